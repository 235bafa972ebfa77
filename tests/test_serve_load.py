"""The load benchmark runs end to end on a tiny random model (CPU smoke test: it
must not rot between GPU sessions), and its merge joins runs."""

import json

import pytest

from benchmarks import serve_load


def test_serve_load_tiny(tmp_path):
    rc = serve_load.main(["--tiny", "--methods", "dense:resident-segmented,quest:offload,quest:segmented,dense:paged-chunked",
                          "--prefill-chunk", "64", "--budget", "32",
                          "--rates", "20,200",
                          "--requests", "5", "--prompt-mix", "64:0.5,128:0.5", "--output-min", "3",
                          "--output-max", "6", "--slots", "2,dense:resident-segmented=1", "--time-limit", "30", "--out", str(tmp_path),
                          "--name", "t"])
    assert rc == 0
    d = json.loads((tmp_path / "t.json").read_text())
    assert [r["method"] for r in d["runs"]] == ["dense:resident-segmented", "quest:offload", "quest:segmented",
                                                "dense:paged-chunked"]
    assert [r["slots"] for r in d["runs"]] == [1, 2, 2, 2]
    # paged, its prompts prefilled 64 tokens per iteration through every layer
    assert d["runs"][3]["paged"] and d["runs"][3]["prefill_chunk"] == 64 and d["runs"][3]["prefill_segments"] > 0
    # resident, its prompts prefilled a layer segment per iteration
    assert not d["runs"][0]["offloaded"] and d["runs"][0]["prefill_segments"] > 0
    assert d["runs"][2]["offloaded"] and d["runs"][2]["prefill_segments"] > 0
    assert d["runs"][1]["offloaded"] and sum(r["blocks_loaded_per_iter"] for r in d["runs"][1]["rows"]) > 0
    # the device pool's hit rate: offloaded rows read blocks (some found in the pool), resident ones none
    assert all(0.0 < r["pool_hit_rate"] < 1.0 for r in d["runs"][1]["rows"])
    assert all(r["pool_hit_rate"] is None for r in d["runs"][3]["rows"])
    for run in d["runs"]:
        assert run["iteration_ms"] > 0 and run["goodput_rps"] in (None, 20.0, 200.0)
        for row in run["rows"]:
            assert row["completed"] == row["requests"] == 5
            # not p99 >= mean: a few whole-prefill stalls put the mean above the P99 on the H100
            assert row["max_tbt_ms"] >= row["p99_tbt_ms"] > 0 and row["mean_tbt_ms"] > 0
            assert row["throughput_tok_s"] > 0
            assert 3 * 5 <= row["output_tokens"] <= 6 * 5
            # prefill time per mix length (prompts of (32, 64] count as 64) and where the longest gap came
            assert set(row["prefill_s_by_length"]) <= {"64", "128"} and min(row["prefill_s_by_length"].values()) > 0
            assert row["mean_prefill_s"] > 0 and "-token prompt, before output token" in row["max_tbt_at"]
    assert (tmp_path / "t.md").read_text().startswith("# Serving under load")
    assert (tmp_path / "t.png").stat().st_size > 0
    rc = serve_load.main(["--merge", f"{tmp_path / 't.json'},{tmp_path / 't.json'}", "--out", str(tmp_path),
                          "--name", "m", "--note", "two copies"])
    m = json.loads((tmp_path / "m.json").read_text())  # the same four runs twice: joined per method
    assert [r["method"] for r in m["runs"]] == ["dense:resident-segmented", "quest:offload", "quest:segmented",
                                                "dense:paged-chunked"]
    assert [row["rate"] for row in m["runs"][0]["rows"]] == [20, 20, 200, 200]
    md = (tmp_path / "m.md").read_text()
    assert "- two copies" in md
    # where and how each part ran, not only the first's command; a merged input keeps its parts
    assert "joined from 2 runs" in md and "\n  1. cpu (cpu), jax" in md and "\n  2. cpu (cpu), jax" in md
    assert len(serve_load.merge([str(tmp_path / "m.json"), str(tmp_path / "t.json")])["parts"]) == 3
    # one method at two max_inject_tokens: merged, the labels say which
    d["runs"] = d["runs"][2:3]
    (tmp_path / "a.json").write_text(json.dumps(d))
    d["runs"][0]["max_inject_tokens"] = 64
    (tmp_path / "b.json").write_text(json.dumps(d))
    merged = serve_load.merge([str(tmp_path / "a.json"), str(tmp_path / "b.json")])
    labels = [r["method"] for r in merged["runs"]]
    assert labels[0] != labels[1] and labels[1] == "quest:segmented (inject 64)"
    assert {row["method"] for row in merged["runs"][1]["rows"]} == {"quest:segmented (inject 64)"}


