"""The layer driver: one function runs the stack of layers for ``forward``,
``prefill``, ``decode_step`` and capture.

The stack is cut into segments of identical layers (:func:`sparse_jax.layers.segments`:
same kind, window, RoPE base and whether the method runs there). Each segment
runs one body over its layers, either unrolled (a Python loop with static
layer indices inside the one program: the default on the GPU) or as a
``jax.lax.scan`` (the default elsewhere: it compiles several times faster).
Parameters are stacked (``params["layers"]`` holds every layer on a leading
axis); the cache keeps one buffer per layer (:mod:`sparse_jax.cache` says why:
a scanned or sliced stacked cache costs a copy of each layer's KV per step on
the GPU), which the scan stacks and splits around itself. A carry crosses
layers and segments:

* the hidden state ``x``;
* the method's carry (``method.init_carry``: e.g. Kascade's last anchor
  selection), which a later layer reads; dense layers pass it through.

Per-layer constants are scanned (or indexed) arrays: the method's
``layer_data`` rows (Double Sparsity's calibrated channels) and the layer
index. A whole decode step, or a whole prefill, is one jitted program with the
cache donated (:func:`models.programs.build_functions`). Offloaded layers
(:mod:`sparse_jax.offload.pool`) run inside the same decode program, always
unrolled: each reads its own host tier.

Data flow of one decode step::

    tokens -> embed -> [per layer: qkv -> write token -> method.select(q, kv view)
    -> Selection -> kv.attend (kernel; offloaded: fetch / prefetch blocks)
    -> output proj + MLP] -> norm + head -> logits
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.config import ModelConfig
from models.transformer import last_valid, layer_output, layer_qkv, rope_cos_sin, rope_inv_freq
from sparse_jax.cache import KVCache, LayerCache, PagedLayer, write_paged, write_prompt_pages, write_rows
from sparse_jax.kv import PagedKV, ResidentKV, paged_rows
from sparse_jax.layers import LayerSpec, Segment, layer_specs, segments
from sparse_jax.selection import Selection
from sparse_jax.methods.base import AttentionMethod, LayerCtx
from sparse_jax.methods.registry import get_method
from sparse_jax.offload.pool import decode_offloaded
from sparse_jax.offload.tiers import OffloadedLayer
from sparse_jax.ops.attention import dense_decode_attention  # the Pallas kernel on a GPU, the einsum elsewhere
from sparse_jax.ops.dense import chunk_prefill_attention, dense_prefill_attention

#: Tokens of a whole-prompt layer's per-token blocks run at once: the norm, projections and RoPE
#: before attention, the output projection and MLP after it (``token_chunk`` of
#: :func:`models.transformer.layer_qkv` and :func:`~models.transformer.layer_output`), where the
#: prompt is longer (its last slice may be shorter): the prefill programs' temporaries are a
#: slice's activations, not the prompt's.
PROMPT_TOKEN_CHUNK = 8192


@dataclasses.dataclass(frozen=True)
class Plan:
    """The static structure of a model under a method: one spec per layer and the segments."""

    specs: tuple[LayerSpec, ...]
    segments: tuple[Segment, ...]


@functools.lru_cache(maxsize=64)
def make_plan(cfg: ModelConfig, method: AttentionMethod) -> Plan:
    specs = layer_specs(cfg.kinds, window=cfg.sliding_window, rope_theta=cfg.rope_theta,
                        local_rope_theta=cfg.rope_local_theta, is_sparse=method.is_sparse_layer,
                        is_sparse_prefill=method.is_sparse_prefill_layer)
    return Plan(specs, segments(specs))


def sparse_prefill_eligible(cfg: ModelConfig) -> list[bool]:
    """Per model layer, whether a sparse prefill may run there (the plan's rule: global
    layers only), whatever layers a method names: what the drift profile's δ rule picks
    among (``models.cli.prefill_profile``, ``prefill.quantile``)."""
    every = get_method("dense", prefill="token_sparse", prefill_options=(("layers", tuple(range(cfg.num_layers))),))
    return [s.sparse_prefill for s in make_plan(cfg, every).specs]


def segment_data(method: AttentionMethod, seg: Segment) -> dict[str, np.ndarray]:
    """The segment's per-layer constants stacked ``[L_seg, ...]``: the method's
    ``layer_data`` on sparse segments, and ``"index"`` (model layer indices)."""
    out: dict[str, np.ndarray] = {"index": np.arange(seg.start, seg.start + seg.length, dtype=np.int32)}
    if seg.spec.sparse:
        rows = [method.layer_data(i) for i in seg.layers]
        if rows[0] is not None:
            for key in rows[0]:
                out[key] = np.stack([np.asarray(r[key]) for r in rows])
    return out


def per_kv_head(key: str, value, num_kv_heads: int, axis: int) -> bool:
    """Whether a layer-data entry is per KV head (its ``axis``, 0 for one layer's row, 1
    for a segment's stacked rows, has one entry per KV head; Double Sparsity's channels):
    tensor parallelism cuts such entries to each device's heads."""
    return key != "index" and value.ndim > axis and value.shape[axis] == num_kv_heads


