"""Layer-by-layer execution: one jitted call per layer, KV optionally offloaded.

:class:`LayeredRunner` runs a loaded :class:`models.api.Model` with the
same math as its whole-model jitted functions, but dispatches one jitted
function per layer (parameters passed as arguments, so all layers of a kind
share one compilation, also at 36 layers of Qwen3-8B). That granularity is
what offloading needs:

* ``mode="resident"``: every layer's KV cache on the device (dense or any
  sparse method) -- the baseline, run the same way as the offloaded mode.
* ``mode="offload"`` (AsyncTLS, ``lag=True`` forced): the sparse layers keep
  only the device tier of :mod:`sparse_jax.offload.tiers` on the device and
  every KV block in ``pinned_host`` memory. The layers the method keeps dense
  stay resident.

Prefill (SparseServe's layer-segmented idea): layer ``i``'s K/V is computed,
its device tier built, and its blocks handed to ``jax.device_put(...,
pinned_host)`` -- an asynchronous copy the next layer's compute overlaps --
and then dropped, so device KV memory during prefill is about one layer.

Decode: per step, the embedding, then one jitted call per layer, or per group
of ``layers_per_call`` consecutive layers (the offloaded ones read the host
tier inside the call through ``host_gather_into``), then the head. Completed
blocks (the ring of the device tier) are copied back to the host tier by the
CPU, one step later
(SparseServe's CPU-assisted saving): a device->host copy of the block, then a
store into the pinned buffer through its address. The engine tracks lengths
on the host, so nothing here waits on the device except those small copies.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import transformer as tfm
from models.api import round_up
from sparse_jax.cache import LayerCache
from sparse_jax.layers import LayerSpec
from models.driver import make_plan
from sparse_jax.methods.base import DenseAttention, LayerCtx, dense_prefill_attention
from sparse_jax.methods.double_sparsity import AsyncTLS
from sparse_jax.offload import capacity
from sparse_jax.offload import step as off
from sparse_jax.offload.tiers import HostLayer, OffloadLayer, device_sharding, pinned_host_sharding

MODES = ("resident", "offload")
# the offloaded layers' copy kernel grid when it runs beside the MLP (benchmarks/stream_probe.py,
# H100, B=11: 8 programs x 4 entries in flight slowed the MLP least of 4/8/16/32 programs, and
# alone still move ~45 GB/s)
DEFAULT_GATHER_PROGRAMS = 8
# layers per jitted decode call: each call costs ~0.3 ms of host time (the CUDA graph's update and
# launch), more than a layer's GPU work at 64K/B=5 on an H100; 4 per call cut the host's time to issue
# a step by ~25% and was the fastest of 1/2/4/6 for both modes (benchmarks/results/offload_groups_64k.md)
DEFAULT_LAYERS_PER_CALL = 4


@dataclasses.dataclass
class LayeredState:
    """Everything one batch carries between steps (host-side object, not a pytree).

    ``layers[i]``: a :class:`LayerCache` (resident) or :class:`OffloadLayer`;
    ``host[i]``: the layer's :class:`HostLayer` (offloaded layers) or None;
    ``lengths``: device ``int32[B]``; ``lengths_host``: its NumPy mirror.
    """

    layers: list
    host: list
    lengths: jax.Array
    lengths_host: np.ndarray
    max_len: int
    pending: list = dataclasses.field(default_factory=list)  # flushes not yet stored on the host
    counters: list = dataclasses.field(default_factory=list)  # per step: [(hits, misses) per offloaded layer]
    host_views: dict = dataclasses.field(default_factory=dict)  # layer -> (K, V) NumPy views of its host tier


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


class LayeredRunner:
    """Per-layer jitted prefill/decode of ``model`` (see the module docstring).

    Args:
      model: a :class:`models.api.Model` (its method is used; for
        ``mode="offload"`` it must be ``asynctls``, run with ``lag=True``).
      mode: "resident" or "offload".
      pool_slots: resident block slots per (row, KV head) of an offloaded layer
        (default :func:`sparse_jax.offload.step.default_pool_slots`: twice the
        filter's ``min(kb, S/block) - 1``; that smallest pool is allowed).
      device_limit, host_limit: bytes the capacity check allows ("auto": measured
        when checked, see :mod:`sparse_jax.offload.capacity`; None: unchecked).
        Measure the host limit once, before the first pinned allocation.
      churn: benchmarks on random weights only (0 = the real method): the
        fraction of the block set renewed per step, see
        :func:`sparse_jax.offload.step.decode_layer`.
      concurrent: compile the decode calls with XLA's concurrent
        CUDA-graph schedule (``xla_gpu_command_buffer_scheduling_mode=
        CONCURRENT``: kernels with no data dependence may run at once), so an
        offloaded layer's host copy runs beside its output projection and MLP.
        Default: on for ``mode="offload"``, off for ``"resident"``. GPU only
        (ignored elsewhere).
      gather_programs: grid of the offloaded layers' copy kernel (see
        :func:`sparse_jax.offload.step.decode_layer`); default 8 when
        ``concurrent``, else one program per block.
      layers_per_call: consecutive layers run by one jitted decode call (the
        last call takes the rest). Each call costs host time (argument
        handling, the CUDA graph's update); when a layer's GPU work is shorter
        than that, the step waits on the host, and fewer, larger calls help.
        Calls with the same sequence of layer kinds share one compilation.
        Default 4 (measured, see ``DEFAULT_LAYERS_PER_CALL``).
    """

    def __init__(self, model, mode: str = "resident", *, pool_slots: int | None = None, churn: float = 0.0,
                 concurrent: bool | None = None, gather_programs: int | None = None,
                 layers_per_call: int = DEFAULT_LAYERS_PER_CALL,
                 device_limit="auto", host_limit="auto"):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.model = model
        self.cfg = model.config
        self.mode = mode
        method = model.method
        if mode == "offload":
            if not isinstance(method, AsyncTLS):
                raise ValueError(f"mode='offload' runs the asynctls method, the model has {method.name!r}")
            method = dataclasses.replace(method, lag=True)
        self.method = method
        self.pool_slots = pool_slots
        self.churn = float(churn)  # benchmarks only: see sparse_jax.offload.step.decode_layer
        self.concurrent = (mode == "offload") if concurrent is None else bool(concurrent)
        if gather_programs is not None and (isinstance(gather_programs, bool) or not isinstance(gather_programs, int)
                                            or gather_programs < 1):
            raise ValueError(f"gather_programs must be a positive int or None, got {gather_programs!r}")
        self.gather_programs = (DEFAULT_GATHER_PROGRAMS if self.concurrent else None) if gather_programs is None \
            else gather_programs
        if isinstance(layers_per_call, bool) or not isinstance(layers_per_call, int) or layers_per_call < 1:
            raise ValueError(f"layers_per_call must be a positive int, got {layers_per_call!r}")
        self.layers_per_call = layers_per_call
        self.device_limit, self.host_limit = device_limit, host_limit
        full = nnx.merge(model.graphdef, model.params)
        # The model's layers are stacked ([L, ...] parameters); this engine runs them one
        # call at a time, so it holds one slice per layer (a copy of the layer weights,
        # until the offloaded cache runs inside the layer driver). Parameters travel as
        # flat tuples of arrays and each group's jitted function is looked up once: the
        # per-call host overhead matters here.
        stacked = nnx.state(full.layers)
        self.layer_graph = tfm.layer_graphdef(self.cfg, model.dtype)
        self.layer_treedef = jax.tree.structure(stacked)
        leaves = jax.tree.leaves(stacked)
        self.num_layers = self.cfg.num_layers
        self.layer_params = [tuple(a[i] for a in leaves) for i in range(self.num_layers)]
        del stacked, leaves
        self.embed_table = full.embed_tokens.weight[...]
        self.final_norm = full.norm.weight[...]
        self.lm_head = None if full.lm_head is None else full.lm_head.kernel[...]
        self.specs = make_plan(self.cfg, method).specs
        if any(sp.kind != "global" for sp in self.specs):
            raise ValueError("LayeredRunner runs models whose layers are all global")
        self.sparse = [sp.sparse for sp in self.specs]
        self.offloaded = [mode == "offload" and sp for sp in self.sparse]
        self.offloaded_layers = [i for i, o in enumerate(self.offloaded) if o]
        # each sparse layer's constants (the method's layer_data, its index): call arguments,
        # so layers of a kind share one compilation
        self.layer_data = [self._data(i) for i in range(self.num_layers)]
        self._head = _head_fn(self.cfg.rms_eps, self.lm_head is None)
        self._embed = _embed_fn()
        g, cfg, t = self.layer_graph, self.cfg, self.layer_treedef
        conc = self.concurrent and jax.default_backend() == "gpu"
        n = self.num_layers
        self.groups = [tuple(range(s, min(s + layers_per_call, n))) for s in range(0, n, layers_per_call)]
        self._group_params = [tuple(self.layer_params[i] for i in grp) for grp in self.groups]
        self._group_data = [tuple(self.layer_data[i] for i in grp) for grp in self.groups]
        self._decode_fns = [
            _decode_group_fn(g, t, cfg, tuple((self.offloaded[i], self._layer_method(i)) for i in grp),
                             self.churn, self.gather_programs, conc) for grp in self.groups]

    # -- helpers -----------------------------------------------------------------
    def _pool(self, max_len: int) -> int:
        p = off.default_pool_slots(self.method, max_len) if self.pool_slots is None else int(self.pool_slots)
        off.check_offload(self.method, p, max_len)
        return p

    def _layer_method(self, i):
        """The method on a sparse layer, None (exact attention) on the others."""
        return self.method if self.sparse[i] else None

    def _data(self, i):
        if not self.sparse[i]:
            return None
        d = {"index": jnp.int32(i)}
        d.update({k: jnp.asarray(v) for k, v in (self.method.layer_data(i) or {}).items()})
        return d

    def footprint(self, batch: int, max_len: int) -> capacity.Footprint:
        """Device and host bytes of a batch (see :mod:`sparse_jax.offload.capacity`)."""
        mode = self.mode if self.mode == "offload" else (
            "dense" if isinstance(self.method, DenseAttention) else "sparse")
        return capacity.footprint(self.cfg, self.method, batch=batch, max_len=max_len, mode=mode,
                                  dtype_bytes=jnp.dtype(self.model.dtype).itemsize,
                                  pool_slots=self._pool(max_len) if self.mode == "offload" else None)

    def check_capacity(self, batch: int, max_len: int, *, device_limit=None, host_limit=None):
        """Raise :class:`~sparse_jax.offload.capacity.CapacityError` before allocating
        when the batch does not fit (limits: the runner's unless given here)."""
        device_limit = self.device_limit if device_limit is None else device_limit
        host_limit = self.host_limit if host_limit is None else host_limit
        dl = capacity.device_budget() if device_limit == "auto" else device_limit
        hl = capacity.host_budget() if host_limit == "auto" else host_limit
        capacity.check_fits(self.footprint(batch, max_len), device_limit=dl, host_limit=hl,
                            what=f"{self.mode} batch of {batch} x {max_len} tokens")

    # -- building the state --------------------------------------------------------
    def state_from_kv(self, kv_of_layer, lengths, max_len: int) -> LayeredState:
        """The state of a batch whose layer ``i`` K/V is ``kv_of_layer(i) -> (k, v,
        q_last)`` (device ``[B,Hkv,S,D]`` x2, ``[B,Hq,D]``): used by :meth:`prefill`
        and by benchmarks that fill the cache with synthetic K/V. Each layer's
        device K/V is dropped before the next is made (about one layer at a time)."""
        lengths = jnp.asarray(lengths, jnp.int32)
        pool = self._pool(max_len) if self.mode == "offload" else 0
        self.check_capacity(int(lengths.shape[0]), max_len)
        layers, host = [], []
        for i in range(self.num_layers):
            k, v, q_last = kv_of_layer(i)
            entry, hk, hv = _finish_layer(self._layer_method(i), self.offloaded[i], pool)(
                k, v, lengths, q_last, self.layer_data[i])
            del k, v
            # committed to the device, as the decode calls' outputs are (the host tier is): an
            # uncommitted first state is another compilation of each decode call and extraction
            layers.append(jax.device_put(entry, device_sharding()))
            if self.offloaded[i]:
                sh = pinned_host_sharding()
                host.append(HostLayer(jax.device_put(hk, sh), jax.device_put(hv, sh)))  # async D2H copies
            else:
                host.append(None)
        self._compile_flush(layers, int(lengths.shape[0]))
        return LayeredState(layers, host, lengths, np.asarray(lengths).copy(), max_len)

    def _compile_flush(self, layers, batch: int):
        """Compile the block extraction for every padded row count of this batch
        now, not in the middle of decoding (one small call each, results dropped)."""
        if self.mode != "offload":
            return
        tiers = tuple(layers[i] for i in self.offloaded_layers)
        fn = _extract_block_fn(self.method.block_size)
        for m in (1 << k for k in range(_padded_rows(batch).bit_length())):
            fn(tiers, jnp.zeros((m,), jnp.int32), jnp.full((m,), tiers[0].pool_slots, jnp.int32))

    def prefill(self, tokens, lengths, max_len: int | None = None):
        """Prefill right-padded ``tokens int32[B, T]``, layer by layer. Returns the
        f32 logits ``[B, V]`` at each row's last token and the :class:`LayeredState`."""
        max_len = round_up(int(max_len or self.model.max_len), self.method.cache_multiple)
        tokens = jnp.asarray(tokens, jnp.int32)
        lengths = jnp.asarray(lengths, jnp.int32)
        b, t = tokens.shape
        if t >= max_len:
            raise ValueError(f"prompt of {t} tokens leaves no room in a cache of {max_len}")
        x = self._embed(self.embed_table, tokens)
        cur = {"x": x}
        fns = [_prefill_layer_fn(self.layer_graph, self.layer_treedef, self.cfg, max_len, self._layer_method(i))
               for i in range(self.num_layers)]

        def kv_of_layer(i):
            cur["x"], k, v, q_last = fns[i](self.layer_params[i], cur["x"], lengths, self.layer_data[i])
            return k, v, q_last

        state = self.state_from_kv(kv_of_layer, lengths, max_len)
        return self._head(tfm.last_valid(cur["x"], lengths), self.final_norm, self._head_weight()), state

    def _head_weight(self):
        # tied embeddings: logits = x @ E^T (the head contracts E's hidden axis)
        return self.embed_table if self.lm_head is None else self.lm_head

    # -- decode --------------------------------------------------------------------
    def decode_step(self, tokens, state: LayeredState):
        """One token per row: f32 logits ``[B, V]``; ``state`` is updated in place
        (its device buffers are donated to the step)."""
        if int(state.lengths_host.max()) >= state.max_len:
            raise ValueError(f"the cache is full ({state.max_len} tokens)")
        pos = state.lengths
        x = self._embed(self.embed_table, jnp.asarray(tokens, jnp.int32))
        layers, host = state.layers, state.host
        for grp, fn, params, datas in zip(self.groups, self._decode_fns, self._group_params, self._group_data):
            x, entries = fn(params, x, tuple(layers[i] for i in grp), tuple(host[i] for i in grp), pos, datas)
            for i, e in zip(grp, entries):
                layers[i] = e
        step_counts = [(layers[i].hits, layers[i].misses) for i in self.offloaded_layers]
        logits = self._head(x, self.final_norm, self._head_weight())
        state.lengths = pos + 1
        state.lengths_host = state.lengths_host + 1
        if step_counts:
            state.counters.append(step_counts)
        self._store_pending(state)  # last step's completed blocks (that step is done or nearly)
        self._start_flush(state)
        return logits

    def _start_flush(self, state: LayeredState):
        """Copy the blocks completed by this step to the host (asynchronously): one
        jitted call and one device-to-host copy for all rows that completed one."""
        if self.mode != "offload":
            return
        bs = self.method.block_size
        rows = np.nonzero(state.lengths_host % bs == 0)[0]
        if not rows.size:
            return
        idx = self.offloaded_layers
        pool = state.layers[idx[0]].pool_slots
        blocks = state.lengths_host[rows] // bs - 1
        ring = pool + blocks % 2  # the ring slot that holds each row's completed block
        # pad the lists to a power of two (repeating their last entry): few compilations
        pad = _padded_rows(rows.size) - rows.size
        ks, vs = _extract_block_fn(bs)(tuple(state.layers[i] for i in idx),
                                       jnp.asarray(np.pad(rows, (0, pad), mode="edge").astype(np.int32)),
                                       jnp.asarray(np.pad(ring, (0, pad), mode="edge").astype(np.int32)))
        ks.copy_to_host_async()
        vs.copy_to_host_async()
        state.pending.append((rows, blocks, idx, ks, vs))

    def _views(self, state: LayeredState, i: int):
        """The NumPy views of layer ``i``'s host tier, made once per state."""
        if i not in state.host_views:
            h = state.host[i]
            state.host_views[i] = (_host_view(h.k), _host_view(h.v))
        return state.host_views[i]

    def _store_pending(self, state: LayeredState):
        hkv = self.cfg.num_kv_heads
        b = state.lengths_host.shape[0]
        while state.pending:
            rows, blocks, idx, ks, vs = state.pending.pop(0)
            m = rows.size
            ks, vs = np.asarray(ks)[:, :m], np.asarray(vs)[:, :m]  # [n_layers, m, Hkv, bs, D]
            for j, i in enumerate(idx):
                kview, vview = self._views(state, i)
                nb = kview.shape[0] // (b * hkv)
                dst = ((rows[:, None] * hkv + np.arange(hkv)) * nb + blocks[:, None]).reshape(-1)
                kview[dst] = ks[j].reshape((-1,) + ks.shape[3:])
                vview[dst] = vs[j].reshape((-1,) + vs.shape[3:])

    def finish(self, state: LayeredState):
        """Store the outstanding flushes (call before reading the host tier)."""
        self._store_pending(state)

    def transfer_stats(self, state: LayeredState) -> dict:
        """Hits, misses and bytes moved per decode step (offloaded layers summed)."""
        if not state.counters:
            return {"steps": 0}
        # per step and offloaded layer: (hits, misses), each int32[B*Hkv]
        arr = np.asarray(jax.device_get([[list(c) for c in s] for s in state.counters]), np.int64).sum(-1)  # [T, L, 2]
        hits, misses = arr[..., 0].sum(1), arr[..., 1].sum(1)
        d = self.cfg.head_dim
        block_bytes = 2 * self.method.block_size * d * jnp.dtype(self.model.dtype).itemsize
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


@functools.lru_cache(maxsize=2)
def _embed_fn():
    return jax.jit(lambda table, tokens: jnp.take(table, tokens, axis=0))


@functools.lru_cache(maxsize=8)
def _head_fn(eps: float, tied: bool):
    return jax.jit(functools.partial(tfm.head_logits, eps=eps, tied=tied))


def _merge(layer_graph, treedef, leaves):
    return nnx.merge(layer_graph, jax.tree.unflatten(treedef, leaves))


@functools.lru_cache(maxsize=16)
def _prefill_layer_fn(layer_graph, treedef, cfg, max_len: int, method):
    """``(params, x [B,T,H], lengths, data) -> (x, k, v [B,Hkv,S,D], q_last [B,Hq,D])``:
    causal attention over the prompt (the method's prefill hook on its layers, dense
    elsewhere; cuDNN on GPU) and the layer's K/V padded to ``max_len``."""

    @jax.jit
    def run(params, x, lengths, data):
        layer = _merge(layer_graph, treedef, params)
        b, t, _ = x.shape
        cos, sin = tfm.rope_for(cfg, jnp.arange(t))
        q, k, v = tfm.layer_qkv(layer, x, cos, sin)
        if method is None:
            o = dense_prefill_attention(q, k, v)
        else:
            o = method.prefill_attention(q, k, v, lengths, LayerCtx(_SPEC, data))
        x = tfm.layer_output(layer, x, o)
        pad = ((0, 0), (0, 0), (0, max_len - t), (0, 0))
        k = jnp.pad(k.transpose(0, 2, 1, 3), pad)
        v = jnp.pad(v.transpose(0, 2, 1, 3), pad)
        return x, k, v, tfm.last_valid(q, lengths)

    return run


# the one layer kind this engine runs: a global layer where the method runs
_SPEC = LayerSpec("global", None, 0.0, True)


@functools.lru_cache(maxsize=32)
def _finish_layer(method, offloaded: bool, pool: int):
    """``(k, v, lengths, q_last, data) -> (entry, host_k, host_v)``; K/V donated."""

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def resident(k, v, lengths, q_last, data):
        if method is None:
            return LayerCache(k, v, None), None, None
        b, hkv, s, d = k.shape
        ctx = LayerCtx(_SPEC, data)
        st = method.init_state(_SPEC, batch=b, num_kv_heads=hkv, max_len=s, head_dim=d, dtype=k.dtype)
        st = method.prefill_state(st, k, v, lengths, ctx)
        st = method.prefill_query_state(st, q_last, lengths, ctx)
        return LayerCache(k, v, st), None, None

    @jax.jit
    def offloaded_(k, v, lengths, q_last, data):
        return off.layer_from_prefill(method, k, v, lengths, q_last, data["channels"], pool)

    return offloaded_ if offloaded else resident


def _compiler_options(concurrent: bool):
    # CONCURRENT: XLA's CUDA graph keeps only the data dependences between
    # kernels (its default, LHS, serialises them as scheduled)
    return {"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"} if concurrent else None


@functools.lru_cache(maxsize=16)
def _decode_group_fn(layer_graph, treedef, cfg, kinds, churn, gather_programs=None, concurrent=False):
    """One decode step of consecutive layers, ``kinds``: per layer ``(offloaded, method)``
    (method None: exact attention).

    ``(params, x [B,H], entries, hosts, pos int32[B], datas) -> (x, entries)``,
    each of ``params, entries, hosts, datas`` a tuple with one item per layer
    (``hosts`` None for resident layers, ``datas`` None for exact ones: the method's
    per-layer constants); ``entries`` donated."""

    @functools.partial(jax.jit, donate_argnums=(2,), compiler_options=_compiler_options(concurrent))
    def run(params, x, entries, hosts, pos, datas):
        cos, sin = tfm.rope_for(cfg, pos)
        out = []
        carry = None
        for (offloaded, method), p, entry, host, data in zip(kinds, params, entries, hosts, datas):
            layer = _merge(layer_graph, treedef, p)
            if offloaded:
                q, k, v = tfm.layer_qkv(layer, x, cos, sin)
                o, entry = off.decode_layer(method, q, k, v, pos, entry, host, data["channels"], churn,
                                            gather_programs)
                x = tfm.layer_output(layer, x, o)
            else:
                ctx = None if method is None else LayerCtx(_SPEC, data)
                x, entry, carry = tfm.decode_layer(layer, method, x, entry, pos, cos, sin, ctx, carry)
            out.append(entry)
        return x, tuple(out)

    return run


def _padded_rows(n: int) -> int:
    """The row count a block extraction of ``n`` rows runs with: the next power of two."""
    return 1 << int(n - 1).bit_length()


@functools.lru_cache(maxsize=8)
def _extract_block_fn(bs: int):
    """``(layers, rows int32[m], ring_slots int32[m]) -> (K, V) [n_layers, m, Hkv, bs, D]``:
    each listed row's ring block, in every offloaded layer."""
    @jax.jit
    def run(layers, rows, ring_slots):
        def one(t):
            def row(r, slot):
                k = jax.lax.dynamic_slice_in_dim(t.pool_k[r], slot * bs, bs, axis=1)
                v = jax.lax.dynamic_slice_in_dim(t.pool_v[r], slot * bs, bs, axis=1)
                return k, v

            return jax.vmap(row)(rows, ring_slots)

        ks, vs = zip(*(one(t) for t in layers))
        return jnp.stack(ks), jnp.stack(vs)

    return run
