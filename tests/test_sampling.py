"""The one sampler (:mod:`models.sampling`) against NumPy references of the same formulas,
and the engine applying every option per row: penalties, top-k / min-p, logit bias,
min_tokens and log-probabilities (tiny random model, CPU)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.sampling import (Filters, Penalties, RowSampling, adjust_logits, filter_sorted, logprob_width, sample,
                             sample_program, sample_rows, sample_step)
from models.serving.engine import Engine
from models.serving.requests import SamplingParams

V = 50


def _np_adjust(z, counts, prompt, presence, frequency, repetition, bias, min_tokens, counters, stop_ids):
    """The reference: vLLM's order (bias, min_tokens ban, repetition, frequency/presence), in f64."""
    z = z.astype(np.float64).copy()
    for b in range(z.shape[0]):
        for t, v in bias[b]:
            z[b, t] += v
        if counters[b] < min_tokens[b]:
            z[b, stop_ids] = -np.inf
        seen = prompt[b] | (counts[b] > 0)
        r = repetition[b]
        z[b] = np.where(seen, np.where(z[b] > 0, z[b] / r, z[b] * r), z[b])
        z[b] -= frequency[b] * counts[b] + presence[b] * (counts[b] > 0)
    return z


def _np_filtered(z, temperature, top_p, top_k, min_p):
    """The reference distribution over the vocabulary after temperature, min-p, top-k, top-p."""
    out = np.zeros_like(z, dtype=np.float64)
    for b in range(z.shape[0]):
        x = z[b].astype(np.float64) / temperature[b]
        p = np.exp(x - x.max())
        p /= p.sum()
        order = np.argsort(-x, kind="stable")
        keep = np.ones(len(x), bool)
        keep &= p >= min_p[b] * p.max()
        if top_k[b] > 0:
            ranks = np.empty(len(x), int)
            ranks[order] = np.arange(len(x))
            keep &= ranks < top_k[b]
        q = np.where(keep, p, 0.0)
        q /= q.sum()
        mass, nucleus = 0.0, np.zeros(len(x), bool)
        for t in order:
            if not keep[t]:
                continue
            if mass < top_p[b]:
                nucleus[t] = True
            mass += q[t]
        q = np.where(nucleus, q, 0.0)
        out[b] = q / q.sum()
    return out


def _rows(rng, b=4):
    return dict(presence=rng.uniform(-2, 2, b).astype(np.float32), frequency=rng.uniform(-2, 2, b).astype(np.float32),
                repetition=rng.uniform(0.5, 2, b).astype(np.float32),
                counts=rng.integers(0, 3, (b, V)).astype(np.int32) * (rng.random((b, V)) < 0.2),
                prompt=rng.random((b, V)) < 0.2)


