"""The accuracy harness: RULER-style task generators, the fidelity probe, and an
end-to-end run on a tiny random-weights model (SmolLM2's tokenizer)."""

import dataclasses
import json

import jax

from sparse_jax.layers import LayerSpec
from sparse_jax.methods.base import single_layer
from sparse_jax.selection import Selection
import jax.numpy as jnp
import numpy as np

from sparse_jax.kv import ResidentKV
import pytest

from benchmarks import accuracy as acc
from benchmarks import fidelity as fid
from benchmarks import ruler_tasks as rt
from sparse_jax.methods import AttentionMethod, DenseAttention
from sparse_jax.ops.dense import masked_decode_attention


@pytest.fixture(scope="module")
def tokenizer():
    from models import gguf_loader

    try:
        path = gguf_loader.smollm2_gguf_path()
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"SmolLM2 GGUF (tokenizer) not installed: {e}")
    return gguf_loader.read_gguf(path, tensors=False).tokenizer


# -----------------------------------------------------------------------------
# Tasks
# -----------------------------------------------------------------------------


@pytest.mark.parametrize("target", [512, 2048])
def test_tasks_hit_target_length_and_are_deterministic(tokenizer, target):
    for task in rt.TASKS:
        s = rt.generate_sample(task, target, 0, tokenizer)
        again = rt.generate_sample(task, target, 0, tokenizer)
        assert s == again, task
        assert s.input_ids == tuple(tokenizer.encode(s.prompt))
        assert s.max_new_tokens <= rt.ANSWER_ROOM
        budget = target - rt.ANSWER_ROOM
        # within one filler unit of the budget (cwe: 3 list entries), never over
        assert budget - 40 <= s.num_tokens <= budget, (task, s.num_tokens, budget)
        for a in s.answers:
            assert a in s.prompt, (task, a)
        other = rt.generate_sample(task, target, 1, tokenizer)
        assert other.answers != s.answers, task
    # the seed changes the samples
    assert rt.generate_sample("niah_single_1", target, 0, tokenizer, seed=1).answers != \
        rt.generate_sample("niah_single_1", target, 0, tokenizer).answers


def test_chosen_indices_are_those_samples(tokenizer):
    """``indices`` (``--indices``): the same prompts as those positions of a full run."""
    full = rt.generate_samples(["passkey", "vt"], 512, 3, tokenizer)
    some = rt.generate_samples(["passkey", "vt"], 512, 0, tokenizer, indices=[2, 0])
    assert some == [full[2], full[0], full[5], full[3]]


def test_task_structure(tokenizer):
    mk = rt.generate_sample("niah_multikey", 1024, 3, tokenizer)
    assert len(mk.answers) == 1 and mk.prompt.count("One of the special magic numbers for") == 4
    mv = rt.generate_sample("niah_multivalue", 1024, 3, tokenizer)
    assert len(mv.answers) == 4 and len(set(mv.answers)) == 4
    mq = rt.generate_sample("niah_multiquery", 1024, 3, tokenizer)
    assert len(mq.answers) == 4
    vt = rt.generate_sample("vt", 1024, 3, tokenizer)
    assert len(vt.answers) == 5 and all(f"VAR {n} =" in vt.prompt for n in vt.answers)
    cwe = rt.generate_sample("cwe", 2048, 3, tokenizer)
    body = cwe.prompt.split("Question:")[0]
    counts = {w: len([l for l in body.splitlines() if l.endswith(f". {w}")]) for w in cwe.answers}
    assert len(counts) == 10 and min(counts.values()) == 16  # 2048 // 128 repeats
    s2 = rt.generate_sample("niah_single_2", 1024, 0, tokenizer)
    assert "The grass is green." not in s2.prompt  # real text, not noise
    assert s2.prompt.endswith("mentioned in the provided text is")
    assert "<|im_start|>assistant\n" in s2.prompt  # chat template applied


def test_scorer():
    assert rt.score("The number is 1234567.", ["1234567"]) == 1.0
    assert rt.score("The number is 7654321.", ["1234567"]) == 0.0
    assert rt.score("", ["1234567"]) == 0.0
    assert rt.score("1, 2 and three", ["1", "2", "three", "four"]) == 0.75
    assert rt.score("ABCDE and fghij", ["abcde", "FGHIJ"]) == 1.0  # case-insensitive
    with pytest.raises(ValueError):
        rt.score("x", [])


