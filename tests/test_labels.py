"""Double-Sparsity label cache and label scores.

Reference and Pallas kernels (interpret mode) against float64 NumPy oracles:
packing layout (even channel in the low nibble), quantization error within
scale/2, incremental updates equal to a rebuild, and label scores over
candidate sets with counts below C (garbage past the count), candidates past
the length, and candidates=None with ragged lengths; GQA ratios 1, 3, 4, 8;
every kernel mode (two_pass, logits, per_tile) with several programs per row
and prefetch depths; block-structured candidates (block_label_scores) with
partial and out-of-range blocks.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import labels as lb
from sparse_jax.ops import scoring
from sparse_jax.ops._dispatch import on_gpu
from sparse_jax.ops.scoring import LabelCache

IMPLS = ["reference", "pallas"]


# NumPy random data (jax.random would compile once per shape: slow on CPU CI).
def _randn(seed, shape, dtype=jnp.float32, scale=1.0, shift=0.0):
    x = np.random.default_rng(seed).standard_normal(shape) * scale + shift
    return jnp.asarray(x.astype(np.float32), dtype=dtype)


def _keys(seed, b, hkv, s, d, dtype):
    return _randn(seed, (b, hkv, s, d), dtype, 1.5, -0.2)


def _channels(seed, hkv, d, r):
    rng = np.random.default_rng(seed)
    return jnp.asarray(np.stack([rng.permutation(d)[:r] for _ in range(hkv)]), jnp.int32)


def _np_unpack(packed, bits):
    """Independent unpacking: code of channel j*vpb + i is bits [i*bits, (i+1)*bits) of byte j."""
    packed = np.asarray(packed).astype(np.int64)
    vpb = 8 // bits
    codes = [(packed >> (bits * i)) & ((1 << bits) - 1) for i in range(vpb)]
    return np.stack(codes, axis=-1).reshape(packed.shape[:-1] + (packed.shape[-1] * vpb,))


def _np_selected(k, channels):
    k = np.asarray(k.astype(jnp.float32), np.float64)
    ch = np.asarray(channels)
    return np.stack([k[:, h][..., ch[h]] for h in range(k.shape[1])], axis=1)


def _np_dequant(cache, bits):
    codes = _np_unpack(cache.packed, bits).astype(np.float64)
    return np.asarray(cache.offset, np.float64)[..., None] + np.asarray(cache.scale, np.float64)[..., None] * codes


# (dtype, D, r, bits)
BUILD_CASES = [
    (jnp.float32, 64, 16, 4),
    (jnp.bfloat16, 128, 32, 4),
    (jnp.float32, 128, 16, 8),
    (jnp.bfloat16, 64, 32, 2),
    (jnp.bfloat16, 256, 32, 4),  # Gemma 3: D=256
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype,d,r,bits", BUILD_CASES)
def test_build_label_cache_matches_oracle(impl, dtype, d, r, bits):
    b, hkv, s = 2, 3, 77  # S not a multiple of the kernel's token tile
    k = np.array(_keys(d + r + bits, b, hkv, s, d, dtype).astype(jnp.float32))
    k[1, 2, 5] = 0.75  # a constant row: scale 0, exact dequantization
    k = jnp.asarray(k, dtype)
    channels = _channels(r, hkv, d, r)
    cache = scoring.build_label_cache(k, channels, bits=bits, impl=impl, block_s=32)
    assert isinstance(cache, LabelCache)
    assert cache.packed.shape == (b, hkv, s, r * bits // 8) and cache.packed.dtype == jnp.uint8
    assert cache.scale.shape == cache.offset.shape == (b, hkv, s)
    assert cache.scale.dtype == cache.offset.dtype == jnp.float32

    x = _np_selected(k, channels)  # [B, Hkv, S, r] float64
    levels = (1 << bits) - 1
    lo, hi = x.min(-1), x.max(-1)
    np.testing.assert_array_equal(np.asarray(cache.offset, np.float64), lo)
    np.testing.assert_allclose(np.asarray(cache.scale, np.float64), (hi - lo) / levels, rtol=1e-6)
    scale = np.asarray(cache.scale, np.float64)
    assert scale[1, 2, 5] == 0.0

    codes = _np_unpack(cache.packed, bits)
    safe = np.where(scale > 0, scale, 1.0)[..., None]
    want = np.clip(np.floor((x - lo[..., None]) / safe + 0.5), 0, levels)
    # f32 vs f64 may round a code differently only at an exact .5 tie.
    diff = np.abs(codes - want)
    assert diff.max() <= 1 and (diff > 0).mean() < 1e-3

    deq = np.asarray(scoring.dequantize_labels(cache, bits=bits), np.float64)
    np.testing.assert_allclose(deq, _np_dequant(cache, bits), rtol=1e-6, atol=1e-6)
    err = np.abs(deq - x)
    assert np.all(err <= scale[..., None] / 2 * (1 + 1e-5) + 1e-6 * np.abs(x) + 1e-7)
    assert np.all(err[1, 2, 5] == 0.0)


def test_build_label_cache_kernel_equals_reference_bitwise():
    k = _keys(7, 2, 2, 50, 128, jnp.bfloat16)
    channels = _channels(3, 2, 128, 16)
    ref = scoring.build_label_cache(k, channels, impl="reference")
    ker = scoring.build_label_cache(k, channels, impl="pallas", block_s=16)
    for a, b in zip(ref, ker):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_update_label_cache_equals_rebuild():
    b, hkv, s, d, r = 3, 2, 40, 64, 16
    k = _keys(21, b, hkv, s, d, jnp.bfloat16)
    channels = _channels(5, hkv, d, r)
    lengths = jnp.asarray([3, 15, 30], jnp.int32)
    cache = scoring.build_label_cache(k, channels, impl="reference")
    k_np = np.array(k.astype(jnp.float32))
    for step in range(3):
        k_new = _randn(50 + step, (b, hkv, d), jnp.bfloat16, 2.0)
        k_np[np.arange(b), :, np.asarray(lengths)] = np.asarray(k_new.astype(jnp.float32))
        cache = scoring.update_label_cache(cache, k_new, channels, lengths)
        lengths = lengths + 1
    rebuilt = scoring.build_label_cache(jnp.asarray(k_np, jnp.bfloat16), channels, impl="reference")
    for a, want in zip(cache, rebuilt):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(want))
    # out-of-range positions change nothing
    same = scoring.update_label_cache(cache, k_new * 9, channels, jnp.asarray([s, -1, s + 5]))
    for a, want in zip(same, cache):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(want))


def _oracle_scores(q, cache, channels, bits, pos, valid, scale):
    """float64: softmax over candidates per query head, mean over the group."""
    q = np.asarray(q.astype(jnp.float32), np.float64)
    b, hq, d = q.shape
    hkv = cache.packed.shape[1]
    g = hq // hkv
    deq = _np_dequant(cache, bits)  # [B, Hkv, S, r]
    ch = np.asarray(channels)
    out = np.zeros(pos.shape)
    for bi in range(b):
        for h in range(hkv):
            idx = np.nonzero(valid[bi, h])[0]
            if idx.size == 0:
                continue
            lab = deq[bi, h, pos[bi, h, idx]]  # [n, r]
            for gi in range(g):
                logit = lab @ q[bi, h * g + gi, ch[h]] * scale
                p = np.exp(logit - logit.max())
                out[bi, h, idx] += p / p.sum() / g
    return out


# (Hq, Hkv, D, r, dtype)
SCORE_CASES = [
    (2, 2, 64, 16, jnp.float32),
    (9, 3, 64, 16, jnp.bfloat16),
    (8, 2, 128, 32, jnp.bfloat16),
    (16, 2, 128, 16, jnp.float32),
    (8, 2, 256, 32, jnp.bfloat16),  # D=256 (Gemma 3; one KV head would leave this test no past-length row)
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("hq,hkv,d,r,dtype", SCORE_CASES)
def test_label_scores_candidates_match_oracle(impl, hq, hkv, d, r, dtype):
    b, s, c = 2, 90, 37
    k = _keys(hq + d, b, hkv, s, d, dtype)
    channels = _channels(hq, hkv, d, r)
    cache = scoring.build_label_cache(k, channels, impl="reference")
    q = _randn(hq * r, (b, hq, d), dtype, 2.0)
    rng = np.random.default_rng(hq + r)
    lengths = np.array([90, 61])
    cand = rng.integers(0, 90, size=(b, hkv, c))
    counts = rng.integers(1, c + 1, size=(b, hkv))
    counts[0, 0] = c
    counts[1, -1] = 0  # an empty row: all zeros
    # garbage past the count: negative, past S, anything
    junk = rng.integers(-1000, 1000, size=(b, hkv, c))
    idx = np.arange(c)
    cand = np.where(idx < counts[..., None], cand, junk)
    valid = (idx < counts[..., None]) & (cand >= 0) & (cand < lengths[:, None, None])
    assert (~valid & (idx < counts[..., None])).any()  # some in-count candidates past the length
    got = scoring.label_scores(q, cache, channels, jnp.asarray(cand, jnp.int32),
                               jnp.asarray(counts, jnp.int32), lengths=jnp.asarray(lengths, jnp.int32),
                               impl=impl, block_c=16)
    assert got.shape == (b, hkv, c) and got.dtype == jnp.float32
    want = _oracle_scores(q, cache, channels, 4, np.clip(cand, 0, s - 1), valid, 1 / math.sqrt(d))
    got = np.asarray(got)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)
    assert np.all(got[~valid] == 0.0)  # masked entries are exactly zero
    rows = valid.any(-1)
    np.testing.assert_allclose(got.sum(-1)[rows], 1.0, rtol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("hq,hkv,d,r,dtype", [SCORE_CASES[1], SCORE_CASES[2]])
def test_label_scores_all_positions_with_lengths(impl, hq, hkv, d, r, dtype):
    b, s = 3, 75
    k = _keys(5 * hq, b, hkv, s, d, dtype)
    channels = _channels(hq + 1, hkv, d, r)
    cache = scoring.build_label_cache(k, channels, impl="reference")
    q = _randn(d, (b, hq, d), dtype)
    lengths = np.array([75, 32, 1])
    got = scoring.label_scores(q, cache, channels, lengths=jnp.asarray(lengths, jnp.int32),
                               scale=0.3, impl=impl, block_c=32)
    assert got.shape == (b, hkv, s)
    pos = np.broadcast_to(np.arange(s), (b, hkv, s))
    valid = pos < lengths[:, None, None]
    want = _oracle_scores(q, cache, channels, 4, pos, valid, 0.3)
    got = np.asarray(got)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)
    assert np.all(got[~valid] == 0.0)
    np.testing.assert_allclose(got[2, :, 0], 1.0, rtol=1e-6)  # a single valid token


@pytest.mark.parametrize("impl", IMPLS)
def test_label_scores_other_bit_widths(impl):
    b, hq, hkv, s, d, r = 2, 4, 2, 40, 64, 16
    k = _keys(9, b, hkv, s, d, jnp.float32)
    channels = _channels(9, hkv, d, r)
    q = _randn(9, (b, hq, d))
    lengths = np.array([40, 23])
    pos = np.broadcast_to(np.arange(s), (b, hkv, s))
    for bits in (8, 2):
        cache = scoring.build_label_cache(k, channels, bits=bits, impl="reference")
        got = scoring.label_scores(q, cache, channels, lengths=jnp.asarray(lengths), bits=bits,
                                   impl=impl, block_c=16)
        want = _oracle_scores(q, cache, channels, bits, pos, pos < lengths[:, None, None],
                              1 / math.sqrt(d))
        np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=1e-6)


def test_label_scores_kernel_tiles_and_raw_outputs():
    """Raw kernel outputs: masked logits are -inf and the per-tile (per_tile) or
    per-program (logits, two_pass) statistics recombine."""
    from pallas_kernels import labels as lb

    b, hq, hkv, s, d, r = 1, 4, 1, 50, 64, 16
    k = _keys(31, b, hkv, s, d, jnp.float32)
    channels = _channels(31, hkv, d, r)
    cache = lb.build_label_cache_reference(k, channels)
    q = _randn(31, (b, hq, d))
    lengths = jnp.asarray([20])
    logits, tmax, tsum = lb.label_scores_kernel(q, cache, channels, lengths=lengths, mode="per_tile",
                                                block_c=16, interpret=True, return_raw=True)
    assert logits.shape == (b, hkv, hq, s) and tmax.shape == tsum.shape == (b, hkv, 4, hq)
    logits = np.asarray(logits)
    assert np.all(np.isneginf(logits[..., 20:])) and np.all(np.isfinite(logits[..., :20]))
    assert np.all(np.isneginf(np.asarray(tmax)[:, :, 2:])) and np.all(np.asarray(tsum)[:, :, 2:] == 0)
    want = np.asarray(jax.nn.softmax(jnp.asarray(logits), axis=-1)).mean(2)
    np.testing.assert_allclose(np.asarray(lb.label_scores_epilogue(logits, tmax, tsum)), want,
                               rtol=1e-6, atol=1e-7)

    # Looped kernels: 4 tiles of 16 over 2 programs; the second program's tiles
    # are past the length (its statistics are empty: max -inf, sum 0).
    raw, m, l = lb.label_scores_kernel(q, cache, channels, lengths=lengths, mode="logits",
                                       block_c=16, splits=2, interpret=True, return_raw=True)
    assert raw.shape == (b, hkv, hq, s) and m.shape == l.shape == (b, hkv, 2, hq)
    raw = np.asarray(raw)
    np.testing.assert_allclose(raw[..., :20], logits[..., :20], rtol=1e-5, atol=1e-5)
    assert np.all(np.isneginf(raw[..., 20:]))
    assert np.all(np.isneginf(np.asarray(m)[:, :, 1])) and np.all(np.asarray(l)[:, :, 1] == 0)
    np.testing.assert_allclose(np.asarray(m)[:, :, 0], raw[..., :20].max(-1), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(l)[:, :, 0],
                               np.exp(raw[..., :20] - raw[..., :20].max(-1, keepdims=True)).sum(-1),
                               rtol=1e-5)
    np.testing.assert_allclose(np.asarray(lb.label_scores_epilogue(raw, m, l)), want, rtol=1e-5,
                               atol=1e-7)
    out, m2, l2 = lb.label_scores_kernel(q, cache, channels, lengths=lengths, mode="two_pass",
                                         block_c=16, splits=2, interpret=True, return_raw=True)
    np.testing.assert_allclose(np.asarray(m2), np.asarray(m), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(l2), np.asarray(l), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-7)


# (Hq, Hkv, D, r, bits, C, tuning): awkward sizes; tiles of 16-32 candidates so
# that several programs (splits, also not powers of two) each loop over several tiles.
LOOPED_CASES = [
    (2, 2, 64, 16, 4, 37, dict(mode="two_pass", block_c=16, splits=2)),
    (6, 2, 64, 16, 4, 100, dict(mode="logits", block_c=16, splits=3, prefetch=1)),
    (8, 2, 128, 32, 4, 77, dict(mode="two_pass", block_c=16, splits=3, prefetch=3)),
    (16, 2, 128, 32, 4, 50, dict(mode="logits", block_c=32, splits=1)),  # G=8: query reloaded per tile
    (4, 1, 64, 32, 4, 61, dict(mode="two_pass", block_c=16, splits=2, prefetch=0)),
    (4, 2, 64, 16, 4, 45, dict(mode="two_pass", block_c=16, hoist_q=False, prefetch=2)),
    # (2 and 8 bits: below with the kernel's query side, and in the records test, 8 bits in two passes;
    # logits mode with the kernel's query side on GQA 3: the head split of 3 below)
    # the query side gathered by each program (q_prep="kernel") instead of an XLA fusion
    (9, 3, 64, 16, 2, 45, dict(mode="two_pass", block_c=16, splits=2, q_prep="kernel")),
    (8, 1, 256, 64, 4, 40, dict(mode="logits", block_c=16, splits=2, q_prep="kernel")),  # MQA, D=256, r=64
    # the heads split over programs (each holds G / head_split heads' query)
    (8, 2, 128, 32, 4, 77, dict(mode="logits", block_c=16, splits=3, prefetch=1, head_split=2)),
    (9, 3, 64, 16, 2, 45, dict(mode="logits", block_c=16, splits=2, q_prep="kernel", head_split=3)),  # 1 head each
    (16, 2, 128, 32, 4, 50, dict(block_c=32, splits=1, head_split=4)),  # G=8, the default mode
]


@pytest.mark.parametrize("hq,hkv,d,r,bits,c,tuning", LOOPED_CASES)
def test_label_scores_looped_kernels_match_oracle(hq, hkv, d, r, bits, c, tuning):
    """The looped kernels across modes, splits, prefetch depths, GQA ratios 1-8,
    r = 16/32 and bit widths: candidates with garbage past the count, past the
    length, an empty row, and counts ending inside a tile."""
    b, s = 2, 90
    dtype = jnp.bfloat16 if d == 128 else jnp.float32
    k = _keys(hq + c, b, hkv, s, d, dtype)
    channels = _channels(hq + r, hkv, d, r)
    cache = scoring.build_label_cache(k, channels, bits=bits, impl="reference")
    q = _randn(c + r, (b, hq, d), dtype, 2.0)
    rng = np.random.default_rng(c)
    lengths = np.array([90, 61])
    cand = rng.integers(0, 90, size=(b, hkv, c))
    counts = rng.integers(1, c + 1, size=(b, hkv))
    counts[0, 0] = c
    counts[1, -1] = 0
    junk = rng.integers(-1000, 1000, size=(b, hkv, c))
    idx = np.arange(c)
    cand = np.where(idx < counts[..., None], cand, junk)
    valid = (idx < counts[..., None]) & (cand >= 0) & (cand < lengths[:, None, None])
    got = scoring.label_scores(q, cache, channels, jnp.asarray(cand, jnp.int32),
                               jnp.asarray(counts, jnp.int32), lengths=jnp.asarray(lengths, jnp.int32),
                               bits=bits, impl="pallas", **tuning)
    want = _oracle_scores(q, cache, channels, bits, np.clip(cand, 0, s - 1), valid, 1 / math.sqrt(d))
    got = np.asarray(got)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)
    assert np.all(got[~valid] == 0.0)
    rows = valid.any(-1)
    np.testing.assert_allclose(got.sum(-1)[rows], 1.0, rtol=1e-5)
    assert np.all(got[~rows] == 0.0)


@pytest.mark.parametrize("mode", ["two_pass", "logits"])
def test_label_scores_looped_all_positions(mode):
    b, hq, hkv, s, d, r = 3, 8, 2, 75, 128, 32
    k = _keys(77, b, hkv, s, d, jnp.bfloat16)
    channels = _channels(78, hkv, d, r)
    cache = scoring.build_label_cache(k, channels, impl="reference")
    q = _randn(79, (b, hq, d), jnp.bfloat16)
    lengths = np.array([75, 32, 1])
    got = scoring.label_scores(q, cache, channels, lengths=jnp.asarray(lengths, jnp.int32), scale=0.3,
                               impl="pallas", mode=mode, block_c=16, splits=2)
    pos = np.broadcast_to(np.arange(s), (b, hkv, s))
    valid = pos < lengths[:, None, None]
    want = _oracle_scores(q, cache, channels, 4, pos, valid, 0.3)
    got = np.asarray(got)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)
    assert np.all(got[~valid] == 0.0)


def _expand_blocks_np(block_ids, block_counts, lengths, block_size, s):
    b, hkv, nb = block_ids.shape
    nbt = -(-s // block_size)
    pos = np.full((b, hkv, nb, block_size), -1)
    for bi in range(b):
        for h in range(hkv):
            for j in range(min(max(block_counts[bi, h], 0), nb)):
                bid = block_ids[bi, h, j]
                if 0 <= bid < nbt:
                    p = bid * block_size + np.arange(block_size)
                    pos[bi, h, j] = np.where(p < min(lengths[bi], s), p, -1)
    return pos.reshape(b, hkv, nb * block_size)


# (Hq, Hkv, D, r, block_size, NBsel, tuning)
BLOCK_CASES = [
    (8, 2, 128, 32, 16, 7, dict(mode="two_pass", block_c=32, splits=2)),
    (6, 2, 64, 16, 64, 3, dict(mode="logits", block_c=16, splits=5)),
    (3, 1, 64, 32, 48, 3, dict(mode="two_pass", block_c=16, splits=2, prefetch=1)),  # block not pow2
    (4, 4, 64, 16, 8, 5, dict(mode="logits", block_c=16, prefetch=3)),
    (16, 2, 64, 32, 16, 4, dict(mode="two_pass", block_c=32, splits=1)),  # G=8
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("hq,hkv,d,r,bs,nb,tuning", BLOCK_CASES)
def test_block_label_scores_match_oracle(impl, hq, hkv, d, r, bs, nb, tuning):
    """Block-structured candidates: lengths cutting the last block, garbage ids
    past the count, out-of-range ids inside it, an empty row; block-slot order."""
    b, s = 2, 150
    dtype = jnp.bfloat16 if d == 128 else jnp.float32
    k = _keys(hq + bs, b, hkv, s, d, dtype)
    channels = _channels(bs, hkv, d, r)
    cache = scoring.build_label_cache(k, channels, impl="reference")
    q = _randn(hq * bs, (b, hq, d), dtype, 2.0)
    rng = np.random.default_rng(bs + nb)
    nbt = -(-s // bs)
    lengths = np.array([s, s - bs // 2 - 5])
    ids = np.stack([np.stack([rng.permutation(nbt)[:nb] for _ in range(hkv)]) for _ in range(b)])
    ids[0, 0, 0] = nbt - 1  # the partial last block of a full row
    ids[1, 0, -1] = (lengths[1] - 1) // bs  # a block cut by the length
    counts = rng.integers(1, nb + 1, size=(b, hkv))
    counts[0, 0] = nb
    counts[1, 0] = nb
    counts[1, -1] = 0 if hkv > 1 else counts[1, -1]  # an empty row
    counts[0, -1] = nb + 3  # clamped to NBsel
    if nb > 1 and hkv > 1:
        ids[0, 1, 0] = nbt + 2  # out of range inside the count
    junk = rng.integers(-(2 ** 30), 2 ** 30, size=(b, hkv, nb))  # garbage past the count
    ids = np.where(np.arange(nb) < counts[..., None], ids, junk)
    args = (q, cache, channels, jnp.asarray(ids, jnp.int32), jnp.asarray(counts, jnp.int32),
            jnp.asarray(lengths, jnp.int32))
    got = scoring.block_label_scores(*args, block_size=bs, impl=impl,
                                     **(tuning if impl == "pallas" else {}))
    assert got.shape == (b, hkv, nb * bs) and got.dtype == jnp.float32
    pos = _expand_blocks_np(ids, counts, lengths, bs, s)
    valid = pos >= 0
    want = _oracle_scores(q, cache, channels, 4, np.maximum(pos, 0), valid, 1 / math.sqrt(d))
    got = np.asarray(got)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)
    assert np.all(got[~valid] == 0.0)
    if impl == "pallas":
        # masked_score=-inf (block_label_topk's path: its top-k reads the scores as they are):
        # the same scores, -inf exactly where masked
        # (interpreted where `got` was: compiled and interpreted sums round differently)
        neg = np.asarray(lb.block_label_scores_kernel(*args, block_size=bs, interpret=not on_gpu(),
                                                      masked_score=-np.inf, **tuning))
        np.testing.assert_array_equal(neg[valid], got[valid])
        assert np.all(neg[~valid] == -np.inf)
    # Same as label_scores over the expanded positions.
    same = scoring.label_scores(q, cache, channels, jnp.asarray(pos, jnp.int32),
                                lengths=jnp.asarray(lengths, jnp.int32), impl="reference")
    np.testing.assert_allclose(got, np.asarray(same), rtol=2e-5, atol=1e-6)


def test_block_label_scores_bad_inputs():
    b, hq, hkv, s, d, r = 2, 4, 2, 40, 64, 16
    k = _keys(2, b, hkv, s, d, jnp.float32)
    channels = _channels(2, hkv, d, r)
    cache = scoring.build_label_cache(k, channels, impl="reference")
    q = jnp.ones((b, hq, d))
    ids = jnp.zeros((b, hkv, 3), jnp.int32)
    cnt = jnp.full((b, hkv), 3, jnp.int32)
    lengths = jnp.asarray([40, 3])
    f = scoring.block_label_scores
    bad = [
        (ValueError, lambda: f(q, cache, channels, ids, cnt, None, block_size=16)),
        (ValueError, lambda: f(q, cache, channels, ids, cnt, lengths, block_size=0)),
        (ValueError, lambda: f(q, cache, channels, ids[0], cnt, lengths, block_size=16)),
        (ValueError, lambda: f(q, cache, channels, ids[:1], cnt, lengths, block_size=16)),
        (ValueError, lambda: f(q, cache, channels, ids[..., :0], cnt, lengths, block_size=16)),
        (TypeError, lambda: f(q, cache, channels, ids.astype(jnp.float32), cnt, lengths, block_size=16)),
        (ValueError, lambda: f(q, cache, channels, ids, cnt[0], lengths, block_size=16)),
        (ValueError, lambda: f(q, cache, channels, ids, cnt, lengths[:1], block_size=16)),
        (ValueError, lambda: f(q, cache, channels, ids, cnt, lengths, block_size=16, bits=8)),
        (ValueError, lambda: f(q, cache, channels, ids, cnt, lengths, block_size=16, mode="per_tile")),
        (ValueError, lambda: f(q, cache, channels, ids, cnt, lengths, block_size=16, mode="fast")),
        (ValueError, lambda: f(q, cache, channels, ids, cnt, lengths, block_size=16, splits=0)),
        (ValueError, lambda: f(q, cache, channels, ids, cnt, lengths, block_size=16, prefetch=-1)),
        (ValueError, lambda: f(q, cache, channels, ids, cnt, lengths, block_size=16, impl="pallas",
                               block_c=24)),
    ]
    for i, (err, fn) in enumerate(bad):
        with pytest.raises(err):
            fn()
            print("no error for case", i)


def test_label_scores_bad_inputs():
    b, hq, hkv, s, d, r = 2, 4, 2, 40, 64, 16
    k = _keys(1, b, hkv, s, d, jnp.float32)
    channels = _channels(1, hkv, d, r)
    cache = scoring.build_label_cache(k, channels, impl="reference")
    q = jnp.ones((b, hq, d))
    cand = jnp.zeros((b, hkv, 8), jnp.int32)
    lengths = jnp.asarray([40, 3])
    bad = [
        # build
        (ValueError, lambda: scoring.build_label_cache(k[0], channels)),
        (TypeError, lambda: scoring.build_label_cache(k.astype(jnp.int8), channels)),
        (ValueError, lambda: scoring.build_label_cache(k, channels[:, :15])),  # odd r
        (ValueError, lambda: scoring.build_label_cache(k, channels.at[0, 0].set(d))),  # range
        (ValueError, lambda: scoring.build_label_cache(k, channels.at[1, 3].set(-1))),
        (ValueError, lambda: scoring.build_label_cache(k, channels[:1])),  # Hkv mismatch
        (TypeError, lambda: scoring.build_label_cache(k, channels.astype(jnp.float32))),
        (ValueError, lambda: scoring.build_label_cache(k, channels, bits=3)),
        (ValueError, lambda: scoring.build_label_cache(k, channels[:, :6], bits=2)),  # 6*2 % 8
        # update
        (ValueError, lambda: scoring.update_label_cache(cache, k[:, :, 0, :], channels, lengths[:1])),
        (ValueError, lambda: scoring.update_label_cache(cache, k[:, :1, 0, :], channels, lengths)),
        (TypeError, lambda: scoring.update_label_cache(tuple(cache), k[:, :, 0, :], channels, lengths)),
        # scores
        (ValueError, lambda: scoring.label_scores(q, cache, channels)),  # needs lengths
        (ValueError, lambda: scoring.label_scores(q[0], cache, channels, cand)),
        (ValueError, lambda: scoring.label_scores(jnp.ones((b, 3, d)), cache, channels, cand)),  # GQA
        (ValueError, lambda: scoring.label_scores(q, cache, channels[:, :8], cand)),  # r vs width
        (ValueError, lambda: scoring.label_scores(q, cache, channels, cand, bits=8)),  # bits vs width
        (ValueError, lambda: scoring.update_label_cache(cache, k[:, :, 0, :], channels, lengths, bits=8)),
        (ValueError, lambda: scoring.label_scores(q, cache, channels.at[0, 0].set(99), cand)),
        (ValueError, lambda: scoring.label_scores(q, cache, channels, cand[:1])),
        (TypeError, lambda: scoring.label_scores(q, cache, channels, cand.astype(jnp.float32))),
        (ValueError, lambda: scoring.label_scores(q, cache, channels, cand, jnp.zeros((b,), jnp.int32))),
        (ValueError, lambda: scoring.label_scores(q, cache, channels, cand, lengths=lengths[:1])),
        (ValueError, lambda: scoring.label_scores(q, cache, channels, None, jnp.zeros((b, hkv), jnp.int32),
                                                  lengths=lengths)),
        (TypeError, lambda: scoring.label_scores(q, cache._replace(packed=cache.packed.astype(jnp.int32)),
                                                 channels, cand)),
        (TypeError, lambda: scoring.label_scores(q, tuple(cache), channels, cand)),
        (ValueError, lambda: scoring.label_scores(q, cache, channels, cand, impl="fast")),
    ]
    for i, (err, fn) in enumerate(bad):
        with pytest.raises(err):
            fn()
            print("no error for case", i)


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
def test_kernels_lower_to_triton(abstract_h100):
    """Lower the label kernels for CUDA on CPU (abstract H100): catches ops the
    Triton lowering rejects before the code reaches a GPU."""
    from pallas_kernels import labels as lb

    sd = jax.ShapeDtypeStruct
    cache = LabelCache(sd((2, 3, 300, 8), jnp.uint8), sd((2, 3, 300), jnp.float32),
                       sd((2, 3, 300), jnp.float32))
    q, ch = sd((2, 9, 128), jnp.bfloat16), sd((3, 16), jnp.int32)  # G = 3
    cache32 = LabelCache(sd((2, 3, 300, 16), jnp.uint8), sd((2, 3, 300), jnp.float32),
                         sd((2, 3, 300), jnp.float32))
    q8, ch32 = sd((2, 24, 128), jnp.bfloat16), sd((3, 32), jnp.int32)  # G = 8, r = 32
    cand, cnt, lens = sd((2, 3, 100), jnp.int32), sd((2, 3), jnp.int32), sd((2,), jnp.int32)
    fns = [(lb.build_label_cache_kernel, (sd((2, 3, 300, 128), jnp.bfloat16), ch))]
    for mode in ("two_pass", "logits", "per_tile"):
        fns += [
            (lambda q, c, ch, cand, n, l, mode=mode: lb.label_scores_kernel(q, c, ch, cand, n, lengths=l, mode=mode),
             (q, cache, ch, cand, cnt, lens)),
            (lambda q, c, ch, l, mode=mode: lb.label_scores_kernel(q, c, ch, lengths=l, mode=mode),
             (q, cache, ch, lens)),
        ]
    rec32 = lb.LabelRecords(sd((2, 3, 300, 8), jnp.int32))  # r = 32: 4 code words, scale, offset, padding
    for labels in (cache32, rec32):
        for mode in ("two_pass", "logits"):
            fns += [
                (lambda q, c, ch, cand, n, l, mode=mode: lb.label_scores_kernel(q, c, ch, cand, n, lengths=l,
                                                                                mode=mode),
                 (q8, labels, ch32, cand, cnt, lens)),
                (lambda q, c, ch, bid, n, l, mode=mode: lb.block_label_scores_kernel(q, c, ch, bid, n, l,
                                                                                     block_size=64, mode=mode),
                 (q, labels, ch32, sd((2, 3, 5), jnp.int32), cnt, lens)),
                (lambda q, c, ch, bid, n, l, mode=mode: lb.block_label_scores_kernel(q, c, ch, bid, n, l,
                                                                                     block_size=64, mode=mode),
                 (q, labels, ch32, sd((2, 3, 5), jnp.int32), sd((2, 1), jnp.int32), lens)),  # [B, 1] counts
                (lambda q, c, ch, bid, n, l, mode=mode: lb.block_label_scores_kernel(
                    q, c, ch, bid, n, l, block_size=64, mode=mode, masked_score=-np.inf),
                 (q, labels, ch32, sd((2, 3, 5), jnp.int32), cnt, lens)),  # masked slots as -inf
            ]
    for labels in (cache32, rec32):  # the query side gathered in the kernel, and with the heads split
        fns += [(lambda q, c, ch, bid, n, l: lb.block_label_scores_kernel(q, c, ch, bid, n, l, block_size=64,
                                                                          q_prep="kernel"),
                 (sd((2, 12, 128), jnp.bfloat16), labels, ch32, sd((2, 3, 5), jnp.int32), cnt, lens)),
                (lambda q, c, ch, bid, n, l: lb.block_label_scores_kernel(q, c, ch, bid, n, l, block_size=64,
                                                                          q_prep="kernel", head_split=2),
                 (sd((2, 12, 128), jnp.bfloat16), labels, ch32, sd((2, 3, 5), jnp.int32), cnt, lens)),
                (lambda q, c, ch, bid, n, l: lb.block_label_scores_kernel(q, c, ch, bid, n, l, block_size=64,
                                                                          head_split=2),
                 (sd((2, 12, 128), jnp.bfloat16), labels, ch32, sd((2, 3, 5), jnp.int32), cnt, lens))]
    for fn, args in fns:
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "__gpu$xla.gpu.triton" in text


def _block_label_case(hq, seeds):
    """``(q, cache, channels, blocks, counts, lengths)`` for the block label kernels: B=2, Hkv=4,
    S=150, D=128, r=32, bf16; three block slots a row (an out-of-range id, repeats, counts 0-3)
    and a second row shorter than the cache. ``seeds``: the keys', the channels', the query's."""
    b, hkv, s, d, r = 2, 4, 150, 128, 32
    k = _keys(seeds[0], b, hkv, s, d, jnp.bfloat16)
    channels = _channels(seeds[1], hkv, d, r)
    q = _randn(seeds[2], (b, hq, d), jnp.bfloat16, 2.0)
    cache = scoring.build_label_cache(k, channels, impl="reference")
    blocks = jnp.asarray([[[0, 1, 2], [2, 0, 9], [1, 1, 0], [0, 2, 1]]] * 2, jnp.int32)
    counts = jnp.asarray([[3, 2, 1, 0], [3, 3, 3, 3]], jnp.int32)
    lengths = jnp.asarray([150, 100], jnp.int32)
    return q, cache, channels, blocks, counts, lengths


