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

The reference (``impl="masked"``) builds dense ``[T, T]`` masks and probabilities: exact,
for tests and CPU; not fast. On the fast path an anchor's selection comes from
:func:`anchor_selection_chunked` (the same indices, chunk by chunk of query tiles, at
most ``max_chunk_bytes`` of f32 logits at a time) and the fast path (``impl="composed"``, :func:`tiled_attention_composed`)
is a composition of existing kernels, exact for the selections the anchors make:

(a) the tile's selected keys: a sparse *decode* attention
    (``sparse_jax.ops.attention.sparse_decode_attention``, the token-gather kernel)
    with one row per (batch, KV head, tile) whose GQA group is the tile's
    ``tile x G`` query rows, all reading that tile's list; the rows share the
    head-major K/V through ``kv_batch_share`` (no per-tile copy);
(b) the diagonal tile: causal attention inside each ``tile`` of queries (an einsum
    over ``[tile, tile]`` blocks, cheap);
(c) the two log-sum-exp merged (``merge_attention``): the selected keys lie before
    the tile and the diagonal's inside it, disjoint sets, so the merge is the softmax
    over their union, which is what the masked reference attends.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels import tile_scores as _ts
from sparse_jax.ops._dispatch import resolve_impl
from sparse_jax.ops.attention import merge_attention, sparse_decode_attention
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


#: default byte budget of one chunk's f32 probabilities in :func:`anchor_selection_chunked`
#: (2 GiB: 16 tiles of 32 queries at T = 32K for Qwen3-8B's 32 query heads, B = 1)
MAX_CHUNK_BYTES = 2 << 30


#: the kernel path cuts the tiles into at least this many chunks: a chunk scores (and top-k sorts)
#: rows only as long as its own causal prefix (:func:`key_bounds`), about half the keys of whole rows
MIN_CHUNKS = 8


def key_bounds(n_chunks: int, chunk_queries: int, t: int) -> list[tuple[int, int, int]]:
    """``[(first chunk, end chunk, keys)]``: groups of consecutive chunks and the static
    key count each scores, at least every key its queries attend (``(end chunk) *
    chunk_queries``, at most ``t``). Up to 16 chunks each get their own count; more
    are grouped by powers of two (chunks ``[2^(g-1), 2^g)``), so that the programs
    stay few while the rows average about 2/3 of the keys, not all of them."""
    if n_chunks <= 16:
        return [(i, i + 1, min(t, (i + 1) * chunk_queries)) for i in range(n_chunks)]
    out, c0 = [], 0
    while c0 < n_chunks:
        c1 = min(n_chunks, max(1, 2 * c0))
        out.append((c0, c1, min(t, c1 * chunk_queries)))
        c0 = c1
    return out


