"""Parity with Hugging Face transformers on the same GGUF (fixture
``tests/fixtures/smollm2_parity.npz``, made by scripts/make_hf_fixture.py; see
tests/fixtures/README.md): float32 logits within 2e-3 and identical greedy tokens."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from models import gguf_loader

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "smollm2_parity.npz")
ATOL = 2e-3


@pytest.fixture(scope="module")
def ref():
    if not os.path.exists(FIXTURE):
        pytest.skip(f"missing fixture {FIXTURE} (python scripts/make_hf_fixture.py)")
    return dict(np.load(FIXTURE, allow_pickle=False))


@pytest.fixture(scope="module")
def model():
    try:
        gguf_loader.smollm2_gguf_path()
    except gguf_loader.WeightsNotFoundError as e:
        pytest.skip(str(e))
    return models.load_model("smollm2-135m", dtype=jnp.float32, max_len=256)


def test_prompt_logits_match_hf(model, ref):
    ids = ref["prompt_ids"].astype(np.int32)
    logits = np.asarray(model.forward(ids[None]))[0]  # [64, V]
    np.testing.assert_allclose(logits[:, ref["vocab_cols"]], ref["logits_rows"], rtol=0, atol=ATOL)
    np.testing.assert_allclose(np.asarray(jax.nn.logsumexp(logits, -1)), ref["logsumexp"], rtol=0, atol=ATOL)
    np.testing.assert_array_equal(logits.argmax(-1), ref["argmax"])


def test_prefill_last_logits_match_hf(model, ref):
    ids = ref["prompt_ids"].astype(np.int32)
    cache = model.init_cache(1, 256)  # the size generate_ids picks below: one compilation
    last, _ = model.prefill(ids[None], np.array([len(ids)], np.int32), cache)
    np.testing.assert_allclose(np.asarray(last)[0], ref["last_logits"], rtol=0, atol=ATOL)


def test_greedy_tokens_match_hf(model, ref):
    ids = ref["prompt_ids"].astype(np.int32)
    want = ref["greedy_ids"].tolist()
    got = model.generate_ids(ids[None], [len(ids)], max_new_tokens=len(want), stop_ids=[])[0]
    assert got == want
    assert model.tokenizer.decode(got) == str(ref["greedy_text"])


def test_generate_chat_stream(model):
    """Text generation through the chat template (greedy), streamed piece by piece."""
    pieces = []
    out = model.generate("What is the capital of France?", max_new_tokens=12, chat=True, stream=pieces.append)
    assert out and "".join(pieces) == out
    assert "Paris" in out
    with pytest.raises(ValueError, match="exceeds the maximum context of 256"):
        model.generate("hello " * 300, max_new_tokens=4)
