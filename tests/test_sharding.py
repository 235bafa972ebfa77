"""Several devices (models.runtime.sharding): padding, layouts and errors, on one device.

The cases that need several devices (sharded decode against one device, offload on a mesh,
the CLI with --tensor-parallel) run in ``tests/test_multi_device.py``'s one 4-device process."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import ModelConfig
from models.driver import init_cache
from models.programs import build_functions
from models.runtime import sharding as sh
from models.transformer import abstract_model, init_params
from sparse_jax.methods.registry import get_method

def _tiny(kv=3, heads=9):
    return ModelConfig(name="tiny-pad", arch="llama", num_layers=2, hidden_size=32, num_heads=heads, num_kv_heads=kv,
                       head_dim=8, intermediate_size=48, vocab_size=53, max_position=128, rope_theta=1e4,
                       rms_eps=1e-6)


def test_padded_heads_give_the_same_logits():
    cfg = _tiny()
    graphdef, params = init_params(cfg, jnp.float32, seed=3)
    pcfg, pparams = sh.pad_kv_heads(cfg, params, 2)
    assert (pcfg.num_kv_heads, pcfg.num_heads) == (4, 12)
    pgraph = abstract_model(pcfg, jnp.float32)[0]
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 53, (2, 20)), jnp.int32)
    lengths = jnp.asarray([20, 13], jnp.int32)
    outs = []
    for c, g, p in ((cfg, graphdef, params), (pcfg, pgraph, pparams)):
        fns = build_functions(g, c, get_method("dense"), unroll=False)
        logits, cache = fns.prefill(p, tokens, lengths, init_cache(c, get_method("dense"), 2, 32, jnp.float32))
        step, _ = fns.decode_step(p, jnp.argmax(logits, -1).astype(jnp.int32), cache)
        outs.append((logits, step))
    np.testing.assert_allclose(outs[0][0], outs[1][0], atol=1e-5)
    np.testing.assert_allclose(outs[0][1], outs[1][1], atol=1e-5)


def test_padding_copies_calibrated_channels():
    cfg = _tiny()
    _, params = init_params(cfg, jnp.float32)
    chans = (((0, 1), (2, 3), (4, 5)),) * 2
    m = get_method("asynctls", budget=16, block_size=8, kb=2, channels_per_layer=chans)
    _, _, pm = sh.pad_kv_heads(cfg, params, 4, m)
    assert pm.channels_per_layer[0] == ((0, 1), (2, 3), (4, 5), (0, 1))


def test_local_config_and_param_specs():
    from models.config import get_config

    cfg = get_config("qwen3-8b")
    local = sh.local_config(cfg, 2)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (16, 4, 6144)
    specs = {sh._name(p): s for p, s in jax.tree_util.tree_flatten_with_path(
        sh.param_specs(abstract_model(cfg)[1]), is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))[0]}
    assert specs["layers.self_attn.q_proj.kernel"] == jax.sharding.PartitionSpec(None, None, "model")
    assert specs["layers.self_attn.o_proj.kernel"] == jax.sharding.PartitionSpec(None, "model", None)
    assert specs["layers.mlp.down_proj.kernel"] == jax.sharding.PartitionSpec(None, "model", None)
    assert specs["embed_tokens.weight"] == jax.sharding.PartitionSpec()


def test_cache_specs_read_off_the_method_state():
    cfg = ModelConfig(name="t8", arch="qwen3", num_layers=2, hidden_size=32, num_heads=8, num_kv_heads=4, head_dim=16,
                      intermediate_size=48, vocab_size=53, max_position=256, rope_theta=1e4)
    chans = (tuple(tuple(range(h, 16, 4)) for h in range(4)),) * 2
    m = get_method("asynctls", budget=32, block_size=16, kb=4, channels_per_layer=chans, dense_layers=())
    specs = sh.cache_specs(cfg, m, 4, 128, jnp.dtype(jnp.float32), sh.Parallelism(2, 2))
    leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    P = jax.sharding.PartitionSpec
    assert specs.layers[0].k == P("data", "model", None, None)
    assert specs.lengths == P("data")
    assert specs.layers[0].state.labels.scale == P("data", "model", None)  # [B, Hkv, S]
    assert specs.layers[0].state.boxes.upper == P("data", "model", None, None)  # [B, Hkv, NB, D]
    assert all(s.count("model") <= 1 and s.count("data") <= 1 for s in leaves)


def test_clear_errors():
    cfg = _tiny()
    with pytest.raises(ValueError, match="pad them first"):
        sh.local_config(cfg, 2)
    with pytest.raises(ValueError, match="xla_force_host_platform_device_count=64"):
        sh.Parallelism(8, 8).mesh()
    with pytest.raises(ValueError, match="head map"):
        sh.check_method(get_method("kascade", budget=16), 2)
    sh.check_method(get_method("kascade", budget=16), 1)  # data replicas are fine
    sh.check_method(get_method("asyncspade", budget=16), 2, devices=4)  # shards since the zero-size leaf went

    class OneDeviceOnly(type(get_method("quest"))):
        shardable = False

    with pytest.raises(ValueError, match="not supported on several devices"):
        sh.check_method(OneDeviceOnly(), 1, devices=2)
    with pytest.raises(ValueError, match="does not split over data=2"):
        sh.cache_specs(_tiny(4, 8), get_method("dense"), 3, 32, jnp.dtype(jnp.float32), sh.Parallelism(2, 1))


def test_cache_specs_allocate_nothing():
    """The layout is read off abstract shapes: a 150 GB cache (Qwen3-8B, 128K, 8 rows)
    is laid out without allocating it."""
    from models.config import get_config

    cfg = get_config("qwen3-8b")
    specs = sh.cache_specs(cfg, get_method("quest", budget=2048), 8, 131072, jnp.dtype(jnp.bfloat16),
                           sh.Parallelism(2, 2))
    assert specs.layers[5].k == jax.sharding.PartitionSpec("data", "model", None, None)
