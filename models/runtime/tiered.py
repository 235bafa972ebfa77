"""A batch's KV cache resident or offloaded to host memory, decoded one whole
step per program.

:class:`TieredRunner` runs a loaded :class:`models.api.Model` under its method:

* ``mode="resident"``: every layer's KV on the device (dense or any sparse
  method), the baseline, run the same way as the offloaded mode.
* ``mode="offload"``: the layers the method runs on keep only the device tier
  of :mod:`sparse_jax.offload.tiers` (a pool of blocks, a ring of the newest
  two) and every KV block in ``pinned_host`` memory; the layers the method
  keeps dense stay resident. Any method whose selection names blocks runs
  offloaded (AsyncTLS, as ``method.for_offload()``: the one-step lag; Quest;
  ArkVale); the layer driver calls the same ``select`` as resident decoding.

Decode: one jitted program per step (embedding, every layer through
:class:`models.driver.Driver` unrolled, the head), the cache donated; the
offloaded layers read their host tiers inside it through ``host_gather_into``.
The program is compiled with XLA's concurrent CUDA-graph schedule when
offloading, so each layer's copy of the next step's blocks runs beside its
output projection and MLP.

Prefill (SparseServe's layer-segmented idea): layer ``i``'s K/V is computed,
its device tier built, its blocks handed to ``jax.device_put(...,
pinned_host)`` (an asynchronous copy the next layer's compute overlaps) and
dropped, so device KV memory during prefill is about one layer.

Saving: new tokens accumulate in the ring. When rows complete a block, one
jitted call extracts those rows' ring blocks of every offloaded layer, copies
them device-to-host asynchronously and, one step later, the CPU stores them
into the pinned buffers (SparseServe's CPU-assisted saving). A block is first
read from the host ``bs`` steps after it completes, when it leaves the ring.
The runner tracks lengths on the host, so nothing waits on the device.

Paged host tier (``host_pages=N``): each offloaded layer's host tier is a pool of ``N``
pages of one block (every KV head) shared by the rows, page 0 the null page, and one
block table ``int32[B, max_len / bs]`` for every layer (:mod:`sparse_jax.offload.tiers`),
so host memory holds the blocks that exist, not ``B x max_len``. :class:`HostPages` keeps
the table on the host (the CPU's saves read it) and sends it to the device with the next
step when it changed (the decode program turns a miss's block into its page's id). The
runner assigns the pages itself as rows grow, or a caller does (the serving engine's
block manager: ``HostPages(own=False)``). The device tier is the same as the contiguous
tier's, and so are the numbers.
"""

from __future__ import annotations

import ctypes
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from models import programs
from models import transformer as tfm
from models.api import round_up
from models.driver import Driver, make_plan
from models.runtime import sharding as shd
from models.runtime.tiered_programs import (
    MeshLayout, chunked_layer_kv, decode_fn, embed_fn, extract_block_fn, finish_layer, greedy_fn, head_fn, padded_rows, prefill_chunk_fn, prefill_layer_fn)
from sparse_jax.cache import NULL_PAGE, KVCache
from sparse_jax.methods.base import DenseAttention
from sparse_jax.offload import capacity
from sparse_jax.offload import pool as off
from sparse_jax.offload.tiers import HostLayer, device_sharding, pinned_host_sharding

MODES = ("resident", "offload")
SAVE_MODES = ("deferred", "sync")  # TieredRunner(save=...)
# the offloaded layers' copy kernel grid when it runs beside the MLP (benchmarks/probes/stream_probe.py,
# H100, B=11: 8 programs x 4 entries in flight slowed the MLP least of 4/8/16/32 programs, and
# alone still move the copy at full speed; docs/architecture.md, 'Measured reasons for runtime
# and benchmark choices')
DEFAULT_GATHER_PROGRAMS = 8


class OutOfHostPages(RuntimeError):
    """A row needs a host page and the runner's own pool (``host_pages``) has none left."""


class HostPages:
    """The block table of a paged host tier on the host (see the module docstring):
    ``table int32[B, NB]``, row ``b``'s block ``n`` in page ``table[b, n]`` of every
    offloaded layer's pool (:data:`~sparse_jax.cache.NULL_PAGE` where it holds none; a
    row's pages are a prefix of its table). ``own``: the runner gives each row the pages
    its next position needs before every step, from its own free list; else the caller
    writes the rows (:meth:`set_row`) and the runner only checks that every row it steps
    holds them. ``dirty``: the table changed since it was last sent to the device."""

    def __init__(self, num_pages: int, batch: int, blocks_per_row: int, own: bool = True):
        if isinstance(num_pages, bool) or not isinstance(num_pages, (int, np.integer)) or num_pages < 2:
            raise ValueError(f"host_pages must be an int >= 2 (page 0 is the null page), got {num_pages!r}")
        self.num_pages = int(num_pages)
        self.table = np.full((int(batch), int(blocks_per_row)), NULL_PAGE, np.int32)
        self.free = list(range(self.num_pages - 1, 0, -1)) if own else None  # pop() gives 1, 2, ... first
        self.dirty = True

    @property
    def own(self) -> bool:
        return self.free is not None

    def held(self) -> np.ndarray:
        """``int[B]``: pages each row holds."""
        return (self.table != NULL_PAGE).sum(1)

    def ensure(self, row: int, blocks: int) -> None:
        """(``own``) Give ``row`` pages for its first ``blocks`` blocks; :class:`OutOfHostPages`
        (nothing changed) when the free list is short."""
        blocks = min(int(blocks), self.table.shape[1])
        have = int((self.table[row] != NULL_PAGE).sum())
        if blocks <= have:
            return
        if blocks - have > len(self.free):
            raise OutOfHostPages(f"row {row} needs {blocks - have} more host pages, {len(self.free)} of "
                                 f"{self.num_pages - 1} are free")
        self.table[row, have:blocks] = [self.free.pop() for _ in range(blocks - have)]
        self.dirty = True

    def set_row(self, row: int, pages) -> None:
        self.table[row] = pages
        self.dirty = True


