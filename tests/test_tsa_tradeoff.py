"""benchmarks.tsa_tradeoff: τ read from an accuracy row's config, and speed rows joined
with the accuracy measured at the same (length, τ), blank where none was."""

import json

import pytest

from benchmarks import tsa_tradeoff


def test_row_tau_reads_the_options_and_the_default():
    assert tsa_tradeoff.row_tau("DenseAttention(dense_layers=(), prefill='dense', prefill_options=())") is None
    assert tsa_tradeoff.row_tau("DenseAttention(dense_layers=(), prefill='token_sparse', prefill_options=())") == 0.005
    cfg = "DenseAttention(dense_layers=(), prefill='token_sparse', prefill_options=(('layers', (3, 4)), ('tau', 0.01)))"
    assert tsa_tradeoff.row_tau(cfg) == 0.01


def test_tradeoff_joins_speed_and_accuracy(tmp_path):
    acc = {"stamp": {"command": "acc"}, "rows": [
        {"method": "dense", "length": 16, "status": "ok", "average": 0.5, "config": "DenseAttention(prefill='dense')"},
        {"method": "t", "length": 16, "status": "ok", "average": 0.25, "n_samples": 8,
         "config": "DenseAttention(prefill='token_sparse', prefill_options=(('tau', 0.05),))",
         "fidelity": {"kl": 0.1, "agreement": 0.9}},
    ]}
    sweep = {"settings": {"model": "m"}, "stamp": {"command": "sweep"}, "rows": [
        {"length": 16, "tau": 0.05, "kept": 0.5, "dense_ms": 2.0, "tsa_ms": 1.0, "speedup": 2.0},
        {"length": 16, "tau": 0.01, "kept": 0.7, "dense_ms": 2.0, "tsa_ms": 1.5, "speedup": 1.33},
    ]}
    (tmp_path / "a.json").write_text(json.dumps(acc))
    (tmp_path / "s.json").write_text(json.dumps(sweep))
    tsa_tradeoff.main(["--sweep", str(tmp_path / "s.json"), "--accuracy", str(tmp_path / "a.json"),
                       "--out", str(tmp_path), "--name", "t"])
    rows = json.loads((tmp_path / "t.json").read_text())["rows"]
    assert rows[0]["accuracy"] == 25.0 and rows[0]["delta"] == -25.0 and rows[0]["samples"] == 8
    assert "accuracy" not in rows[1]  # not measured at tau 0.01
    assert (tmp_path / "t.png").exists()
    sweep["rows"] = [{k: v for k, v in r.items() if k not in ("speedup", "dense_ms", "tsa_ms")} for r in sweep["rows"]]
    (tmp_path / "s.json").write_text(json.dumps(sweep))
    with pytest.raises(SystemExit, match="--time"):
        tsa_tradeoff.main(["--sweep", str(tmp_path / "s.json")])
