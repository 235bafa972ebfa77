"""LRU slot assignment of an offloaded layer's block pool, one launch per step.

Every offloaded decode step must decide, per (row, KV head), which of the
blocks chosen for the next step are already in the device pool (hits), give
each missing block a pool slot (the least recently used one that the next
step does not need), update the block tables, and list the copies for
:func:`pallas_kernels.host_gather.host_gather_into_pallas`. Written in jnp
this is ~20 small XLA kernels (gathers, an argsort, scatters, cumsums,
reductions) costing ~70 us per layer at Qwen3-8B shape, 96K context, B=3 --
more than the layer's attention. Here it is one program per row.

Shapes (``R`` rows = B * Hkv, flattened; ``n1`` blocks chosen per row; ``NB``
blocks per row; ``P`` pool slots per row):

* ``nxt int32[R, n1]``: the blocks the next step needs, distinct per row;
* ``ring_start int32[R]``: blocks ``>= ring_start`` live in the ring, not in
  the pool: they are neither hits nor misses;
* ``clock int32[R]``: the LRU clock (the row's length), stamped on every slot
  the next step uses;
* ``block_slot int32[R, NB]``: pool slot of each block, -1 when not resident;
* ``slot_block int32[R, P]``: block in each slot, -1 when empty;
* ``slot_used int32[R, P]``: clock at the slot's last use (-1: never).

Returns ``(block_slot, slot_block, slot_used, copy_src, copy_dst,
copy_count, hits)``: the new tables; ``copy_src, copy_dst int32[R, n1]``,
whose first ``copy_count[r]`` entries of row ``r`` are the misses in the
order of ``nxt`` (the rest 0): ``copy_src = r * NB + block`` (the host tier's
``[R*NB, bs, D]`` row) and ``copy_dst = r * (P + ring_slots) + slot`` (the
pool's ``[R*(P+ring), bs, D]`` row); ``copy_count, hits int32[R]``.

Policy (the documented contract of :mod:`sparse_jax.offload.tiers`): slots
holding a hit are never evicted; misses take, in order, the unprotected
slots by increasing ``slot_used`` (empty slots first), ties by slot index.
Every hit slot and every newly filled slot gets ``slot_used = clock``.
Requires ``P >= n1`` (there is always a free slot) and consistent tables.

Kernel (Pallas-Triton, grid ``(R,)``): the row's ``nxt`` and slot arrays in
registers (padded to powers of two with masked loads); ``cur`` by a gather
load from ``block_slot``; protected slots by a ``[P, n1]`` compare; then a
loop over the row's misses (usually a handful) extracts the minimum-key slot
each time; the new tables and the copy list are written with masked stores.
``block_slot`` is updated in place (``input_output_aliases``): only evicted
and newly filled entries are stored. Masked-off lanes of scatter stores use
out-of-bounds indices (see ``pallas_kernels/topk.py``: interpret mode writes
masked lanes back otherwise).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

__all__ = ["assign_slots_reference", "assign_slots_pallas"]

INT32_MAX = np.int32(2**31 - 1)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def assign_slots_reference(nxt, ring_start, clock, block_slot, slot_block, slot_used, *, ring_slots: int = 2):
    """Pure-jnp slot assignment (see the module docstring for the contract)."""
    r, n1 = nxt.shape
    nb, p = block_slot.shape[1], slot_block.shape[1]
    need = nxt < ring_start[:, None]
    cur = jnp.take_along_axis(block_slot, jnp.clip(nxt, 0, nb - 1), axis=-1)
    hit, miss = need & (cur >= 0), need & (cur < 0)

    def one(bslot, sblock, sused, nxt_, cur_, hit_, miss_, c):
        protect = jnp.zeros((p,), bool).at[jnp.where(hit_, cur_, p)].set(True, mode="drop")
        key = jnp.where(protect, INT32_MAX, sused)
        order = jnp.argsort(key, stable=True)  # empty (-1) first, then least recently used
        rank = jnp.cumsum(miss_.astype(jnp.int32)) - 1
        victim = jnp.where(miss_, order[jnp.clip(rank, 0, p - 1)], p)
        evicted = jnp.where(miss_, sblock[jnp.clip(victim, 0, p - 1)], -1)
        bslot = bslot.at[jnp.where(evicted >= 0, evicted, nb)].set(-1, mode="drop")
        bslot = bslot.at[jnp.where(miss_, nxt_, nb)].set(victim, mode="drop")
        sblock = sblock.at[victim].set(nxt_, mode="drop")
        sused = sused.at[jnp.where(hit_, cur_, victim)].set(c, mode="drop")
        at = jnp.where(miss_, rank, n1)
        return bslot, sblock, sused, at, victim

    bslot, sblock, sused, at, victim = jax.vmap(one)(block_slot, slot_block, slot_used, nxt, cur, hit, miss, clock)
    rows = jnp.arange(r, dtype=jnp.int32)[:, None]
    zeros = jnp.zeros((r, n1), jnp.int32)
    src = zeros.at[rows, at].set(rows * nb + nxt, mode="drop")
    dst = zeros.at[rows, at].set(rows * (p + ring_slots) + victim, mode="drop")
    return (bslot, sblock, sused, src, dst,
            jnp.sum(miss, axis=-1, dtype=jnp.int32), jnp.sum(hit, axis=-1, dtype=jnp.int32))


def _assign_kernel(nxt_ref, ring_ref, clock_ref, _bslot_in, sblock_ref, sused_ref,
                   bslot_ref, sblock_out, sused_out, src_out, dst_out, count_out, hits_out,
                   *, n_rows: int, n1: int, nb: int, p: int, ring_slots: int, n1p: int, pp: int):
    # _bslot_in is bslot_ref's buffer (aliased): read through bslot_ref before any store
    r = pl.program_id(0)
    j = lax.broadcasted_iota(jnp.int32, (n1p,), 0)
    s = lax.broadcasted_iota(jnp.int32, (pp,), 0)
    jv, sv = j < n1, s < p
    ring = ring_ref[r]
    clock = clock_ref[r]

    nxt = plgpu.load(nxt_ref.at[r * n1 + jnp.where(jv, j, 0)], mask=jv, other=0)
    need = jv & (nxt < ring)
    cur = plgpu.load(bslot_ref.at[r * nb + jnp.clip(nxt, 0, nb - 1)], mask=need, other=-1)
    hit, miss = need & (cur >= 0), need & (cur < 0)
    sblock = plgpu.load(sblock_ref.at[r * p + jnp.where(sv, s, 0)], mask=sv, other=-1)
    sused = plgpu.load(sused_ref.at[r * p + jnp.where(sv, s, 0)], mask=sv, other=0)

    # slots the next step reads from: [P, n1] compare
    protect = jnp.max((hit[None, :] & (cur[None, :] == s[:, None])).astype(jnp.int32), axis=1) > 0
    key = jnp.where(protect | ~sv, INT32_MAX, sused)
    miss_i = miss.astype(jnp.int32)
    n_miss = jnp.sum(miss_i)
    rank = jnp.cumsum(miss_i) - 1  # of each miss among the row's misses
    # the missing blocks in rank order: [n1 (rank), n1 (j)] one-hot
    blk_by_rank = jnp.sum(jnp.where(miss[None, :] & (rank[None, :] == j[:, None]), nxt[None, :], 0), axis=1)

    def extract(i, carry):
        key, vic = carry
        kmin = jnp.min(key)
        smin = jnp.min(jnp.where(key == kmin, s, pp))  # ties: lowest slot
        return jnp.where(s == smin, INT32_MAX, key), jnp.where(j == i, smin, vic)

    _, vic_by_rank = lax.fori_loop(0, n_miss, extract, (key, jnp.zeros((n1p,), jnp.int32)))
    live = j < n_miss  # ranks in use
    evicted = plgpu.load(sblock_ref.at[r * p + jnp.where(live, vic_by_rank, 0)], mask=live, other=-1)

    # new slot contents: [P, n1 (rank)] one-hot of the victims
    filled = live[None, :] & (vic_by_rank[None, :] == s[:, None])
    is_victim = jnp.max(filled.astype(jnp.int32), axis=1) > 0
    new_block = jnp.sum(jnp.where(filled, blk_by_rank[None, :], 0), axis=1)
    sblock_new = jnp.where(is_victim, new_block, sblock)
    sused_new = jnp.where(is_victim | protect, clock, sused)

    oob = n_rows * nb  # masked-off scatter lanes point past the table
    ev_ok = live & (evicted >= 0)
    plgpu.store(bslot_ref.at[jnp.where(ev_ok, r * nb + evicted, oob)], jnp.full((n1p,), -1, jnp.int32), mask=ev_ok)
    plgpu.store(bslot_ref.at[jnp.where(live, r * nb + blk_by_rank, oob)], vic_by_rank, mask=live)
    s_at = jnp.where(sv, r * p + s, n_rows * p)
    plgpu.store(sblock_out.at[s_at], sblock_new, mask=sv)
    plgpu.store(sused_out.at[s_at], sused_new, mask=sv)
    j_at = jnp.where(jv, r * n1 + j, n_rows * n1)
    plgpu.store(src_out.at[j_at], jnp.where(live, r * nb + blk_by_rank, 0), mask=jv)
    plgpu.store(dst_out.at[j_at], jnp.where(live, r * (p + ring_slots) + vic_by_rank, 0), mask=jv)
    count_out[r] = n_miss
    hits_out[r] = jnp.sum(hit.astype(jnp.int32))


def assign_slots_pallas(nxt, ring_start, clock, block_slot, slot_block, slot_used, *, ring_slots: int = 2,
                        num_warps: int = 4, interpret: bool = False):
    """Kernel path (same contract as :func:`assign_slots_reference`)."""
    r, n1 = nxt.shape
    nb, p = block_slot.shape[1], slot_block.shape[1]
    if r * max(nb, p + ring_slots, n1) >= 2**31:
        raise ValueError(f"{r} rows x {max(nb, p + ring_slots)} entries overflow int32 offsets")
    kern = functools.partial(_assign_kernel, n_rows=r, n1=n1, nb=nb, p=p, ring_slots=ring_slots,
                             n1p=_next_pow2(n1), pp=_next_pow2(p))
    i32 = jnp.int32
    out_shape = (
        jax.ShapeDtypeStruct((r * nb,), i32),
        jax.ShapeDtypeStruct((r * p,), i32),
        jax.ShapeDtypeStruct((r * p,), i32),
        jax.ShapeDtypeStruct((r * n1,), i32),
        jax.ShapeDtypeStruct((r * n1,), i32),
        jax.ShapeDtypeStruct((r,), i32),
        jax.ShapeDtypeStruct((r,), i32),
    )
    bslot, sblock, sused, src, dst, count, hits = pl.pallas_call(
        kern,
        out_shape=out_shape,
        grid=(r,),
        input_output_aliases={3: 0},
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="assign_pool_slots",
    )(nxt.reshape(-1).astype(i32), ring_start.astype(i32), clock.astype(i32), block_slot.reshape(-1).astype(i32),
      slot_block.reshape(-1).astype(i32), slot_used.reshape(-1).astype(i32))
    return (bslot.reshape(r, nb), sblock.reshape(r, p), sused.reshape(r, p), src.reshape(r, n1),
            dst.reshape(r, n1), count, hits)
