"""Token-gather sparse decode attention: Pallas (Triton) kernel + jnp reference.

Shapes (one new query token per sequence, head-major KV cache):

* ``q``        ``[B, Hq, D]``
* ``k``, ``v`` ``[B, Hkv, S, D]``
* ``indices``  ``int32[B, Hkv, K]``: selected token positions per KV head
* ``counts``   ``int32[B, Hkv]``: how many leading entries of ``indices`` count

Query head ``i`` belongs to KV head ``i // G`` with ``G = Hq // Hkv``. For each
``(b, h)`` the G query heads of the group attend to the tokens
``indices[b, h, :min(counts[b, h], K)]``, softmax over exactly those tokens.

* Entries past the count are ignored whatever they hold (garbage, negative,
  ``>= S``). A count ``<= 0`` gives a zero output (and ``m = MASK_VALUE``,
  ``l = 0``). Counts above K are clamped to K.
* Entries inside the count must lie in ``[0, S)``; out-of-range ones are
  clamped into range (a memory-safety guard, not a feature).
* Duplicated positions inside the count are attended once per occurrence
  (the kernel does not deduplicate; callers are expected not to produce them).
* ``kv_batch_share = r`` (default 1): ``q``, ``indices`` and ``counts`` have
  ``r`` times k's batch, and q's batch row ``i`` reads k/v row ``i // r``: many
  lists over one cache without copying it (Kascade's tiled prefill: one row per
  (batch, KV head, query tile), ``sparse_jax.methods.kascade.prefill``).

The output is ``[B, Hq, D]`` in q's dtype; logits, softmax and accumulation are
float32. With ``return_residuals=True`` the result is ``(out, (m, l))`` with
``m, l`` float32 ``[B, Hq]`` (see ``pallas_kernels.merge``).

GPU kernel design
-----------------
Grid ``(B, Hkv, num_splits)``. One program owns one GQA group: its q tile is
``[G_pad, D]`` (G padded with zero rows up to >= 16, because Triton's ``tl.dot``
needs M >= 16; the padding is a masked load of the group's G rows, not a
padded copy of q), so every gathered K/V row is loaded once and used by all G
query heads through tensor-core dots. The K selected slots are cut into
``num_splits`` contiguous shares (flash-decoding) so that small ``B * Hkv``
still fills the GPU; each program loops over its share in tiles of
``block_k`` slots:

1. load ``block_k`` indices (a masked ``pl.ds`` slice of the whole index row at
   the split's offset: the list is read in place, never padded),
2. mask slots past the count and point them at row 0 (always in bounds, so the
   gather needs no load mask),
3. gather the K rows: ``k_ref[idx]`` with an int-array indexer lowers to a
   pointer gather ``base + idx[:, None] * D + arange(D)[None, :]``, contiguous
   along D (vectorised loads),
4. ``logits = q @ k.T`` ``[G_pad, block_k]``, online softmax in float32,
   ``o += p @ v`` with V gathered the same way.

Each split writes unnormalised ``(o, m, l)`` of the G real heads (masked
stores); a small jnp epilogue (``merge.combine_splits``) merges the splits.
Tiling comes from the tuned table (``pallas_kernels.tuning``) on the GPU when
the caller gives none. ``prefetch=1`` double-buffers tile t+1's rows in
registers while tile t computes. (Loading only tile t+1's indices ahead was
tried and removed: cold on the H100 it was slower than none at every K from 512 to
4096, at B=1 and B=8; docs/kernels.md, 'Index prefetch'.)
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
from pallas_kernels.split_merge import MERGES, merge_splits_pallas, merge_splits_reference
from pallas_kernels._util import exp_fast, next_pow2

# Tuning defaults (the lead sweeps these on the H100).
DEFAULT_BLOCK_K = 64          # gathered tokens per inner-loop tile
DEFAULT_NUM_WARPS = 4
DEFAULT_NUM_STAGES = 2
MIN_TOKENS_PER_SPLIT = 256    # below this a split's fixed cost dominates
TARGET_PROGRAMS = 264         # ~2 waves of programs on 132 SMs (H100 SXM)
MIN_GROUP_ROWS = 16           # tl.dot needs M >= 16

TUNING_KEYS = ("block_k", "num_splits", "num_warps", "num_stages", "prefetch", "merge")



def _is_pow2(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def unsupported_reason(head_dim: int) -> str | None:
    """Why the Triton kernel cannot run this head_dim, or None if it can."""
    if not _is_pow2(head_dim) or head_dim < 16:
        return f"head_dim must be a power of two >= 16 for the Triton kernel, got {head_dim}"
    return None


def choose_num_splits(work_items: int, items_per_tile: int, min_items_per_split: int,
                      num_rows: int) -> int:
    """Default flash-decoding split count.

    ``work_items`` slots, processed ``items_per_tile`` at a time; ``num_rows`` =
    ``B * Hkv`` programs per split. Split until the grid has about
    TARGET_PROGRAMS programs, but keep >= ``min_items_per_split`` slots per
    split and never more splits than tiles.
    """
    tiles = max(1, -(-work_items // items_per_tile))
    want = max(1, -(-TARGET_PROGRAMS // max(1, num_rows)))
    by_work = max(1, work_items // max(1, min_items_per_split))
    return max(1, min(want, by_work, tiles))


# --------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------

def gathered_attention_reference(q, k, v, pos, valid, scale: float,
                                 return_residuals: bool):
    """Shared jnp reference: attention of each GQA group over gathered tokens.

    q ``[B, Hq, D]``; k, v ``[B // r, Hkv, S, D]`` (q's row ``i`` reads k/v row
    ``i // r``; r = 1 unless ``kv_batch_share``); pos ``int32[B, Hkv, T]`` (any
    values where ``valid`` is False); valid ``bool[B, Hkv, T]``.
    """
    B, Hq, D = q.shape
    Bk, Hkv, S, _ = k.shape
    G = Hq // Hkv
    pos = jnp.where(valid, jnp.clip(pos, 0, S - 1), 0).astype(jnp.int32)
    qg = q.reshape(B, Hkv, G, D).astype(jnp.float32)
    if Bk == B:
        kg = jnp.take_along_axis(k, pos[..., None], axis=2).astype(jnp.float32)
        vg = jnp.take_along_axis(v, pos[..., None], axis=2).astype(jnp.float32)
    else:  # gather straight from the shared rows (no [B, Hkv, S, D] copy)
        rows = (jnp.arange(B, dtype=jnp.int32) // (B // Bk))[:, None, None]
        heads = jnp.arange(Hkv, dtype=jnp.int32)[None, :, None]
        kg = k[rows, heads, pos].astype(jnp.float32)
        vg = v[rows, heads, pos].astype(jnp.float32)
    hi = lax.Precision.HIGHEST  # no TF32 in the reference on GPU
    logits = jnp.einsum("bhgd,bhtd->bhgt", qg, kg, precision=hi) * scale
    vmask = valid[:, :, None, :]
    logits = jnp.where(vmask, logits, MASK_VALUE)
    m = jnp.max(logits, axis=-1, initial=MASK_VALUE)
    # where() rather than relying on exp(MASK - m) == 0: for an empty set
    # m == MASK and exp(0) would be 1.
    p = jnp.where(vmask, jnp.exp(logits - m[..., None]), 0.0)
    l = jnp.sum(p, axis=-1)
    o = jnp.einsum("bhgt,bhtd->bhgd", p, vg, precision=hi)
    o = o / jnp.where(l > 0, l, 1.0)[..., None]
    out = o.reshape(B, Hq, D).astype(q.dtype)
    if return_residuals:
        return out, (m.reshape(B, Hq), l.reshape(B, Hq))
    return out


@functools.partial(jax.jit, static_argnames=("scale", "return_residuals"))
def sparse_decode_attention_reference(q, k, v, indices, counts, *, scale=None,
                                      return_residuals=False):
    """Pure-jnp reference (float32 math). Same contract as the kernel (k's batch
    may divide q's: ``kv_batch_share``)."""
    K = indices.shape[-1]
    scale = default_scale(q.shape[-1]) if scale is None else float(scale)
    cnt = jnp.clip(counts.astype(jnp.int32), 0, K)
    valid = jnp.arange(K, dtype=jnp.int32)[None, None, :] < cnt[..., None]
    return gathered_attention_reference(q, k, v, indices.astype(jnp.int32), valid,
                                        scale, return_residuals)


# --------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------

def online_softmax_step(q, k, v, valid, carry, *, scale: float, precision, interpret: bool = False):
    """One flash step for a tile: q ``[G_pad, D]``, k/v ``[T, D]``, valid ``[T]``.

    Shared by both decode kernels (and Kascade's tiled prefill, which runs the gather
    kernel with a tile's 128 query rows: compute-bound, where the exponential's cost
    shows). ``carry = (o [G_pad, D] f32, m [G_pad] f32, l [G_pad] f32)``; o is
    unnormalised, ``m`` in natural-log units (the residuals callers merge). Each
    exponential is the MUFU ``ex2.approx`` of ``x * log2 e`` (``exp_fast``), not
    libdevice's ``expf``.
    """
    exp = functools.partial(exp_fast, interpret=interpret)

    o_prev, m_prev, l_prev = carry
    logits = plgpu.dot(q, k, trans_b=True, precision=precision) * scale  # [G_pad, T] f32
    vmask = valid[None, :]
    logits = jnp.where(vmask, logits, MASK_VALUE)
    m_next = jnp.maximum(m_prev, jnp.max(logits, axis=-1))
    corr = exp(m_prev - m_next)
    # where(): a fully masked tile (possible in the block-sparse kernel) with
    # m_prev == MASK would otherwise give exp(0) = 1 for every masked slot.
    p = jnp.where(vmask, exp(logits - m_next[:, None]), 0.0)
    l_next = corr * l_prev + jnp.sum(p, axis=-1)
    o_next = corr[:, None] * o_prev + plgpu.dot(p.astype(v.dtype), v, precision=precision)
    return o_next, m_next, l_next


def dot_precision(dtype):
    # float32 inputs: IEEE fp32 dot (Triton's default would be TF32, ~1e-3
    # relative error). bf16/f16: native tensor-core dot, f32 accumulation.
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def load_group_q(q_ref):
    """The program's GQA group ``q_ref [G, D]`` as a ``[group_rows(G), D]`` tile with
    zero rows past G (``tl.dot`` needs M >= 16): a masked load, so no padded copy of q
    is made."""
    g_pad = group_rows(q_ref.shape[0])
    rows = jnp.arange(g_pad, dtype=jnp.int32)
    return plgpu.load(q_ref.at[pl.ds(0, g_pad)], mask=(rows < q_ref.shape[0])[:, None], other=0.0)


def store_group(o_ref, m_ref, l_ref, o, m, l):
    """Store the first G rows of the ``[g_pad, ...]`` results into ``o_ref [G, D]``,
    ``m_ref, l_ref [G]`` (masked stores: the outputs hold only real heads)."""
    g_pad = o.shape[0]
    ok = jnp.arange(g_pad, dtype=jnp.int32) < o_ref.shape[0]
    plgpu.store(o_ref.at[pl.ds(0, g_pad)], o, mask=ok[:, None])
    plgpu.store(m_ref.at[pl.ds(0, g_pad)], m, mask=ok)
    plgpu.store(l_ref.at[pl.ds(0, g_pad)], l, mask=ok)


def _sparse_decode_kernel(counts_ref, q_ref, idx_ref, k_ref, v_ref,
                          o_ref, m_ref, l_ref, *,
                          scale: float, block_k: int, k_split: int, K: int, S: int,
                          prefetch: int, precision, interpret: bool = False):
    # Block refs: counts_ref [] ; q_ref [G, D] ; idx_ref [K] (the whole index row:
    # this split reads [split * k_split, ...) with masked loads, so the list needs no
    # padded copy) ; k_ref, v_ref [S, D] (this (b, h)'s whole cache row) ;
    # o_ref [G, D] f32 ; m_ref, l_ref [G] f32.
    d = q_ref.shape[-1]
    split = pl.program_id(2)
    count = jnp.clip(counts_ref[()], 0, K)
    base = split * k_split
    # Valid slots of this split: [split * k_split, count) ∩ the split's range.
    n_valid = jnp.clip(count - base, 0, k_split)
    # Only tiles with >= 1 valid slot are visited (early exit for short rows).
    n_tiles = lax.div(n_valid + (block_k - 1), block_k)

    q = load_group_q(q_ref)
    g_pad = q.shape[0]
    lanes = jnp.arange(block_k, dtype=jnp.int32)

    def load_indices(t):
        start = t * block_k
        valid = start + lanes < n_valid
        idx = plgpu.load(idx_ref.at[pl.ds(base + start, block_k)], mask=valid, other=0)
        # Slots past the count may hold anything: point them at row 0 so the
        # gather stays in bounds; their logits are masked below.
        return valid, jnp.where(valid, jnp.clip(idx, 0, S - 1), 0)

    def fetch(t):
        valid, idx = load_indices(t)
        return valid, k_ref[idx], v_ref[idx]  # [block_k, D] row gathers

    init = (
        jnp.zeros((g_pad, d), jnp.float32),
        jnp.full((g_pad,), MASK_VALUE, jnp.float32),
        jnp.zeros((g_pad,), jnp.float32),
    )
    if not prefetch:
        def body(t, carry):
            valid, k, v = fetch(t)
            return online_softmax_step(q, k, v, valid, carry, scale=scale, precision=precision,
                                       interpret=interpret)

        o, m, l = lax.fori_loop(0, n_tiles, body, init)
    else:
        # Register double buffering: tile t+1's indices and rows are loaded before tile
        # t is computed, so the gather latency overlaps the math (the loop is too short
        # for Triton's pipeliner to hide it: a split holds a few tiles). The fetch past
        # the last tile reads row 0 only (all lanes masked).
        def body(t, carry):
            acc, (valid, k, v) = carry
            nxt = fetch(t + 1)
            return online_softmax_step(q, k, v, valid, acc, scale=scale, precision=precision,
                                       interpret=interpret), nxt

        (o, m, l), _ = lax.fori_loop(0, n_tiles, body, (init, fetch(0)))
    store_group(o_ref, m_ref, l_ref, o, m, l)


def resolve_sparse_tuning(B: int, Hkv: int, K: int, D: int, *, block_k=None,
                          num_splits=None):
    """Static tiling for the token-gather kernel: (block_k, num_splits, k_split)."""
    if block_k is None:
        block_k = DEFAULT_BLOCK_K if D <= 128 else 32
        # Short selections: don't pad a 40-slot row to 64.
        block_k = min(block_k, max(16, next_pow2(max(K, 1))))
    block_k = int(block_k)
    if not _is_pow2(block_k) or block_k < 16:
        raise ValueError(f"block_k must be a power of two >= 16, got {block_k}")
    tiles = max(1, -(-K // block_k))
    if num_splits is None:
        num_splits = choose_num_splits(K, block_k, MIN_TOKENS_PER_SPLIT, B * Hkv)
    num_splits = int(num_splits)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    num_splits = min(num_splits, tiles)
    tiles_per_split = -(-tiles // num_splits)
    num_splits = -(-tiles // tiles_per_split)  # drop splits that would be empty
    return block_k, num_splits, tiles_per_split * block_k


@functools.partial(
    jax.jit,
    static_argnames=("scale", "return_residuals", "block_k", "num_splits",
                     "num_warps", "num_stages", "prefetch", "merge", "interpret"),
)
def sparse_decode_attention_pallas(q, k, v, indices, counts, *, scale=None,
                                   return_residuals=False, block_k=None,
                                   num_splits=None, num_warps=None,
                                   num_stages=None, prefetch=None, merge=None, interpret=False):
    """Pallas-Triton token-gather decode attention (see module docstring).

    Tuning: ``block_k`` (tokens per tile, power of two >= 16; default 64 for
    D <= 128 else 32, capped by K), ``num_splits`` (default from
    ``choose_num_splits``), ``num_warps`` (4), ``num_stages`` (2), ``prefetch``
    (default 0; 1 loads tile t+1's indices and rows while tile t computes), ``merge``
    (how the splits merge: "xla", the default, or "pallas"; see :func:`finish_splits`).
    k's batch may divide q's (``kv_batch_share = q batch // k batch``, read off the shapes).
    """
    B, Hq, D = q.shape
    Bk, Hkv, S, _ = k.shape
    assert B % Bk == 0, (q.shape, k.shape)
    K = indices.shape[-1]
    prefetch = 0 if prefetch is None else int(prefetch)
    if prefetch not in (0, 1):
        raise ValueError(f"prefetch must be 0 or 1, got {prefetch}")
    scale = default_scale(D) if scale is None else float(scale)
    block_k, ns, k_split = resolve_sparse_tuning(B, Hkv, K, D, block_k=block_k,
                                                 num_splits=num_splits)

    kernel = functools.partial(
        _sparse_decode_kernel, scale=scale, block_k=block_k, k_split=k_split,
        K=K, S=S, prefetch=prefetch, precision=dot_precision(q.dtype), interpret=interpret)
    return split_decode_call(
        kernel, q, k, v, indices, k_split, ns, head_scalars=(counts,),
        name=f"sparse_decode_bk{block_k}_ns{ns}", num_warps=num_warps,
        num_stages=num_stages, interpret=interpret, return_residuals=return_residuals,
        kv_batch_share=B // Bk, merge=merge)


def group_rows(G: int) -> int:
    """Rows of a program's query tile: G padded up to ``MIN_GROUP_ROWS`` or the next
    power of two (``tl.dot`` needs M >= 16)."""
    return max(MIN_GROUP_ROWS, next_pow2(G))


def split_decode_call(kernel, q, k, v, split_list, per_split: int, ns: int, *,
                      head_scalars=(), row_scalars=(), row_vectors=(), name: str, num_warps=None,
                      num_stages=None, interpret=False, return_residuals=False,
                      kv_batch_share: int = 1, merge=None):
    """The scaffolding the decode kernels share: GQA grouping, the ``pallas_call``
    over grid ``(B, Hkv, ns)`` and the merge of the splits.

    ``kernel(*head_scalars, *row_scalars, q, list, k, v, o, m, l)`` gets per
    program: each of ``head_scalars`` (``[B, Hkv]`` arrays) and ``row_scalars``
    (``[B]``) as a scalar ref, each of ``row_vectors`` (``[B, W]``, e.g. a block table) as
    its row's ``[W]``; ``q`` as ``[G, D]`` (its GQA group; load it with
    :func:`load_group_q`); the whole row ``[N]`` of ``split_list [B, Hkv, N]``,
    of which split ``s`` owns entries ``[s * per_split, (s + 1) * per_split)``
    (read with masked loads: nothing is padded); the whole ``k, v [S, D]`` of its
    KV head; and writes the split's partial ``o [G, D]``, ``m, l [G]`` (f32,
    with :func:`store_group`), merged here (:func:`finish_splits`, ``merge``). No XLA
    copies surround the kernel: q and the list go in as they are, and the
    outputs hold real heads only. ``kv_batch_share = r``: k, v hold ``B / r``
    rows and program ``(b, h)`` reads row ``b // r`` (the rest is per q row).
    """
    B, Hq, D = q.shape
    _, Hkv, S, _ = k.shape
    G = Hq // Hkv
    r = int(kv_batch_share)
    assert r >= 1 and B == k.shape[0] * r, (q.shape, k.shape, r)
    assert ns * per_split >= split_list.shape[-1], (ns, per_split, split_list.shape)
    qg = q.reshape(B, Hkv, G, D)
    lst = split_list.astype(jnp.int32)
    if lst.shape[-1] == 0:  # an empty list selects nothing; a zero-size block cannot be mapped
        lst = jnp.zeros((B, Hkv, 1), jnp.int32)
    n = lst.shape[-1]

    def kv_row(b):
        return b if r == 1 else lax.div(b, jnp.int32(r))

    in_specs = ([pl.BlockSpec((None, None), lambda b, h, s: (b, h)) for _ in head_scalars]
                + [pl.BlockSpec((None,), lambda b, h, s: (b,)) for _ in row_scalars]
                + [pl.BlockSpec((None, x.shape[1]), lambda b, h, s: (b, 0)) for x in row_vectors]
                + [pl.BlockSpec((None, None, G, D), lambda b, h, s: (b, h, 0, 0)),            # q
                   pl.BlockSpec((None, None, n), lambda b, h, s: (b, h, 0)),                  # list
                   pl.BlockSpec((None, None, S, D), lambda b, h, s: (kv_row(b), h, 0, 0)),    # k
                   pl.BlockSpec((None, None, S, D), lambda b, h, s: (kv_row(b), h, 0, 0))])   # v
    o, m, l = pl.pallas_call(
        kernel,
        grid=(B, Hkv, ns),
        in_specs=in_specs,
        **split_outputs(B, Hkv, ns, G, D),
        compiler_params=plgpu.CompilerParams(
            num_warps=DEFAULT_NUM_WARPS if num_warps is None else int(num_warps),
            num_stages=DEFAULT_NUM_STAGES if num_stages is None else int(num_stages)),
        interpret=interpret,
        name=name,
    )(*(x.astype(jnp.int32) for x in head_scalars), *(x.astype(jnp.int32) for x in row_scalars),
      *(x.astype(jnp.int32) for x in row_vectors), qg, lst, k, v)
    return finish_splits(o, m, l, G, q.dtype, return_residuals, merge=merge, interpret=interpret)


def split_outputs(B: int, Hkv: int, ns: int, G: int, D: int) -> dict:
    """``out_specs`` and ``out_shape`` of a decode kernel with grid ``(B, Hkv, ns)``
    writing per-split partials: ``o [B, Hkv, ns, G, D]``, ``m, l [B, Hkv, ns, G]`` (f32)."""
    return dict(
        out_specs=[
            pl.BlockSpec((None, None, None, G, D), lambda b, h, s: (b, h, s, 0, 0)),
            pl.BlockSpec((None, None, None, G), lambda b, h, s: (b, h, s, 0)),
            pl.BlockSpec((None, None, None, G), lambda b, h, s: (b, h, s, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((B, Hkv, ns, G, D), jnp.float32),
            jax.ShapeDtypeStruct((B, Hkv, ns, G), jnp.float32),
            jax.ShapeDtypeStruct((B, Hkv, ns, G), jnp.float32),
        ],
    )


def finish_splits(o, m, l, G: int, out_dtype, return_residuals: bool, *, merge=None, interpret=False):
    """Merge the kernel's per-split partials ``[B, Hkv, NS, G, ...]``.

    ``merge``: "xla" (default; ``combine_splits`` in jnp, one or two XLA fusions) or
    "pallas" (``pallas_kernels.split_merge``, one kernel launch).
    """
    merge = "xla" if merge is None else merge
    if merge not in MERGES:
        raise ValueError(f"merge must be one of {MERGES}, got {merge!r}")
    B, Hkv = o.shape[:2]
    D = o.shape[-1]
    if merge == "pallas":
        out, m_all, l_all = merge_splits_pallas(o, m, l, jnp.dtype(out_dtype), interpret=interpret)
    else:
        # JAX's own decode kernel notes NaNs after jit without a barrier here;
        # it costs nothing, so keep the max from being fused into the kernel inputs.
        m = lax.optimization_barrier(m)
        out, m_all, l_all = merge_splits_reference(o, m, l, out_dtype)
    out = out.reshape(B, Hkv * G, D)
    if return_residuals:
        return out, (m_all.reshape(B, Hkv * G), l_all.reshape(B, Hkv * G))
    return out
