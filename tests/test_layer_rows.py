"""The CPU's decode step over per-layer weight rows (``models.driver.LayerRows``,
``models.programs.RowsStep``): the same logits as the scanned step, the rows are
views of the stacked buffers (no copy), and the lowered and compiled step takes the
model's stacked params."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import ModelConfig
from models.driver import LayerRows, init_cache, layer_rows
from models.programs import RowsStep, build_functions
from models.transformer import init_params
from sparse_jax.methods import get_method

CFG = ModelConfig(name="tiny-rows", arch="llama", num_layers=3, hidden_size=64, num_heads=4, num_kv_heads=2,
                  head_dim=16, intermediate_size=96, vocab_size=61, max_position=128, rope_theta=1e4, rms_eps=1e-6)


def _greedy(fns, params, steps=4):
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, CFG.vocab_size, (2, 24)), jnp.int32)
    lengths = jnp.asarray([24, 17], jnp.int32)
    cache = init_cache(CFG, get_method("dense"), 2, 64, jnp.float32)
    logits, cache = fns.prefill(params, tokens, lengths, cache)
    out = [np.asarray(logits)]
    for _ in range(steps):
        logits, cache = fns.decode_step(params, jnp.argmax(logits, -1).astype(jnp.int32), cache)
        out.append(np.asarray(logits))
    return np.stack(out)


def test_rows_step_is_the_cpu_default_and_equals_the_scanned_step():
    graphdef, params = init_params(CFG, jnp.float32, seed=1)
    rows = build_functions(graphdef, CFG, get_method("dense"))
    assert isinstance(rows.decode_step, RowsStep)  # CPU default
    scanned = build_functions(graphdef, CFG, get_method("dense"), unroll=False)
    assert not isinstance(scanned.decode_step, RowsStep)  # an explicit unroll= keeps today's program
    np.testing.assert_allclose(_greedy(rows, params), _greedy(scanned, params), atol=2e-6, rtol=0)


def test_rows_are_views_of_the_stacked_buffer():
    a = jnp.asarray(np.random.default_rng(0).standard_normal((3, 64, 96)), jnp.float32)  # rows 24 KiB, aligned
    r = layer_rows(a)
    assert isinstance(r, LayerRows) and len(r.rows) == 3
    base, row = a.unsafe_buffer_pointer(), 64 * 96 * 4
    for g in range(3):
        assert r[g].unsafe_buffer_pointer() == base + g * row  # no copy
        np.testing.assert_array_equal(np.asarray(r[g]), np.asarray(a[g]))
    abstract = layer_rows(jax.ShapeDtypeStruct((3, 64, 96), jnp.float32))
    assert [x.shape for x in abstract.rows] == [(64, 96)] * 3


def test_lowered_and_compiled_step_take_the_stacked_params():
    graphdef, params = init_params(CFG, jnp.float32, seed=2)
    fns = build_functions(graphdef, CFG, get_method("dense"))
    cache = init_cache(CFG, get_method("dense"), 1, 64, jnp.float32)
    _, cache = fns.prefill(params, jnp.zeros((1, 8), jnp.int32), jnp.asarray([8], jnp.int32), cache)
    tok = jnp.zeros((1,), jnp.int32)
    compiled = fns.decode_step.lower(params, tok, cache).compile()
    assert "dot" in compiled.as_text()  # the jax stage's own methods are reachable through it
    unrolled = build_functions(graphdef, CFG, get_method("dense"), unroll=True)  # stacked params, sliced
    want, _ = unrolled.decode_step(params, tok, jax.tree.map(jnp.copy, cache))
    got, _ = compiled(params, tok, cache)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=0)


def test_a_scanned_segment_refuses_rows():
    from models.driver import _at

    with pytest.raises(ValueError, match="stacked params"):
        _at({"w": LayerRows([jnp.zeros(2)] * 2)}, jnp.int32(0))


def test_decode_compiles_once_from_prefill_to_later_steps():
    """The rows step's outputs are as committed as its inputs: the cache a prefill returns
    (uncommitted, from uncommitted params) and the one a decode step returns take the same
    compiled program. Committed rows of uncommitted params made every CPU decode loop
    compile its step twice (SmolLM2 f32: 6.5 s each time)."""
    graphdef, params = init_params(CFG, jnp.float32, seed=4)
    fns = build_functions(graphdef, dataclasses.replace(CFG, name="tiny-rows-once"), get_method("dense"))
    assert isinstance(fns.decode_step, RowsStep)
    _greedy(fns, params, steps=3)
    assert fns.decode_step.jitted._cache_size() == 1
    assert all(not r.committed for r in fns.decode_step.rows(params)["layers"]["mlp"]["down_proj"]["kernel"].rows)
