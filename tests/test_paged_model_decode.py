"""Paged KV in the model's decode step: the same prefilled cache, its global layers' K/V
moved into one page pool shared by the batch (rows' pages in random order, the null page
padding nothing: every row's table is full), decodes to the same logits (1e-5) and the same
greedy tokens as the contiguous cache, for every registered method, across page boundaries
and for rows of different lengths (a small random model; f32 on CPU)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparse_jax.cache import PagedLayer, page_cache, paged_like
from sparse_jax.methods import available_methods
from test_engine import _OPTIONS, _tiny_config

MAX_LEN, PAGE, STEPS = 256, 16, 24


@pytest.fixture(scope="module")
def tiny():
    import models

    return models.load_model(config=_tiny_config(), dtype=jnp.float32)


@pytest.mark.parametrize("name", sorted(available_methods()))
def test_paged_decode_equals_contiguous(tiny, name):
    assert name in _OPTIONS, f"add options for the new method {name!r}"
    model = tiny.with_method(name, **_OPTIONS[name])
    rng = np.random.default_rng(5)
    lens = np.array([150, 141], np.int32)  # rows cross pages at different steps
    tokens = np.full((2, 192), 0, np.int32)
    for b, n in enumerate(lens):
        tokens[b, :n] = rng.integers(4, 97, n)
    logits, cache = model.fns.prefill(model.params, jnp.asarray(tokens), jnp.asarray(lens),
                                      model.init_cache(2, MAX_LEN))
    w = MAX_LEN // PAGE
    table = rng.permutation(np.arange(1, 2 * w + 1)).reshape(2, w).astype(np.int32)
    # its own copy: decode_step donates each cache, and the paged one shares the method state's buffers
    paged = page_cache(jax.tree.map(jnp.copy, cache), table, 2 * w + 1, PAGE)
    assert sum(isinstance(e, PagedLayer) for e in paged.layers) == model.config.num_layers
    tok = jnp.argmax(logits, -1).astype(jnp.int32)
    tok_p = tok
    for step in range(STEPS):
        lg, cache = model.fns.decode_step(model.params, tok, cache)
        lg_p, paged = model.fns.decode_step(model.params, tok_p, paged)
        np.testing.assert_allclose(np.asarray(lg_p), np.asarray(lg), atol=1e-5, rtol=1e-5, err_msg=f"step {step}")
        tok, tok_p = jnp.argmax(lg, -1).astype(jnp.int32), jnp.argmax(lg_p, -1).astype(jnp.int32)
        np.testing.assert_array_equal(np.asarray(tok_p), np.asarray(tok))
    assert (np.asarray(paged.lengths) == lens + STEPS).all()


@pytest.mark.parametrize("name", sorted(available_methods()))
def test_prefill_into_pages_equals_contiguous(tiny, name):
    """The model's prefill into a paged cache (what the paged engine runs: no one-row cache)
    gives the contiguous prefill's logits, its K/V in each row's pages (a row holding only
    its prompt's pages, the rest of its table null) and the same method state."""
    model = tiny.with_method(name, **_OPTIONS[name])
    rng = np.random.default_rng(6)
    lens = np.array([150, 37], np.int32)
    tokens = np.zeros((2, 192), np.int32)
    for b, n in enumerate(lens):
        tokens[b, :n] = rng.integers(4, 97, n)
    logits, cache = model.fns.prefill(model.params, jnp.asarray(tokens), jnp.asarray(lens),
                                      model.init_cache(2, MAX_LEN))
    w = MAX_LEN // PAGE
    held = -(-lens // PAGE) + 1  # its prompt's pages and one more, as the engine reserves
    free = rng.permutation(np.arange(1, 2 * w + 1))
    table = np.zeros((2, w), np.int32)
    table[0, :held[0]], table[1, :held[1]] = free[:held[0]], free[held[0]:held[0] + held[1]]
    empty = jax.jit(lambda: paged_like(model.init_cache(2, MAX_LEN), 2 * w + 1, PAGE))()
    empty = dataclasses.replace(empty, block_table=jnp.asarray(table))
    logits_p, paged = model.fns.prefill(model.params, jnp.asarray(tokens), jnp.asarray(lens), empty)
    np.testing.assert_allclose(np.asarray(logits_p), np.asarray(logits), atol=1e-5, rtol=1e-5)
    assert (np.asarray(paged.lengths) == lens).all()
    for e, p in zip(cache.layers, paged.layers):
        if not isinstance(p, PagedLayer):
            jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5), e, p)
            continue
        for x, pool in ((e.k, p.pool_k), (e.v, p.pool_v)):
            pages = np.asarray(pool)[0].reshape(x.shape[1], -1, PAGE, x.shape[3])
            for b, n in enumerate(lens):
                got = pages[:, table[b, :held[b]]].reshape(x.shape[1], -1, x.shape[3])[:, :n]
                np.testing.assert_allclose(got, np.asarray(x[b, :, :n]), atol=1e-5)
            assert not np.asarray(pages[:, 0]).any(), "the null page was written"
        jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5),
                     e.state, p.state)