def chunk_tiles(batch: int, num_q_heads: int, t: int, tile: int, max_chunk_bytes: int = MAX_CHUNK_BYTES) -> int:
    """Tiles per chunk of :func:`anchor_selection_chunked`: the most whose f32 logits
    ``[B, Hq, chunk * tile, T]`` fit ``max_chunk_bytes`` (at least 1, at most all)."""
    per_tile = batch * num_q_heads * tile * t * 4
    return int(max(1, min(num_tiles(t, tile), max_chunk_bytes // per_tile)))


def anchor_selection_chunked(q, k, lengths, *, tile: int, budget: int, fraction: float, min_keys: int,
                             max_chunk_bytes: int = MAX_CHUNK_BYTES, chunk: int | None = None,
                             scores_impl: str = "auto", scores_tuning: dict | None = None):
    """:func:`anchor_selection` without the ``[B, Hq, T, T]`` probabilities: the same
    indices and counts, chunk by chunk of query tiles.

    A chunk of ``c`` tiles (``c * tile`` queries) needs its queries' whole causal key
    rows anyway, so each chunk computes its exact softmax ``[B, Hq, c * tile, T]`` (the
    reference's f32 math, row by row: the same logits, mask and ``jax.nn.softmax``), sums
    it over each GQA group and each tile's valid queries, masks keys at or after the
    tile start and takes ``lax.top_k(width)``, under ``lax.map`` over the chunks: one
    chunk's arrays live at a time. ``c`` (``chunk``, else :func:`chunk_tiles`) is the
    most tiles whose f32 logits fit ``max_chunk_bytes``; the peak is a small multiple
    of that (logits, their exponentials, the group sum: about 2-3x, XLA's fusion
    decides), plus the f32 grouped keys ``[B, Hq, T, D]``. Tiles past ``T`` in the last
    chunk are padding, dropped.

    A chunk scores only the keys its queries can see (:func:`key_bounds`: its own end,
    or for many chunks the end of its power-of-two group), not all ``T``: the early
    chunks' rows are short, which halves the scores written and the keys ``top_k``
    sorts (it costs the whole row whatever ``width`` is). The keys cut off are ``-inf``
    (at or after every tile start of the chunk), so where ``width`` exceeds the row,
    the indices ``top_k`` over the whole row would add (those keys, lowest first) are
    appended: the result is the same.

    ``scores_impl`` ("auto" | "pallas" | "reference", ``sparse_jax.ops._dispatch``): a
    chunk's tile scores from the Pallas kernel (``pallas_kernels.tile_scores``: two
    flash-style passes, no logits in HBM; 2x the QK FLOP of causal attention) or the
    f32 reference above; "auto": the kernel on the GPU where it supports the head size
    and tile. Under the kernel a chunk is the most tiles whose f32 scores ``[B, Hkv, c,
    T]`` fit ``max_chunk_bytes``, and at most an eighth of the tiles (:data:`MIN_CHUNKS`);
    ``scores_tuning`` (``block_k``, ``num_warps``, ``num_stages``) goes to the kernel.
    The kernel's dot runs on the tensor cores (bf16 inputs, f32 accumulation), so
    near-ties may order differently from the f32 reference.
    """
    choice, interpret = resolve_impl(scores_impl, kernel_unsupported=_ts.unsupported_reason(
        q.shape[3], tile, q.dtype, k.dtype))
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    nt = num_tiles(t, tile)
    width = tile_width(t, tile, budget=budget, fraction=fraction, min_keys=min_keys)
    lengths = lengths.astype(jnp.int32)
    if chunk is None:  # the most tiles whose f32 logits (reference) or scores (kernel) fit
        if choice == "reference":
            chunk = chunk_tiles(b, hq, t, tile, max_chunk_bytes)
        else:  # and at least MIN_CHUNKS chunks, so that the early ones score short rows (below)
            chunk = min(max_chunk_bytes // (b * hkv * t * 4), -(-nt // MIN_CHUNKS))
    c = int(max(1, min(chunk, nt)))
    nc = -(-nt // c)
    if choice == "reference":
        kg = _group(k, hq).astype(jnp.float32)  # [B, Hq, T, D], as causal_probabilities
        qp = jnp.pad(q, ((0, 0), (0, nc * c * tile - t), (0, 0), (0, 0)))
        operands = (qp.reshape(b, nc, c * tile, hq, d).swapaxes(0, 1), kg, lengths)  # q: [nc, B, rows, Hq, D]
    else:
        operands = (q, k, lengths)

    def chunk_scores(ops, ci, bound: int):  # [B, Hkv, c, bound]: keys 0 .. bound - 1
        if choice == "pallas":
            return _ts.tile_scores_pallas(*ops, ci * c, tile=tile, chunk=c, out_len=bound, interpret=interpret,
                                          **(scores_tuning or {}))
        qc, kg, lengths = ops
        rows = c * tile
        j = jnp.arange(bound)[None, :]
        s = jnp.einsum("bthd,bhsd->bhts", qc[ci].astype(jnp.float32), kg[:, :, :bound]) * (d ** -0.5)
        i = ci * rows + jnp.arange(rows)[:, None]  # [rows, 1]: the chunk's query positions
        ok = (j <= i)[None, None] & (j[None, None] < lengths[:, None, None, None])
        p = jax.nn.softmax(jnp.where(ok, s, NEG), axis=-1)  # [B, Hq, rows, bound]: whole causal rows
        valid_q = (i[None, :, 0] < lengths[:, None])[:, None, :, None]  # [B, 1, rows, 1]
        gs = jnp.where(valid_q, p, 0.0).reshape(b, hkv, g, rows, bound).sum(2)
        gs = gs.reshape(b, hkv, c, tile, bound).sum(3)
        before = j < ((ci * c + jnp.arange(c)) * tile)[:, None]  # [c, bound]
        return jnp.where(before[None, None], gs, -jnp.inf)

    def chunk_topk(ci, ops, bound: int):  # [B, Hkv, c, width]
        top = tile_topk(chunk_scores(ops, ci, bound), min(width, bound))
        if width > bound:  # what top_k over the whole row adds: keys bound, bound + 1, ... (-inf, lowest first)
            extra = width - bound
            pad = jnp.broadcast_to(bound + jnp.arange(extra, dtype=jnp.int32), top.shape[:-1] + (extra,))
            top = jnp.concatenate([top, pad], axis=-1)
        return top

    parts = []
    for c0, c1, bound in key_bounds(nc, c * tile, t):
        if parts:  # one group at a time, as lax.map runs one chunk at a time: the next group's inputs
            operands, _ = lax.optimization_barrier((operands, parts[-1]))  # wait for the last result
        if c1 - c0 == 1:
            parts.append(chunk_topk(jnp.int32(c0), operands, bound)[None])
        else:
            parts.append(lax.map(lambda ci, bound=bound, ops=operands: chunk_topk(ci, ops, bound),
                                 jnp.arange(c0, c1, dtype=jnp.int32)))
    idx = jnp.concatenate(parts, axis=0) if len(parts) > 1 else parts[0]
    idx = idx.transpose(1, 2, 0, 3, 4).reshape(b, hkv, nc * c, width)[:, :, :nt]  # from [nc, B, Hkv, c, width]
    return {"indices": idx,
            "counts": tile_counts(lengths, t, tile, budget=budget, fraction=fraction, min_keys=min_keys)}


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


#: most query-row elements (rows x head_dim) one program of the gather kernel holds:
#: its f32 accumulator is ``rows x D``. 128 x 128 = a tile of 32 queries of a GQA group
#: of 4 at D=128 (Qwen3-8B, Llama-3.1-8B); a larger group or head splits the tile into
#: several kernel calls over the same lists (a guess from register pressure, unmeasured
#: beyond D=128, G=4)
MAX_ROW_ELEMENTS = 128 * 128
IMPLS = ("composed", "masked")


def tiled_attention_composed(q, k, v, indices, counts, tile: int, *, impl: str = "auto",
                             max_rows: int | None = None, **tuning):
    """:func:`tiled_attention` as a composition of existing kernels (module docstring).

    Shapes as :func:`tiled_attention`: ``q [B, T, Hq, D]``, ``k, v [B, T, Hkv, D]``,
    ``indices int32[B, Hkv, n_tiles, K]``, ``counts int32[B, n_tiles]``. Equal to it
    (up to float rounding) when each tile's listed keys (the first ``counts`` entries)
    are distinct and lie before the tile, as every anchor's selection does
    (:func:`tile_scores` leaves only keys before the tile to pick, and ``counts <=``
    tile start); the reference would also drop a listed key at or after the tile,
    this path would attend it. A count of 0 (the first tile) leaves the diagonal
    alone. Like the reference, lengths play no part: a query past its row's length
    attends its tile's keys as any other (the model never reads it).

    ``impl`` is the gather kernel's (``"auto"``: the Pallas kernel on a GPU, its jnp
    reference elsewhere; ``"pallas"`` runs interpret mode on a CPU); ``tuning`` its
    knobs (``sparse_jax.ops.attention.SPARSE_TUNING_KEYS``). A tile whose ``tile x G``
    rows exceed ``max_rows`` (default ``MAX_ROW_ELEMENTS // D``, at least 16) runs as
    several calls over equal slices of its queries (the same lists, read again).
    """
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    nt = num_tiles(t, tile)
    kk = indices.shape[-1]
    assert indices.shape == (b, hkv, nt, kk) and counts.shape == (b, nt), (indices.shape, counts.shape)
    scale = d ** -0.5
    pad = ((0, 0), (0, nt * tile - t), (0, 0), (0, 0))
    # q as [B, Hkv, nt, tile, G, D]: the rows of one (batch, KV head, tile) together
    qt = jnp.pad(q, pad).reshape(b, nt, tile, hkv, g, d).transpose(0, 3, 1, 2, 4, 5)

    # (b) the diagonal tile, causal: f32 logits, the partial (o, m, l) of merge_attention
    kd = jnp.pad(k, pad).reshape(b, nt, tile, hkv, d)
    vd = jnp.pad(v, pad).reshape(b, nt, tile, hkv, d)
    hi = lax.Precision.HIGHEST
    s = jnp.einsum("bhnqgd,bnkhd->bhnqgk", qt, kd, precision=hi, preferred_element_type=jnp.float32) * scale
    causal = (jnp.arange(tile)[:, None] >= jnp.arange(tile)[None, :])[:, None, :]  # [tile(q), 1, tile(k)]
    s = jnp.where(causal, s, NEG)
    m_d = s.max(-1)  # every query sees itself: finite
    p = jnp.exp(s - m_d[..., None])
    l_d = p.sum(-1)
    o_d = jnp.einsum("bhnqgk,bnkhd->bhnqgd", p, vd.astype(jnp.float32), precision=hi) / l_d[..., None]

    # (a) the selected keys: one gather-kernel row per (batch, KV head, tile), K/V shared
    kh = k.transpose(0, 2, 1, 3).reshape(b * hkv, 1, t, d)  # head-major, row (b, h)
    vh = v.transpose(0, 2, 1, 3).reshape(b * hkv, 1, t, d)
    idx = indices.astype(jnp.int32).reshape(b * hkv * nt, 1, kk)  # a free reshape
    cnt = jnp.broadcast_to(counts.astype(jnp.int32)[:, None, :], (b, hkv, nt)).reshape(b * hkv * nt, 1)
    if max_rows is None:
        max_rows = max(16, MAX_ROW_ELEMENTS // d)
    per = max(1, min(tile, max_rows // g))
    while tile % per:  # equal slices of the tile
        per -= 1
    rows = b * hkv * nt
    outs = []
    for c in range(0, tile, per):
        qc = qt[:, :, :, c:c + per].reshape(rows, per * g, d)
        o_s, res_s = sparse_decode_attention(qc, kh, vh, idx, cnt, scale=scale, return_residuals=True,
                                             impl=impl, kv_batch_share=nt, **tuning)
        part = (slice(None),) * 3 + (slice(c, c + per),)
        res_d = (m_d[part].reshape(rows, per * g), l_d[part].reshape(rows, per * g))
        # (c) the union of two disjoint sets: the log-sum-exp merge
        o = merge_attention(o_d[part].reshape(rows, per * g, d).astype(jnp.float32), res_d,
                            o_s.astype(jnp.float32), res_s)
        outs.append(o.reshape(b, hkv, nt, per, g, d))
    o = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=3)
    o = o.transpose(0, 2, 3, 1, 4, 5).reshape(b, nt * tile, hq, d)[:, :t]
    return o.astype(q.dtype)


def tiled_attention_impl(q, k, v, indices, counts, tile: int, *, impl: str = "composed",
                         kernel_impl: str = "auto", **tuning):
    """A reuse layer's attention: ``impl`` "composed" (:func:`tiled_attention_composed`,
    the gather kernel's ``kernel_impl``) or "masked" (:func:`tiled_attention`)."""
    if impl == "masked":
        return tiled_attention(q, k, v, indices, counts, tile)
    if impl != "composed":
        raise ValueError(f"kascade prefill: impl must be one of {IMPLS}, got {impl!r}")
    return tiled_attention_composed(q, k, v, indices, counts, tile, impl=kernel_impl, **tuning)


def anchor_attention_impl(q, k, v, lengths, *, impl: str = "composed", kernel_impl: str = "auto",
                          max_chunk_bytes: int = MAX_CHUNK_BYTES, **args):
    """An anchor layer: ``(out, selection)``. "masked": :func:`anchor_attention` (its
    probabilities renormalised); "composed": the same selection from
    :func:`anchor_selection_chunked` (chunks of ``max_chunk_bytes``), attended by
    :func:`tiled_attention_composed` as a reuse layer attends it: no ``[T, T]`` array.
    The two agree on every query inside its row's length; past it the masked anchor
    keeps only keys before the length, the composed path attends its tile as a reuse
    layer does (rows the model never reads)."""
    if impl == "masked":
        return anchor_attention(q, k, v, lengths, **args)
    if impl != "composed":
        raise ValueError(f"kascade prefill: impl must be one of {IMPLS}, got {impl!r}")
    sel = anchor_selection_chunked(q, k, lengths, max_chunk_bytes=max_chunk_bytes, scores_impl=kernel_impl, **args)
    return tiled_attention_composed(q, k, v, sel["indices"], sel["counts"], args["tile"], impl=kernel_impl), sel


def anchor_selection_impl(q, k, lengths, *, impl: str = "composed", max_chunk_bytes: int = MAX_CHUNK_BYTES,
                          kernel_impl: str = "auto", **args):
    """The dense anchor's selection (it attends densely, by the driver's prefill attention):
    "masked" :func:`anchor_selection` (the ``[T, T]`` reference), "composed"
    :func:`anchor_selection_chunked`."""
    if impl == "masked":
        return anchor_selection(q, k, lengths, **args)
    if impl != "composed":
        raise ValueError(f"kascade prefill: impl must be one of {IMPLS}, got {impl!r}")
    return anchor_selection_chunked(q, k, lengths, max_chunk_bytes=max_chunk_bytes, scores_impl=kernel_impl, **args)


def empty_carry(batch: int, num_kv_heads: int, t: int, *, tile: int, budget: int, fraction: float,
                min_keys: int) -> dict:
    width = tile_width(t, tile, budget=budget, fraction=fraction, min_keys=min_keys)
    nt = num_tiles(t, tile)
    return {"indices": jnp.zeros((batch, num_kv_heads, nt, width), jnp.int32),
            "counts": jnp.zeros((batch, nt), jnp.int32)}