def scan_layers(body: Callable, carry: Any, xs: Any, length: int, unroll: bool):
    """``lax.scan(body, carry, xs)``, or the same loop unrolled in Python (static
    indices; ``ys`` stacked) when ``unroll``."""
    if not unroll:
        return jax.lax.scan(body, carry, xs, length=length)
    ys = []
    for i in range(length):
        carry, y = body(carry, jax.tree.map(lambda a: a[i], xs))
        ys.append(y)
    if ys and ys[0] is not None:
        return carry, jax.tree.map(lambda *a: jnp.stack(a), *ys)
    return carry, None


# -----------------------------------------------------------------------------
# Pieces shared by every mode
# -----------------------------------------------------------------------------


def inv_freq(cfg: ModelConfig, spec: LayerSpec) -> np.ndarray:
    """RoPE inverse frequencies of a layer kind (the Llama-3 scaling applies to global layers)."""
    scaling = cfg.rope_scaling if spec.kind == "global" else None
    return rope_inv_freq(cfg.head_dim, spec.rope_theta, scaling)


@jax.tree_util.register_pytree_node_class
class LayerRows:
    """One stacked parameter ``[L, ...]`` as its ``L`` rows, each an array of its own.

    On the CPU a row sliced out of a stacked parameter inside the program is a copy
    (XLA:CPU does not fuse the slice into the GEMM, as the GPU does): SmolLM2's
    unrolled decode step copied all its layer weights every step, most of the step
    (docs/models.md, 'CPU performance'). Passed as rows, each layer's GEMMs read their own input buffers.
    :func:`layer_rows` makes them as zero-copy views of the stacked buffers."""

    def __init__(self, rows):
        self.rows = tuple(rows)

    def __getitem__(self, i: int):
        return self.rows[i]

    def tree_flatten(self):
        return self.rows, None

    @classmethod
    def tree_unflatten(cls, _, rows):
        return cls(rows)


def _is_rows(x) -> bool:
    return isinstance(x, LayerRows)


def layer_rows(a) -> LayerRows:
    """One stacked parameter ``a [L, ...]`` as :class:`LayerRows`. On the CPU a concrete
    array's rows are views of its buffer (``device_put`` of a NumPy view does not copy
    there), so this costs no memory; an abstract one (``ShapeDtypeStruct``, for
    ``lower``) gives abstract rows."""
    if isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer):
        (dev, *others) = a.devices()
        if not others and dev.platform == "cpu":
            host = np.asarray(a)  # a view of the device buffer
            # committed only where ``a`` is: a step's outputs are committed when any input is,
            # and a cache that changed from uncommitted (prefill's) to committed (the first
            # decode step's) would compile the decode step a second time
            put = functools.partial(jax.device_put, device=dev) if a.committed else jax.device_put
            return LayerRows(put(host[g]) for g in range(a.shape[0]))
        return LayerRows(a[g] for g in range(a.shape[0]))  # elsewhere: copies, laid out as ``a``
    return LayerRows(jax.ShapeDtypeStruct(a.shape[1:], a.dtype) for _ in range(a.shape[0]))


def _at(tree, i):
    """Row ``i`` of every leaf (``i`` a static int or a traced index; :class:`LayerRows`
    leaves take static indices only)."""
    if isinstance(i, (int, np.integer)):
        return jax.tree.map(lambda a: a[int(i)], tree, is_leaf=_is_rows)
    if any(_is_rows(a) for a in jax.tree.leaves(tree, is_leaf=_is_rows)):
        raise ValueError("a scanned segment needs the stacked params, not LayerRows (unroll the driver)")
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False), tree)


