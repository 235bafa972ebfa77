"""AsyncTLS's second level in one op: block_label_topk (its unfused kernels, and with
fused=True the label logits kernel + the normalize / top-k / token-map kernel of
pallas_kernels.label_topk) against the definition (block_label_scores, top-k with masked
slots last, the block-to-token map)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import label_topk as ltk
from pallas_kernels import labels as lb
from sparse_jax.ops import scoring

S = 700


def _case(seed, b, hq, hkv, d, r, bs, nb, short_row=True):
    """Random keys and labels, distinct block ids per row, a row cut by its length, a row
    with fewer counted blocks, garbage ids past the count."""
    rng = np.random.default_rng(seed)
    k = jnp.asarray(rng.normal(size=(b, hkv, S, d)), jnp.float32)
    channels = jnp.asarray(np.stack([rng.permutation(d)[:r] for _ in range(hkv)]), jnp.int32)
    labels = scoring.build_label_cache(k, channels, impl="reference")
    q = jnp.asarray(rng.normal(size=(b, hq, d)) * 2.0, jnp.float32)
    nbt = -(-S // bs)
    ids = np.stack([np.stack([rng.permutation(nbt)[:nb] for _ in range(hkv)]) for _ in range(b)])
    counts = np.full((b, hkv), nb)
    lengths = np.full((b,), S)
    if short_row and b > 1:
        lengths[1] = S - bs - 7
        cut = (lengths[1] - 1) // bs  # a block cut by the length, in the last slot (no duplicate)
        row = [int(x) for x in ids[1, 0] if x != cut][:nb - 1]
        ids[1, 0] = row + [cut]
        counts[1, -1] = max(1, nb // 3)
        ids[1, -1, counts[1, -1]:] = rng.integers(-(2**20), 2**20, size=nb - counts[1, -1])
    return (q, labels, channels, jnp.asarray(ids, jnp.int32), jnp.asarray(counts, jnp.int32),
            jnp.asarray(lengths, jnp.int32))


def _selected_scores(args, bs, pos, cnt):
    """Per row, the sorted scores (from block_label_scores) of the first ``cnt`` tokens of
    ``pos``; ties make positions ambiguous, scores are not."""
    q, labels, channels, ids, counts, lengths = args
    scores = np.asarray(scoring.block_label_scores(*args, block_size=bs, impl="reference"))
    tokens = np.asarray(lb.expand_blocks(ids, counts, lengths, block_size=bs, seq_len=S))
    out = []
    pos, cnt = np.asarray(pos), np.asarray(cnt)
    for bi in range(pos.shape[0]):
        for h in range(pos.shape[1]):
            lookup = {int(t): float(sc) for t, sc in zip(tokens[bi, h], scores[bi, h]) if t >= 0}
            sel = pos[bi, h, :cnt[bi, h]]
            assert len(set(sel.tolist())) == len(sel), "a token chosen twice"
            out.append(sorted(lookup[int(t)] for t in sel))  # KeyError: a masked token was chosen
    return out


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("hq,hkv,d,r,bs,nb,k", [
    (8, 2, 64, 16, 16, 9, 40),     # G=4, C=144 (not a power of two)
    (9, 3, 64, 16, 64, 5, 320),    # G=3 (SmolLM2), k = C: every unmasked slot
    (4, 1, 256, 64, 64, 7, 100),   # Gemma 3: MQA, D=256
    (4, 4, 32, 8, 8, 3, 24),       # G=1, k = C
])
def test_kernel_matches_the_unfused_definition(hq, hkv, d, r, bs, nb, k, fused):
    args = _case(hq * 7 + nb, 2, hq, hkv, d, r, bs, nb)
    ref_pos, ref_cnt = scoring.block_label_topk(*args, block_size=bs, k=k, impl="reference")
    got_pos, got_cnt = scoring.block_label_topk(*args, block_size=bs, k=k, impl="pallas", fused=fused)
    assert got_pos.shape == ref_pos.shape == (2, hkv, k) and got_pos.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got_cnt), np.asarray(ref_cnt))
    assert np.asarray(ref_cnt).min() < k or k < nb * bs  # the cases cover short rows or a real choice
    got = _selected_scores(args, bs, got_pos, got_cnt)
    ref = _selected_scores(args, bs, ref_pos, ref_cnt)
    for g, rr in zip(got, ref):
        np.testing.assert_allclose(g, rr, rtol=1e-6, atol=1e-12)


def test_unfused_selection_reads_the_tuned_table(monkeypatch):
    """With no selection knob from the caller, the unfused path's top-k takes the tuned
    table's knobs for its class (on the GPU; here the GPU check and the table are stubbed and
    the kernel runs in interpret mode). It used to pass radix_bits=1 always, which kept
    topk_indices from reading the table; a caller's knob still wins over the table."""
    from sparse_jax.ops import selection

    seen = []
    monkeypatch.setattr(selection, "on_gpu", lambda: True)
    monkeypatch.setattr(selection, "_measured", lambda n, k, rows: seen.append((rows, n, k)) or {"search": "bracket"})
    bs, nb, k = 16, 9, 40
    args = _case(5, 2, 8, 2, 64, 16, bs, nb)
    got_pos, got_cnt = scoring.block_label_topk(*args, block_size=bs, k=k, impl="pallas", fused=False)
    assert seen == [(2 * 2, nb * bs, k)]
    ref_pos, ref_cnt = scoring.block_label_topk(*args, block_size=bs, k=k, impl="reference")
    np.testing.assert_array_equal(np.asarray(got_cnt), np.asarray(ref_cnt))
    for g, rr in zip(_selected_scores(args, bs, got_pos, got_cnt), _selected_scores(args, bs, ref_pos, ref_cnt)):
        np.testing.assert_allclose(g, rr, rtol=1e-6, atol=1e-12)
    seen.clear()
    scoring.block_label_topk(*args, block_size=bs, k=k, impl="pallas", fused=False, radix_bits=2)
    assert seen == []


