"""AsyncSpade's cache rank on a second device (models.runtime.cache_rank).

The two-device cases run ``tests/cache_rank_check.py`` in a subprocess with two forced
CPU devices (the count must be set before jax starts); the errors are checked here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from models.api import Model
from models.runtime.cache_rank import CacheRankModel, packs_of
from models.config import ModelConfig
from models.transformer import init_params
from sparse_jax.methods.registry import get_method
from models.runtime.cache_rank import with_cache_rank

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_cache_rank_gives_the_one_device_tokens():
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2")
    proc = subprocess.run([sys.executable, "-m", "tests.cache_rank_check"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = {r["case"]: r for r in (json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{"))}
    cases = [c for c in rows if c.startswith("tiny/")]
    assert len(cases) == 5, rows
    for c in cases:
        r = rows[c]
        # the same computation on the same CPU, compiled per pack: equal to f32 rounding
        assert r["max_dlogit"] < 1e-5 and r["tokens_agree"], r
        assert r["rank_devices"] == ["cpu:1"] and r["inference_devices"] == ["cpu:0"], r
    assert rows["tiny/asyncspade[quest]/pack=1/device_put/threads"]["packs"] == 5
    assert rows["tiny/asyncspade[quest]/pack=6/device_put/one"]["packs"] == 1
    # the comparison can fail: another selection (the lag) moves the logits by far more
    assert rows["control/asyncspade[quest]/window=1-vs-window=4"]["max_dlogit"] > 0.1


def _tiny(method):
    cfg = ModelConfig(name="tiny", arch="qwen3", num_layers=3, hidden_size=32, num_heads=4, num_kv_heads=2,
                      head_dim=8, intermediate_size=48, vocab_size=31, max_position=256, rope_theta=1e4,
                      rms_eps=1e-6)
    graphdef, params = init_params(cfg, jnp.float32)
    return Model(cfg, graphdef, params, None, method, jnp.float32, 128)


def test_clear_errors():
    with pytest.raises(ValueError, match="the cache rank is AsyncSpade's"):
        with_cache_rank(_tiny(get_method("quest", budget=16)))
    spade = _tiny(get_method("asyncspade", budget=16, window=2))
    with pytest.raises(ValueError, match="pack_layers must be >= 1"):
        with_cache_rank(spade, pack_layers=0)
    if len(jax.devices()) == 1:
        with pytest.raises(ValueError, match="needs a second device: jax sees 1"):
            with_cache_rank(spade)
    with pytest.raises(ValueError, match="transfer must be one of"):
        with_cache_rank(spade, transfer="nccl")
    with pytest.raises(ValueError, match="two different devices"):
        with_cache_rank(spade, devices=[jax.devices()[0]] * 2)
    from models.serving.engine import Engine

    with pytest.raises(ValueError, match="does not run AsyncSpade's cache rank"):
        Engine(CacheRankModel.__new__(CacheRankModel))  # refused before anything of it is read
    # ArkVale re-summarises the new token's whole page: the keys stay on the inference rank
    ark = _tiny(get_method("asyncspade", budget=128, window=2, selector="arkvale"))
    with pytest.raises(ValueError, match="reads `block_keys` of the key cache"):
        with_cache_rank(ark, devices=[jax.devices()[0]] * 2)


def test_packs():
    assert packs_of(5, 2) == (range(0, 2), range(2, 4), range(4, 5))
    assert packs_of(36, 6)[-1] == range(30, 36) and len(packs_of(36, 6)) == 6
    assert packs_of(3, 8) == (range(0, 3),)


@pytest.mark.slow
def test_generate_cli_cache_rank():
    """``python -m models.generate --attention asyncspade --cache-rank`` prints the one-device text."""
    from tests.cli_runs import run_generate, texts_with_and_without

    prompt = "The capital of France is Paris. The capital of Italy is Rome. " * 5 + "The capital of Germany is"
    texts = texts_with_and_without(["--model", "smollm2-135m", "--attention", "asyncspade", "--attention-opt",
                                    "budget=48", "--prompt", prompt, "--max-new-tokens", "8"], ["--cache-rank"],
                                   "cache rank on cpu:1")
    assert texts[0] == texts[1] and texts[0].strip(), texts
    proc = run_generate(["--model", "smollm2-135m", "--prompt", "hi", "--cache-rank"])
    assert proc.returncode == 2 and "--cache-rank is AsyncSpade's" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.slow
def test_two_device_benchmarks_run_on_cpu(tmp_path):
    """``benchmarks.cache_rank`` and ``benchmarks.multi_gpu`` end to end on a tiny model
    (two CPU devices): every configuration row, the results files, and the cross-device
    logits agreeing with the one-device run."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2")
    runs = {"cache_rank": ["--tiny", "--contexts", "512", "--batch", "2", "--budget", "64", "--window", "4",
                           "--packs", "2", "--steps", "2", "--rounds", "1", "--transfers", "device_put", "--dispatch",
                           "threads-wait"],
            "multi_gpu": ["--tiny", "--contexts", "256", "--batch", "1", "--methods", "dense,quest", "--steps", "2",
                          "--rounds", "1", "--budget", "64"]}
    for name, args in runs.items():
        proc = subprocess.run([sys.executable, "-m", f"benchmarks.{name}", *args, "--out", str(tmp_path)], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        rows = json.loads((tmp_path / f"{name}.json").read_text())["rows"]
        assert (tmp_path / f"{name}.md").exists() and (tmp_path / f"{name}.png").exists()
        two = [r for r in rows if r.get("gpus") == 2]
        assert len(rows) == (3 if name == "cache_rank" else 4) and two, rows
        for r in two:
            assert r["argmax_agree"] == 1.0 and r["max_dlogit"] < 0.1 and r["ms_per_step"] > 0, r
