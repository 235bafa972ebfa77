"""The offloaded tier's shared pool (``pool="shared"``): one pool of block slots per
(layer, KV head) shared by every row, LRU across rows. The slot kernel against its
reference; offloaded == resident with evictions every step (Quest: fetch path,
AsyncTLS: prefetch path); rows really share; the engine's admission on it."""

import jax.numpy as jnp
import numpy as np
import pytest

from sparse_jax.ops.slot_pool import assign_shared_pool_slots


def _shared_tables(rng, m, r, nb, n, n1, fill=None):
    """Consistent shared tables (each resident (row, block) in one slot), LRU clocks with
    ties, distinct next blocks per row of which some fall in the ring; some rows idle."""
    bslot = np.full((m, r, nb), -1, np.int32)
    sblock, sused = np.full((r, n), -1, np.int32), np.full((r, n), -1, np.int32)
    for h in range(r):
        filled = rng.integers(0, n + 1) if fill is None else fill
        flat = rng.choice(m * nb, size=filled, replace=False)
        slots = rng.choice(n, size=filled, replace=False)
        sblock[h, slots] = flat
        bslot[flat // nb, h, flat % nb] = slots
        sused[h, slots] = rng.integers(0, 30, size=filled)
    nxt = np.stack([np.stack([rng.choice(nb, size=n1, replace=False) for _ in range(r)]) for _ in range(m)])
    ring = rng.integers(nb - 4, nb + 1, size=m).astype(np.int32)
    ring[rng.random(m) < 0.25] = 0  # idle rows need nothing
    clock = (100 + np.arange(r)).astype(np.int32)
    return nxt.astype(np.int32), ring, clock, bslot, sblock, sused


def _check_against_reference(args, ring_slots=2):
    ref = assign_shared_pool_slots(*args, ring_slots=ring_slots, impl="reference")
    ker = assign_shared_pool_slots(*args, ring_slots=ring_slots, impl="pallas")
    names = "block_slot slot_block slot_used src dst copies hits".split()
    ref, ker = [np.asarray(a) for a in ref], [np.asarray(a) for a in ker]
    for name, a, b in zip(names, ref, ker):
        if name in ("src", "dst"):  # entries past the counts are unspecified
            live = np.arange(a.shape[-1]) < ref[5][..., None]
            a, b = np.where(live, a, 0), np.where(live, b, 0)
        np.testing.assert_array_equal(a, b, err_msg=name)
    return ker


@pytest.mark.parametrize("m,r,nb,n,n1", [(3, 2, 37, 20, 5), (5, 3, 19, 11, 2), (1, 1, 8, 3, 3)])
def test_shared_kernel_matches_reference(m, r, nb, n, n1):
    """Awkward sizes (nothing a power of two, one row, idle rows, pools from empty to
    full); the copy list names each placed miss once; blocks of several rows move."""
    rng = np.random.default_rng(m * 100 + nb)
    for _ in range(3):
        args = _shared_tables(rng, m, r, nb, n, n1)
        nxt, ring, _, bslot0, _, _ = args
        bslot, sblock, sused, src, dst, copies, hits = _check_against_reference([jnp.asarray(a) for a in args])
        for h in range(r):
            need = nxt[:, h] < ring[:, None]
            miss = need & (bslot0[np.arange(m)[:, None], h, nxt[:, h]] < 0)
            protected = len({bslot0[i, h, b] for i in range(m) for b in nxt[i, h][need[i] & ~miss[i]]})
            placed = min(miss.sum(), n - protected)
            assert copies[:, h].sum() == placed and (hits[:, h] == (need & ~miss).sum(1)).all()
            for i in range(m):
                c = copies[i, h]
                blocks = nxt[i, h][miss[i]][:c]
                assert src[i, h, :c].tolist() == ((i * r + h) * nb + blocks).tolist()
                slots = dst[i, h, :c] - h * (n + 2 * m)
                assert sblock[h, slots].tolist() == (i * nb + blocks).tolist()
                assert (bslot[i, h, blocks] == slots).all()
            # the map and the slot table agree
            for s, f in enumerate(sblock[h]):
                if f >= 0:
                    assert bslot[f // nb, h, f % nb] == s
            assert (bslot[:, h] >= 0).sum() == (sblock[h] >= 0).sum()


def test_shared_lru_evicts_across_rows():
    """Row 1's miss takes the pool's least recently used slot, which holds row 0's
    block; row 0's hit is protected although it is older still."""
    nb, n = 10, 3
    bslot = np.full((2, 1, nb), -1, np.int32)
    sblock = np.array([[0 * nb + 4, 0 * nb + 5, 1 * nb + 2]], np.int32)  # row 0: blocks 4, 5; row 1: block 2
    sused = np.array([[1, 3, 7]], np.int32)
    bslot[0, 0, 4], bslot[0, 0, 5], bslot[1, 0, 2] = 0, 1, 2
    nxt = np.array([[[4]], [[6]]], np.int32)  # row 0 needs its block 4 (hit), row 1 its block 6 (miss)
    for impl in ("reference", "pallas"):
        out = assign_shared_pool_slots(*map(jnp.asarray, (nxt, [8, 8], [9], bslot, sblock, sused)), impl=impl)
        b, sb, su, src, dst, copies, hits = (np.asarray(a) for a in out)
        assert sb[0].tolist() == [4, 16, 12] and su[0].tolist() == [9, 9, 7]  # row 0's block 5 evicted by row 1
        assert b[0, 0, 5] == -1 and b[1, 0, 6] == 1 and b[0, 0, 4] == 0
        assert copies.tolist() == [[0], [1]] and hits.tolist() == [[1], [0]]
        assert src[1, 0, 0] == (1 * 1 + 0) * nb + 6 and dst[1, 0, 0] == 0 * (n + 4) + 1


def test_shared_overflow_is_left_unplaced_identically():
    """More misses than free slots (the callers prevent it): both implementations place
    the first ones in (row, position) order and count only those."""
    rng = np.random.default_rng(0)
    args = list(_shared_tables(rng, 4, 2, 30, 6, 4, fill=6))
    args[1] = np.full(4, 30, np.int32)  # every row needs all its blocks
    _, _, _, _, _, copies, hits = _check_against_reference([jnp.asarray(a) for a in args])
    assert (copies.sum(0) + 0 <= 6).all() and (copies.sum(0) < (4 * 4 - hits.sum(0))).all()


def test_shared_bad_input():
    a = dict(nxt=np.zeros((2, 3, 4), np.int32), ring_start=np.zeros((2,), np.int32), clock=np.zeros((3,), np.int32),
             block_slot=np.full((2, 3, 9), -1, np.int32), slot_block=np.full((3, 3), -1, np.int32),
             slot_used=np.full((3, 3), -1, np.int32))
    with pytest.raises(ValueError, match=r"shared pool \(3 slots\) must hold the 4 blocks"):
        assign_shared_pool_slots(**{k: jnp.asarray(v) for k, v in a.items()})
    a["slot_block"] = a["slot_used"] = np.full((3, 5), -1, np.int32)
    a["block_slot"] = np.full((2, 2, 9), -1, np.int32)
    with pytest.raises(ValueError, match=r"block_slot must have shape \[M, R, NB\]"):
        assign_shared_pool_slots(**{k: jnp.asarray(v) for k, v in a.items()})


def test_sparse_decode_attention_reads_one_shared_buffer():
    """k, v with a batch of 1 are read by every row: equal to the same buffer repeated
    per row (kernel in interpret mode and reference)."""
    from sparse_jax.ops.attention import sparse_decode_attention

    rng = np.random.default_rng(1)
    b, hq, hkv, s, d, k = 3, 4, 2, 40, 16, 7
    q = jnp.asarray(rng.standard_normal((b, hq, d)), jnp.float32)
    kk = jnp.asarray(rng.standard_normal((1, hkv, s, d)), jnp.float32)
    vv = jnp.asarray(rng.standard_normal((1, hkv, s, d)), jnp.float32)
    idx = jnp.asarray(rng.integers(0, s, (b, hkv, k)), jnp.int32)
    cnt = jnp.asarray(rng.integers(0, k + 1, (b, hkv)), jnp.int32)
    want = sparse_decode_attention(q, jnp.repeat(kk, b, 0), jnp.repeat(vv, b, 0), idx, cnt, impl="reference")
    for impl in ("reference", "pallas"):
        got = sparse_decode_attention(q, kk, vv, idx, cnt, impl=impl)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)


def _shared_equals_resident(model, tokens, lengths, steps, max_len, pools, atol):
    """Offloaded greedy decoding on a shared pool of each size equals the resident
    model's (ids and logits); blocks came back from the host; dropping the saves of
    completed blocks breaks it (the negative control). Returns the per-pool stats."""
    from models.runtime.tiered import TieredRunner
    from tests.test_offload import _resident_run

    ref_ids, ref_logits = _resident_run(model, tokens, lengths, steps, max_len)
    stats = {}
    for pool in pools:
        runner = TieredRunner(model, "offload", pool="shared", pool_slots=pool)
        ids, lg, state = runner.generate_ids(tokens, lengths, steps, max_len)
        np.testing.assert_array_equal(np.asarray(ids), ref_ids)
        np.testing.assert_allclose(np.asarray(lg), ref_logits, atol=atol, rtol=0)
        st = runner.transfer_stats(state)
        assert st["steps"] == steps and sum(st["misses_per_step"][1:]) > 0 and 0 < st["hit_rate"] < 1, st
        tier = state.cache.layers[runner.offloaded_layers[0]]
        assert tier.shared and tier.pool_k.shape[0] == 1 and tier.slot_block.shape[0] == 1
        stats[pool] = st
    runner = TieredRunner(model, "offload", pool="shared", pool_slots=pools[0])
    runner._store_pending = lambda state: state.pending.clear()  # drop the completed blocks
    _, lg, _ = runner.generate_ids(tokens, lengths, steps, max_len)
    assert np.abs(np.asarray(lg) - ref_logits).max() > 1e-2
    return stats


def test_offloaded_quest_on_a_shared_pool_equals_resident():
    """Quest (the fetch path: the current query's blocks placed before attending) on the
    smallest shared pool (3 rows x 8 blocks: evictions every step) decodes exactly as
    resident Quest; the rows really share: a slot holding one row's block is taken by
    another row's, and against per-row pools of twice the step (16 each, 48 in all)
    the 24 shared slots miss more. (The negative control: the AsyncTLS test below and
    the per-row tests of test_offload.py.)"""
    from models.runtime.tiered import TieredRunner
    from sparse_jax.methods import get_method
    from tests.test_offload import _ragged_tokens, _resident_run, _tiny_model

    model = _tiny_model(get_method("quest", budget=64, block_size=8, dense_layers=(0,)), num_layers=2)
    tokens, lengths = _ragged_tokens(5)
    steps, nb = 18, 256 // 8
    ref_ids, ref_logits = _resident_run(model, tokens, lengths, steps, 256)
    runner = TieredRunner(model, "offload", pool="shared", pool_slots=24)
    logits, state = runner.prefill(tokens, lengths, 256)

    def owners():  # [Hkv, N]: the row whose block each slot holds (-1: empty)
        sb = np.asarray(state.cache.layers[1].slot_block)[0]
        return np.where(sb >= 0, sb // nb, -1)

    ids, lgs, taken, prev = [], [], 0, owners()
    for _ in range(steps):
        nxt = jnp.argmax(logits, -1).astype(jnp.int32)
        ids.append(np.asarray(nxt))
        lgs.append(np.asarray(logits))
        logits = runner.decode_step(nxt, state)
        cur = owners()
        taken += int(((prev >= 0) & (cur >= 0) & (prev != cur)).sum())  # another row's block evicted
        prev = cur
    runner.finish(state)
    np.testing.assert_array_equal(np.stack(ids, 1), ref_ids)
    np.testing.assert_allclose(np.stack(lgs, 1), ref_logits, atol=1e-5, rtol=0)
    shared = runner.transfer_stats(state)
    assert taken > 0 and sum(shared["misses_per_step"][1:]) > 0
    tier = state.cache.layers[1]
    assert tier.shared and tier.pool_k.shape[0] == 1 and tier.slot_block.shape == (1, 2, 24)
    bslot, own = np.asarray(tier.block_slot), owners()  # the map (row, block) -> slot and the slots agree
    for h in range(2):
        for b in range(3):
            assert (own[h, bslot[b, h][bslot[b, h] >= 0]] == b).all()
    per_row_runner = TieredRunner(model, "offload")
    _, _, per_row_state = per_row_runner.generate_ids(tokens, lengths, steps, 256)
    per_row = per_row_runner.transfer_stats(per_row_state)
    assert sum(shared["misses_per_step"]) > sum(per_row["misses_per_step"])
    assert shared["hit_rate"] < per_row["hit_rate"]


def test_offloaded_asynctls_on_a_shared_pool_equals_resident():
    """AsyncTLS with its one-step lag (the prefetch path: the next step's blocks placed
    after the attention, beside the MLP) on the smallest shared pool (3 rows x 3)."""
    from tests.test_offload import _ragged_tokens, _tiny_asynctls_model

    model = _tiny_asynctls_model(lag=True)
    tokens, lengths = _ragged_tokens(7)
    _shared_equals_resident(model, tokens, lengths, 24, 256, (9,), atol=1e-5)


def test_engine_on_a_shared_pool():
    """The serving engine with one pool for all its slots: R_max is capped so that one
    step of the running rows fits the pool (8 slots, 4 blocks a step: 2 of 3 slots);
    M_avl defaults to the pool's bytes; every request gets its tokens alone (blocks of
    one request evicted by another's, insertion into a freed slot, block saves). Then
    first-fit admission on the working sets: with M_avl one prompt's estimate, the
    second request waits until the first has finished, and still gets its tokens."""
    import models
    from models.serving.engine import Engine
    from models.serving.requests import SamplingParams
    from tests.test_engine import _tiny_config

    import dataclasses

    cfg = dataclasses.replace(_tiny_config(), num_layers=2)  # layer 1 offloaded
    model = models.load_model(config=cfg, dtype=jnp.float32).with_method("quest", budget=64, dense_layers=(0,))
    rng = np.random.default_rng(3)
    ids = [rng.integers(4, 97, n).tolist() for n in (150, 120, 90)]
    steps = 20  # the 16-token blocks complete: saves run
    refs = [model.generate_ids(np.asarray([i], np.int32), np.asarray([len(i)], np.int32), max_new_tokens=steps,
                               stop_ids=())[0] for i in ids]
    with pytest.raises(ValueError, match="needs offload=True"):
        Engine(model, slots=3, max_len=256, pool="shared")
    engine = Engine(model, slots=3, max_len=256, stop_ids=(), offload=True, pool="shared", pool_slots=8)
    kv = engine.kv
    assert kv.shared and kv.blocks_per_step == 4 and kv.max_rows == 2 and engine.scheduler.max_requests == 2
    assert engine.scheduler.kv_bytes == kv.pool_bytes == 8 * kv.layer_heads * kv.block_bytes
    seen = []
    engine.start()
    try:
        reqs = [engine.submit(engine.make_request(i, SamplingParams(max_tokens=steps),
                                                  lambda ev: seen.append(engine.stats()["active_slots"])))
                for i in ids]
        for r in reqs:
            assert r.done.wait(300), r
    finally:
        engine.stop()
    assert [r.output_ids for r in reqs] == refs
    assert max(seen) == 2  # never more rows than the pool holds one step of
    s = engine.stats()
    assert s["blocks_loaded"] > 0 and engine.idle() and s["working_set_bytes"] == 0
    # first-fit on M_avl (driven by hand): one prompt's working set fits, not two
    first_ws = kv.working_set(engine.make_request(ids[0], SamplingParams(max_tokens=steps)))
    assert first_ws == min(-(-150 // 16), 4) * kv.layer_heads * kv.block_bytes
    engine.scheduler.kv_bytes = first_ws
    engine.scheduler.max_tokens_per_iter = 1000  # both prompts within T_max: only M_avl holds the second back
    deferred = engine.scheduler.counters.deferred_for_memory
    a, b = (engine.submit(engine.make_request(i, SamplingParams(max_tokens=6))) for i in ids[:2])
    engine.iterate()
    assert a.slot is not None and b.slot is None and engine.scheduler.counters.deferred_for_memory > deferred
    for _ in range(200):
        if engine.idle():
            break
        engine.iterate()
        assert a.finish_reason is not None or b.slot is None  # b waits while a runs
    assert a.output_ids == refs[0][:6] and b.output_ids == refs[1][:6] and engine.idle()


def test_pool_flags_are_checked_before_any_model_is_built():
    from benchmarks import offload as offload_bench
    from benchmarks import serve_load
    from models.cli import serve
    from models.runtime.tiered import TieredRunner
    from tests.test_offload import _tiny_asynctls_model

    args = serve.build_parser().parse_args(["--attention", "quest", "--pool", "shared"])
    with pytest.raises(ValueError, match="--pool shared needs --offload"):
        serve.make_engine(args)
    args = serve.build_parser().parse_args(["--attention", "quest", "--offload", "--pool", "shared",
                                            "--tensor-parallel", "2"])
    with pytest.raises(ValueError, match="does not run on several devices"):
        serve.make_engine(args)
    with pytest.raises(SystemExit):
        serve_load.parse_args(["--methods", "quest:sharde"])
    assert serve_load.parse_args(["--methods", "quest:shared,quest:shared-segmented,quest:shared-nows",
                                  "--tiny"]).methods
    with pytest.raises(SystemExit):
        offload_bench.parse_args(["--modes", "offload,shared"])
    model = _tiny_asynctls_model()
    with pytest.raises(ValueError, match="pool must be one of"):
        TieredRunner(model, "offload", pool="global")
    runner = TieredRunner(model, "offload", pool="shared", pool_slots=5)  # 3 blocks a step: one row fits
    with pytest.raises(ValueError, match="a shared pool of 5 slots cannot hold one step of 2 rows"):
        runner.start_prefill(np.zeros((2, 40), np.int32), np.array([40, 30], np.int32), 256)
    # the footprint: one pool per layer and KV head plus a ring per row
    fp = TieredRunner(model, "offload", pool="shared", pool_slots=12).footprint(3, 256)
    assert fp.device["slot_pool"] == 2 * 2 * 2 * (12 + 2 * 3) * 16 * 16 * 4  # layers x K,V x Hkv x slots x bs x D x f32


def test_slot_pool_benchmark_times_both_pools(tmp_path):
    """``benchmarks.slot_pool`` (and ``--shared``) checks each kernel against its reference
    before timing it; a CPU smoke run at a tiny shape, interpret mode."""
    import json

    from benchmarks.probes import slot_pool as bench

    for extra, pool in (([], "per_row"), (["--shared", "--heads", "2"], "shared")):
        out = tmp_path / f"{pool}.json"
        assert bench.main(["--rows", "4", "--blocks", "64", "--pool", "12", "--n1", "6", "--misses", "0,3",
                           "--warps", "1", "--inner", "1", "--repeats", "1", "--json", str(out), *extra]) == 0
        rows = json.loads(out.read_text())["rows"]
        assert len(rows) == 3 and all(r["pool"] == pool and r["reference_ok"] and r["pallas_w1_ok"] for r in rows)


def _clear_step_caches():
    import jax

    from models import driver
    from models.runtime import tiered

    for mod in (tiered, driver):
        for v in vars(mod).values():
            if hasattr(v, "cache_clear"):
                v.cache_clear()
    jax.clear_caches()


def test_shared_slot_impl_knob(monkeypatch):
    """``pool.SHARED_SLOT_IMPL`` (``benchmarks.offload --shared-slot-impl``) picks the shared
    slot assignment's implementation when the step's impl is "auto", and only then: the
    kernel (interpret mode here) gives the same tokens and logits as the reference."""
    from models.runtime.tiered import TieredRunner
    from sparse_jax.methods import get_method
    from sparse_jax.offload import pool as offload_pool
    from tests.test_offload import _ragged_tokens, _tiny_model

    seen = []
    real = offload_pool.assign_shared_pool_slots

    def spy(*args, impl, **kw):
        seen.append(impl)
        return real(*args, impl=impl, **kw)

    monkeypatch.setattr(offload_pool, "assign_shared_pool_slots", spy)
    model = _tiny_model(get_method("quest", budget=64, block_size=8, dense_layers=(0,)), num_layers=2)
    tokens, lengths = _ragged_tokens(5)
    out = {}
    for knob in (None, "pallas"):
        monkeypatch.setattr(offload_pool, "SHARED_SLOT_IMPL", knob)
        _clear_step_caches()  # the knob is read when a step is traced
        seen.clear()
        runner = TieredRunner(model, "offload", pool="shared", pool_slots=24)
        ids, lg, _ = runner.generate_ids(tokens, lengths, 3, 256)
        assert set(seen) == {"auto" if knob is None else "pallas"}, seen
        out[knob] = (np.asarray(ids), np.asarray(lg))
    np.testing.assert_array_equal(out[None][0], out["pallas"][0])
    np.testing.assert_allclose(out[None][1], out["pallas"][1], atol=1e-6, rtol=0)
    monkeypatch.setattr(offload_pool, "SHARED_SLOT_IMPL", None)
    _clear_step_caches()  # no later test reuses a program traced with the knob
