"""AsyncSpade (sparse_jax.methods.asyncspade): the closed-form ridge solution
against numpy.linalg.lstsq; W = 1 is the one-step lag exactly; a perfect
predictor selects what the non-lagged selector selects; exact when the budget
covers the context; offloaded == resident over a block and a token selector."""

import jax.numpy as jnp
import numpy as np
import pytest

from sparse_jax.kv import ResidentKV
from sparse_jax.methods import get_method
from sparse_jax.methods.asyncspade import AsyncSpade, predict_next_query, ridge_weights
from sparse_jax.methods.base import single_layer


def test_ridge_closed_form_matches_lstsq():
    rng = np.random.default_rng(0)
    for k, d, eps in [(1, 8, 0.3), (5, 16, 1e-3), (15, 64, 2.0)]:
        x = rng.normal(size=(k, d))
        y = rng.normal(size=(d,))
        got = np.asarray(ridge_weights(jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32), jnp.float32(eps)))
        # ridge = least squares on [xᵀ; sqrt(eps) I] w = [y; 0]
        a = np.concatenate([x.T, np.sqrt(eps) * np.eye(k)])
        want = np.linalg.lstsq(a, np.concatenate([y, np.zeros(k)]), rcond=None)[0]
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5)


def _np_predict(hist, count, window, ridge):
    """The predictor written out window by window (Eq. 2-5 as resolved), float64."""
    q_t = hist[-1]
    eps = ridge * max(q_t @ q_t, 1e-12)
    cands = [q_t]
    for k in range(2, window + 1):
        if count <= k:
            continue
        x = hist[-1 - k:-1]
        w = np.linalg.solve(x @ x.T + eps * np.eye(k), x @ q_t)
        w = np.exp(w - w.max()) / np.exp(w - w.max()).sum()
        cands.append(w @ hist[-k:])
    return np.mean(cands, axis=0)


@pytest.mark.parametrize("window", [2, 5, 16])
def test_predictor_matches_the_window_by_window_formula(window):
    rng = np.random.default_rng(window)
    hist = rng.normal(size=(3, 2, window + 1, 8))
    hist[..., -1, :] += hist[..., -2, :]  # some temporal correlation
    count = np.array([window + 1, 3, 1])
    got = np.asarray(predict_next_query(jnp.asarray(hist, jnp.float32), jnp.asarray(count), window, 1e-2))
    for b in range(3):
        for h in range(2):
            np.testing.assert_allclose(got[b, h], _np_predict(hist[b, h], count[b], window, 1e-2), rtol=2e-4, atol=2e-5)


def test_window_one_is_the_lag_and_windows_use_the_known_history():
    rng = np.random.default_rng(1)
    hist = jnp.asarray(rng.normal(size=(2, 3, 6, 8)), jnp.float32)
    np.testing.assert_array_equal(np.asarray(predict_next_query(hist[:, :, -2:], jnp.asarray([2, 2]), 1, 1e-2)),
                                  np.asarray(hist[:, :, -1]))
    # with one known query, any window predicts it (the first decode step)
    np.testing.assert_allclose(np.asarray(predict_next_query(hist, jnp.asarray([1, 1]), 5, 1e-2)),
                               np.asarray(hist[:, :, -1]), rtol=1e-6)
    # a query sequence that repeats with period 2 is predicted from a window of 2+
    a, b = rng.normal(size=8), rng.normal(size=8)
    seq = jnp.asarray(np.stack([a, b, a, b, a, b])[None, None], jnp.float32)
    pred = np.asarray(predict_next_query(seq, jnp.asarray([6]), 2, 1e-6))[0, 0]
    assert np.dot(pred, a) / np.linalg.norm(pred) / np.linalg.norm(a) > np.dot(b, a) / np.linalg.norm(b) / np.linalg.norm(a)


