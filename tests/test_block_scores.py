"""Block metadata (Quest min/max, ArkVale cuboid) and Quest block scores.

The reference and the Pallas kernel (interpret mode on CPU) are both checked
against float64 NumPy oracles on awkward sizes: S not a multiple of the block,
ragged lengths (a partial last block, an exact block multiple, an empty row),
GQA ratios 1, 3, 4 and 8, head_dim 64 and 128, f32 and bf16.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparse_jax.ops import scoring

IMPLS = ["reference", "pallas"]


# NumPy random data (jax.random would compile once per shape: slow on CPU CI).
def _randn(seed, shape, dtype, scale=1.0, shift=0.0):
    x = np.random.default_rng(seed).standard_normal(shape) * scale + shift
    return jnp.asarray(x.astype(np.float32), dtype=dtype)


def _keys(seed, b, hkv, s, d, dtype):
    return _randn(seed, (b, hkv, s, d), dtype, 2.0, 0.3)


def _oracle_blocks(k, lengths, block_size):
    """Per block: list of valid-token arrays [n, D] in float64."""
    k = np.asarray(k.astype(jnp.float32), np.float64)
    b, h, s, d = k.shape
    nb = -(-s // block_size)
    out = [[[None] * nb for _ in range(h)] for _ in range(b)]
    for bi in range(b):
        length = min(int(lengths[bi]), s)
        for hi in range(h):
            for n in range(nb):
                lo, hi_tok = n * block_size, min((n + 1) * block_size, length)
                out[bi][hi][n] = k[bi, hi, lo:hi_tok] if hi_tok > lo else np.zeros((0, d))
    return out, nb, d


def _oracle_minmax(k, lengths, block_size):
    blocks, nb, d = _oracle_blocks(k, lengths, block_size)
    b, h = k.shape[:2]
    kmax, kmin = np.zeros((b, h, nb, d)), np.zeros((b, h, nb, d))
    for bi in range(b):
        for hi in range(h):
            for n in range(nb):
                x = blocks[bi][hi][n]
                if len(x):
                    kmax[bi, hi, n], kmin[bi, hi, n] = x.max(0), x.min(0)
    return kmax, kmin


def _oracle_cuboid(k, lengths, block_size):
    blocks, nb, d = _oracle_blocks(k, lengths, block_size)
    b, h = k.shape[:2]
    up, low = np.zeros((b, h, nb, d)), np.zeros((b, h, nb, d))
    for bi in range(b):
        for hi in range(h):
            for n in range(nb):
                x = blocks[bi][hi][n]
                if len(x):
                    c = (x.max(0) + x.min(0)) / 2
                    r = np.abs(c - x).mean(0)
                    up[bi, hi, n], low[bi, hi, n] = c + r, c - r
    return up, low


def _oracle_quest(q, kmax, kmin):
    q = np.asarray(q.astype(jnp.float32), np.float64)
    kmax = np.asarray(kmax.astype(jnp.float32), np.float64)
    kmin = np.asarray(kmin.astype(jnp.float32), np.float64)
    b, hq, d = q.shape
    hkv = kmax.shape[1]
    g = hq // hkv
    out = np.zeros(kmax.shape[:3])
    for h in range(hq):
        kh = h // g
        qp, qn = np.maximum(q[:, h], 0), np.minimum(q[:, h], 0)
        out[:, kh] += np.einsum("bd,bnd->bn", qp, kmax[:, kh]) + np.einsum("bd,bnd->bn", qn, kmin[:, kh])
    return out


# (dtype, D, block_size, S, lengths): lengths cover a full row, a partial last
# block, an exact block multiple and (once) an empty row.
CACHE_CASES = [
    (jnp.float32, 64, 16, 77, [77, 32, 45]),
    (jnp.bfloat16, 128, 32, 100, [64, 100, 0]),
    (jnp.float32, 128, 8, 41, [41, 8, 17]),
    (jnp.bfloat16, 256, 16, 70, [70, 33, 1]),  # Gemma 3: D=256
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype,d,bs,s,lengths", CACHE_CASES)
def test_block_minmax_matches_oracle(impl, dtype, d, bs, s, lengths):
    k = _keys(d + s, len(lengths), 2, s, d, dtype)
    lengths = jnp.asarray(lengths, jnp.int32)
    kmax, kmin = scoring.block_minmax(k, lengths, block_size=bs, impl=impl)
    nb = -(-s // bs)
    assert kmax.shape == kmin.shape == (len(lengths), 2, nb, d)
    assert kmax.dtype == kmin.dtype == dtype
    omax, omin = _oracle_minmax(k, lengths, bs)
    # max/min of representable values is exact in any dtype.
    np.testing.assert_array_equal(np.asarray(kmax.astype(jnp.float32)), omax)
    np.testing.assert_array_equal(np.asarray(kmin.astype(jnp.float32)), omin)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype,d,bs,s,lengths", CACHE_CASES[:2])
def test_block_cuboid_matches_oracle(impl, dtype, d, bs, s, lengths):
    k = _keys(3 * d + s, len(lengths), 2, s, d, dtype)
    lengths = jnp.asarray(lengths, jnp.int32)
    up, low = scoring.block_cuboid(k, lengths, block_size=bs, impl=impl)
    assert up.dtype == low.dtype == dtype
    oup, olow = _oracle_cuboid(k, lengths, bs)
    tol = 1e-5 if dtype == jnp.float32 else 1e-2  # bf16: one rounding of the output
    np.testing.assert_allclose(np.asarray(up.astype(jnp.float32)), oup, rtol=tol, atol=tol)
    np.testing.assert_allclose(np.asarray(low.astype(jnp.float32)), olow, rtol=tol, atol=tol)


def test_block_minmax_blocks_per_program_tail():
    """Several blocks per program with a ragged tail of programs (NB=7, 4 per program)."""
    k = _keys(5, 2, 3, 100, 64, jnp.float32)
    lengths = jnp.asarray([100, 50], jnp.int32)
    got = scoring.block_minmax(k, lengths, block_size=16, impl="pallas", blocks_per_program=4)
    want = _oracle_minmax(k, lengths, 16)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), w)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_update_block_minmax_equals_rebuild(dtype):
    """Appending tokens one by one (across a block boundary) == rebuilding."""
    b, hkv, s, d, bs = 3, 2, 48, 64, 16
    k = _keys(11, b, hkv, s, d, dtype)  # positions past the length hold garbage
    lengths = jnp.asarray([14, 16, 31], jnp.int32)  # 16: the next token opens a block
    kmax, kmin = scoring.block_minmax(k, lengths, block_size=bs, impl="reference")
    k_np = np.array(k.astype(jnp.float32))
    for step in range(4):  # rows 0 and 2 cross a block boundary during these steps
        k_new = _randn(100 + step, (b, hkv, d), dtype, 3.0)
        k_np[np.arange(b), :, np.asarray(lengths)] = np.asarray(k_new.astype(jnp.float32))
        kmax, kmin = scoring.update_block_minmax(kmax, kmin, k_new, lengths, block_size=bs)
        lengths = lengths + 1
        rmax, rmin = _oracle_minmax(jnp.asarray(k_np), lengths, bs)
        np.testing.assert_array_equal(np.asarray(kmax.astype(jnp.float32)), rmax)
        np.testing.assert_array_equal(np.asarray(kmin.astype(jnp.float32)), rmin)
    assert kmax.dtype == dtype


def test_update_block_minmax_out_of_range_is_noop():
    k = _keys(12, 2, 2, 32, 64, jnp.float32)
    kmax, kmin = scoring.block_minmax(k, jnp.asarray([32, 5]), block_size=16, impl="reference")
    k_new = jnp.full((2, 2, 64), 100.0)
    nmax, nmin = scoring.update_block_minmax(kmax, kmin, k_new, jnp.asarray([32, -1]), block_size=16)
    np.testing.assert_array_equal(np.asarray(nmax), np.asarray(kmax))
    np.testing.assert_array_equal(np.asarray(nmin), np.asarray(kmin))


# (Hq, Hkv, D, dtype): GQA ratios 1, 3 (SmolLM2: 9/3), 4 and 8.
QUEST_CASES = [
    (4, 4, 64, jnp.float32),
    (9, 3, 64, jnp.bfloat16),
    (8, 2, 128, jnp.bfloat16),
    (16, 2, 128, jnp.float32),
    (4, 1, 256, jnp.bfloat16),  # Gemma 3 270M: MQA, D=256
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("hq,hkv,d,dtype", QUEST_CASES)
def test_quest_scores_match_oracle(impl, hq, hkv, d, dtype):
    b, s, bs = 2, 150, 16  # NB = 10, not a multiple of block_n below
    k = _keys(hq * d, b, hkv, s, d, dtype)
    lengths = jnp.asarray([150, 96], jnp.int32)
    kmax, kmin = scoring.block_minmax(k, lengths, block_size=bs, impl="reference")
    q = _randn(hq + d, (b, hq, d), dtype)
    got = scoring.quest_block_scores(q, kmax, kmin, impl=impl, block_n=4)
    assert got.shape == (b, hkv, -(-s // bs)) and got.dtype == jnp.float32
    want = _oracle_quest(q, kmax, kmin)
    # Inputs are exact in f32, so only f32 accumulation error remains, for bf16 too.
    scale = np.abs(want).max()
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("hq,hkv,d,dtype", [QUEST_CASES[1], QUEST_CASES[4]])
def test_quest_scores_reduced_by_max_over_the_group(impl, hq, hkv, d, dtype):
    """``group_reduce="max"``: each query head's own bound, the largest of the group
    (float64 oracle); with one head per group it is the sum's result."""
    b, s, bs = 2, 150, 16
    k = _keys(hq * d + 1, b, hkv, s, d, dtype)
    lengths = jnp.asarray([150, 96], jnp.int32)
    kmax, kmin = scoring.block_minmax(k, lengths, block_size=bs, impl="reference")
    q = _randn(hq + d + 1, (b, hq, d), dtype)
    got = scoring.quest_block_scores(q, kmax, kmin, group_reduce="max", impl=impl, block_n=4)
    g = hq // hkv
    per_head = np.stack([_oracle_quest(q[:, [h]], kmax[:, [h // g]], kmin[:, [h // g]])[:, 0] for h in range(hq)], 1)
    want = per_head.reshape(b, hkv, g, -1).max(2)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert not np.allclose(want, _oracle_quest(q, kmax, kmin))  # not the sum
    one = scoring.quest_block_scores(q[:, ::g], kmax, kmin, group_reduce="max", impl=impl)
    np.testing.assert_array_equal(np.asarray(one), np.asarray(scoring.quest_block_scores(q[:, ::g], kmax, kmin, impl=impl)))
    with pytest.raises(ValueError, match="group_reduce"):
        scoring.quest_block_scores(q, kmax, kmin, group_reduce="mean")


@pytest.mark.parametrize("impl", IMPLS)
def test_quest_score_bounds_every_token(impl):
    """Random trials: the block score bounds sum_g q_g . k_j for each valid token j."""
    rng = np.random.default_rng(0)
    b, hq, hkv, s, d, bs = 2, 8, 2, 70, 64, 16
    for trial in range(4 if impl == "reference" else 1):
        k = (rng.standard_normal((b, hkv, s, d)) * rng.uniform(0.1, 4)).astype(np.float32)
        k = jnp.asarray(k).astype(jnp.bfloat16)
        q = jnp.asarray(rng.standard_normal((b, hq, d)) * rng.uniform(0.1, 4), jnp.bfloat16)
        lengths = jnp.asarray(rng.integers(1, s + 1, size=b), jnp.int32)
        kmax, kmin = scoring.block_minmax(k, lengths, block_size=bs, impl=impl)
        score = np.asarray(scoring.quest_block_scores(q, kmax, kmin, impl=impl), np.float64)
        kf = np.asarray(k.astype(jnp.float32), np.float64)
        qf = np.asarray(q.astype(jnp.float32), np.float64).reshape(b, hkv, hq // hkv, d).sum(2)
        true = np.einsum("bhd,bhsd->bhs", qf, kf)  # sum over the group of q_g . k_j
        for bi in range(b):
            n_valid = int(lengths[bi])
            blk = np.arange(n_valid) // bs
            slack = 1e-5 * np.abs(score[bi]).max() + 1e-5
            assert np.all(score[bi][:, blk] >= true[bi, :, :n_valid] - slack), (trial, bi)


def test_auto_is_reference_on_cpu_and_falls_back_for_odd_sizes():
    k = _keys(1, 2, 2, 40, 48, jnp.float32)  # D=48 is not a power of two
    lengths = jnp.asarray([40, 7], jnp.int32)
    ref = scoring.block_minmax(k, lengths, block_size=12, impl="reference")
    got = scoring.block_minmax(k, lengths, block_size=12, impl="auto")
    for g, r in zip(got, ref):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(r))
    with pytest.raises(ValueError, match="powers of two"):
        scoring.block_minmax(k, lengths, block_size=12, impl="pallas")


def test_bad_inputs_fail_before_compilation():
    k = _keys(2, 2, 2, 40, 64, jnp.float32)
    lengths = jnp.asarray([40, 7], jnp.int32)
    q = jnp.ones((2, 4, 64), jnp.float32)
    kmax, kmin = scoring.block_minmax(k, lengths, block_size=16, impl="reference")
    bad = [
        (ValueError, lambda: scoring.block_minmax(k[0], lengths, block_size=16)),  # rank
        (TypeError, lambda: scoring.block_minmax(k.astype(jnp.int32), lengths, block_size=16)),
        (TypeError, lambda: scoring.block_minmax(k, lengths.astype(jnp.float32), block_size=16)),
        (ValueError, lambda: scoring.block_minmax(k, lengths[:1], block_size=16)),
        (ValueError, lambda: scoring.block_minmax(k, lengths, block_size=0)),
        (ValueError, lambda: scoring.block_minmax(k, lengths, block_size=-16)),
        (ValueError, lambda: scoring.block_minmax(k, lengths, block_size=16.0)),
        (ValueError, lambda: scoring.block_cuboid(k, lengths, block_size=0)),
        (ValueError, lambda: scoring.block_minmax(k, lengths, block_size=16, impl="gpu")),
        (ValueError, lambda: scoring.quest_block_scores(q[0], kmax, kmin)),  # rank
        (ValueError, lambda: scoring.quest_block_scores(jnp.ones((2, 3, 64)), kmax, kmin)),  # GQA
        (ValueError, lambda: scoring.quest_block_scores(jnp.ones((2, 4, 32)), kmax, kmin)),  # D
        (ValueError, lambda: scoring.quest_block_scores(q, kmax, kmin[:, :, :1])),
        (TypeError, lambda: scoring.quest_block_scores(q.astype(jnp.int32), kmax, kmin)),
        (ValueError, lambda: scoring.update_block_minmax(kmax, kmin, k[:, :, 0, :32], lengths,
                                                         block_size=16)),
        (TypeError, lambda: scoring.update_block_minmax(kmax, kmin, k[:, :, 0], lengths * 1.0,
                                                        block_size=16)),
        (ValueError, lambda: scoring.update_block_minmax(kmax, kmin, k[:, :, 0], lengths,
                                                         block_size=0)),
    ]
    for err, fn in bad:
        with pytest.raises(err):
            fn()
    # The same checks fire at trace time inside a user's jit (before XLA sees anything).
    with pytest.raises(ValueError, match="block_size"):
        jax.jit(lambda k, l: scoring.block_minmax(k, l, block_size=0)).trace(k, lengths)


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
def test_kernels_lower_to_triton(abstract_h100):
    from pallas_kernels import block_scores as bs

    sd = jax.ShapeDtypeStruct
    k, lengths = sd((2, 3, 77, 128), jnp.bfloat16), sd((2,), jnp.int32)
    meta = sd((2, 3, 5, 128), jnp.bfloat16)
    fns = [
        (lambda k, l: bs.block_summary_kernel(k, l, block_size=16, mode="minmax"), (k, lengths)),
        (lambda k, l: bs.block_summary_kernel(k, l, block_size=16, mode="cuboid"), (k, lengths)),
        (bs.quest_block_scores_kernel, (sd((2, 9, 128), jnp.bfloat16), meta, meta)),  # G = 3
        (lambda q, a, b: bs.quest_block_scores_kernel(q, a, b, reduce="max"), (sd((2, 9, 128), jnp.bfloat16), meta, meta)),
        (lambda q, a, b: bs.quest_block_scores_kernel(q, a, b, reduce="max"),
         (sd((2, 12, 256), jnp.bfloat16), sd((2, 3, 5, 256), jnp.bfloat16), sd((2, 3, 5, 256), jnp.bfloat16))),
    ]
    for fn, args in fns:
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "__gpu$xla.gpu.triton" in text


@pytest.mark.parametrize("impl", IMPLS)
def test_quest_max_ignores_the_padded_head(impl):
    """G = 3 pads the group to 4 in the kernel: with every real bound negative, a zero pad
    row would win the max; it must not."""
    b, hq, hkv, s, d, bs = 1, 6, 2, 64, 64, 16
    k = -10.0 - jnp.abs(_randn(3, (b, hkv, s, d), jnp.float32))  # every key below zero
    kmax, kmin = scoring.block_minmax(k, jnp.asarray([s], jnp.int32), block_size=bs, impl="reference")
    q = jnp.abs(_randn(4, (b, hq, d), jnp.float32))  # q+ only: every bound is q . k_max < 0
    got = np.asarray(scoring.quest_block_scores(q, kmax, kmin, group_reduce="max", impl=impl))
    per_head = np.stack([_oracle_quest(q[:, [h]], kmax[:, [h // 3]], kmin[:, [h // 3]])[:, 0] for h in range(hq)], 1)
    want = per_head.reshape(b, hkv, 3, -1).max(2)
    assert (want < 0).all()
    np.testing.assert_allclose(got, want, rtol=1e-5)
