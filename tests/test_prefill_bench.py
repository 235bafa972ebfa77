"""benchmarks.prefill_bench on CPU (a smoke run: rows, files, the numerics cross-check)."""

import json

import pytest

from benchmarks import prefill_bench


def test_prefill_bench_tiny(tmp_path):
    rc = prefill_bench.main(["--contexts", "256", "--fractions", "1.0,0.25", "--heads", "4,2", "--head-dim", "64",
                             "--window", "16", "--dtype", "float32", "--runs", "1", "--out", str(tmp_path),
                             "--name", "pb", "--kascade-tunings", "default"])
    assert rc == 0
    rows = json.loads((tmp_path / "pb.json").read_text())["rows"]
    kascade, rows = rows[-6:], rows[:-6]
    assert [r["part"] for r in kascade] == ["kascade reuse, composed (default tuning)",
                                            "kascade reuse, counts 0 (layout, diagonal, merge)",
                                            *(f"kascade anchor selection, {x} + {y}"
                                              for x in ("f32 softmax in HBM", "tile-scores kernel")
                                              for y in ("per-tile top-k", "top-1 (the scores alone)"))]
    assert all(r["ms"] > 0 for r in kascade)
    assert kascade[4]["max_abs_err"] < 1e-4  # the tile-scores kernel (interpret mode) == the reference
    assert kascade[0]["max_abs_err"] < 1e-5  # the composed path == the masked reference
    # 256 tokens at the paper's rule: tiles 1-7 attend min(128 - 32, 128, start) keys before them
    want = sum(32 * min(96, 32 * n) for n in range(8)) + 8 * 32 * 33 // 2
    assert kascade[0]["kept"] == pytest.approx(want / (256 * 257 / 2))
    assert [r["part"] for r in rows] == ["dense (cuDNN causal)",
                                         "tsa window scores (step 1), reference", "tsa scoring (steps 1-4), reference",
                                         "tsa window scores (step 1), pallas", "tsa scoring (steps 1-4), pallas",
                                         "tsa select (step 4), one sort", "tsa select (step 4), two argsorts",
                                         "tsa compressed order, cumsum + scatter", "tsa compressed order, argsort",
                                         *(f"tsa attend, {f} of the prefix{m}" for f in ("1", "0.25")
                                           for m in ("", ", gather", ", full length", ", gather, full length"))]
    assert rows[3]["max_abs_err"] < 1e-6  # the kernel (interpret mode) == the reference
    kept = [r["kept"] for r in rows[-8:]]
    assert set(kept[:4]) == {1.0} and len(set(kept[4:])) == 1 and 0.25 < kept[4] < 0.35  # a quarter + the window
    # compressed (both movements, bucketed or full length) == masked reference
    assert all(r["max_abs_err"] < 1e-5 for r in rows[-8:])
    assert "| dense (cuDNN causal) |" in (tmp_path / "pb.md").read_text()
    assert (tmp_path / "pb.png").stat().st_size > 0  # TSA's attend time against the kept fraction
    curves = prefill_bench.tsa_curves(json.loads((tmp_path / "pb.json").read_text())["rows"])[256]
    assert sorted(curves) == ["dense", "gather", "gather, full length", "scatter", "scatter, full length"]
    assert all(len(v) == 2 for k, v in curves.items() if k != "dense")  # kept 1 and 0.25


def test_prefill_bench_without_a_kernel_for_the_head_size(tmp_path):
    """A head size the window-scores kernel does not take: reference rows only."""
    rc = prefill_bench.main(["--contexts", "64", "--fractions", "0.5", "--heads", "2,1", "--head-dim", "16",
                             "--window", "16", "--dtype", "float32", "--runs", "1", "--out", str(tmp_path),
                             "--name", "pb", "--parts", "tsa"])
    assert rc == 0
    parts = [r["part"] for r in json.loads((tmp_path / "pb.json").read_text())["rows"]]
    assert not any("pallas" in p for p in parts) and "tsa scoring (steps 1-4), reference" in parts
    assert not any("kascade" in p for p in parts)  # --parts tsa


