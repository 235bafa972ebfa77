"""LRU slot assignment of an offloaded layer's block pool, one launch per step.

Every offloaded decode step must decide, per (row, KV head), which of the
blocks chosen for the next step are already in the device pool (hits), give
each missing block a pool slot (the least recently used one that the next
step does not need), update the block tables, and list the copies for
:func:`pallas_kernels.host_gather.host_gather_into_pallas`. Written in jnp
this is ~20 small XLA kernels (gathers, an argsort, scatters, cumsums,
reductions), which in the offloaded step cost more than the layer's attention
(docs/kernels.md, 'Measured reasons for kernel choices', with the later timing of both alone). Here it is one
program per row.

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

Kernel (Pallas-Triton, grid ``(R,)``, one warp by default): the row's ``nxt``
and slot arrays in registers (padded to powers of two with masked loads);
``cur`` by a gather load from ``block_slot``; then a loop takes slots by
increasing LRU key until every miss has one, skipping slots whose block is a
hit (a scalar membership test against ``nxt``), so the work is about
``n_miss`` vector reductions over ``P`` -- no ``[P, n1]`` tensor, which
spilled registers and was slow (docs/kernels.md, 'Measured reasons for kernel
choices'). The three tables are updated in place
(``input_output_aliases``): only evicted, newly filled and hit entries are
stored. Masked-off lanes of scatter stores use out-of-bounds indices (see
``pallas_kernels/topk.py``: interpret mode writes masked lanes back
otherwise).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from pallas_kernels._util import next_pow2

__all__ = ["assign_slots_reference", "assign_slots_pallas", "assign_shared_reference", "assign_shared_pallas"]

INT32_MAX = np.int32(2**31 - 1)



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


def _assign_kernel(nxt_ref, ring_ref, clock_ref, _bslot_in, _sblock_in, _sused_in,
                   bslot_ref, sblock_ref, sused_ref, src_out, dst_out, count_out, hits_out,
                   *, n_rows: int, n1: int, nb: int, p: int, ring_slots: int, n1p: int, pp: int):
    # the three tables are updated in place (aliased): read through the output
    # refs before any store; only changed entries are stored, at addresses that
    # are distinct within each table, so no two stores of a table can race
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
    sused = plgpu.load(sused_ref.at[r * p + jnp.where(sv, s, 0)], mask=sv, other=INT32_MAX)
    n_miss = jnp.sum(miss.astype(jnp.int32))
    rank = jnp.cumsum(miss.astype(jnp.int32)) - 1  # of each miss among the row's misses

    # Take slots by increasing (slot_used, slot) until every miss has one,
    # skipping the slots of hits (protected). Hits were used by the last step,
    # so their clocks are the newest: they are rarely met before n_miss free
    # ones, and the loop runs about n_miss times (at most n1: P >= n1).
    def cond(c):
        return (c[1] < n_miss) & (c[5] < pp)  # the cap only guards malformed tables

    def body(c):
        key, found, vic, blk, ev, it = c
        kmin = jnp.min(key)
        smin = jnp.min(jnp.where(key == kmin, s, pp))  # ties: lowest slot
        held = jnp.sum(jnp.where(s == smin, sblock, 0))  # its block (-1: empty)
        protected = (held >= 0) & (jnp.sum((hit & (nxt == held)).astype(jnp.int32)) > 0)
        at = ~protected & (j == found)
        block = jnp.sum(jnp.where(miss & (rank == found), nxt, 0))  # the miss of this rank
        return (jnp.where(s == smin, INT32_MAX, key), found + (~protected).astype(jnp.int32),
                jnp.where(at, smin, vic), jnp.where(at, block, blk), jnp.where(at, held, ev), it + 1)

    zeros = jnp.zeros((n1p,), jnp.int32)
    init = (jnp.where(sv, sused, INT32_MAX), np.int32(0), zeros, zeros, zeros - 1, np.int32(0))
    _, _, vic, blk, evicted, _ = lax.while_loop(cond, body, init)
    live = j < n_miss  # ranks in use

    def scatter(ref, offset, idx, vals, mask, size):
        # masked-off lanes point past the table (interpret mode writes them otherwise)
        plgpu.store(ref.at[jnp.where(mask, offset + idx, size)], vals, mask=mask)

    ev_ok = live & (evicted >= 0)
    scatter(bslot_ref, r * nb, evicted, jnp.full((n1p,), -1, jnp.int32), ev_ok, n_rows * nb)
    scatter(bslot_ref, r * nb, blk, vic, live, n_rows * nb)
    scatter(sblock_ref, r * p, vic, blk, live, n_rows * p)
    scatter(sused_ref, r * p, vic, jnp.full((n1p,), clock, jnp.int32), live, n_rows * p)
    scatter(sused_ref, r * p, cur, jnp.full((n1p,), clock, jnp.int32), hit, n_rows * p)
    j_at = jnp.where(jv, r * n1 + j, n_rows * n1)
    plgpu.store(src_out.at[j_at], jnp.where(live, r * nb + blk, 0), mask=jv)
    plgpu.store(dst_out.at[j_at], jnp.where(live, r * (p + ring_slots) + vic, 0), mask=jv)
    count_out[r] = n_miss
    hits_out[r] = jnp.sum(hit.astype(jnp.int32))


def _call_slot_kernel(kern, sizes, *, grid, name, num_warps, interpret, inputs):
    """The ``pallas_call`` both slot kernels share: ``inputs`` (nxt, ring_start, clock,
    block_slot, slot_block, slot_used) flattened to int32; ``sizes = (tables, slots,
    copies, counts)`` the flat lengths of the outputs (block_slot; slot_block and
    slot_used; copy_src and copy_dst; copy_count and hits). The three tables are updated
    in place (aliased to their inputs)."""
    i32 = jnp.int32
    n_tab, n_slot, n_copy, n_cnt = sizes
    out_shape = tuple(jax.ShapeDtypeStruct((k,), i32) for k in (n_tab, n_slot, n_slot, n_copy, n_copy, n_cnt, n_cnt))
    nxt, ring_start, clock, block_slot, slot_block, slot_used = inputs
    return pl.pallas_call(
        kern,
        out_shape=out_shape,
        grid=(grid,),
        input_output_aliases={3: 0, 4: 1, 5: 2},
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name=name,
    )(nxt.reshape(-1).astype(i32), ring_start.astype(i32), clock.astype(i32), block_slot.reshape(-1).astype(i32),
      slot_block.reshape(-1).astype(i32), slot_used.reshape(-1).astype(i32))


def assign_slots_pallas(nxt, ring_start, clock, block_slot, slot_block, slot_used, *, ring_slots: int = 2,
                        num_warps: int = 1, interpret: bool = False):
    """Kernel path (same contract as :func:`assign_slots_reference`)."""
    r, n1 = nxt.shape
    nb, p = block_slot.shape[1], slot_block.shape[1]
    if r * max(nb, p + ring_slots, n1) >= 2**31:
        raise ValueError(f"{r} rows x {max(nb, p + ring_slots)} entries overflow int32 offsets")
    kern = functools.partial(_assign_kernel, n_rows=r, n1=n1, nb=nb, p=p, ring_slots=ring_slots,
                             n1p=next_pow2(n1), pp=next_pow2(p))
    bslot, sblock, sused, src, dst, count, hits = _call_slot_kernel(
        kern, (r * nb, r * p, r * n1, r), grid=r, name="assign_pool_slots", num_warps=num_warps,
        interpret=interpret, inputs=(nxt, ring_start, clock, block_slot, slot_block, slot_used))
    return (bslot.reshape(r, nb), sblock.reshape(r, p), sused.reshape(r, p), src.reshape(r, n1),
            dst.reshape(r, n1), count, hits)


# -----------------------------------------------------------------------------
# The shared pool: one pool per KV head, shared by every row of the batch
# -----------------------------------------------------------------------------
#
# Shapes (``M`` rows share each of ``R`` pools, one per KV head; ``N`` slots per
# pool): ``nxt int32[M, R, n1]``, ``ring_start int32[M]`` (per row: blocks
# ``>= ring_start[m]`` are in row m's ring; a row that needs nothing passes 0),
# ``clock int32[R]`` (the pool's clock, a global step count), ``block_slot
# int32[M, R, NB]`` (the map (row, block) -> slot, -1 when not resident),
# ``slot_block int32[R, N]`` (the flat id ``m * NB + block`` of the row's block
# in each slot, -1 when empty), ``slot_used int32[R, N]`` (clock at last use).
#
# Returns ``(block_slot, slot_block, slot_used, copy_src int32[M, R, n1],
# copy_dst int32[M, R, n1], copy_count int32[M, R], hits int32[M, R])``: the
# first ``copy_count[m, r]`` entries of ``copy_*[m, r]`` are row m's misses in
# the order of ``nxt`` (entries past the count are unspecified): ``copy_src =
# (m * R + r) * NB + block`` (the host tier's ``[M*R*NB, bs, D]`` row) and
# ``copy_dst = r * (N + ring_slots * M) + slot`` (the shared buffer seen as
# ``[R * (N + ring_slots*M), bs, D]``: each head's N pool slots, then every
# row's ring slots).
#
# Policy: the per-row policy over the whole pool. The slots of every row's hits
# are protected; the misses of all rows, in (row, position) order, take the
# unprotected slots by increasing (slot_used, slot), so one row's miss may evict
# another row's block (LRU across rows). Precondition: the misses fit the
# unprotected slots (``sum of the needing rows' blocks <= N`` suffices: callers
# check it statically). A miss past the free slots is left unplaced (not
# resident, not counted in copy_count), identically in both implementations.


def assign_shared_reference(nxt, ring_start, clock, block_slot, slot_block, slot_used, *, ring_slots: int = 2):
    """Pure-jnp shared-pool slot assignment (contract above)."""
    m_rows, r_pools, n1 = nxt.shape
    nb, n = block_slot.shape[2], slot_block.shape[1]
    rows = jnp.arange(m_rows, dtype=jnp.int32)

    def one(r, nxt_r, bslot_r, sblock, sused, c):  # nxt_r [M, n1], bslot_r [M, NB], sblock/sused [N]
        need = nxt_r < ring_start[:, None]
        cur = jnp.take_along_axis(bslot_r, jnp.clip(nxt_r, 0, nb - 1), axis=-1)
        hit, miss = need & (cur >= 0), need & (cur < 0)
        protect = jnp.zeros((n,), bool).at[jnp.where(hit, cur, n).reshape(-1)].set(True, mode="drop")
        key = jnp.where(protect, INT32_MAX, sused)
        order = jnp.argsort(key, stable=True)  # empty (-1) first, then least recently used
        avail = n - jnp.sum(protect, dtype=jnp.int32)
        mf = miss.reshape(-1)
        rank = jnp.cumsum(mf.astype(jnp.int32)) - 1  # over all rows, in (row, position) order
        placed = mf & (rank < avail)
        victim = jnp.where(placed, order[jnp.clip(rank, 0, n - 1)], n)
        evicted = jnp.where(placed, sblock[jnp.clip(victim, 0, n - 1)], -1)  # flat ids m' * NB + block
        flat = (rows[:, None] * nb + jnp.clip(nxt_r, 0, nb - 1)).reshape(-1)
        b = bslot_r.reshape(-1)
        b = b.at[jnp.where(evicted >= 0, evicted, m_rows * nb)].set(-1, mode="drop")
        b = b.at[jnp.where(placed, flat, m_rows * nb)].set(victim, mode="drop")
        sblock = sblock.at[victim].set(flat, mode="drop")
        sused = sused.at[jnp.where(hit.reshape(-1), cur.reshape(-1), victim)].set(c, mode="drop")
        placed2 = placed.reshape(m_rows, n1)
        at = jnp.where(placed2, jnp.cumsum(placed2.astype(jnp.int32), axis=1) - 1, n1)
        zeros = jnp.zeros((m_rows, n1), jnp.int32)
        src = zeros.at[rows[:, None], at].set((rows[:, None] * r_pools + r) * nb + nxt_r, mode="drop")
        dst = zeros.at[rows[:, None], at].set(r * (n + ring_slots * m_rows) + victim.reshape(m_rows, n1),
                                              mode="drop")
        return (b.reshape(m_rows, nb), sblock, sused, src, dst,
                jnp.sum(placed2, axis=-1, dtype=jnp.int32), jnp.sum(hit, axis=-1, dtype=jnp.int32))

    return jax.vmap(one, in_axes=(0, 1, 1, 0, 0, 0), out_axes=(1, 0, 0, 1, 1, 1, 1))(
        jnp.arange(r_pools, dtype=jnp.int32), nxt, block_slot, slot_block, slot_used, clock)


def _assign_shared_kernel(nxt_ref, ring_ref, clock_ref, _bslot_in, _sblock_in, _sused_in,
                          bslot_ref, sblock_ref, sused_ref, src_out, dst_out, count_out, hits_out,
                          *, m_rows: int, r_pools: int, n1: int, nb: int, n: int, ring_slots: int, mp: int,
                          pp: int):
    # one program per pool (KV head); lanes j = m * n1 + position over every row's
    # needs. As the per-row kernel: tables aliased, read before any store, only
    # changed entries stored at distinct addresses
    r = pl.program_id(0)
    j = lax.broadcasted_iota(jnp.int32, (mp,), 0)
    s = lax.broadcasted_iota(jnp.int32, (pp,), 0)
    jv, sv = j < m_rows * n1, s < n
    row, pos = j // n1, j % n1
    clock = clock_ref[r]
    size_b = m_rows * r_pools * nb

    nxt = plgpu.load(nxt_ref.at[jnp.where(jv, (row * r_pools + r) * n1 + pos, 0)], mask=jv, other=0)
    ring = plgpu.load(ring_ref.at[jnp.where(jv, row, 0)], mask=jv, other=0)
    need = jv & (nxt < ring)
    nxt_c = jnp.clip(nxt, 0, nb - 1)
    cur = plgpu.load(bslot_ref.at[jnp.where(need, (row * r_pools + r) * nb + nxt_c, 0)], mask=need, other=-1)
    hit, miss = need & (cur >= 0), need & (cur < 0)
    flat = row * nb + nxt_c  # the slot table's id of each needed block
    sblock = plgpu.load(sblock_ref.at[r * n + jnp.where(sv, s, 0)], mask=sv, other=-1)
    sused = plgpu.load(sused_ref.at[r * n + jnp.where(sv, s, 0)], mask=sv, other=INT32_MAX)
    n_miss = jnp.sum(miss.astype(jnp.int32))
    rank = jnp.cumsum(miss.astype(jnp.int32)) - 1

    def cond(c):
        return (c[1] < n_miss) & (c[5] < n)  # every slot visited: the rest stay unplaced

    def body(c):
        key, found, vic, blk, ev, it = c
        kmin = jnp.min(key)
        smin = jnp.min(jnp.where(key == kmin, s, pp))
        held = jnp.sum(jnp.where(s == smin, sblock, 0))
        protected = (held >= 0) & (jnp.sum((hit & (flat == held)).astype(jnp.int32)) > 0)
        at = ~protected & (j == found)
        block = jnp.sum(jnp.where(miss & (rank == found), flat, 0))
        return (jnp.where(s == smin, INT32_MAX, key), found + (~protected).astype(jnp.int32),
                jnp.where(at, smin, vic), jnp.where(at, block, blk), jnp.where(at, held, ev), it + 1)

    zeros = jnp.zeros((mp,), jnp.int32)
    init = (jnp.where(sv, sused, INT32_MAX), np.int32(0), zeros, zeros, zeros - 1, np.int32(0))
    _, found, vic, blk, evicted, _ = lax.while_loop(cond, body, init)
    live = j < found  # lanes indexed by rank: the placed misses
    brow, bblk = blk // nb, blk % nb

    def scatter(ref, addr, vals, mask, size):
        plgpu.store(ref.at[jnp.where(mask, addr, size)], vals, mask=mask)

    ev_ok = live & (evicted >= 0)
    scatter(bslot_ref, (evicted // nb * r_pools + r) * nb + evicted % nb, jnp.full((mp,), -1, jnp.int32), ev_ok,
            size_b)
    scatter(bslot_ref, (brow * r_pools + r) * nb + bblk, vic, live, size_b)
    scatter(sblock_ref, r * n + vic, blk, live, r_pools * n)
    scatter(sused_ref, r * n + vic, jnp.full((mp,), clock, jnp.int32), live, r_pools * n)
    scatter(sused_ref, r * n + cur, jnp.full((mp,), clock, jnp.int32), hit, r_pools * n)

    # each placed miss's entry within its row: its rank less the misses of the rows before
    def per_row(mi, first):
        mine = row == mi
        placed_here = jnp.sum((live & (brow == mi)).astype(jnp.int32))
        count_out[mi * r_pools + r] = placed_here
        hits_out[mi * r_pools + r] = jnp.sum((hit & mine).astype(jnp.int32))
        start = jnp.sum((miss & (row < mi)).astype(jnp.int32))
        return jnp.where(brow == mi, start, first)

    first = lax.fori_loop(0, m_rows, per_row, zeros)
    k_at = j - first
    out_at = jnp.where(live, (brow * r_pools + r) * n1 + k_at, m_rows * r_pools * n1)
    plgpu.store(src_out.at[out_at], (brow * r_pools + r) * nb + bblk, mask=live)
    plgpu.store(dst_out.at[out_at], r * (n + ring_slots * m_rows) + vic, mask=live)


def assign_shared_pallas(nxt, ring_start, clock, block_slot, slot_block, slot_used, *, ring_slots: int = 2,
                         num_warps: int = 1, interpret: bool = False):
    """Kernel path of :func:`assign_shared_reference` (grid ``(R,)``: one program per
    pool). Entries of ``copy_src / copy_dst`` past the counts are left unwritten."""
    m_rows, r_pools, n1 = nxt.shape
    nb, n = block_slot.shape[2], slot_block.shape[1]
    if m_rows * r_pools * max(nb, n1) >= 2**31 or r_pools * (n + ring_slots * m_rows) >= 2**31:
        raise ValueError(f"{m_rows} rows x {r_pools} pools overflow int32 offsets")
    kern = functools.partial(_assign_shared_kernel, m_rows=m_rows, r_pools=r_pools, n1=n1, nb=nb, n=n,
                             ring_slots=ring_slots, mp=next_pow2(m_rows * n1), pp=next_pow2(n))
    bslot, sblock, sused, src, dst, count, hits = _call_slot_kernel(
        kern, (m_rows * r_pools * nb, r_pools * n, m_rows * r_pools * n1, m_rows * r_pools), grid=r_pools,
        name="assign_shared_pool_slots", num_warps=num_warps, interpret=interpret,
        inputs=(nxt, ring_start, clock, block_slot, slot_block, slot_used))
    return (bslot.reshape(m_rows, r_pools, nb), sblock.reshape(r_pools, n), sused.reshape(r_pools, n),
            src.reshape(m_rows, r_pools, n1), dst.reshape(m_rows, r_pools, n1), count.reshape(m_rows, r_pools),
            hits.reshape(m_rows, r_pools))
