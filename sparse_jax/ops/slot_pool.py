"""``assign_pool_slots``: one step of an offloaded layer's LRU block pool.

Given the blocks the next decode step needs, per (row, KV head), find the
ones already resident, give every missing one the least recently used slot
the next step does not read, update the block tables and list the copies
(host tier row -> pool row) for
:func:`sparse_jax.ops.transfer.host_gather_into` (whose ``count`` takes the
per-row ``copy_count`` as segments). Contract, shapes and policy:
``pallas_kernels/slot_pool.py``.

:func:`assign_shared_pool_slots` is the same step for a pool shared by every
row of the batch (one pool per KV head, LRU across rows).

Implementations: ``"pallas"`` (one program per row; interpret mode without
a GPU), ``"reference"`` (vmapped jnp: an argsort and scatters per row),
``"auto"`` (the kernel on GPU).
"""

from __future__ import annotations

import functools

import jax

from pallas_kernels import slot_pool as _sp
from sparse_jax.ops import _checks
from sparse_jax.ops._dispatch import resolve_impl

__all__ = ["assign_pool_slots", "assign_shared_pool_slots"]


def _check_ring_slots(ring_slots) -> None:
    if isinstance(ring_slots, bool) or not isinstance(ring_slots, int) or ring_slots < 0:
        raise ValueError(f"ring_slots must be a non-negative int, got {ring_slots!r}")


def _check(nxt, ring_start, clock, block_slot, slot_block, slot_used, ring_slots):
    _checks.check_rank("nxt", nxt, 2, "[R, n1]")
    _checks.check_int("nxt", nxt)
    r, n1 = nxt.shape
    _checks.check_int_array("ring_start", ring_start, (r,), "[R]")
    _checks.check_int_array("clock", clock, (r,), "[R]")
    _checks.check_rank("block_slot", block_slot, 2, "[R, NB]")
    _checks.check_int("block_slot", block_slot)
    if block_slot.shape[0] != r or block_slot.shape[1] < 1:
        raise ValueError(f"block_slot must have shape [R, NB] with R = {r} and NB >= 1, got {tuple(block_slot.shape)}")
    _checks.check_rank("slot_block", slot_block, 2, "[R, P]")
    _checks.check_int("slot_block", slot_block)
    p = slot_block.shape[1]
    if slot_block.shape[0] != r:
        raise ValueError(f"slot_block must have shape [R, P] with R = {r}, got {tuple(slot_block.shape)}")
    _checks.check_int_array("slot_used", slot_used, (r, p), "[R, P]")
    if p < n1:
        raise ValueError(f"the pool ({p} slots per row) must hold the {n1} blocks a step needs (P >= n1)")
    _check_ring_slots(ring_slots)


@functools.partial(jax.jit, static_argnames=("ring_slots", "choice", "interpret"))
def _run(nxt, ring_start, clock, block_slot, slot_block, slot_used, *, ring_slots, choice, interpret):
    if choice == "reference":
        return _sp.assign_slots_reference(nxt, ring_start, clock, block_slot, slot_block, slot_used,
                                          ring_slots=ring_slots)
    return _sp.assign_slots_pallas(nxt, ring_start, clock, block_slot, slot_block, slot_used,
                                   ring_slots=ring_slots, interpret=interpret)


def assign_pool_slots(nxt, ring_start, clock, block_slot, slot_block, slot_used, *, ring_slots: int = 2,
                      impl: str = "auto"):
    """LRU slots for the misses of ``nxt``; the new tables and the copy list.

    Args:
      nxt: ``int32[R, n1]`` blocks the next step needs (distinct per row).
      ring_start: ``int32[R]``; blocks ``>= ring_start`` are in the ring.
      clock: ``int32[R]``, stamped on every slot the next step uses.
      block_slot: ``int32[R, NB]``; slot_block, slot_used: ``int32[R, P]``, ``P >= n1``.
      ring_slots: slots per row after the pool in the device buffer (for ``copy_dst``).
      impl: "auto" | "pallas" | "reference".

    Returns:
      ``(block_slot, slot_block, slot_used, copy_src int32[R, n1], copy_dst
      int32[R, n1], copy_count int32[R], hits int32[R])``. Inside a jit that
      donates ``block_slot``, the kernel updates it in place.
    """
    _check(nxt, ring_start, clock, block_slot, slot_block, slot_used, ring_slots)
    choice, interpret = resolve_impl(impl)
    return _run(nxt, ring_start, clock, block_slot, slot_block, slot_used, ring_slots=ring_slots,
                choice=choice, interpret=interpret)


