"""Sparse decode methods: selection invariants, state updates, accuracy on
peaked attention, dense fallback."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from sparse_jax.kv import ResidentKV
import pytest

from sparse_jax.layers import LayerSpec
from sparse_jax.methods import BlockSparseMethod, get_method
from sparse_jax.methods.base import single_layer
from sparse_jax.ops.dense import dense_decode_reference

SPEC = LayerSpec(sparse=True)

B, HQ, HKV, S, D = 2, 8, 2, 640, 64
LAYERS = 4
CHANNELS = tuple(tuple(tuple(range(c, 64, 4)) for c in range(HKV)) for _ in range(LAYERS))
SPARSE = {
    "oracle_topk": {},
    "streaming": {},
    "quest": {},
    "arkvale": {},
    "double_sparsity": {"channels_per_layer": CHANNELS},
    "asynctls": {"channels_per_layer": CHANNELS, "kb": 8},
}


def make_method(name, **kw):
    m = get_method(name, **{**SPARSE[name], **kw})
    m.check(num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, max_len=S)
    return m


def ctx(m):
    """The last layer's context (its calibrated channels for the label methods)."""
    data = m.layer_data(LAYERS - 1)
    return single_layer(LAYERS - 1, SPEC, {k: jnp.asarray(v) for k, v in (data or {}).items()})


def select_tokens(m, q, k, v, lengths, st):
    """``(indices, counts, state)`` of the method's selection as token positions."""
    sel, st, _ = m.select(q, ResidentKV(k, v), lengths, st, None, ctx(m))
    idx, cnt = sel.token_view(lengths)
    return idx, cnt, st


def decode_fn(m):
    return lambda q, k, v, lengths, st: m.decode(q, ResidentKV(k, v), lengths, st, None, ctx(m))[:2]


def peaked_inputs(seed, hot=12):
    """Keys with ``hot`` tokens per KV head aligned with the group's queries, so
    attention concentrates on them (as in real long-context attention)."""
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, HQ, D)).astype(np.float32)
    k = rng.normal(size=(B, HKV, S, D)).astype(np.float32) * 0.5
    v = rng.normal(size=(B, HKV, S, D)).astype(np.float32)
    hot_pos = np.stack([np.stack([rng.choice(np.arange(40, 400), hot, replace=False) for _ in range(HKV)]) for _ in range(B)])
    g = HQ // HKV
    for b in range(B):
        for h in range(HKV):
            qmean = q[b, h * g:(h + 1) * g].mean(0)
            k[b, h, hot_pos[b, h]] += 3.0 * qmean / np.linalg.norm(qmean) * np.sqrt(D)
    return jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), hot_pos


def run(m, q, k, v, lengths):
    st = m.init_state(SPEC, batch=B, num_kv_heads=HKV, max_len=S, head_dim=D, dtype=k.dtype)
    st = m.prefill_state(st, k, v, lengths, ctx(m))
    idx, cnt, _ = select_tokens(m, q, k, v, lengths, st)
    out, _ = jax.jit(decode_fn(m))(q, k, v, lengths, st)
    return np.asarray(idx), np.asarray(cnt), out, st