@dataclasses.dataclass
class TieredState:
    """Everything one batch carries between steps (host-side object, not a pytree).

    ``cache``: the :class:`KVCache` whose entries are :class:`LayerCache`
    (resident) or :class:`OffloadedLayer` (device tier); ``host[i]``: the
    layer's :class:`HostLayer` (offloaded layers) or None; ``lengths_host``:
    the NumPy mirror of ``cache.lengths``.
    """

    cache: KVCache
    host: tuple
    lengths_host: np.ndarray
    max_len: int
    pending: list = dataclasses.field(default_factory=list)  # saves not yet stored on the host
    counters: list = dataclasses.field(default_factory=list)  # per step: [(hits, misses) per offloaded layer]
    #: keep each step's block counters in ``counters`` (``transfer_stats``). Keeping them
    #: holds two small device buffers per layer and step alive, so the next step's outputs
    #: land at new addresses and XLA updates the step's whole CUDA graph on the host
    #: (``command_buffer::update``, milliseconds a step: docs/offload.md, 'Where the host time
    #: goes'): a timed loop
    #: turns it off.
    record_transfers: bool = True
    host_views: dict = dataclasses.field(default_factory=dict)  # layer -> (K, V) NumPy views of its host tier
    #: a paged host tier's block table (``TieredRunner(host_pages=N)``); None: contiguous
    pages: HostPages | None = None


def _host_view(x: jax.Array) -> np.ndarray:
    """A writable NumPy view of a ``pinned_host`` jax Array's buffer (its own memory).

    JAX arrays are immutable; the host tier is the one place we write behind
    JAX's back (the CPU half of SparseServe's saving), always to blocks no
    kernel reads until a later step."""
    if x.sharding.memory_kind != "pinned_host":
        raise ValueError(f"expected a pinned_host array, got memory kind {x.sharding.memory_kind!r}")
    # the array may still be filling (device_put to pinned_host is asynchronous):
    # a store racing that copy would be overwritten by it
    x.block_until_ready()
    dt = np.dtype(x.dtype)
    n = x.size * dt.itemsize
    buf = (ctypes.c_char * n).from_address(x.unsafe_buffer_pointer())
    return np.frombuffer(buf, dtype=np.uint8).view(dt).reshape(x.shape)