def test_adjust_logits_matches_numpy():
    rng = np.random.default_rng(0)
    z = rng.normal(0, 3, (4, V)).astype(np.float32)
    r = _rows(rng)
    bias = [[(3, 5.0), (7, -100.0)], [], [(0, 1.5)], [(49, 100.0), (1, -2.0), (2, 0.25)]]
    width = 4
    ids = np.zeros((4, width), np.int32)
    vals = np.zeros((4, width), np.float32)
    for b, pairs in enumerate(bias):
        for j, (t, v) in enumerate(pairs):
            ids[b, j], vals[b, j] = t, v
    counters = np.asarray([0, 3, 5, 1], np.int32)
    min_tokens = np.asarray([2, 3, 9, 0], np.int32)
    stop_ids = np.asarray([4, 11], np.int32)
    s = RowSampling(jnp.zeros(4, jnp.uint32), jnp.asarray(counters), jnp.zeros(4), jnp.ones(4),
                    penalties=Penalties(*(jnp.asarray(r[k]) for k in ("presence", "frequency", "repetition", "counts",
                                                                       "prompt"))),
                    bias_ids=jnp.asarray(ids), bias_values=jnp.asarray(vals), min_tokens=jnp.asarray(min_tokens),
                    stop_ids=jnp.asarray(stop_ids))
    got = np.asarray(adjust_logits(jnp.asarray(z), s))
    want = _np_adjust(z, r["counts"], r["prompt"], r["presence"], r["frequency"], r["repetition"], bias, min_tokens,
                      counters, stop_ids)
    assert np.array_equal(np.isinf(got), np.isinf(want))
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[fin], want[fin], rtol=1e-6, atol=1e-5)
    assert np.isinf(got[0, [4, 11]]).all() and np.isinf(got[2, [4, 11]]).all()  # rows before their min_tokens
    assert np.isfinite(got[1, [4, 11]]).all() and np.isfinite(got[3, [4, 11]]).all()
    # nothing present: the logits as they are
    plain = RowSampling(jnp.zeros(4, jnp.uint32), jnp.asarray(counters), jnp.zeros(4), jnp.ones(4))
    np.testing.assert_array_equal(np.asarray(adjust_logits(jnp.asarray(z), plain)), z)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_filters_match_numpy(seed):
    """min-p, top-k and top-p leave the reference's distribution (set and probabilities)."""
    rng = np.random.default_rng(seed)
    z = rng.normal(0, 2, (5, V)).astype(np.float32)
    temperature = np.asarray([0.7, 1.0, 1.3, 0.5, 2.0], np.float32)
    top_p = np.asarray([1.0, 0.9, 0.5, 0.95, 1.0], np.float32)
    top_k = np.asarray([0, 5, 0, 12, 1], np.int32)
    min_p = np.asarray([0.0, 0.0, 0.1, 0.05, 0.0], np.float32)
    zt = jnp.asarray(z) / jnp.asarray(temperature)[:, None]
    order, zs = filter_sorted(zt, jnp.asarray(top_p)[:, None], jnp.asarray(top_k)[:, None],
                              jnp.asarray(min_p)[:, None])
    probs = np.zeros((5, V))
    kept = np.asarray(jax.nn.softmax(zs, axis=-1))
    np.put_along_axis(probs, np.asarray(order), kept, axis=-1)
    np.testing.assert_allclose(probs, _np_filtered(z, temperature, top_p, top_k, min_p), atol=1e-6)
    assert (probs[4] > 0).sum() == 1  # top_k 1: the top token alone


def test_sample_draws_only_from_the_filtered_set_and_is_per_row():
    rng = np.random.default_rng(3)
    z = jnp.asarray(rng.normal(0, 2, (3, V)).astype(np.float32))
    top3 = set(np.argsort(-np.asarray(z[1]))[:3].tolist())
    seen = set()
    for c in range(40):
        s = RowSampling(jnp.asarray([1, 2, 3], jnp.uint32), jnp.full((3,), c, jnp.int32),
                        jnp.asarray([0.0, 1.5, 1.0]), jnp.ones(3),
                        filters=Filters(jnp.asarray([0, 3, 0], jnp.int32), jnp.asarray([0.0, 0.0, 1.0])))
        t = np.asarray(sample_program(z, s).tokens)
        assert t[0] == int(jnp.argmax(z[0]))  # greedy row
        assert t[2] == int(jnp.argmax(z[2]))  # min_p 1: only the top token
        seen.add(int(t[1]))
    assert seen <= top3 and len(seen) > 1
    # the plain path is the old sampler's
    base = RowSampling(jnp.asarray([5, 6, 7], jnp.uint32), jnp.asarray([2, 2, 2]), jnp.asarray([0.0, 0.8, 1.2]),
                       jnp.asarray([1.0, 0.9, 1.0]))
    np.testing.assert_array_equal(np.asarray(sample(z, base).tokens),
                                  np.asarray(sample_rows(z, base.seeds, base.counters, base.temperature, base.top_p)))


