"""Kascade's tiled prefill (Deshmukh et al., 2025, §prefill; microsoft/kascade
``KascadeStrategy`` with ``tile_size=32, rolling_prefill=True``): pure-jnp reference.

The prompt's queries are cut into tiles of ``tile`` (32: the paper says 128, its
code supports 32). On an **anchor** layer every tile gets its own top-k keys:

* exact causal softmax probabilities ``P [B, Hq, T, T]``, summed over each GQA group
  and over the tile's queries: a score per (KV head, tile, key);
* only keys **before** the tile compete (the tile's own keys are always attended);
* the tile's top ``count`` keys: ``count = min(K, max(min_keys, fraction * tile
  start), tile start)``, where ``K = min(max(min_keys, fraction * L), L) - tile``
  for a row of ``L`` prompt tokens (the code's ``k - tile_size``; the per-tile cap
  is its "rolling" mask). A fixed ``budget`` instead: ``count = min(budget, tile start)``.

Each query then attends its tile's top-k keys plus the keys of its own tile up to
itself (the diagonal tile, causal). An anchor renormalises its exact probabilities
over that set (the same as a softmax over it, from probabilities it computes once);
the **dense anchor** (the first, the
paper's layer 0) attends everything and only computes the top-k. A **reuse** layer's
KV head ``h`` attends the top-k of the anchor head ``head_map[h]`` plus its diagonal
tile. The anchors' selection crosses layers as the prefill carry
(``indices int32[B, Hkv, n_tiles, K]``, ``counts int32[B, n_tiles]``).

This reference builds dense ``[T, T]`` masks: exact, for tests and CPU; not fast.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from sparse_jax.prefill import _group  # k [B, T, Hkv, D] -> [B, Hq, T, D]

NEG = -1e30


def num_tiles(t: int, tile: int) -> int:
    return max(1, math.ceil(t / tile))


def tile_width(t: int, tile: int, *, budget: int, fraction: float, min_keys: int) -> int:
    """Static width ``K`` of a prompt of ``t`` (padded) tokens' per-tile selection (>= 1:
    a zero-size array is never built)."""
    if budget:
        return max(1, min(budget, t))
    k = min(max(min_keys, int(np.floor(fraction * t))), t) - tile
    return max(1, k)


def tile_counts(lengths: jax.Array, t: int, tile: int, *, budget: int, fraction: float,
                min_keys: int) -> jax.Array:
    """``int32[B, n_tiles]``: how many of each tile's top keys each row attends (above)."""
    lengths = lengths.astype(jnp.int32)
    start = jnp.arange(num_tiles(t, tile), dtype=jnp.int32)[None, :] * tile  # [1, nt]
    if budget:
        return jnp.minimum(budget, start) + jnp.zeros_like(lengths)[:, None]
    frac = lambda n: jnp.floor(n.astype(jnp.float32) * fraction).astype(jnp.int32)  # noqa: E731
    row_k = jnp.maximum(jnp.minimum(jnp.maximum(frac(lengths), min_keys), lengths) - tile, 0)[:, None]
    rolling = jnp.maximum(frac(start), min_keys)
    return jnp.minimum(jnp.minimum(row_k, rolling), start).astype(jnp.int32)


def causal_probabilities(q, k, lengths):
    """Exact causal softmax ``f32[B, Hq, T, T]`` (keys ``j <= i`` and ``j < L``)."""
    b, t, hq, d = q.shape
    s = jnp.einsum("bthd,bhsd->bhts", q.astype(jnp.float32), _group(k, hq).astype(jnp.float32)) * (d ** -0.5)
    i, j = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
    ok = (j <= i)[None, None] & (j[None, None] < lengths[:, None, None, None])
    return jax.nn.softmax(jnp.where(ok, s, NEG), axis=-1)


