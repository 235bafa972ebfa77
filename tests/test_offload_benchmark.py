"""The offload benchmark runs end to end on a tiny random model (CPU smoke test:
it must not rot between GPU sessions)."""

import json

from benchmarks import offload


def test_offload_benchmark_tiny(tmp_path):
    # one timed round of 8 steps a configuration (the default 3 of 64 ran 1,649 steps: 77 s of CI)
    rc = offload.main(["--tiny", "--contexts", "1024", "--budget", "128", "--kb", "8", "--steps", "2", "--eq-repeats", "1",
                       "--warmup", "1", "--rounds", "1", "--round-steps", "8", "--prefill-len", "256",
                       "--out", str(tmp_path), "--name", "t"])
    assert rc == 0
    d = json.loads((tmp_path / "t.json").read_text())
    labels = {r["label"] for r in d["throughput"]}
    assert {"dense", "sparse", "offload"} <= labels
    off = next(r for r in d["throughput"] if r["label"] == "offload")
    assert off["batch"] >= 1 and off["finite"] and 0 < off["hit_rate"] <= 1
    assert d["equal_batch"] and d["prefill"] and d["device_put"]
    assert (tmp_path / "t.md").read_text().startswith("# Offloaded decoding")
    assert "tpot = median of 1 back-to-back rounds of 8 steps" in (tmp_path / "t.md").read_text()
    assert all(len(r["tpot_rounds_ms"]) == 1 for r in d["throughput"] if r.get("batch"))
    assert (tmp_path / "t.png").stat().st_size > 0
    eq = d["equal_batch"][0]
    assert {"sparse_concurrent_tpot_ms", "offload_serial_tpot_ms", "slowdown"} <= set(eq)
    # every row against its floor: bytes it must read / the measured bandwidth, and the host's share
    assert d["bandwidth_gbps"] > 0
    for r in d["throughput"]:
        assert r["floor_ms"] > 0 and 0 < r["of_floor"] and 0 < r["host_issue_of_step"] and 0 < r["host_dispatch_of_step"], r

    # --merge joins per-context runs into one file, keeping every run's command
    rc = offload.main(["--merge", f"{tmp_path / 't.json'},{tmp_path / 't.json'}", "--out", str(tmp_path),
                       "--name", "m"])
    assert rc == 0
    m = json.loads((tmp_path / "m.json").read_text())
    assert len(m["throughput"]) == 2 * len(d["throughput"]) and len(m["parts"]) == 2
    assert (tmp_path / "m.md").read_text().count("- command: `") == 2


def test_stream_probe_renders_saved_result(tmp_path):
    from benchmarks.probes import stream_probe

    payload = {"stamp": {"device": "H100", "jax": "0.11.2", "git_commit": "abc", "date": "d", "command": "c"},
               "batch": 11, "copy_bytes": 5 << 20, "mlp_bytes": 288 << 20,
               "rows": [{"variant": "serial/default", "ms": 0.24, "ok": True},
                        {"variant": "mlp_only/default", "ms": 0.12, "ok": True},
                        {"variant": "copy_only/default", "ms": 0.13, "ok": True},
                        {"variant": "serial_p8u4/concurrent", "ms": 0.16, "ok": True}]}
    src = tmp_path / "p.json"
    src.write_text(json.dumps(payload))
    stream_probe.main(["--from-json", str(src), "--out", str(tmp_path), "--name", "sp"])
    md = (tmp_path / "sp.md").read_text()
    assert "| serial_p8u4/concurrent | 0.16 | 1.333 | 0.692 | True |" in md  # (0.12 + 0.13 - 0.16) / 0.13
    assert (tmp_path / "sp.png").stat().st_size > 0


def test_offloaded_runs_prime_the_autotuner_at_a_short_context(tmp_path, monkeypatch):
    """Each offloaded configuration first steps its batch at a quarter of the context (so
    XLA's GEMM autotuner runs before the full state fills the device), then measures."""
    calls = []
    real = offload.prime_autotuner
    monkeypatch.setattr(offload, "PRIME_BACKENDS", ("gpu", "cpu"))
    monkeypatch.setattr(offload, "prime_autotuner", lambda runner, model, batch, context: (
        calls.append((batch, context)), real(runner, model, batch, context)))
    rc = offload.main(["--tiny", "--contexts", "1024", "--modes", "offload", "--budget", "128", "--kb", "8",
                       "--steps", "2", "--warmup", "1", "--prefill-len", "0", "--no-extras", "--eq-repeats", "0",
                       "--out", str(tmp_path), "--name", "p"])
    assert rc == 0 and calls and all(c == 1024 for _, c in calls)
    off = json.loads((tmp_path / "p.json").read_text())["throughput"][0]
    assert off["batch"] == calls[-1][0] and off["finite"]


def test_offload_benchmark_save_ab_at_one_batch(tmp_path):
    """--save deferred,sync runs both saves at the batch the first found (one row each, labelled),
    so the FlashD2H A/B is not confounded by the planner choosing two batches; a bad list is
    refused before any model is built."""
    rc = offload.main(["--tiny", "--contexts", "1024", "--budget", "128", "--kb", "8", "--steps", "2",
                       "--warmup", "1", "--prefill-len", "0", "--modes", "offload", "--no-extras",
                       "--save", "deferred,sync", "--out", str(tmp_path), "--name", "ab"])
    assert rc == 0
    rows = json.loads((tmp_path / "ab.json").read_text())["throughput"]
    assert [(r["label"], r["save"]) for r in rows] == [("offload (save deferred)", "deferred"),
                                                       ("offload (save sync)", "sync")]
    assert rows[0]["batch"] == rows[1]["batch"] >= 1 and all(r["finite"] and r["tpot_ms"] > 0 for r in rows)
    import pytest

    with pytest.raises(SystemExit):
        offload.main(["--tiny", "--save", "deferred,flash"])
    for bad in (["--rounds", "0"], ["--round-steps", "0"]):  # refused before any model is built
        with pytest.raises(SystemExit):
            offload.parse_args(["--tiny", *bad])


def test_flashd2h_ab_tiny(tmp_path):
    """benchmarks.flashd2h_ab (the save A/B in alternating order, each run profiled) end to end;
    bad orders are refused before any model is built."""
    import pytest

    from benchmarks.probes import flashd2h_ab

    with pytest.raises(SystemExit):
        flashd2h_ab.parse_args(["--order", "sync,async"])
    rc = flashd2h_ab.main(["--tiny", "--order", "sync,deferred:device", "--batch", "2", "--steps", "2",
                           "--warmup", "1", "--out", str(tmp_path), "--name", "f"])
    assert rc == 0
    d = json.loads((tmp_path / "f.json").read_text())
    assert [(r["run"], r["save"]) for r in d["runs"]] == [(1, "sync"), (2, "deferred:device")]
    for r in d["runs"]:
        assert r["tpot_ms"] > 0 and len(r["tpot_rounds_ms"]) == 3 and r["host_top"], r
    md = (tmp_path / "f.md").read_text()
    assert "| sync | 1 |" in md and "| deferred:device | 1 |" in md and (tmp_path / "f.png").stat().st_size > 0
