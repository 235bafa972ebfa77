"""Kascade's anchor-layer tile scores in prefill: Pallas-Triton kernel.

Shapes (prefill layout): ``q [B, T, Hq, D]``, ``k [B, T, Hkv, D]``, ``lengths
int32[B]`` (``0 <= L <= T``), a static query ``tile`` and a chunk of ``C`` query
tiles starting at tile ``n0`` (a traced scalar). Query head ``i`` belongs to KV
head ``i // G``. With ``P[b, h, i, j]`` the exact causal softmax of query ``i``
(keys ``j <= i`` and ``j < L``), the result ``f32[B, Hkv, C, T]`` is

    s[b, h, c, j] = sum_{g < G} sum_{i in tile n0 + c, i < L} P[b, h * G + g, i, j]

for keys ``j`` before the tile's start, and ``-inf`` from the tile's start on:
what :func:`sparse_jax.methods.kascade.prefill.tile_scores` computes from the
materialised ``[B, Hq, T, T]`` probabilities (the jnp reference;
:func:`sparse_jax.methods.kascade.prefill.anchor_selection_chunked` calls this kernel, or
the reference, chunk by chunk and takes the per-tile top-k).

GPU kernel design
-----------------
The reference path builds each chunk's f32 logits, their softmax and the group
sums in HBM: on the H100 at 32K (Qwen3-8B heads) an anchor layer's selection took
many times cuDNN's whole causal attention (docs/methods.md, Kascade's anchor selection
table). The kernel keeps one
``[tile, block_k]`` logit tile in registers at a time.

Grid ``(B, Hkv, C)``: one program per (row, KV head, query tile), its ``R = Gp *
tile`` query rows loaded once as one ``[R, D]`` operand (``q`` is laid out ``[B,
Hkv, n_tiles * R, D]``, rows ordered (tile, head, query), by a jnp prologue: one
copy of q; ``Gp`` is ``G`` rounded up to a power of two, its extra heads zero and
masked), so each key tile costs one ``[R, block_k]`` dot: a tile of 32 queries alone
would be an M = 32 dot, a quarter of a tensor-core tile at G = 4. Two passes over K, both reading one KV head's ``[T,
D]`` in place:

*Pass 1, log-sum-exp* of each query row over its causal keys (``j <= i``, ``j
< L``), flash style: running max and sum of exponentials per row, ``tl.dot`` on
the tensor cores (f32 inputs in IEEE f32). The key tiles wholly before the query
tile's start (and ``L``) are causal for every row, so only the last few carry a
mask.

*Pass 2, scores* over the keys before the tile's start (all of them causal for
every query of the tile): ``exp(s - lse)`` summed over the tile's valid queries
and the group's heads, ``[block_k]`` per key tile, stored; keys at or past ``L``
score 0 (their probability is 0), keys from the tile's start on ``-inf``. Its dot
is the transpose, ``[block_k, R]``, so that the sum over queries runs along the
accumulator's rows (inside a warp) rather than down its columns (across warps).

Both passes are bound by the exponentials and the elementwise work, not the dots
(one exponential per 2D FLOP, against one per 4D in attention): logits are kept in
base-2 units (``scale * log2 e`` folded in once) and every exponential is the MUFU
``ex2.approx`` (``pallas_kernels._util.exp2_fast``; libdevice's ``expf``, what
``jnp.exp`` lowers to, is a dozen FP32 instructions).

Cost: ``2 * B * Hq * D`` FLOP per (query, causal key) pair in each pass (twice
the QK of causal attention), and the ``B * Hkv * C * T`` f32 output.

Supported: ``D`` in {64, 128, 256} (:func:`unsupported_reason`); q and k of one
dtype (f32, bf16 or f16); ``tile`` a power of two >= 16.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._util import LOG2E, exp2_fast, next_pow2
from pallas_kernels.merge import MASK_VALUE
from pallas_kernels.sparse_decode import dot_precision

SUPPORTED_HEAD_DIMS = (64, 128, 256)
NO_KEYS_LSE = 1e30  # lse of a row without keys: exp2(s - lse) == 0


def unsupported_reason(head_dim: int, tile: int, q_dtype=None, k_dtype=None) -> str | None:
    """Why the kernel cannot run these arguments, or None if it can."""
    if head_dim not in SUPPORTED_HEAD_DIMS:
        return f"the tile-scores kernel supports head_dim {SUPPORTED_HEAD_DIMS}, got {head_dim}"
    if tile < 16 or tile & (tile - 1):
        return f"the tile-scores kernel needs a query tile that is a power of two >= 16, got {tile}"
    if q_dtype is not None and k_dtype is not None and jnp.dtype(q_dtype) != jnp.dtype(k_dtype):
        return f"the tile-scores kernel needs q and k of one dtype, got {jnp.dtype(q_dtype)} and {jnp.dtype(k_dtype)}"
    return None


def _kernel(n0_ref, len_ref, q_ref, k_ref, o_ref, *, seq_len, out_len, tile, groups, block_k, scale, precision,
            interpret):
    # n0_ref []: the chunk's first tile; len_ref []: the row's length; q_ref [NT * R, D]: this KV
    # head's queries, R = Gp * tile rows per query tile ordered (g, i), heads past G zero;
    # k_ref [T, D]: this KV head; o_ref [out_len]: this tile's scores for keys 0 .. out_len - 1.
    # Logits are kept in log2 units (scale * log2(e) folded in once) so that every exponential is
    # one MUFU ex2 (exp2_fast), not libdevice's expf.
    n = n0_ref[()] + pl.program_id(2)
    q0 = n * tile
    length = jnp.clip(len_ref[()], 0, seq_len)
    r = q_ref.shape[0] // -(-seq_len // tile)  # rows per query tile
    rows = jnp.arange(r, dtype=jnp.int32)
    qpos = q0 + rows % tile
    valid_q = (rows // tile < groups) & (qpos < length)
    lanes = jnp.arange(block_k, dtype=jnp.int32)
    # the whole group's rows in one [R, D] operand: one dot per key tile (M = R, not tile)
    qt = plgpu.load(q_ref.at[pl.ds(n * r, r), :], mask=(n * r + rows < q_ref.shape[0])[:, None], other=0.0)
    c = scale * LOG2E
    exp2 = functools.partial(exp2_fast, interpret=interpret)

    def load_k(start, upto):
        kpos = start + lanes
        return kpos, plgpu.load(k_ref.at[pl.ds(start, block_k), :], mask=(kpos < upto)[:, None], other=0.0)

    # pass 1: each query row's log-sum-exp (base 2) over its causal keys, flash style. Key tiles wholly
    # before min(tile start, length) are causal and valid for every row: no mask there; only the last
    # few (the diagonal, the length) are masked.
    kend = jnp.minimum(q0 + tile, length)
    n_full = lax.div(jnp.maximum(jnp.minimum(q0, length), 0), block_k)

    def full_body(i, carry):
        m, l = carry
        kt = plgpu.load(k_ref.at[pl.ds(i * block_k, block_k), :])
        s = plgpu.dot(qt, kt, trans_b=True, precision=precision) * c  # [R, block_k]
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        return m_new, l * exp2(m - m_new) + jnp.sum(exp2(s - m_new[:, None]), axis=1)

    def tail_body(i, carry):
        m, l = carry
        kpos, kt = load_k(i * block_k, kend)
        ok = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] < length)
        s = jnp.where(ok, plgpu.dot(qt, kt, trans_b=True, precision=precision) * c, MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.where(ok, exp2(s - m_new[:, None]), 0.0)
        return m_new, l * exp2(m - m_new) + jnp.sum(p, axis=1)

    init = (jnp.full((r,), MASK_VALUE, jnp.float32), jnp.zeros((r,), jnp.float32))
    m, l = lax.fori_loop(0, n_full, full_body, init)
    m, l = lax.fori_loop(n_full, lax.div(jnp.maximum(kend, 0) + block_k - 1, block_k), tail_body, (m, l))
    # rows past the length, padding heads and rows without keys contribute nothing: a huge lse
    lse = jnp.where(valid_q & (l > 0), m + jnp.log2(jnp.where(l > 0, l, 1.0)), NO_KEYS_LSE)

    # pass 2: the keys before the tile's start, summed over the tile's queries and the group. The dot
    # is transposed ([block_k, R]: keys on M) so that the sum over the queries runs along a row of
    # the accumulator (within a warp), not down a column (across warps).
    valid_keys = jnp.minimum(q0, length)

    def score_body(i, carry):  # returns its carry: Triton's loop yields a Value, not a literal
        start = i * block_k
        kpos, kt = load_k(start, valid_keys)
        st = plgpu.dot(kt, qt, trans_b=True, precision=precision) * c  # [block_k, R]
        acc = jnp.sum(exp2(st - lse[None, :]), axis=1)
        val = jnp.where(kpos < q0, jnp.where(kpos < length, acc, 0.0), -jnp.inf)
        plgpu.store(o_ref.at[pl.ds(start, block_k)], val, mask=kpos < out_len)
        return carry

    n_before = lax.div(jnp.minimum(q0, out_len) + block_k - 1, block_k)
    lax.fori_loop(0, n_before, score_body, 0)

    def fill_body(i, carry):  # from the tile's start on: not selectable
        start = i * block_k
        kpos = start + lanes
        plgpu.store(o_ref.at[pl.ds(start, block_k)], jnp.full((block_k,), -jnp.inf, jnp.float32),
                    mask=(kpos < out_len) & (kpos >= q0))
        return carry

    lax.fori_loop(lax.div(jnp.minimum(q0, out_len), block_k), lax.div(out_len + block_k - 1, block_k), fill_body, 0)


@functools.partial(jax.jit, static_argnames=("tile", "chunk", "out_len", "block_k", "num_warps", "num_stages",
                                             "interpret"))
def tile_scores_pallas(q, k, lengths, first_tile, *, tile, chunk, out_len=None, block_k=None, num_warps=None,
                       num_stages=None, interpret=False):
    """The kernel (module docstring) for ``chunk`` query tiles from ``first_tile``
    (traced): ``f32[B, Hkv, chunk, out_len]``, the scores of keys ``0 .. out_len - 1``
    (default ``T``; a chunk whose tiles all start at or before ``out_len`` loses
    nothing selectable: the keys past it are ``-inf`` for those tiles). No argument
    checks (see :func:`sparse_jax.methods.kascade.prefill.anchor_selection_chunked`). Tiles
    past the prompt give rows of ``-inf`` past their start (callers drop them). Tuning:
    ``block_k`` (keys per tile; 64, or 32 for D = 256), ``num_warps`` (4, or 8 for
    D = 256), ``num_stages`` (3 for 16-bit inputs at D <= 128: faster than 2 at 128K on the
    H100, docs/methods.md, the anchor step's old/new table; else 2, whose shared memory
    the f32 or D = 256 operands fit)."""
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    bk = (64 if d <= 128 else 32) if block_k is None else int(block_k)
    params = plgpu.CompilerParams(num_warps=(4 if d <= 128 else 8) if num_warps is None else int(num_warps),
                                  num_stages=(3 if d <= 128 and q.dtype.itemsize == 2 else 2) if num_stages is None
                                  else int(num_stages))
    out_len = t if out_len is None else int(out_len)
    nt = -(-t // tile)
    gp = next_pow2(g)  # R = Gp * tile rows per query tile, a power of two for tl.dot
    qg = jnp.pad(q, ((0, 0), (0, nt * tile - t), (0, 0), (0, 0))).reshape(b, nt, tile, hkv, g, d)
    qg = jnp.pad(qg, ((0, 0),) * 4 + ((0, gp - g), (0, 0)))  # zero heads, masked as invalid rows
    qg = qg.transpose(0, 3, 1, 4, 2, 5).reshape(b, hkv, nt * gp * tile, d)  # rows (tile, g, i)
    return pl.pallas_call(
        functools.partial(_kernel, seq_len=t, out_len=out_len, tile=tile, groups=g, block_k=bk,
                          scale=1.0 / math.sqrt(d), precision=dot_precision(q.dtype), interpret=interpret),
        grid=(b, hkv, chunk),
        in_specs=[pl.BlockSpec((None,), lambda i, j, c: (0,)),
                  pl.BlockSpec((None,), lambda i, j, c: (i,)),
                  pl.BlockSpec((None, None, nt * gp * tile, d), lambda i, j, c: (i, j, 0, 0)),
                  pl.BlockSpec((None, t, None, d), lambda i, j, c: (i, 0, j, 0))],
        out_specs=pl.BlockSpec((None, None, None, out_len), lambda i, j, c: (i, j, c, 0)),
        out_shape=jax.ShapeDtypeStruct((b, hkv, chunk, out_len), jnp.float32),
        compiler_params=params,
        interpret=interpret,
        name=f"kascade_tile_scores_t{tile}_bk{bk}",
    )(jnp.asarray(first_tile, jnp.int32).reshape(1), jnp.clip(lengths.astype(jnp.int32), 0, t), qg, k)
