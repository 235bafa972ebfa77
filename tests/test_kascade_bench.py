"""benchmarks.kascade_bench's prefill part on CPU: bad method names fail before any model
is built; the TSA rows build the methods they name (the runs themselves need the GPU: an
8B-shaped model)."""

import pytest

from benchmarks import kascade_bench


def test_prefill_refuses_an_unknown_method_before_building_a_model(monkeypatch):
    monkeypatch.setattr("benchmarks.offload.random_model",
                        lambda *a, **k: pytest.fail("a model was built before the names were checked"))
    with pytest.raises(SystemExit, match="unknown prefill method 'nope'"):
        kascade_bench.main(["prefill", "--methods", "dense,nope", "--context", "256", "--layers", "1"])
    with pytest.raises(SystemExit):
        kascade_bench.main(["prefill", "--model", "gpt-2"])


def test_tsa_fraction_rows_build_token_sparse_methods(monkeypatch):
    built = []

    def fake_model(cfg, method, cap):
        built.append((cfg.name, cfg.num_layers, method.prefill, dict(method.prefill_options)))
        raise RuntimeError("stop")  # the timing itself needs the GPU

    monkeypatch.setattr("benchmarks.offload.random_model", fake_model)
    with pytest.raises(RuntimeError, match="stop"):
        kascade_bench.main(["prefill", "--methods", "tsa@0.25", "--model", "llama-3.1-8b", "--context", "256"])
    assert built == [("llama-3.1-8b", 32, "token_sparse", {"keep_fraction": 0.25})]
