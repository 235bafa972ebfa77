"""The tools that read a decode step's measurements (no GPU): benchmarks.breakdown (stages from a
kernels results file), benchmarks.ncu_summary (Nsight Compute exports, here small ones in its CSV
formats) and benchmarks.ncu_step's argument checks (they come before any device work)."""

import json

import pytest

from benchmarks import breakdown as bd
from benchmarks.probes import ncu_step, ncu_summary

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


def test_the_pallas_merge_is_the_split_merge():
    """merge="pallas" launches one kernel, ``split_merge_ns16``: the split merge, not "other"."""
    assert bd.stage_of("split_merge_ns16", 2, True) == "split merge"
    assert bd.stage_of("loop_convert_fusion", 2, True) == "split merge"  # XLA's merge
    assert bd.stage_of("loop_convert_fusion", 2, False) == "XLA glue"


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


# ---- benchmarks.ncu_summary and benchmarks.ncu_step

RAW = (
    '"ID","Kernel Name","gpu__time_duration.sum","launch__registers_per_thread",'
    '"smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",'
    '"smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio"\n'
    '"","","us","register/thread","ratio","ratio"\n'
    '"0","label_logits_x","14.27","225","1.16","0.17"\n'
    '"1","sparse_decode_y","1,023.50","158","0.50","2.25"\n'
)

SASS = (
    '"Kernel Name","label_logits_x",\n'
    '"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed",\n'
    '"0x1","      FFMA R1, R2, R3, R1","5","96",\n'
    '"0x2","@!P0  FFMA R4, R2, R3, R4","1","32",\n'
    '"0x3","      LOP3.LUT R5, R6, 0xf, RZ, 0xc0, !PT","4","64",\n'
    '"0x4","      EXIT","0","",\n'
    '"Kernel Name","sparse_decode_y",\n'
    '"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed",\n'
    '"0x1","      BAR.SYNC.DEFER_BLOCKING 0x0","9","10",\n'
)


def test_raw_export_gives_each_launch_its_metrics_and_stalls():
    raw = ncu_summary.read_raw(RAW)
    assert [r["kernel"] for r in raw] == ["label_logits_x", "sparse_decode_y"]
    assert raw[0]["us"] == 14.27 and raw[0]["regs"] == 225 and raw[1]["us"] == 1023.5
    assert raw[0]["occ_theory_%"] is None  # not in this export: left blank
    assert raw[0]["stalls"] == [("long_scoreboard", 1.16), ("barrier", 0.17)]
    assert raw[1]["stalls"][0] == ("barrier", 2.25)  # largest first


def test_sass_export_counts_opcodes_with_predicates_and_modifiers_dropped():
    sass = ncu_summary.read_sass(SASS)
    mix = sass["label_logits_x"]
    assert mix["total"] == 192 and mix["ops"] == {"FFMA": 128, "LOP3": 64}
    assert mix["stalls"] == {"FFMA": 6, "LOP3": 4}
    assert sass["sparse_decode_y"]["ops"] == {"BAR": 10}


def test_summary_divides_by_the_work_items():
    md = ncu_summary.summarize(ncu_summary.read_raw(RAW), ncu_summary.read_sass(SASS), {"label_logits": 64})
    assert "| label_logits_x | 14.27 | 225 |" in md
    assert "192 warp instructions = 96 a work item (64 items)" in md  # 192 * 32 threads / 64
    assert "| FFMA | 128 | 66.7% | 60.0% |" in md


def test_bad_exports_and_arguments_get_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="Kernel Name"):
        ncu_summary.read_raw("a,b\n1,2\n")
    with pytest.raises(ValueError, match="Kernel Name"):
        ncu_summary.read_sass("nothing here")
    with pytest.raises(ValueError, match="KERNEL_PREFIX=COUNT"):
        ncu_summary.parse_work(["label_logits=0"])
    bad = tmp_path / "raw.csv"
    bad.write_text("x\n")
    with pytest.raises(SystemExit, match="ncu_summary"):
        ncu_summary.main([str(bad)])
    for argv in (["--seq", "100"], ["--budget", "0"], ["--batch", "0"], ["--seq", "128", "--budget", "256"]):
        with pytest.raises(SystemExit):
            ncu_step.parse_args(argv)
    assert ncu_step.parse_args(["--batch", "1", "--seq", "4096", "--budget", "512"]).budget == 512
