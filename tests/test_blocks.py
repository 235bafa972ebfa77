"""The paged engine's block manager (models/serving/blocks.py): random sequences of
reservations, growth and frees keep every block free or held by exactly one request, the
tables name each request's blocks in token order padded with the null block, a refused
reservation changes nothing, and freeing everything returns the whole pool."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from models.serving.blocks import NULL_BLOCK, BlockManager, OutOfBlocks


def test_reserve_grow_free_and_tables():
    m = BlockManager(num_blocks=9, block_size=4, max_blocks_per_request=5)
    assert (m.total, m.free_blocks) == (8, 8)
    assert m.reserve("a", 5) == [1, 2] and m.reserve("a", 8) == [] and m.reserve("a", 9) == [3]
    assert m.reserve("b", 1) == [4]
    np.testing.assert_array_equal(m.table("a"), [1, 2, 3, NULL_BLOCK, NULL_BLOCK])
    np.testing.assert_array_equal(m.tables(["b", None]), [[4, 0, 0, 0, 0], [0, 0, 0, 0, 0]])
    assert m.can_reserve("b", 20) and not m.can_reserve("c", 21)  # 6 blocks: over the table's width
    with pytest.raises(ValueError, match="at most 5"):
        m.reserve("c", 21)
    assert m.reserve("c", 16) == [5, 6, 7, 8] and m.free_blocks == 0
    with pytest.raises(OutOfBlocks, match="needs 1 more blocks, 0 of 8 are free"):
        m.reserve("b", 5)
    with pytest.raises(OutOfBlocks):
        m.reserve("d", 1)
    assert "d" not in m.requests and m.held("b") == 1  # a refused reservation changed nothing
    assert m.free("a") == 3 and m.reserve("d", 4) == [1]  # a freed request's first block is reused first
    m.check()
    for rid in m.requests:
        m.free(rid)
    assert m.free_blocks == m.total and m.requests == []


@pytest.mark.parametrize("bad", [dict(num_blocks=1), dict(block_size=0), dict(max_blocks_per_request=True),
                                 dict(num_blocks=2.5)])
def test_bad_sizes_are_refused(bad):
    kw = dict(num_blocks=8, block_size=16, max_blocks_per_request=4) | bad
    with pytest.raises(ValueError, match="must be"):
        BlockManager(**kw)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["reserve", "free"]), st.integers(0, 5), st.integers(0, 40)),
                max_size=60))
def test_random_sequences_keep_the_pool_whole(ops):
    m = BlockManager(num_blocks=13, block_size=4, max_blocks_per_request=10)
    want: dict[int, int] = {}  # request -> positions reserved
    for op, rid, tokens in ops:
        if op == "free":
            assert m.free(rid) == m.blocks_for(want.pop(rid, 0))
        else:
            ok = m.can_reserve(rid, tokens)
            before = (m.free_blocks, m.held(rid))
            try:
                m.reserve(rid, tokens)
                assert ok
                want[rid] = max(want.get(rid, 0), tokens)
            except (OutOfBlocks, ValueError):
                assert not ok and (m.free_blocks, m.held(rid)) == before
        m.check()
        for r, n in want.items():
            t = m.table(r)
            assert m.held(r) == m.blocks_for(n) and (t[:m.held(r)] != NULL_BLOCK).all() and (t[m.held(r):] == 0).all()
    for r in list(want):
        m.free(r)
    assert m.free_blocks == m.total


def test_pool_plan_says_what_bounds_the_batch():
    from models.serving.blocks import pool_plan

    # 2 slots x 256 tokens = 32 pages of 16, and the null page
    assert pool_plan(33, 16, 2, 256, asked=False, memory="host memory")[0] == "slots"
    bound, line = pool_plan(30, 16, 2, 256, asked=False, memory="host memory", detail=" (9.0 GiB usable)")
    assert bound == "host memory" and "1 request of 256 tokens" in line and "9.0 GiB usable" in line, line
    assert pool_plan(17, 16, 2, 256, asked=True, memory="device memory")[0] == "asked"
    assert pool_plan(17, 16, 1, 256, asked=True, memory="device memory")[0] == "slots"  # one slot, one context
    bound, line = pool_plan(5, 64, 4, 1000, asked=False, memory="device memory")  # 16 pages a request: none fit
    assert bound == "device memory" and "0 requests of 1,000" in line, line