def test_prefill_bench_chunk_rows(tmp_path):
    """--parts chunk: one chunk at each context over the engine's key bucket, dense and TSA's
    chunk form whole and in pieces, per scoring implementation (the kernel in interpret mode);
    TSA with nothing dropped equals the dense chunk, the kernel's scores the jnp tiles'."""
    rc = prefill_bench.main(["--contexts", "1200", "--heads", "4,2", "--head-dim", "64", "--window", "16",
                             "--dtype", "float32", "--runs", "1", "--parts", "chunk", "--chunk", "256",
                             "--chunk-keep", "0.25", "--chunk-cap", "2048", "--out", str(tmp_path), "--name", "pc"])
    assert rc == 0
    rows = json.loads((tmp_path / "pc.json").read_text())["rows"]
    assert {r["kv_len"] for r in rows} == {2048} and {r["context"] for r in rows} == {1200}  # 1456 -> 2048
    parts = [r["part"].split(": ", 1)[1] for r in rows]
    assert parts == ["dense (cuDNN split)",
                     *(f"tsa {x}, {impl}" for impl in ("jnp tiles", "kernel")
                       for x in ("window scores", "kept set (steps 1-4)", "whole, 0.25 kept")),
                     "tsa select (count + step 4 on given scores)",
                     "tsa select + compressed order (sort, cumsum, scatter)", "tsa kept order (one argsort)",
                     "tsa whole, 0.25 kept, kernel, one argsort", "tsa attend (gather + cuDNN), 0.25 kept"]
    assert all(r["ms"] > 0 for r in rows)
    assert rows[4]["max_abs_err"] < 1e-6  # the kernel's scores == the jnp tiles'
    assert rows[3]["max_abs_err"] < 1e-5 and rows[6]["max_abs_err"] < 1e-5  # nothing dropped == dense
    assert rows[-2]["max_abs_err"] < 1e-5  # one argsort keeps the sort's keys
    assert "| 1200 | 2048 | chunk 256: dense (cuDNN split) |" in (tmp_path / "pc.md").read_text()
    assert (tmp_path / "pc.png").stat().st_size > 0


@pytest.mark.parametrize("argv", [["--contexts", "8"], ["--fractions", "0"], ["--heads", "5,2"], ["--contexts", "x"],
                                  ["--parts", "tsa,x"], ["--parts", "chunk", "--contexts", "131072"],
                                  ["--parts", "chunk", "--chunk-keep", "0"], ["--kascade-tunings", "block_kk=32"],
                                  ["--kascade-tunings", "num_warps=x"]])
def test_prefill_bench_bad_arguments(argv):
    with pytest.raises(SystemExit) as e:
        prefill_bench.main(argv)
    assert e.value.code == 2


def test_prefill_bench_anchor_options(tmp_path):
    """--anchor-impls picks the anchor rows, --scores-tunings adds one kernel row per tuning;
    bad values are refused before anything runs."""
    rc = prefill_bench.main(["--contexts", "256", "--heads", "4,2", "--head-dim", "64", "--window", "16",
                             "--dtype", "float32", "--runs", "1", "--out", str(tmp_path), "--name", "pa",
                             "--parts", "kascade", "--kascade-tunings", "default", "--anchor-impls", "pallas",
                             "--scores-tunings", "block_k=32:num_warps=8;num_stages=3"])
    assert rc == 0
    rows = json.loads((tmp_path / "pa.json").read_text())["rows"]
    assert [r["part"] for r in rows[3:]] == [
        "kascade anchor selection, tile-scores kernel + per-tile top-k",
        "kascade anchor selection, tile-scores kernel + top-1 (the scores alone)",
        "kascade anchor selection, tile-scores kernel (block_k=32, num_warps=8) + top-1 (the scores alone)",
        "kascade anchor selection, tile-scores kernel (num_stages=3) + top-1 (the scores alone)"]
    assert rows[3]["max_abs_err"] < 1e-4
    for bad in (["--anchor-impls", "cudnn"], ["--scores-tunings", "tile=64"]):
        with pytest.raises(SystemExit):
            prefill_bench.main(["--contexts", "256", "--parts", "kascade", *bad])


def test_chunk_attention_bench_tiny(tmp_path):
    """benchmarks.chunk_attention end to end on CPU: every chunk checked against the whole
    prompt's attention, results and plot written; a bad backend is refused before any work."""
    import json

    from benchmarks.probes import chunk_attention

    with pytest.raises(SystemExit):
        chunk_attention.parse_args(["--impls", "blockwise,flash"])
    with pytest.raises(SystemExit):
        chunk_attention.parse_args(["--impls", "cudnn:paged"])
    assert chunk_attention.main(["--tiny", "--impls", "blockwise,cudnn:padded,cudnn", "--out", str(tmp_path),
                                 "--name", "ca"]) == 0
    payload = json.loads((tmp_path / "ca.json").read_text())
    rows = payload["rows"]
    assert [r["impl"] for r in rows] == ["whole (xla)"] + [i for i in ("blockwise", "xla:padded", "xla") for _ in "01"]
    assert all(r["max_err"] < 1e-4 and r["ms"] > 0 for r in rows)
    assert (tmp_path / "ca.png").stat().st_size > 0