def test_stdlib_text_is_deterministic():
    assert rt.stdlib_modules() == tuple(sorted(rt.stdlib_modules()))
    a = rt.stdlib_prose_sentences()
    rt.stdlib_prose_sentences.cache_clear()
    assert rt.stdlib_prose_sentences() == a and len(a) > 500
    assert rt.stdlib_source_text(min_chars=1000).startswith("# file: ")


def test_bad_task_arguments(tokenizer):
    with pytest.raises(ValueError, match="unknown task"):
        rt.generate_sample("niah_nope", 1024, 0, tokenizer)
    with pytest.raises(ValueError, match="over its budget"):
        rt.generate_sample("niah_single_1", 128, 0, tokenizer)


# -----------------------------------------------------------------------------
# Fidelity probe (no model)
# -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _PerHeadTopK(AttentionMethod):
    """Test-only selector: top-``budget`` keys by each KV head's own summed logits."""

    budget: int = 8

    def select(self, q, kv, lengths, state, carry, layer):
        b, hq, d = q.shape
        hkv, s = kv.num_kv_heads, kv.capacity
        p = fid.dense_probabilities(q, kv.k, lengths).sum(axis=2)  # [B, Hkv, S]
        kk = min(self.budget, s)
        _, idx = jax.lax.top_k(p, kk)
        counts = jnp.broadcast_to(jnp.minimum(lengths, kk)[:, None], (b, hkv)).astype(jnp.int32)
        return Selection.tokens(idx.astype(jnp.int32), counts), state, carry

    def decode(self, q, kv, lengths, state, carry, layer):
        sel, state, carry = self.select(q, kv, lengths, state, carry, layer)
        mask = fid.selection_mask(sel.indices, sel.counts, lengths, kv.capacity)
        return masked_decode_attention(q, kv.k, kv.v, mask), state, carry


def _qkv(b, hq, hkv, s, d, seed=0):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (b, hq, d), jnp.float32) * 2
    k = jax.random.normal(kk, (b, hkv, s, d), jnp.float32)
    v = jax.random.normal(kv, (b, hkv, s, d), jnp.float32)
    return q, k, v


def _probe_step(inner, q, k, v, lengths):
    b, hq, d = q.shape
    probe = fid.FidelityProbe(inner=inner, num_q_heads=hq)
    spec = LayerSpec(sparse=True)
    state = probe.init_state(spec, batch=b, num_kv_heads=k.shape[1], max_len=k.shape[2], head_dim=d, dtype=q.dtype)
    out, state, _ = jax.jit(lambda q, k, v, lengths, state: probe.decode(
        q, ResidentKV(k, v), lengths, state, None, single_layer(0, spec)))(q, k, v, lengths, state)
    valid = jnp.arange(k.shape[2])[None, :] < lengths[:, None]
    np.testing.assert_array_equal(out, masked_decode_attention(q, k, v, valid[:, None, :]))  # returns dense
    return np.asarray(state["rel_err"]), np.asarray(state["mass"])


def test_probe_dense_and_full_budget_are_exact():
    q, k, v = _qkv(2, 8, 2, 45, 16)
    lengths = jnp.array([45, 30], jnp.int32)
    rel, mass = _probe_step(DenseAttention(), q, k, v, lengths)
    assert rel.shape == (2, 8) and np.all(rel < 1e-6) and np.all(mass == 1)  # f32 rounding only
    rel, mass = _probe_step(_PerHeadTopK(budget=64), q, k, v, lengths)  # budget > context
    assert np.all(rel < 1e-5) and np.allclose(mass, 1, atol=1e-5)


def test_probe_small_budget():
    # MHA: per-head top-K is the oracle top-K -> mass ratio 1, but the output is not exact
    q, k, v = _qkv(2, 4, 4, 60, 16, seed=1)
    lengths = jnp.array([60, 41], jnp.int32)
    rel, mass = _probe_step(_PerHeadTopK(budget=8), q, k, v, lengths)
    np.testing.assert_allclose(mass, 1, atol=1e-5)
    assert np.all(rel > 1e-3)
    # GQA: a group-wide choice recovers less than each head's own top-K, but more than a window
    q, k, v = _qkv(2, 8, 2, 60, 16, seed=2)
    rel, mass = _probe_step(_PerHeadTopK(budget=8), q, k, v, lengths)
    assert np.all(mass <= 1 + 1e-6) and np.all(mass > 0.3)


