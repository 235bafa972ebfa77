"""Chunks cut by layers (``Engine(chunk_parts=N)``, the paged engine's chunked prefill): each
chunk of a prompt longer than a chunk runs its layers in N parts over N iterations, the hidden
state carried between them. The same prompt gives the same pages, method state and logits as
whole chunks; served beside decoding requests, every request gets the tokens it gets alone; the
precompiled programs cover the parts; bad options are refused before anything is built."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from models.serving.engine import Engine
from models.serving.paged import PagedChunkJob
from models.serving.requests import SamplingParams
from tests.test_engine import _tiny_config

MAX_LEN = 256


@pytest.fixture(scope="module")
def tiny():
    return models.load_model(config=_tiny_config(), dtype=jnp.float32)


def _prefill(model, ids, parts: int):
    """The logits of ``ids`` prefilled in chunks of 64 by a PagedChunkJob into slot 0, the
    iterations it took, and the pool's rows of its pages and slot 0's state, per layer."""
    engine = Engine(model, slots=2, max_len=MAX_LEN, stop_ids=(), paged=True, prefill_chunk=64, chunk_parts=parts)
    kv = engine.kv
    r = engine.make_request(ids, SamplingParams(max_tokens=2))
    assert kv.reserve(r, len(ids) + 1)
    job = PagedChunkJob(kv, ids, 0, r, 64)
    steps = 0
    while not job.done:
        job.advance_budget()
        steps += 1
    logits, row = job.result()
    table = kv.blocks.table(r.id)
    layers = []
    for e in kv.cache.layers:
        pages = np.asarray(e.pool_k)[0].reshape(e.pool_k.shape[1], -1, e.page, e.pool_k.shape[3])
        k = pages[:, table].reshape(pages.shape[0], -1, pages.shape[3])[:, :len(ids)]
        state = [np.asarray(a)[0] for a in jax.tree.leaves(e.state)]
        layers.append((k, state))
    return np.asarray(logits), steps, layers, int(np.asarray(kv.cache.lengths)[0])


# One case, Quest after Token Sparse Attention's chunk form: its layer 0 is plain Quest's chunk
# prefill and layers 1-2 TSA's, so each part runs one of the two prefill paths with method state.
# (It ran beside a "dense" and a "quest" case, 24 s of CI, 2026-12: plain Quest's chunk prefill
# and state are layer 0's here; dense parts give each request its whole-chunk tokens in
# test_parts_beside_decoding_requests_give_each_its_tokens and serve_load's run below.)
@pytest.mark.parametrize("method", ["quest+tsa"])
def test_parts_write_what_whole_chunks_write(tiny, method):
    """A 200-token prompt (4 chunks of 64) in 1, 2 and 3 parts (the tiny model's 3 layers: one
    a part): the same last-token logits, every layer's K/V in its pages and method state in its
    slot, the slot's length, in chunks x parts iterations; Token Sparse Attention's chunk form
    on layers 1-2 (its kept keys by one argsort), plain Quest's on layer 0."""
    tsa = (("min_tokens", 16), ("window", 16), ("layers", (1, 2)), ("tau", 0.3), ("chunk_select", "argsort"))
    # Quest on every layer: each part's layers have method state, so a part that wrote the other
    # parts' (empty) states into the slot would show
    model = {"quest+tsa": tiny.with_method("quest", budget=64, dense_layers=(), prefill="token_sparse",
                                           prefill_options=tsa)}[method]
    ids = np.random.default_rng(5).integers(4, 97, 200).tolist()
    base_logits, base_steps, base_layers, base_len = _prefill(model, ids, 1)
    assert base_steps == 4 and base_len == 200
    for parts in (2, 3):
        logits, steps, layers, length = _prefill(model, ids, parts)
        assert steps == 4 * parts and length == 200
        np.testing.assert_allclose(logits, base_logits, atol=1e-5, rtol=1e-5)
        for (k, state), (k0, state0) in zip(layers, base_layers):
            np.testing.assert_allclose(k, k0, atol=1e-5)
            assert len(state) == len(state0) and state
            for a, b in zip(state, state0):
                np.testing.assert_allclose(a, b, atol=1e-5)


def test_parts_beside_decoding_requests_give_each_its_tokens(tiny):
    """Served: a long prompt prefilled in parts while short ones decode (and a short prompt,
    one chunk, runs whole): every request gets the tokens the whole-chunk engine gives it; the
    precompiled programs cover every part (no call compiles)."""
    rng = np.random.default_rng(9)
    prompts = [rng.integers(4, 97, n).tolist() for n in (30, 180, 50, 150)]
    outs = {}
    for parts in (1, 3):
        engine = Engine(tiny, slots=4, max_len=MAX_LEN, stop_ids=(), paged=True, prefill_chunk=64,
                        chunk_parts=parts)
        names = [name for name, *_ in engine.kv.program_shapes()]
        assert any(", layers 1-1" in n for n in names) == (parts == 3)
        engine.precompile()
        engine.start()
        try:
            reqs = engine.submit_all([engine.make_request(p, SamplingParams(max_tokens=8)) for p in prompts])
            for r in reqs:
                assert r.done.wait(300) and r.finish_reason == "length", r.error
        finally:
            engine.stop()
        assert engine.kv.aot.jit_calls == 0
        outs[parts] = [r.output_ids for r in reqs]
        stats = engine.stats()
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert outs[3] == outs[1]


def test_chunk_parts_refused_where_they_cannot_run(tiny):
    with pytest.raises(ValueError, match="chunk_parts"):
        Engine(tiny, slots=2, max_len=MAX_LEN, paged=True, chunk_parts=2)  # no chunks
    with pytest.raises(ValueError, match="chunk_parts"):
        Engine(tiny, slots=2, max_len=MAX_LEN, paged=True, prefill_chunk=64, chunk_parts=4)  # 3 layers
    with pytest.raises(ValueError, match="chunk_parts"):
        Engine(tiny, slots=2, max_len=MAX_LEN, paged=True, prefill_chunk=64, chunk_parts=0)


def test_server_and_load_benchmark_flags(tmp_path):
    """--prefill-chunk-parts reaches the server's engine (refused off the paged resident
    engine); serve_load --chunk-parts runs and records it, and is refused without a chunked engine."""
    import json

    from benchmarks import serve_load
    from models.cli import serve

    parser = serve.build_parser()
    args = parser.parse_args(["--model", "smollm2-135m", "--offload", "--prefill-chunk-parts", "2"])
    with pytest.raises(ValueError, match="--prefill-chunk-parts"):
        serve.make_engine(args)
    rc = serve_load.main(["--tiny", "--methods", "dense:paged-chunked", "--prefill-chunk", "64", "--chunk-parts", "3",
                          "--prompt-mix", "200:1", "--output-min", "2", "--output-max", "4", "--slots", "2",
                          "--rates", "4", "--requests", "3", "--time-limit", "60", "--out", str(tmp_path),
                          "--name", "p"])
    assert rc == 0
    run = json.loads((tmp_path / "p.json").read_text())["runs"][0]
    assert run["chunk_parts"] == 3 and run["rows"][0]["completed"] == 3
    assert run["prefill_segments"] > 3 * 2  # each prompt of >64 tokens: chunks x 3 parts
    with pytest.raises(SystemExit):
        serve_load.main(["--tiny", "--methods", "dense:paged", "--chunk-parts", "2"])
