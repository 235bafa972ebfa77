"""Block-sparse decode attention: Pallas (Triton) kernel + jnp reference.

Shapes (one new query token per sequence, head-major KV cache):

* ``q``            ``[B, Hq, D]``
* ``k``, ``v``     ``[B, Hkv, S, D]``
* ``block_indices`` ``int32[B, Hkv, NBsel]``: selected block ids per KV head
* ``block_counts``  ``int32[B, Hkv]``: how many leading entries count
* ``lengths``       ``int32[B]``: valid cache length per sequence

Block ``j`` covers tokens ``[j * block_size, (j + 1) * block_size)``. The G
query heads of KV head ``h`` attend to every token of the blocks
``block_indices[b, h, :min(block_counts[b, h], NBsel)]`` that lies below
``min(lengths[b], S)`` (so a partial last block is handled, and blocks past
the length contribute nothing). Entries past the count are ignored whatever
they hold; a block id inside the count outside ``[0, ceil(S / block_size))``
contributes no tokens; a duplicated block id is attended once per occurrence
(callers should not produce duplicates). An empty token set gives a zero
output (``m = MASK_VALUE``, ``l = 0``).

Output ``[B, Hq, D]`` in q's dtype, float32 math; ``return_residuals=True``
gives ``(out, (m, l))``, ``m, l`` float32 ``[B, Hq]`` (see
``pallas_kernels.merge``).

GPU kernel design
-----------------
Grid ``(B, Hkv, num_splits)``; one program per GQA group with a
``[G_pad, D]`` q tile (G zero-padded to >= 16 for ``tl.dot``), each split owns
a contiguous share of the selected-block slots (flash-decoding), partials
merged by ``merge.combine_splits``. Two inner-loop shapes, chosen statically:

* **contiguous** (``blocks_per_iter == 1``; default when
  ``block_size >= block_k`` or block_size is not a power of two): every
  iteration reads one tile of ``tile = min(block_k, next_pow2(block_size))``
  rows as a contiguous ``pl.ds(block_id * block_size + sub * tile, tile)``
  slice with a row mask (like JAX's paged-attention kernel); blocks longer
  than the tile take ``ceil(block_size / tile)`` iterations.
* **multi-block gather** (``blocks_per_iter = block_k // block_size > 1``;
  default for small power-of-two blocks, e.g. 16): one iteration covers
  ``blocks_per_iter`` blocks (``block_k`` tokens) so the dots are not tiny.
  Token row positions are built in registers
  (``block_id[slot] * block_size + lane % block_size``) and the rows gathered
  like the token-gather kernel; rows are still contiguous within a block.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._util import next_pow2
from pallas_kernels.merge import MASK_VALUE
from pallas_kernels.sparse_decode import (
    DEFAULT_BLOCK_K,
    MIN_TOKENS_PER_SPLIT,
    _is_pow2,
    choose_num_splits,
    default_scale,
    dot_precision,
    gathered_attention_reference,
    load_group_q,
    store_group,
    online_softmax_step,
    split_decode_call,
    unsupported_reason,  # noqa: F401  (re-exported for the dispatcher)
)

TUNING_KEYS = ("block_k", "blocks_per_iter", "num_splits", "num_warps", "num_stages", "merge", "split_schedule")
#: how the splits share a (row, KV head)'s block list: "valid" (default) divides its ``count``
#: valid blocks evenly, "capacity" gives split ``s`` the fixed slots ``[s * per_split, ...)`` of
#: the list, so with fewer valid blocks than the list holds the last splits idle (at half fill a
#: dense row took 75% of its full-fill time, 1.56x cuDNN: paged_decode_h200.md)
SPLIT_SCHEDULES = ("valid", "capacity")


# --------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------

def paged_rows(pool: jax.Array, block_table: jax.Array, block_size: int) -> jax.Array:
    """The rows a block table names, contiguous: ``pool [1, Hkv, P * block_size, D]`` and
    ``block_table int32[B, W]`` -> ``[B, Hkv, W * block_size, D]`` (row ``b``'s logical block
    ``j`` is page ``block_table[b, j]``; an entry outside ``[0, P)`` reads page 0, as the
    kernel does). The reference's view of a paged cache: a copy, the kernel reads in place."""
    _, hkv, n, d = pool.shape
    p = n // block_size
    table = jnp.where((block_table >= 0) & (block_table < p), block_table, 0).astype(jnp.int32)
    pages = pool[0].reshape(hkv, p, block_size, d)[:, table]  # [Hkv, B, W, bs, D]
    b, w = table.shape
    return pages.transpose(1, 0, 2, 3, 4).reshape(b, hkv, w * block_size, d)


