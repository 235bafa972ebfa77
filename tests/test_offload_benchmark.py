"""The offload benchmark runs end to end on a tiny random model (CPU smoke test:
it must not rot between GPU sessions)."""

import json

from benchmarks import offload


def test_offload_benchmark_tiny(tmp_path):
    rc = offload.main(["--tiny", "--contexts", "1024", "--budget", "128", "--kb", "8", "--steps", "2",
                       "--warmup", "1", "--prefill-len", "256", "--out", str(tmp_path), "--name", "t"])
    assert rc == 0
    d = json.loads((tmp_path / "t.json").read_text())
    labels = {r["label"] for r in d["throughput"]}
    assert {"dense", "sparse", "offload"} <= labels
    off = next(r for r in d["throughput"] if r["label"] == "offload")
    assert off["batch"] >= 1 and off["finite"] and 0 < off["hit_rate"] <= 1
    assert d["equal_batch"] and d["prefill"] and d["device_put"]
    assert (tmp_path / "t.md").read_text().startswith("# Offloaded decoding")
    assert (tmp_path / "t.png").stat().st_size > 0
