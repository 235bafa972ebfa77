"""benchmarks.probes.compile_probe on a tiny model (the CPU check of the GPU probe), and the
chunk key buckets it compiles."""

import json

from benchmarks.probes import compile_probe
from models.serving.paged import chunk_kv_len


def test_chunk_key_buckets_stop_at_the_requests_capacity():
    assert [chunk_kv_len(n, 64) for n in (1, 64, 65, 1000, 4096, 4097)] == [64, 64, 128, 1024, 4096, 8192]
    # a 132,096-token context's last chunks gather its pages, not 262,144 keys
    assert chunk_kv_len(132096, 64, 132096) == 132096 and chunk_kv_len(131072, 64, 132096) == 131072
    assert chunk_kv_len(70000, 64, 132096) == 131072


def test_compile_probe_times_each_program(tmp_path):
    assert compile_probe.main(["--tiny", "--layers", "2", "--max-len", "1536", "--slots", "2", "--chunk", "256",
                               "--kv-lens", "1536", "--unroll", "scanned", "--runs", "1", "--out", str(tmp_path),
                               "--trace-compile", str(tmp_path / "trace")]) == 0
    d = json.loads((tmp_path / "compile_probe.json").read_text())
    rows = d["rows"]
    # the traced compile's phases: XLA's own events (the CPU compiler's here), not Python frames
    names = [r["event"] for r in d["compile_phases"]]
    assert any("Compile" in n for n in names) and not any(n.startswith("$") for n in names), names
    assert [r["program"] for r in rows] == ["decode step, 2 rows", "chunk of 256 tokens, keys 1536"]
    assert all(r["compile_s"] > 0 and r["run_ms"] > 0 and r["unroll"] is False for r in rows)
    assert "| chunk of 256 tokens, keys 1536 | False |" in (tmp_path / "compile_probe.md").read_text()


def test_engine_iteration_refuses_a_cache_that_does_not_fit(monkeypatch):
    """benchmarks.probes.engine_iteration says so before building a model whose cache exceeds
    the device (8 rows of 132,096 positions on the Qwen3-8B shape: 156 GB)."""
    import pytest

    from benchmarks.probes import engine_iteration
    from sparse_jax.offload import capacity

    monkeypatch.setattr(capacity, "device_budget", lambda reserve=0: 130 << 30)  # an H200's usable bytes
    with pytest.raises(SystemExit, match=r"batch 8 at capacity 132096 needs 1[0-9]{2}\.\d GiB"):
        engine_iteration.main(["--caps", "132096", "--batch", "8", "--methods", "dense"])
    # 4 rows of 128K and 8 of 64K fit (the shapes)
    engine_iteration._check_fits(engine_iteration.argparse.Namespace(tiny=False, layers=36, batch=[4]), [132096])
    engine_iteration._check_fits(engine_iteration.argparse.Namespace(tiny=False, layers=36, batch=[8]), [66560])


def test_engine_iteration_probe_runs_on_cpu(tmp_path):
    """``benchmarks.probes.engine_iteration --tiny``: benchmark A's probe runs end to end on the
    paged and offloaded engines with their programs precompiled, and writes a row each (it
    broke unseen once: host_probe's step functions grew a fourth, 2026-12-06)."""
    import json

    from benchmarks.probes import engine_iteration

    assert engine_iteration.main(["--tiny", "--layers", "3", "--context", "130", "--caps", "192", "--batch", "2",
                                  "--methods", "asynctls", "--engines", "paged,offload-paged", "--max-tokens", "4",
                                  "--steps", "2", "--rounds", "1", "--precompile", "--out", str(tmp_path),
                                  "--name", "e"]) == 0
    rows = json.loads((tmp_path / "e.json").read_text())["rows"]
    assert [r["engine"] for r in rows] == ["paged", "offload-paged"]
    assert all(r["iteration_ms"] > 0 and r["bare_ms"] > 0 and r["steps_measured"] > 0 for r in rows)