def _decode_steps(method, steps, seed=0, b=2, hq=4, hkv=2, s=256, d=16):
    """Drive a method's hooks by hand over ``steps`` decode steps of random data:
    per step (q, selection, state before, state after)."""
    rng = np.random.default_rng(seed)
    k = jnp.asarray(rng.normal(size=(b, hkv, s, d)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(b, hkv, s, d)), jnp.float32)
    lengths = jnp.asarray([150, 131], jnp.int32)
    ctx = single_layer(2, capacity=s)
    st = method.init_state(ctx.spec, batch=b, num_kv_heads=hkv, max_len=s, head_dim=d, dtype=jnp.float32)
    st = method.prefill_state(st, k, v, lengths, ctx)
    qs = [jnp.asarray(rng.normal(size=(b, hq, d)), jnp.float32) for _ in range(steps + 1)]
    st = method.prefill_query_state(st, qs[0], lengths, ctx)
    out = []
    for t in range(1, steps + 1):
        kv = ResidentKV(k, v)
        st1 = method.append_state(st, kv, lengths, ctx)
        sel, st2, _ = method.select(qs[t], kv, lengths + 1, st1, None, ctx)
        out.append((qs[t], lengths + 1, sel, st1, st2))
        st, lengths = st2, lengths + 1
    return out, qs


def test_window_one_selects_with_the_previous_query():
    m = AsyncSpade(selector="quest", budget=64, window=1)
    quest = m.inner()
    steps, qs = _decode_steps(m, 5)
    for t, (q, lengths, sel, st_before, _) in enumerate(steps, start=1):
        want, want_counts = quest.select_blocks(qs[t - 1], lengths, st_before["inner"])
        np.testing.assert_array_equal(np.asarray(sel.indices), np.asarray(want))
        np.testing.assert_array_equal(np.asarray(sel.counts), np.asarray(want_counts))


def test_perfect_predictor_selects_like_the_non_lagged_selector():
    m = AsyncSpade(selector="quest", budget=64, window=4)
    quest = m.inner()
    steps, qs = _decode_steps(m, 4)
    for t in range(len(steps) - 1):
        _, lengths, _, _, st_after = steps[t]
        q_next, len_next, _, st_next_before, _ = steps[t + 1]
        # the true next query fed to the one-step-ahead choice ...
        ahead, ahead_counts = m._choose(q_next, lengths, st_after["inner"], single_layer(2))
        # ... equals the selector run at the next step with that query
        now, now_counts = quest.select_blocks(q_next, len_next, st_next_before["inner"])
        np.testing.assert_array_equal(np.sort(np.asarray(ahead), -1), np.sort(np.asarray(now), -1))
        np.testing.assert_array_equal(np.asarray(ahead_counts), np.asarray(now_counts))


def _tiny(method, layers=3):
    from tests.test_offload import _tiny_model

    return _tiny_model(method, num_layers=layers)


@pytest.mark.parametrize("selector", ["quest", "double_sparsity"])
def test_asyncspade_offloaded_equals_resident(selector):
    """Quest blocks or DS tokens chosen one step ahead from the predicted query: the
    selection lies in the previous step's prefetch, so the offloaded run matches (θ_t = 0:
    offloaded the default resolves to it, resident it is asked for)."""
    from tests.test_offload import _check_offloaded_equals_resident, _ragged_tokens

    opts = dict(selector=selector, budget=32, window=4, dense_layers=(0,), dense_steps=0)
    if selector == "quest":
        opts["selector_options"] = (("block_size", 8),)
    else:
        chans = ((tuple(range(0, 16, 4)), tuple(range(1, 16, 4))),) * 3
        opts.update(selector_options=(("channels_per_layer", chans),), prefetch_block_size=8)
    model = _tiny(get_method("asyncspade", **opts))
    tokens, lengths = _ragged_tokens(8)
    pools = (4,) if selector == "quest" else (31,)
    _check_offloaded_equals_resident(model, tokens, lengths, 32, 256, pools, atol=1e-5)