def tile_scores(p, lengths, tile: int, num_kv_heads: int):
    """``f32[B, Hkv, n_tiles, T]``: ``p [B, Hq, T, T]`` summed over each GQA group and
    over each tile's valid queries; keys at or after the tile's start are -inf."""
    b, hq, t, _ = p.shape
    nt = num_tiles(t, tile)
    valid_q = (jnp.arange(t)[None, :] < lengths[:, None])[:, None, :, None]  # [B, 1, T, 1]
    g = jnp.where(valid_q, p, 0.0).reshape(b, num_kv_heads, hq // num_kv_heads, t, t).sum(2)  # [B, Hkv, T, T]
    g = jnp.pad(g, ((0, 0), (0, 0), (0, nt * tile - t), (0, 0))).reshape(b, num_kv_heads, nt, tile, t).sum(3)
    before = jnp.arange(t)[None, :] < (jnp.arange(nt) * tile)[:, None]  # [nt, T]
    return jnp.where(before[None, None], g, -jnp.inf)


def tile_topk(scores, width: int):
    """``int32[B, Hkv, n_tiles, width]``: each tile's keys, best first."""
    return jax.lax.top_k(scores, width)[1].astype(jnp.int32)


def selection_mask(indices, counts, t: int, tile: int):
    """``bool[B, Hkv, T(queries), T(keys)]``: query ``i`` (tile ``n = i // tile``) sees the
    first ``counts[b, n]`` keys of ``indices[b, h, n]`` (those ``<= i``) and keys ``n * tile .. i``."""
    b, hkv, nt, kk = indices.shape
    valid = jnp.arange(kk)[None, None, None, :] < counts[:, None, :, None]
    idx = jnp.where(valid, indices, t)  # out of range: dropped
    sel = jax.vmap(jax.vmap(jax.vmap(lambda r: jnp.zeros((t,), bool).at[r].set(True, mode="drop"))))(idx)
    q_tile = jnp.arange(t) // tile
    per_query = sel[:, :, q_tile, :]  # [B, Hkv, T, T]
    i, j = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
    diagonal = (j >= (i // tile) * tile) & (j <= i)
    return (per_query & (j <= i)[None, None]) | diagonal[None, None]  # causal, whatever was selected


def masked_attention(q, k, v, mask):
    """``[B, T, Hq, D]``: each query's softmax over the keys ``mask [B, Hkv, T, T]`` allows."""
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    s = jnp.einsum("bthd,bhsd->bhts", q.astype(jnp.float32), _group(k, hq).astype(jnp.float32)) * (d ** -0.5)
    m = jnp.repeat(mask, hq // hkv, axis=1)
    p = jax.nn.softmax(jnp.where(m, s, NEG), axis=-1)
    o = jnp.einsum("bhts,bhsd->bthd", p, _group(v, hq).astype(jnp.float32))
    return o.astype(q.dtype)


def _select(p, lengths, num_kv_heads: int, *, tile: int, budget: int, fraction: float, min_keys: int) -> dict:
    t = p.shape[-1]
    width = tile_width(t, tile, budget=budget, fraction=fraction, min_keys=min_keys)
    scores = tile_scores(p, lengths, tile, num_kv_heads)
    return {"indices": tile_topk(scores, width),  # width <= t (tile_width)
            "counts": tile_counts(lengths, t, tile, budget=budget, fraction=fraction, min_keys=min_keys)}


def anchor_selection(q, k, lengths, **args):
    """An anchor's per-tile top-k: ``{"indices": int32[B, Hkv, nt, K], "counts": int32[B, nt]}``
    (``args``: ``tile, budget, fraction, min_keys``)."""
    return _select(causal_probabilities(q, k, lengths), lengths, k.shape[2], **args)


def anchor_attention(q, k, v, lengths, **args):
    """An anchor layer: ``(out [B, T, Hq, D], its selection)``. The exact probabilities are
    computed once: they give the selection, and renormalised over it (each tile's top-k
    plus the diagonal tile) the output."""
    hq, hkv = q.shape[2], k.shape[2]
    p = causal_probabilities(q, k, lengths)
    sel = _select(p, lengths, hkv, **args)
    mask = jnp.repeat(selection_mask(sel["indices"], sel["counts"], q.shape[1], args["tile"]), hq // hkv, axis=1)
    kept = jnp.where(mask, p, 0.0)
    kept = kept / jnp.maximum(kept.sum(-1, keepdims=True), 1e-30)  # the query itself is always kept
    o = jnp.einsum("bhts,bhsd->bthd", kept, _group(v, hq).astype(jnp.float32))
    return o.astype(q.dtype), sel


def reused(carry, head_map):
    """The carry as KV head ``h`` reads it: anchor head ``head_map[h]``'s selection."""
    if head_map is None:
        return carry["indices"]
    return jnp.take(carry["indices"], jnp.asarray(head_map, jnp.int32), axis=1)


def tiled_attention(q, k, v, indices, counts, tile: int):
    """Attention over each tile's selected keys plus its diagonal tile."""
    return masked_attention(q, k, v, selection_mask(indices, counts, q.shape[1], tile))


def empty_carry(batch: int, num_kv_heads: int, t: int, *, tile: int, budget: int, fraction: float,
                min_keys: int) -> dict:
    width = tile_width(t, tile, budget=budget, fraction=fraction, min_keys=min_keys)
    nt = num_tiles(t, tile)
    return {"indices": jnp.zeros((batch, num_kv_heads, nt, width), jnp.int32),
            "counts": jnp.zeros((batch, nt), jnp.int32)}
