"""The offloaded KV on a paged host tier (issue 49): ``TieredRunner(host_pages=N)`` keeps each
offloaded layer's host blocks in a pool of pages shared by the rows through a block table, and
decodes exactly as the contiguous host tier does (greedy tokens equal, logits within 1e-5, on
scattered pages, across block completions); the engine on it (``Engine(paged=True,
offload=True)``) gives every request its tokens alone, frees and reuses pages, and preempts
when the host pages run out. CPU, f32, tiny random models."""

from __future__ import annotations

import numpy as np
import pytest

from models.runtime.tiered import HostPages, OutOfHostPages, TieredRunner
from tests.test_offload import _ragged_tokens, _resident_run, _tiny_model

MAX_LEN = 256


def _scattered_pages(monkeypatch, seed=0):
    """The runner's own pages handed out in a random order (not one run per row)."""
    real = HostPages.__init__

    def init(self, *a, **k):
        real(self, *a, **k)
        if self.free is not None:
            np.random.default_rng(seed).shuffle(self.free)

    monkeypatch.setattr(HostPages, "__init__", init)


def _pages_needed(lengths, steps, bs):
    """Pages a batch holds after ``steps`` steps: each row's blocks up to the last position written."""
    return int(sum((int(n) + steps - 1) // bs + 1 for n in lengths))


def _check_paged_equals_contiguous(model, pool, steps, monkeypatch, seed):
    tokens, lengths = _ragged_tokens(seed)
    ref_ids, ref_logits, _ = TieredRunner(model, "offload", pool_slots=pool).generate_ids(tokens, lengths, steps,
                                                                                        MAX_LEN)
    bs = model.method.for_offload().offload_block_size
    need = _pages_needed(lengths, steps, bs)
    _scattered_pages(monkeypatch, seed)
    runner = TieredRunner(model, "offload", pool_slots=pool, host_pages=need + 1)  # exactly enough, and the null page
    ids, lg, state = runner.generate_ids(tokens, lengths, steps, MAX_LEN)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(ref_ids))
    np.testing.assert_allclose(np.asarray(lg), np.asarray(ref_logits), atol=1e-5, rtol=0)
    # the host holds the blocks that exist: every page given out, the table a prefix per row
    assert len(state.pages.free) == 0 and state.pages.held().sum() == need
    hosts = [h for h in state.host if h is not None]
    assert hosts and all(h.paged and h.k.shape[0] == need + 1 and h.k.sharding.memory_kind == "pinned_host"
                         for h in hosts)
    assert sum(runner.transfer_stats(state)["misses_per_step"][1:]) > 0  # blocks came back from the pages
    contiguous = 3 * MAX_LEN // bs  # blocks per layer of the contiguous tier
    assert need + 1 < contiguous
    # dropping the saves of completed blocks breaks it (the test can fail)
    runner = TieredRunner(model, "offload", pool_slots=pool, host_pages=need + 1)
    runner._store_pending = lambda state: state.pending.clear()
    _, lg, _ = runner.generate_ids(tokens, lengths, steps, MAX_LEN)
    assert np.abs(np.asarray(lg) - np.asarray(ref_logits)).max() > 1e-2
    return ref_ids, ref_logits, tokens, lengths


def test_paged_host_tier_equals_contiguous_quest(monkeypatch):
    """Quest (the synchronous fetch path), the smallest pool (evictions every step), a ragged
    batch whose rows complete blocks of 8 while decoding: the paged host tier gives the
    contiguous tier's tokens and logits, and those are the resident model's."""
    from sparse_jax.methods import get_method

    model = _tiny_model(get_method("quest", budget=64, block_size=8, dense_layers=(0,)))
    ids, logits, tokens, lengths = _check_paged_equals_contiguous(model, 8, 20, monkeypatch, seed=5)
    res_ids, res_logits = _resident_run(model, tokens, lengths, 20, MAX_LEN)
    np.testing.assert_array_equal(np.asarray(ids), res_ids)
    np.testing.assert_allclose(np.asarray(logits), res_logits, atol=1e-5, rtol=0)


def test_paged_host_tier_equals_contiguous_asynctls_lag(monkeypatch):
    """AsyncTLS with its one-step lag (the prefetch path) on the smallest pool."""
    from sparse_jax.methods import get_method

    chans = ((tuple(range(0, 16, 4)), tuple(range(1, 16, 4))),) * 3
    model = _tiny_model(get_method("asynctls", channels_per_layer=chans, budget=32, block_size=8, kb=8, lag=True,
                                   dense_layers=(0,)))
    _check_paged_equals_contiguous(model, 7, 20, monkeypatch, seed=7)


def _other_offloaded_model(name):
    """The other methods that run offloaded, as their own offload tests configure them."""
    from sparse_jax.methods import get_method

    if name == "arkvale":
        return _tiny_model(get_method("arkvale", budget=64, block_size=8, dense_layers=(0,))), 8
    if name == "reuse_previous_layer":  # a method that reuses the previous layer's selection (the carry)
        from tests.test_offload import ReusePreviousLayer

        return _tiny_model(ReusePreviousLayer(budget=64, block_size=8, dense_layers=(0,)), num_layers=4), 8
    if name == "kascade":  # its reuse layers follow the lagged AsyncTLS anchors' prefetch
        from tests import test_kascade

        return test_kascade._tiny_model(test_kascade._composed(), max_len=4096), 3
    if name.startswith("asyncspade"):
        opts = dict(budget=32, window=4, dense_layers=(0,))
        if name == "asyncspade-quest":
            opts.update(selector="quest", selector_options=(("block_size", 8),))
        else:
            chans = ((tuple(range(0, 16, 4)), tuple(range(1, 16, 4))),) * 3
            opts.update(selector="double_sparsity", selector_options=(("channels_per_layer", chans),),
                        prefetch_block_size=8)
        return _tiny_model(get_method("asyncspade", **opts)), 4 if name == "asyncspade-quest" else 31
    raise AssertionError(name)


@pytest.mark.parametrize("name", ["arkvale", "reuse_previous_layer", "kascade", "asyncspade-quest",
                                  "asyncspade-double_sparsity"])
def test_paged_host_tier_equals_contiguous_for_the_other_offloaded_methods(name, monkeypatch):
    """Every other method that runs offloaded: the paged host tier (scattered pages, exactly
    enough) gives the contiguous tier's greedy tokens, logits within 1e-5."""
    model, pool = _other_offloaded_model(name)
    tokens, lengths = _ragged_tokens(8)
    steps = 20
    ref_ids, ref_logits, _ = TieredRunner(model, "offload", pool_slots=pool).generate_ids(tokens, lengths, steps,
                                                                                        MAX_LEN)
    bs = model.method.for_offload().offload_block_size
    need = _pages_needed(lengths, steps, bs)
    _scattered_pages(monkeypatch, 8)
    runner = TieredRunner(model, "offload", pool_slots=pool, host_pages=need + 1)
    ids, lg, state = runner.generate_ids(tokens, lengths, steps, MAX_LEN)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(ref_ids))
    np.testing.assert_allclose(np.asarray(lg), np.asarray(ref_logits), atol=1e-5, rtol=0)
    assert len(state.pages.free) == 0 and sum(runner.transfer_stats(state)["misses_per_step"][1:]) > 0