def test_query_side_in_the_kernel_equals_the_xla_one_and_refuses_conflicts():
    """``q_prep="kernel"`` (the channel gather and scale made by each program) gives the
    ``q_prep="xla"`` scores, over cache and records; with the query not hoisted, or in the
    per-tile mode, it is refused before any tracing of the kernel."""
    b, hkv = 2, 4
    q, cache, channels, blocks, counts, lengths = _block_label_case(12, seeds=(5, 7, 3))
    for labels, mode in ((cache, "logits"), (lb.interleave_labels(cache), "two_pass")):  # each layout, each mode
        kw = dict(block_size=64, impl="pallas", mode=mode, block_c=32, splits=2)
        xla = scoring.block_label_scores(q, labels, channels, blocks, counts, lengths, **kw)
        ker = scoring.block_label_scores(q, labels, channels, blocks, counts, lengths, q_prep="kernel", **kw)
        np.testing.assert_allclose(np.asarray(ker), np.asarray(xla), rtol=1e-5, atol=1e-7)
    cand = jnp.zeros((b, hkv, 8), jnp.int32)
    for bad in (dict(q_prep="kernel", hoist_q=False), dict(q_prep="kernel", mode="per_tile"), dict(q_prep="cuda")):
        with pytest.raises(ValueError, match="q_prep"):
            scoring.label_scores(q, cache, channels, cand, impl="pallas", **bad)


