"""The host probe's program shapes compute the same greedy steps: one step per call
(``stable``), ``--multi`` steps in a ``lax.fori_loop`` (``multi``) and the same steps written
out in one program (``multi_unrolled``, issue 49's "several steps unrolled in one program"),
so the GPU's per-token times compare one computation."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import models
from benchmarks.offload import random_model
from benchmarks.probes.host_probe import _step_fns
from models.driver import init_cache
from sparse_jax.methods import get_method


def test_multi_step_programs_match_single_steps():
    cfg = models.ModelConfig(name="tiny", arch="qwen3", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
                             head_dim=16, intermediate_size=96, vocab_size=97, max_position=256, rope_theta=1e6,
                             rms_eps=1e-6, tie_embeddings=False)
    method = get_method("dense")
    model = random_model(cfg, method, 256, seed=3)
    _, stable, multi, unrolled = _step_fns(model.graphdef, cfg, method, 3)

    def fresh():
        cache = init_cache(cfg, method, 2, 256, jnp.bfloat16)
        return jnp.array([5, 11], jnp.int32), dataclasses.replace(cache, lengths=jnp.array([7, 40], jnp.int32))

    tok, cache = fresh()
    singles = []
    for _ in range(3):
        tok, cache = stable(model.params, tok, cache)
        singles.append(np.asarray(tok))
    want = [np.asarray(x, np.float32) for x in jax.tree.leaves(cache)]
    for fn in (multi, unrolled):
        t, c = fn(model.params, *fresh())
        np.testing.assert_array_equal(np.asarray(t), singles[-1])
        np.testing.assert_array_equal(np.asarray(c.lengths), [10, 43])
        for got, w in zip(jax.tree.leaves(c), want):  # the same K/V written at the three positions
            np.testing.assert_allclose(np.asarray(got, np.float32), w, atol=1e-2)
