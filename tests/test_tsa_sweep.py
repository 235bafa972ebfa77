"""``benchmarks.tsa_sweep``: Token Sparse Attention's kept tokens against τ on real
text (SmolLM2, its shipped drift profile): τ = 0 keeps every token, a larger τ keeps
fewer, never under ``min_tokens`` + the window; bad arguments exit with a message."""

import json

import pytest

from benchmarks import tsa_sweep


def test_tsa_sweep_on_real_text(tmp_path):
    length = 1408  # > min_tokens + window = 1152: TSA applies
    rc = tsa_sweep.main(["--lengths", str(length), "--rows", "1", "--taus", "0,0.005,0.05", "--text", "source",
                         "--out", str(tmp_path), "--name", "sw"])
    assert rc == 0
    d = json.loads((tmp_path / "sw.json").read_text())
    kept = [r["kept"] for r in d["rows"]]
    assert kept[0] == 1.0 and kept[0] >= kept[1] >= kept[2]
    assert kept[2] < 1.0 and min(r["kept_min"] for r in d["rows"]) >= (1024 + 128) / length - 1e-9
    assert d["layers"] and set(d["rows"][1]["per_layer"]) == {str(i) for i in d["layers"]}
    assert "| 1408 | 0.05 |" in (tmp_path / "sw.md").read_text() and (tmp_path / "sw.png").stat().st_size > 0


@pytest.mark.parametrize("argv, fragment", [(["--taus", "x"], "comma-separated"), (["--taus", "-1"], "non-negative"),
                                            (["--lengths", "0"], "positive"), (["--rows", "0"], "--rows")])
def test_tsa_sweep_bad_arguments(argv, fragment, capsys):
    with pytest.raises(SystemExit) as e:
        tsa_sweep.parse_args(argv)
    assert e.value.code == 2 and fragment in capsys.readouterr().err


def test_layer_times_and_the_timed_table(tmp_path):
    """``--time``'s pieces: one layer's dense and per-τ TSA times (positive; τ = 0 runs
    the whole prompt), and a timed payload renders its columns and a two-panel plot."""
    import jax
    import jax.numpy as jnp

    from benchmarks.timing import stamp, write_final_results

    kq, kk = jax.random.split(jax.random.PRNGKey(0))
    q = jax.random.normal(kq, (1, 320, 4, 16), jnp.float32)
    k = jax.random.normal(kk, (1, 320, 2, 16), jnp.float32)
    dense, tsa = tsa_sweep.layer_times(q, k, jnp.asarray([320], jnp.int32), [0.0, 0.05], min_tokens=64, window=32,
                                       pool=7, runs=1)
    assert dense > 0 and len(tsa) == 2 and min(tsa) > 0
    rows = [{"length": 320, "tau": t, "kept": f, "kept_min": f, "kept_max": f, "attention_work": f * f,
             "per_layer": {"1": f}, "dense_ms": dense, "tsa_ms": ms, "speedup": dense / ms}
            for t, f, ms in zip([0.0, 0.05], [1.0, 0.6], tsa)]
    payload = {"settings": {"model": "m", "text": "prose", "rows": 1}, "layers": [1],
               "options": {"min_tokens": 64, "window": 32, "pool": 7}, "rows": rows, "stamp": stamp("x")}
    write_final_results("t", payload, tsa_sweep.render, tsa_sweep.plot, tmp_path)
    md = (tmp_path / "t.md").read_text()
    assert "| dense_ms | tsa_ms | speedup |" in md
    assert (tmp_path / "t.png").stat().st_size > 0
