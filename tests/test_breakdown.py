"""benchmarks.breakdown: stages of a decode step from a kernels results file (no GPU)."""

import json

import pytest

from benchmarks import breakdown as bd

STAMP = {"device": "cpu", "jax": "x", "date": "today", "git_commit": "abc", "command": "python -m benchmarks.kernels"}
KERNELS = [["loop_select_fusion_2", 0.001], ["quest_block_scores", 0.030], ["topk_select_l0", 0.007],
           ["loop_transpose_fusion", 0.0015], ["label_logits_blocks_c128_p4", 0.014],
           ["label_normalize_c512", 0.004], ["topk_select_l0__1", 0.012], ["loop_select_fusion", 0.0016],
           ["sparse_decode_bk128_ns4", 0.031], ["loop_convert_fusion", 0.0018], ["mystery_kernel", 0.002]]


def payload():
    row = {"B": 8, "S": 131072, "K": 2048, "kernel": "AsyncTLS method step (model path)",
           "ms": sum(ms for _, ms in KERNELS), "kernels": KERNELS}
    other = dict(row, K=1024)
    return {"stamp": STAMP, "rows": [other, row, {"B": 8, "S": 131072, "K": 2048, "kernel": "dense cuDNN", "ms": 1.4}]}


def test_stages_follow_launch_order_and_keep_every_kernel():
    st = bd.breakdown(payload()["rows"][1])
    # the first top-k picks blocks, the second tokens; XLA fusions after the attention merge its splits
    assert st["block top-k"]["kernels"] == ["topk_select_l0"]
    assert st["token top-k"]["kernels"] == ["topk_select_l0__1"]
    assert st["split merge"]["kernels"] == ["loop_convert_fusion"]
    assert st["XLA glue"]["kernels"] == ["loop_select_fusion_2", "loop_transpose_fusion", "loop_select_fusion"]
    assert st["other"]["kernels"] == ["mystery_kernel"]  # unknown: counted, named, not dropped
    total = sum(e["us"] for e in st.values())
    assert total == pytest.approx(sum(ms for _, ms in KERNELS) * 1e3)


def test_cli_writes_table_and_plot(tmp_path):
    src = tmp_path / "k.json"
    src.write_text(json.dumps(payload()))
    bd.main([str(src), "--rows", "AsyncTLS method step (model path)", "--K", "2048", "--out", str(tmp_path),
             "--name", "b"])
    md = (tmp_path / "b.md").read_text()
    assert "| 8 | 131072 | 2048 | AsyncTLS method step (model path) | sparse attention | 31.0 |" in md
    assert "mystery_kernel" in md and "python -m benchmarks.breakdown" in md
    assert (tmp_path / "b.png").stat().st_size > 10_000
    out = json.loads((tmp_path / "b.json").read_text())
    assert [r["K"] for r in out["rows"]] == [2048]


def test_cli_errors_name_what_is_there(tmp_path):
    src = tmp_path / "k.json"
    src.write_text(json.dumps(payload()))
    with pytest.raises(SystemExit, match="the file has: \\['AsyncTLS method step"):
        bd.main([str(src), "--rows", "AsyncTLS operator (end to end)", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="no such results file"):
        bd.main([str(tmp_path / "missing.json")])
