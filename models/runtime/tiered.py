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

The state between steps and the host page table are in :mod:`models.runtime.tiered_state`,
the layer-by-layer prefill in :mod:`models.runtime.tiered_prefill`, the jitted pieces in
:mod:`models.runtime.tiered_programs`; their names are importable from here as before.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from models import programs
from models import transformer as tfm
from models.api import round_up
from models.driver import Driver, make_plan
from models.runtime import sharding as shd
from models.runtime import tiered_prefill
from models.runtime.tiered_prefill import PrefillJob, StateBuilder
from models.runtime.tiered_programs import (
    MeshLayout, decode_fn, embed_fn, extract_block_fn, greedy_fn, head_fn, padded_rows, prefill_layer_fn)
from models.runtime.tiered_state import HostPages, OutOfHostPages, TieredState, host_view
from sparse_jax.cache import NULL_PAGE, KVCache
from sparse_jax.methods.base import DenseAttention
from sparse_jax.offload import capacity
from sparse_jax.offload import pool as off

MODES = ("resident", "offload")
SAVE_MODES = ("deferred", "sync")  # TieredRunner(save=...)
# the offloaded layers' copy kernel grid when it runs beside the MLP (benchmarks/probes/stream_probe.py,
# H100, B=11: 8 programs x 4 entries in flight slowed the MLP least of 4/8/16/32 programs, and
# alone still move the copy at full speed; docs/architecture.md, 'Measured reasons for runtime
# and benchmark choices')
DEFAULT_GATHER_PROGRAMS = 8