def test_selection_mass_ratio_matches_numpy():
    b, hq, hkv, s, d = 2, 6, 2, 33, 8
    q, k, _ = _qkv(b, hq, hkv, s, d, seed=3)
    lengths = jnp.array([33, 20], jnp.int32)
    rng = np.random.default_rng(0)
    idx = rng.integers(0, s, (b, hkv, 10)).astype(np.int32)  # duplicates and positions past length
    counts = np.array([[10, 7], [4, 10]], np.int32)
    got = np.asarray(fid.selection_mass_ratio(q, k, lengths, jnp.asarray(idx), jnp.asarray(counts)))
    qn, kn = np.asarray(q, np.float64), np.asarray(k, np.float64)
    for bi in range(b):
        n = int(lengths[bi])
        for h in range(hq):
            kh = h // (hq // hkv)
            logit = kn[bi, kh, :n] @ qn[bi, h] / np.sqrt(d)
            p = np.exp(logit - logit.max())
            p /= p.sum()
            sel = sorted({int(i) for i in idx[bi, kh, : counts[bi, kh]] if i < n})
            want = p[sel].sum() / np.sort(p)[::-1][: len(sel)].sum()
            np.testing.assert_allclose(got[bi, h], want, rtol=1e-4)


# -----------------------------------------------------------------------------
# End to end on a tiny random-weights model
# -----------------------------------------------------------------------------


def test_harness_end_to_end(tokenizer, tmp_path):
    import models
    from sparse_jax import available_methods

    acc.import_methods()
    cfg = models.ModelConfig(name="tiny", arch="llama", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
                             head_dim=16, intermediate_size=128, vocab_size=tokenizer.vocab_size,
                             max_position=1024, rope_theta=1e4, tie_embeddings=True, eos_token_id=2, pad_token_id=2)
    model = models.load_model(config=cfg, dtype=jnp.float32, max_len=384)
    sparse = "oracle_topk" if "oracle_topk" in available_methods() else None
    # kascade: its dense first anchor has no selection in a scanned layer (the CPU default), so
    # the probe runs unrolled; its mass was NaN before
    # tsa: dense decode after a sparse prefill: the probe has no sparse decode layer (it crashed)
    methods = ["dense", "no_such_method", "win=streaming", "kascade", "tsa=dense"] + ([sparse] if sparse else [])
    payload = acc.run(model, tokenizer=tokenizer, methods=methods, budgets=[48, 1024], lengths=[384],
                      tasks=["niah_single_1", "vt"], samples=1, batch_size=2, fidelity=True, probe_steps=2,
                      kl_steps=4, keep_full_budget=True, progress=False, log=lambda s: None,
                      method_options={"win": {"window": 40}, "kascade": {"anchors": (0,)},
                                      "tsa": {"prefill": "token_sparse",
                                              "prefill_options": (("min_tokens", 64), ("window", 16),
                                                                  ("tau", 0.2), ("layers", (0,)))}})
    rows = {(r["method"], r["budget"]): r for r in payload["rows"]}
    dense = rows[("dense", None)]
    assert dense["status"] == "ok" and set(dense["scores"]) == {"niah_single_1", "vt"}
    assert 0.0 <= dense["average"] <= 1.0 and dense["n_samples"] == 2
    # where the time went: one batch (2 samples, batch 2) of prefill and decode steps
    tm = dense["timing"]
    assert tm["batches"] == 1 and tm["steps"] >= 1 and tm["prefill_s"] > 0 and tm["decode_s"] >= 0
    assert tm["first_batch_s"] >= tm["prefill_s"]
    assert rows[("no_such_method", None)]["status"] == "error"  # reported, the run went on
    assert len(payload["predictions"]) == 2 * (6 + (2 if sparse else 0))
    tsa = rows[("tsa", None)]
    assert tsa["status"] == "ok", tsa.get("traceback")
    assert tsa["fidelity"]["mass"] == 1.0 and tsa["fidelity"]["rel_err"] == 0.0  # decode is dense
    # layer 0's sparse prefill changed the K/V layer 1 wrote (the last layer's alone could not:
    # its cache is written before compression, and the window keeps the last token)
    assert tsa["fidelity"]["kl"] > 0
    kas = rows[("kascade", 48)]["fidelity"]  # layer 0 the dense anchor (mass 1), layer 1 reuses it
    assert kas["mass_per_layer"][0] == 1.0 and 0 < kas["mass_per_layer"][1] <= 1 + 1e-6, kas["mass_per_layer"]
    # each method's prompts against dense's: the indices it scored below or above on
    preds = {(p["method"], p["budget"], p["task"], p["index"]): p["score"] for p in payload["predictions"]}
    for (name, budget), r in rows.items():
        if name == "dense" or not r.get("scores"):
            continue
        want = {}
        for t in ("niah_single_1", "vt"):
            d, m = preds[("dense", None, t, 0)], preds[(name, budget, t, 0)]
            if m != d:
                want[t] = {"below": [0] if m < d else [], "above": [0] if m > d else []}
        assert r["against_dense"] == want, (name, budget, r["against_dense"], want)
    a = acc.against_dense([{"task": "t", "index": 3, "score": 0.0}, {"task": "t", "index": 1, "score": 1.0},
                           {"task": "u", "index": 0, "score": 0.5}], {("t", 3): 1.0, ("t", 1): 0.5, ("u", 0): 0.5})
    assert a == {"t": {"below": [3], "above": [1]}}
    # a variant runs under its alias, with its own options
    assert rows[("win", 48)]["status"] == "ok" and "window=40" in rows[("win", 48)]["config"]
    if sparse:
        full = rows[(sparse, 1024)]["fidelity"]  # budget > context: the dense fallback
        assert full["rel_err"] < 1e-4 and full["mass"] > 0.9999
        assert full["kl"] < 1e-6 and full["agreement"] == 1.0 and full["max_logp_diff"] < 1e-4
        small = rows[(sparse, 48)]["fidelity"]
        assert 0 < small["mass"] <= 1 + 1e-6 and small["rel_err"] > 1e-4
        assert np.asarray(small["rel_err_per_layer_head"]).shape == (2, 4)
        assert small["max_logp_diff"] < 1e-4  # the probe runs dense: teacher forcing
    payload["stamp"] = {"device": "cpu", "command": "test"}
    out = acc.save(payload, "acc_test", tmp_path)
    assert json.loads((out / "acc_test.json").read_text())["rows"]
    assert "| dense | - | 384 |" in (out / "acc_test.md").read_text()
    assert (out / "acc_test.png").stat().st_size > 0
    assert json.loads((out / "acc_test_predictions.json").read_text())