def test_heads_split_over_programs_give_the_same_scores_and_selection():
    """``head_split``: the G heads of a tile range scored by G / head_split programs give the
    one-program scores (the raw logits to the bit, the statistics to rounding), over cache and records, with the
    query side from XLA or the kernel, and the same tokens from ``block_label_topk`` (fused
    and not); a split that does not divide G, or one outside the "logits" mode, is refused
    before any tracing of the kernel."""
    b, hkv = 2, 4
    q, cache, channels, blocks, counts, lengths = _block_label_case(16, seeds=(11, 13, 17))  # G = 4
    kw = dict(block_size=64, block_c=32, splits=2, interpret=True)
    for labels, q_prep in ((cache, None), (lb.interleave_labels(cache), "kernel")):
        one = lb.block_label_scores_kernel(q, labels, channels, blocks, counts, lengths, q_prep=q_prep,
                                           return_raw=True, **kw)
        for hs in ((2, 4) if q_prep is None else (4,)):
            split = lb.block_label_scores_kernel(q, labels, channels, blocks, counts, lengths, q_prep=q_prep,
                                                 head_split=hs, return_raw=True, **kw)
            np.testing.assert_array_equal(np.asarray(split[0]), np.asarray(one[0]))  # the logits, to the bit
            for a, w in zip(split[1:], one[1:]):  # the statistics: summed over fewer heads side by side
                np.testing.assert_allclose(np.asarray(a), np.asarray(w), rtol=1e-6)
        for fused in ((False, True) if q_prep is None else (True,)):
            sel = dict(block_size=64, k=40, impl="pallas", block_c=32, splits=2, fused=fused)
            want = scoring.block_label_topk(q, labels, channels, blocks, counts, lengths, **sel)
            got = scoring.block_label_topk(q, labels, channels, blocks, counts, lengths, head_split=2, **sel)
            np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
            np.testing.assert_array_equal(np.sort(np.asarray(got[0]), -1), np.sort(np.asarray(want[0]), -1))
    cand = jnp.zeros((b, hkv, 8), jnp.int32)
    for bad, match in ((dict(head_split=3), "divide"), (dict(head_split=0), "positive"),
                       (dict(head_split=2, mode="two_pass"), "logits"), (dict(head_split=2, mode="per_tile"), "logits"),
                       (dict(head_split=True), "positive")):
        with pytest.raises(ValueError, match=match):
            scoring.label_scores(q, cache, channels, cand, impl="pallas", **bad)
        with pytest.raises(ValueError, match=match):
            scoring.block_label_scores(q, cache, channels, blocks, counts, lengths, block_size=64, impl="pallas", **bad)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_scaled_codes_are_the_fields_times_their_powers_of_two(bits):
    """The label kernels' unpack without conversions (an OR into the f32 2**23, minus
    2**23) gives every field exactly, times 2**e_k, on words with every bit pattern:
    the sign bit, all ones, all zeros and random words."""
    rng = np.random.default_rng(bits)
    words = np.concatenate([rng.integers(-2**31, 2**31, size=4000, dtype=np.int64),
                            [0, -1, -2**31, 2**31 - 1, 0x0F0F0F0F, -0x0F0F0F10]]).astype(np.int32)
    exps = lb._field_exponents(bits)
    assert len(exps) == 32 // bits and all(e >= 0 and e + bits <= 23 for e in exps)
    got = lb._scaled_codes(jnp.asarray(words), bits)
    u = words.view(np.uint32).astype(np.int64)
    for k, (g, e) in enumerate(zip(got, exps)):
        want = ((u >> (bits * k)) & ((1 << bits) - 1)).astype(np.float64) * 2.0 ** e
        np.testing.assert_array_equal(np.asarray(g, np.float64), want)