def test_serve_load_shared_pool_with_and_without_admission(tmp_path):
    """The ablation's shared-pool steps: NAME:shared admits on working sets (M_avl = the pool),
    NAME:shared-nows does not (M_avl unbounded); both complete every request."""
    rc = serve_load.main(["--tiny", "--methods", "quest:shared,quest:shared-nows", "--budget", "32", "--rates", "200",
                          "--requests", "4", "--prompt-mix", "64:1", "--output-min", "3", "--output-max", "5",
                          "--slots", "2", "--time-limit", "30", "--out", str(tmp_path), "--name", "ab"])
    assert rc == 0
    runs = json.loads((tmp_path / "ab.json").read_text())["runs"]
    assert [(r["method"], r["pool"], r["ws_admission"]) for r in runs] == [
        ("quest:shared", "shared", True), ("quest:shared-nows", "shared", False)]
    assert all(row["completed"] == row["requests"] == 4 for r in runs for row in r["rows"])


def test_slots_per_method():
    """``--slots 6,dense=3``: a default and per-method counts; bad specs are refused before any run."""
    import pytest

    labels = ["dense", "asynctls:shared"]
    assert serve_load.parse_slots("4", labels) == {"dense": 4, "asynctls:shared": 4}
    assert serve_load.parse_slots("6,dense=3", labels) == {"dense": 3, "asynctls:shared": 6}
    assert serve_load.parse_slots("dense=2,asynctls:shared=8", labels) == {"dense": 2, "asynctls:shared": 8}
    for bad, msg in (("dense=3", "no count for"), ("0", ">= 1"), ("x", "N or LABEL=N"),
                     ("4,quest=2", "not one of --methods")):
        with pytest.raises(ValueError, match=msg):
            serve_load.parse_slots(bad, labels)
    with pytest.raises(SystemExit):
        serve_load.parse_args(["--methods", "dense,asynctls", "--slots", "dense=3"])


def test_workload_is_poisson_and_bounded():
    mix = serve_load.parse_mix("100:1,1000:3")
    wl = serve_load.make_workload(2.0, 400, mix, 128, 512, seed=1)
    assert wl.arrivals[0] == 0 and all(b >= a for a, b in zip(wl.arrivals, wl.arrivals[1:]))
    assert abs(len(wl.arrivals) / wl.arrivals[-1] - 2.0) < 0.4  # rate
    assert all(50 < p <= 100 or 500 < p <= 1000 for p in wl.prompt_lens)
    assert all(128 <= o <= 512 for o in wl.output_lens)


def test_a_method_whose_prefill_fails_is_reported_and_the_next_runs(tmp_path, monkeypatch):
    """On the H100 a dense engine's 64K prefill ran out of memory compiling, the engine thread
    died, and the warm-up waited 600 s for a request nobody would finish. Now the failed
    request ends with its error, the warm-up stops the method at once, the results say why,
    the next method runs, and the exit status is 1. With ``--fit-slots`` an engine whose slots
    the capacity check refuses is built with fewer (here the offloaded one, at 1 of 2)."""
    from models.serving import engine as engine_mod
    from models.serving import slots as eng
    from sparse_jax.offload.capacity import CapacityError

    real = eng.ResidentSlots.prefill
    real_engine = engine_mod.Engine

    def refusing(model, slots, **kw):
        if kw.get("offload") and slots > 1:
            raise CapacityError(f"offload batch of {slots}: needs more device memory than is usable")
        return real_engine(model, slots=slots, **kw)

    monkeypatch.setattr(engine_mod, "Engine", refusing)

    def prefill(self, ids):
        if len(ids) > 96:
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 3.39GiB")
        return real(self, ids)

    monkeypatch.setattr(eng.ResidentSlots, "prefill", prefill)
    rc = serve_load.main(["--tiny", "--methods", "dense,quest:offload", "--budget", "32", "--rates", "200",
                          "--requests", "3", "--prompt-mix", "64:0.5,128:0.5", "--output-min", "3",
                          "--output-max", "4", "--slots", "2", "--time-limit", "30", "--out", str(tmp_path),
                          "--name", "f", "--fit-slots"])
    assert rc == 1
    dense, offloaded = json.loads((tmp_path / "f.json").read_text())["runs"]
    assert offloaded["slots"] == 1
    assert "warm-up: a 128-token prompt ended 'error'" in dense["error"] and "RESOURCE_EXHAUSTED" in dense["error"]
    assert offloaded["rows"][0]["completed"] == 3 and offloaded["rows"][0]["failed"] == 0
    assert "**dense (2 slots) failed**: RuntimeError: warm-up" in (tmp_path / "f.md").read_text()


