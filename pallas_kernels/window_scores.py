"""Token Sparse Attention's step 1, the window scores: Pallas-Triton kernel.

Shapes (prefill layout): ``q [B, T, Hq, D]``, ``k [B, T, Hkv, D]``, ``lengths
int32[B]`` (a row's valid tokens, ``0 <= L <= T``), a static ``window`` W >= 1.
Query head ``i`` belongs to KV head ``i // G``, ``G = Hq // Hkv``. With ``P = L -
W`` and the window queries at positions ``p_w = L - W + w`` (``w < W``), the
result ``[B, Hq, T]`` float32 is

    s[b, h, j] = 1/W * sum_w softmax_{j' <= p_w}(q[b, p_w, h] . k[b, j', h // G] / sqrt(D))[j]

for ``j < P`` (the prefix) and 0 elsewhere (all 0 when ``L <= W``). The jnp
reference is :func:`sparse_jax.ops.window_scores.window_scores_reference`; the public op,
with the argument checks and the ``impl`` dispatch, is
:func:`sparse_jax.ops.window_scores.window_scores`.

GPU kernel design
-----------------
The reference materialises the ``[B, Hq, W, T]`` f32 probabilities (2 GB at
T = 128K with 32 heads and W = 128). The kernel never does: it keeps one
``[block_q, block_k]`` logit tile in registers at a time, in two passes over
K, both tiled over keys and both reading K in place (strided ``[T, D]`` view of
one KV head, no transpose or repeat copy).

*Query layout.* A jnp prologue gathers the W window queries of each row and
groups them per KV head: ``[B, Hkv, R, D]`` with ``R = G * Wp`` rows ordered
``(g, w)``, where ``Wp`` is W rounded up to a multiple of ``block_q`` (padding
rows sit at position -1: they see no key). Small: ``B * Hq * Wp * D``.

*Pass 1, log-sum-exp* (flash-decoding). Grid ``(B, Hkv, num_splits, row
groups)``; a
program owns a contiguous share of the keys (``num_splits`` chosen so the grid
has about 264 programs, >= 512 keys each: small ``B * Hkv`` still fills the
GPU) and walks it in ``block_k`` tiles, stopping at the row's length. Each K
tile is loaded once and used by every query row of the program's row group: for
each of its row chunks (a static loop; Triton keeps them all live, so the rows
are cut into groups whose chunks and K tiles fit ``SMEM_BUDGET_BYTES``: one group
at D = 128, two at D = 256 with 4 heads) ``s = q_chunk @ k_tile.T`` on the
tensor cores (``tl.dot``; f32 inputs in IEEE f32), causal mask ``j <= p_w``,
running max and sum of exponentials per row. It writes ``(m, l) [R]`` per
split; a jnp epilogue merges the splits into each row's log-sum-exp (padding
rows and rows without a key: a huge lse, so their terms below are exactly 0).

*Pass 2, scores.* Grid ``(B, Hkv, ceil(T / block_k))``; one program per key
tile, which loads the tile once (tiles at or past the prefix only write zeros)
and, per query head g of the group, sums ``exp(s - lse)`` over that head's
window rows (chunks of ``block_q``), divided by W: ``[block_k]`` per head,
written to the ``[B, Hkv, G, T]`` output (that is ``[B, Hq, T]``). No causal
mask is needed here: every window query sits at or after ``P``, so it sees the
whole prefix. Keys past the prefix read as zero (masked loads) and their
outputs are zeroed; T need not be a multiple of any tile.

Cost: each pass is ``2 * B * Hq * Wp * T * D`` FLOP (tensor cores) and ``B * Hq *
Wp * T`` exponentials; K is read once per pass from HBM, the window queries
once per key tile (from L2).

Supported: ``D`` in {64, 128, 256} (:func:`unsupported_reason`); q and k of
one dtype (f32, bf16 or f16).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._util import next_pow2
from pallas_kernels.merge import MASK_VALUE
from pallas_kernels.sparse_decode import choose_num_splits, dot_precision

SUPPORTED_HEAD_DIMS = (64, 128, 256)
DEFAULT_BLOCK_Q = 64           # window rows per dot (M)
MIN_TOKENS_PER_SPLIT = 512     # pass 1: keys per split at least
NO_KEYS_LSE = 1e30             # lse of a row without keys: exp(s - lse) == 0
TUNING_KEYS = ("block_q", "block_k", "num_splits", "num_warps", "num_stages")
#: pass 1's shared-memory estimate per program (its row chunks plus the pipelined K
#: tiles) stays within this: 192 KiB is what D = 128, 4 heads, W = 128 takes, and compiles
SMEM_BUDGET_BYTES = 200 * 1024


def unsupported_reason(head_dim: int, q_dtype=None, k_dtype=None) -> str | None:
    """Why the kernel cannot run these arguments, or None if it can."""
    if head_dim not in SUPPORTED_HEAD_DIMS:
        return f"the window-scores kernel supports head_dim {SUPPORTED_HEAD_DIMS}, got {head_dim}"
    if q_dtype is not None and k_dtype is not None and jnp.dtype(q_dtype) != jnp.dtype(k_dtype):
        return f"the window-scores kernel needs q and k of one dtype, got {jnp.dtype(q_dtype)} and {jnp.dtype(k_dtype)}"
    return None


def resolve_tuning(window: int, head_dim: int, *, block_q=None, block_k=None) -> tuple[int, int]:
    """``(block_q, block_k)``: window rows and keys per tile (powers of two >= 16)."""
    if block_q is None:
        block_q = min(DEFAULT_BLOCK_Q, max(16, next_pow2(window)))
    if block_k is None:
        block_k = 128 if head_dim <= 128 else 64
    for name, v in (("block_q", block_q), ("block_k", block_k)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 16 or v & (v - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {v!r}")
    return block_q, block_k


def num_row_groups(n_chunks: int, block_q: int, block_k: int, head_dim: int, itemsize: int, stages: int) -> int:
    """Pass 1's row groups: the fewest that divide the ``n_chunks`` row chunks of a GQA
    group so one group's chunks plus ``stages`` K tiles fit ``SMEM_BUDGET_BYTES``."""
    fit = max(1, (SMEM_BUDGET_BYTES - stages * block_k * head_dim * itemsize) // (block_q * head_dim * itemsize))
    per_group = max(c for c in range(1, n_chunks + 1) if n_chunks % c == 0 and c <= fit)
    return n_chunks // per_group


def _lse_kernel(len_ref, rowpos_ref, q_ref, k_ref, m_ref, l_ref, *, seq_len, block_q, block_k, chunk,
                scale, precision):
    # len_ref []: the row's length; rowpos_ref [Wp]: each window row's position (-1: none);
    # q_ref [Rg, D]: this program's share of the group's window queries (row group
    # program_id(3) of rows (g, w)); k_ref [T, D]: this KV head;
    # m_ref, l_ref [Rg]: this split's running max and sum of exponentials per row.
    split = pl.program_id(2)
    rows, wp = q_ref.shape[0], rowpos_ref.shape[0]
    n_chunks, per_head = rows // block_q, wp // block_q
    first_chunk = pl.program_id(3) * n_chunks  # this row group's first chunk among the group's
    length = jnp.clip(len_ref[()], 0, seq_len)
    start0 = split * chunk
    n_tiles = jnp.clip(lax.div(length - start0 + block_k - 1, block_k), 0, chunk // block_k)
    lanes = jnp.arange(block_k, dtype=jnp.int32)
    rowpos = [rowpos_ref[pl.ds(lax.rem(first_chunk + c, per_head) * block_q, block_q)] for c in range(n_chunks)]

    def body(i, carry):
        start = start0 + i * block_k
        kpos = start + lanes
        kt = plgpu.load(k_ref.at[pl.ds(start, block_k), :], mask=(kpos < length)[:, None], other=0.0)
        out = []
        for c in range(n_chunks):  # every row chunk of the group uses this K tile
            m, l = carry[c]
            q = q_ref[pl.ds(c * block_q, block_q), :]
            s = plgpu.dot(q, kt, trans_b=True, precision=precision) * scale  # [block_q, block_k] f32
            ok = kpos[None, :] <= rowpos[c][:, None]  # causal; implies j < L
            s = jnp.where(ok, s, MASK_VALUE)
            m_new = jnp.maximum(m, jnp.max(s, axis=1))
            p = jnp.where(ok, jnp.exp(s - m_new[:, None]), 0.0)
            out.append((m_new, l * jnp.exp(m - m_new) + jnp.sum(p, axis=1)))
        return tuple(out)

    init = tuple((jnp.full((block_q,), MASK_VALUE, jnp.float32), jnp.zeros((block_q,), jnp.float32))
                 for _ in range(n_chunks))
    res = lax.fori_loop(0, n_tiles, body, init)
    for c in range(n_chunks):
        m_ref[pl.ds(c * block_q, block_q)] = res[c][0]
        l_ref[pl.ds(c * block_q, block_q)] = res[c][1]


def _scores_kernel(prefix_ref, q_ref, lse_ref, k_ref, o_ref, *, seq_len, window, groups, block_q, block_k,
                   scale, precision):
    # prefix_ref []: the keys scored, [0, prefix); q_ref [R, D]; lse_ref [R]; k_ref [T, D];
    # o_ref [G, T]: this KV head's query heads.
    tile = pl.program_id(2)
    wp = q_ref.shape[0] // groups
    start = tile * block_k
    kpos = start + jnp.arange(block_k, dtype=jnp.int32)
    prefix = prefix_ref[()]
    in_prefix = kpos < prefix
    in_bounds = kpos < seq_len

    @pl.when(start < prefix)
    def _():
        kt = plgpu.load(k_ref.at[pl.ds(start, block_k), :], mask=in_prefix[:, None], other=0.0)
        for g in range(groups):
            def body(c, acc, g=g):
                r0 = g * wp + c * block_q
                q = q_ref[pl.ds(r0, block_q), :]
                lse = lse_ref[pl.ds(r0, block_q)]
                s = plgpu.dot(q, kt, trans_b=True, precision=precision) * scale
                return acc + jnp.sum(jnp.exp(s - lse[:, None]), axis=0)

            acc = lax.fori_loop(0, wp // block_q, body, jnp.zeros((block_k,), jnp.float32))
            plgpu.store(o_ref.at[pl.ds(g, 1), pl.ds(start, block_k)],
                        jnp.where(in_prefix, acc / window, 0.0)[None, :], mask=in_bounds[None, :])

    @pl.when(start >= prefix)
    def _():
        for g in range(groups):
            plgpu.store(o_ref.at[pl.ds(g, 1), pl.ds(start, block_k)], jnp.zeros((1, block_k), jnp.float32),
                        mask=in_bounds[None, :])


@functools.partial(jax.jit, static_argnames=("window", "block_q", "block_k", "num_splits", "num_warps",
                                             "num_stages", "interpret"))
def window_scores_pallas(q, k, lengths, *, window, q_start=None, prefix=None, block_q=None, block_k=None,
                         num_splits=None, num_warps=None, num_stages=None, interpret=False):
    """The kernel (module docstring); no argument checks (see the public op).
    A chunk of a prompt (chunked prefill): ``q [B, Tq, Hq, D]`` holds positions
    ``q_start .. q_start + Tq - 1`` (``q_start`` int32, may be traced); a window row
    before ``q_start`` has no query and scores nothing, and the result is the mean over
    the rows that have one. ``prefix int32[B]``: the keys scored, ``[0, prefix)``
    (default ``L - W``); it must not pass the first live window query's position (pass 2
    applies no causal mask).
    Tuning: ``block_q`` (window rows per dot, default ``min(64, next_pow2(W))``,
    at least 16), ``block_k`` (keys per tile; 128, or 64 for D = 256),
    ``num_splits`` (pass 1's key splits; default about 264 programs, >= 512 keys
    each), ``num_warps`` (4, or 8 for D = 256), ``num_stages`` (2)."""
    b, tq, hq, d = q.shape
    t, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    window = int(window)
    bq, bk = resolve_tuning(window, d, block_q=block_q, block_k=block_k)
    wp = -(-window // bq) * bq
    r = g * wp
    scale = 1.0 / math.sqrt(d)
    precision = dot_precision(q.dtype)
    params = plgpu.CompilerParams(num_warps=(4 if d <= 128 else 8) if num_warps is None else int(num_warps),
                                  num_stages=2 if num_stages is None else int(num_stages))

    lengths = jnp.clip(lengths.astype(jnp.int32), 0, t)
    first = jnp.int32(0) if q_start is None else jnp.asarray(q_start, jnp.int32)
    w = jnp.arange(wp, dtype=jnp.int32)
    pos = lengths[:, None] - window + w[None, :]  # [B, Wp]
    live = (w[None, :] < window) & (pos >= first)
    rowpos = jnp.where(live, pos, -1)  # < 0: no key at all
    qw = jnp.take_along_axis(q, jnp.clip(pos - first, 0, tq - 1)[:, :, None, None], axis=1)  # [B, Wp, Hq, D]
    qw = qw.reshape(b, wp, hkv, g, d).transpose(0, 2, 3, 1, 4).reshape(b, hkv, r, d)

    tiles = -(-t // bk)
    # pass 1 keeps every row chunk of its program live across the key loop (Triton hoists
    # the loads): the group's rows are cut into row groups whose chunks, with the pipelined
    # K tiles, fit the shared memory (D = 256 with 4 heads and W = 128 asked for 320 KiB)
    row_groups = num_row_groups(r // bq, bq, bk, d, jnp.dtype(q.dtype).itemsize,
                                2 if num_stages is None else int(num_stages))
    rg = r // row_groups
    ns = int(num_splits) if num_splits else choose_num_splits(t, bk, MIN_TOKENS_PER_SPLIT, b * hkv * row_groups)
    ns = max(1, min(ns, tiles))
    chunk = -(-tiles // ns) * bk
    ns = -(-t // chunk)
    len_spec = pl.BlockSpec((None,), lambda i, j, s, *_: (i,))
    q_spec = pl.BlockSpec((None, None, r, d), lambda i, j, s: (i, j, 0, 0))
    k_spec = pl.BlockSpec((None, t, None, d), lambda i, j, s, *_: (i, 0, j, 0))
    stat_spec = pl.BlockSpec((None, None, None, rg), lambda i, j, s, c: (i, j, s, c))
    m, l = pl.pallas_call(
        functools.partial(_lse_kernel, seq_len=t, block_q=bq, block_k=bk, chunk=chunk, scale=scale,
                          precision=precision),
        grid=(b, hkv, ns, row_groups),
        in_specs=[len_spec, pl.BlockSpec((None, wp), lambda i, j, s, c: (i, 0)),
                  pl.BlockSpec((None, None, rg, d), lambda i, j, s, c: (i, j, c, 0)), k_spec],
        out_specs=[stat_spec, stat_spec],
        out_shape=[jax.ShapeDtypeStruct((b, hkv, ns, r), jnp.float32)] * 2,
        compiler_params=params,
        interpret=interpret,
        name=f"tsa_window_lse_bq{bq}_bk{bk}_ns{ns}_rg{row_groups}",
    )(lengths, rowpos, qw, k)
    # each row's log-sum-exp over the splits (a split without keys: m = MASK_VALUE, l = 0)
    m_all = jnp.max(m, axis=2)
    l_all = jnp.sum(l * jnp.exp(m - m_all[:, :, None, :]), axis=2)
    lse = jnp.where(l_all > 0, m_all + jnp.log(jnp.where(l_all > 0, l_all, 1.0)), NO_KEYS_LSE)  # [B, Hkv, R]

    prefix = lengths - window if prefix is None else jnp.minimum(prefix.astype(jnp.int32), t)
    out = pl.pallas_call(
        functools.partial(_scores_kernel, seq_len=t, window=window, groups=g, block_q=bq, block_k=bk, scale=scale,
                          precision=precision),
        grid=(b, hkv, tiles),
        in_specs=[len_spec, q_spec, pl.BlockSpec((None, None, r), lambda i, j, s: (i, j, 0)), k_spec],
        out_specs=pl.BlockSpec((None, None, g, t), lambda i, j, s: (i, j, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((b, hkv, g, t), jnp.float32),
        compiler_params=params,
        interpret=interpret,
        name=f"tsa_window_scores_bq{bq}_bk{bk}",
    )(prefix, qw, lse, k)
    out = out.reshape(b, hq, t)
    if q_start is None:
        return out
    n_live = live.sum(-1).astype(jnp.float32)  # pass 2 divided by W: the mean over the live rows
    return out * (window / jnp.maximum(n_live, 1.0))[:, None, None]