@functools.partial(jax.jit, static_argnames=("block_size", "scale", "return_residuals"))
def block_sparse_decode_attention_reference(q, k, v, block_indices, block_counts,
                                            lengths, *, block_size: int, scale=None,
                                            return_residuals=False):
    """Pure-jnp reference (float32 math). Same contract as the kernel.

    Expands the selected blocks into token positions ``[B, Hkv, NBsel *
    block_size]`` and runs the shared gathered-attention reference.
    """
    B, Hkv, S, _ = k.shape
    nb = block_indices.shape[-1]
    scale = default_scale(q.shape[-1]) if scale is None else float(scale)
    n_blocks_total = -(-S // block_size)
    bid = block_indices.astype(jnp.int32)
    cnt = jnp.clip(block_counts.astype(jnp.int32), 0, nb)
    slot_ok = jnp.arange(nb, dtype=jnp.int32)[None, None, :] < cnt[..., None]
    block_ok = slot_ok & (bid >= 0) & (bid < n_blocks_total)
    pos = bid[..., None] * block_size + jnp.arange(block_size, dtype=jnp.int32)
    limit = jnp.minimum(lengths.astype(jnp.int32), S)[:, None, None, None]
    valid = block_ok[..., None] & (pos < limit)
    return gathered_attention_reference(
        q, k, v, pos.reshape(B, Hkv, nb * block_size),
        valid.reshape(B, Hkv, nb * block_size), scale, return_residuals)


# --------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------

def _block_sparse_kernel(counts_ref, len_ref, *refs,
                         scale: float, block_size: int, tile: int, sub_tiles: int,
                         blocks_per_iter: int, blocks_per_split: int, NB: int, S: int,
                         precision, num_splits: int = 1, split_schedule: str = "valid",
                         paged: bool = False, interpret: bool = False):
    # Block refs: counts_ref [], len_ref [] ; paged: table_ref [W] (logical block -> page) ;
    # q_ref [G, D] ; bidx_ref [NB] (the whole block list; this split owns a share) ;
    # k_ref, v_ref [S, D] (paged: the pool's [P * block_size, D]; S is then the logical
    # capacity W * block_size) ; o_ref [G, D] f32 ; m_ref, l_ref [G] f32.
    if paged:
        table_ref, q_ref, bidx_ref, k_ref, v_ref, o_ref, m_ref, l_ref = refs
        n_pages = k_ref.shape[0] // block_size

        def phys(bid):  # a (clipped, in-range) logical block's page; a bad table entry reads page 0
            page = table_ref[bid]
            return jnp.where((page >= 0) & (page < n_pages), page, 0)
    else:
        q_ref, bidx_ref, k_ref, v_ref, o_ref, m_ref, l_ref = refs

        def phys(bid):
            return bid
    d = q_ref.shape[-1]
    split = pl.program_id(2)
    count = jnp.clip(counts_ref[()], 0, NB)
    limit = jnp.minimum(len_ref[()], S)          # tokens at or past this are masked
    n_blocks_total = -(-S // block_size)          # static
    if split_schedule == "valid":
        # the valid blocks shared evenly, in whole iterations: never more than blocks_per_split
        # (ns * per_split covers the whole list, and count <= NB)
        per = -(-count // (num_splits * blocks_per_iter)) * blocks_per_iter
    else:
        per = blocks_per_split
    base = split * per
    n_valid = jnp.clip(count - base, 0, per)

    q = load_group_q(q_ref)
    g_pad = q.shape[0]
    lanes = jnp.arange(tile, dtype=jnp.int32)

    if blocks_per_iter == 1:
        # Contiguous path: iteration i handles sub-tile (i % sub_tiles) of slot
        # (i // sub_tiles).
        n_iter = n_valid * sub_tiles

        def body(i, carry):
            if sub_tiles == 1:
                slot, sub = i, 0
            else:
                slot, sub = lax.div(i, sub_tiles), lax.rem(i, sub_tiles)
            bid = bidx_ref[base + slot]
            in_range = (bid >= 0) & (bid < n_blocks_total)
            # Clamp so the slice start is always a real row (no negative or
            # far out-of-bounds pointers even for garbage ids).
            bid = jnp.clip(bid, 0, n_blocks_total - 1)
            in_block = sub * tile + lanes                      # offset inside the block
            start = bid * block_size + sub * tile              # logical position of lane 0
            valid = in_range & (in_block < block_size) & (start + lanes < limit)
            rows = pl.ds(phys(bid) * block_size + sub * tile, tile)
            # Masked loads: rows past S (partial last block, tile > block_size)
            # are never touched.
            k = plgpu.load(k_ref.at[rows, :], mask=valid[:, None], other=0.0)
            v = plgpu.load(v_ref.at[rows, :], mask=valid[:, None], other=0.0)
            return online_softmax_step(q, k, v, valid, carry, scale=scale,
                                       precision=precision, interpret=interpret)
    else:
        # Multi-block gather path: tile == blocks_per_iter * block_size tokens.
        n_iter = lax.div(n_valid + (blocks_per_iter - 1), blocks_per_iter)
        lane_slot = lax.div(lanes, block_size)    # block_size is a power of two
        lane_off = lax.rem(lanes, block_size)

        def body(i, carry):
            slot = i * blocks_per_iter + lane_slot                # [tile]
            slot_ok = slot < n_valid
            bid = bidx_ref[base + jnp.where(slot_ok, slot, 0)]    # [tile] gather of ids
            in_range = (bid >= 0) & (bid < n_blocks_total)
            bid = jnp.clip(bid, 0, n_blocks_total - 1)
            valid = slot_ok & in_range & (bid * block_size + lane_off < limit)   # logical positions
            pos = jnp.where(valid, phys(bid) * block_size + lane_off, 0)          # in-bounds gather
            k = k_ref[pos]
            v = v_ref[pos]
            return online_softmax_step(q, k, v, valid, carry, scale=scale,
                                       precision=precision, interpret=interpret)

    init = (
        jnp.zeros((g_pad, d), jnp.float32),
        jnp.full((g_pad,), MASK_VALUE, jnp.float32),
        jnp.zeros((g_pad,), jnp.float32),
    )
    o, m, l = lax.fori_loop(0, n_iter, body, init)
    store_group(o_ref, m_ref, l_ref, o, m, l)


def resolve_block_tuning(B: int, Hkv: int, NB: int, D: int, block_size: int, *,
                         block_k=None, blocks_per_iter=None, num_splits=None):
    """Static tiling: (tile, sub_tiles, blocks_per_iter, num_splits, blocks_per_split)."""
    if block_k is None:
        block_k = DEFAULT_BLOCK_K if D <= 128 else 32
    block_k = int(block_k)
    if not _is_pow2(block_k) or block_k < 16:
        raise ValueError(f"block_k must be a power of two >= 16, got {block_k}")
    if blocks_per_iter is None:
        if _is_pow2(block_size) and block_size < block_k:
            blocks_per_iter = block_k // block_size
        else:
            blocks_per_iter = 1
    blocks_per_iter = int(blocks_per_iter)
    if blocks_per_iter < 1:
        raise ValueError(f"blocks_per_iter must be >= 1, got {blocks_per_iter}")
    if blocks_per_iter == 1:
        tile = min(block_k, max(16, next_pow2(block_size)))
        sub_tiles = -(-block_size // tile)
    else:
        tile = blocks_per_iter * block_size
        if not _is_pow2(block_size) or not _is_pow2(blocks_per_iter) or tile < 16:
            raise ValueError(
                "blocks_per_iter > 1 needs power-of-two block_size and blocks_per_iter "
                f"with blocks_per_iter * block_size >= 16; got block_size={block_size}, "
                f"blocks_per_iter={blocks_per_iter}")
        sub_tiles = 1
    min_blocks_per_split = max(1, -(-MIN_TOKENS_PER_SPLIT // block_size))
    if num_splits is None:
        num_splits = choose_num_splits(NB, blocks_per_iter, min_blocks_per_split, B * Hkv)
    num_splits = int(num_splits)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    iters = max(1, -(-NB // blocks_per_iter))
    num_splits = min(num_splits, iters)
    iters_per_split = -(-iters // num_splits)
    num_splits = -(-iters // iters_per_split)
    return tile, sub_tiles, blocks_per_iter, num_splits, iters_per_split * blocks_per_iter


@functools.partial(
    jax.jit,
    static_argnames=("block_size", "scale", "return_residuals", "block_k",
                     "blocks_per_iter", "num_splits", "num_warps", "num_stages",
                     "merge", "split_schedule", "interpret"),
)
def block_sparse_decode_attention_pallas(q, k, v, block_indices, block_counts, lengths, block_table=None,
                                         *, block_size: int, scale=None,
                                         return_residuals=False, block_k=None,
                                         blocks_per_iter=None, num_splits=None,
                                         num_warps=None, num_stages=None,
                                         merge=None, split_schedule=None, interpret=False):
    """Pallas-Triton block-sparse decode attention (see module docstring).

    Tuning: ``block_k`` (max tokens per inner iteration, power of two >= 16;
    default 64 for D <= 128 else 32), ``blocks_per_iter`` (default
    ``block_k // block_size`` for power-of-two block sizes below block_k,
    else 1 = contiguous slices), ``num_splits`` (default from
    ``choose_num_splits``), ``num_warps`` (4), ``num_stages`` (2), ``merge`` (how the
    splits merge: "xla", the default, or "pallas"; ``sparse_decode.finish_splits``),
    ``split_schedule`` (:data:`SPLIT_SCHEDULES`, default "valid").

    ``block_table`` (``int32[B, W]``, paged KV): ``k, v`` are one pool ``[1, Hkv, P * block_size,
    D]`` shared by the rows, and row ``b``'s logical block ``j`` (what ``block_indices`` name,
    masked by ``lengths`` on logical positions, capacity ``W * block_size``) is page
    ``block_table[b, j]`` of it.
    """
    split_schedule = "valid" if split_schedule is None else split_schedule
    if split_schedule not in SPLIT_SCHEDULES:
        raise ValueError(f"split_schedule must be one of {SPLIT_SCHEDULES}, got {split_schedule!r}")
    B, Hq, D = q.shape
    _, Hkv, S, _ = k.shape
    if block_table is not None:
        S = block_table.shape[1] * block_size  # the logical capacity; k holds the pool's pages
    NB = block_indices.shape[-1]
    scale = default_scale(D) if scale is None else float(scale)
    tile, sub_tiles, bpi, ns, bps = resolve_block_tuning(
        B, Hkv, NB, D, block_size, block_k=block_k, blocks_per_iter=blocks_per_iter,
        num_splits=num_splits)

    kernel = functools.partial(
        _block_sparse_kernel, scale=scale, block_size=block_size, tile=tile,
        sub_tiles=sub_tiles, blocks_per_iter=bpi, blocks_per_split=bps, NB=NB, S=S,
        precision=dot_precision(q.dtype), num_splits=ns, split_schedule=split_schedule,
        paged=block_table is not None, interpret=interpret)
    return split_decode_call(
        kernel, q, k, v, block_indices, bps, ns, head_scalars=(block_counts,), row_scalars=(lengths,),
        row_vectors=() if block_table is None else (block_table,), kv_batch_share=1 if block_table is None else B,
        name=f"block_sparse_decode{'_paged' if block_table is not None else ''}_bs{block_size}_t{tile}_bpi{bpi}_ns{ns}",
        num_warps=num_warps,
        num_stages=num_stages, interpret=interpret, return_residuals=return_residuals, merge=merge)
