"""Token-gather sparse decode attention: reference and interpret-mode Pallas
kernel against a float64 NumPy oracle (CPU).

Layout: q [B, Hq, D], k/v [B, Hkv, S, D], indices int32[B, Hkv, K],
counts int32[B, Hkv].
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.merge import MASK_VALUE
from pallas_kernels.sparse_decode import choose_num_splits, resolve_sparse_tuning
from sparse_jax.ops.attention import merge_attention, sparse_decode_attention
from attention_oracle import oracle

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2, jnp.float16: 5e-3}


# --------------------------------------------------------------------------
# Oracle and data
# --------------------------------------------------------------------------



def make_qkv(rng, B, Hq, Hkv, S, D, dtype):
    # Rounded to the test dtype first: the oracle then sees exactly the kernel's
    # inputs, so the tolerance measures only the kernel's arithmetic.
    q = jnp.asarray(1.5 * rng.standard_normal((B, Hq, D)), dtype)
    k = jnp.asarray(rng.standard_normal((B, Hkv, S, D)), dtype)
    v = jnp.asarray(rng.standard_normal((B, Hkv, S, D)), dtype)
    return q, k, v


def make_indices(rng, B, Hkv, S, K, counts, duplicate_row=None):
    """Distinct in-range positions inside the count, garbage past it."""
    idx = rng.integers(-3 * S, 3 * S, size=(B, Hkv, K))  # garbage: negative and >= S
    lists = [[None] * Hkv for _ in range(B)]
    for b in range(B):
        for h in range(Hkv):
            c = int(np.clip(counts[b, h], 0, K))
            sel = rng.permutation(S)[:c]
            if duplicate_row == (b, h) and c >= 4:
                sel[c // 2:c // 2 + 2] = sel[:2]  # documented: attended twice
            idx[b, h, :c] = sel
            lists[b][h] = sel
    return jnp.asarray(idx, jnp.int32), lists


def assert_close(got, want, dtype, what):
    tol = TOL[dtype]
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=tol, atol=tol,
                               err_msg=what)


# --------------------------------------------------------------------------
# Correctness
# --------------------------------------------------------------------------

# (B, Hq, Hkv, S, D, K, dtype, tuning). S is never a multiple of the tile and
# K never a multiple of block_k.
CASES = [
    pytest.param(2, 4, 4, 257, 64, 100, jnp.float32, dict(block_k=32, num_splits=2),
                 id="mha-f32-d64-split2"),
    pytest.param(2, 16, 4, 300, 128, 77, jnp.bfloat16, dict(),
                 id="gqa4-bf16-d128-default"),
    pytest.param(1, 16, 2, 650, 64, 300, jnp.float32, dict(block_k=64, num_splits=3),
                 id="gqa8-f32-d64-split3"),
    pytest.param(2, 8, 1, 211, 128, 40, jnp.float16, dict(block_k=16),
                 id="gqa8-f16-d128-mqa"),
    # register double buffering: one split of several tiles, and splits ending mid-tile
    pytest.param(2, 12, 4, 333, 128, 150, jnp.bfloat16, dict(block_k=32, num_splits=1, prefetch=1),
                 id="gqa3-bf16-d128-prefetch"),
    pytest.param(1, 4, 1, 400, 256, 97, jnp.float32, dict(block_k=16, num_splits=2, prefetch=1),
                 id="mqa4-f32-d256-prefetch-split2"),
    # the splits merged by the Pallas kernel (split_merge), with empty rows and splits
    pytest.param(1, 16, 2, 650, 64, 300, jnp.float32, dict(block_k=64, num_splits=3, merge="pallas"),
                 id="gqa8-f32-d64-split3-pallas-merge"),
    pytest.param(2, 12, 4, 333, 128, 150, jnp.bfloat16, dict(block_k=16, num_splits=5, merge="pallas"),
                 id="gqa3-bf16-d128-split5-pallas-merge"),
]


@pytest.mark.parametrize("B,Hq,Hkv,S,D,K,dtype,tuning", CASES)
@pytest.mark.parametrize("impl", ["pallas", "reference"])
def test_matches_oracle(B, Hq, Hkv, S, D, K, dtype, tuning, impl):
    rng = np.random.default_rng(hash((B, Hq, S, D, K)) % 2**32)
    q, k, v = make_qkv(rng, B, Hq, Hkv, S, D, dtype)
    # Per-row counts: empty, short, over-K (clamped), full, in between.
    pool = np.array([0, 1, 5, K // 2, K - 1, K, K + 13, 3 * K, -4])
    counts = rng.choice(pool, size=(B, Hkv))
    counts[0, 0] = 0
    counts[-1, -1] = K + 7
    if Hkv > 1:
        counts[0, 1] = K // 2 + 3
    idx, lists = make_indices(rng, B, Hkv, S, K, counts, duplicate_row=(B - 1, Hkv - 1))
    scale = 0.9 / np.sqrt(D)
    want, m_want, l_want = oracle(q, k, v, lists, scale)

    out, (m, l) = sparse_decode_attention(
        q, k, v, idx, jnp.asarray(counts, jnp.int32), scale=scale,
        return_residuals=True, impl=impl, **tuning)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert m.dtype == jnp.float32 and l.dtype == jnp.float32
    assert np.all(np.isfinite(np.asarray(out, np.float32)))
    assert_close(out, want, dtype, "output")
    # Residuals are float32 even for bf16 input: compare more tightly.
    np.testing.assert_allclose(np.asarray(m), m_want, rtol=2e-5, atol=2e-5 if dtype == jnp.float32 else 2e-2)
    np.testing.assert_allclose(np.asarray(l), l_want, rtol=1e-4 if dtype == jnp.float32 else 2e-2, atol=1e-5)


def test_default_scale_and_no_residuals():
    rng = np.random.default_rng(1)
    B, Hq, Hkv, S, D, K = 1, 4, 2, 200, 64, 50
    q, k, v = make_qkv(rng, B, Hq, Hkv, S, D, jnp.float32)
    counts = np.array([[50, 20]])
    idx, lists = make_indices(rng, B, Hkv, S, K, counts)
    want, _, _ = oracle(q, k, v, lists, 1 / np.sqrt(D))
    for impl in ("pallas", "reference"):
        out = sparse_decode_attention(q, k, v, idx, jnp.asarray(counts, jnp.int32), impl=impl)
        assert not isinstance(out, tuple)
        assert_close(out, want, jnp.float32, impl)


def test_all_empty_gives_zeros():
    rng = np.random.default_rng(2)
    q, k, v = make_qkv(rng, 2, 8, 2, 100, 64, jnp.bfloat16)
    idx = jnp.asarray(rng.integers(-500, 500, (2, 2, 32)), jnp.int32)  # all garbage
    counts = jnp.asarray([[0, -3], [0, 0]], jnp.int32)
    for impl in ("pallas", "reference"):
        out, (m, l) = sparse_decode_attention(q, k, v, idx, counts, return_residuals=True,
                                              impl=impl)
        assert np.all(np.asarray(out, np.float32) == 0.0), impl
        assert np.all(np.asarray(l) == 0.0) and np.all(np.asarray(m) == np.float32(MASK_VALUE))
        # K == 0: nothing can be selected whatever the counts say.
        out0 = sparse_decode_attention(q, k, v, jnp.zeros((2, 2, 0), jnp.int32),
                                       jnp.full((2, 2), 5, jnp.int32), impl=impl)
        assert np.all(np.asarray(out0, np.float32) == 0.0), impl


def test_merge_dense_window_with_sparse_set():
    """A dense local window and a disjoint sparse set, merged, equal attention
    over their union."""
    rng = np.random.default_rng(3)
    B, Hq, Hkv, S, D = 2, 8, 2, 400, 64
    W = 48
    q, k, v = make_qkv(rng, B, Hq, Hkv, S, D, jnp.float32)
    lengths = np.array([400, 333])
    win_idx = np.zeros((B, Hkv, W), np.int32)
    sp_idx = np.zeros((B, Hkv, 90), np.int32)
    sp_counts = np.array([[90, 0], [37, 61]])
    union = [[None] * Hkv for _ in range(B)]
    for b in range(B):
        for h in range(Hkv):
            win = np.arange(lengths[b] - W, lengths[b])
            sel = rng.permutation(lengths[b] - W)[:sp_counts[b, h]]
            win_idx[b, h] = win
            sp_idx[b, h, :sp_counts[b, h]] = sel
            sp_idx[b, h, sp_counts[b, h]:] = rng.integers(-S, 2 * S, 90 - sp_counts[b, h])
            union[b][h] = np.concatenate([win, sel])
    want, m_want, l_want = oracle(q, k, v, union, 1 / np.sqrt(D))
    o1, r1 = sparse_decode_attention(q, k, v, jnp.asarray(win_idx), jnp.full((B, Hkv), W, jnp.int32),
                                     return_residuals=True, impl="pallas")
    o2, r2 = sparse_decode_attention(q, k, v, jnp.asarray(sp_idx), jnp.asarray(sp_counts, jnp.int32),
                                     return_residuals=True, impl="pallas")
    merged, (m, l) = merge_attention(o1, r1, o2, r2, return_residuals=True)
    assert_close(merged, want, jnp.float32, "merged output")
    np.testing.assert_allclose(np.asarray(m), m_want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(l), l_want, rtol=1e-4)
    # Merge is symmetric, and merging with an empty partial is the identity.
    assert_close(merge_attention(o2, r2, o1, r1), want, jnp.float32, "swapped")
    empty = (jnp.full(r1[0].shape, MASK_VALUE, jnp.float32), jnp.zeros_like(r1[1]))
    assert_close(merge_attention(o1, r1, jnp.zeros_like(o1), empty), np.asarray(o1),
                 jnp.float32, "merge with empty")


def test_under_jit_and_auto_on_cpu():
    rng = np.random.default_rng(4)
    q, k, v = make_qkv(rng, 1, 4, 1, 150, 64, jnp.float32)
    counts = np.array([[30]])
    idx, lists = make_indices(rng, 1, 1, 150, 40, counts)
    want, _, _ = oracle(q, k, v, lists, 1 / 8)
    f = jax.jit(lambda *a: sparse_decode_attention(*a, impl="auto"))
    assert_close(f(q, k, v, idx, jnp.asarray(counts, jnp.int32)), want, jnp.float32, "jit auto")


@pytest.mark.parametrize("impl", ["reference", "pallas"])
def test_kv_batch_share(impl):
    """q rows b read k/v row b // r (each with its own list): the same as repeating the
    cache r times (Kascade's tiled prefill, one row per tile)."""
    rng = np.random.default_rng(9)
    r = 3
    q, _, _ = make_qkv(rng, 2 * r, 16, 2, 40, 16, jnp.float32)
    _, k, v = make_qkv(rng, 2, 16, 2, 40, 16, jnp.float32)
    counts = rng.integers(0, 13, (2 * r, 2))
    idx, lists = make_indices(rng, 2 * r, 2, 40, 12, counts)
    want, wm, wl = oracle(q, jnp.repeat(k, r, 0), jnp.repeat(v, r, 0), lists, 0.25)
    out, (m, l) = sparse_decode_attention(q, k, v, idx, jnp.asarray(counts, jnp.int32), impl=impl,
                                          kv_batch_share=r, return_residuals=True)
    assert_close(out, want, jnp.float32, "shared rows")
    np.testing.assert_allclose(np.asarray(l), wl, rtol=1e-5)
    with pytest.raises(ValueError, match="kv_batch_share"):
        sparse_decode_attention(q, k, v, idx, jnp.asarray(counts, jnp.int32), kv_batch_share=4)
    with pytest.raises(ValueError, match="kv_batch_share"):
        sparse_decode_attention(q, k, v, idx, jnp.asarray(counts, jnp.int32), kv_batch_share=0)
    with pytest.raises(ValueError, match=r"B / kv_batch_share"):
        sparse_decode_attention(q, k, v, idx, jnp.asarray(counts, jnp.int32), kv_batch_share=2)


def test_head_dim_unsupported_by_kernel():
    rng = np.random.default_rng(5)
    q, k, v = make_qkv(rng, 1, 2, 1, 50, 48, jnp.float32)  # D=48: not a power of 2
    idx = jnp.asarray(rng.integers(0, 50, (1, 1, 8)), jnp.int32)
    counts = jnp.asarray([[8]], jnp.int32)
    with pytest.raises(ValueError, match="head_dim"):
        sparse_decode_attention(q, k, v, idx, counts, impl="pallas")
    # auto falls back to the reference.
    out = sparse_decode_attention(q, k, v, idx, counts, impl="auto")
    want, _, _ = oracle(q, k, v, [[np.asarray(idx[0, 0])]], 1 / np.sqrt(48))
    assert_close(out, want, jnp.float32, "auto fallback")


def test_num_split_heuristic():
    # Small B*Hkv and long selection: split until ~264 programs, >= 256 slots each.
    assert choose_num_splits(4096, 64, 256, 8) == 16
    assert choose_num_splits(4096, 64, 256, 1) == 16       # capped by 256 slots/split
    assert choose_num_splits(4096, 64, 256, 512) == 1      # grid already full
    assert choose_num_splits(100, 64, 256, 1) == 1
    bk, ns, k_split = resolve_sparse_tuning(1, 8, 1000, 128)
    assert bk == 64 and ns * k_split >= 1000 and k_split % bk == 0
    assert resolve_sparse_tuning(1, 1, 40, 64)[0] == 64
    assert resolve_sparse_tuning(1, 1, 20, 64)[0] == 32


# --------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------

def _good():
    q = jnp.ones((2, 8, 64), jnp.float32)
    k = jnp.ones((2, 2, 100, 64), jnp.float32)
    idx = jnp.zeros((2, 2, 16), jnp.int32)
    counts = jnp.ones((2, 2), jnp.int32)
    return dict(q=q, k=k, v=k, indices=idx, counts=counts)


@pytest.mark.parametrize("change,kwargs,exc", [
    (dict(q=jnp.ones((2, 8, 1, 64))), {}, ValueError),                     # q rank
    (dict(k=jnp.ones((2, 100, 64))), {}, ValueError),                       # k rank
    (dict(v=jnp.ones((2, 2, 99, 64))), {}, ValueError),                     # v != k shape
    (dict(q=jnp.ones((2, 7, 64))), {}, ValueError),                         # GQA 7 % 2
    (dict(q=jnp.ones((3, 8, 64))), {}, ValueError),                         # batch mismatch
    (dict(q=jnp.ones((2, 8, 32))), {}, ValueError),                         # head_dim mismatch
    (dict(q=jnp.ones((2, 8, 64), jnp.int32)), {}, TypeError),               # int q
    (dict(q=jnp.ones((2, 8, 64), jnp.bfloat16)), {}, TypeError),            # mixed dtypes
    (dict(indices=jnp.zeros((2, 2, 16), jnp.float32)), {}, TypeError),      # float indices
    (dict(indices=jnp.zeros((2, 3, 16), jnp.int32)), {}, ValueError),       # Hkv mismatch
    (dict(indices=jnp.zeros((2, 16), jnp.int32)), {}, ValueError),          # indices rank
    (dict(counts=jnp.ones((2, 2), jnp.float32)), {}, TypeError),            # float counts
    (dict(counts=jnp.ones((2,), jnp.int32)), {}, ValueError),               # counts rank
    ({}, dict(impl="triton"), ValueError),                                  # unknown impl
    ({}, dict(block_kk=64), TypeError),                                     # unknown knob
    ({}, dict(block_k=48, impl="pallas"), ValueError),                      # not a power of 2
    ({}, dict(num_splits=0), ValueError),
    ({}, dict(prefetch=2, impl="pallas"), ValueError),                      # 0 or 1
    ({}, dict(scale=jnp.float32(0.1)), TypeError),                          # traced-able scale
])
def test_bad_inputs(change, kwargs, exc):
    args = _good() | change
    with pytest.raises(exc):
        sparse_decode_attention(args["q"], args["k"], args["v"], args["indices"],
                                args["counts"], **kwargs)


# --------------------------------------------------------------------------
# The shared decode-kernel checks (tests/kernel_test_base.py)
# --------------------------------------------------------------------------

from kernel_test_base import DecodeKernelTestBase  # noqa: E402


class TestSparseDecodeKernel(DecodeKernelTestBase):
    """Token lists: ragged counts (one full row), K never a multiple of a tile."""

    op = staticmethod(sparse_decode_attention)

    def draw(self, rng, B, Hkv, S):
        K = S // 3 + 5
        counts = rng.integers(1, K + 1, size=(B, Hkv))
        counts[0, 0] = K
        idx, lists = make_indices(rng, B, Hkv, S, K, counts)
        return dict(indices=idx, counts=jnp.asarray(counts, jnp.int32)), lists

    def empty_args(self, B, Hkv, S):
        counts = np.full((B, Hkv), 5, np.int32)
        counts[0, 0] = 0
        return dict(indices=jnp.zeros((B, Hkv, 8), jnp.int32), counts=jnp.asarray(counts))


@pytest.mark.parametrize("b,hkv,ns,g,d", [(2, 3, 5, 3, 64), (1, 2, 16, 4, 128), (3, 1, 1, 8, 256), (1, 1, 3, 1, 96)])
def test_split_merge_kernel_equals_the_jnp_merge(b, hkv, ns, g, d):
    """``split_merge.merge_splits_pallas`` (interpret mode) against ``combine_splits``: NS, G
    and D not powers of two, splits that are empty (m = MASK_VALUE, l = 0, o = 0), one
    (b, h) row with every split empty (its output 0, never NaN), and bf16 output."""
    from pallas_kernels.split_merge import merge_splits_pallas, merge_splits_reference

    rng = np.random.default_rng(ns * 100 + g * 10 + d)
    o = rng.normal(size=(b, hkv, ns, g, d)).astype(np.float32) * 3
    m = rng.normal(size=(b, hkv, ns, g)).astype(np.float32) * 4
    l = rng.uniform(0.5, 20, size=(b, hkv, ns, g)).astype(np.float32)
    empty = rng.random((b, hkv, ns, g)) < 0.3
    empty[0, 0] = True  # every split of the first (b, h) row
    m = np.where(empty, MASK_VALUE, m)
    l = np.where(empty, 0.0, l)
    o = np.where(empty[..., None], 0.0, o)
    for dtype in (jnp.float32, jnp.bfloat16):
        got = merge_splits_pallas(jnp.asarray(o), jnp.asarray(m), jnp.asarray(l), dtype, interpret=True)
        want = merge_splits_reference(jnp.asarray(o), jnp.asarray(m), jnp.asarray(l), dtype)
        assert got[0].dtype == dtype and got[0].shape == (b, hkv, g, d)
        tol = 1e-6 if dtype == jnp.float32 else 1e-2
        for x, y in zip(got, want):
            np.testing.assert_allclose(np.asarray(x, np.float64), np.asarray(y, np.float64), rtol=tol, atol=tol)
        assert np.all(np.asarray(got[0], np.float32)[0, 0] == 0.0) and np.all(np.asarray(got[2])[0, 0] == 0.0)


def test_split_merge_refuses_bad_shapes_and_names():
    from pallas_kernels.split_merge import merge_splits_pallas
    from pallas_kernels.sparse_decode import finish_splits

    o = jnp.zeros((1, 2, 3, 4, 8))
    with pytest.raises(ValueError, match="partials"):
        merge_splits_pallas(o, jnp.zeros((1, 2, 3, 5)), jnp.zeros((1, 2, 3, 4)), jnp.float32, interpret=True)
    with pytest.raises(ValueError, match="merge must be one of"):
        finish_splits(o, jnp.zeros((1, 2, 3, 4)), jnp.zeros((1, 2, 3, 4)), 4, jnp.float32, False, merge="cuda")
    q, kv = jnp.zeros((1, 4, 64)), jnp.zeros((1, 2, 16, 64))
    with pytest.raises(ValueError, match="tuning argument merge must be one of"):
        sparse_decode_attention(q, kv, kv, jnp.zeros((1, 2, 4), jnp.int32), jnp.ones((1, 2), jnp.int32),
                                impl="pallas", merge="fast")


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
@pytest.mark.parametrize("d", [64, 128, 256])
def test_decode_kernels_lower_to_triton_with_the_fast_exponential(abstract_h100, d):
    """Both decode kernels lower for CUDA (an abstract H100, no GPU; the gather kernel with
    its register prefetch too), and their online
    softmax uses the MUFU ex2.approx (pallas_kernels._util.exp_fast), not libdevice."""
    from pallas_kernels.block_sparse_decode import block_sparse_decode_attention_pallas
    from pallas_kernels.sparse_decode import sparse_decode_attention_pallas

    sd = jax.ShapeDtypeStruct
    q, kv = sd((2, 8, d), jnp.bfloat16), sd((2, 2, 1024, d), jnp.bfloat16)
    idx, cnt, lens = sd((2, 2, 256), jnp.int32), sd((2, 2), jnp.int32), sd((2,), jnp.int32)
    bidx = sd((2, 2, 8), jnp.int32)
    for fn, args in ((sparse_decode_attention_pallas, (q, kv, kv, idx, cnt)),
                     (functools.partial(sparse_decode_attention_pallas, prefetch=1), (q, kv, kv, idx, cnt)),
                     (functools.partial(sparse_decode_attention_pallas, merge="pallas"), (q, kv, kv, idx, cnt)),
                     (functools.partial(block_sparse_decode_attention_pallas, block_size=64),
                      (q, kv, kv, bidx, cnt, lens))):
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "__gpu$xla.gpu.triton" in text and "ex2.approx.ftz.f32" in text