def test_paged_host_tier_refuses_on_the_host():
    """Bad options, a pool too small for the prompts, and a caller's table that misses a page a
    step needs: errors on the host, before anything runs on the device."""
    from sparse_jax.methods import get_method

    model = _tiny_model(get_method("quest", budget=64, block_size=8, dense_layers=(0,)))
    for bad in (1, 0, True, 2.5):
        with pytest.raises(ValueError, match="host_pages must be an int >= 2"):
            TieredRunner(model, "offload", host_pages=bad)
    with pytest.raises(ValueError, match='mode="offload"'):
        TieredRunner(model, "resident", host_pages=8)
    tokens, lengths = _ragged_tokens(5)
    with pytest.raises(OutOfHostPages, match="more host pages"):
        TieredRunner(model, "offload", host_pages=20).prefill(tokens, lengths, MAX_LEN)  # 12 + 8 + 10 blocks
    # the caller keeps the table (a serving engine): a row without its pages cannot step
    runner = TieredRunner(model, "offload", host_pages=40)
    bs = runner.method.offload_block_size
    pages = HostPages(40, 3, MAX_LEN // bs, own=False)

    def kv(i):
        import jax.numpy as jnp
        shape = (3, 2, MAX_LEN, 16)
        return jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32), jnp.zeros((3, 4, 16), jnp.float32)

    state = runner.state_from_kv(kv, np.ones(3, np.int32), MAX_LEN, pages=pages)
    assert state.pages is pages and not pages.dirty
    pages.set_row(1, np.r_[[5], np.zeros(MAX_LEN // bs - 1, np.int32)])
    with pytest.raises(ValueError, match=r"rows \[0\] step without the host pages"):
        runner.decode_step(np.zeros(3, np.int32), state, active=np.array([True, True, False]))
    assert pages.dirty  # nothing was sent
    runner.finish(state)


# -- the engine on it: Engine(paged=True, offload=True) ----------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    import jax.numpy as jnp

    import models
    from tests.test_engine import _tiny_config

    return models.load_model(config=_tiny_config(), dtype=jnp.float32)


HOST_PAGES = 17  # one request of max_len (16 blocks of 16) and the null page: the smallest pool, shared compiles


def _serve(model, prompts, steps, engine=None, **kw):
    """Every prompt through an offloaded paged engine of 2 slots (``engine``'s, not started, or a
    new one); ``(requests, engine, owners)``, ``owners``: page -> the request ids that held it
    (the reserve calls seen)."""
    from models.serving.engine import Engine
    from models.serving.requests import SamplingParams

    if engine is None:
        engine = Engine(model, slots=2, max_len=MAX_LEN, stop_ids=(), paged=True, offload=True,
                        host_pages=HOST_PAGES, **kw)
    owners: dict[int, set] = {}
    real = engine.kv.blocks.reserve

    def reserve(rid, tokens):
        added = real(rid, tokens)
        for p in added:
            owners.setdefault(p, set()).add(rid)
        return added

    engine.kv.blocks.reserve = reserve
    insert = engine.kv.insert

    def checked_insert(row, slot, r):
        # the prompt's blocks are in the engine's page pools already: the row has no host tier of its own
        for mine, big in zip(row.host, engine.kv.state.host):
            assert (mine is None) == (big is None) and (mine is None or (mine.k is big.k and mine.v is big.v))
        return insert(row, slot, r)

    engine.kv.insert = checked_insert
    engine.start()
    try:
        reqs = [engine.submit(engine.make_request(i, SamplingParams(max_tokens=steps))) for i in prompts]
        for r in reqs:
            assert r.done.wait(300), r
        assert engine.idle()
    finally:
        engine.stop()
    return reqs, engine, owners


def _alone(model, prompts, steps):
    return [model.generate_ids(np.asarray([i], np.int32), np.asarray([len(i)], np.int32), max_new_tokens=steps,
                               stop_ids=())[0] for i in prompts]


def _check_drained(engine):
    s = engine.stats()
    assert s["kv_blocks_free"] == s["kv_blocks_total"] == HOST_PAGES - 1
    engine.kv.check()
    assert (engine.kv.state.pages.table == 0).all()  # every slot back on the null page
    hosts = [h for h in engine.kv.state.host if h is not None]
    assert hosts and all(h.paged and h.k.shape[0] == HOST_PAGES for h in hosts)


def test_offloaded_paged_engine_quest_matches_single_requests(tiny):
    """Four requests of mixed lengths on two slots and a host pool of one max_len request: each
    request's greedy tokens equal ``generate_ids`` alone; blocks complete and are saved into pages
    while decoding, pages freed by an ended request are given to another, and afterwards every
    page is free and every slot's table row is the null page."""
    model = tiny.with_method("quest", budget=64)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(4, 97, n).tolist() for n in (150, 40, 97, 63)]
    steps = 20  # every request crosses at least one 16-token block boundary while decoding
    reqs, engine, owners = _serve(model, prompts, steps)
    assert [r.output_ids for r in reqs] == _alone(model, prompts, steps)
    assert any(len(ids) > 1 for ids in owners.values())  # a freed page was reused
    assert engine.stats()["blocks_loaded"] > 0
    _check_drained(engine)


def test_offloaded_paged_engine_preempts_and_recomputes(tiny):
    """Two requests that fit the host pool at admission but not grown: the newest is preempted
    (its pages freed, requeued first) and recomputed; every request gets its tokens alone."""
    model = tiny.with_method("quest", budget=64)
    rng = np.random.default_rng(4)
    # 7 pages each to admit (prompt and first position), 9 each after 20 steps: 18 > 16
    prompts = [rng.integers(4, 97, n).tolist() for n in (111, 110, 40)]
    steps = 20
    reqs, engine, _ = _serve(model, prompts, steps)
    assert [r.output_ids for r in reqs] == _alone(model, prompts, steps)
    assert engine.stats()["preempted"] >= 1 and reqs[1].preemptions >= 1 and reqs[0].preemptions == 0
    _check_drained(engine)


def test_offloaded_paged_engine_asynctls_lag(tiny):
    """AsyncTLS offloaded (its one-step lag: the prefetch path) equals the resident lagged method
    alone, through page reuse and a layer-segmented prefill."""
    from tests.test_engine import _OPTIONS

    model = tiny.with_method("asynctls", **_OPTIONS["asynctls"], lag=True)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(4, 97, n).tolist() for n in (140, 70, 90)]
    steps = 18
    reqs, engine, owners = _serve(model, prompts, steps, max_inject_tokens=200)
    assert [r.output_ids for r in reqs] == _alone(model, prompts, steps)
    assert any(len(ids) > 1 for ids in owners.values())
    _check_drained(engine)


def test_offloaded_paged_engine_refuses_before_allocating(tiny):
    from models.serving.engine import Engine
    from sparse_jax.offload.capacity import CapacityError

    model = tiny.with_method("quest", budget=64)
    with pytest.raises(CapacityError, match="at least 17 host pages"):
        Engine(model, slots=2, max_len=MAX_LEN, paged=True, offload=True, host_pages=16)
    with pytest.raises(ValueError, match="host_pages must be an int"):
        Engine(model, slots=2, max_len=MAX_LEN, paged=True, offload=True, host_pages=1)
    with pytest.raises(ValueError, match="pass paged=True, offload=True"):
        Engine(model, slots=2, max_len=MAX_LEN, offload=True, host_pages=40)
    with pytest.raises(ValueError, match="pass host_pages"):
        Engine(model, slots=2, max_len=MAX_LEN, paged=True, offload=True, kv_blocks=40)
    with pytest.raises(ValueError, match="max_inject_tokens"):
        Engine(model, slots=2, max_len=MAX_LEN, paged=True, offload=True, prefill_chunk=64)
    with pytest.raises(ValueError, match="offloads no layer"):  # every layer dense: nothing to page
        Engine(tiny.with_method("quest", budget=64, dense_layers=(0, 1, 2)), slots=2, max_len=MAX_LEN, paged=True,
               offload=True)
    engine = Engine(model, slots=2, max_len=MAX_LEN, paged=True, offload=True)  # default: every slot full
    assert engine.stats()["kv_blocks_total"] == 2 * MAX_LEN // 16
    assert engine.stats()["kv_bound"] == "slots", engine.kv.kv_plan
    small = Engine(model, slots=2, max_len=MAX_LEN, paged=True, offload=True, host_pages=MAX_LEN // 16 + 1)
    assert small.stats()["kv_bound"] == "asked" and "host memory: 1 request of" in small.kv.kv_plan, small.kv.kv_plan


def test_offloaded_paged_engine_leaves_the_host_budget_room_for_staging(tiny, monkeypatch):
    """A host budget that cannot hold every slot full: the default host pages are as many as fit
    beside a prefill's pinned staging buffers, so pages and staging together (the capacity
    check's host terms) fit the budget. They took the whole budget before, and a GPU's check
    then refused the batch by the staging (H100, 2026-12-06: 9 GiB over 106 at 128K)."""
    from models.serving.engine import Engine
    from sparse_jax.offload import capacity

    model = tiny.with_method("quest", budget=64)
    full = Engine(model, slots=4, max_len=MAX_LEN, paged=True, offload=True)
    runner = full.kv.runner
    host = runner.footprint(4, MAX_LEN).host
    page_bytes = full.kv.page_bytes
    budget = host["kv_pages"] // 2 + host["prefill_staging"]  # half the full pages, beside the staging
    monkeypatch.setattr(capacity, "host_budget", lambda *a, **k: budget)
    engine = Engine(model, slots=4, max_len=MAX_LEN, paged=True, offload=True)  # refused here before
    pages = engine.kv.runner.host_pages
    assert pages == (budget - host["prefill_staging"]) // page_bytes  # not budget // page_bytes
    assert sum(engine.kv.runner.footprint(4, MAX_LEN).host.values()) <= budget
    assert engine.stats()["kv_bound"] == "host memory", engine.kv.kv_plan
    engine.kv.runner.check_capacity(4, MAX_LEN, device_limit=None, host_limit=budget)


def test_the_pinned_pool_model_places_what_the_h100_placed():
    """:func:`capacity.bfc_fits`, the model of XLA's growing pinned-host allocator, against the
    GPU (H100, 2026-12-07): under a 105 GiB pool, 68 page arrays of 1,613,496,320 bytes (12,310
    pages) passed the budget by 0.01 GiB and the 68th failed to allocate; under 106 GiB, 68 arrays
    of 12,091 pages had run (2026-12-07 00:38). Power-of-two arrays pack every region."""
    from sparse_jax.offload.capacity import GiB, bfc_fits, pages_the_pool_places

    page = 8 * 64 * 128 * 2  # one page of one layer's K: 8 KV heads x 64 tokens x 128 x bf16
    assert bfc_fits(105 * GiB, [12_310 * page] * 68) == 67
    assert bfc_fits(106 * GiB, [12_091 * page] * 68) == 68
    assert bfc_fits(64 * GiB, [GiB] * 64) == 64  # regions of 1, 1, 2, 4, ... GiB: nothing stranded
    assert bfc_fits(GiB, [GiB + 1]) == 0 and bfc_fits(GiB, []) == 0
    # the pages planned under the 105 GiB pool: fewer, so that all 68 arrays and the staging place
    got = pages_the_pool_places(12_310, limit=105 * GiB, page_bytes=68 * page, arrays=68,
                                staging=int(2.81 * GiB / 18), staging_buffers=18)
    assert 11_500 < got < 12_310
    assert bfc_fits(105 * GiB, [got * page] * 68 + [int(2.81 * GiB / 18)] * 18) == 86
    assert bfc_fits(105 * GiB, [(got + 1) * page] * 68 + [int(2.81 * GiB / 18)] * 18) < 86


def test_pinned_pool_probe_puts_the_count_placed_beside_the_model(tmp_path, monkeypatch):
    """``benchmarks.probes.pinned_pool`` (the GPU check of :func:`capacity.bfc_fits`), on the CPU:
    every copy is placed there (no pool), in this process and in the fresh process per size that
    a GPU run uses; the model's column is bfc_fits's count; a CPU run that would copy more than
    1 GiB of ordinary memory is refused before copying."""
    from benchmarks.probes import pinned_pool
    from sparse_jax.offload import capacity

    monkeypatch.setattr(capacity, "BFC_FIRST_REGION", 4096)
    # regions of 16 KiB (grown to fit), 32 KiB and the 56.9 KiB the limit leaves: 1 + 3 + 5 arrays
    [row] = pinned_pool.probe([10_000], 12, 107_374, fresh_process=False)
    assert (row["placed"], row["model"], row["agree"], row["error"]) == (12, 9, False, None)
    [row] = pinned_pool.probe([4096], 3, capacity.GiB, fresh_process=True, limit_gib=1)
    assert (row["placed"], row["model"], row["agree"]) == (3, 3, True), row
    md = pinned_pool.render({"stamp": {"device": "cpu", "jax": "x", "date": "d", "command": "c", "git_commit": "g"},
                             "limit_gib": 1, "pool": False, "rows": [row]})
    assert "| 4,096 | 0.0 | 3 | 3 | 3 | yes |" in md and "agrees on 1 of 1" in md
    with pytest.raises(SystemExit):
        pinned_pool.main(["--limit-gib", "2", "--sizes", str(capacity.GiB), "--out", str(tmp_path)])
    assert not list(tmp_path.iterdir())


def test_offloaded_paged_engine_plans_its_pages_below_the_pinned_pool(tiny, monkeypatch):
    """Where XLA's pinned pool has a limit (a GPU), the default host pages are as many as its
    allocator places whole (:func:`capacity.pages_the_pool_places`), not what the budget's bytes
    hold; asked for more, the engine refuses before allocating. In small: the pool's first region
    4 KiB, so the tiny model's page arrays (33 pages: 67,584 bytes, just over 64 KiB) strand most of
    a region, as 1.50 GiB arrays did on the H100."""
    from models.serving.engine import Engine
    from sparse_jax.offload import capacity

    model = tiny.with_method("quest", budget=64)
    kv = Engine(model, slots=4, max_len=MAX_LEN, paged=True, offload=True).kv
    staging = kv.runner.footprint(4, MAX_LEN).host["prefill_staging"]
    budget = 33 * kv.page_bytes + staging  # the bytes hold 33 pages beside the staging
    monkeypatch.setattr(capacity, "host_budget", lambda *a, **k: budget)
    monkeypatch.setattr(capacity, "pinned_pool_limit", lambda: budget)  # the pool exactly the budget
    monkeypatch.setattr(capacity, "BFC_FIRST_REGION", 4096)
    engine = Engine(model, slots=4, max_len=MAX_LEN, paged=True, offload=True)
    pages, arrays = engine.kv.runner.host_pages, 2 * engine.kv.num_offloaded_layers
    one = capacity.staging_bytes(1, max_len=MAX_LEN, block_size=engine.kv.block_size,
                                 num_kv_heads=model.config.num_kv_heads, head_dim=model.config.head_dim, dtype_bytes=4)
    n_buffers = staging // one
    sizes = lambda n: [n * engine.kv.page_bytes // arrays] * arrays + [one] * n_buffers  # noqa: E731
    assert pages < 33, pages
    assert capacity.bfc_fits(budget, sizes(pages)) == arrays + n_buffers
    assert capacity.bfc_fits(budget, sizes(pages + 1)) < arrays + n_buffers
    with pytest.raises(capacity.CapacityError, match="do not fit the pinned host"):
        Engine(model, slots=4, max_len=MAX_LEN, paged=True, offload=True, host_pages=pages + 1)


def test_offloaded_paged_engine_on_a_shared_pool(tiny):
    """The shared device pool (one per layer and KV head, LRU across slots) over the paged host
    tier: an insertion places the prompt's primed blocks (AsyncTLS's first prefetch) from its
    pages; tokens equal the resident lagged method's alone."""
    from tests.test_engine import _OPTIONS

    model = tiny.with_method("asynctls", **_OPTIONS["asynctls"], lag=True)
    rng = np.random.default_rng(6)
    prompts = [rng.integers(4, 97, n).tolist() for n in (130, 50, 80)]
    steps = 18
    reqs, engine, owners = _serve(model, prompts, steps, pool="shared")
    assert engine.kv.shared
    assert [r.output_ids for r in reqs] == _alone(model, prompts, steps)
    assert any(len(ids) > 1 for ids in owners.values())
    _check_drained(engine)


def test_offloaded_paged_engine_cancellations_return_every_page(tiny):
    """Cancelled while waiting, while decoding, and a request that fails its prefill: their pages
    come back, the others get their tokens alone, and the engine drains to every page free."""
    from models.serving.engine import Engine
    from models.serving.requests import SamplingParams

    model = tiny.with_method("quest", budget=64)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(4, 97, n).tolist() for n in (150, 40, 97, 63)]
    steps = 20
    engine = Engine(model, slots=2, max_len=MAX_LEN, stop_ids=(), paged=True, offload=True, host_pages=HOST_PAGES)
    real = engine.kv.prefill

    def prefill(ids, *a):
        if len(ids) == 97:
            raise RuntimeError("RESOURCE_EXHAUSTED: a prefill that fails")
        return real(ids, *a)

    engine.kv.prefill = prefill
    reqs = [engine.submit(engine.make_request(i, SamplingParams(max_tokens=steps))) for i in prompts]
    engine.cancel(reqs[3])  # waiting: dropped from the queue
    while len(reqs[0].output_ids) < 3:
        engine.iterate()
    assert engine.stats()["kv_blocks_free"] < engine.stats()["kv_blocks_total"]
    engine.cancel(reqs[0])  # decoding: its pages and slot back at the next iteration
    for _ in range(500):
        if engine.idle():
            break
        engine.iterate()
    assert [r.finish_reason for r in reqs] == ["cancelled", "length", "error", "cancelled"]
    assert reqs[1].output_ids == _alone(model, prompts[1:2], steps)[0]
    _check_drained(engine)


def test_offloaded_paged_engine_soak(tiny):
    """A small soak through the engine thread: twelve requests of random lengths and outputs on two
    slots and the smallest host pool (waits for slots and pages, page reuse), two cancelled while
    waiting and three after a random number of their tokens; every other request gets its tokens
    alone, and the engine drains to every page free."""
    from models.serving.engine import Engine
    from models.serving.requests import SamplingParams

    model = tiny.with_method("quest", budget=64)
    rng = np.random.default_rng(11)
    prompts = [rng.integers(4, 97, int(n)).tolist() for n in rng.integers(10, 180, 12)]
    outs = [int(rng.integers(2, 60)) for _ in prompts]
    order = rng.permutation(12)
    early, late = set(order[:2].tolist()), {int(i): int(rng.integers(1, outs[i])) for i in order[2:5]}
    engine = Engine(model, slots=2, max_len=MAX_LEN, stop_ids=(), paged=True, offload=True, host_pages=HOST_PAGES)
    reqs: list = []

    def on_event(i):
        def f(ev):  # on the engine thread: cancel after the request's late[i]-th token
            if i in late and len(reqs[i].output_ids) >= late[i]:
                engine.cancel(reqs[i])
        return f

    reqs += [engine.make_request(p, SamplingParams(max_tokens=k), on_event(i))
             for i, (p, k) in enumerate(zip(prompts, outs))]
    for i in early:
        engine.cancel(reqs[i])
    engine.submit_all(reqs)
    engine.start()
    try:
        for r in reqs:
            assert r.done.wait(300), r
        assert engine.idle()
    finally:
        engine.stop()
    assert engine.stats()["finished"]["cancelled"] == 5
    for i, r in enumerate(reqs):
        if i in early or i in late:
            assert r.finish_reason == "cancelled" and (i in early or len(r.output_ids) >= late[i]), i
            continue
        assert r.finish_reason == "length", (i, r.finish_reason)
        assert r.output_ids == _alone(model, [prompts[i]], outs[i])[0], i
    _check_drained(engine)


@pytest.mark.parametrize("pool", ["per_row", "shared"])
def test_empty_state_is_the_zero_kv_state_without_the_batch_kv(pool):
    """``TieredRunner.empty_state`` (the paged engine's free slots) builds the state that
    ``state_from_kv`` of zero K/V builds, leaf for leaf, with no offloaded layer's batch K/V on
    the device; the capacity check then counts one row's prefill, not the batch's."""
    import jax
    import jax.numpy as jnp

    from sparse_jax.offload import capacity
    from tests.test_offload import _tiny_asynctls_model

    model = _tiny_asynctls_model()
    runner = TieredRunner(model, "offload", host_pages=9, pool=pool)
    cfg, bs, slots = model.config, runner.method.offload_block_size, 3
    pages = lambda: HostPages(9, slots, MAX_LEN // bs, own=False)  # noqa: E731 - every block the null page

    def zeros(i):
        shape = (slots, cfg.num_kv_heads, MAX_LEN, cfg.head_dim)
        return jnp.zeros(shape), jnp.zeros(shape), jnp.zeros((slots, cfg.num_heads, cfg.head_dim))

    want = runner.state_from_kv(zeros, np.ones(slots, np.int32), MAX_LEN, pages=pages())
    got = runner.empty_state(slots, MAX_LEN, pages())
    assert runner.offloaded_layers and jax.tree.structure(got.cache) == jax.tree.structure(want.cache)
    for a, b in zip(jax.tree.leaves(got.cache), jax.tree.leaves(want.cache)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(got.host, want.host):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.k.sharding.memory_kind == "pinned_host"
            np.testing.assert_array_equal(np.asarray(a.k), np.asarray(b.k))
            np.testing.assert_array_equal(np.asarray(a.table), np.asarray(b.table))
    np.testing.assert_array_equal(got.lengths_host, want.lengths_host)
    # what a prefill holds: one row's layer (the engine's), or the batch's (a batch prefill)
    one = capacity.footprint(cfg, model.method, batch=slots, max_len=MAX_LEN, mode="offload", host_pages=9,
                             prefill_rows=1)
    every = capacity.footprint(cfg, model.method, batch=slots, max_len=MAX_LEN, mode="offload", host_pages=9)
    assert every.device["prefill_layer"] == slots * one.device["prefill_layer"] > 0
    with pytest.raises(ValueError, match="paged host tier"):
        TieredRunner(model, "offload").empty_state(slots, MAX_LEN, pages())


def test_prefill_page_stores_overlapped_equal_the_serial_ones(monkeypatch):
    """A prefill's blocks go to their host pages on worker threads while the next layers run
    (``tiered_prefill.PAGE_STORE_THREADS``): the pages hold exactly what the serial store after
    the last layer (``PAGE_STORE_THREADS = 0``, the way before) writes, and the stores did run
    before the last layer (the overlap, not a store in ``finish``)."""
    from models.runtime import tiered_prefill
    from tests.test_offload import _tiny_asynctls_model

    model = _tiny_asynctls_model()
    tokens, lengths = _ragged_tokens(3)
    _scattered_pages(monkeypatch, seed=3)

    def prefill(threads):
        monkeypatch.setattr(tiered_prefill, "PAGE_STORE_THREADS", threads)
        runner = TieredRunner(model, "offload", host_pages=64)
        job = runner.start_prefill(tokens, lengths, MAX_LEN)
        job.advance(runner.num_layers - 1)
        in_flight = len(job.build._stores)
        job.advance(1)
        logits, state = job.result()
        return np.asarray(logits), [(np.asarray(h.k), np.asarray(h.v)) for h in state.host if h is not None], in_flight

    serial_logits, serial, serial_in_flight = prefill(0)
    logits, threaded, in_flight = prefill(2)
    assert serial_in_flight == 0 and in_flight > 0  # stored per layer, before the last one ran
    np.testing.assert_array_equal(logits, serial_logits)
    assert serial and any(np.abs(k).max() > 0 for k, _ in serial)
    for (k, v), (sk, sv) in zip(threaded, serial):
        np.testing.assert_array_equal(k, sk)
        np.testing.assert_array_equal(v, sv)


def _slowed_stores(monkeypatch, wait) -> list:
    """The prefill's page stores on 2 threads, each after ``wait()``; returns the list each
    store's page count is appended to once it landed."""
    from models.runtime import tiered_prefill

    monkeypatch.setattr(tiered_prefill, "PAGE_STORE_THREADS", 2)
    real, landed = tiered_prefill._store_pages, []

    def slow(pool, pages, staged):
        wait()
        real(pool, pages, staged)
        landed.append(pages.size)

    monkeypatch.setattr(tiered_prefill, "_store_pages", slow)
    return landed


def test_a_prefill_given_up_midway_leaves_no_page_store_in_flight(monkeypatch):
    """A layer-segmented prefill dropped after some layers (cancelled, preempted, failed): its
    stores still in flight land before ``drain`` returns, so none writes into a page the pool
    has given to another request since. The stores are slowed to be still running."""
    import threading
    import time

    from tests.test_offload import _tiny_asynctls_model

    gate = threading.Event()
    landed = _slowed_stores(monkeypatch, lambda: (gate.wait(5), time.sleep(0.05)))
    model = _tiny_asynctls_model()
    tokens, lengths = _ragged_tokens(4)
    runner = TieredRunner(model, "offload", host_pages=64)
    job = runner.start_prefill(tokens, lengths, MAX_LEN)
    job.advance(runner.num_layers - 1)
    pending = list(job.build._stores)
    assert pending and not landed
    gate.set()
    job.drain()
    assert all(f.done() for f in pending) and len(landed) == len(pending) and not job.build._stores


def test_offload_prefill_probe_runs_on_cpu(tmp_path):
    """``benchmarks.probes.offload_prefill --tiny``: every variant runs, and the whole-layer ones
    give the same first-token logits and the same stored pages (the A/B's numerics)."""
    import json

    from benchmarks.probes import offload_prefill

    assert offload_prefill.main(["--tiny", "--length", "512", "--layers", "3", "--segment", "256", "--rounds", "1",
                                 "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "offload_prefill.json").read_text())["rows"]
    assert [r["variant"].split(",")[0] for r in rows] == ["resident (no host tier)", "offload", "offload", "offload"]
    for r in rows[1:3]:
        assert r["max_logit_diff"] == 0 and r["pages_max_rel_diff"] == 0
    assert all(r["median_s"] > 0 for r in rows)


def test_prefill_temps_probe_runs_on_cpu(tmp_path, capsys):
    """``benchmarks.probes.prefill_temps --tiny``: each layer kind's prefill program is compiled
    and its bytes printed; the memory-usage report's head is read back (its first table only)."""
    from benchmarks.probes import prefill_temps

    assert prefill_temps.main(["--tiny", "--length", "512", "--layers", "3"]) == 0
    out = capsys.readouterr().out
    assert "a global layer's prefill of 512 tokens: temporaries" in out
    assert "a global sparse layer's prefill of 512 tokens: temporaries" in out
    (tmp_path / "module_0007.jit_prefill_layer.gpu_after_optimizations-memory-usage-report.txt").write_text(
        "Memory Space: default (color=0)\nTotal bytes: 3072 (3.00KiB)\n"
        "  cumulative_size;       size;       offset; used_by_n_values; shapes_list\n  ----\n"
        "    2.00KiB( 67%);    2.00KiB;            0;                2; bf16[1024], f32[512]\n"
        "    3.00KiB(100%);    1.00KiB;         2048;                1; f32[256]\n\n"
        "  cumulative_size;       size;       offset; used_by_n_values; shapes_list\n"
        "    9.00KiB(100%);    9.00KiB;            0;                1; f32[9]\n")
    lines = prefill_temps.usage_reports(tmp_path, "prefill_layer", top=1)
    assert lines == ["module_0007 (prefill_layer): Total bytes: 3072 (3.00KiB)",
                     "    2.00KiB( 67%);    2.00KiB;            0;                2; bf16[1024], f32[512]"]
    assert len(prefill_temps.usage_reports(tmp_path, "prefill_layer", top=5)) == 3  # the second table is not read


def test_a_prefills_gathered_blocks_leave_the_device_for_pinned_staging(monkeypatch):
    """Each layer's blocks gathered for its host pages go straight to pinned host staging
    buffers, so nothing of them stays on the device until the prefill's end (a 64K prompt of
    Qwen3-8B: 9.1 GB beside the engine's pools, held that way until 2026-12-06), and at most
    2 x PAGE_STORE_THREADS stores are in flight."""
    from models.runtime import tiered_prefill
    from sparse_jax.methods import get_method
    from sparse_jax.offload import capacity
    from tests.test_offload import _tiny_model

    monkeypatch.setattr(tiered_prefill, "PAGE_STORE_THREADS", 1)
    seen, real = [], tiered_prefill._store_pages
    monkeypatch.setattr(tiered_prefill, "_store_pages", lambda pool, pages, blocks: (seen.append(blocks),
                                                                                       real(pool, pages, blocks)))
    model = _tiny_model(get_method("quest", budget=64, block_size=8, dense_layers=(0,)), num_layers=6)
    tokens, lengths = _ragged_tokens(5)
    runner = TieredRunner(model, "offload", host_pages=64)
    job = runner.start_prefill(tokens, lengths, MAX_LEN)
    in_flight = []
    for _ in range(runner.num_layers):
        job.advance(1)
        in_flight.append(sum(not f.done() for f in job.build._stores))
    job.result()
    assert len(seen) == 2 * len(runner.offloaded_layers) == 10
    assert {b.sharding.memory_kind for b in seen} == {"pinned_host"}
    filled = int((-(-np.asarray(lengths) // runner.method.offload_block_size)).sum())  # every block has a page
    assert {b.shape[0] for b in seen} == {capacity.staged_rows(filled)} != {filled}  # padded as the check counts
    assert max(in_flight) <= 2


def test_a_prefills_result_waits_for_its_stores_and_raises_their_errors(monkeypatch):
    """``result()`` returns only once every page store has landed (slowed here, so a result that
    did not wait would see them unfinished), and a store's error is raised there, not lost."""
    import time

    from models.runtime import tiered_prefill
    from tests.test_offload import _tiny_asynctls_model

    landed = _slowed_stores(monkeypatch, lambda: time.sleep(0.2))
    model = _tiny_asynctls_model()
    tokens, lengths = _ragged_tokens(6)
    runner = TieredRunner(model, "offload", host_pages=64)
    runner.prefill(tokens, lengths, MAX_LEN)
    assert len(landed) == 2 * len(runner.offloaded_layers) > 0

    def broken(pool, pages, staged):
        raise OSError("store failed")

    monkeypatch.setattr(tiered_prefill, "_store_pages", broken)
    with pytest.raises(OSError, match="store failed"):
        TieredRunner(model, "offload", host_pages=64).prefill(tokens, lengths, MAX_LEN)


def test_staged_rows_pad_by_quarter_octaves():
    """A prefill's page gather pads its block list to a power of two up to 8, then to the next
    of four steps an octave: never less than the list, at most a quarter more, and few sizes."""
    from sparse_jax.offload import capacity

    assert [capacity.staged_rows(n) for n in (1, 2, 3, 5, 8, 9, 11, 16, 17, 2048, 2049, 2079)] == [
        1, 2, 4, 8, 8, 10, 12, 16, 20, 2048, 2560, 2560]
    sizes = {capacity.staged_rows(n) for n in range(1, 1 << 14)}
    assert all(n <= capacity.staged_rows(n) <= max(8, 1.25 * n) for n in range(1, 1 << 14))
    assert len(sizes) == 4 + 4 * 11  # 1, 2, 4, 8, then four an octave


def test_capacity_counts_the_prefills_pinned_staging(monkeypatch):
    """A paged host tier's footprint counts the pinned buffers a prefill stages its blocks in
    (one layer's K or V of the longest prompt, rows padded to a power of two), as many as the
    store threads keep in flight, or every offloaded layer's without threads; and the capacity
    check refuses a host limit that holds the pages but not the staging."""
    from models.runtime import tiered_prefill
    from sparse_jax.offload import capacity
    from tests.test_offload import _tiny_asynctls_model

    model = _tiny_asynctls_model()
    runner = TieredRunner(model, "offload", host_pages=9)
    cfg, bs = model.config, runner.method.offload_block_size
    nb = MAX_LEN // bs
    one = capacity.staged_rows(nb) * cfg.num_kv_heads * bs * cfg.head_dim * np.dtype(model.dtype).itemsize
    every = 2 * len(runner.offloaded_layers)
    for threads, buffers in ((1, min(4, every)), (0, every), (64, every)):
        monkeypatch.setattr(tiered_prefill, "PAGE_STORE_THREADS", threads)
        assert runner.footprint(2, MAX_LEN).host["prefill_staging"] == buffers * one
    assert "prefill_staging" not in TieredRunner(model, "offload").footprint(2, MAX_LEN).host
    host = runner.footprint(2, MAX_LEN).host
    with pytest.raises(capacity.CapacityError, match="host"):
        runner.check_capacity(2, MAX_LEN, device_limit=None, host_limit=host["kv_pages"] + one)
    runner.check_capacity(2, MAX_LEN, device_limit=None, host_limit=sum(host.values()))
    assert runner.checked_footprint.host == host  # what was checked, kept for a benchmark to print


def test_offloaded_engine_precompiles_its_prompt_buckets(tiny):
    """``Engine.precompile`` on an offloaded engine compiles its decode step and each prompt
    bucket's prefill programs (the embedding, each layer kind's layer program) ahead; prompts
    of those buckets then compile no layer program and no step while they are served (their
    tokens are the other tests')."""
    import logging

    import jax

    from models.serving.engine import Engine

    # a budget no other test uses: programs of their own, not compiled by an earlier test
    model = tiny.with_method("quest", budget=48)
    engine = Engine(model, slots=2, max_len=MAX_LEN, stop_ids=(), paged=True, offload=True, host_pages=HOST_PAGES)
    kv = engine.kv
    assert kv.prefill_buckets() == [64, 128, 192] and kv.prefill_buckets(shortest_prompt=100) == [128, 192]
    jobs = kv.program_shapes()
    assert len(jobs) == 1 + 3 * (1 + len(set(kv.prefill_runner.plan.specs)))  # the step, then 3 buckets
    compiled: list[str] = []

    class Compiles(logging.Handler):
        def emit(self, record):
            m = record.getMessage()
            if m.startswith("Compiling") and ("jit(prefill_layer)" in m or "jit(offloaded_decode_step)" in m):
                compiled.append(m)

    handler, log = Compiles(), logging.getLogger("jax")
    log.addHandler(handler)
    before = jax.config.jax_log_compiles
    jax.config.update("jax_log_compiles", True)
    try:
        out = engine.precompile()
        assert out["programs"] == len(jobs) and not out["failed"] and compiled  # the layer programs, here
        compiled.clear()
        rng = np.random.default_rng(6)
        prompts = [rng.integers(4, 97, n).tolist() for n in (40, 150)]  # buckets 64 and 192
        reqs, engine, _ = _serve(model, prompts, 2, engine=engine)
    finally:
        jax.config.update("jax_log_compiles", before)
        log.removeHandler(handler)
    assert compiled == [] and all(len(r.output_ids) == 2 for r in reqs)