@pytest.mark.parametrize("name", sorted(available_methods()))
def test_chunked_prefill_into_pages_equals_whole(tiny, name):
    """A prompt prefilled 64 tokens per call through every layer straight into its pages
    (:class:`models.serving.paged.PagedChunkJob`, what ``Engine(prefill_chunk=64)`` runs)
    gives the whole prefill's logits and K/V in its pages, and a cache that decodes to the
    same logits and tokens (its method state equal wherever it is read: past the prompt the
    whole prefill holds its padding's, the chunked one zeros); a method whose prompt
    attention cannot be chunked is refused with a clear error."""
    from models.serving.engine import Engine
    from models.serving.paged import PagedChunkJob, check_chunked_prefill
    from models.serving.requests import SamplingParams

    model = tiny.with_method(name, **_OPTIONS[name])
    try:
        check_chunked_prefill(model)
    except ValueError as e:
        assert name in ("kascade",) and "cannot run in chunks" in str(e), (name, e)
        with pytest.raises(ValueError, match="cannot run in chunks"):
            Engine(model, slots=2, max_len=MAX_LEN, paged=True, prefill_chunk=64)
        return
    engine = Engine(model, slots=2, max_len=MAX_LEN, stop_ids=(), paged=True, prefill_chunk=64)
    kv = engine.kv
    ids = np.random.default_rng(7).integers(4, 97, 150).tolist()
    reqs = [engine.make_request(ids, SamplingParams(max_tokens=STEPS + 2)) for _ in range(2)]  # pages for the decode
    for r in reqs:
        assert kv.reserve(r, len(ids) + 1)
    whole, _ = kv.prefill(ids, 0, reqs[0])
    job = PagedChunkJob(kv, ids, 1, reqs[1], 64)
    while not job.done:
        job.advance_budget()
    chunked, row = job.result()
    assert job.chunks == 3 and row.slot == 1 and row.tokens == 150
    np.testing.assert_allclose(np.asarray(chunked), np.asarray(whole), atol=1e-5, rtol=1e-5)
    assert (np.asarray(kv.cache.lengths) == [150, 150]).all()
    tables = [kv.blocks.table(r.id) for r in reqs]
    for e in kv.cache.layers:
        assert isinstance(e, PagedLayer)
        for pool in (e.pool_k, e.pool_v):
            _, hkv, n, d = pool.shape
            pages = np.asarray(pool)[0].reshape(hkv, n // e.page, e.page, d)
            got = [pages[:, t].reshape(hkv, -1, d)[:, :150] for t in tables]
            np.testing.assert_allclose(got[1], got[0], atol=1e-5)
    # both rows decode on: the same logits and tokens
    cache = dataclasses.replace(kv.cache, block_table=jnp.asarray(np.stack(tables)))
    tok = jnp.argmax(jnp.concatenate([whole, chunked]), -1).astype(jnp.int32)
    for step in range(STEPS):
        lg, cache = model.fns.decode_step(model.params, tok, cache)
        np.testing.assert_allclose(np.asarray(lg[1]), np.asarray(lg[0]), atol=1e-5, rtol=1e-5, err_msg=f"step {step}")
        tok = jnp.argmax(lg, -1).astype(jnp.int32)
        assert int(tok[0]) == int(tok[1])


def test_chunked_prefill_runs_token_sparse_attention_in_chunks(tiny, monkeypatch):
    """Token Sparse Attention's prefill (layers 1 and 2) through the paged chunked prefill: each
    chunk of a TSA layer runs TSA's chunk form (its window keeps part of the prefix: the chunks
    after the first drop keys), layer 0's K/V in the pages equal the whole prefill's, and with
    nothing to drop (``tau`` 0) the chunked prefill gives the whole prefill's logits."""
    from models.serving.engine import Engine
    from models.serving.paged import PagedChunkJob
    from models.serving.requests import SamplingParams
    from sparse_jax import prefill as tsa

    calls = []
    real = tsa.chunk_kept_keys

    def counting(*args, **kwargs):
        kept, keep = real(*args, **kwargs)
        calls.append(keep)
        return kept, keep

    monkeypatch.setattr(tsa, "chunk_kept_keys", counting)
    ids = np.random.default_rng(11).integers(4, 97, 150).tolist()
    out = {}
    for tau in (0.3, 0.0):
        opts = (("min_tokens", 16), ("window", 16), ("layers", (1, 2)), ("tau", tau))
        model = tiny.with_method("quest", budget=64, prefill="token_sparse", prefill_options=opts)
        engine = Engine(model, slots=2, max_len=MAX_LEN, stop_ids=(), paged=True, prefill_chunk=64)
        kv = engine.kv
        reqs = [engine.make_request(ids, SamplingParams(max_tokens=2)) for _ in range(2)]
        for r in reqs:
            assert kv.reserve(r, len(ids) + 1)
        whole, _ = kv.prefill(ids, 0, reqs[0])
        calls.clear()
        job = PagedChunkJob(kv, ids, 1, reqs[1], 64)
        while not job.done:
            job.advance_budget()
        chunked, _ = job.result()
        assert len(calls) == 3 * 2  # traced once per chunk program and TSA layer (3 programs: 2 kv buckets x last)
        assert np.isfinite(np.asarray(chunked)).all()
        tables = [kv.blocks.table(r.id) for r in reqs]
        e = kv.cache.layers[0]  # before any TSA layer: the same K/V
        pages = np.asarray(e.pool_k)[0].reshape(e.pool_k.shape[1], -1, e.page, e.pool_k.shape[3])
        got = [pages[:, t].reshape(pages.shape[0], -1, pages.shape[3])[:, :150] for t in tables]
        np.testing.assert_allclose(got[1], got[0], atol=1e-5)
        out[tau] = np.asarray(chunked), np.asarray(whole)
    np.testing.assert_allclose(out[0.0][0], out[0.0][1], atol=1e-5, rtol=1e-5)  # nothing dropped: exact
    assert np.abs(out[0.3][0] - out[0.0][0]).max() > 1e-4  # tau 0.3 dropped prefix keys