# ----------------------------------------------------------------------------
# Interleaved label records: one record per token, the same numbers
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("r,bits,wr", [(16, 4, 4), (32, 4, 8), (16, 8, 8), (32, 2, 4)])
def test_label_records_round_trip(r, bits, wr):
    from pallas_kernels import labels as lb

    k = _keys(r + bits, 2, 3, 37, 64, jnp.float32)
    channels = _channels(r, 3, 64, r)
    cache = scoring.build_label_cache(k, channels, bits=bits, impl="reference")
    rec = lb.interleave_labels(cache, bits=bits)
    assert rec.words.shape == (2, 3, 37, wr) and rec.words.dtype == jnp.int32
    back = lb.deinterleave_labels(rec, r=r, bits=bits)
    for a, b_ in zip(cache, back):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b_))  # bit for bit
    nw = r * bits // 32
    assert np.all(np.asarray(rec.words[..., nw + 2:]) == 0)  # the padding
    np.testing.assert_array_equal(np.asarray(rec.words[..., nw]).view(np.float32), np.asarray(cache.scale))


def test_label_records_refuse_partial_words():
    from pallas_kernels import labels as lb

    with pytest.raises(ValueError, match="whole 32-bit code words"):
        lb.record_layout(4, 4)


# records are a layout of the same codes: two cases (each mode, 4 and 8 bits, one with a
# prefetch) cover what the looped kernels' matrix above checks case by case
@pytest.mark.parametrize("hq,hkv,d,r,bits,c,tuning", [LOOPED_CASES[1], (4, 2, 64, 16, 8, 29, dict(
    mode="two_pass", block_c=16, splits=2))])
