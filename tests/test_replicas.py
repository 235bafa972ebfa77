"""Data-parallel serving (models.serving.replicas): one engine per device group behind one
engine interface, and ``python -m models.serve --data-parallel 2`` behind the OpenAI
API with two forced CPU devices (a server process). The replicas against single-request
generation run in ``tests/test_multi_device.py``'s one 4-device process."""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ENV = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2")

@pytest.mark.slow
def test_server_data_parallel_with_the_openai_client():
    """``python -m models.serve --data-parallel 2 --precompile`` (a real server process, its
    programs compiling in the background as on a GPU): concurrent ``openai`` clients get
    greedy ``Model.generate`` text, both replicas serve, and ``/health`` lists them and
    what is left to compile. A context of 64 tokens holds these prompts and their 10 tokens: each
    replica precompiles (and warms up) 6 programs (one chunk size, one group of two prompts, two
    decode buckets greedy and sampled), not the 10 of a 256-token context (64, 128 and 256-token
    prompt programs). (Most of this test's time is the two SmolLM2 loads, server and references.)"""
    openai = pytest.importorskip("openai")
    import httpx

    from models.serving.server import free_port

    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "models.serve", "--model", "smollm2-135m", "--data-parallel",
                               "2", "--slots", "2", "--max-len", "64", "--precompile", "--port", str(port)], cwd=ROOT, env=ENV,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        end = time.time() + 300
        while True:
            assert server.poll() is None, server.stdout.read()[-3000:]
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < end, "the server did not start"
            time.sleep(0.5)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)
        prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time,",
                   "The three primary colors are"]

        def complete(p):
            return client.completions.create(model="smollm2-135m", prompt=p, max_tokens=10, temperature=0).choices[0].text

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            got = list(pool.map(complete, prompts))
        health = httpx.get(f"{base}/health").json()
    finally:
        server.terminate()
        out = server.communicate(timeout=60)[0]
    assert "2 replicas" in out and "programs in the background" in out, out[-2000:]
    assert isinstance(health["programs_compiling"], int) and health["programs_compiling"] >= 0, health
    assert health["status"] == "ok" and len(health["replicas"]) == 2, health
    assert sum(health["requests_given"]) == 4 and min(health["requests_given"]) >= 1, health
    # the references on one device, in this process
    import jax.numpy as jnp

    import models

    model = models.load_model("smollm2-135m", dtype=jnp.float32, max_len=64)
    assert got == [model.generate(p, max_new_tokens=10) for p in prompts]


def test_device_groups_and_errors():
    from models.serving.replicas import EngineReplicas, device_groups

    assert device_groups(2, 1, devices=["a", "b", "c"]) == [["a"], ["b"]]
    assert device_groups(1, 2, devices=["a", "b"]) == [["a", "b"]]
    with pytest.raises(ValueError, match="need 4 devices; 2 visible"):
        device_groups(2, 2, devices=[type("D", (), {"platform": "cpu"})()] * 2)
    with pytest.raises(ValueError, match="at least one engine"):
        EngineReplicas([])


def test_data_parallel_flag_is_checked_before_loading(monkeypatch):
    import models
    from models.cli.serve import build_parser, make_engine

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("loaded weights before checking"))
    with pytest.raises(ValueError, match="--data-parallel 2 x --tensor-parallel 1 = 2 devices: 1 devices visible"):
        make_engine(build_parser().parse_args(["--data-parallel", "2"]))
    with pytest.raises(ValueError, match="--data-parallel must be >= 1"):
        make_engine(build_parser().parse_args(["--data-parallel", "0"]))