def test_asyncspade_bad_options():
    with pytest.raises(ValueError, match="must not lag"):
        get_method("asyncspade", selector="asynctls", **{"selector.lag": True}).check(
            num_q_heads=4, num_kv_heads=2, head_dim=16, max_len=256)
    with pytest.raises(ValueError, match="reads every key"):
        get_method("asyncspade", selector="kascade").check(num_q_heads=4, num_kv_heads=2, head_dim=16,
                                                            max_len=256)
    with pytest.raises(ValueError, match="window must be"):
        AsyncSpade(window=0).check(num_q_heads=4, num_kv_heads=2, head_dim=16, max_len=256)
    with pytest.raises(ValueError, match="steady is the program past the warm-up"):  # not a user option
        get_method("asyncspade", dense_steps=2, steady=True).check(num_q_heads=4, num_kv_heads=2, head_dim=16,
                                                                    max_len=256)
    for bad in (-1, 5, 2.0, True):
        with pytest.raises(ValueError, match="dense_steps must be None"):
            AsyncSpade(window=4, dense_steps=bad).check(num_q_heads=4, num_kv_heads=2, head_dim=16, max_len=256)
    # θ_t defaults to the window (issue 51's harness); offloaded and on the cache rank no whole
    # cache is on the attending device, so the default is 0 there and a count is refused
    assert AsyncSpade().theta_steps == 16 and AsyncSpade(window=4).warmup_steps == 4
    assert AsyncSpade(dense_steps=0).warmup_steps == 0
    assert AsyncSpade().for_offload().dense_steps == 0 and AsyncSpade().for_offload().warmup_steps == 0
    with pytest.raises(ValueError, match="dense_steps=3 attends every key"):
        AsyncSpade(dense_steps=3).for_offload()


def test_dense_steps_attend_every_key_then_the_selection():
    """θ_t (``dense_steps``): the first decode steps after the prompt give the dense logits,
    the later ones select (``dense_steps=0``: every step); rows at different steps in one batch
    each take their own (a row's output does not depend on the others)."""
    from tests.test_offload import _ragged_tokens

    dense = _tiny(get_method("dense"))
    tokens, lengths = _ragged_tokens(5)
    tokens, lengths = jnp.asarray(tokens), jnp.asarray(lengths)

    def run(model, steps=5):
        logits, cache = model.fns.prefill(model.params, tokens, lengths, model.init_cache(3, 128))
        out = [logits]
        for _ in range(steps):
            logits, cache = model.fns.decode_step(model.params, jnp.argmax(out[-1], -1).astype(jnp.int32), cache)
            out.append(logits)
        return np.stack([np.asarray(x) for x in out]), cache

    want, _ = run(dense)
    opts = dict(budget=16, window=3, dense_layers=(0,), selector_options=(("block_size", 8),))
    warm, cache = run(_tiny(get_method("asyncspade", **opts)))  # the default: the whole window
    cold, _ = run(_tiny(get_method("asyncspade", dense_steps=0, **opts)))
    np.testing.assert_allclose(warm[:4], want[:4], rtol=1e-5, atol=1e-5)  # prefill + 3 dense steps
    assert np.abs(warm[4:] - want[4:]).max() > 1e-4  # then it selects
    assert np.abs(cold[1:4] - want[1:4]).max() > 1e-4  # the control: sparse from the first step
    assert int(np.asarray(cache.layers[1].state["count"]).min()) == 4  # W + 1: the window full
    # past the warm-up, the steady program (no per-layer branch) gives the same logits and cache
    _check_steady_program(_tiny(get_method("asyncspade", dense_steps=3, **opts)), tokens, lengths, 3)
    assert _tiny(get_method("asyncspade", dense_steps=0, **opts)).fns.steady_decode_step is None  # one program
    # a row whose count says it is past the warm-up takes the selection while another warms up
    m = AsyncSpade(selector="quest", budget=64, window=4, dense_steps=2)
    steps, qs = _decode_steps(m, 1)
    q, lens, sel, st_before, _ = steps[0]
    rng = np.random.default_rng(0)
    k = jnp.asarray(rng.normal(size=(2, 2, 256, 16)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(2, 2, 256, 16)), jnp.float32)
    kv, ctx = ResidentKV(k, v), single_layer(2, capacity=256)
    mixed = dict(st_before, count=jnp.asarray([1, 3], jnp.int32))  # row 0 warming up, row 1 past it
    out, _, _ = m.decode(q, kv, lens, mixed, None, ctx)
    from sparse_jax.ops.dense import dense_decode_reference
    from sparse_jax.selection import attend

    np.testing.assert_allclose(np.asarray(out[0]), np.asarray(dense_decode_reference(q, k, v, lens))[0],
                               rtol=1e-5, atol=1e-5)
    sel1, _, _ = m.select(q, kv, lens, mixed, None, ctx)
    np.testing.assert_allclose(np.asarray(out[1]), np.asarray(attend(q, k, v, lens, sel1, impl="reference"))[1],
                               rtol=1e-5, atol=1e-5)