def test_merge_labels_one_method_at_several_chunk_sizes(tmp_path):
    """``--merge`` of runs of one method at different ``prefill_chunk`` keeps them apart (a
    label that says the chunk), and joins runs of one configuration in rate order; the header's
    time limit is the longest any part ran under."""
    def part(name, chunk, rate, tps, limit=150.0):
        run = {"method": "asynctls:paged-chunked", "slots": 8, "pool": None, "max_inject_tokens": None,
               "prefill_chunk": chunk, "iteration_ms": 10.0, "goodput_rps": None,
               "rows": [{"method": "asynctls:paged-chunked", "rate": rate, "throughput_tok_s": tps, "completed": 1,
                         "requests": 1, "p99_tbt_ms": 50.0, "mean_queue_s": 0.5}]}
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"stamp": {"command": name}, "model": "m", "time_limit_s": limit, "runs": [run]}))
        return str(path)

    out = serve_load.merge([part("a", 1024, 2.0, 1.0), part("b", 4096, 2.0, 2.0, 240.0), part("c", 1024, 1.0, 3.0)])
    assert out["time_limit_s"] == 240.0
    labels = [r["method"] for r in out["runs"]]
    assert labels == ["asynctls:paged-chunked (chunk 1024)", "asynctls:paged-chunked (chunk 4096)"]
    assert [row["rate"] for row in out["runs"][0]["rows"]] == [1.0, 2.0]
    assert all(row["method"] == labels[0] for row in out["runs"][0]["rows"])


def test_goodput_slo_is_one_dense_iteration():
    """Goodput's P99 TBT bound is 25x one dense iteration (the same engine's dense run where the
    results hold one): a sparse engine whose own iteration is shorter is not held to a tighter
    bound; without a dense run, each run's own iteration."""
    def run(method, iteration_ms, p99):
        return {"method": method, "iteration_ms": iteration_ms, "goodput_rps": None,
                "rows": [{"rate": 1.0, "completed": 4, "requests": 4, "p99_tbt_ms": p99, "mean_queue_s": 0.5}]}

    runs = [run("dense:paged-chunked", 20.0, 400.0), run("asynctls:paged-chunked", 10.0, 400.0),
            run("dense:offload", 30.0, 700.0), run("quest:offload", 12.0, 700.0)]
    serve_load.apply_dense_slo(runs)
    assert [r["slo_iteration_ms"] for r in runs] == [20.0, 20.0, 30.0, 30.0]
    assert [r["goodput_rps"] for r in runs] == [1.0, 1.0, 1.0, 1.0]  # 400 <= 500 and 700 <= 750
    alone = [run("asynctls:paged-chunked", 10.0, 400.0)]
    serve_load.apply_dense_slo(alone)
    assert alone[0]["slo_base"] == "own iteration" and alone[0]["goodput_rps"] is None  # 400 > 250


def test_tsa_prefill_labels(tmp_path):
    """``NAME+tsa`` builds the method with Token Sparse Attention's prefill (``--prefill-opt`` its
    options); a bad suffix or a bad option is refused before anything is drawn."""
    args = serve_load.parse_args(["--tiny", "--prefill-opt", "min_tokens=16", "--prefill-opt", "tau=0.01"])
    m = serve_load.build_model(args, "dense+tsa").method
    assert m.name == "dense" and m.prefill == "token_sparse" and dict(m.prefill_options) == {"min_tokens": 16, "tau": 0.01}
    assert serve_load.build_model(args, "dense").method.prefill == "dense"
    with pytest.raises(ValueError, match="NAME\\+tsa"):
        serve_load.check_label("dense+foo:paged")
    serve_load.check_label("dense+tsa:paged-chunked")  # TSA's chunk form
    with pytest.raises(ValueError):
        serve_load.build_model(serve_load.parse_args(["--tiny", "--prefill-opt", "nope=1"]), "dense+tsa")