__all__ = ["HostPages", "OutOfHostPages", "PrefillJob", "TieredRunner", "TieredState"]


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
        # the largest footprint check_capacity passed (an engine checks its batch with a prompt's
        # prefill beside it, then builds the batch, whose own check counts the batch alone)
        self.checked_footprint: capacity.Footprint | None = None
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

    @property
    def staging_buffers(self) -> int:
        """Pinned host buffers a paged prefill stages at once
        (:func:`~models.runtime.tiered_prefill.staging_buffer_count`); 0 without pages."""
        return 0 if self.host_pages is None else tiered_prefill.staging_buffer_count(len(self.offloaded_layers))

    def footprint(self, batch: int, max_len: int, prefill_rows: int | None = None) -> capacity.Footprint:
        """Device and host bytes of a batch (see :mod:`sparse_jax.offload.capacity`); on a
        mesh, the device bytes are one device's (its KV heads' share of the weights and
        caches, its replica's rows) and the host bytes the whole host tier."""
        mode = self.mode if self.mode == "offload" else (
            "dense" if isinstance(self.method, DenseAttention) else "sparse")

        def fp(cfg, b):
            return capacity.footprint(cfg, self.method, batch=b, max_len=max_len, mode=mode,
                                      dtype_bytes=jnp.dtype(self.model.dtype).itemsize,
                                      pool_slots=self._pool(max_len, batch) if self.mode == "offload" else None,
                                      shared=self.shared, host_pages=self.host_pages, prefill_rows=prefill_rows,
                                      staging_buffers=self.staging_buffers)

        whole = fp(self.cfg, batch)
        if self.mesh is None:
            return whole
        return capacity.Footprint(device=fp(self.local_cfg, -(-batch // self.par.data)).device, host=whole.host)

    def check_capacity(self, batch: int, max_len: int, *, device_limit=None, host_limit=None,
                       prefill_temp_bytes: int = 0, autotune_scratch: int = 0, prefill_rows: int | None = None):
        """Raise :class:`~sparse_jax.offload.capacity.CapacityError` before allocating
        when the batch does not fit (limits: the runner's unless given here).
        ``prefill_temp_bytes``: a prompt's prefill temporaries on top of the batch
        (:meth:`prefill_temp_bytes`; a serving engine prefills beside its batch).
        ``autotune_scratch``: what XLA's GEMM autotuner claims compiling a program after the
        batch exists (:func:`~sparse_jax.offload.capacity.autotune_scratch_bytes`). ``prefill_rows``:
        the rows prefilled at once (:func:`~sparse_jax.offload.capacity.footprint`; default the batch)."""
        device_limit = self.device_limit if device_limit is None else device_limit
        host_limit = self.host_limit if host_limit is None else host_limit
        dl = capacity.device_budget() if device_limit == "auto" else device_limit
        hl = capacity.host_budget() if host_limit == "auto" else host_limit
        fp = self.footprint(batch, max_len, prefill_rows)
        extra = {k: int(v) for k, v in (("prefill_temporaries", prefill_temp_bytes),
                                         ("autotune_scratch", autotune_scratch)) if v}
        if extra:
            fp = capacity.Footprint({**fp.device, **extra}, fp.host)
        capacity.check_fits(fp, device_limit=dl, host_limit=hl, what=f"{self.mode} batch of {batch} x {max_len} tokens")
        if self.checked_footprint is None or fp.device_bytes >= self.checked_footprint.device_bytes:
            self.checked_footprint = fp  # with its terms (a benchmark prints it; a refusal says its own)

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
        most = 0
        for _, fn, args, static in self.prefill_layer_jobs(tokens, max_len, embed=False):
            stats = fn.lower(*args, **static).compile().memory_analysis()
            most = max(most, int(getattr(stats, "temp_size_in_bytes", 0) or 0))
        return most

    def prefill_layer_jobs(self, tokens: int, max_len: int, embed: bool = True) -> list[tuple]:
        """The programs a one-row whole-layer prefill of ``tokens`` tokens (a prompt bucket)
        runs, as ``(what, program, args, static)`` with abstract arguments placed as the real
        call's (:meth:`models.serving.precompile.AheadOfTime.compile`'s jobs): the embedding
        (``embed``) and each layer kind's :func:`prefill_layer_fn`. Compiled ahead, a prefill of
        that length reuses them (jit's cache; the hidden state's shape carries the device
        placement the embedding's output has: jit's cache tells a committed argument from an
        unplaced one). None on a mesh (its layer programs are the layout's)."""
        if self.mesh is not None:
            return []
        max_len = round_up(int(max_len), self.method.cache_multiple)
        params, t = self.model.params, int(tokens)
        ids = jax.ShapeDtypeStruct((1, t), jnp.int32)
        x = jax.eval_shape(self._embed, params, ids)
        leaf = jax.tree.leaves(params)[0]  # the embedding's output is placed as the weights are
        x = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=leaf.sharding if getattr(leaf, "committed", False) else None)
        lengths = jax.ShapeDtypeStruct((1,), jnp.int32)
        carry = self.method.init_prefill_carry(batch=1, num_kv_heads=self.local_cfg.num_kv_heads, length=t)
        jobs = [(f"the embedding of {t} tokens", self._embed, (params, ids), {})] if embed else []
        seen = set()
        for i, spec in enumerate(self.plan.specs):
            if spec in seen:
                continue
            seen.add(spec)
            jobs.append((f"a {spec.kind}{' sparse' if spec.sparse else ''} layer's prefill of {t} tokens",
                         prefill_layer_fn(self.driver, spec, max_len), (params["layers"], x, lengths, self.layer_data(i),
                                                                        carry), {}))
        return jobs

    # -- building the state --------------------------------------------------------
    def state_from_kv(self, kv_of_layer, lengths, max_len: int, pages: HostPages | None = None) -> TieredState:
        """The state of a batch whose layer ``i`` K/V is ``kv_of_layer(i) -> (k, v,
        q_last)`` (device ``[B,Hkv,S,D]`` x2, ``[B,Hq,D]``): used by :meth:`prefill`
        and by benchmarks that fill the cache with synthetic K/V. Each layer's
        device K/V is dropped before the next is made (about one layer at a time).
        ``pages``: a paged host tier's table kept by the caller (default: the runner's own);
        only blocks with a page are stored."""
        build = StateBuilder(self, lengths, max_len, pages)
        for i in range(self.num_layers):
            build.add(i, *kv_of_layer(i))
        return build.finish()

    def empty_state(self, batch: int, max_len: int, pages: HostPages) -> TieredState:
        """A paged host tier's batch of ``batch`` one-token rows of zeros (a serving engine's free
        slots; ``pages``: the caller's table, every block the null page), as :meth:`state_from_kv`
        of zero K/V gives it, but no offloaded layer's ``[batch, Hkv, max_len, D]`` K/V (nor its
        block layout) is ever on the device: each such layer's tiers are computed from zeros
        made inside one program (:func:`~models.runtime.tiered_programs.empty_offloaded_layer`),
        so the batch's device peak is its tiers, not 2 x a layer's K/V more (at 16 slots of 64K
        on the Qwen3-8B shape, 8 GiB). Resident layers hold their K/V anyway."""
        if self.host_pages is None or self.mesh is not None:
            raise ValueError("empty_state builds a paged host tier's batch on one device (host_pages=N, no mesh)")
        build = StateBuilder(self, np.ones(batch, np.int32), max_len, pages, empty=True)
        for i in range(self.num_layers):
            build.add_empty(i)
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

    def decode_step_job(self, state: TieredState) -> tuple | None:
        """:meth:`decode_step`'s program over ``state``'s batch as an ahead-of-time job
        (:meth:`models.serving.precompile.AheadOfTime.compile`), its arguments abstract and
        placed as the step's calls place them (the tokens as the lengths, the state's leaves as
        they are); None on a mesh (its step is the layout's)."""
        if self.mesh is not None:
            return None
        def aval(a):
            return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)

        tokens = jax.ShapeDtypeStruct(state.lengths_host.shape, jnp.int32, sharding=state.cache.lengths.sharding)
        # the cache abstract (the step donates it: a background compile may lower after the first
        # step); the host tiers as they are: a ShapeDtypeStruct's aval has no host memory space,
        # so a pinned pool's would be a device array's, another program (never donated, they stay)
        args = (self.model.params, tokens, jax.tree.map(aval, state.cache), state.host)
        if self.shared:
            args += (jax.ShapeDtypeStruct(state.lengths_host.shape, jnp.bool_),)
        return (f"the decode step of {state.lengths_host.shape[0]} rows", self._decode, args, {})

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
                              host_view(sk.data), host_view(sv.data)))
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
