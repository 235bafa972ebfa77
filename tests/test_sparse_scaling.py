"""benchmarks.sparse_scaling's pieces that run without a GPU: the three selection layouts,
the fixed-cost fit, and the report and plot of a result."""

import jax
import numpy as np
import pytest

from benchmarks import sparse_scaling as ss


@pytest.mark.parametrize("layout", ss.LAYOUTS)
def test_selections_are_distinct_in_range_positions(layout):
    b, s, k = 2, 64 * 200, 300
    pos = np.asarray(ss.selection(jax.random.key(1), layout, b, s, k))
    assert pos.shape == (b, ss.HKV, k) and pos.dtype == np.int32
    assert pos.min() >= 0 and pos.max() < s
    for row in pos.reshape(-1, k):
        assert len(set(row.tolist())) == k
    if layout != "random":
        assert np.all(np.diff(pos, axis=-1) > 0)
    if layout == "blocks":  # at most 128 distinct 64-token blocks per row
        assert max(len(set((row // 64).tolist())) for row in pos.reshape(-1, k)) <= ss.KB
    else:
        assert max(len(set((row // 64).tolist())) for row in pos.reshape(-1, k)) > 150


def test_unknown_layout_is_refused():
    with pytest.raises(ValueError, match="unknown layout"):
        ss.selection(jax.random.key(0), "zigzag", 1, 1024, 8)


def test_fit_recovers_a_fixed_cost_and_a_rate():
    rate, fixed_ms = 3.0e12, 7e-3
    pts = [(n, fixed_ms + n / rate * 1e3) for n in (3.3e7, 6.7e7, 1.3e8)]
    f = ss.fit_fixed_cost(pts)
    assert f["fixed_us"] == pytest.approx(7.0, rel=1e-6)
    assert f["rate_GBs"] == pytest.approx(3000.0, rel=1e-6)
    assert ss.fit_fixed_cost(pts[:1]) is None


def test_report_and_plot(tmp_path):
    rows = [{"K": "", "layout": "", "tiling": "dense cuDNN", "ms": 1.39, "GB/s": 3083.0}]
    for kk in (1024, 2048):
        for layout in ss.LAYOUTS:
            for tiling in ("op default", "block_k=64", "block_k=64, prefetch=2"):
                rows.append({"K": kk, "layout": layout, "tiling": tiling, "ms": 0.01 * kk / 1024, "kernel_ms": 0.009,
                             "GB/s": 3000.0, "frac_cudnn_bw": 0.97})
    payload = {"stamp": {"device": "cpu", "jax": jax.__version__, "date": "today", "git_commit": "x", "command": "c"},
               "batch": 8, "context": 131072, "cudnn_GBs": 3083.0, "rows": rows,
               "fits": [{"layout": "random", "tiling": "op default", "fixed_us": 7.0, "rate_GBs": 3000.0}]}
    md = ss.render(payload)
    assert "| 2048 | blocks | block_k=64 |" in md and "| random | op default | 7.0 | 3000 |" in md
    ss.plot(payload, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 10_000
