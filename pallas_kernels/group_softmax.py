"""Kascade's anchor step: exact decode softmax probabilities summed over each GQA
group, ``[B, Hkv, S]`` f32 (Pallas-Triton kernel + jnp reference).

Shapes: ``q [B, Hq, D]``, ``k [B, Hkv, S, D]`` (head-major cache, post-RoPE),
``lengths int32[B]``: positions ``< lengths[b]`` are valid. Query head ``i``
belongs to KV head ``i // G``, ``G = Hq // Hkv``. The result is

    p[b, h, s] = sum_g softmax_s(q[b, h*G+g] . k[b, h, s] * scale)   (s < lengths[b])

and 0 at and past ``lengths[b]``. Scale defaults to ``1/sqrt(D)``.

GPU kernel design: one pass over K. Grid ``(B * Hkv, splits)``; a program owns
one KV head's contiguous share of the positions (flash-decoding splits, so
that small ``B * Hkv`` fills the GPU) and walks it in tiles of ``block_s``
positions, stopping at the row's length. Per tile it loads the ``[block_s,
D]`` keys once and computes each of the G query heads' logits with
multiply-and-reduce on the CUDA cores (a decode GEMV: G is 1-8, far below the
16 rows a tensor-core dot needs, and padding G to 16 would multiply the
logits written by up to 16), writes the raw logits ``[G, block_s]`` and keeps
a running max and sum of exponentials per head. A small jnp epilogue merges
the splits' ``(m, l)`` into each head's log-sum-exp and computes
``sum_g exp(logit - lse_g)``, which XLA fuses into one pass over the logits
(``G * 4`` bytes per position against the ``2 * D`` bytes of K read).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.merge import MASK_VALUE
from pallas_kernels.sparse_decode import choose_num_splits

DEFAULT_BLOCK_S = 64
MIN_TOKENS_PER_SPLIT = 1024


def unsupported_reason(seq_len: int, head_dim: int) -> str | None:
    if head_dim < 16 or head_dim & (head_dim - 1):
        return f"head_dim must be a power of two >= 16 for the Triton kernel, got {head_dim}"
    if seq_len % 16:
        return f"the cache length must be a multiple of 16 for the kernel, got {seq_len}"
    return None


@functools.partial(jax.jit, static_argnames=("scale",))
def group_softmax_reference(q, k, lengths, *, scale=None):
    """Pure-jnp reference (float32 math, same contract)."""
    b, hq, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    qg = q.reshape(b, hkv, hq // hkv, d).astype(jnp.float32)
    logits = jnp.einsum("bhgd,bhsd->bhgs", qg, k.astype(jnp.float32), precision=lax.Precision.HIGHEST) * scale
    valid = (jnp.arange(s)[None, :] < lengths[:, None])[:, None, None, :]
    logits = jnp.where(valid, logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.where(valid, jnp.exp(logits - m), 0.0)
    den = jnp.sum(e, axis=-1, keepdims=True)
    return jnp.sum(e / jnp.where(den > 0, den, 1.0), axis=2)


def _pick_block(seq_len: int, block_s: int) -> int:
    blk = block_s
    while blk > 16 and seq_len % blk:
        blk //= 2
    return blk


def _kernel(len_ref, q_ref, k_ref, s_ref, m_ref, l_ref, *, groups: int, block: int, chunk: int, scale: float):
    # len_ref []: the row's length; q_ref [G_pad, D]; k_ref [S, D] (this KV head);
    # s_ref [G_pad, S] raw logits (this program writes its share of columns);
    # m_ref, l_ref [G_pad]: this split's running max and sum of exponentials
    split = pl.program_id(1)
    s_len = k_ref.shape[0]
    length = jnp.minimum(len_ref[()], s_len)
    start0 = split * chunk
    n_tiles = jnp.clip(lax.div(length - start0 + block - 1, block), 0, chunk // block)
    lanes = jnp.arange(block, dtype=jnp.int32)
    qs = [q_ref[g, :].astype(jnp.float32) for g in range(groups)]

    def body(t, carry):
        start = start0 + t * block
        kt = k_ref[pl.ds(start, block), :].astype(jnp.float32)  # [block, D]
        valid = start + lanes < length
        out = []
        for g in range(groups):
            m, l = carry[g]
            s = jnp.sum(kt * qs[g][None, :], axis=1) * scale
            s = jnp.where(valid, s, MASK_VALUE)
            s_ref[g, pl.ds(start, block)] = s
            m_new = jnp.maximum(m, jnp.max(s))
            l = l * jnp.exp(m - m_new) + jnp.sum(jnp.where(valid, jnp.exp(s - m_new), 0.0))
            out.append((m_new, l))
        return tuple(out)

    init = tuple((jnp.float32(MASK_VALUE), jnp.float32(0.0)) for _ in range(groups))
    res = lax.fori_loop(0, n_tiles, body, init)
    g_pad = m_ref.shape[0]
    rows = jnp.arange(g_pad)
    m_vec = jnp.full((g_pad,), MASK_VALUE, jnp.float32)
    l_vec = jnp.zeros((g_pad,), jnp.float32)
    for g in range(groups):
        m_vec = jnp.where(rows == g, res[g][0], m_vec)
        l_vec = jnp.where(rows == g, res[g][1], l_vec)
    m_ref[...] = m_vec
    l_ref[...] = l_vec


@functools.partial(jax.jit, static_argnames=("scale", "block_s", "num_splits", "num_warps", "num_stages",
                                             "interpret"))
def group_softmax_pallas(q, k, lengths, *, scale=None, block_s=None, num_splits=None, num_warps=None,
                         num_stages=None, interpret=False):
    """The kernel (module docstring). Tuning: ``block_s`` (positions per tile, a power
    of two >= 16 dividing S; default 64, halved until it divides S), ``num_splits``
    (default: about 264 programs, >= 1024 positions each), ``num_warps`` (4),
    ``num_stages`` (2)."""
    b, hq, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    g = hq // hkv
    g_pad = 1 << max(0, (g - 1).bit_length())
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    block = _pick_block(s, int(block_s or DEFAULT_BLOCK_S))
    if s % block or block & (block - 1):
        raise ValueError(f"block_s must be a power of two dividing the cache length {s}, got {block}")
    tiles = s // block
    ns = int(num_splits) if num_splits else choose_num_splits(s, block, MIN_TOKENS_PER_SPLIT, b * hkv)
    ns = max(1, min(ns, tiles))
    chunk = -(-tiles // ns) * block
    ns = -(-s // chunk)
    r = b * hkv
    qg = q.reshape(r, g, d)
    if g_pad != g:
        qg = jnp.pad(qg, ((0, 0), (0, g_pad - g), (0, 0)))
    rows_len = jnp.repeat(lengths.astype(jnp.int32), hkv)
    kernel = functools.partial(_kernel, groups=g, block=block, chunk=chunk, scale=scale)
    logits, m, l = pl.pallas_call(
        kernel,
        grid=(r, ns),
        in_specs=[pl.BlockSpec((None,), lambda i, j: (i,)),
                  pl.BlockSpec((None, g_pad, d), lambda i, j: (i, 0, 0)),
                  pl.BlockSpec((None, s, d), lambda i, j: (i, 0, 0))],
        out_specs=[pl.BlockSpec((None, g_pad, s), lambda i, j: (i, 0, 0)),
                   pl.BlockSpec((None, None, g_pad), lambda i, j: (i, j, 0)),
                   pl.BlockSpec((None, None, g_pad), lambda i, j: (i, j, 0))],
        out_shape=[jax.ShapeDtypeStruct((r, g_pad, s), jnp.float32),
                   jax.ShapeDtypeStruct((r, ns, g_pad), jnp.float32),
                   jax.ShapeDtypeStruct((r, ns, g_pad), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=4 if num_warps is None else int(num_warps),
                                             num_stages=2 if num_stages is None else int(num_stages)),
        interpret=interpret,
        name=f"group_softmax_bs{block}_ns{ns}",
    )(rows_len, qg, k.reshape(r, s, d))
    # log-sum-exp per query head over the splits (the m of a split with no valid
    # position is MASK_VALUE and its l is 0: it adds nothing)
    m = lax.optimization_barrier(m[..., :g])
    l = l[..., :g]
    m_all = jnp.max(m, axis=1)  # [R, G]
    l_all = jnp.sum(l * jnp.exp(m - m_all[:, None, :]), axis=1)
    lse = m_all + jnp.log(jnp.where(l_all > 0, l_all, 1.0))
    valid = jnp.arange(s)[None, :] < rows_len[:, None]
    p = jnp.sum(jnp.exp(logits[:, :g, :] - lse[..., None]), axis=1)  # [R, S]
    p = jnp.where(valid, p, 0.0)
    return p.reshape(b, hkv, s)