@pytest.mark.parametrize("name", sorted(SPARSE))
def test_selection_invariants_and_fallback(name):
    q, k, v, _ = peaked_inputs(0)
    lengths = jnp.array([611, 150], jnp.int32)
    m = make_method(name, budget=192)
    idx, cnt, out, _ = run(m, q, k, v, lengths)
    assert idx.shape[:2] == (B, HKV)
    # Block methods always attend the newest block; token methods only with a window.
    forces_newest = isinstance(m, BlockSparseMethod) or name == "streaming" or m.window > 0
    for b in range(B):
        for h in range(HKV):
            sel = idx[b, h, : cnt[b, h]]
            assert cnt[b, h] <= 192
            assert len(np.unique(sel)) == len(sel), "a token is selected twice"
            assert sel.min() >= 0 and sel.max() < int(lengths[b])
            if forces_newest:
                assert int(lengths[b]) - 1 in sel, "the newest token must be attended"
    # Row 1 fits in the budget: exact attention over its whole context.
    assert np.all(cnt[1] == 150)
    dense, _ = (dense_decode_reference(q, k, v, lengths), None)
    np.testing.assert_allclose(out[1], dense[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["oracle_topk", "quest", "arkvale", "double_sparsity", "asynctls"])
def test_query_aware_methods_find_the_hot_tokens(name):
    q, k, v, hot = peaked_inputs(1)
    lengths = jnp.array([640, 577], jnp.int32)
    # 12 scattered hot tokens need 12 blocks: ArkVale's 32-token pages (3 of them
    # sink/window) need a larger budget than the token methods.
    m = make_method(name, budget=512 if name == "arkvale" else 256)
    idx, cnt, out, _ = run(m, q, k, v, lengths)
    for b in range(B):
        for h in range(HKV):
            found = np.isin(hot[b, h], idx[b, h, : cnt[b, h]]).mean()
            assert found >= 0.9, f"{name} found only {found:.0%} of the hot tokens"
    dense, _ = (dense_decode_reference(q, k, v, lengths), None)
    rel = np.linalg.norm(out - dense) / np.linalg.norm(dense)
    assert rel < 0.1, rel


def test_streaming_keeps_sink_and_recent_window():
    q, k, v, _ = peaked_inputs(2)
    lengths = jnp.array([640, 400], jnp.int32)
    m = make_method("streaming", budget=100, sink=4)
    idx, cnt, _, _ = run(m, q, k, v, lengths)
    for b, n in enumerate([640, 400]):
        assert sorted(idx[b, 0, : cnt[b, 0]].tolist()) == list(range(4)) + list(range(n - 96, n))


def test_budget_counts_sink_and_window():
    q, k, v, _ = peaked_inputs(3)
    lengths = jnp.array([640, 640], jnp.int32)
    m = make_method("oracle_topk", budget=100, sink=8, window=16)
    idx, cnt, _, _ = run(m, q, k, v, lengths)
    assert np.all(cnt == 100)
    sel = idx[0, 0, :100]
    assert set(range(8)) <= set(sel.tolist()) and set(range(624, 640)) <= set(sel.tolist())


@pytest.mark.parametrize("name", ["quest", "arkvale", "double_sparsity", "asynctls"])
def test_append_state_equals_rebuild(name):
    """Appending tokens one by one (across a block boundary) gives the same
    state as summarising the longer cache from scratch. AsyncTLS with boxes in the cache's
    dtype: its default 8-bit boxes keep the prompt's range, so a rebuild from more keys
    quantizes differently (``tests/test_quantized_boxes.py`` checks their appends)."""
    m = make_method(name, **({"box_bits": None} if name == "asynctls" else {}))
    _, k, v, _ = peaked_inputs(4)
    start = jnp.array([60, 95], jnp.int32)
    st = m.init_state(SPEC, batch=B, num_kv_heads=HKV, max_len=S, head_dim=D, dtype=k.dtype)
    st = m.prefill_state(st, k, v, start, ctx(m))
    for step in range(40):
        st = m.append_state(st, ResidentKV(k, v), start + step, ctx(m))
    ref = m.prefill_state(m.init_state(SPEC, batch=B, num_kv_heads=HKV, max_len=S, head_dim=D, dtype=k.dtype), k, v, start + 40, ctx(m))
    # Compare only what covers valid tokens (blocks/tokens past the length are don't-care).
    for a, r in zip(jax.tree.leaves(st), jax.tree.leaves(ref)):
        a, r = np.asarray(a, np.float64), np.asarray(r, np.float64)
        if a.ndim >= 3 and a.shape[2] == S:  # per-token label arrays
            for b, n in enumerate([100, 135]):
                np.testing.assert_allclose(a[b, :, :n], r[b, :, :n], rtol=1e-5, atol=1e-5)
        elif a.ndim == 4:  # per-block boxes
            bs = m.block_size
            for b, n in enumerate([100, 135]):
                nb = -(-n // bs)
                np.testing.assert_allclose(a[b, :, :nb], r[b, :, :nb], rtol=1e-5, atol=1e-5)


def test_bad_configs_fail_early():
    with pytest.raises(ValueError, match="exceed the budget"):
        make_method("oracle_topk", budget=10, sink=8, window=8)
    with pytest.raises(ValueError, match="multiple of block_size"):
        get_method("quest").check(num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, max_len=S + 3)
    with pytest.raises(ValueError, match="calibrated channels"):
        get_method("double_sparsity").check(num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, max_len=S)
    with pytest.raises(ValueError, match="fewer than"):
        make_method("arkvale", budget=64)


def test_missing_calibration_names_the_command(tmp_path):
    m = get_method("double_sparsity", calibration_root=str(tmp_path))
    with pytest.raises(FileNotFoundError, match="python -m models.cli.calibrate --model nope"):
        m.for_model("nope", num_layers=2, head_dim=64)


def test_asynctls_lag_searches_the_blocks_the_previous_query_chose():
    """``lag=True``: step t's candidates are the blocks picked by step t-1's query
    (the last prompt token's for the first step); with one query throughout
    the lagged method equals the unlagged one."""
    q, k, v, _ = peaked_inputs(3)
    q2 = jnp.asarray(np.random.default_rng(9).normal(size=q.shape).astype(np.float32))
    lengths = jnp.array([600, 333], jnp.int32)  # the first decode step's lengths
    lag = make_method("asynctls", budget=128, kb=4, block_size=32, lag=True)
    now = make_method("asynctls", budget=128, kb=4, block_size=32)
    st = lag.init_state(SPEC, batch=B, num_kv_heads=HKV, max_len=S, head_dim=D, dtype=k.dtype)
    st = lag.prefill_state(st, k, v, lengths - 1, ctx(lag))
    st = lag.prefill_query_state(st, q2, lengths - 1, ctx(lag))  # the "previous" query
    expected = now.pick_blocks(q2, st.boxes, (lengths - 1) // 32)
    np.testing.assert_array_equal(np.asarray(st.prev_blocks), np.asarray(expected))
    st = lag.append_state(st, ResidentKV(k, v), lengths - 1, ctx(lag))
    idx, cnt, st2 = select_tokens(lag, q, k, v, lengths, st)
    cand, ccnt = now.expand_blocks(expected, lengths)
    for b in range(B):
        for h in range(HKV):
            allowed = set(np.asarray(cand[b, h, : ccnt[b, h]]).tolist())
            assert set(np.asarray(idx[b, h, : cnt[b, h]]).tolist()) <= allowed
    # the state now holds this query's choice for the next step (newest = lengths // bs)
    np.testing.assert_array_equal(np.asarray(st2.prev_blocks),
                                  np.asarray(now.pick_blocks(q, st.boxes, lengths // 32)))
    # same query at both steps: lagged == unlagged (no block completed in between)
    st_same = dataclasses.replace(st, prev_blocks=now.pick_blocks(q, st.boxes, (lengths - 1) // 32))
    i1, c1, _ = select_tokens(lag, q, k, v, lengths, st_same)
    i0, c0, _ = select_tokens(now, q, k, v, lengths, dataclasses.replace(st, prev_blocks=None))
    np.testing.assert_array_equal(np.asarray(c1), np.asarray(c0))
    for b in range(B):
        for h in range(HKV):
            assert sorted(np.asarray(i1[b, h, : c1[b, h]]).tolist()) == sorted(np.asarray(i0[b, h, : c0[b, h]]).tolist())


@pytest.mark.parametrize("name", ["double_sparsity", "asynctls"])
def test_label_records_layout_selects_the_same(name):
    """``label_layout="records"``: the same selections and outputs as the three-array
    cache, after a prefill and after appended tokens; a layout the channels cannot
    fill is refused before anything runs."""
    q, k, v, _ = peaked_inputs(5)
    lengths = jnp.array([600, 333], jnp.int32)
    cache_m, rec_m = make_method(name), make_method(name, label_layout="records")
    i1, c1, o1, st1 = run(cache_m, q, k, v, lengths)
    i2, c2, o2, st2 = run(rec_m, q, k, v, lengths)
    np.testing.assert_array_equal(i1, i2)
    np.testing.assert_array_equal(c1, c2)
    np.testing.assert_array_equal(np.asarray(o1), np.asarray(o2))
    for m, st in ((cache_m, st1), (rec_m, st2)):
        for step in range(3):
            st = m.append_state(st, ResidentKV(k, v), lengths + step, ctx(m))
        idx, cnt, _ = select_tokens(m, q, k, v, lengths + 3, st)
        if m is cache_m:
            want = (np.asarray(idx), np.asarray(cnt))
        else:
            np.testing.assert_array_equal(np.asarray(idx), want[0])
            np.testing.assert_array_equal(np.asarray(cnt), want[1])
    with pytest.raises(ValueError, match="label_layout must be"):
        make_method(name, label_layout="interleaved")
    narrow = tuple(tuple(tuple(range(c, 24, 4)) for c in range(HKV)) for _ in range(LAYERS))  # r = 6
    with pytest.raises(ValueError, match="multiple of 8"):
        make_method(name, label_layout="records", channels=6, channels_per_layer=narrow)


def test_block_bound_group_reduction():
    """``group_reduce="max"``: a block one query head of the group wants ranks first, where
    the sum lets the group's other heads outvote it (Gemma 3's needle at layer 11)."""
    from sparse_jax.methods import get_method
    from sparse_jax.methods.quest import BlockBoxes

    upper = np.zeros((1, 1, 5, 4), np.float32)
    upper[0, 0, 0, 0] = 10.0  # block 0: what head 0 reads
    upper[0, 0, 1:, 1] = 4.0  # blocks 1-4: what heads 1-3 read, a little each
    boxes = BlockBoxes(jnp.asarray(upper), jnp.zeros_like(jnp.asarray(upper)))
    q = jnp.asarray([[[1, 0, 0, 0], [0, 1, 0, 0], [0, 1, 0, 0], [0, 1, 0, 0]]], jnp.float32)
    newest = jnp.asarray([4], jnp.int32)
    for reduce, want_first in (("sum", False), ("max", True)):
        tls = get_method("asynctls", budget=64, kb=2, group_reduce=reduce)
        picked = np.asarray(tls.pick_blocks(q, boxes, newest))
        assert (picked[0, 0, 0] == 0) == want_first, (reduce, picked)
        quest = get_method("quest", budget=64, group_reduce=reduce)
        assert (int(np.argmax(np.asarray(quest.block_scores(q, boxes))[0, 0])) == 0) == want_first, reduce
    with pytest.raises(ValueError, match="group_reduce must be one of"):
        get_method("quest", budget=64, group_reduce="mean")


@pytest.mark.parametrize("impl", ["pallas", "reference"])
def test_filter_writes_short_rows_and_the_newest_block_in_its_top_k(impl):
    """The filter's fallback and the newest block come out of its top-k kernel (``dense_lengths``,
    ``append``), not an XLA select and concatenate after it: the same blocks as that old form,
    ``where(newest <= n-1, arange(n-1), top)`` with the newest appended, for a long row, a row
    exactly at n-1 blocks and a short one; and the one-block filter (n-1 = 0)."""
    from sparse_jax.methods.quest import BlockBoxes
    from sparse_jax.ops.scoring import quest_block_scores
    from sparse_jax.ops.selection import topk_indices

    rng = np.random.default_rng(4)
    nb, bs = 20, 32
    upper = jnp.asarray(rng.normal(size=(3, HKV, nb, D)).astype(np.float32))
    boxes = BlockBoxes(upper, upper - jnp.asarray(rng.random(upper.shape).astype(np.float32)))
    q = jnp.asarray(rng.normal(size=(3, HQ, D)).astype(np.float32))
    for kb in (6, 1):
        m = get_method("asynctls", budget=64, kb=kb, block_size=bs, impl=impl)
        n1 = kb - 1
        newest = jnp.asarray([17, n1, 2], jnp.int32)  # long, at the limit, short
        got = np.asarray(m.pick_blocks(q, boxes, newest, with_newest=True))
        plain = np.asarray(m.pick_blocks(q, boxes, newest))
        assert got.shape == (3, HKV, n1 + 1) and plain.shape == (3, HKV, n1)
        if n1:  # the old form
            scores = quest_block_scores(q, boxes.upper, boxes.lower, group_reduce=m.group_reduce, impl="reference")
            top = np.asarray(topk_indices(scores, n1, newest[:, None], impl="reference"))
            want = np.where((np.asarray(newest) <= n1)[:, None, None], np.arange(n1), top)
            np.testing.assert_array_equal(np.sort(plain, -1), np.sort(want, -1))  # the kernel's order: ascending
            # in order: a short row's candidates are its tokens 0..L-1 first (expand_blocks)
            np.testing.assert_array_equal(plain[1:], np.broadcast_to(np.arange(n1), (2, HKV, n1)))
        np.testing.assert_array_equal(got[..., :n1], plain)
        np.testing.assert_array_equal(got[..., n1], np.broadcast_to(np.asarray(newest)[:, None], (3, HKV)))


def test_asynctls_fused_selection_selects_the_same(monkeypatch):
    """``fused_selection=True`` (one kernel normalizes, selects and maps the labels' top
    tokens) picks the tokens the unfused kernels do, through the kernel path (Pallas
    interpret mode here), and only then runs the fused kernel; anything but True, False or
    None is refused."""
    from sparse_jax.ops import scoring

    calls = []
    fused_kernel = scoring._ltk.label_topk_pallas
    monkeypatch.setattr(scoring._ltk, "label_topk_pallas", lambda *a, **kw: calls.append(1) or fused_kernel(*a, **kw))
    q, k, v, _ = peaked_inputs(7)
    lengths = jnp.array([600, 333], jnp.int32)
    got = {}
    for fused in (False, True):
        m = make_method("asynctls", budget=64, impl="pallas", fused_selection=fused)
        idx, cnt, _, _ = run(m, q, k, v, lengths)
        got[fused] = [sorted(idx[b, h, :cnt[b, h]].tolist()) for b in range(B) for h in range(HKV)], cnt
        assert bool(calls) == fused
    assert got[False][0] == got[True][0]
    np.testing.assert_array_equal(got[False][1], got[True][1])
    assert (got[True][1] == 64).all()  # both rows are longer than the budget: a sparse selection
    with pytest.raises(ValueError, match="fused_selection must be"):
        make_method("asynctls", fused_selection="yes")


def test_asynctls_8bit_boxes_find_what_the_exact_boxes_find():
    """``box_bits=8``: the filter reads 8-bit codes (half bf16's bytes). On peaked inputs with a
    filter that must choose (7 of 9 blocks) it finds the hot tokens as the exact boxes do;
    after appends, the codes still contain the exact boxes of the longer cache (a bound); a
    width other than 8 is refused."""
    from pallas_kernels.quantized_boxes import QuantizedBoxes, dequantize_boxes
    from sparse_jax.ops.scoring import block_minmax

    q, k, v, hot = peaked_inputs(1)
    lengths = jnp.array([640, 577], jnp.int32)
    exact, q8 = make_method("asynctls", budget=256), make_method("asynctls", budget=256, box_bits=8)
    i0, c0, o0, _ = run(exact, q, k, v, lengths)
    i8, c8, o8, st = run(q8, q, k, v, lengths)
    assert isinstance(st.boxes, QuantizedBoxes) and st.boxes.upper.dtype == jnp.int8
    for b in range(B):
        for h in range(HKV):
            assert np.isin(hot[b, h], i8[b, h, : c8[b, h]]).mean() >= 0.9
            same = np.isin(i8[b, h, : c8[b, h]], i0[b, h, : c0[b, h]]).mean()
            assert same >= 0.9, same
    dense = dense_decode_reference(q, k, v, lengths)
    assert np.linalg.norm(o8 - dense) / np.linalg.norm(dense) < 0.1
    start = jnp.array([500, 333], jnp.int32)
    st = q8.prefill_state(q8.init_state(SPEC, batch=B, num_kv_heads=HKV, max_len=S, head_dim=D, dtype=k.dtype),
                          k, v, start, ctx(q8))
    for step in range(70):  # across a block boundary in both rows
        st = q8.append_state(st, ResidentKV(k, v), start + step, ctx(q8))
    e_max, e_min = block_minmax(k, start + 70, block_size=64, impl="reference")
    up, lo = dequantize_boxes(st.boxes)
    for b, n in enumerate([570, 403]):
        nb = -(-n // 64)
        tol = 1e-6 * float(jnp.abs(e_max).max())
        assert (np.asarray(up[b, :, :nb]) >= np.asarray(e_max[b, :, :nb]) - tol).all()
        assert (np.asarray(lo[b, :, :nb]) <= np.asarray(e_min[b, :, :nb]) + tol).all()
    with pytest.raises(ValueError, match="box_bits"):
        make_method("asynctls", box_bits=4)
