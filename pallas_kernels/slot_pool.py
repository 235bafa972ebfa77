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

Kernel (Pallas-Triton, grid ``(R,)``, one warp by default): the row's ``nxt``
and slot arrays in registers (padded to powers of two with masked loads);
``cur`` by a gather load from ``block_slot``; then a loop takes slots by
increasing LRU key until every miss has one, skipping slots whose block is a
hit (a scalar membership test against ``nxt``), so the work is about
``n_miss`` vector reductions over ``P`` -- no ``[P, n1]`` tensor, which
spilled registers and cost ~50 us. The three tables are updated in place
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

__all__ = ["assign_slots_reference", "assign_slots_pallas"]

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


def assign_slots_pallas(nxt, ring_start, clock, block_slot, slot_block, slot_used, *, ring_slots: int = 2,
                        num_warps: int = 1, interpret: bool = False):
    """Kernel path (same contract as :func:`assign_slots_reference`)."""
    r, n1 = nxt.shape
    nb, p = block_slot.shape[1], slot_block.shape[1]
    if r * max(nb, p + ring_slots, n1) >= 2**31:
        raise ValueError(f"{r} rows x {max(nb, p + ring_slots)} entries overflow int32 offsets")
    kern = functools.partial(_assign_kernel, n_rows=r, n1=n1, nb=nb, p=p, ring_slots=ring_slots,
                             n1p=next_pow2(n1), pp=next_pow2(p))
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
        input_output_aliases={3: 0, 4: 1, 5: 2},
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="assign_pool_slots",
    )(nxt.reshape(-1).astype(i32), ring_start.astype(i32), clock.astype(i32), block_slot.reshape(-1).astype(i32),
      slot_block.reshape(-1).astype(i32), slot_used.reshape(-1).astype(i32))
    return (bslot.reshape(r, nb), sblock.reshape(r, p), sused.reshape(r, p), src.reshape(r, n1),
            dst.reshape(r, n1), count, hits)
