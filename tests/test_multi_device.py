"""Every check that needs several devices, in one process: ``tests/multi_device_check.py``
with four forced CPU devices (the count must be set before jax starts, so it runs in a
subprocess), started once for this module. Sharded decode, offload on a mesh and the engine
over it (``models.runtime.sharding``), AsyncSpade's cache rank (``models.runtime.cache_rank``),
data-parallel replicas (``models.serving.replicas``), the generate CLI with
``--tensor-parallel`` and ``--cache-rank``, and the two-device benchmarks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def multi_device_out(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("multi_device")


@pytest.fixture(scope="module")
def multi_device(multi_device_out) -> dict[str, dict]:
    """The check's JSON lines by case (no case reported twice)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4")
    proc = subprocess.run([sys.executable, "-m", "tests.multi_device_check", str(multi_device_out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    out = {r["case"]: r for r in rows}
    assert len(out) == len(rows), [r["case"] for r in rows]
    return out


def _sharded_rows(rows: dict) -> dict:
    """The sharded-decode cases (tests/sharded_check.py), without the offload ones."""
    return {c: r for c, r in rows.items() if c.startswith(("tiny-kv8/", "tiny-kv3", "smollm2/api-generate/"))}


def _offload_rows(case: str) -> bool:
    return case.startswith(("offload/", "offload-control/", "engine/"))


@pytest.mark.slow
def test_sharded_decode_matches_one_device(multi_device):
    rows = _sharded_rows(multi_device)
    f32 = [r for c, r in rows.items() if "bf16" not in c]
    # tiny-kv8: each method on one mesh (1x2 quest; 2x2 dense, asynctls, quest+TSA; 1x4 asyncspade);
    # forward on 1x2 and 1x4, kascade with its tiled prefill on data=2; tiny-kv3 (padded to 4 KV heads):
    # dense, asynctls, quest+TSA on model=2; SmolLM2 (real weights, its first 4 layers:
    # tests/multi_device_check.py's sharded_case): shard(model, model=2).generate
    assert len(f32) == 12, sorted(rows)
    meshes = {r["case"].split("/")[-1] for r in f32 if r["case"].startswith("tiny-kv8/")}
    assert {"data=1,model=2", "data=2,model=2", "data=1,model=4"} <= meshes, meshes
    assert rows["smollm2/api-generate/dense/data=1,model=2"]["kv_heads"] == 4  # 3 padded to 4
    assert rows["smollm2/api-generate/dense/data=1,model=2"]["text"].strip()
    for r in f32:
        assert r["tokens_agree"], r
        assert r["max_dlogit"] < 5e-4, r  # f32: summation order only (measured <= 7e-5)
        if "/forward/" in r["case"]:
            continue
        layout = r["case"].split("/")[-1]
        want = {"data=1,model=2": ("P(None, 'model')", 2), "data=2,model=2": ("P('data', 'model')", 4),
                "data=1,model=4": ("P(None, 'model')", 4), "data=2,model=1": ("P('data',)", 2)}[layout]
        assert (r["k_spec"], r["devices"]) == want, r
    # bf16: splitting the reductions over two devices changes the rounding, not its size
    one = rows["tiny-kv3-bf16/dense/one device vs f32"]["max_dlogit"]
    two = rows["tiny-kv3-bf16/dense/model=2 vs f32"]["max_dlogit"]
    assert 0 < two < 2 * one + 0.05, (one, two)


@pytest.mark.slow
def test_generate_cli_tensor_parallel(multi_device):
    """``python -m models.generate --tensor-parallel 2`` (the CLI's ``main``, in the 4-device
    process) prints the one-device text and says so in its header; 8 devices are refused."""
    r = multi_device["smollm2/cli/tensor-parallel=2"]
    one, two = r["texts"]
    assert one == two and one.strip(), r
    assert "x 2 (tensor parallel)" in r["heads"][1] and "tensor parallel" not in r["heads"][0], r["heads"]
    assert r["refused_rc"] == 2 and "needs 8 devices; 4 visible" in r["refused"], r


@pytest.mark.slow
def test_offloaded_decoding_on_a_mesh_matches_one_device(multi_device):
    """Host tier and pool split by KV head and row (``TieredRunner`` on a sharded model):
    the same tokens and logits as one device, resident, with blocks read back from the
    sharded pinned host tier; dropping the block saves breaks it (the test can fail).
    Padded KV heads: a tiny config of 3, decoded by the runner and through the engines
    (the offloaded one, against single-request generation; and the paged one, its pools split
    by KV head, AsyncSpade after Token Sparse Attention's chunks, against the paged engine on
    one device: with the chunk's kept count each device's own, or with the padded heads in its
    head mean, its tokens differ)."""
    rows = {c: r for c, r in multi_device.items() if _offload_rows(c)}
    engine = {c: rows.pop(c) for c in list(rows) if c.startswith("engine/")}
    # quest 1x2, asynctls 2x2, controls, kv3; the engines: paged (TSA's chunk form), offloaded
    assert len(rows) == 5 and len(engine) == 2, sorted(rows)
    for r in engine.values():  # the serving engine over the mesh, paged (the server's default) and offloaded
        assert r["completed"] and r["tokens_agree"], r
    # the step's inputs keep one sharding on the mesh: one program per batch bucket (paged: rows 1
    # and 2, its warm-up and steady steps) and sampling structure (plain; with penalties, two of its
    # three requests), none compiled again mid-serving (before, the tokens, lengths and block
    # table alternated between one device and the mesh: 4 + 3 programs with no penalised request)
    assert all(n <= 4 for n in engine["engine/tiny-kv3/asyncspade+token_sparse/paged-chunked/data=1,model=2"]
               ["step_programs"]), engine
    assert engine["engine/tiny-kv3/quest/offload/data=1,model=2"]["step_programs"] == [1], engine
    # the first token's sampler: one program for plain rows and one for penalised ones (before the
    # penalty counts were made on the mesh, the first penalised request compiled one more)
    assert engine["engine/tiny-kv3/asyncspade+token_sparse/paged-chunked/data=1,model=2"][
        "first_token_programs"] == 2, engine
    assert engine["engine/tiny-kv3/quest/offload/data=1,model=2"]["blocks_loaded"] > 0
    paged = engine["engine/tiny-kv3/asyncspade+token_sparse/paged-chunked/data=1,model=2"]
    # the pools split by KV head (4 padded heads, 2 a device), every page back, and both the warm-up's
    # and the steady decode program ran
    assert paged["pool_spec"] == "P(None, 'model')" and paged["pool_shard"][1] * 2 == paged["pool"][1] == 4
    assert paged["blocks_free"][0] == paged["blocks_free"][1], paged
    assert paged["warm_steps"] > 0 and paged["steady_steps"] > 0, paged
    for case, r in rows.items():
        assert r["host_memory"] == "pinned_host" and r["k_spec"] == "P('data', 'model')", r
        assert r["later_misses"] > 0, r  # blocks came back from the host after the first step
        if case.startswith("offload-control/"):
            assert not r["tokens_agree"] and r["max_dlogit"] > 0.1, r
        else:
            assert r["tokens_agree"] and r["max_dlogit"] < 5e-4, r
    assert rows["offload/tiny-kv8/asynctls/data=2,model=2"]["devices"] == 4
    assert rows["offload/tiny-kv3/asynctls/data=1,model=2"]["devices"] == 2


@pytest.mark.slow
def test_cache_rank_gives_the_one_device_tokens(multi_device):
    rows = multi_device
    cases = [c for c in rows if c.startswith("tiny/")]
    assert len(cases) == 4, rows
    for c in cases:
        r = rows[c]
        # the same computation on the same CPU, compiled per pack: equal to f32 rounding
        assert r["max_dlogit"] < 1e-5 and r["tokens_agree"], r
        assert r["rank_devices"] == ["cpu:1"] and r["inference_devices"] == ["cpu:0"], r
    assert rows["tiny/asyncspade[quest]/pack=2/collective/threads"]["packs"] == 3  # 5 layers: 2 + 2 + 1
    assert rows["tiny/asyncspade[quest]/pack=6/device_put/one"]["packs"] == 1
    # a default AsyncSpade (θ_t = the window) decodes sparsely from the first step on the rank
    q = rows["tiny/asyncspade[quest]/pack=2/collective/threads"]
    assert (q["base_dense_steps"], q["rank_dense_steps"]) == (None, 0), q
    # the comparison can fail: another selection (the lag) moves the logits by far more
    assert rows["control/asyncspade[quest]/window=1-vs-window=4"]["max_dlogit"] > 0.1


@pytest.mark.slow
def test_generate_cli_cache_rank(multi_device):
    """``python -m models.generate --attention asyncspade --cache-rank`` prints the one-device
    text, and says so in its header; the flag is refused for another method. (SmolLM2's first
    12 layers: ``tests/multi_device_check.py``'s ``cache_rank_cli_case`` says why.)"""
    r = multi_device["cli/cache-rank"]
    one, two = r["texts"]
    assert one == two and one.strip(), r
    assert "cache rank on cpu:1" in r["heads"][1] and "cache rank" not in r["heads"][0], r["heads"]
    assert r["refused_rc"] == 2 and "--cache-rank is AsyncSpade's" in r["refused"], r


@pytest.mark.slow
def test_two_device_benchmarks_run_on_cpu(multi_device, multi_device_out):
    """``benchmarks.cache_rank`` and ``benchmarks.multi_gpu`` end to end on a tiny model
    (two of the CPU devices): every configuration row, the results files, and the
    cross-device logits agreeing with the one-device run; ``benchmarks.serve_load
    --tensor-parallel 2`` serving its load through the paged engine over two devices."""
    for name in ("cache_rank", "multi_gpu"):
        assert multi_device[f"benchmarks/{name}"]["rc"] == 0
        rows = json.loads((multi_device_out / f"{name}.json").read_text())["rows"]
        assert (multi_device_out / f"{name}.md").exists() and (multi_device_out / f"{name}.png").exists()
        two = [r for r in rows if r.get("gpus") == 2]
        assert len(rows) == 2 and len(two) == 1, rows  # the one-device baseline and the two-device row
        for r in two:
            assert r["argmax_agree"] == 1.0 and r["max_dlogit"] < 0.1 and r["ms_per_step"] > 0, r
    # serve_load --tensor-parallel 2: the paged engine over two devices serves the whole load
    assert multi_device["benchmarks/serve_load"]["rc"] == 0
    load = json.loads((multi_device_out / "serve_load.json").read_text())
    assert load["tensor_parallel"] == 2 and "each engine over 2 devices" in (multi_device_out / "serve_load.md").read_text()
    (run,) = load["runs"]
    assert run["paged"] and [(r["completed"], r["requests"]) for r in run["rows"]] == [(2, 2)], run


@pytest.mark.slow
def test_replicas_give_each_request_its_single_request_tokens(multi_device):
    rows = [multi_device[f"replicas/{m}"] for m in ("resident", "offload", "paged")]
    assert multi_device["replicas/paged"]["pools"] == ["cpu:0", "cpu:1"]  # each replica's pages on its device
    for r in rows:
        assert r["completed"] and all(r["equal"]), r
        # the fewest unfinished requests first: alternating while none finishes
        assert r["replicas"] == [0, 1, 0, 1, 0] and r["given"] == [3, 2], r
        assert r["finished"] == {"length": 5} and r["slots"] == 4 and r["idle"], r
        assert r["devices"] == ["cpu:0", "cpu:1"], r


def test_every_step_ran_and_reports_its_time(multi_device, capsys):
    """Each step of the check reported its time (a step that did not run has none); the
    times are printed into the test log, so the slow step shows in CI."""
    times = {c.split("/", 1)[1]: r["seconds"] for c, r in multi_device.items() if c.startswith("time/")}
    assert set(times) == {"sharded", "cache_rank", "cache_rank_cli", "replicas", "benchmarks"}, times
    with capsys.disabled():
        print(f"\nmulti-device check, seconds per step: {times}")