def test_a_method_out_of_memory_runs_at_a_smaller_batch():
    """XLA's out-of-memory at one batch: the method runs again at half the batch, then a quarter,
    and the table says at which; another error, or out of memory at batch 1, is raised."""
    calls, logs = [], []

    def fn(b):
        calls.append(b)
        if b > 2:
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 48.75GiB")
        return f"ran at {b}"

    assert acc.run_fitting(fn, 8, logs.append) == ("ran at 2", 2)
    assert calls == [8, 4, 2] and len(logs) == 2 and "again at batch 4" in logs[0]
    with pytest.raises(ValueError):
        acc.run_fitting(lambda b: (_ for _ in ()).throw(ValueError("a bug")), 8, logs.append)
    with pytest.raises(RuntimeError, match="RESOURCE_EXHAUSTED"):
        acc.run_fitting(lambda b: fn(8), 1, logs.append)
    md = acc.render_markdown({"stamp": {}, "settings": {"samples": 1, "seed": 0, "batch_size": 8, "model": "m",
                                                         "dtype": "float32", "tasks": ["vt"], "fidelity": False,
                                                         "prefill_chunk": None, "indices": None},
                              "rows": [{"method": "m", "budget": 64, "length": 128, "status": "ok", "batch_size": 2,
                                        "scores": {"vt": 1.0}, "average": 1.0}]})
    assert "ok at batch 2" in md