def _check_shared(nxt, ring_start, clock, block_slot, slot_block, slot_used, ring_slots):
    _checks.check_rank("nxt", nxt, 3, "[M, R, n1]")
    _checks.check_int("nxt", nxt)
    m, r, n1 = nxt.shape
    _checks.check_int_array("ring_start", ring_start, (m,), "[M]")
    _checks.check_int_array("clock", clock, (r,), "[R]")
    _checks.check_rank("block_slot", block_slot, 3, "[M, R, NB]")
    _checks.check_int("block_slot", block_slot)
    if block_slot.shape[:2] != (m, r) or block_slot.shape[2] < 1:
        raise ValueError(f"block_slot must have shape [M, R, NB] with M, R = {m}, {r} and NB >= 1, "
                         f"got {tuple(block_slot.shape)}")
    _checks.check_rank("slot_block", slot_block, 2, "[R, N]")
    _checks.check_int("slot_block", slot_block)
    n = slot_block.shape[1]
    if slot_block.shape[0] != r:
        raise ValueError(f"slot_block must have shape [R, N] with R = {r}, got {tuple(slot_block.shape)}")
    _checks.check_int_array("slot_used", slot_used, (r, n), "[R, N]")
    if n < n1:
        raise ValueError(f"the shared pool ({n} slots) must hold the {n1} blocks one row needs (N >= n1)")
    _check_ring_slots(ring_slots)


@functools.partial(jax.jit, static_argnames=("ring_slots", "choice", "interpret"))
def _run_shared(nxt, ring_start, clock, block_slot, slot_block, slot_used, *, ring_slots, choice, interpret):
    if choice == "reference":
        return _sp.assign_shared_reference(nxt, ring_start, clock, block_slot, slot_block, slot_used,
                                           ring_slots=ring_slots)
    return _sp.assign_shared_pallas(nxt, ring_start, clock, block_slot, slot_block, slot_used,
                                    ring_slots=ring_slots, interpret=interpret)


def assign_shared_pool_slots(nxt, ring_start, clock, block_slot, slot_block, slot_used, *, ring_slots: int = 2,
                             impl: str = "auto"):
    """:func:`assign_pool_slots` for a pool shared by the ``M`` rows of a batch: one
    pool of ``N`` slots per KV head (``R`` pools), LRU across rows, the map (row,
    block) -> slot. Contract: ``pallas_kernels/slot_pool.py`` (the shared pool).

    Args:
      nxt: ``int32[M, R, n1]`` blocks each row needs (distinct per row and head).
      ring_start: ``int32[M]``: row m's blocks ``>= ring_start[m]`` are in its ring
        (0: the row needs nothing, e.g. a free slot).
      clock: ``int32[R]``: the pool's clock (a global step count).
      block_slot: ``int32[M, R, NB]``; slot_block, slot_used: ``int32[R, N]``
        (slot_block holds the flat id ``m * NB + block``).
      ring_slots: ring slots per row after the ``N`` pool slots, for ``copy_dst``.

    Returns ``(block_slot, slot_block, slot_used, copy_src int32[M, R, n1], copy_dst
    int32[M, R, n1], copy_count int32[M, R], hits int32[M, R])``; entries of the copy
    lists past ``copy_count`` are unspecified. The caller keeps each step's misses
    within the pool (the rows that need blocks need at most ``N`` together); a miss
    past the free slots is left unplaced and uncounted.
    """
    _check_shared(nxt, ring_start, clock, block_slot, slot_block, slot_used, ring_slots)
    choice, interpret = resolve_impl(impl)
    return _run_shared(nxt, ring_start, clock, block_slot, slot_block, slot_used, ring_slots=ring_slots,
                       choice=choice, interpret=interpret)
