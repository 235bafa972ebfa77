"""The prefill's cache argument is donated and its buffers reused for the new cache.

The prefill reads only the empty cache's shapes, so ``jax.jit`` used to drop the argument
as unused, and its donation with it: every prefill then allocated a second whole cache
(19 GiB at 128K on the Qwen3-8B shape, enough to run Kascade's tiled prefill out of
memory on an 80 GB H100)."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from models import transformer as tfm
from models import programs
from models.config import get_config
from models.driver import init_cache
from sparse_jax.methods import get_method


@pytest.mark.parametrize("unroll", [True, False])
def test_prefill_donates_the_cache(unroll):
    cfg = dataclasses.replace(get_config("smollm2-135m"), num_layers=2, max_position=64)
    method = get_method("dense").for_model(cfg.name, num_layers=2, head_dim=cfg.head_dim)
    graphdef, abstract = tfm.abstract_model(cfg, jnp.float32)
    params = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), abstract)
    fns = programs.build_functions(graphdef, cfg, method, unroll)
    cache = init_cache(cfg, method, 1, 64, jnp.float32)
    args = (params, jnp.zeros((1, 64), jnp.int32), jnp.array([64], jnp.int32), cache)
    leaves = jax.tree.leaves(cache)
    assert fns.prefill.lower(*args).as_text().count("tf.aliasing_output") == len(leaves)
    _, new = fns.prefill(*args)
    assert all(x.is_deleted() for x in leaves)  # donated, not copied
    assert all(not x.is_deleted() for x in jax.tree.leaves(new))
