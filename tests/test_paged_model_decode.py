"""Paged KV in the model's decode step: the same prefilled cache, its global layers' K/V
moved into one page pool shared by the batch (rows' pages in random order, the null page
padding nothing: every row's table is full), decodes to the same logits (1e-5) and the same
greedy tokens as the contiguous cache, for every registered method, across page boundaries
and for rows of different lengths (a small random model; f32 on CPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparse_jax.cache import PagedLayer, page_cache
from sparse_jax.methods import available_methods
from test_engine import _OPTIONS, _tiny_config

MAX_LEN, PAGE, STEPS = 256, 16, 24


@pytest.fixture(scope="module")
def tiny():
    import models

    return models.load_model(config=_tiny_config(), dtype=jnp.float32)


@pytest.mark.parametrize("name", sorted(available_methods()))
def test_paged_decode_equals_contiguous(tiny, name):
    assert name in _OPTIONS, f"add options for the new method {name!r}"
    model = tiny.with_method(name, **_OPTIONS[name])
    rng = np.random.default_rng(5)
    lens = np.array([150, 141], np.int32)  # rows cross pages at different steps
    tokens = np.full((2, 192), 0, np.int32)
    for b, n in enumerate(lens):
        tokens[b, :n] = rng.integers(4, 97, n)
    logits, cache = model.fns.prefill(model.params, jnp.asarray(tokens), jnp.asarray(lens),
                                      model.init_cache(2, MAX_LEN))
    w = MAX_LEN // PAGE
    table = rng.permutation(np.arange(1, 2 * w + 1)).reshape(2, w).astype(np.int32)
    # its own copy: decode_step donates each cache, and the paged one shares the method state's buffers
    paged = page_cache(jax.tree.map(jnp.copy, cache), table, 2 * w + 1, PAGE)
    assert sum(isinstance(e, PagedLayer) for e in paged.layers) == model.config.num_layers
    tok = jnp.argmax(logits, -1).astype(jnp.int32)
    tok_p = tok
    for step in range(STEPS):
        lg, cache = model.fns.decode_step(model.params, tok, cache)
        lg_p, paged = model.fns.decode_step(model.params, tok_p, paged)
        np.testing.assert_allclose(np.asarray(lg_p), np.asarray(lg), atol=1e-5, rtol=1e-5, err_msg=f"step {step}")
        tok, tok_p = jnp.argmax(lg, -1).astype(jnp.int32), jnp.argmax(lg_p, -1).astype(jnp.int32)
        np.testing.assert_array_equal(np.asarray(tok_p), np.asarray(tok))
    assert (np.asarray(paged.lengths) == lens + STEPS).all()
