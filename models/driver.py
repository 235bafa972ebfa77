"""The layer driver: one function runs the stack of layers for ``forward``,
``prefill``, ``decode_step`` and capture.

The stack is cut into segments of identical layers (:func:`sparse_jax.layers.segments`:
same kind, window, RoPE base and whether the method runs there). Each segment
is a ``jax.lax.scan`` over the layers' stacked parameters (``params["layers"]``
holds every layer on a leading axis, indexed by the model layer index) and
the segment's stacked cache (:class:`sparse_jax.cache.SegmentCache`), or the
same body unrolled (``unroll=True``: a Python loop with static layer indices
inside the one program). A carry crosses layers and segments:

* the hidden state ``x``;
* the method's carry (``method.init_carry``: e.g. Kascade's last anchor
  selection), which a later layer reads; dense layers pass it through.

Per-layer constants become scanned arrays: the method's ``layer_data`` rows
(Double Sparsity's calibrated channels) and the layer index. A whole decode
step, or a whole prefill, is then one jitted program with the cache donated
(:func:`models.transformer.build_functions`).

Data flow of one decode step::

    tokens -> embed -> [segment scans: qkv -> write token -> method.select ->
    Selection -> attend (kernel) -> output proj + MLP] -> norm + head -> logits
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
from sparse_jax.cache import KVCache, SegmentCache
from sparse_jax.layers import LayerSpec, Segment, layer_specs, segments
from sparse_jax.methods.base import AttentionMethod, LayerCtx, dense_prefill_attention
from sparse_jax.selection import dense_decode_attention


@dataclasses.dataclass(frozen=True)
class Plan:
    """The static structure of a model under a method: one spec per layer and the segments."""

    specs: tuple[LayerSpec, ...]
    segments: tuple[Segment, ...]


@functools.lru_cache(maxsize=64)
def make_plan(cfg: ModelConfig, method: AttentionMethod) -> Plan:
    specs = layer_specs(cfg.kinds, window=cfg.sliding_window, rope_theta=cfg.rope_theta,
                        local_rope_theta=cfg.rope_local_theta, is_sparse=method.is_sparse_layer)
    return Plan(specs, segments(specs))


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
    from models.transformer import rope_inv_freq

    scaling = cfg.rope_scaling if spec.kind == "global" else None
    return rope_inv_freq(cfg.head_dim, spec.rope_theta, scaling)


def _at(tree, i):
    """Row ``i`` of every leaf (``i`` a static int or a traced index)."""
    if isinstance(i, (int, np.integer)):
        return jax.tree.map(lambda a: a[int(i)], tree)
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False), tree)


def _layer_at(graphdef, stacked, g) -> Any:
    """The layer module whose parameters are row ``g`` of the stacked ``params["layers"]``."""
    return nnx.merge(graphdef, _at(stacked, g))


def _set(tree, i, new):
    return jax.tree.map(lambda a, n: jax.lax.dynamic_update_index_in_dim(a, n.astype(a.dtype), i, 0), tree, new)


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

    @property
    def plan(self) -> Plan:
        return make_plan(self.cfg, self.method)

    # -- forward / capture ------------------------------------------------------
    def forward(self, stacked, x: jax.Array, *, capture: bool = False):
        """Whole sequences, no cache: ``x [B, T, H]`` -> ``x`` (and with ``capture``, per
        segment the stacked post-RoPE ``(q [L,B,T,Hq,D], k [L,B,T,Hkv,D])``)."""
        from models.transformer import layer_output, layer_qkv, rope_cos_sin

        b, t, _ = x.shape
        lengths = jnp.full((b,), t, jnp.int32)
        captured = []
        for seg in self.plan.segments:
            spec, m = seg.spec, _method_for(self.method, seg.spec)
            cos, sin = rope_cos_sin(jnp.arange(t), inv_freq(self.cfg, spec))

            def body(x, xs, spec=spec, m=m, cos=cos, sin=sin):
                data = xs
                layer = _layer_at(self.layer_graph, stacked, data["index"])
                q, k, v = layer_qkv(layer, x, cos, sin)
                if m is None:
                    o = dense_prefill_attention(q, k, v, spec.window)
                else:
                    o = m.prefill_attention(q, k, v, lengths, LayerCtx(spec, data))
                return layer_output(layer, x, o), ((q, k) if capture else None)

            x, ys = scan_layers(body, x, self._xs(seg), seg.length, self.unroll)
            captured.append(ys)
        return (x, captured) if capture else x

    # -- prefill ----------------------------------------------------------------------
    def prefill(self, stacked, x: jax.Array, lengths: jax.Array, cache: KVCache):
        """Prefill right-padded ``x [B, T, H]`` into the empty ``cache``: returns ``x``
        (every position) and the cache."""
        from models.transformer import last_valid, layer_output, layer_qkv, rope_cos_sin

        b, t, _ = x.shape
        new_segments = []
        for seg, sc in zip(self.plan.segments, cache.segments):
            spec, m = seg.spec, _method_for(self.method, seg.spec)
            cos, sin = rope_cos_sin(jnp.arange(t), inv_freq(self.cfg, spec))
            cap = sc.k.shape[3]

            def body(carry, xs, spec=spec, m=m, cos=cos, sin=sin, cap=cap):
                x, sc = carry
                i, data = xs
                layer = _layer_at(self.layer_graph, stacked, data["index"])
                q, k, v = layer_qkv(layer, x, cos, sin)  # [B, T, H*, D]
                ctx = LayerCtx(spec, data)
                if m is None:
                    o = dense_prefill_attention(q, k, v, spec.window)
                else:
                    o = m.prefill_attention(q, k, v, lengths, ctx)
                kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, Hkv, T, D]
                if spec.kind == "local":
                    rows = ring_prefill_rows(lengths, cap, t)  # [B, cap]
                    kc = jnp.take_along_axis(kh, rows[:, None, :, None], axis=2)
                    vc = jnp.take_along_axis(vh, rows[:, None, :, None], axis=2)
                else:
                    pad = ((0, 0), (0, 0), (0, cap - t), (0, 0))
                    kc, vc = jnp.pad(kh, pad), jnp.pad(vh, pad)
                kc, vc = kc.astype(sc.k.dtype), vc.astype(sc.v.dtype)
                st = None
                if m is not None:
                    st = m.prefill_state(_at(sc.state, i), kc, vc, lengths, ctx)
                    st = m.prefill_query_state(st, last_valid(q, lengths), lengths, ctx)
                sc = SegmentCache(_set(sc.k, i, kc), _set(sc.v, i, vc),
                                  None if st is None else _set(sc.state, i, st))
                return (layer_output(layer, x, o), sc), None

            idx = jnp.arange(seg.length, dtype=jnp.int32) if not self.unroll else np.arange(seg.length)
            (x, sc), _ = scan_layers(body, (x, sc), (idx, self._xs(seg)), seg.length, self.unroll)
            new_segments.append(sc)
        return x, KVCache(tuple(new_segments), lengths.astype(jnp.int32), cache.max_len)

    # -- decode -------------------------------------------------------------------------
    def decode(self, stacked, x: jax.Array, cache: KVCache):
        """One token per row ``x [B, H]`` at positions ``cache.lengths``: returns ``x``
        and the cache with the token appended (``lengths + 1``)."""
        from models.transformer import layer_output, layer_qkv, rope_cos_sin

        pos = cache.lengths
        b = pos.shape[0]
        mcarry = self.method.init_carry(batch=b, num_kv_heads=self.cfg.num_kv_heads, max_len=cache.max_len)
        new_segments = []
        for seg, sc in zip(self.plan.segments, cache.segments):
            spec, m = seg.spec, _method_for(self.method, seg.spec)
            cos, sin = rope_cos_sin(pos, inv_freq(self.cfg, spec))
            cap = sc.k.shape[3]

            def body(carry, xs, spec=spec, m=m, cos=cos, sin=sin, cap=cap):
                x, sc, mcarry = carry
                i, data = xs
                layer = _layer_at(self.layer_graph, stacked, data["index"])
                q, k, v = layer_qkv(layer, x, cos, sin)  # [B, H*, D]
                slot = pos if spec.kind == "global" else pos % cap
                # the new token straight into the stacked cache (one scatter, in place)
                rows = jnp.arange(b)
                kst = sc.k.at[i, rows, :, slot].set(k.astype(sc.k.dtype))
                vst = sc.v.at[i, rows, :, slot].set(v.astype(sc.v.dtype))
                kc, vc = _at(kst, i), _at(vst, i)
                st = None
                if m is None:
                    o = dense_decode_attention(q, kc, vc, jnp.minimum(pos + 1, cap))
                else:
                    ctx = LayerCtx(spec, data)
                    st = m.append_state(_at(sc.state, i), kc, vc, pos, ctx)
                    o, st, mcarry = m.decode(q, kc, vc, pos + 1, st, mcarry, ctx)
                sc = SegmentCache(kst, vst, None if st is None else _set(sc.state, i, st))
                return (layer_output(layer, x, o), sc, mcarry), None

            idx = jnp.arange(seg.length, dtype=jnp.int32) if not self.unroll else np.arange(seg.length)
            (x, sc, mcarry), _ = scan_layers(body, (x, sc, mcarry), (idx, self._xs(seg)), seg.length, self.unroll)
            new_segments.append(sc)
        return x, KVCache(tuple(new_segments), pos + 1, cache.max_len)

    # -- helpers ------------------------------------------------------------------------
    def _xs(self, seg: Segment) -> dict:
        data = segment_data(self.method, seg)
        if self.unroll:
            return data  # NumPy: static layer indices, the parameters are sliced statically
        return {k: jnp.asarray(v) for k, v in data.items()}


def init_cache(cfg: ModelConfig, method: AttentionMethod, batch: int, max_len: int, dtype) -> KVCache:
    """Empty cache: per segment ``k, v [L_seg, B, Hkv, S_seg, D]`` (``S_seg``: ``max_len``
    on global layers, the window on local ones) and the method's stacked state."""
    method.check(num_q_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, max_len=max_len)
    segs = []
    for seg in make_plan(cfg, method).segments:
        cap = seg.spec.capacity(max_len)
        shape = (seg.length, batch, cfg.num_kv_heads, cap, cfg.head_dim)
        state = None
        if seg.spec.sparse:
            one = method.init_state(seg.spec, batch=batch, num_kv_heads=cfg.num_kv_heads, max_len=cap,
                                    head_dim=cfg.head_dim, dtype=dtype)
            state = jax.tree.map(lambda a: jnp.repeat(jnp.asarray(a)[None], seg.length, axis=0), one)
        segs.append(SegmentCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), state))
    return KVCache(tuple(segs), jnp.zeros((batch,), jnp.int32), int(max_len))