def test_static_sampled_flag_gives_the_device_decision():
    """``RowSampling.sampled`` known on the host (the engine's) draws what the on-device
    ``lax.cond`` draws: True for a batch with a sampling row, False for an all-greedy one."""
    rng = np.random.default_rng(5)
    z = jnp.asarray(rng.normal(0, 2, (3, V)).astype(np.float32))
    for temps, flag in (([0.0, 0.9, 1.3], True), ([0.0, 0.0, 0.0], False)):
        for c in range(5):
            s = RowSampling(jnp.asarray([4, 5, 6], jnp.uint32), jnp.full((3,), c, jnp.int32), jnp.asarray(temps),
                            jnp.asarray([1.0, 0.8, 1.0]))
            want = np.asarray(sample_program(z, s).tokens)
            got = np.asarray(sample_program(z, dataclasses.replace(s, sampled=flag)).tokens)
            np.testing.assert_array_equal(got, want)
    # the engine's builder says it from its host copy: greedy unless an active row samples
    from models.serving.slot_sampling import SlotSampling
    ss = SlotSampling(3, V, (1,))
    ss.temperature[:] = [0.0, 0.7, 0.0]
    assert ss.build(np.zeros(3), np.asarray([True, True, False])).sampled is True
    assert ss.build(np.zeros(3), np.asarray([True, False, True])).sampled is False


def test_logprobs_are_the_raw_distributions():
    rng = np.random.default_rng(4)
    z = jnp.asarray(rng.normal(0, 2, (2, V)).astype(np.float32))
    bias_ids = jnp.asarray([[int(jnp.argmax(z[0]))], [0]], jnp.int32)
    s = RowSampling(jnp.zeros(2, jnp.uint32), jnp.zeros(2, jnp.int32), jnp.zeros(2), jnp.ones(2),
                    bias_ids=bias_ids, bias_values=jnp.asarray([[-100.0], [0.0]]), top_logprobs=logprob_width(3))
    out = sample(z, s)
    lp = np.asarray(jax.nn.log_softmax(z, axis=-1))
    tok = np.asarray(out.tokens)
    assert tok[0] != int(jnp.argmax(z[0]))  # -100 bans the top token
    np.testing.assert_allclose(np.asarray(out.logprob), lp[np.arange(2), tok], atol=1e-6)
    assert out.top_ids.shape == (2, 5)
    np.testing.assert_array_equal(np.asarray(out.top_ids)[:, :3], np.argsort(-lp, axis=-1)[:, :3])
    assert logprob_width(-1) == -1 and logprob_width(0) == 0 and logprob_width(2) == 5 and logprob_width(20) == 20


def test_sample_step_counts_the_fed_tokens():
    z = jnp.zeros((2, V))
    pen = Penalties(jnp.zeros(2), jnp.asarray([0.0, 1.0]), jnp.ones(2), jnp.zeros((2, V), jnp.int32),
                    jnp.zeros((2, V), bool))
    s = RowSampling(jnp.zeros(2, jnp.uint32), jnp.zeros(2, jnp.int32), jnp.zeros(2), jnp.ones(2), penalties=pen)
    out = sample_step(z, jnp.asarray([7, 0]), jnp.asarray([True, False]), s)
    c = np.asarray(out.counts)
    assert c[0, 7] == 1 and c.sum() == 1  # the inactive row's token is not counted
    out = sample_step(z, jnp.asarray([7, 9]), jnp.asarray([True, True]), dataclasses.replace(s, penalties=dataclasses.replace(pen, counts=out.counts)))
    assert np.asarray(out.counts)[0, 7] == 2 and np.asarray(out.tokens)[1] != 9  # frequency-penalised away


# -- the engine: every option, per row -------------------------------------------------


def _tiny_model():
    import models
    from models.config import ModelConfig

    cfg = ModelConfig(name="tiny-sampling", arch="llama", num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2,
                      head_dim=8, intermediate_size=64, vocab_size=V, max_position=256, rope_theta=1e4, rms_eps=1e-6,
                      tie_embeddings=True, eos_token_id=3)
    return models.load_model(config=cfg, dtype=jnp.float32)


@pytest.fixture(scope="module")
def tiny():
    return _tiny_model()