def test_fused_scores_equal_the_normalization_kernel():
    """The fused kernel forms the scores with the normalization kernel's arithmetic: the
    same numbers (interpret mode), so the same selection as block_label_scores + top-k."""
    q, labels, channels, ids, counts, lengths = _case(3, 2, 8, 2, 64, 16, 16, 9)
    kw = dict(block_size=16, interpret=True)
    logits, m, l = lb.block_label_scores_kernel(q, labels, channels, ids, counts, lengths, mode="logits",
                                                return_raw=True, splits=3, **kw)
    assert m.shape[2] > 1  # several statistic partitions are combined
    scores = lb.block_label_scores_kernel(q, labels, channels, ids, counts, lengths, mode="logits", splits=3, **kw)
    b, hkv, g, c = logits.shape
    # the reference path's normalization (label_scores_epilogue), -inf where masked
    ours = np.asarray(lb.label_scores_epilogue(logits, m, l))
    ours = np.where(np.asarray(logits)[:, :, 0] == -np.inf, -np.inf, ours)
    masked = np.isneginf(ours)
    np.testing.assert_array_equal(np.asarray(scores)[masked], 0.0)
    np.testing.assert_allclose(ours[~masked], np.asarray(scores)[~masked], rtol=1e-6)  # XLA's exp: 1 ulp
    # the fused kernel picks exactly what the unfused kernels pick: the top-k kernel over the
    # normalization kernel's scores, masked slots last, mapped to tokens
    pos, cnt = ltk.label_topk_pallas(logits.reshape(b * hkv, g, c), m.reshape(b * hkv, -1, g),
                                     l.reshape(b * hkv, -1, g), ids.reshape(b * hkv, -1), 50, block_size=16,
                                     interpret=True)
    from pallas_kernels.topk import topk_pallas

    valid = np.asarray(lb.expand_blocks(ids, counts, lengths, block_size=16, seq_len=S)) >= 0
    unfused = topk_pallas(jnp.where(valid, scores, -jnp.inf).reshape(b * hkv, c), 50, interpret=True)
    unfused = np.asarray(ids).reshape(b * hkv, -1)[np.arange(b * hkv)[:, None], np.asarray(unfused) // 16] * 16 \
        + np.asarray(unfused) % 16
    np.testing.assert_array_equal(np.asarray(cnt), np.minimum(valid.reshape(b * hkv, c).sum(-1), 50))
    for row in range(b * hkv):
        n = int(cnt[row])
        assert set(np.asarray(pos[row, :n]).tolist()) == set(unfused[row, :n].tolist())


def test_ties_take_slots_in_order_and_short_rows_fill_from_masked_slots():
    """Equal logits everywhere: the first k unmasked slots, in slot order; a row with
    fewer unmasked slots than k returns them all, then masked slots' images."""
    r, g, nb, bs, k = 2, 2, 4, 8, 12
    logits = np.zeros((r, g, nb * bs), np.float32)
    logits[1, :, 5:] = -np.inf  # row 1: 5 unmasked slots
    m = np.zeros((r, 1, g), np.float32)
    l = np.array([[[32.0, 32.0]], [[5.0, 5.0]]], np.float32)
    ids = np.array([[3, 0, 7, 1], [2, 9, 4, 6]], np.int32)
    pos, cnt = ltk.label_topk_pallas(jnp.asarray(logits), jnp.asarray(m), jnp.asarray(l), jnp.asarray(ids), k,
                                     block_size=bs, interpret=True)
    assert np.asarray(cnt).tolist() == [12, 5]
    slots = np.arange(12)
    np.testing.assert_array_equal(np.asarray(pos[0]), ids[0][slots // bs] * bs + slots % bs)
    assert np.asarray(pos[1, :5]).tolist() == [16, 17, 18, 19, 20]


def test_long_rows_use_the_unfused_kernels():
    """More candidates than one program holds: block_label_scores + topk_indices."""
    args = _case(5, 1, 4, 1, 32, 8, 64, 11, short_row=False)
    big = ltk.MAX_CANDIDATES
    try:
        ltk.MAX_CANDIDATES = 256  # 11 blocks of 64 = 704 candidates: past the (lowered) limit
        got_pos, got_cnt = scoring.block_label_topk(*args, block_size=64, k=300, impl="pallas", fused=True)
    finally:
        ltk.MAX_CANDIDATES = big
    ref_pos, ref_cnt = scoring.block_label_topk(*args, block_size=64, k=300, impl="reference")
    np.testing.assert_array_equal(np.asarray(got_cnt), np.asarray(ref_cnt))
    for g, rr in zip(_selected_scores(args, 64, got_pos, got_cnt), _selected_scores(args, 64, ref_pos, ref_cnt)):
        np.testing.assert_allclose(g, rr, rtol=1e-6, atol=1e-12)


def test_bad_arguments_fail_before_running():
    args = _case(1, 2, 8, 2, 64, 16, 16, 4)
    f = scoring.block_label_topk
    for kw, exc in [
        (dict(k=0), ValueError),
        (dict(k=65), ValueError),  # NBsel * block_size = 64
        (dict(k=3.0), ValueError),
        (dict(k=8, radix_bits=3), ValueError),
        (dict(k=8, select_num_warps=0), ValueError),
        (dict(k=8, impl="fast"), ValueError),
    ]:
        with pytest.raises(exc):
            f(*args, block_size=16, **kw)
    with pytest.raises(ValueError, match="needs lengths"):
        f(*args[:5], None, block_size=16, k=8)
    with pytest.raises(ValueError):
        ltk.label_topk_pallas(jnp.zeros((2, 1, 64)), jnp.zeros((2, 1, 1)), jnp.ones((2, 1, 1)),
                              jnp.zeros((2, 3), jnp.int32), 8, block_size=16, interpret=True)  # 3 * 16 != 64


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
@pytest.mark.parametrize("c,g,k", [(8192, 4, 2048), (144, 3, 40), (16384, 1, 512)])
def test_kernel_lowers_to_triton(abstract_h100, c, g, k):
    sd = jax.ShapeDtypeStruct
    args = (sd((16, g, c), jnp.float32), sd((16, 3, g), jnp.float32), sd((16, 3, g), jnp.float32),
            sd((16, c // 16), jnp.int32))
    fn = lambda *a: ltk.label_topk_pallas(*a, k, block_size=16)  # noqa: E731
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text


@pytest.mark.parametrize("impl,fused", [("reference", False), ("pallas", False), ("pallas", True)])
def test_asynctls_selects_what_the_unfused_path_selects(impl, fused, monkeypatch):
    """AsyncTLS (no sink or window) selects through block_label_topk; the scores + top-k +
    gather path it replaced (still DS's and AsyncTLS-with-sink's) must give the same tokens
    and counts: long rows, a row just past the budget, a row inside it (dense fallback)."""
    from sparse_jax.methods import get_method

    monkeypatch.setattr(scoring, "FUSED_LABEL_TOPK", fused)
    b, hq, hkv, d, r, bs, kb, budget = 3, 8, 2, 64, 16, 16, 6, 48
    rng = np.random.default_rng(0)
    k = jnp.asarray(rng.normal(size=(b, hkv, S, d)), jnp.float32)
    channels = np.stack([rng.permutation(d)[:r] for _ in range(hkv)])
    cpl = (tuple(tuple(int(c) for c in row) for row in channels),)
    m = get_method("asynctls", budget=budget, kb=kb, block_size=bs, channels_per_layer=cpl, impl=impl)
    lengths = jnp.asarray([S, budget + 5, budget - 3], jnp.int32)
    state = m.state_from_keys(k, lengths, jnp.asarray(channels, jnp.int32))
    q = jnp.asarray(rng.normal(size=(b, hq, d)) * 2.0, jnp.float32)
    ch = jnp.asarray(channels, jnp.int32)
    blocks = m.pick_blocks(q, state.boxes, (lengths - 1) // bs)
    got_idx, got_cnt = m.select_tokens(q, state, blocks, lengths, ch, S)
    # the unfused path, as select_tokens ran it before the fused op
    all_blocks, newest = m._with_newest(blocks, lengths)
    n1 = blocks.shape[-1]
    scored = jnp.broadcast_to(jnp.where(newest < n1, n1, n1 + 1)[:, None], (b, hkv)).astype(jnp.int32)
    scores = scoring.block_label_scores(q, state.labels, ch, all_blocks, scored, lengths, block_size=bs, impl=impl)
    cand, cand_counts = m.expand_blocks(blocks, lengths)
    ref_idx, ref_cnt = m.select_from_scores(scores, lengths, cand, cand_counts, capacity=S)
    np.testing.assert_array_equal(np.asarray(got_cnt), np.asarray(ref_cnt))
    got_idx, ref_idx = np.asarray(got_idx), np.asarray(ref_idx)
    for bi in range(b):
        for h in range(hkv):
            n = int(got_cnt[bi, h])
            assert n == min(budget, int(lengths[bi]))
            assert sorted(got_idx[bi, h, :n].tolist()) == sorted(ref_idx[bi, h, :n].tolist())


@pytest.mark.parametrize("impl", ["reference", "pallas"])
def test_block_counts_shared_by_a_rows_heads(impl):
    """block_counts [B, 1] (what AsyncTLS passes: one count for every KV head) gives what the
    broadcast [B, Hkv] gives, for the scores and the top-k."""
    q, labels, channels, ids, counts, lengths = _case(9, 2, 8, 2, 64, 16, 16, 6, short_row=False)
    per_row = jnp.asarray([6, 4], jnp.int32)
    wide = jnp.broadcast_to(per_row[:, None], (2, 2))
    args = (q, labels, channels, ids)
    np.testing.assert_array_equal(
        np.asarray(scoring.block_label_scores(*args, per_row[:, None], lengths, block_size=16, impl=impl)),
        np.asarray(scoring.block_label_scores(*args, wide, lengths, block_size=16, impl=impl)))
    got = scoring.block_label_topk(*args, per_row[:, None], lengths, block_size=16, k=30, impl=impl)
    want = scoring.block_label_topk(*args, wide, lengths, block_size=16, k=30, impl=impl)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    np.testing.assert_array_equal(np.sort(np.asarray(got[0]), -1), np.sort(np.asarray(want[0]), -1))
    with pytest.raises(ValueError, match="block_counts"):
        scoring.block_label_scores(*args, jnp.ones((2, 3), jnp.int32), lengths, block_size=16)


@pytest.mark.parametrize("impl,fused", [("reference", None), ("pallas", False), ("pallas", True)])
def test_dense_budget_is_the_dense_fallback(impl, fused):
    """``dense_budget``: a row no longer than it attends its whole context, ``arange(k)`` with
    its length as the count (``sparse_base.fallback_to_dense``'s rule: what AsyncTLS did after
    the op); longer rows keep the op's selection and count."""
    from sparse_jax.methods.sparse_base import fallback_to_dense

    bs, nb, k, budget = 16, 9, 40, 600
    args = _case(5, 3, 8, 2, 64, 16, bs, nb)
    q, labels, channels, ids, counts, lengths = args
    lengths = jnp.asarray([S, 200, 600], jnp.int32)  # rows 1 and 2 at most the budget
    args = (q, labels, channels, ids, counts, lengths)
    kw = {} if fused is None else {"fused": fused}
    pos, cnt = scoring.block_label_topk(*args, block_size=bs, k=k, impl=impl, **kw)
    dpos, dcnt = scoring.block_label_topk(*args, block_size=bs, k=k, impl=impl, dense_budget=budget, **kw)
    want_pos, want_cnt = fallback_to_dense(pos, lengths, budget)
    long = np.asarray(lengths > budget)[:, None]
    np.testing.assert_array_equal(np.asarray(dpos), np.asarray(want_pos))
    np.testing.assert_array_equal(np.asarray(dcnt), np.where(long, np.minimum(want_cnt, cnt), want_cnt))
    assert dcnt.dtype == jnp.int32
    with pytest.raises(ValueError, match="dense_budget"):
        scoring.block_label_topk(*args, block_size=bs, k=k, impl=impl, dense_budget=600.0)