def test_warm_up_times_the_rows_a_small_pool_holds():
    """A paged pool that cannot hold every slot's requests at once (benchmark C's capped device)
    times the iteration with the rows it holds, not a batch that never forms; a pool that holds
    every slot full times every slot."""
    import jax.numpy as jnp

    import models
    from models.serving.engine import Engine
    from tests.test_engine import _tiny_config

    model = models.load_model(config=_tiny_config(), dtype=jnp.float32)
    page = Engine(model, slots=4, max_len=256, paged=True, stop_ids=()).kv.page
    per_request = -(-64 // page)  # a 40-token prompt and its 24 warm-up tokens
    # max_len 64: the pool must hold one request of max_len; it holds 3 of 64 tokens, and
    # 2 beside the scheduler's watermark (a page), not 4
    small = Engine(model, slots=4, max_len=64, paged=True, kv_blocks=1 + 3 * per_request, stop_ids=())
    full = Engine(model, slots=4, max_len=64, paged=True, stop_ids=())
    assert serve_load.decoding_rows(small, 64) == 2 and serve_load.decoding_rows(full, 64) == 4
    for engine, want in ((small, 2), (full, 4)):
        engine.start()
        try:
            ms, rows, _ = serve_load.warm_up(engine, [(40, 1.0)], 97)
        finally:
            engine.stop()
        assert rows == want and ms > 0


def test_warm_up_leaves_the_first_row_room_while_the_others_prefill():
    """A prompt near ``max_len`` whose chunks run in layer parts: the first warm-up row decodes
    while each later one prefills (a chunk's parts, one an iteration), and at the mix's length it
    reached its context before the last was inserted (H100, 4 rows of 64K in 66,048, 8 parts,
    2026-12-07: the warm-up failed). The rows then decode a shorter prompt, and say so."""
    import jax.numpy as jnp

    import models
    from models.serving.engine import Engine
    from tests.test_engine import _tiny_config

    room = serve_load.FULL_STEPS + 3 * 256 + 8
    assert serve_load.warm_up_prompt(66048, 65536, 4, 256) == 66048 - room
    assert serve_load.warm_up_prompt(66048 + room, 65536, 4, 256) == 65536  # room enough: the mix's
    with pytest.raises(ValueError, match="longer max_len or fewer slots"):
        serve_load.warm_up_prompt(128, 120, 4, 64)  # the iteration would not be the mix's
    model = models.load_model(config=_tiny_config(), dtype=jnp.float32)
    # 188 tokens: 6 chunks of 32 in 3 parts, 18 iterations a prompt, in a context of 192
    engine = Engine(model, slots=2, max_len=192, paged=True, prefill_chunk=32, chunk_parts=3, stop_ids=())
    engine.start()
    try:
        ms, rows, tokens = serve_load.warm_up(engine, [(188, 1.0)], 97)
    finally:
        engine.stop()
    assert rows == 2 and ms > 0 and tokens == 192 - (serve_load.FULL_STEPS + 18 + 8)


def test_offloaded_paged_shared_pool_with_churn(tmp_path):
    """``asynctls:offload-paged-shared-segmented`` (paged host memory, one shared device pool with
    working-set admission, segmented prefill) completes every request, and ``--churn`` is recorded
    on the offloaded AsyncTLS run it moves; it is refused where no such run is named."""
    rc = serve_load.main(["--tiny", "--methods", "asynctls:offload-paged-shared-segmented", "--budget", "32",
                          "--churn", "0.5", "--rates", "200", "--requests", "3", "--prompt-mix", "128:1",
                          "--output-min", "3", "--output-max", "5", "--slots", "2", "--time-limit", "30",
                          "--out", str(tmp_path), "--name", "ch"])
    assert rc == 0
    (run,) = json.loads((tmp_path / "ch.json").read_text())["runs"]
    assert (run["pool"], run["ws_admission"], run["paged"], run["churn"]) == ("shared", True, True, 0.5)
    assert run["max_inject_tokens"] and all(row["completed"] == row["requests"] == 3 for row in run["rows"])
    assert "churn 0.5" in (tmp_path / "ch.md").read_text()
    for bad in (["--methods", "asynctls:paged-chunked", "--churn", "0.01"],  # resident: no prefetch to move
                ["--methods", "quest:offload", "--churn", "0.01"],
                ["--methods", "asynctls:offload", "--churn", "1.5"]):
        with pytest.raises(SystemExit):
            serve_load.parse_args(["--tiny", *bad])


def test_warm_up_prompts_reach_every_prefill_bucket_of_the_mix():
    """The warm-up prefills the longest prompt of each bucket the workload's draws of (n/2, n]
    reach, where the engine's prompts run at buckets (the offloaded engine's ``prompt_tokens``),
    so no bucket's layer programs compile in the timed load; one prompt of n otherwise."""
    import types

    from benchmarks import serve_load
    from models.serving.buckets import segmented_prompt_tokens

    offloaded = types.SimpleNamespace(kv=types.SimpleNamespace(prompt_tokens=lambda n: segmented_prompt_tokens(n, 133120)))
    assert serve_load.bucket_prompts(offloaded, 131072) == [81920, 98304, 114688, 131072]
    assert serve_load.bucket_prompts(offloaded, 4096) == [4096]  # (2048, 4096]: one power-of-two bucket
    assert serve_load.bucket_prompts(types.SimpleNamespace(kv=object()), 131072) == [131072]