def _reference(model, prompt, params: SamplingParams, stop_ids, n):
    """Greedy decoding by whole forwards and the NumPy formulas: the tokens and each one's
    log-softmax under the model, what the engine must give."""
    ids, out, lps = list(prompt), [], []
    bias = [list(params.logit_bias)]
    for i in range(n):
        # one padded length (the forward is causal): one compilation for every step
        padded = np.zeros((1, 64), np.int32)
        padded[0, :len(ids)] = ids
        logits = np.asarray(model.forward(jnp.asarray(padded)))[0, len(ids) - 1:len(ids)]
        counts = np.bincount(np.asarray(out, int), minlength=V)[None].astype(np.int32)
        seen = np.zeros((1, V), bool)
        seen[0, prompt] = True
        z = _np_adjust(logits, counts, seen, [params.presence_penalty], [params.frequency_penalty],
                       [params.repetition_penalty], bias, [params.min_tokens], [i], list(stop_ids))
        t = int(np.argmax(z[0]))
        lp = logits[0].astype(np.float64) - np.log(np.exp(logits[0].astype(np.float64)).sum())
        if t in stop_ids:
            break
        out.append(t)
        lps.append(lp)
        ids.append(t)
    return out, lps


def _serve_all(engine: Engine, prompts, params) -> list:
    """Each prompt with its parameters through ``engine`` (started here, stopped after), all
    submitted at once; the finished requests."""
    engine.start()
    try:
        reqs = [engine.submit(engine.make_request(p, o)) for p, o in zip(prompts, params)]
        for r in reqs:
            assert r.done.wait(120), r
    finally:
        engine.stop()
    return reqs


