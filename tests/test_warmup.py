"""Engine.warm_up (models/serving/warmup.py): each short program run once, as requests, before
users meet its first execution; and the server's --warm-up flag."""

import jax.numpy as jnp
import pytest

import models
from models.serving import warmup
from models.serving.engine import Engine
from tests.test_engine import _tiny_config


@pytest.fixture(scope="module")
def model():
    return models.load_model(config=_tiny_config(), dtype=jnp.float32)


def test_prompt_sizes_follow_the_precompiled_programs(model):
    """The one-chunk sizes of prompts of at least ``shortest_prompt`` tokens (what
    ``precompile(shortest_prompt=...)`` compiles); 64 tokens for an engine without chunks."""
    chunked = Engine(model, slots=4, max_len=256, paged=True, prefill_chunk=128, stop_ids=())
    assert warmup.prompt_sizes(chunked) == [64, 128]
    assert warmup.prompt_sizes(chunked, shortest_prompt=65) == [128]
    assert warmup.prompt_sizes(chunked, shortest_prompt=200) == []  # every prompt longer than a chunk
    for shortest, want in ((1, {64, 128}), (65, {128})):  # the one-chunk programs precompile compiles
        got = {int(name.split(" of ")[1].split(" tokens")[0])
               for name, *_ in chunked.kv.program_shapes(shortest_prompt=shortest) if name.startswith("chunk of")}
        assert set(warmup.prompt_sizes(chunked, shortest)) == want <= got
    assert warmup.prompt_sizes(Engine(model, slots=2, max_len=256, stop_ids=())) == [64]


def test_warm_up_runs_each_prompt_group_and_decode_bucket(model, monkeypatch):
    """Every group shape the engine prefills together runs (recorded at run_prompt_group), every
    decode bucket greedy and sampled, and the engine is left empty: every page back, no request
    running. An engine that does not group runs no group."""
    grouped = Engine(model, slots=4, max_len=256, paged=True, prefill_chunk=256, stop_ids=())
    alone = Engine(model, slots=4, max_len=256, paged=True, prefill_chunk=256, stop_ids=(), group_prompts=False)
    want_groups = grouped.kv.prompt_group_shapes([64, 128, 256])
    assert want_groups == [(2, 64), (4, 64), (2, 128)]
    for engine in (grouped, alone):
        ran, steps = set(), set()
        real_group, real_step = engine.kv.run_prompt_group, engine.kv.step

        def group(jobs, real=real_group, ran=ran):
            ran.add((1 << (len(jobs) - 1).bit_length(), max(j.next_tokens for j in jobs)))
            return real(jobs)

        def step(tokens, active, sampling, real=real_step, steps=steps, kv=engine.kv):
            out = real(tokens, active, sampling)
            steps.add((kv.last_rows, bool(sampling.sampled)))
            return out

        monkeypatch.setattr(engine.kv, "run_prompt_group", group)
        monkeypatch.setattr(engine.kv, "step", step)
        engine.start()
        try:
            done = engine.warm_up()
        finally:
            engine.stop()
        assert done["bursts"] > 0 and done["requests"] >= done["bursts"]
        assert ran == (set(want_groups) if engine is grouped else set())
        assert {(r, s) for r in (1, 2, 4) for s in (False, True)} <= steps
        stats = engine.stats()
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and stats["running"] == 0


def test_serve_flag_warms_up_in_the_background(model, monkeypatch):
    """--warm-up runs Engine.warm_up in a thread once the engine serves (default: with
    --precompile, off on a CPU); its failure is reported, and serving goes on."""
    from models.cli import serve

    calls = []

    class Fake:
        def warm_up(self):
            calls.append("warm")
            return {"requests": 3, "bursts": 2, "seconds": 0.1}

    serve.warm_up_in_background(Fake())
    assert calls == ["warm"]

    class Broken:
        def warm_up(self):
            raise RuntimeError("no")

    serve.warm_up_in_background(Broken())  # says so on stderr, does not raise
    args = serve.build_parser().parse_args(["--model", "smollm2-135m", "--warm-up"])
    assert args.warm_up is True
    assert serve.build_parser().parse_args(["--model", "smollm2-135m"]).warm_up is None