def test_harness_through_the_engines_chunked_prefill(tokenizer):
    """``prefill_chunk``: the samples are served by the paged engine, prompts prefilled in
    chunks (the serving path): for dense and a sparse decode method, exactly the predictions
    of the model's whole, batched prefill (chunked prefill is exact where no Token Sparse
    prefill runs)."""
    import models

    cfg = models.ModelConfig(name="tiny", arch="llama", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
                             head_dim=16, intermediate_size=128, vocab_size=tokenizer.vocab_size,
                             max_position=1024, rope_theta=1e4, tie_embeddings=True, eos_token_id=2, pad_token_id=2)
    model = models.load_model(config=cfg, dtype=jnp.float32, max_len=384)
    kw = dict(tokenizer=tokenizer, methods=["dense", "quest"], budgets=[64], lengths=[384],
              tasks=["niah_single_1", "vt"], samples=1, batch_size=2, progress=False, log=lambda s: None)
    whole, chunked = acc.run(model, **kw), acc.run(model, prefill_chunk=128, **kw)
    assert chunked["settings"]["prefill_chunk"] == 128
    assert [r["status"] for r in chunked["rows"]] == ["ok", "ok"], chunked["rows"]
    assert "engine_s" in chunked["rows"][0]["timing"]
    assert all(p["new_tokens"] > 0 for p in whole["predictions"])  # something to compare
    key = lambda p: (p["method"], p["task"], p["index"])  # noqa: E731
    assert sorted((key(p), p["prediction"]) for p in chunked["predictions"]) == \
        sorted((key(p), p["prediction"]) for p in whole["predictions"])
    assert "prompts prefilled 128 tokens per iteration" in acc.render_markdown(dict(chunked, stamp={}))


def test_cli_arguments():
    a = acc.parse_args(["--methods", "dense,quest", "--budgets", "64,128", "--lengths", "512",
                        "--set", "quest.block_size=8", "--set", "streaming.sink=2", "--fidelity"])
    assert a.methods == ["dense", "quest"] and a.budgets == [64, 128] and a.lengths == [512]
    assert a.method_options == {"quest": {"block_size": 8}, "streaming": {"sink": 2}}
    assert a.indices is None and acc.parse_args(["--indices", "5,10,20"]).indices == [5, 10, 20]
    with pytest.raises(SystemExit):
        acc.parse_args(["--tasks", "nope"])
    with pytest.raises(SystemExit):
        acc.parse_args(["--set", "budget=3"])


def test_plot_skips_rows_without_numbers(tmp_path):
    """A fidelity-only run checkpoints after its dense row, which has no numbers."""
    payload = {"settings": {"lengths": [512]}, "rows": [{"method": "dense", "budget": None, "length": 512, "status": "ok"}]}
    assert acc.plot(payload, tmp_path / "p.png") is None


def test_plot_of_one_budget_shows_the_tasks(tmp_path):
    """One budget: grouped bars per task (a line over one budget is a dot)."""
    rows = [{"method": m, "budget": b, "length": 512, "status": "ok", "scores": {"passkey": p, "vt": v},
             "average": (p + v) / 2} for m, b, p, v in (("dense", None, 1.0, 0.5), ("quest", 64, 0.75, 0.25))]
    payload = {"settings": {"lengths": [512], "model": "tiny", "samples": 4}, "rows": rows}
    path = acc.plot(payload, tmp_path / "p.png")
    assert path is not None and path.stat().st_size > 0


def test_probe_binds_the_measured_method_to_the_model():
    """A calibrated method inside the probe gets its channels (it failed before)."""
    from sparse_jax.methods import get_method

    probe = fid.FidelityProbe(inner=get_method("asynctls", block_size=32), num_q_heads=9)
    bound = probe.for_model("smollm2-135m", num_layers=30, head_dim=64)
    assert bound.inner.channels_per_layer is not None and probe.inner.channels_per_layer is None
    assert bound.cache_multiple == 32


def test_hf_crosscheck_checks_its_arguments_and_needs_torch(capsys):
    """``benchmarks.hf_crosscheck``: bad arguments exit 2 with a message; without torch
    (the project venv) it says what it needs instead of failing on an import."""
    import importlib.util

    from benchmarks.probes import hf_crosscheck

    for argv, fragment in ((["--tasks", "nope"], "unknown task"), (["--lengths", "12,x"], "comma-separated"),
                           (["--lengths", "100"], "at least 256"), (["--samples", "0"], ">= 1")):
        with pytest.raises(SystemExit) as e:
            hf_crosscheck.parse_args(argv)
        assert e.value.code == 2 and fragment in capsys.readouterr().err
    if importlib.util.find_spec("torch") is None:
        assert hf_crosscheck.main(["--lengths", "1024"]) == 2
        assert "needs torch and transformers" in capsys.readouterr().err