def _check_steady_program(model, tokens, lengths, warmup: int, steps: int = 2):
    """``fns.steady_decode_step`` (no per-layer warm-up branch) gives a row past its first
    ``warmup_steps`` decode steps the logits and cache of ``fns.decode_step`` exactly, and
    differs within them (the control: the comparison can fail); ``decode_at`` picks it
    (``generate_ids`` uses it: tests/test_engine.py compares the engines with it)."""
    import jax

    fns = model.fns
    assert fns.warmup_steps == warmup and fns.steady_decode_step is not None
    assert fns.decode_at(warmup) is fns.decode_step and fns.decode_at(warmup + 1) is fns.steady_decode_step
    logits, cache = fns.prefill(model.params, tokens, lengths, model.init_cache(3, 128))
    for step in range(1, warmup + steps + 1):
        tok = jnp.argmax(logits, -1).astype(jnp.int32)
        copy = jax.tree.map(jnp.copy, cache)  # both programs donate their cache
        steady_logits, steady_cache = fns.steady_decode_step(model.params, tok, copy)
        logits, cache = fns.decode_step(model.params, tok, cache)
        if step <= warmup:
            assert np.abs(np.asarray(steady_logits) - np.asarray(logits)).max() > 1e-4, step
        else:
            np.testing.assert_array_equal(np.asarray(steady_logits), np.asarray(logits), err_msg=str(step))
            for a, b in zip(jax.tree.leaves(steady_cache), jax.tree.leaves(cache)):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(step))


# -- the token-level selector (selector="oracle_topk": the paper's top-k of q̂ Kᵀ) ----------------


def _oracle_choice(q, k, lengths, budget):
    """Top ``budget`` tokens of the exact group-summed softmax of ``q`` over ``[0, lengths)``."""
    from sparse_jax.methods.sparse_base import group_probabilities

    scores = np.asarray(group_probabilities(q, k, lengths))
    return [[set(np.argsort(-scores[b, h, :int(lengths[b])], kind="stable")[:budget].tolist())
             for h in range(scores.shape[1])] for b in range(scores.shape[0])]


def test_token_selector_takes_the_predicted_querys_top_tokens():
    """Each step attends the top ``budget - 1`` tokens of the query predicted one step earlier
    (the first step: of the last prompt query, over the prompt) plus the new token; the
    selection invariants of the other token methods hold."""
    budget, window = 24, 4
    m = AsyncSpade(selector="oracle_topk", budget=budget, window=window)
    m.check(num_q_heads=4, num_kv_heads=2, head_dim=16, max_len=256)
    assert m.reads_all_keys and not m.blocks
    steps, qs = _decode_steps(m, 5)
    rng = np.random.default_rng(0)
    k = jnp.asarray(rng.normal(size=(2, 2, 256, 16)), jnp.float32)  # _decode_steps' keys (same seed, first draw)
    for t, (q, lengths, sel, st_before, st_after) in enumerate(steps, start=1):
        assert sel.kind == "tokens"
        idx, cnt = np.asarray(sel.indices), np.asarray(sel.counts)
        q_hat = qs[0] if t == 1 else predict_next_query(st_before["hist"], st_before["count"], window, m.ridge)
        want = _oracle_choice(q_hat, k, lengths - 1, budget - 1)
        for b in range(2):
            for h in range(2):
                got = idx[b, h, :cnt[b, h]].tolist()
                assert cnt[b, h] == budget and len(set(got)) == budget
                assert got[-1] == int(lengths[b]) - 1  # the new token, added this step
                assert set(got[:-1]) == want[b][h]


def test_token_selector_is_exact_when_the_budget_covers_the_context():
    from sparse_jax.ops.dense import dense_decode_reference

    m = AsyncSpade(selector="oracle_topk", budget=200, window=4)
    steps, qs = _decode_steps(m, 3)
    rng = np.random.default_rng(0)
    k = jnp.asarray(rng.normal(size=(2, 2, 256, 16)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(2, 2, 256, 16)), jnp.float32)
    for q, lengths, sel, st_before, _ in steps:
        np.testing.assert_array_equal(np.asarray(sel.counts), np.repeat(np.asarray(lengths)[:, None], 2, 1))
        out, _, _ = m.decode(q, ResidentKV(k, v), lengths, st_before, None, single_layer(2, capacity=256))
        np.testing.assert_allclose(np.asarray(out), np.asarray(dense_decode_reference(q, k, v, lengths)),
                                   rtol=1e-5, atol=1e-5)