def _layer_at(graphdef, stacked, g) -> Any:
    """The layer module whose parameters are row ``g`` of the stacked ``params["layers"]``."""
    return nnx.merge(graphdef, _at(stacked, g))


def _method_for(method: AttentionMethod, spec: LayerSpec) -> AttentionMethod | None:
    return method if spec.sparse else None


def ring_prefill_rows(lengths: jax.Array, window: int, t: int) -> jax.Array:
    """``int32[B, window]``: the prompt position each ring slot of a local layer holds
    after a prefill of ``lengths`` tokens (slot ``j``: the last position ``p < length``
    with ``p % window == j``; slots no position reached hold position ``j``, masked)."""
    j = jnp.arange(window, dtype=jnp.int32)[None, :]
    last = lengths[:, None] - 1
    p = j + window * (jnp.maximum(last - j, 0) // window)
    return jnp.clip(jnp.where(j <= last, p, j), 0, t - 1)


# -----------------------------------------------------------------------------
# The driver
# -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Driver:
    """Runs a model's stack under one method (built once per model structure and method)."""

    cfg: ModelConfig
    method: AttentionMethod
    layer_graph: Any  # nnx.GraphDef of one DecoderLayer
    unroll: bool = False
    #: tensor parallelism over KV heads (:mod:`models.runtime.sharding`): the driver runs inside
    #: ``shard_map`` on this device's heads (``cfg`` is the per-device config), sums the
    #: attention output and MLP projections over ``tp_axis`` and slices per-KV-head
    #: layer data (Double Sparsity's channels) to its heads. None: one device.
    tp_axis: str | None = None
    tp_size: int = 1

    @property
    def plan(self) -> Plan:
        return make_plan(self.cfg, self.method)

    def _reduce(self, y: jax.Array) -> jax.Array:
        """The row-parallel projections' partial sums added over the devices (identity on one)."""
        return y if self.tp_axis is None else jax.lax.psum(y, self.tp_axis)

    def segment_data(self, seg: Segment) -> dict:
        """:func:`segment_data`, with each per-KV-head array (axis 1 of the stacked rows,
        ``num_kv_heads * tp_size`` long) cut to this device's heads under tensor parallelism."""
        data = segment_data(self.method, seg)
        if self.tp_size == 1:
            return data
        n = self.cfg.num_kv_heads
        # no axis (abstract evaluation of one device's shapes): the first device's heads
        first = 0 if self.tp_axis is None else jax.lax.axis_index(self.tp_axis) * n
        out = {}
        for key, v in data.items():
            if per_kv_head(key, v, n * self.tp_size, axis=1):
                v = jax.lax.dynamic_slice_in_dim(jnp.asarray(v), first, n, axis=1)
            out[key] = v
        return out

    # -- forward / capture ------------------------------------------------------
    def forward(self, stacked, x: jax.Array, *, capture: bool = False, drift: bool = False):
        """Whole sequences, no cache: ``x [B, T, H]`` -> ``x`` (and with ``capture``, per
        segment the stacked post-RoPE ``(q [L,B,T,Hq,D], k [L,B,T,Hkv,D])``; with
        ``drift``, per segment each layer's mean relative update ``|h_out - h_in| /
        |h_in|`` over every token, ``f32[L_seg]``: Token Sparse Attention's layer profile)."""
        b, t, _ = x.shape
        lengths = jnp.full((b,), t, jnp.int32)
        captured = []
        pcarry = self.method.init_prefill_carry(batch=b, num_kv_heads=self.cfg.num_kv_heads, length=t)
        for seg in self.plan.segments:
            spec, m = seg.spec, _method_for(self.method, seg.spec)
            cos, sin = rope_cos_sin(jnp.arange(t), inv_freq(self.cfg, spec))

            def body(carry, data, spec=spec, m=m, cos=cos, sin=sin):
                x, pcarry = carry
                layer = _layer_at(self.layer_graph, stacked, data["index"])
                q, k, v = layer_qkv(layer, x, cos, sin)
                o, pcarry = prompt_attention(m, spec, q, k, v, lengths, LayerCtx(spec, data), self.method,
                                             self.tp_axis, pcarry)
                out = layer_output(layer, x, o, self._reduce)
                if drift:
                    xf, of = x.astype(jnp.float32), out.astype(jnp.float32)
                    rel = jnp.linalg.norm(of - xf, axis=-1) / jnp.maximum(jnp.linalg.norm(xf, axis=-1), 1e-30)
                    return (out, pcarry), rel.mean()
                return (out, pcarry), ((q, k) if capture else None)

            (x, pcarry), ys = scan_layers(body, (x, pcarry), self._xs(seg), seg.length, self.unroll)
            captured.append(ys)
        return (x, captured) if capture or drift else x

    # -- running a segment over per-layer cache entries ------------------------------
    def _run_segment(self, body: Callable, carry: Any, seg: Segment, entries: list, unroll: bool):
        """``body(carry, data, entry) -> (carry, entry)`` over the segment's layers.

        Unrolled: a Python loop with static layer indices, each layer reading and
        writing its own cache buffers (no copy). Scanned: the entries are stacked,
        scanned over and split again, a copy of the segment's cache each call; cheap
        to compile (tests on CPU), slow on the GPU (``sparse_jax/cache.py``)."""
        data = self.segment_data(seg)
        if unroll:
            out = []
            for j in range(seg.length):
                carry, e = body(carry, {k: v[j] for k, v in data.items()}, entries[j])
                out.append(e)
            return carry, out
        stacked = jax.tree.map(lambda *a: jnp.stack(a), *entries)

        def step(c, xs):
            d, e = xs
            return body(c, d, e)

        carry, ys = jax.lax.scan(step, carry, ({k: jnp.asarray(v) for k, v in data.items()}, stacked),
                                 length=seg.length)
        return carry, [jax.tree.map(lambda a, j=j: a[j], ys) for j in range(seg.length)]

    # -- prefill ----------------------------------------------------------------------
    def prefill(self, stacked, x: jax.Array, lengths: jax.Array, cache: KVCache):
        """Prefill right-padded ``x [B, T, H]`` into the empty ``cache``: returns ``x``
        (every position) and the cache. A :class:`PagedLayer` entry gets the prompt's K/V in
        the rows' pages (``cache.block_table``; positions past a row's length land in its last
        page's tail or are dropped with the null page) and its state computed as a contiguous
        layer of ``max_len`` would have it (the paged engine's prefill: no one-row cache)."""
        layers = list(cache.layers)
        pcarry = self.method.init_prefill_carry(batch=x.shape[0], num_kv_heads=self.cfg.num_kv_heads,
                                                length=x.shape[1])
        for seg in self.plan.segments:
            spec, m = seg.spec, _method_for(self.method, seg.spec)

            def body(carry, data, lc, spec=spec, m=m):
                x, pcarry = carry
                paged = isinstance(lc, PagedLayer)
                cap = cache.max_len if paged else lc.k.shape[2]
                x, kc, vc, q_last, pcarry = self.prompt_layer(stacked, x, lengths, data, spec, cap, pcarry)
                dtype = (lc.pool_k if paged else lc.k).dtype
                kc, vc = kc.astype(dtype), vc.astype(dtype)
                st = None if m is None else prompt_state(m, lc.state, kc, vc, q_last, lengths, LayerCtx(spec, data))
                if paged:
                    t = x.shape[1]
                    pk = write_prompt_pages(lc.pool_k, kc, cache.block_table, lc.page, t)
                    pv = write_prompt_pages(lc.pool_v, vc, cache.block_table, lc.page, t)
                    return (x, pcarry), PagedLayer(pk, pv, st, lc.page)
                return (x, pcarry), LayerCache(kc, vc, st)

            entries = [layers[i] for i in seg.layers]
            (x, pcarry), entries = self._run_segment(body, (x, pcarry), seg, entries, self.unroll)
            for i, e in zip(seg.layers, entries):
                layers[i] = e
        return x, KVCache(tuple(layers), lengths.astype(jnp.int32), cache.max_len, cache.block_table)

    def prompt_layer(self, stacked, x: jax.Array, lengths: jax.Array, data: dict, spec: LayerSpec, cap: int,
                     carry=None):
        """One layer over the prompt ``x [B, T, H]`` (the method's prefill hook where it
        runs, exact attention elsewhere): ``(x, k, v [B, Hkv, cap, D] as the layer's cache
        holds them, q of each row's last prompt token [B, Hq, D], the prefill carry)``.
        Shared by :meth:`prefill` and the layer-by-layer prefill of :mod:`models.runtime.tiered`."""
        layer = _layer_at(self.layer_graph, stacked, data["index"])
        cos, sin = rope_cos_sin(jnp.arange(x.shape[1]), inv_freq(self.cfg, spec))
        q, k, v = layer_qkv(layer, x, cos, sin, token_chunk=PROMPT_TOKEN_CHUNK)  # [B, T, H*, D]
        o, carry = prompt_attention(_method_for(self.method, spec), spec, q, k, v, lengths, LayerCtx(spec, data),
                                    self.method, self.tp_axis, carry)
        kc, vc = prefill_kv(k, v, lengths, cap, spec)
        return (layer_output(layer, x, o, self._reduce, token_chunk=PROMPT_TOKEN_CHUNK), kc, vc,
                last_valid(q, lengths), carry)

    def chunkable(self, spec: LayerSpec, sparse_chunks: bool = False) -> bool:
        """Whether a layer's prompt attention can run in chunks: exact attention there (no
        method prefill hook), one device. A Token Sparse Attention layer runs whole within a
        layer-segmented prefill (:meth:`prompt_layer_chunk`: exact TSA needs the prompt's last
        window), and in chunks with ``sparse_chunks`` (the paged chunked prefill,
        :meth:`prefill_chunk`: TSA's chunk form, ``TokenSparsePrefill.chunk_attention``) where
        the method adds nothing to a prefill carry there."""
        if self.tp_axis is not None:
            return False
        m = _method_for(self.method, spec)
        if spec.sparse_prefill:
            return sparse_chunks and (m is None or type(m).prefill_carry is AttentionMethod.prefill_carry)
        return m is None or (type(m).prefill_attention is AttentionMethod.prefill_attention
                             and type(m).prefill_attention_carry is AttentionMethod.prefill_attention_carry)

    def prompt_layer_chunk(self, stacked, x: jax.Array, start: jax.Array, kbuf: jax.Array, vbuf: jax.Array,
                           q_last: jax.Array, lengths: jax.Array, data: dict, spec: LayerSpec):
        """One chunk of one layer over the prompt (chunked prefill, for a layer whose
        whole prompt exceeds a serving iteration's budget): ``x [B, C, H]`` at positions
        ``start .. start + C - 1`` (``start`` traced), the layer's keys and values so far
        ``kbuf, vbuf [B, T, Hkv, D]`` (every position of the prompt; this chunk's rows are
        written), and the last prompt query seen so far ``q_last [B, Hq, D]``. The chunk's
        queries attend every key up to their position (exact attention; a sliding window
        on local layers). Returns ``(x, kbuf, vbuf, q_last)``; after the last chunk,
        :func:`prefill_kv` of the buffers is what :meth:`prompt_layer` returns."""
        layer = _layer_at(self.layer_graph, stacked, data["index"])
        c = x.shape[1]
        cos, sin = rope_cos_sin(start + jnp.arange(c), inv_freq(self.cfg, spec))
        q, k, v = layer_qkv(layer, x, cos, sin)  # [B, C, H*, D]
        kbuf = jax.lax.dynamic_update_slice_in_dim(kbuf, k.astype(kbuf.dtype), start, axis=1)
        vbuf = jax.lax.dynamic_update_slice_in_dim(vbuf, v.astype(vbuf.dtype), start, axis=1)
        o = chunk_prefill_attention(q, kbuf, vbuf, start, window=spec.window)  # cuDNN on a GPU
        at = lengths - 1 - start  # the row's last prompt token, if it is in this chunk
        here = (at >= 0) & (at < c)
        q_row = jnp.take_along_axis(q, jnp.clip(at, 0, c - 1)[:, None, None, None], axis=1)[:, 0]
        q_last = jnp.where(here[:, None, None], q_row.astype(q_last.dtype), q_last)
        return layer_output(layer, x, o, self._reduce), kbuf, vbuf, q_last

    def prefill_chunk(self, stacked, x: jax.Array, start: jax.Array, lengths: jax.Array, cache: KVCache,
                      kv_len: int, last: bool, layers: tuple[int, int] | None = None):
        """One chunk of a prompt through every layer, straight into its pages (the paged
        engine's chunked prefill): ``x [1, C, H]`` at positions ``start .. start + C - 1``
        (``start`` traced) of a prompt of ``lengths [1]`` tokens, ``cache`` a one-row view
        whose every layer is a :class:`PagedLayer` (the engine's pools) read and written
        through ``cache.block_table [1, W]``. Each layer writes the chunk's K/V into the pages
        (positions past the prompt go to the null page), then the chunk's queries attend
        every key up to their own (:func:`chunk_prefill_attention` over the first ``kv_len``
        positions gathered from the pages: ``kv_len >= start + C``, static, a bucket). With
        ``last`` (the chunk holding the prompt's last token) each sparse layer's method state
        is computed from the layer's whole prompt in its pages, as :meth:`prefill` computes
        it; before, the entries' states pass through untouched (None in the engine). Only
        for layers :meth:`chunkable` allows, all global. ``layers``: only the model layers
        ``[lo, hi)`` (a chunk cut by layers over several iterations: ``x`` is the hidden state
        layer ``lo`` takes); the other entries pass through. Returns ``(x, cache)``."""
        c = x.shape[1]
        pos = start + jnp.arange(c, dtype=jnp.int32)
        table = cache.block_table
        lo, hi = (0, len(self.plan.specs)) if layers is None else layers
        layers = list(cache.layers)
        for whole in self.plan.segments:
            a, b = max(whole.start, lo), min(whole.start + whole.length, hi)
            if a >= b:
                continue
            seg = Segment(whole.spec, a, b - a)
            spec, m = seg.spec, _method_for(self.method, seg.spec)

            def body(carry, data, entry, spec=spec, m=m):
                x = carry
                layer = _layer_at(self.layer_graph, stacked, data["index"])
                q, k, v = layer_qkv(layer, x, *rope_cos_sin(pos, inv_freq(self.cfg, spec)))  # [1, C, H*, D]
                kv = PagedKV(entry.pool_k, entry.pool_v, table, entry.page)
                # past the prompt (the last chunk's padding, maybe past max_len): the null page
                rows = jnp.where(pos < lengths[0], kv.rows(pos[None])[0], pos % entry.page)
                pk, pv = write_paged(entry.pool_k, entry.pool_v, k[0], v[0], rows)
                pages = -(-kv_len // entry.page)
                tbl = table[:, :pages]
                if tbl.shape[1] < pages:  # a bucket past max_len: null pages, never read (causal)
                    tbl = jnp.pad(tbl, ((0, 0), (0, pages - tbl.shape[1])))
                kbuf = jnp.swapaxes(paged_rows(pk, tbl, entry.page), 1, 2)  # [1, kv_len, Hkv, D]
                vbuf = jnp.swapaxes(paged_rows(pv, tbl, entry.page), 1, 2)
                if spec.sparse_prefill:  # TSA's chunk form: the prefix keys the chunk's own window keeps
                    o = self.method.sparse_prefill().chunk_attention(q, kbuf, vbuf, start, lengths,
                                                                     head_axis=self.tp_axis)
                else:
                    o = chunk_prefill_attention(q, kbuf, vbuf, start)  # cuDNN on a GPU
                st = entry.state
                if last and m is not None:
                    kc, vc = paged_rows(pk, table, entry.page), paged_rows(pv, table, entry.page)  # [1, Hkv, cap, D]
                    # as a contiguous prefill leaves them: nothing past the prompt
                    valid = (jnp.arange(kc.shape[2]) < lengths[0])[None, None, :, None]
                    kc, vc = jnp.where(valid, kc, 0), jnp.where(valid, vc, 0)
                    q_last = last_valid(q, lengths - start)
                    st = prompt_state(m, st, kc, vc, q_last, lengths, LayerCtx(spec, data))
                return layer_output(layer, x, o, self._reduce), PagedLayer(pk, pv, st, entry.page)

            entries = [layers[i] for i in seg.layers]
            x, entries = self._run_segment(body, x, seg, entries, self.unroll)
            for i, e in zip(seg.layers, entries):
                layers[i] = e
        return x, KVCache(tuple(layers), cache.lengths, cache.max_len, table)

    # -- decode -------------------------------------------------------------------------
    def decode(self, stacked, x: jax.Array, cache: KVCache, host: tuple | None = None, *,
               gather_programs: int | None = None, layers: range | None = None, active=None):
        """One token per row ``x [B, H]`` at positions ``cache.lengths``: returns ``x``
        and the cache with the token appended (``lengths + 1``).

        ``host``: per layer, the :class:`sparse_jax.offload.tiers.HostLayer` of an
        offloaded layer (whose cache entry is its device tier, an
        :class:`~sparse_jax.offload.tiers.OffloadedLayer`) or None; offloaded
        segments always run unrolled (each layer reads its own host buffers).
        ``gather_programs``: the offloaded layers' copy grid. ``layers``: run only these
        consecutive model layers (``x`` is then the hidden state entering the first;
        entries of ``cache.layers`` outside them are not read and may be None): a pack
        of layers of :mod:`models.runtime.cache_rank`. ``active`` (``bool[B]``): the rows that
        place blocks in an offloaded layer's shared pool (None: every row)."""
        pos = cache.lengths
        b = pos.shape[0]
        host = host or (None,) * cache.num_layers
        mcarry = self.method.init_carry(batch=b, num_kv_heads=self.cfg.num_kv_heads, max_len=cache.max_len)
        entries_all = list(cache.layers)
        for seg in self.plan.segments:
            if layers is not None:  # the segment clipped to the layers asked for
                lo, hi = max(seg.start, layers.start), min(seg.start + seg.length, layers.stop)
                if lo >= hi:
                    continue
                seg = dataclasses.replace(seg, start=lo, length=hi - lo)
            spec, m = seg.spec, _method_for(self.method, seg.spec)
            cos, sin = rope_cos_sin(pos, inv_freq(self.cfg, spec))
            offloaded = [host[i] is not None for i in seg.layers]
            if any(offloaded) and not all(offloaded):
                raise ValueError(f"layers {seg.layers}: a segment is offloaded whole or not at all")

            def body(carry, data, entry, spec=spec, m=m, cos=cos, sin=sin):
                x, mcarry = carry
                layer = _layer_at(self.layer_graph, stacked, data["index"])
                q, k, v = layer_qkv(layer, x, cos, sin)  # [B, H*, D]
                ctx = LayerCtx(spec, data)
                if isinstance(entry, OffloadedLayer):
                    o, entry, mcarry = decode_offloaded(m, q, k, v, pos, entry, host[int(data["index"])], ctx,
                                                        mcarry, gather_programs=gather_programs, active=active)
                    return (layer_output(layer, x, o, self._reduce), mcarry), entry
                if isinstance(entry, PagedLayer):  # a global layer in the batch's page pool
                    kv = PagedKV(entry.pool_k, entry.pool_v, cache.block_table, entry.page)
                    pk, pv = write_paged(kv.pool_k, kv.pool_v, k, v, kv.rows(pos[:, None])[:, 0])
                    kv = dataclasses.replace(kv, pool_k=pk, pool_v=pv)
                    st = entry.state
                    if m is None:
                        o = kv.attend(q, pos + 1, Selection.all_tokens())
                    else:
                        st = m.append_state(st, kv, pos, ctx)
                        o, st, mcarry = m.decode(q, kv, pos + 1, st, mcarry, ctx)
                    return (layer_output(layer, x, o, self._reduce), mcarry), PagedLayer(pk, pv, st, entry.page)
                cap = entry.k.shape[2]
                slot = pos if spec.kind == "global" else pos % cap
                kc, vc = write_rows(entry.k, entry.v, k, v, slot)
                st = entry.state
                if m is None:
                    o = dense_decode_attention(q, kc, vc, jnp.minimum(pos + 1, cap))
                else:
                    kv = ResidentKV(kc, vc)
                    st = m.append_state(st, kv, pos, ctx)
                    o, st, mcarry = m.decode(q, kv, pos + 1, st, mcarry, ctx)
                return (layer_output(layer, x, o, self._reduce), mcarry), LayerCache(kc, vc, st)

            entries = [entries_all[i] for i in seg.layers]
            (x, mcarry), entries = self._run_segment(body, (x, mcarry), seg, entries,
                                                     self.unroll or any(offloaded))
            for i, e in zip(seg.layers, entries):
                entries_all[i] = e
        return x, KVCache(tuple(entries_all), pos + 1, cache.max_len, cache.block_table)

    # -- helpers ------------------------------------------------------------------------
    def _xs(self, seg: Segment) -> dict:
        data = self.segment_data(seg)
        if self.unroll:
            return data  # NumPy: static layer indices, the parameters are sliced statically
        return {k: jnp.asarray(v) for k, v in data.items()}


def prompt_attention(method: AttentionMethod | None, spec: LayerSpec, q, k, v, lengths, ctx: LayerCtx,
                     model_method: AttentionMethod | None = None, head_axis: str | None = None, carry=None):
    """Causal attention over the prompt, ``(out, carry)``: Token Sparse Attention where
    the layer's spec says so (``model_method``'s ``prefill``; ``head_axis``: the mesh
    axis splitting the heads, for its count shared by every head), else the method's
    prefill hook (with the prefill ``carry`` that crosses layers; on a TSA layer the
    method's ``prefill_carry`` updates it, Kascade's anchors selecting), or exact attention
    (with the layer's sliding window) where ``method`` is None; the carry passes
    unchanged through layers the method does not run on."""
    if spec.sparse_prefill:
        out = (model_method or method).sparse_prefill().attention(q, k, v, lengths, head_axis=head_axis)
        # a carry the method builds across layers (Kascade's tiled prefill) still gets this layer's part
        return out, (carry if method is None else method.prefill_carry(q, k, lengths, ctx, carry))
    if method is None:
        return dense_prefill_attention(q, k, v, spec.window), carry
    return method.prefill_attention_carry(q, k, v, lengths, ctx, carry)


def prompt_state(method: AttentionMethod, state, k, v, q_last, lengths, ctx: LayerCtx):
    """The method's layer state after a prefill: ``prefill_state`` from the layer's
    cache ``k, v [B, Hkv, S, D]``, then ``prefill_query_state`` with the last prompt query."""
    ctx = dataclasses.replace(ctx, capacity=k.shape[2])
    state = method.prefill_state(state, k, v, lengths, ctx)
    return method.prefill_query_state(state, q_last, lengths, ctx)


def prefill_kv(k: jax.Array, v: jax.Array, lengths: jax.Array, cap: int, spec: LayerSpec):
    """A layer's cache contents after a prefill of ``k, v [B, T, Hkv, D]``: ``[B, Hkv,
    cap, D]`` (global layers: padded to ``cap``; local layers: the ring of the last
    ``cap`` positions)."""
    t = k.shape[1]
    kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, Hkv, T, D]
    if spec.kind == "local":
        rows = ring_prefill_rows(lengths, cap, t)  # [B, cap]
        return (jnp.take_along_axis(kh, rows[:, None, :, None], axis=2),
                jnp.take_along_axis(vh, rows[:, None, :, None], axis=2))
    pad = ((0, 0), (0, 0), (0, cap - t), (0, 0))
    return jnp.pad(kh, pad), jnp.pad(vh, pad)


def init_cache(cfg: ModelConfig, method: AttentionMethod, batch: int, max_len: int, dtype) -> KVCache:
    """Empty cache: per layer ``k, v [B, Hkv, S_layer, D]`` (``S_layer``: ``max_len`` on
    global layers, the window on local ones) and the method's state on its layers."""
    method.check(num_q_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, max_len=max_len)
    layers = []
    for spec in make_plan(cfg, method).specs:
        cap = spec.capacity(max_len)
        shape = (batch, cfg.num_kv_heads, cap, cfg.head_dim)
        state = None
        if spec.sparse:
            state = method.init_state(spec, batch=batch, num_kv_heads=cfg.num_kv_heads, max_len=cap,
                                      head_dim=cfg.head_dim, dtype=dtype, num_q_heads=cfg.num_heads)
        layers.append(LayerCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), state))
    return KVCache(tuple(layers), jnp.zeros((batch,), jnp.int32), int(max_len))