@pytest.mark.parametrize("paged", [False, True])
def test_engine_applies_penalties_bias_and_min_tokens_per_row(tiny, paged):
    """Three requests decoding together, each with its own options, get the tokens of the
    reference alone; a neighbour without options is untouched; the logprobs are the model's."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(4, V, n).tolist() for n in (12, 30, 7)]
    opts = [SamplingParams(max_tokens=14, repetition_penalty=1.8, frequency_penalty=0.7, presence_penalty=0.4,
                           logprobs=3),
            SamplingParams(max_tokens=14, logit_bias=((3, 100.0), (10, -100.0)), min_tokens=5),
            SamplingParams(max_tokens=14, logprobs=0)]
    stop_ids = (3,)
    reqs = _serve_all(Engine(tiny, slots=3, max_len=64, stop_ids=stop_ids, paged=paged), prompts, opts)
    for p, o, r in zip(prompts, opts, reqs):
        want, lps = _reference(tiny, p, o, stop_ids, o.max_tokens)
        assert r.output_ids == want, (o, r.output_ids, want)
        if o.logprobs is not None:
            assert [t.token_id for t in r.logprobs] == want
            np.testing.assert_allclose([t.logprob for t in r.logprobs], [lp[t] for lp, t in zip(lps, want)],
                                       atol=1e-4)
            for t, lp in zip(r.logprobs, lps):
                assert len(t.top) == o.logprobs
                assert [i for i, _ in t.top] == np.argsort(-lp)[:o.logprobs].tolist()
        else:
            assert r.logprobs == []
    # the biased request: EOS (+100) held back for exactly min_tokens tokens, then it stops
    assert len(reqs[1].output_ids) == 5 and reqs[1].finish_reason == "stop" and 10 not in reqs[1].output_ids


def test_penalised_requests_inserted_while_others_decode(tiny):
    """More penalised, logprob-asking requests than slots: each insertion (which rewrites the
    penalties' rows) lands while a step is in flight, and each request still gets the
    reference's tokens alone."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(4, V, n).tolist() for n in (9, 21, 14, 5)]
    params = [SamplingParams(max_tokens=k, frequency_penalty=1.0, repetition_penalty=1.3, logprobs=2)
              for k in (6, 11, 8, 9)]
    reqs = _serve_all(Engine(tiny, slots=2, max_len=64, stop_ids=(), paged=True), prompts, params)
    for p, o, r in zip(prompts, params, reqs):
        assert r.finish_reason == "length", r.error
        assert r.output_ids == _reference(tiny, p, o, (), o.max_tokens)[0]


def test_engine_top_k_one_is_greedy(tiny):
    """top_k 1 at temperature 1 leaves only the top token: the greedy tokens."""
    prompt = list(range(5, 25))
    engine = Engine(tiny, slots=2, max_len=64, stop_ids=()).start()
    try:
        greedy = engine.generate(prompt, SamplingParams(max_tokens=10)).output_ids
        topk = engine.generate(prompt, SamplingParams(max_tokens=10, temperature=1.0, top_k=1, seed=3)).output_ids
        free = engine.generate(prompt, SamplingParams(max_tokens=10, temperature=1.0, seed=3)).output_ids
    finally:
        engine.stop()
    assert topk == greedy and free != greedy


@pytest.mark.parametrize("bad, fragment", [(dict(top_k=-1), "top_k"), (dict(min_p=1.5), "min_p"),
                                           (dict(presence_penalty=3.0), "presence_penalty"),
                                           (dict(repetition_penalty=0.0), "repetition_penalty"),
                                           (dict(min_tokens=20), "min_tokens"),
                                           (dict(logit_bias=((1, 200.0),)), "logit_bias values"),
                                           (dict(logprobs=21), "logprobs")])
def test_bad_sampling_options_are_refused(bad, fragment):
    with pytest.raises(ValueError, match=fragment):
        SamplingParams(max_tokens=8, **bad).check()


@pytest.mark.parametrize("paged", [False, True])
def test_engine_scores_prompts(tiny, paged):
    """prompt_logprobs: each prompt token's log-probability given those before it (the first
    None) equals the f32 log-softmax of ``forward``; with max_tokens 0 nothing is generated,
    and a scored request that generates gets the tokens it gets without scoring."""
    rng = np.random.default_rng(5)
    prompt = rng.integers(4, V, 70).tolist()  # over one 64-token chunk of the LM head
    logits = np.asarray(tiny.forward(jnp.asarray([prompt], jnp.int32)))[0].astype(np.float64)
    lp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    engine = Engine(tiny, slots=2, max_len=128, stop_ids=(), paged=paged).start()
    try:
        only = engine.generate(prompt, SamplingParams(max_tokens=0, prompt_logprobs=2))
        both = engine.generate(prompt, SamplingParams(max_tokens=6, prompt_logprobs=0, logprobs=1))
        plain = engine.generate(prompt, SamplingParams(max_tokens=6))
    finally:
        engine.stop()
    assert only.finish_reason == "length" and only.output_ids == [] and only.prompt_logprobs[0] is None
    got = [t.logprob for t in only.prompt_logprobs[1:]]
    np.testing.assert_allclose(got, [lp[i - 1, prompt[i]] for i in range(1, len(prompt))], atol=1e-4)
    assert [t.token_id for t in only.prompt_logprobs[1:]] == prompt[1:]
    for i, t in enumerate(only.prompt_logprobs[1:], start=1):
        assert [j for j, _ in t.top] == np.argsort(-lp[i - 1])[:2].tolist()
    assert both.output_ids == plain.output_ids and len(both.prompt_logprobs) == len(prompt)
    assert all(t.top == () for t in both.prompt_logprobs[1:])
    # the first generated token's logprob is the forward's at the prompt's last position
    np.testing.assert_allclose(both.logprobs[0].logprob, lp[-1, both.output_ids[0]], atol=1e-4)


@pytest.mark.parametrize("paged", [False, True])
def test_n_choices_share_one_prefill(tiny, paged):
    """A prompt's choices (one ``prefill_group``) admitted together are prefilled once and
    inserted into each slot; each samples with its own seed and gets what it gets alone."""
    prompt = list(range(6, 40))
    params = [SamplingParams(max_tokens=10, temperature=1.0, seed=s) for s in (1, 2, 3)]
    # 4 slots: the paged pool (a page per slot) keeps one page of headroom beside the running
    engine = Engine(tiny, slots=4, max_len=64, stop_ids=(), paged=paged).start()
    try:
        alone = [engine.generate(prompt, p).output_ids for p in params]
        before = engine.stats()
        reqs = engine.submit_all([engine.make_request(prompt, p, prefill_group="g") for p in params])
        for r in reqs:
            assert r.done.wait(120)
        after = engine.stats()
    finally:
        engine.stop()
    assert [r.output_ids for r in reqs] == alone and len({tuple(a) for a in alone}) > 1
    assert after["prefills"] - before["prefills"] == 1 and after["prefills_shared"] - before["prefills_shared"] == 2