class TieredRunner:
    """Resident or offloaded prefill/decode of ``model`` (see the module docstring).

    Args:
      model: a :class:`models.api.Model`; its method is used (offloaded:
        ``method.for_offload()``).
      mode: "resident" or "offload".
      pool: "per_row" (default: a pool of ``pool_slots`` block slots per (row, KV
        head) of an offloaded layer, which no other row touches) or "shared" (one pool
        of ``pool_slots`` slots per (layer, KV head) for every row of the batch, LRU
        across rows: a row's misses may evict another row's blocks; see
        ``docs/offload.md``). Not on a mesh yet.
      pool_slots: per_row: resident block slots per (row, KV head) (default
        :func:`sparse_jax.offload.pool.default_pool_slots`: twice the blocks one step
        reads; that smallest pool is allowed). shared: slots per (layer, KV head)
        (default: the batch times the per-row default, the same device bytes); it must
        hold one step of every row decoding at once (``rows x blocks per step``:
        :func:`~sparse_jax.offload.pool.check_shared_fits`, checked before any step).
      sharding: where the tiers live (a :class:`jax.sharding.Sharding`; its
        memory kind is replaced by ``device`` / ``pinned_host``). Default: the
        first device.
      device_limit, host_limit: bytes the capacity check allows ("auto": measured
        when checked, see :mod:`sparse_jax.offload.capacity`; None: unchecked).
        Measure the host limit once, before the first pinned allocation.
      concurrent: compile the decode program with XLA's concurrent CUDA-graph
        schedule (``xla_gpu_command_buffer_scheduling_mode=CONCURRENT``: kernels
        with no data dependence may run at once), so an offloaded layer's host
        copy runs beside its output projection and MLP. Default: on for
        ``mode="offload"``. GPU only (ignored elsewhere).
      gather_programs: grid of the offloaded layers' copy kernels; default 8 when
        ``concurrent``, else one program per block.
      unroll: the layer driver's segments unrolled (default: on the GPU, where the
        scan's per-layer cache copies cost step time; offloaded layers always).
      save: how the blocks a step completes reach the host tier. "deferred" (default,
        SparseServe's FlashD2H): one device-to-host copy of all of them, started after
        the step is issued, and stored into the host blocks by the CPU at the next
        step, while the device computes; "sync": the same copy, waited for and stored
        within the step (the host cannot issue the next step until this one is done:
        the baseline FlashD2H is measured against). The same numbers.
      host_pages: offloaded: the host tier as a pool of this many pages of one block (page 0
        the null page) per offloaded layer, shared by the rows through a block table
        (:class:`HostPages`; module docstring), not ``batch x max_len`` blocks. None (default):
        the contiguous tier ``[B, Hkv, NB, bs, D]``. One device (not on a mesh yet).
    """

    def __init__(self, model, mode: str = "resident", *, pool_slots: int | None = None, pool: str = "per_row",
                 sharding=None,
                 concurrent: bool | None = None, gather_programs: int | None = None, unroll: bool | None = None,
                 device_limit="auto", host_limit="auto", save: str = "deferred", host_pages: int | None = None):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if save not in SAVE_MODES:
            raise ValueError(f"save must be one of {SAVE_MODES}, got {save!r}")
        self.save = save
        self.model = model
        self.cfg = model.config
        self.mode = mode
        method = model.method.for_offload() if mode == "offload" else model.method
        self.method = method
        if pool_slots is not None and (isinstance(pool_slots, bool) or not isinstance(pool_slots, int)
                                       or pool_slots < 1):
            raise ValueError(f"pool_slots must be a positive int or None, got {pool_slots!r}")
        self.pool_slots = pool_slots
        self.pool = off.check_pool(pool)
        self.shared = mode == "offload" and pool == "shared"
        self.sharding = sharding
        self.concurrent = (mode == "offload") if concurrent is None else bool(concurrent)
        if gather_programs is not None and (isinstance(gather_programs, bool) or not isinstance(gather_programs, int)
                                            or gather_programs < 1):
            raise ValueError(f"gather_programs must be a positive int or None, got {gather_programs!r}")
        self.gather_programs = (DEFAULT_GATHER_PROGRAMS if self.concurrent else None) if gather_programs is None \
            else gather_programs
        self.unroll = programs.default_unroll() if unroll is None else bool(unroll)
        self.device_limit, self.host_limit = device_limit, host_limit
        self.plan = make_plan(self.cfg, method)
        if mode == "offload":
            off.check_offloadable(method)
            # only the method's layers are offloaded, and a method runs on global layers
            # only: local layers (sliding-window rings, Gemma 3) stay resident
            if any(sp.sparse and sp.kind != "global" for sp in self.plan.specs):
                raise ValueError("only global layers can be offloaded")
        self.num_layers = self.cfg.num_layers
        self.offloaded = [mode == "offload" and sp.sparse for sp in self.plan.specs]
        self.offloaded_layers = [i for i, o in enumerate(self.offloaded) if o]
        # a sharded model (models.runtime.sharding.ShardedModel): every piece runs as one shard_map on
        # its mesh, each device on its KV heads and rows; the host tiers split the same way
        self.mesh = getattr(model, "mesh", None)
        self.local_cfg, tp = self.cfg, {}
        if self.mesh is not None:
            if sharding is not None:
                raise ValueError("a sharded model's tiers follow its mesh: do not pass sharding=")
            if self.shared:
                raise ValueError('pool="shared" does not run on a mesh yet (the shared pool has no row axis to '
                                 'split by data replicas): use pool="per_row"')
            self.par = shd.Parallelism.of(self.mesh)
            shd.check_method(method, self.par.model, self.par.size)
            self.local_cfg = shd.local_config(self.cfg, self.par.model)
            tp = dict(tp_axis=shd.MODEL, tp_size=self.par.model)
            self._param_specs = shd.param_specs(model.params)
            self._local_graphdef = tfm.abstract_model(self.local_cfg, model.dtype)[0]
            self._layouts = {}  # (batch, max_len) -> MeshLayout
        if host_pages is not None:
            if isinstance(host_pages, bool) or not isinstance(host_pages, (int, np.integer)) or host_pages < 2:
                raise ValueError(f"host_pages must be an int >= 2 (page 0 is the null page), got {host_pages!r}")
            if mode != "offload":
                raise ValueError('host_pages pages the offloaded host tier: pass mode="offload"')
            if self.mesh is not None:
                raise ValueError("a paged host tier does not run on a mesh yet: drop host_pages")
        self.host_pages = None if host_pages is None else int(host_pages)
        self.layer_graph = tfm.layer_graphdef(self.local_cfg, model.dtype)
        self.driver = Driver(self.local_cfg, method, self.layer_graph, self.unroll, **tp)
        self._conc = self.concurrent and jax.default_backend() == "gpu"
        self._decode = None if self.mesh is not None else decode_fn(model.graphdef, self.driver,
                                                                      self.gather_programs, self._conc)
        self._embed = embed_fn(model.graphdef)
        self._head = head_fn(model.graphdef)

    # -- helpers -----------------------------------------------------------------
    def _pool(self, max_len: int, batch: int | None = None) -> int:
        """Pool slots of an offloaded layer: per (row, KV head), or with a shared pool per
        KV head for the whole batch (its default needs ``batch``)."""
        if self.mode != "offload":
            return 0
        p = off.default_pool_slots(self.method, max_len) if self.pool_slots is None else int(self.pool_slots)
        if self.shared and self.pool_slots is None:
            if batch is None:
                raise ValueError("the default shared pool is sized by the batch: pass batch")
            p *= int(batch)
        off.check_offload(self.method, p, max_len)
        return p

    def layer_data(self, i: int) -> dict:
        """Layer ``i``'s constants as the driver passes them (``"index"`` and the
        method's ``layer_data`` on its layers)."""
        d = {"index": jnp.int32(i)}
        if self.plan.specs[i].sparse:
            d.update({k: jnp.asarray(v) for k, v in (self.method.layer_data(i) or {}).items()})
        return d

    def _layout(self, batch: int, max_len: int) -> "MeshLayout":
        """The mesh layout of a batch (sharded model only), built once per shape."""
        key = (int(batch), int(max_len))
        if key not in self._layouts:
            self._layouts[key] = MeshLayout(self, *key)
        return self._layouts[key]

    def footprint(self, batch: int, max_len: int) -> capacity.Footprint:
        """Device and host bytes of a batch (see :mod:`sparse_jax.offload.capacity`); on a
        mesh, the device bytes are one device's (its KV heads' share of the weights and
        caches, its replica's rows) and the host bytes the whole host tier."""
        mode = self.mode if self.mode == "offload" else (
            "dense" if isinstance(self.method, DenseAttention) else "sparse")

        def fp(cfg, b):
            return capacity.footprint(cfg, self.method, batch=b, max_len=max_len, mode=mode,
                                      dtype_bytes=jnp.dtype(self.model.dtype).itemsize,
                                      pool_slots=self._pool(max_len, batch) if self.mode == "offload" else None,
                                      shared=self.shared, host_pages=self.host_pages)

        whole = fp(self.cfg, batch)
        if self.mesh is None:
            return whole
        return capacity.Footprint(device=fp(self.local_cfg, -(-batch // self.par.data)).device, host=whole.host)

    def check_capacity(self, batch: int, max_len: int, *, device_limit=None, host_limit=None,
                       prefill_temp_bytes: int = 0, autotune_scratch: int = 0):
        """Raise :class:`~sparse_jax.offload.capacity.CapacityError` before allocating
        when the batch does not fit (limits: the runner's unless given here).
        ``prefill_temp_bytes``: a prompt's prefill temporaries on top of the batch
        (:meth:`prefill_temp_bytes`; a serving engine prefills beside its batch).
        ``autotune_scratch``: what XLA's GEMM autotuner claims compiling a program after the
        batch exists (:func:`~sparse_jax.offload.capacity.autotune_scratch_bytes`)."""
        device_limit = self.device_limit if device_limit is None else device_limit
        host_limit = self.host_limit if host_limit is None else host_limit
        dl = capacity.device_budget() if device_limit == "auto" else device_limit
        hl = capacity.host_budget() if host_limit == "auto" else host_limit
        fp = self.footprint(batch, max_len)
        extra = {k: int(v) for k, v in (("prefill_temporaries", prefill_temp_bytes),
                                         ("autotune_scratch", autotune_scratch)) if v}
        if extra:
            fp = capacity.Footprint({**fp.device, **extra}, fp.host)
        capacity.check_fits(fp, device_limit=dl, host_limit=hl, what=f"{self.mode} batch of {batch} x {max_len} tokens")

    def prefill_temp_bytes(self, tokens: int, max_len: int) -> int:
        """The largest temporaries, over the layer kinds, of one layer's prefill program for
        a one-row prompt of ``tokens`` tokens, as XLA's buffer assignment reports them
        (``memory_analysis``; 0 where the backend reports none, and on a mesh). The programs
        are compiled ahead of time from shapes, before the caller allocates, so the GEMM
        autotuner finds the device free; a prefill of that length then reuses them (the
        hidden state's shape carries the device placement the embedding's output has: jit's
        cache tells a committed argument from an unplaced one). A chunked layer's programs
        (fewer queries) hold less."""
        if self.mesh is not None:
            return 0
        max_len = round_up(int(max_len), self.method.cache_multiple)
        params = self.model.params
        x = jax.eval_shape(self._embed, params, jax.ShapeDtypeStruct((1, int(tokens)), jnp.int32))
        leaf = jax.tree.leaves(params)[0]  # the embedding's output is placed as the weights are
        x = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=leaf.sharding if getattr(leaf, "committed", False) else None)
        lengths = jax.ShapeDtypeStruct((1,), jnp.int32)
        carry = self.method.init_prefill_carry(batch=1, num_kv_heads=self.local_cfg.num_kv_heads, length=int(tokens))
        most, seen = 0, set()
        for i, spec in enumerate(self.plan.specs):
            if spec in seen:
                continue
            seen.add(spec)
            fn = prefill_layer_fn(self.driver, spec, max_len)
            stats = fn.lower(params["layers"], x, lengths, self.layer_data(i), carry).compile().memory_analysis()
            most = max(most, int(getattr(stats, "temp_size_in_bytes", 0) or 0))
        return most

    # -- building the state --------------------------------------------------------
    def state_from_kv(self, kv_of_layer, lengths, max_len: int, pages: HostPages | None = None) -> TieredState:
        """The state of a batch whose layer ``i`` K/V is ``kv_of_layer(i) -> (k, v,
        q_last)`` (device ``[B,Hkv,S,D]`` x2, ``[B,Hq,D]``): used by :meth:`prefill`
        and by benchmarks that fill the cache with synthetic K/V. Each layer's
        device K/V is dropped before the next is made (about one layer at a time).
        ``pages``: a paged host tier's table kept by the caller (default: the runner's own);
        only blocks with a page are stored."""
        build = _StateBuilder(self, lengths, max_len, pages)
        for i in range(self.num_layers):
            build.add(i, *kv_of_layer(i))
        return build.finish()

    def _compile_save(self, cache: KVCache, batch: int):
        """Compile the block extraction for every padded row count of this batch
        now, not in the middle of decoding (one small call each, results dropped)."""
        if not self.offloaded_layers:
            return
        tiers = tuple(cache.layers[i] for i in self.offloaded_layers)
        fn = extract_block_fn()
        for m in (1 << k for k in range(padded_rows(batch).bit_length())):
            fn(tiers, jnp.zeros((m,), jnp.int32), jnp.full((m,), tiers[0].pool_slots, jnp.int32))

    def prefill(self, tokens, lengths, max_len: int | None = None):
        """Prefill right-padded ``tokens int32[B, T]``, layer by layer. Returns the
        f32 logits ``[B, V]`` at each row's last token and the :class:`TieredState`."""
        job = self.start_prefill(tokens, lengths, max_len)
        job.advance(self.num_layers)
        return job.result()

    def start_prefill(self, tokens, lengths, max_len: int | None = None, pages: HostPages | None = None,
                      into: tuple | None = None) -> "PrefillJob":
        """A prefill that runs a few layers at a time (:class:`PrefillJob`): the serving
        engine's layer-segmented prefill, interleaved with decode steps. Paged host tier:
        ``pages`` the prompts' table (default: the runner's own pages), ``into`` another
        state's host tiers (``state.host``) whose page pools take the prompts' blocks (a
        serving engine's: the prompt's blocks go straight to its pages, no host tier of its
        own)."""
        return PrefillJob(self, tokens, lengths, max_len, pages=pages, into=into)

    # -- decode --------------------------------------------------------------------
    def decode_step(self, tokens, state: TieredState, active=None):
        """One token per row: f32 logits ``[B, V]``; ``state`` is updated in place
        (its device buffers are donated to the step). ``active`` (``bool[B]``, optional;
        the serving engine's free slots): rows outside it keep their length and save
        no block (what the step wrote for them is garbage, overwritten on insertion)."""
        live = np.ones(state.lengths_host.shape, bool) if active is None else np.asarray(active, bool)
        if live.any() and int(state.lengths_host[live].max()) >= state.max_len:
            raise ValueError(f"the cache is full ({state.max_len} tokens)")
        decode = self._decode if self.mesh is None else self._layout(*state.lengths_host.shape, state.max_len).decode
        # placed like the step's own outputs: a first token taken from the prefill's logits
        # (uncommitted) and the next ones from a step's (committed) would compile the step twice
        tokens = jax.device_put(jnp.asarray(tokens, jnp.int32), state.cache.lengths.sharding)
        self._sync_pages(state, live)
        if self.shared:  # the rows that place blocks must fit the pool together (checked here, on the host)
            off.check_shared_fits(self.method, state.cache.layers[self.offloaded_layers[0]].pool_slots,
                                  state.max_len, int(live.sum()))
            logits, state.cache = decode(self.model.params, tokens, state.cache, state.host,
                                         jnp.asarray(live.copy()))
        else:
            logits, state.cache = decode(self.model.params, tokens, state.cache, state.host)
        self._after_step(state, live, active is not None)
        return logits

    def _sync_pages(self, state: TieredState, live) -> None:
        """A paged host tier before a step: every ``live`` row holds the pages of its blocks up
        to the position the step writes (the runner's own pages given now; a caller's checked:
        ValueError, before anything runs), and the table goes to the device if it changed."""
        p = state.pages
        if p is None:
            return
        bs = self.method.offload_block_size
        need = state.lengths_host // bs + 1
        if p.own:
            for row in np.flatnonzero(live):
                p.ensure(int(row), int(need[row]))
        else:
            short = np.flatnonzero(np.asarray(live, bool) & (p.held() < need))
            if short.size:
                raise ValueError(f"rows {short.tolist()} step without the host pages of their blocks (they hold "
                                 f"{p.held()[short].tolist()}, need {need[short].tolist()})")
        if p.dirty:  # a copy: the host table changes while the step is queued
            table = jax.device_put(jnp.asarray(p.table.copy()), state.cache.lengths.sharding)
            state.host = tuple(None if h is None else dataclasses.replace(h, table=table) for h in state.host)
            p.dirty = False

    def _after_step(self, state: TieredState, live, masked: bool):
        """A step's host bookkeeping: lengths, block counters and the saves of completed blocks."""
        state.lengths_host = state.lengths_host + live
        if masked:
            # placed like the program's own output: an uncommitted array would compile the step again
            lengths = jax.device_put(state.lengths_host.astype(np.int32), state.cache.lengths.sharding)
            state.cache = dataclasses.replace(state.cache, lengths=lengths)
        if self.offloaded_layers and state.record_transfers:
            state.counters.append([(state.cache.layers[i].hits, state.cache.layers[i].misses)
                                   for i in self.offloaded_layers])
        self._store_pending(state)  # last step's completed blocks (that step is done or nearly)
        self._start_save(state, live)
        if self.save == "sync":
            self._store_pending(state)  # waits for this step, then stores its blocks

    def greedy_steps(self, tokens, state: TieredState, n: int):
        """``n`` greedy steps of every row, each step's argmax fed to the next on the device:
        ``(logits f32[B, V], tokens int32[B])`` of the last step. The tokens and logits live
        in buffers donated to each step and written back in place, so every step runs with
        the same buffer addresses: XLA then has no reason to update the step's CUDA graph
        (it does when any buffer its commands use moved, and :meth:`decode_step`'s tokens and
        logits are new arrays each step). The same tokens as :meth:`decode_step` with
        ``argmax`` between steps. Per-row pools, one device (a probe of the step's host cost)."""
        if self.shared or self.mesh is not None:
            raise ValueError("greedy_steps runs per-row pools on one device")
        if int(state.lengths_host.max()) + n > state.max_len:
            raise ValueError(f"{n} steps overrun the cache ({state.max_len} tokens)")
        fn = greedy_fn(self.model.graphdef, self.driver, self.gather_programs, self._conc)
        live = np.ones(state.lengths_host.shape, bool)
        # donated: never the caller's array; placed like the step's outputs, which come back as the
        # next step's io (uncommitted arrays would compile the step a second time)
        io = jax.device_put({"tokens": jnp.array(tokens, jnp.int32, copy=True),
                             "logits": jnp.zeros((len(live), self.cfg.vocab_size), jnp.float32)},
                            state.cache.lengths.sharding)
        for _ in range(int(n)):
            self._sync_pages(state, live)
            io, state.cache = fn(self.model.params, io, state.cache, state.host)
            self._after_step(state, live, False)
        return io["logits"], io["tokens"]

    def _start_save(self, state: TieredState, live=None):
        """Copy the blocks completed by this step to the host (asynchronously): one
        jitted call and one device-to-host copy for all (``live``) rows that completed one."""
        if not self.offloaded_layers:
            return
        idx = self.offloaded_layers
        bs = state.cache.layers[idx[0]].block_size
        done = state.lengths_host % bs == 0
        rows = np.nonzero(done if live is None else done & live)[0]
        if not rows.size:
            return
        tier = state.cache.layers[idx[0]]
        blocks = state.lengths_host[rows] // bs - 1
        # the ring slot that holds each row's completed block (a shared pool: each row's own two)
        ring = tier.pool_slots + (off.RING_SLOTS * rows if tier.shared else 0) + blocks % off.RING_SLOTS
        # pad the lists to a power of two (repeating their last entry): few compilations
        pad = padded_rows(rows.size) - rows.size
        ks, vs = extract_block_fn()(tuple(state.cache.layers[i] for i in idx),
                                     jnp.asarray(np.pad(rows, (0, pad), mode="edge").astype(np.int32)),
                                     jnp.asarray(np.pad(ring, (0, pad), mode="edge").astype(np.int32)))
        ks.copy_to_host_async()
        vs.copy_to_host_async()
        state.pending.append((rows, blocks, idx, ks, vs))

    def _views(self, state: TieredState, i: int):
        """NumPy views of layer ``i``'s host tier, made once per state: per shard (one
        on one device; on a mesh, each device's rows x KV heads), ``(row range, head
        range, k view, v view)``."""
        if i not in state.host_views:
            h = state.host[i]
            b, hkv = h.k.shape[:2]
            views = []
            for sk, sv in zip(h.k.addressable_shards, h.v.addressable_shards):
                rows, heads = (sk.index + (slice(None),) * 2)[:2]
                views.append((range(*rows.indices(b)), range(*heads.indices(hkv)),
                              _host_view(sk.data), _host_view(sv.data)))
            state.host_views[i] = views
        return state.host_views[i]

    def _store_pending(self, state: TieredState):
        while state.pending:
            rows, blocks, idx, ks, vs = state.pending.pop(0)
            m = rows.size
            ks, vs = np.asarray(ks)[:, :m], np.asarray(vs)[:, :m]  # [n_layers, m, Hkv, bs, D]
            if state.pages is not None:
                # each block to its page, as the table says now: a row that ended since (its pages freed,
                # its row the null page) stores nothing; pending saves land before any insertion
                pages = state.pages.table[rows, blocks]
                ok = pages != NULL_PAGE
                for j, i in enumerate(idx):
                    (_, _, kview, vview), = self._views(state, i)  # [N, Hkv, bs, D]
                    kview[pages[ok]] = ks[j][ok]
                    vview[pages[ok]] = vs[j][ok]
                continue
            for j, i in enumerate(idx):
                for row_range, head_range, kview, vview in self._views(state, i):  # [B', Hkv', NB, bs, D]
                    mine = (rows >= row_range.start) & (rows < row_range.stop)
                    if not mine.any():
                        continue
                    r = (rows[mine] - row_range.start)[:, None]
                    h = np.arange(len(head_range))[None, :]
                    hs = slice(head_range.start, head_range.stop)
                    kview[r, h, blocks[mine][:, None]] = ks[j][mine][:, hs]
                    vview[r, h, blocks[mine][:, None]] = vs[j][mine][:, hs]

    def finish(self, state: TieredState):
        """Store the outstanding saves (call before reading the host tier)."""
        self._store_pending(state)

    def transfer_stats(self, state: TieredState) -> dict:
        """Hits, misses and bytes moved per decode step (offloaded layers summed)."""
        if not state.counters:
            return {"steps": 0}
        # per step and offloaded layer: (hits, misses), each int32[B, Hkv]
        arr = np.asarray(jax.device_get([[list(c) for c in s] for s in state.counters]), np.int64)
        arr = arr.reshape(arr.shape[:3] + (-1,)).sum(-1)  # [T, L, 2]
        hits, misses = arr[..., 0].sum(1), arr[..., 1].sum(1)
        d = self.cfg.head_dim
        block_bytes = 2 * self.method.offload_block_size * d * jnp.dtype(self.model.dtype).itemsize
        return {
            "steps": int(arr.shape[0]),
            "hits_per_step": hits.tolist(), "misses_per_step": misses.tolist(),
            "hit_rate": float(hits.sum() / max(hits.sum() + misses.sum(), 1)),
            "bytes_per_step": (misses * block_bytes).tolist(),
            "mean_bytes_per_step": float(misses.mean() * block_bytes),
        }

    def generate_ids(self, tokens, lengths, steps: int, max_len: int | None = None):
        """Greedy ``steps`` tokens per row: ``(ids int32[B, steps], logits f32[B, steps, V], state)``."""
        logits, state = self.prefill(tokens, lengths, max_len)
        out, all_logits = [], []
        for _ in range(steps):
            nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            out.append(nxt)
            all_logits.append(logits)
            logits = self.decode_step(nxt, state)
        self.finish(state)
        return jnp.stack(out, 1), jnp.stack(all_logits, 1), state


# -----------------------------------------------------------------------------
# The jitted pieces (cached by their static arguments)
# -----------------------------------------------------------------------------


class _StateBuilder:
    """A :class:`TieredState` made one layer at a time: each layer's device K/V becomes
    its device tier (pool, ring, method state) and, for an offloaded layer, a host tier
    (asynchronous copies to pinned memory), and is then dropped."""

    def __init__(self, runner: TieredRunner, lengths, max_len: int, pages: HostPages | None = None,
                 into: tuple | None = None):
        lengths_np = np.asarray(lengths, np.int32).copy()
        lengths = jnp.asarray(lengths_np)
        batch = int(lengths.shape[0])
        self.runner, self.max_len = runner, max_len
        self.pool = runner._pool(max_len, batch)
        runner.check_capacity(batch, max_len)
        self.layout = runner._layout(batch, max_len) if runner.mesh is not None else None
        if self.layout is None:
            self.dev, self.pinned = device_sharding(runner.sharding), pinned_host_sharding(runner.sharding)
        else:
            self.dev, self.pinned = self.layout.rows, self.layout.host_tier
            lengths = jax.device_put(lengths, self.dev)
        self.lengths = lengths
        self.layers, self.host = [], []
        self.pages, self._page_saves, self.into = None, [], None
        if into is not None and runner.host_pages is None:
            raise ValueError("into= is a paged host tier's: the runner has no host_pages")
        if runner.host_pages is not None:
            bs = runner.method.offload_block_size
            if pages is None:
                pages = HostPages(runner.host_pages, batch, max_len // bs, own=True)
                for row in range(batch):  # the prompt's blocks and the first step's position
                    pages.ensure(row, int(lengths_np[row]) // bs + 1)
            if pages.table.shape != (batch, max_len // bs) or pages.num_pages != runner.host_pages:
                raise ValueError(f"a host page table of {pages.table.shape} over {pages.num_pages} pages for a batch "
                                 f"of {batch} x {max_len // bs} blocks over {runner.host_pages}")
            self.pages = pages
            if into is not None and (pages.own or len(into) != runner.num_layers):
                raise ValueError("into= writes a caller's page pools: pass the caller's table (pages, own=False) "
                                 "and one host tier per layer")
            self.into = into
            # the (row, block, page) of every block the prompts filled that has a page
            filled = -(-lengths_np // bs)
            rows, blocks = np.nonzero(np.arange(max_len // bs)[None] < filled[:, None])
            at = pages.table[rows, blocks]
            keep = at != NULL_PAGE
            self._filled = rows[keep], blocks[keep], at[keep]

    def add(self, i: int, k, v, q_last) -> None:
        r = self.runner
        assert i == len(self.layers), (i, len(self.layers))
        spec = r.plan.specs[i]
        m = r.method if spec.sparse else None
        finish = (finish_layer(m, spec, r.offloaded[i], self.pool, r.shared) if self.layout is None
                  else self.layout.finish[i])
        entry, hk, hv = finish(k, v, self.lengths, q_last, r.layer_data(i))
        del k, v
        # committed to the device, as the decode program's outputs are (the host tier is):
        # an uncommitted first state would compile the decode program a second time
        # (a shard_map's outputs are committed to the mesh already)
        self.layers.append(jax.device_put(entry, self.dev) if self.layout is None else entry)
        if r.offloaded[i] and self.pages is not None:
            self.host.append(self._paged_host(i, hk, hv))
        else:
            self.host.append(HostLayer(jax.device_put(hk, self.pinned), jax.device_put(hv, self.pinned))  # async D2H
                             if r.offloaded[i] else None)

    def _paged_host(self, i: int, hk, hv) -> HostLayer:
        """Layer ``i``'s page pools ``[N, Hkv, bs, D]`` in pinned host memory (zeros put from the
        host: nothing of the pool's size on the device; or ``into``'s), and its prompt blocks
        gathered on the device and copied to the host asynchronously, stored into their pages by
        :meth:`finish`."""
        _, hkv, _, bs, d = hk.shape
        shape = (self.pages.num_pages, hkv, bs, d)
        if self.into is not None:
            pk, pv = self.into[i].k, self.into[i].v
            if pk.shape != shape or pk.dtype != hk.dtype:
                raise ValueError(f"layer {i}: page pools {pk.shape} {pk.dtype}, the prompt's pages are {shape} "
                                 f"{hk.dtype}")
        else:
            # zeros from the host, one layer's pool at a time (waited for: at most one layer's NumPy
            # zeros alive beside the pinned pools; nothing of the pool's size on the device)
            pk, pv = (jax.block_until_ready(jax.device_put(np.zeros(shape, hk.dtype), self.pinned))
                      for _ in range(2))
        rows, blocks, pages = self._filled
        if rows.size:
            # the lists padded to a power of two (their last entry repeated): few compilations of the gather
            pad = padded_rows(rows.size) - rows.size
            rows, blocks = (jnp.asarray(np.pad(a, (0, pad), mode="edge").astype(np.int32)) for a in (rows, blocks))
            ks, vs = hk[rows, :, blocks], hv[rows, :, blocks]  # [n + pad, Hkv, bs, D]
            ks.copy_to_host_async()
            vs.copy_to_host_async()
            self._page_saves.append((pk, pv, pages, ks, vs))
        return HostLayer(pk, pv)

    def finish(self) -> TieredState:
        r = self.runner
        assert len(self.layers) == r.num_layers
        cache = KVCache(tuple(self.layers), jax.device_put(self.lengths, self.dev), self.max_len)
        r._compile_save(cache, int(self.lengths.shape[0]))
        host = tuple(self.host)
        if self.pages is not None:
            for pk, pv, pages, ks, vs in self._page_saves:
                _host_view(pk)[pages] = np.asarray(ks)[:pages.size]
                _host_view(pv)[pages] = np.asarray(vs)[:pages.size]
            self._page_saves = []
            table = jax.device_put(jnp.asarray(self.pages.table.copy()), self.dev)
            host = tuple(None if h is None else dataclasses.replace(h, table=table) for h in host)
            self.pages.dirty = False
        return TieredState(cache, host, np.asarray(self.lengths).copy(), self.max_len, pages=self.pages)


class PrefillJob:
    """A layer-by-layer prefill that can stop between layers (SparseServe's
    layer-segmented prefill, §3.4): :meth:`advance` runs the next layers, each
    layer's K/V goes to its tiers (the host, for an offloaded layer) and is freed
    before the next, so the device holds one layer of the prompt's KV at a time; a
    serving engine runs a decode step between segments. The programs, and so the
    numbers, are those of :meth:`TieredRunner.prefill`."""

    def __init__(self, runner: TieredRunner, tokens, lengths, max_len: int | None = None,
                 pages: HostPages | None = None, into: tuple | None = None):
        max_len = round_up(int(max_len or runner.model.max_len), runner.method.cache_multiple)
        tokens = jnp.asarray(tokens, jnp.int32)
        lengths = jnp.asarray(lengths, jnp.int32)
        b, t = tokens.shape
        if t >= max_len:
            raise ValueError(f"prompt of {t} tokens leaves no room in a cache of {max_len}")
        self.runner, self.max_len, self.lengths, self.batch = runner, max_len, lengths, b
        if runner.shared:  # every row of this batch decodes: one step of all of them must fit the pool
            off.check_shared_fits(runner.method, runner._pool(max_len, b), max_len, b)
        self.tokens = t
        self.x = runner._embed(runner.model.params, tokens)
        self.carry = runner.method.init_prefill_carry(batch=b, num_kv_heads=runner.local_cfg.num_kv_heads, length=t)
        if self.carry is not None and runner.mesh is not None:
            raise ValueError(f"{runner.method.name}: a prefill carry across layers (Kascade's tiled prefill) is not "
                             f"supported by the layer-by-layer prefill on a mesh yet")
        self.build = _StateBuilder(runner, lengths, max_len, pages, into)
        self.layers_done = 0
        self._result = None
        #: chunked prefill of a layer over budget: the chunk size (fixed at the first
        #: over-budget call), the tokens of the current layer done, its K/V so far
        self.chunk: int | None = None
        self.chunk_pos = 0
        self._partial = None  # (kbuf, vbuf, q_last) of the layer in progress
        self.chunks_run = 0

    @property
    def done(self) -> bool:
        return self.layers_done == self.runner.num_layers

    def advance_budget(self, tokens: int) -> bool:
        """Run the next segment within ``tokens`` (prompt tokens x layers; SparseServe's
        ``max_inject_tokens``): ``tokens // T`` whole layers when one layer fits, else
        chunks of the current layer (``tokens`` rounded down to a multiple of 64, at least
        64, fixed by the first such call), each chunk's queries attending the keys of the
        chunks before it. A layer whose prompt attention cannot be chunked (Token Sparse
        Attention, a method's prefill hook, a mesh) runs whole. Returns :attr:`done`."""
        tokens = max(1, int(tokens))
        if self.tokens <= tokens and self._partial is None:
            return self.advance(tokens // self.tokens)
        r = self.runner
        i = self.layers_done
        if r.mesh is not None or not r.driver.chunkable(r.plan.specs[i]):
            return self.advance(1)
        if self.chunk is None:
            self.chunk = max(64, tokens // 64 * 64)
        spent = 0  # at least one chunk; then chunks while the budget lasts, into chunkable layers
        while not self.done and r.driver.chunkable(r.plan.specs[self.layers_done]):
            c = min(self.chunk, self.tokens - self.chunk_pos)
            if spent and spent + c > tokens:
                break
            self._run_chunk(self.chunk_pos, c)
            spent += c
        return self.done

    def _run_chunk(self, start: int, size: int) -> None:
        """Prompt positions ``start .. start + size - 1`` of the current layer; after the
        layer's last chunk its K/V go to the tiers as a whole layer's do."""
        r, params = self.runner, self.runner.model.params
        i = self.layers_done
        spec = r.plan.specs[i]
        if self._partial is None:
            b, t = self.batch, self.tokens
            kv_shape = (b, t, r.local_cfg.num_kv_heads, r.local_cfg.head_dim)
            self._partial = (jnp.zeros(kv_shape, self.x.dtype), jnp.zeros(kv_shape, self.x.dtype),
                             jnp.zeros((b, r.local_cfg.num_heads, r.local_cfg.head_dim), self.x.dtype))
        kbuf, vbuf, q_last = self._partial
        fn = prefill_chunk_fn(r.driver, spec, size)
        self.x, kbuf, vbuf, q_last = fn(params["layers"], self.x, jnp.int32(start), kbuf, vbuf, q_last,
                                        self.lengths, r.layer_data(i))
        self.chunks_run += 1
        self.chunk_pos = start + size
        if self.chunk_pos < self.tokens:
            self._partial = (kbuf, vbuf, q_last)
            return
        k, v = chunked_layer_kv(spec, self.max_len)(kbuf, vbuf, self.lengths)
        del kbuf, vbuf
        self._partial, self.chunk_pos = None, 0
        self.build.add(i, k, v, q_last)
        self.layers_done = i + 1

    def advance(self, layers: int) -> bool:
        """Run up to ``layers`` more layers (at least one); returns :attr:`done`."""
        if self._partial is not None:
            raise RuntimeError("a layer is half done in chunks: continue it with advance_budget")
        r, params = self.runner, self.runner.model.params
        stop = min(r.num_layers, self.layers_done + max(1, int(layers)))
        for i in range(self.layers_done, stop):
            if r.mesh is None:
                fn = prefill_layer_fn(r.driver, r.plan.specs[i], self.max_len)
                self.x, k, v, q_last, self.carry = fn(params["layers"], self.x, self.lengths, r.layer_data(i),
                                                      self.carry)
            else:
                fn = r._layout(self.batch, self.max_len).prompt[i]
                self.x, k, v, q_last = fn(params["layers"], self.x, self.lengths, r.layer_data(i))
            self.build.add(i, k, v, q_last)
            del k, v
            self.layers_done = i + 1
        return self.done

    def result(self):
        """``(logits f32[B, V], TieredState)`` once :attr:`done`."""
        if not self.done:
            raise RuntimeError(f"the prefill ran {self.layers_done} of {self.runner.num_layers} layers")
        if self._result is None:
            r = self.runner
            self._result = (r._head(r.model.params, tfm.last_valid(self.x, self.lengths)), self.build.finish())
            self.x = None
        return self._result
