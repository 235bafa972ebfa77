"""Block-sparse decode attention: reference and interpret-mode Pallas kernel
against a float64 NumPy oracle (CPU).

Layout: q [B, Hq, D], k/v [B, Hkv, S, D], block_indices int32[B, Hkv, NBsel],
block_counts int32[B, Hkv], lengths int32[B].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.block_sparse_decode import resolve_block_tuning
from sparse_jax.ops.attention import (
    dense_decode_attention,
    block_sparse_decode_attention,
    merge_attention,
    sparse_decode_attention,
)
from attention_oracle import oracle

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}




def block_tokens(block_ids, count, length, S, block_size):
    """Token positions the op must attend to (in the contract's order)."""
    limit = min(length, S)
    toks = []
    for bid in block_ids[:max(0, min(count, len(block_ids)))]:
        lo = bid * block_size
        toks.extend(t for t in range(lo, lo + block_size) if 0 <= t < limit and bid >= 0)
    return np.asarray(toks, np.int64)


def make_case(rng, B, Hq, Hkv, S, D, NB, block_size, dtype, counts, lengths):
    q = jnp.asarray(1.5 * rng.standard_normal((B, Hq, D)), dtype)
    k = jnp.asarray(rng.standard_normal((B, Hkv, S, D)), dtype)
    v = jnp.asarray(rng.standard_normal((B, Hkv, S, D)), dtype)
    n_blocks = -(-S // block_size)
    bidx = rng.integers(-2 * n_blocks, 3 * n_blocks, size=(B, Hkv, NB))  # garbage
    lists = [[None] * Hkv for _ in range(B)]
    for b in range(B):
        for h in range(Hkv):
            c = int(np.clip(counts[b, h], 0, NB))
            # Distinct real blocks, including the partial last block and
            # blocks past lengths[b] (which must contribute nothing).
            sel = rng.permutation(n_blocks)[:c]
            if c:
                sel[0] = n_blocks - 1
            bidx[b, h, :c] = sel
            lists[b][h] = block_tokens(bidx[b, h], int(counts[b, h]), int(lengths[b]), S,
                                       block_size)
    return q, k, v, jnp.asarray(bidx, jnp.int32), lists


def assert_close(got, want, dtype, what):
    tol = TOL[dtype]
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=tol, atol=tol,
                               err_msg=what)


# (B, Hq, Hkv, S, D, NB, block_size, dtype, tuning). S is never a multiple of
# the block size, so the last block is partial; lengths are ragged.
CASES = [
    # block 16 < block_k: the multi-block gather path (4 blocks / iteration).
    pytest.param(2, 8, 2, 203, 64, 9, 16, jnp.float32, dict(num_splits=2),
                 id="gather-bs16-gqa4-f32"),
    # Same block size forced onto the contiguous pl.ds path.
    pytest.param(2, 2, 2, 203, 128, 9, 16, jnp.bfloat16, dict(blocks_per_iter=1),
                 id="contig-bs16-mha-bf16"),
    # Non-power-of-two block: 64-row tile with the rows >= 48 masked.
    pytest.param(1, 16, 2, 500, 64, 7, 48, jnp.bfloat16, dict(),
                 id="contig-bs48-gqa8-bf16"),
    # Block longer than the tile: 2 sub-tiles per block.
    pytest.param(2, 8, 2, 450, 128, 5, 64, jnp.float32, dict(block_k=32, num_splits=3),
                 id="subtiles-bs64-gqa4-f32"),
    # Tiny blocks: 8 blocks gathered per iteration.
    pytest.param(1, 4, 1, 130, 64, 11, 8, jnp.float32, dict(),
                 id="gather-bs8-gqa4-f32"),
    # the splits merged by the Pallas kernel (split_merge)
    pytest.param(2, 12, 4, 450, 128, 5, 64, jnp.bfloat16, dict(block_k=32, num_splits=3, merge="pallas"),
                 id="subtiles-bs64-gqa3-bf16-pallas-merge"),
    # the splits' shares: fixed slots of the list ("capacity"), against the default that divides
    # each (row, head)'s valid blocks ("valid"; every case above)
    pytest.param(2, 8, 2, 203, 64, 9, 16, jnp.float32, dict(num_splits=3, split_schedule="capacity"),
                 id="gather-bs16-gqa4-f32-capacity-schedule"),
    pytest.param(2, 8, 2, 450, 128, 5, 64, jnp.float32, dict(block_k=32, num_splits=3, split_schedule="capacity"),
                 id="subtiles-bs64-gqa4-f32-capacity-schedule"),
]


@pytest.mark.parametrize("B,Hq,Hkv,S,D,NB,block_size,dtype,tuning", CASES)
@pytest.mark.parametrize("impl", ["pallas", "reference"])
def test_matches_oracle(B, Hq, Hkv, S, D, NB, block_size, dtype, tuning, impl):
    rng = np.random.default_rng(hash((B, Hq, S, D, NB, block_size)) % 2**32)
    pool = np.array([0, 1, NB // 2, NB - 1, NB, NB + 3, -2])
    counts = rng.choice(pool, size=(B, Hkv))
    counts[0, 0] = NB + 5          # clamped to NB
    counts[-1, -1] = 0             # empty
    if Hkv > 1:
        counts[0, 1] = max(1, NB // 2)
    # Ragged lengths: full, mid-block, and one row ending inside a block.
    lengths = np.array([S, S - block_size // 2 - 3][:B])
    if B == 1:
        lengths = np.array([S - 5])
    q, k, v, bidx, lists = make_case(rng, B, Hq, Hkv, S, D, NB, block_size, dtype, counts,
                                     lengths)
    scale = 1.1 / np.sqrt(D)
    want, m_want, l_want = oracle(q, k, v, lists, scale)
    out, (m, l) = block_sparse_decode_attention(
        q, k, v, bidx, jnp.asarray(counts, jnp.int32), jnp.asarray(lengths, jnp.int32),
        block_size=block_size, scale=scale, return_residuals=True, impl=impl, **tuning)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert np.all(np.isfinite(np.asarray(out, np.float32)))
    assert_close(out, want, dtype, "output")
    np.testing.assert_allclose(np.asarray(m), m_want, rtol=2e-5,
                               atol=2e-5 if dtype == jnp.float32 else 2e-2)
    np.testing.assert_allclose(np.asarray(l), l_want, rtol=1e-4 if dtype == jnp.float32 else 2e-2,
                               atol=1e-5)


@pytest.mark.parametrize("impl", ["pallas", "reference"])
def test_blocks_past_length_and_out_of_range_ids(impl):
    """Blocks wholly past the length, negative ids and ids past S inside the
    count contribute nothing; a row with only such blocks gives zeros."""
    rng = np.random.default_rng(7)
    B, Hq, Hkv, S, D, bs = 2, 4, 2, 100, 64, 16
    q = jnp.asarray(rng.standard_normal((B, Hq, D)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, Hkv, S, D)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((B, Hkv, S, D)), jnp.float32)
    lengths = np.array([40, 100])
    bidx = np.array([[[0, 5, 3, -1], [4, 6, 2, 9]],      # row 0: only block 0 and 2 < 40
                     [[-3, 7, 100, 1], [6, 2, 0, 5]]])   # block 6 is partial (96..99)
    counts = np.array([[4, 3], [3, 4]])
    lists = [[block_tokens(bidx[b, h], counts[b, h], lengths[b], S, bs) for h in range(Hkv)]
             for b in range(B)]
    assert lists[1][0].size == 0 and lists[0][1].size == 8
    want, _, _ = oracle(q, k, v, lists, 1 / 8)
    out = block_sparse_decode_attention(
        q, k, v, jnp.asarray(bidx, jnp.int32), jnp.asarray(counts, jnp.int32),
        jnp.asarray(lengths, jnp.int32), block_size=bs, impl=impl)
    assert_close(out, want, jnp.float32, impl)
    assert np.all(np.asarray(out)[1, :2] == 0.0)


def test_merge_blocks_with_dense_window():
    """Block-sparse prefix selection + dense recent window (disjoint), merged,
    equal attention over the union."""
    rng = np.random.default_rng(8)
    B, Hq, Hkv, S, D, bs, W = 2, 8, 2, 300, 64, 16, 40
    q = jnp.asarray(rng.standard_normal((B, Hq, D)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((B, Hkv, S, D)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((B, Hkv, S, D)), jnp.bfloat16)
    lengths = np.array([300, 250])
    prefix = lengths - W                      # blocks cover [0, prefix); window the rest
    NB = 6
    bidx = np.zeros((B, Hkv, NB), np.int64)
    counts = np.array([[6, 2], [4, 0]])
    win_idx = np.zeros((B, Hkv, W), np.int32)
    union = [[None] * Hkv for _ in range(B)]
    for b in range(B):
        for h in range(Hkv):
            bidx[b, h] = rng.permutation(prefix[b] // bs)[:NB]
            win_idx[b, h] = np.arange(prefix[b], lengths[b])
            blk = block_tokens(bidx[b, h], counts[b, h], prefix[b], S, bs)
            union[b][h] = np.concatenate([blk, win_idx[b, h]])
    want, _, _ = oracle(q, k, v, union, 1 / 8)
    o1, r1 = block_sparse_decode_attention(
        q, k, v, jnp.asarray(bidx, jnp.int32), jnp.asarray(counts, jnp.int32),
        jnp.asarray(prefix, jnp.int32), block_size=bs, return_residuals=True, impl="pallas")
    o2, r2 = sparse_decode_attention(q, k, v, jnp.asarray(win_idx),
                                     jnp.full((B, Hkv), W, jnp.int32),
                                     return_residuals=True, impl="pallas")
    assert_close(merge_attention(o1, r1, o2, r2), want, jnp.bfloat16, "merged")


def test_tiling_resolution():
    # (tile, sub_tiles, blocks_per_iter, num_splits, blocks_per_split)
    assert resolve_block_tuning(1, 8, 64, 128, 16)[:3] == (64, 1, 4)
    assert resolve_block_tuning(1, 8, 64, 128, 64)[:3] == (64, 1, 1)
    assert resolve_block_tuning(1, 8, 64, 128, 48)[:3] == (64, 1, 1)
    assert resolve_block_tuning(1, 8, 64, 128, 256)[:3] == (64, 4, 1)
    assert resolve_block_tuning(1, 8, 64, 128, 12)[:3] == (16, 1, 1)
    tile, sub, bpi, ns, bps = resolve_block_tuning(1, 8, 100, 128, 16)
    assert ns * bps >= 100 and bps % bpi == 0 and bps * 16 >= 256
    with pytest.raises(ValueError):
        resolve_block_tuning(1, 8, 64, 128, 48, blocks_per_iter=2)


def _good():
    return dict(q=jnp.ones((2, 8, 64), jnp.bfloat16), k=jnp.ones((2, 2, 100, 64), jnp.bfloat16),
                v=jnp.ones((2, 2, 100, 64), jnp.bfloat16),
                block_indices=jnp.zeros((2, 2, 4), jnp.int32),
                block_counts=jnp.ones((2, 2), jnp.int32), lengths=jnp.full((2,), 100, jnp.int32))


@pytest.mark.parametrize("change,kwargs,exc", [
    ({}, dict(block_size=0), ValueError),
    ({}, dict(block_size=-16), ValueError),
    ({}, dict(block_size=16.0), TypeError),
    ({}, dict(block_size=True), TypeError),
    (dict(lengths=jnp.full((3,), 100, jnp.int32)), {}, ValueError),
    (dict(lengths=jnp.full((2, 1), 100, jnp.int32)), {}, ValueError),
    (dict(lengths=jnp.full((2,), 100.0)), {}, TypeError),
    (dict(block_indices=jnp.zeros((2, 2, 4), jnp.float32)), {}, TypeError),
    (dict(block_indices=jnp.zeros((2, 1, 4), jnp.int32)), {}, ValueError),
    (dict(block_counts=jnp.ones((2, 2, 1), jnp.int32)), {}, ValueError),
    (dict(block_counts=jnp.ones((2, 2), jnp.float32)), {}, TypeError),
    (dict(q=jnp.ones((2, 6, 64), jnp.bfloat16), k=jnp.ones((2, 4, 100, 64), jnp.bfloat16),
          v=jnp.ones((2, 4, 100, 64), jnp.bfloat16),
          block_indices=jnp.zeros((2, 4, 4), jnp.int32),
          block_counts=jnp.ones((2, 4), jnp.int32)), {}, ValueError),      # 6 % 4 != 0
    (dict(v=jnp.ones((2, 2, 100, 64), jnp.float32)), {}, TypeError),      # k/v dtype
    ({}, dict(blocks_per_iter=0), ValueError),
    ({}, dict(num_warps=4.0), TypeError),
    ({}, dict(impl="pallas", blocks_per_iter=3), ValueError),             # 3 * 16 not pow2
])
def test_bad_inputs(change, kwargs, exc):
    args = _good() | change
    kwargs = dict(block_size=16) | kwargs
    with pytest.raises(exc):
        block_sparse_decode_attention(args["q"], args["k"], args["v"], args["block_indices"],
                                      args["block_counts"], args["lengths"], **kwargs)


def test_merge_attention_bad_inputs():
    o = jnp.zeros((1, 2, 64), jnp.float32)
    res = (jnp.zeros((1, 2), jnp.float32), jnp.ones((1, 2), jnp.float32))
    with pytest.raises(ValueError):
        merge_attention(o, res, jnp.zeros((1, 3, 64)), res)
    with pytest.raises(TypeError):
        merge_attention(o, res[0], o, res)
    with pytest.raises(ValueError):
        merge_attention(o, (res[0], jnp.ones((2, 1))), o, res)


# --------------------------------------------------------------------------
# The shared decode-kernel checks (tests/kernel_test_base.py)
# --------------------------------------------------------------------------

from kernel_test_base import DecodeKernelTestBase  # noqa: E402


class TestBlockSparseDecodeKernel(DecodeKernelTestBase):
    """Block lists of 16 tokens: ragged counts and lengths, the partial last block,
    blocks past a row's length and garbage past the count."""

    op = staticmethod(lambda q, k, v, **a: block_sparse_decode_attention(q, k, v, block_size=16, **a))

    def draw(self, rng, B, Hkv, S):
        nb = 5
        counts = rng.integers(1, nb + 1, size=(B, Hkv))
        counts[0, 0] = nb
        lengths = rng.integers(S // 2, S + 1, size=(B,))
        lengths[0] = S
        _, _, _, bidx, lists = make_case(rng, B, 1, Hkv, S, 8, nb, 16, jnp.float32, counts, lengths)
        return dict(block_indices=bidx, block_counts=jnp.asarray(counts, jnp.int32),
                    lengths=jnp.asarray(lengths, jnp.int32)), lists

    def empty_args(self, B, Hkv, S):
        counts = np.full((B, Hkv), 2, np.int32)
        counts[0, 0] = 0
        return dict(block_indices=jnp.zeros((B, Hkv, 3), jnp.int32), block_counts=jnp.asarray(counts),
                    lengths=jnp.full((B,), S, jnp.int32))


class TestDenseDecodeKernel(DecodeKernelTestBase):
    """Exact attention over [0, lengths): the block kernel over every block up to the
    row's length (``impl="pallas"``) and the masked einsum (``"reference"``)."""

    op = staticmethod(lambda q, k, v, **a: dense_decode_attention(q, k, v, block_size=32, **a))

    def draw(self, rng, B, Hkv, S):
        lengths = rng.integers(1, S + 1, size=(B,))
        lengths[0] = S
        lists = [[np.arange(int(lengths[b])) for _ in range(Hkv)] for b in range(B)]
        return dict(lengths=jnp.asarray(lengths, jnp.int32)), lists

    def empty_args(self, B, Hkv, S):
        return dict(lengths=jnp.asarray([0] + [S] * (B - 1), jnp.int32))


def test_dense_decode_bad_input():
    q, k, v = (jnp.zeros(s, jnp.float32) for s in ((2, 4, 16), (2, 2, 40, 16), (2, 2, 40, 16)))
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        dense_decode_attention(q, k, v, jnp.array([3, 4]), block_size=0)
    with pytest.raises(ValueError, match="lengths"):
        dense_decode_attention(q, k, v, jnp.array([3, 4, 5]))
    with pytest.raises(ValueError, match="scale is only supported by impl='pallas'"):
        dense_decode_attention(q, k, v, jnp.array([3, 4]), scale=0.5, impl="reference")


@pytest.mark.parametrize("block_size,tuning", [(16, dict(num_splits=2)), (16, dict(blocks_per_iter=1, num_splits=3)),
                                               (64, dict(block_k=32, num_splits=2))],
                         ids=["gather-bs16", "contig-bs16", "subtiles-bs64"])
@pytest.mark.parametrize("impl", ["pallas", "reference"])
def test_paged_pool_equals_the_contiguous_cache(block_size, tuning, impl):
    """Paged KV (``block_table``): the rows' pages scattered through one pool in random order,
    the same blocks selected (logical ids, some past the length, garbage past the count), give
    what the contiguous cache gives, ragged lengths and a partial last page included; the
    table's unused entries point at page 0 and are never read as real tokens."""
    from pallas_kernels.block_sparse_decode import paged_rows

    rng = np.random.default_rng(block_size)
    B, Hq, Hkv, D, W, NB = 3, 8, 2, 64, 7, 5
    S = W * block_size
    lengths = np.array([S, S - block_size // 2 - 1, 2 * block_size + 3])
    counts = rng.integers(0, NB + 1, (B, Hkv))
    q, k, v, bidx, _ = make_case(rng, B, Hq, Hkv, S, D, NB, block_size, jnp.float32, counts, lengths)
    pages = B * W + 2  # two spare pages beside the rows'
    table = rng.permutation(np.arange(1, pages))[:B * W].reshape(B, W).astype(np.int32)
    table[2, 3:] = 0  # the short row holds 3 pages; the rest of its table is the null page
    pool_k = np.zeros((1, Hkv, pages * block_size, D), np.float32)
    pool_v = np.zeros_like(pool_k)
    for b in range(B):
        for j in range(W):
            rows = slice(table[b, j] * block_size, (table[b, j] + 1) * block_size)
            if table[b, j]:
                pool_k[0, :, rows] = np.asarray(k[b, :, j * block_size:(j + 1) * block_size])
                pool_v[0, :, rows] = np.asarray(v[b, :, j * block_size:(j + 1) * block_size])
    pool_k, pool_v, table = jnp.asarray(pool_k), jnp.asarray(pool_v), jnp.asarray(table)
    view = np.asarray(paged_rows(pool_k, table, block_size))
    np.testing.assert_array_equal(view[:2], np.asarray(k[:2]))
    kw = dict(block_size=block_size, impl=impl, **tuning)
    want = block_sparse_decode_attention(q, k, v, bidx, jnp.asarray(counts, jnp.int32), jnp.asarray(lengths), **kw)
    got = block_sparse_decode_attention(q, pool_k, pool_v, bidx, jnp.asarray(counts, jnp.int32), jnp.asarray(lengths),
                                        block_table=table, **kw)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="whole pages"):
        block_sparse_decode_attention(q, pool_k[:, :, :-1], pool_v[:, :, :-1], bidx, jnp.asarray(counts, jnp.int32),
                                      jnp.asarray(lengths), block_table=table, **kw)
    with pytest.raises(ValueError):  # a pool of one row per q row is not a paged pool
        block_sparse_decode_attention(q, k, v, bidx, jnp.asarray(counts, jnp.int32), jnp.asarray(lengths),
                                      block_table=table, **kw)


@pytest.mark.parametrize("bpi", [None, 1], ids=["gather", "contig"])
def test_paged_kernel_lowers_to_triton_for_the_gpu(bpi):
    """The paged kernel (a block table, one pool for every row) compiles to one Triton call
    for a CUDA device, both inner loops, without a GPU here (jax.export for an H100)."""
    pytest.importorskip("jax._src.lib.triton")
    from test_topk import _lower_for_h100

    from pallas_kernels.block_sparse_decode import block_sparse_decode_attention_pallas

    def fn(q, k, v, bidx, counts, lengths, table):
        return block_sparse_decode_attention_pallas(q, k, v, bidx, counts, lengths, table, block_size=16,
                                                    blocks_per_iter=bpi, num_splits=4)

    sd = jax.ShapeDtypeStruct
    txt = _lower_for_h100(fn, sd((8, 32, 128), jnp.bfloat16), sd((1, 8, 4096 * 16, 128), jnp.bfloat16),
                          sd((1, 8, 4096 * 16, 128), jnp.bfloat16), sd((8, 8, 128), jnp.int32), sd((8, 8), jnp.int32),
                          sd((8,), jnp.int32), sd((8, 512), jnp.int32))
    assert txt.count("__gpu$xla.gpu.triton") == 1