def test_label_scores_records_equal_the_cache(hq, hkv, d, r, bits, c, tuning):
    """The kernel over interleaved records gives the cache's numbers: scattered
    candidates with junk past the count and past the length, an empty row."""
    from pallas_kernels import labels as lb

    b, s = 2, 90
    dtype = jnp.bfloat16 if d == 128 else jnp.float32
    k = _keys(hq + c + 1, b, hkv, s, d, dtype)
    channels = _channels(hq + r + 1, hkv, d, r)
    cache = scoring.build_label_cache(k, channels, bits=bits, impl="reference")
    rec = scoring.interleave_labels(cache, bits=bits)
    q = _randn(c + r + 1, (b, hq, d), dtype, 2.0)
    rng = np.random.default_rng(c + 1)
    lengths = jnp.asarray([90, 61], jnp.int32)
    cand = rng.integers(-5, 95, size=(b, hkv, c))
    counts = rng.integers(1, c + 1, size=(b, hkv))
    counts[1, -1] = 0
    args = (jnp.asarray(cand, jnp.int32), jnp.asarray(counts, jnp.int32))
    want = scoring.label_scores(q, cache, channels, *args, lengths=lengths, bits=bits, impl="pallas", **tuning)
    got = scoring.label_scores(q, rec, channels, *args, lengths=lengths, bits=bits, impl="pallas", **tuning)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    ref = scoring.label_scores(q, rec, channels, *args, lengths=lengths, bits=bits, impl="reference")
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=2e-5, atol=1e-6)
    # all positions, and the block path
    dense = scoring.label_scores(q, rec, channels, lengths=lengths, bits=bits, impl="pallas", **tuning)
    np.testing.assert_array_equal(
        np.asarray(dense),
        np.asarray(scoring.label_scores(q, cache, channels, lengths=lengths, bits=bits, impl="pallas", **tuning)))
    bid = jnp.asarray(rng.integers(-1, 12, size=(b, hkv, 5)), jnp.int32)
    bcnt = jnp.asarray(rng.integers(0, 6, size=(b, hkv)), jnp.int32)
    tun = {k_: v for k_, v in tuning.items() if k_ != "mode"} | {"mode": tuning.get("mode", "logits")}
    blk = scoring.block_label_scores(q, rec, channels, bid, bcnt, lengths, block_size=8, bits=bits,
                                     impl="pallas", **tun)
    np.testing.assert_array_equal(
        np.asarray(blk), np.asarray(scoring.block_label_scores(q, cache, channels, bid, bcnt, lengths, block_size=8,
                                                               bits=bits, impl="pallas", **tun)))
    assert lb.label_dims(rec, r, bits) == cache.packed.shape