def test_token_selector_in_a_model_and_where_it_cannot_run():
    """On a tiny model: the dense logits when the budget covers the context, shapes and finite
    logits when it selects, scanned and unrolled alike; refused offloaded and on the cache rank."""
    from tests.test_offload import _ragged_tokens

    dense = _tiny(get_method("dense"))
    tokens, lengths = _ragged_tokens(5)
    tokens, lengths = jnp.asarray(tokens), jnp.asarray(lengths)

    def run(model, unroll=None, steps=3):
        model = model if unroll is None else model.with_method(model.method, unroll=unroll)
        logits, cache = model.fns.prefill(model.params, tokens, lengths, model.init_cache(3, 128))
        out = [logits]
        for _ in range(steps):
            logits, cache = model.fns.decode_step(model.params, jnp.argmax(out[-1], -1).astype(jnp.int32), cache)
            out.append(logits)
        return np.stack([np.asarray(x) for x in out])

    want = run(dense)
    whole = _tiny(get_method("asyncspade", selector="oracle_topk", budget=128, window=4, dense_layers=(0,)))
    np.testing.assert_allclose(run(whole), want, rtol=1e-4, atol=1e-4)
    small = _tiny(get_method("asyncspade", selector="oracle_topk", budget=16, window=4, dense_layers=(0,),
                             dense_steps=0))  # selecting from the first step
    a, b = run(small, unroll=False), run(small, unroll=True)
    assert a.shape == want.shape and np.isfinite(a).all()
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    assert np.abs(a[1:] - want[1:]).max() > 1e-4  # it does select
    # its first step chooses from the prompt's last query: a warm-up of one step, then the steady program
    _check_steady_program(small, tokens, lengths, 1)
    from models.runtime.cache_rank import check_selector
    from sparse_jax.offload.pool import check_offloadable

    with pytest.raises(ValueError, match="reads every key"):
        check_offloadable(small.method)
    with pytest.raises(ValueError, match="reads every key"):
        check_selector(small.method, small.config, 128, jnp.float32)


def test_model_defaults_fill_only_the_unset_options(tmp_path):
    """``selector`` and ``dense_layers`` left unset take the model's shipped
    ``asyncspade.json``; options given are kept; a model without the file keeps Quest
    and (0, 1); the layer plan of a bound model follows the shipped dense layers."""
    import json

    from models.api import bind_method
    from models.config import get_config
    from models.driver import make_plan

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "asyncspade.json").write_text(json.dumps({"selector": "double_sparsity", "dense_layers": [0, 5]}))
    root = str(tmp_path)
    m = get_method("asyncspade", calibration_root=root)
    assert (m.selector_name, m.exact_layers) == ("quest", (0, 1))  # unbound: the fallback
    d = m.with_model_defaults("m")
    assert (d.selector, d.dense_layers) == ("double_sparsity", (0, 5))
    assert not d.is_sparse_layer(5, 8) and d.is_sparse_layer(1, 8)
    assert m.with_model_defaults("other") is m
    kept = get_method("asyncspade", calibration_root=root, selector="quest", dense_layers=(0,)).with_model_defaults("m")
    assert (kept.selector, kept.dense_layers) == ("quest", (0,))
    opts = get_method("asyncspade", calibration_root=root, selector_options=(("block_size", 8),))
    assert opts.with_model_defaults("m").selector is None  # quest's options keep quest
    # SmolLM2 ships AsyncTLS's selector with layer 7 dense (issue 51's harness)
    cfg = get_config("smollm2-135m")
    bound = bind_method(get_method("asyncspade", budget=256), cfg, 1024)
    assert bound.inner().name == "asynctls" and bound.dense_layers == (0, 1, 7)
    sparse = [i for i, s in enumerate(make_plan(cfg, bound).specs) if s.sparse]
    assert sparse == [i for i in range(cfg.num_layers) if i not in (0, 1, 7)]
