"""The offloaded tier's shared pool (``pool="shared"``): one pool of block slots per
(layer, KV head) shared by every row, LRU across rows. The slot kernel against its
reference; offloaded == resident with evictions every step (Quest: fetch path,
AsyncTLS: prefetch path); rows really share; the engine's admission on it."""

import jax.numpy as jnp
import numpy as np
import pytest

from sparse_jax.ops.slot_pool import assign_shared_pool_slots


def _shared_tables(rng, m, r, nb, n, n1, fill=None):
    """Consistent shared tables (each resident (row, block) in one slot), LRU clocks with
    ties, distinct next blocks per row of which some fall in the ring; some rows idle."""
    bslot = np.full((m, r, nb), -1, np.int32)
    sblock, sused = np.full((r, n), -1, np.int32), np.full((r, n), -1, np.int32)
    for h in range(r):
        filled = rng.integers(0, n + 1) if fill is None else fill
        flat = rng.choice(m * nb, size=filled, replace=False)
        slots = rng.choice(n, size=filled, replace=False)
        sblock[h, slots] = flat
        bslot[flat // nb, h, flat % nb] = slots
        sused[h, slots] = rng.integers(0, 30, size=filled)
    nxt = np.stack([np.stack([rng.choice(nb, size=n1, replace=False) for _ in range(r)]) for _ in range(m)])
    ring = rng.integers(nb - 4, nb + 1, size=m).astype(np.int32)
    ring[rng.random(m) < 0.25] = 0  # idle rows need nothing
    clock = (100 + np.arange(r)).astype(np.int32)
    return nxt.astype(np.int32), ring, clock, bslot, sblock, sused


def _check_against_reference(args, ring_slots=2):
    ref = assign_shared_pool_slots(*args, ring_slots=ring_slots, impl="reference")
    ker = assign_shared_pool_slots(*args, ring_slots=ring_slots, impl="pallas")
    names = "block_slot slot_block slot_used src dst copies hits".split()
    ref, ker = [np.asarray(a) for a in ref], [np.asarray(a) for a in ker]
    for name, a, b in zip(names, ref, ker):
        if name in ("src", "dst"):  # entries past the counts are unspecified
            live = np.arange(a.shape[-1]) < ref[5][..., None]
            a, b = np.where(live, a, 0), np.where(live, b, 0)
        np.testing.assert_array_equal(a, b, err_msg=name)
    return ker


@pytest.mark.parametrize("m,r,nb,n,n1", [(3, 2, 37, 20, 5), (5, 3, 19, 11, 2), (1, 1, 8, 3, 3), (4, 2, 64, 13, 3)])
def test_shared_kernel_matches_reference(m, r, nb, n, n1):
    """Awkward sizes (nothing a power of two, one row, idle rows, pools from empty to
    full); the copy list names each placed miss once; blocks of several rows move."""
    rng = np.random.default_rng(m * 100 + nb)
    for _ in range(3):
        args = _shared_tables(rng, m, r, nb, n, n1)
        nxt, ring, _, bslot0, _, _ = args
        bslot, sblock, sused, src, dst, copies, hits = _check_against_reference([jnp.asarray(a) for a in args])
        for h in range(r):
            need = nxt[:, h] < ring[:, None]
            miss = need & (bslot0[np.arange(m)[:, None], h, nxt[:, h]] < 0)
            protected = len({bslot0[i, h, b] for i in range(m) for b in nxt[i, h][need[i] & ~miss[i]]})
            placed = min(miss.sum(), n - protected)
            assert copies[:, h].sum() == placed and (hits[:, h] == (need & ~miss).sum(1)).all()
            for i in range(m):
                c = copies[i, h]
                blocks = nxt[i, h][miss[i]][:c]
                assert src[i, h, :c].tolist() == ((i * r + h) * nb + blocks).tolist()
                slots = dst[i, h, :c] - h * (n + 2 * m)
                assert sblock[h, slots].tolist() == (i * nb + blocks).tolist()
                assert (bslot[i, h, blocks] == slots).all()
            # the map and the slot table agree
            for s, f in enumerate(sblock[h]):
                if f >= 0:
                    assert bslot[f // nb, h, f % nb] == s
            assert (bslot[:, h] >= 0).sum() == (sblock[h] >= 0).sum()


def test_shared_lru_evicts_across_rows():
    """Row 1's miss takes the pool's least recently used slot, which holds row 0's
    block; row 0's hit is protected although it is older still."""
    nb, n = 10, 3
    bslot = np.full((2, 1, nb), -1, np.int32)
    sblock = np.array([[0 * nb + 4, 0 * nb + 5, 1 * nb + 2]], np.int32)  # row 0: blocks 4, 5; row 1: block 2
    sused = np.array([[1, 3, 7]], np.int32)
    bslot[0, 0, 4], bslot[0, 0, 5], bslot[1, 0, 2] = 0, 1, 2
    nxt = np.array([[[4]], [[6]]], np.int32)  # row 0 needs its block 4 (hit), row 1 its block 6 (miss)
    for impl in ("reference", "pallas"):
        out = assign_shared_pool_slots(*map(jnp.asarray, (nxt, [8, 8], [9], bslot, sblock, sused)), impl=impl)
        b, sb, su, src, dst, copies, hits = (np.asarray(a) for a in out)
        assert sb[0].tolist() == [4, 16, 12] and su[0].tolist() == [9, 9, 7]  # row 0's block 5 evicted by row 1
        assert b[0, 0, 5] == -1 and b[1, 0, 6] == 1 and b[0, 0, 4] == 0
        assert copies.tolist() == [[0], [1]] and hits.tolist() == [[1], [0]]
        assert src[1, 0, 0] == (1 * 1 + 0) * nb + 6 and dst[1, 0, 0] == 0 * (n + 4) + 1


def test_shared_overflow_is_left_unplaced_identically():
    """More misses than free slots (the callers prevent it): both implementations place
    the first ones in (row, position) order and count only those."""
    rng = np.random.default_rng(0)
    args = list(_shared_tables(rng, 4, 2, 30, 6, 4, fill=6))
    args[1] = np.full(4, 30, np.int32)  # every row needs all its blocks
    _, _, _, _, _, copies, hits = _check_against_reference([jnp.asarray(a) for a in args])
    assert (copies.sum(0) + 0 <= 6).all() and (copies.sum(0) < (4 * 4 - hits.sum(0))).all()


def test_shared_bad_input():
    a = dict(nxt=np.zeros((2, 3, 4), np.int32), ring_start=np.zeros((2,), np.int32), clock=np.zeros((3,), np.int32),
             block_slot=np.full((2, 3, 9), -1, np.int32), slot_block=np.full((3, 3), -1, np.int32),
             slot_used=np.full((3, 3), -1, np.int32))
    with pytest.raises(ValueError, match=r"shared pool \(3 slots\) must hold the 4 blocks"):
        assign_shared_pool_slots(**{k: jnp.asarray(v) for k, v in a.items()})
    a["slot_block"] = a["slot_used"] = np.full((3, 5), -1, np.int32)
    a["block_slot"] = np.full((2, 2, 9), -1, np.int32)
    with pytest.raises(ValueError, match=r"block_slot must have shape \[M, R, NB\]"):
        assign_shared_pool_slots(**{k: jnp.asarray(v) for k, v in a.items()})