def test_label_records_bad_inputs():
    from pallas_kernels import labels as lb

    k = _keys(1, 1, 2, 16, 64, jnp.float32)
    channels = _channels(1, 2, 64, 16)
    cache = scoring.build_label_cache(k, channels, bits=4, impl="reference")
    rec = lb.interleave_labels(cache, bits=4)
    q = _randn(2, (1, 4, 64))
    with pytest.raises(ValueError, match="hold 8 words a token, got 4"):
        scoring.label_scores(q, rec, _channels(2, 2, 64, 32), lengths=jnp.array([16]))
    with pytest.raises(TypeError, match="int32"):
        scoring.label_scores(q, lb.LabelRecords(rec.words.astype(jnp.float32)), channels, lengths=jnp.array([16]))
    with pytest.raises(ValueError, match="hold 8 words a token, got 4"):
        scoring.update_label_cache(rec, k[:, :, 0], _channels(2, 2, 64, 32), jnp.array([3]))


def test_update_label_records_equals_interleaved_update():
    """Appending to records gives the records of the appended cache; out-of-range
    positions change nothing."""
    from pallas_kernels import labels as lb

    k = _keys(7, 2, 2, 40, 64, jnp.float32)
    channels = _channels(7, 2, 64, 16)
    cache = scoring.build_label_cache(k, channels, impl="reference")
    rec = lb.interleave_labels(cache)
    k_new = _randn(8, (2, 2, 64))
    for pos in (jnp.array([5, 39]), jnp.array([-1, 40])):
        got = scoring.update_label_cache(rec, k_new, channels, pos)
        want = lb.interleave_labels(scoring.update_label_cache(cache, k_new, channels, pos))
        np.testing.assert_array_equal(np.asarray(got.words), np.asarray(want.words))
    np.testing.assert_array_equal(np.asarray(scoring.update_label_cache(rec, k_new, channels, jnp.array([-1, 40])).words),
                                  np.asarray(rec.words))
