"""Several devices (models.runtime.sharding): sharded prefill + decode give one device's logits.

The device-count cases run ``tests/sharded_check.py`` in a subprocess with
``--xla_force_host_platform_device_count`` (it must be set before jax starts):
one 4-device process for both 4-device tests (the ``four_devices`` fixture), one
2-device process; the rest runs here on one device."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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

ROOT = Path(__file__).resolve().parent.parent


def _check(devices: int, *args: str) -> list[dict]:
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    proc = subprocess.run([sys.executable, "-m", "tests.sharded_check", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def four_devices() -> dict[str, dict]:
    """Every 4-device case in one process (a process start, its compilations and one SmolLM2
    load shared): the sharded decode cases with bf16, and the offloaded ones with the engine."""
    rows = _check(4, "--bf16", "--with-offload")
    out = {r["case"]: r for r in rows}
    assert len(out) == len(rows), [r["case"] for r in rows]  # no case reported twice
    return out


def _offload_rows(case: str) -> bool:
    return case.startswith(("offload/", "offload-control/", "engine/"))


@pytest.mark.slow
def test_four_devices_match_one_device(four_devices):
    rows = {c: r for c, r in four_devices.items() if not _offload_rows(c)}
    f32 = [r for c, r in rows.items() if "bf16" not in c]
    # tiny: 5 methods (asyncspade, quest+TSA prefill) x 3 meshes, forward, kascade (+ tiled prefill) on data=2; SmolLM2: dense, quest,
    # asynctls on model=2 and asynctls on data=2, and shard(model, ...).generate for dense and quest
    assert len(f32) == 25, sorted(rows)  # + forward on 1x2 and 1x4, + kascade's tiled prefill on data=2
    assert rows["smollm2/api-generate/dense/data=1,model=2"]["kv_heads"] == 4  # 3 padded to 4
    for r in f32:
        assert r["tokens_agree"], r
        assert r["max_dlogit"] < 5e-4, r  # f32: summation order only (measured <= 7e-5)
        if "/forward/" in r["case"]:
            continue
        layout = r["case"].split("/")[-1]
        want = {"data=1,model=2": ("P(None, 'model')", 2), "data=2,model=2": ("P('data', 'model')", 4),
                "data=1,model=4": ("P(None, 'model')", 4), "data=2,model=1": ("P('data',)", 2)}[layout]
        assert (r["k_spec"], r["devices"]) == want, r
    # bf16: splitting the reductions over two devices changes the rounding, not its size
    one = rows["smollm2-bf16/dense/one device vs f32"]["max_dlogit"]
    two = rows["smollm2-bf16/dense/model=2 vs f32"]["max_dlogit"]
    assert 0 < two < 2 * one + 0.05, (one, two)


@pytest.mark.slow
def test_offloaded_decoding_on_a_mesh_matches_one_device(four_devices):
    """Host tier and pool split by KV head and row (``TieredRunner`` on a sharded model):
    the same tokens and logits as one device, resident, with blocks read back from the
    sharded pinned host tier; dropping the block saves breaks it (the test can fail).
    Padded KV heads: a tiny config of 3, and SmolLM2 (real weights) through the engine."""
    rows = {c: r for c, r in four_devices.items() if _offload_rows(c)}
    engine = {c: rows.pop(c) for c in list(rows) if c.startswith("engine/")}
    assert len(rows) == 7 and len(engine) == 2, sorted(rows)
    for r in engine.values():  # the serving engine over the mesh, resident and offloaded
        assert r["completed"] and r["tokens_agree"], r
    assert engine["engine/smollm2/quest/offload/data=1,model=2"]["blocks_loaded"] > 0
    for case, r in rows.items():
        assert r["host_memory"] == "pinned_host" and r["k_spec"] == "P('data', 'model')", r
        assert r["later_misses"] > 0, r  # blocks came back from the host after the first step
        if case.startswith("offload-control/"):
            assert not r["tokens_agree"] and r["max_dlogit"] > 0.1, r
        else:
            assert r["tokens_agree"] and r["max_dlogit"] < 5e-4, r
    assert rows["offload/tiny-kv8/asynctls/data=2,model=2"]["devices"] == 4
    assert rows["offload/tiny-kv3/asynctls/data=1,model=2"]["devices"] == 2


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


@pytest.mark.slow
def test_generate_cli_tensor_parallel():
    """``python -m models.generate --tensor-parallel 2`` prints the one-device text."""
    from tests.cli_runs import run_generate, texts_with_and_without

    texts = texts_with_and_without(["--model", "smollm2-135m", "--prompt", "The capital of France is",
                                    "--max-new-tokens", "12"], ["--tensor-parallel", "2"], "x 2 (tensor parallel)")
    assert texts[0] == texts[1] and texts[0].strip(), texts
    proc = run_generate(["--model", "smollm2-135m", "--prompt", "hi", "--tensor-parallel", "4"])
    assert proc.returncode == 2 and "needs 4 devices; 2 visible" in proc.stderr, proc.stderr[-2000:]


def test_cache_specs_allocate_nothing():
    """The layout is read off abstract shapes: a 150 GB cache (Qwen3-8B, 128K, 8 rows)
    is laid out without allocating it."""
    from models.config import get_config

    cfg = get_config("qwen3-8b")
    specs = sh.cache_specs(cfg, get_method("quest", budget=2048), 8, 131072, jnp.dtype(jnp.bfloat16),
                           sh.Parallelism(2, 2))
    assert specs.layers[5].k == jax.sharding.PartitionSpec("data", "model", None, None)
