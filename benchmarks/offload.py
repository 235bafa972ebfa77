"""End-to-end decode throughput with the KV cache offloaded to host memory.

``python -m benchmarks.offload`` (on the GPU) measures, for a Qwen3-8B-shaped
model with random bf16 weights (36 layers, 32/8 heads, D=128) at each context
(default 32K, 64K, 96K):

* three configurations, all run by :class:`models.runtime.tiered.TieredRunner` (one jitted
  program per decode step):
  ``dense`` (all KV on the device, cuDNN-class exact decode), ``sparse``
  (AsyncTLS, everything resident) and ``offload`` (AsyncTLS, KV blocks in
  pinned host memory, device tier only);
* the largest batch that fits each (the capacity planner, then a real
  allocation at that batch), decode time per output token (TPOT: median of
  back-to-back steps / step) and tokens/s at that batch;
* for ``offload``: hits, misses and bytes moved per step, and the step time
  at the sparse configuration's batch (the equal-batch comparison);
* a ``jax.profiler`` trace of offloaded steps and how much transfer it hides
  (:mod:`benchmarks.trace_overlap`), and the alternative transfer path
  (``jax.device_put`` of the same bytes on a copy stream, issued before a
  resident step) timed against it.

Locality. Random weights have no temporal locality: the block filter's choice
changes almost completely every step. The throughput rows therefore run with
``churn`` = a miss rate measured with real text (``--churn`` sets it), and one
extra row reports the raw random-weight behaviour. Each row says which it rests
on. The default, 0.009, is Gemma 3 270M's at 32K with the default pool
(``benchmarks/results/offload_gemma3_locality.md``, H100: hit rate 0.991; 0.904
with the smallest pool), measured by ``python -m benchmarks.offload --smollm2-only
--locality-model gemma3-270m --locality-length 32000 --locality-kb 128 --name
offload_gemma3_locality`` (its three global layers offloaded, the sliding-window
layers resident). Results before 2026-11-26 rest on SmolLM2's 8K figure, 0.012
(``--smollm2`` measures it).

The KV content is synthetic (random keys and values written straight into
the tiers, with ``--context`` tokens per row): decode time does not depend on
how the cache was filled, and a real 96K prefill of every row would cost
minutes of device time. Prefill itself is timed separately, with and without
offload (``--prefill-len``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import shlex
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import markdown_table, stamp, write_results

ROUNDS = 3  # back-to-back timing rounds per configuration (the median is reported)
SETTLE_ROUNDS = 6  # at most this many untimed rounds before them, until two agree within 5%
ROUND_STEPS = 64  # steps per timed round: one 64-token block per row (its host save included)
GiB = 1 << 30



def default_reserve(params) -> int:
    """Bytes the capacity planner leaves free by default: the largest parameter leaf (a stacked
    weight, which the GEMM autotuner copies whole when a fused GEMM slices one layer out of it)
    plus 2.5 GiB for XLA's other temporaries, and never under 4 GiB."""
    largest = max(x.nbytes for x in jax.tree.leaves(params))
    return max(4 * GiB, largest + int(2.5 * GiB))


def qwen3_8b(max_position: int):
    from models.config import get_config

    # Qwen3-8B serves 128K contexts with YaRN; with random weights only the shapes matter
    return dataclasses.replace(get_config("qwen3-8b"), max_position=max_position)


def asynctls_for(cfg, budget: int, kb: int):
    from sparse_jax.methods import get_method

    r = cfg.head_dim // 4
    chans = tuple(tuple(range(h % 4, cfg.head_dim, 4))[:r] for h in range(cfg.num_kv_heads))
    # one channel set for every layer: random weights have nothing to calibrate, and equal
    # channels let all layers share one compilation
    return get_method("asynctls", budget=budget, kb=kb, channels_per_layer=(chans,) * cfg.num_layers)


def timed_steps(warmup: int, steps: int, rounds: int, round_steps: int = ROUND_STEPS) -> int:
    """Decode steps a configuration may take: warm-up, settle rounds, the synced steps, the timed rounds."""
    return warmup + (1 + SETTLE_ROUNDS) * steps + rounds * round_steps


def cache_capacity(context: int, decode_steps: int) -> int:
    """KV capacity for ``context`` tokens plus ``decode_steps`` new ones, in whole 64-token blocks."""
    from models.api import round_up

    return round_up(context + decode_steps + 8, 64)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _draw(key, shape, std):
    """One random bf16 leaf ``N(0, std^2)``: at module level, so every model a process draws
    (a benchmark's several engines, the tests') shares its compiled programs by shape."""
    return (jax.random.normal(key, shape, jnp.float32) * std).astype(jnp.bfloat16)


def random_model(cfg, method, max_len: int, seed: int = 0):
    """A :class:`models.api.Model` with random bf16 weights, drawn leaf by leaf (one
    small jit per distinct shape: seconds, where jitting the whole 8B-parameter
    initialiser took far longer: docs/architecture.md, 'Measured reasons for runtime and
    benchmark choices'). Norm weights are ones; matrices
    ``N(0, 1/fan_in)``; the embedding ``N(0, 0.02^2)``."""
    from models import transformer as tfm
    from models.api import Model

    graphdef, abstract = tfm.abstract_model(cfg, jnp.bfloat16)
    leaves, treedef = jax.tree.flatten(abstract)
    key = jax.random.key(seed)
    out = []
    for i, leaf in enumerate(leaves):
        shape = tuple(leaf.shape)
        if len(shape) == 1:
            out.append(jnp.ones(shape, leaf.dtype))
        else:
            std = 0.02 if shape[0] == cfg.vocab_size else shape[0] ** -0.5
            out.append(_draw(jax.random.fold_in(key, i), shape, float(std)))
    params = jax.tree.unflatten(treedef, out)
    return Model(cfg, graphdef, params, None, method, jnp.bfloat16, max_len)


def _synthetic_kv(cfg, batch, max_len, context, dtype, seed):
    """``kv_of_layer(i)`` for TieredRunner.state_from_kv: random K/V, ``context`` valid tokens."""
    hkv, d = cfg.num_kv_heads, cfg.head_dim

    @jax.jit
    def make(key):
        k1, k2, k3 = jax.random.split(key, 3)
        shape = (batch, hkv, max_len, d)
        k = jax.random.normal(k1, shape, dtype)
        v = jax.random.normal(k2, shape, dtype)
        q = jax.random.normal(k3, (batch, cfg.num_heads, d), dtype)
        return k, v, q

    return lambda i: make(jax.random.fold_in(jax.random.key(seed), i))


def with_churn(model, churn: float):
    """``model`` whose AsyncTLS renews ``churn`` of its block set per step (benchmarks only)."""
    return model.with_method(dataclasses.replace(model.method, churn=churn)) if churn else model


def run_config(model, mode, *, context, batch, steps, warmup, churn=0.0, pool_slots=None, trace_dir=None,
               host_limit="auto", concurrent=None, rounds=ROUNDS, round_steps=ROUND_STEPS, bandwidth=None,
               pool="per_row", save="deferred", loop="host", paged=False):
    """Fill a batch, decode it (:func:`timed_steps` tokens at most), return the measurements.
    ``concurrent``: TieredRunner's (None: its default schedule for ``mode``); ``pool``:
    the offloaded tier's pool, "per_row" or "shared" (``pool_slots`` then per KV head); ``loop``:
    "host" (each step's argmax taken by a separate call, its tokens a new array: the serving
    loop's shape) or "device" (offloaded only: :meth:`TieredRunner.greedy_steps`, tokens and
    logits fed back in donated buffers); ``paged``: offloaded on the paged host tier
    (``TieredRunner(host_pages=...)``) with a page for every block of every row's capacity
    (the contiguous tier's host bytes: what the step's page indirection costs, alone)."""
    if loop not in LOOPS:
        raise ValueError(f"loop must be one of {tuple(LOOPS)}, got {loop!r}")
    if loop == "device" and (mode != "offload" or pool != "per_row"):
        raise ValueError('loop="device" runs offloaded per-row pools')
    from models.runtime.tiered import TieredRunner

    max_len = cache_capacity(context, timed_steps(warmup, steps, rounds, round_steps))  # checked before filling
    host_pages = None
    if paged and mode == "offload":
        host_pages = batch * (max_len // model.method.for_offload().offload_block_size) + 1
    runner = TieredRunner(with_churn(model, churn), mode, pool_slots=pool_slots, host_limit=host_limit,
                          concurrent=concurrent, pool=pool, save=save, host_pages=host_pages)
    if mode == "offload" and jax.default_backend() in PRIME_BACKENDS:
        prime_autotuner(runner, model, batch, context)
    t0 = time.perf_counter()
    lengths = np.full((batch,), context, np.int32)
    state = runner.state_from_kv(_synthetic_kv(model.config, batch, max_len, context, model.dtype, 0),
                                 lengths, max_len)
    jax.block_until_ready(state.cache)
    fill_s = time.perf_counter() - t0
    tok = jnp.zeros((batch,), jnp.int32)
    gc.collect()
    gc.disable()  # the step is dispatch-bound: keep Python's collector out of the timed loops
    try:
        out = _timed_decode(runner, state, tok, decode=LOOPS[loop], mode=mode, context=context, batch=batch,
                            churn=churn, steps=steps, warmup=warmup, rounds=rounds, round_steps=round_steps,
                            fill_s=fill_s, max_len=max_len,
                            trace_dir=trace_dir, bandwidth=bandwidth)
        if host_pages is not None:
            out["host_pages"] = host_pages
        return out
    finally:
        gc.enable()
        del state, runner
        gc.collect()


#: where :func:`prime_autotuner` runs (the GEMM autotuner is XLA:GPU's)
PRIME_BACKENDS = ("gpu",)


def prime_autotuner(runner, model, batch: int, context: int) -> None:
    """One offloaded step at ``batch`` rows of a short context, before the full state is
    allocated. The offloaded step runs its layers unrolled, so XLA fuses each layer's slice
    of a stacked weight into a Triton GEMM, and the GEMM autotuner allocates that operand
    whole (3.4 GiB for Qwen3-8B's [36, 12288, 4096] down projection), on several threads at
    once: with the full state resident, every offloaded batch at 32K failed to compile with
    RESOURCE_EXHAUSTED. The GEMMs depend on the batch, not on the context, and XLA keeps its
    autotuning results for the process, so the full-context compile finds them tuned."""
    short = min(context // 4, 8192)
    short -= short % 64
    if short < 256:
        return
    max_len = cache_capacity(short, 2)
    lengths = np.full((batch,), short, np.int32)
    state = runner.state_from_kv(_synthetic_kv(model.config, batch, max_len, short, model.dtype, 0), lengths,
                                 max_len)
    jax.block_until_ready(runner.decode_step(jnp.zeros((batch,), jnp.int32), state))
    runner.finish(state)
    del state
    gc.collect()


def _decode(runner, state, tok, n):
    """``n`` greedy steps, issued back to back (not waited for): ``(logits, tok)``."""
    logits = None
    for _ in range(n):
        logits = runner.decode_step(tok, state)
        tok = jnp.argmax(logits, -1).astype(jnp.int32)
    return logits, tok


def _decode_on_device(runner, state, tok, n):
    """:func:`_decode` with the argmax fed back on the device (``TieredRunner.greedy_steps``)."""
    return runner.greedy_steps(tok, state, n)


#: run_config(loop=...): how each step's tokens reach the next
LOOPS = {"host": _decode, "device": _decode_on_device}


def _timed_decode(runner, state, tok, *, decode, mode, context, batch, churn, steps, warmup, rounds, round_steps,
                  fill_s, max_len, trace_dir, bandwidth=None):
    logits, tok = decode(runner, state, tok, warmup)
    jax.block_until_ready(tok)
    # settle: right after a large pinned allocation, back-to-back rounds ran slower for about
    # a second (the same configuration measured again in the same process did not; see
    # docs/architecture.md, 'Measured reasons for runtime and benchmark choices'), so rounds
    # of `steps` run until two in a row agree within 5% (at most SETTLE_ROUNDS)
    prev, settle = None, 0
    while settle < SETTLE_ROUNDS:
        t1 = time.perf_counter()
        logits, tok = decode(runner, state, tok, steps)
        jax.block_until_ready(tok)
        cur, settle = time.perf_counter() - t1, settle + 1
        if prev is not None and abs(cur - prev) <= 0.05 * min(cur, prev):
            break
        prev = cur
    # synced single steps; `dispatch`: the host time to issue one step into an idle queue (no
    # back-pressure from the device): above the device time, the loop is bound by the host
    times, dispatch = [], []
    for _ in range(steps):
        t1 = time.perf_counter()
        logits, tok = decode(runner, state, tok, 1)
        dispatch.append(time.perf_counter() - t1)
        jax.block_until_ready(tok)
        times.append(time.perf_counter() - t1)
    # back-to-back (dispatch overlapped with the device): the throughput number, the median
    # of `rounds` rounds (single rounds of 12 steps varied between runs: docs/architecture.md,
    # 'Measured reasons for runtime and benchmark choices'). A round
    # is ROUND_STEPS = 64 steps: one block per row, so each round pays the host save of the
    # blocks completed in it once (offloaded mode), as steady decoding does.
    # `host_issue_ms`: the time to issue a round's steps (before waiting for them); once the
    # device queue is full, issuing waits on the device, so it is not the host's own cost: that
    # is `host_dispatch_ms` (one step into an idle queue), which `host_dispatch_of_step` reports
    rounds_s, issue_s = [], []
    # the timed rounds keep no per-step block counters: holding them moves the step's outputs
    # to new addresses each step, and XLA then updates the step's CUDA graph on the host
    # (TieredState.record_transfers); the hit rate comes from the steps before
    recorded = len(state.counters)
    state.record_transfers = False
    for _ in range(rounds):
        t1 = time.perf_counter()
        logits, tok = decode(runner, state, tok, round_steps)
        issue_s.append((time.perf_counter() - t1) / round_steps)
        jax.block_until_ready(tok)
        rounds_s.append((time.perf_counter() - t1) / round_steps)
    tpot = statistics.median(rounds_s)
    fp = runner.footprint(batch, max_len)
    out = {"mode": mode, "concurrent": runner.concurrent, "unroll": runner.unroll,
           "context": context, "batch": batch, "churn": churn, "fill_s": fill_s,
           "tpot_ms": 1e3 * tpot, "step_ms_median_synced": 1e3 * statistics.median(times),
           "tpot_rounds_ms": [round(1e3 * r, 3) for r in rounds_s], "settle_rounds": settle,
           "host_issue_ms": round(1e3 * statistics.median(issue_s), 3),
           "host_dispatch_ms": round(1e3 * statistics.median(dispatch), 3),
           "tokens_per_s": batch / tpot, "finite": bool(np.isfinite(np.asarray(logits)).all()),
           "footprint_device_gib": fp.device_bytes / GiB, "footprint_host_gib": fp.host_bytes / GiB,
           "pool_slots": runner._pool(max_len, batch) if mode == "offload" else None,
           "pool": runner.pool if mode == "offload" else None}
    nbytes = bytes_per_step(runner, batch, context)
    out["gib_read_per_step"] = nbytes / GiB
    if bandwidth:
        out["floor_ms"] = 1e3 * nbytes / bandwidth
        out["floor_tokens_per_s"] = batch / (nbytes / bandwidth)
        out["of_floor"] = out["floor_ms"] / out["tpot_ms"]
    out["host_issue_of_step"] = out["host_issue_ms"] / out["tpot_ms"]
    out["host_dispatch_of_step"] = out["host_dispatch_ms"] / out["tpot_ms"]
    stats = jax.devices()[0].memory_stats() or {}
    out["device_in_use_gib"] = stats.get("bytes_in_use", 0) / GiB
    if mode == "offload":
        runner.finish(state)
        ts = runner.transfer_stats(state)
        # the settle rounds and the synced single steps (after the warm-up)
        miss = np.asarray(ts["misses_per_step"][warmup:recorded], float)
        hits = np.asarray(ts["hits_per_step"][warmup:recorded], float)
        out.update(hit_rate=float(hits.sum() / max(hits.sum() + miss.sum(), 1)),
                   mib_per_step=float(np.mean(ts["bytes_per_step"][warmup:recorded]) / (1 << 20)),
                   misses_per_step=float(miss.mean()), steps_counted=recorded - warmup)
    if trace_dir is not None:
        from benchmarks import trace_overlap

        jax.profiler.start_trace(str(trace_dir), create_perfetto_trace=True)
        logits, tok = decode(runner, state, tok, 3)
        jax.block_until_ready(tok)
        jax.profiler.stop_trace()
        events, _ = trace_overlap.load_events(trace_dir)
        rep = trace_overlap.overlap_report(events)
        out["trace"] = {k: rep.get(k) for k in ("transfer_busy_us", "compute_busy_us", "overlap_us",
                                                 "hidden_fraction", "note")}
        out["_trace_report"] = rep
        out["_trace_events"] = events
    return out


def fit_batch(model, mode, context, *, start, steps, warmup, churn=0.0, log=print, **kw):
    """Run at the planner's batch; on an allocation failure step down (reported)."""
    b = start
    while b >= 1:
        try:
            r = run_config(model, mode, context=context, batch=b, steps=steps, warmup=warmup, churn=churn, **kw)
            r["planner_batch"] = start
            return r
        except Exception as e:  # noqa: BLE001 - OOM at the planned batch: report and step down
            log(f"[offload] {mode} ctx={context} batch={b} failed: {type(e).__name__}: {str(e)[:200]}")
            gc.collect()
            b -= max(1, b // 8)  # each failed try compiles the step: step down faster at large batches
    return {"mode": mode, "context": context, "batch": 0, "planner_batch": start, "error": "nothing fits"}


def bytes_per_step(runner, batch: int, context: int) -> float:
    """HBM bytes one decode step must read at least: every weight once (the embedding
    table only when tied, as the head), and per row the KV each layer attends: all of
    it on exact layers; on the method's layers the budget's K/V, its block boxes and
    (AsyncTLS) the INT4 labels of the candidate blocks. Offloaded steps move their
    misses over PCIe on top (hidden, or not, behind this)."""
    cfg, m = runner.cfg, runner.method
    e = jnp.dtype(runner.model.dtype).itemsize
    weights = cfg.num_params() * e
    if not cfg.tie_embeddings:
        weights -= cfg.vocab_size * cfg.hidden_size * e  # the embedding is gathered, not read whole
    hkv, d = cfg.num_kv_heads, cfg.head_dim
    kv_token = 2 * hkv * d * e
    total = weights
    for spec in runner.plan.specs:
        if not spec.sparse:
            total += batch * context * kv_token
            continue
        budget = getattr(m, "budget", context)
        total += batch * min(budget, context) * kv_token
        bs = getattr(m, "block_size", 64)
        box_e = 1 if getattr(m, "box_bits", None) == 8 else e  # 8-bit codes or boxes in the model's dtype
        total += batch * 2 * hkv * (context // bs) * d * box_e  # the boxes (Quest bound)
        if hasattr(m, "kb"):
            r = m.num_channels(d)
            total += batch * hkv * min(m.kb * bs, context) * (r // 2 + 4)  # INT4 labels + scale/offset
    return float(total)


def measure_bandwidth(nbytes: int = 4 << 30) -> float:
    """HBM bytes/s of a device copy (read + write): the best of 5 runs at ``nbytes``
    and at a quarter of it. The best, not the median: the floor it sets must not
    flatter a step (two runs of the median of one size disagreed widely: see
    docs/architecture.md, 'Measured reasons for runtime and benchmark choices')."""
    f = jax.jit(lambda a: a + 1.0)
    best = 0.0
    for n in (nbytes // 4, nbytes):
        x = jnp.zeros((n // 4,), jnp.float32)
        jax.block_until_ready(f(x))
        for _ in range(5):
            t = time.perf_counter()
            jax.block_until_ready(f(x))
            best = max(best, 2 * n / (time.perf_counter() - t))
        del x
    return best


def device_put_alternative(model, *, context, batch, mib_per_step, steps=8):
    """The copy-stream path: a sparse-resident step with a bulk ``jax.device_put``
    of ``mib_per_step`` MiB from pinned host memory issued just before it, against
    the step alone and the copy alone. The CPU gather that would assemble the
    contiguous buffer is timed separately (NumPy fancy indexing of 32 KiB blocks)."""
    from models.runtime.tiered import TieredRunner
    from sparse_jax.offload.tiers import device_sharding, pinned_host_sharding

    runner = TieredRunner(model, "resident")
    max_len = cache_capacity(context, 3 * steps)
    state = runner.state_from_kv(_synthetic_kv(model.config, batch, max_len, context, model.dtype, 1),
                                 np.full((batch,), context, np.int32), max_len)
    tok = jnp.zeros((batch,), jnp.int32)
    jax.block_until_ready(runner.decode_step(tok, state))
    nbytes = int(mib_per_step * (1 << 20))
    blocks = max(nbytes // (64 * 128 * 2), 1)
    src = jax.device_put(jnp.ones((blocks, 64, 128), jnp.bfloat16), pinned_host_sharding())
    dev = device_sharding()

    def timed(fn):
        jax.block_until_ready(fn())
        t = time.perf_counter()
        for _ in range(steps):
            out = fn()
        jax.block_until_ready(out)
        return 1e3 * (time.perf_counter() - t) / steps

    step_ms = timed(lambda: runner.decode_step(tok, state))
    copy_ms = timed(lambda: jax.device_put(src, dev))

    def both():
        c = jax.device_put(src, dev)
        return runner.decode_step(tok, state), c

    both_ms = timed(both)
    # CPU side of the copy-stream path: gather scattered blocks into a contiguous buffer
    table = np.zeros((blocks * 8, 64, 128), np.uint16)
    ids = np.random.default_rng(0).integers(0, table.shape[0], blocks)
    staging = np.empty((blocks, 64, 128), np.uint16)
    t = time.perf_counter()
    np.take(table, ids, axis=0, out=staging)
    gather_ms = 1e3 * (time.perf_counter() - t)
    del state, runner, src
    gc.collect()
    hidden = max(0.0, min(1.0, (step_ms + copy_ms - both_ms) / copy_ms)) if copy_ms > 0 else 0.0
    return {"bytes": blocks * 64 * 128 * 2, "step_ms": step_ms, "copy_ms": copy_ms, "step_plus_copy_ms": both_ms,
            "copy_hidden_fraction": hidden, "cpu_gather_ms": gather_ms,
            "copy_gbps": blocks * 64 * 128 * 2 / copy_ms / 1e6, "cpu_gather_gbps": blocks * 64 * 128 * 2 / gather_ms / 1e6}


def prefill_compare(model, *, length, log=print):
    """Prefill time and peak device memory, KV resident vs offloaded (one row)."""
    from models.runtime.tiered import TieredRunner

    out = []
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, model.config.vocab_size, (1, length)), jnp.int32)
    lengths = jnp.asarray([length], jnp.int32)
    for mode in ("offload", "resident"):  # offload first: the peak counter only grows
        runner = TieredRunner(model, mode)
        max_len = cache_capacity(length, 56)
        logits, state = runner.prefill(tokens, lengths, max_len)  # compile
        jax.block_until_ready((logits, state.cache))
        del state
        gc.collect()
        before = (jax.devices()[0].memory_stats() or {}).get("bytes_in_use", 0)
        t = time.perf_counter()
        logits, state = runner.prefill(tokens, lengths, max_len)
        jax.block_until_ready((logits, state.cache, [h.k for h in state.host if h is not None]))
        dt = time.perf_counter() - t
        stats = jax.devices()[0].memory_stats() or {}
        out.append({"mode": mode, "length": length, "prefill_s": dt,
                    "device_kv_after_gib": (stats.get("bytes_in_use", 0) - before) / GiB,
                    "peak_in_use_gib": stats.get("peak_bytes_in_use", 0) / GiB})
        log(f"[offload] prefill {mode} {length}: {dt:.2f}s, device +{out[-1]['device_kv_after_gib']:.2f} GiB")
        del state, runner
        gc.collect()
    return out


def smollm2_locality(*, length=8000, batch=4, steps=64, kb=32, budget=1024, log=print,
                     model_name: str = "smollm2-135m"):
    """Hit rates of offloaded AsyncTLS on a real model (SmolLM2 by default; ``model_name``:
    any preset with real weights, e.g. gemma3-270m) with real text (stdlib source),
    and the check that offloaded bf16 decoding matches the resident method."""
    import models
    from benchmarks.fidelity import fidelity_text_ids
    from models.runtime.tiered import TieredRunner

    cap = cache_capacity(length, steps)
    base = models.load_model(model_name, dtype=jnp.bfloat16, max_len=cap)
    m = base.with_method("asynctls", budget=budget, kb=kb, lag=True)
    ids = fidelity_text_ids(base.tokenizer, length, batch)
    lengths = np.full((batch,), length, np.int32)
    rows = []
    smallest = kb - 1  # the filter's set exactly: evictions every step the set changes
    for pool in (smallest, 2 * (kb - 1)):  # the smallest pool, and the default
        runner = TieredRunner(m, "offload", pool_slots=pool)
        out_ids, logits, state = runner.generate_ids(ids, lengths, steps, cap)
        ts = runner.transfer_stats(state)
        rows.append({"pool_slots": pool, "hit_rate": ts["hit_rate"],
                     "misses_per_step": float(np.mean(ts["misses_per_step"])),
                     "kib_per_step": ts["mean_bytes_per_step"] / 1024, "steps": ts["steps"]})
        if pool == smallest:  # the same method with everything resident, run the same way (layer by layer)
            rid, rlog, _ = TieredRunner(m, "resident").generate_ids(ids, lengths, steps, cap)
            rid, rlog = np.asarray(rid), np.asarray(rlog)
            same = rid == np.asarray(out_ids)
            rows[-1].update(token_agreement=float(same.mean()),
                            max_abs_dlogit=float(np.abs(rlog - np.asarray(logits)).max()))
        log(f"[offload] {model_name} pool={rows[-1]['pool_slots']}: hit rate {rows[-1]['hit_rate']:.3f}")
    return {"model": model_name, "length": length, "batch": batch, "steps": steps, "kb": kb, "budget": budget, "rows": rows}


def plot(payload, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in payload["throughput"] if r.get("batch")]
    ctxs = sorted({r["context"] for r in rows})
    modes = ["dense", "sparse", "offload"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    w = 0.27
    for j, mode in enumerate(modes):
        of_mode = [r for r in rows if r["label"].split(" (save ")[0] == mode]  # an A/B of saves: the first
        tps = [next((r["tokens_per_s"] for r in of_mode if r["context"] == c), 0) for c in ctxs]
        bs = [next((r["batch"] for r in of_mode if r["context"] == c), 0) for c in ctxs]
        x = np.arange(len(ctxs)) + (j - 1) * w
        axes[0].bar(x, tps, w, label=mode)
        axes[1].bar(x, bs, w, label=mode)
    for ax, t in zip(axes, ("decode tokens/s at the largest batch", "largest batch that fits")):
        ax.set_xticks(np.arange(len(ctxs)), [f"{c // 1024}K" for c in ctxs])
        ax.set_title(t)
        ax.legend()
    fig.suptitle(f"Qwen3-8B shape, random weights, {payload['stamp'].get('device', '')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def merge(paths, name: str, out_dir=None):
    """One results file from several runs of this benchmark (each context in its own
    device call, for the 10-minute limit): rows concatenated, the other sections
    taken from the first run that has them, every run's stamp kept."""
    import json

    parts = [json.loads(Path(p).read_text()) for p in paths]
    out = {"stamp": parts[0]["stamp"], "parts": [p["stamp"] for p in parts], "budget": parts[0]["budget"],
           "kb": parts[0]["kb"], "rounds": parts[0].get("rounds", ROUNDS),
           "round_steps": parts[0].get("round_steps", ROUND_STEPS), "throughput": [], "equal_batch": []}
    for p in parts:
        out["throughput"] += p.get("throughput", [])
        out["equal_batch"] += p.get("equal_batch", [])
        if p.get("groups"):
            out.setdefault("groups", []).extend(p["groups"])
        for k in ("trace", "device_put", "prefill", "smollm2", "limits_gib"):
            if p.get(k) and k not in out:
                out[k] = p[k]
    path = write_results(name, out, render(out), out_dir)
    plot(out, Path(path) / f"{name}.png")
    return out


def render(payload) -> str:
    st = payload["stamp"]
    runs = payload.get("parts") or [st]
    lines = ["# Offloaded decoding (Qwen3-8B shape, random weights)", "",
             f"- device: {st.get('device')}, jax {st.get('jax')}, commit {st.get('git_commit') or 'unknown'}",
             f"- date: {st.get('date')}"] + [f"- command: `{r.get('command')}` ({r.get('date')}, commit {r.get('git_commit')})" for r in runs] + [
             f"- budget {payload['budget']} tokens, kb {payload['kb']}, block 64; churn = fraction of the block "
             f"set renewed per step (0 = the random weights' own behaviour); tpot = median of "
             f"{payload.get('rounds', ROUNDS)} back-to-back rounds of {payload.get('round_steps', ROUND_STEPS)} "
             f"steps (a round of {ROUND_STEPS} is one block per row, so it pays the host save of the blocks it "
             f"completes), after untimed rounds until two agree within 5%", ""]
    if payload.get("save", "deferred") != "deferred" or payload.get("shared_slot_impl", "auto") != "auto":
        lines += [f"- offloaded rows: save `{payload.get('save', 'deferred')}` (deferred = FlashD2H), shared-pool "
                  f"slot assignment `{payload.get('shared_slot_impl', 'auto')}`", ""]
    if payload.get("bandwidth_gbps"):
        lines += [f"- measured HBM bandwidth (device copy): {payload['bandwidth_gbps']:.0f} GB/s; `floor_ms` = "
                  f"bytes a step must read (weights once, the KV each layer attends) / that bandwidth; "
                  f"`of_floor` = floor / tpot; `host_dispatch_ms` = host time to issue one step into an idle queue "
                  f"(the host's own cost per step; it overlaps the device's work on the previous steps), "
                  f"`host_dispatch_of_step` = that / tpot", ""]
    cols = ["label", "context", "batch", "planner_batch", "churn", "pool_slots", "tpot_ms", "tokens_per_s", "x_dense",
            "floor_ms", "of_floor", "host_dispatch_ms", "host_dispatch_of_step", "hit_rate", "mib_per_step",
            "footprint_device_gib", "footprint_host_gib"]
    lines.append(markdown_table(payload["throughput"], cols))
    if payload.get("equal_batch"):
        lines += ["", "## Equal batch: offloaded vs resident step", "",
                  "Each step under XLA's serial CUDA graph and under the concurrent one "
                  "(`xla_gpu_command_buffer_scheduling_mode=CONCURRENT`: the offloaded copy runs beside the "
                  "MLP); resident and offloaded runs alternate, each cell is its configuration's fastest run "
                  "(the loop is bound by the host, whose speed drifts; all runs in the JSON's `runs_ms`); "
                  "`slowdown` = offloaded (concurrent, its default) over the faster resident step.", "",
                  markdown_table(payload["equal_batch"], ["context", "batch", "churn", "sparse_tpot_ms",
                                                          "sparse_concurrent_tpot_ms", "offload_tpot_ms",
                                                          "offload_serial_tpot_ms", "slowdown"])]
    if payload.get("device_put"):
        lines += ["", "## Transfer path: inline host_gather vs device_put on a copy stream", "",
                  markdown_table([payload["device_put"]], list(payload["device_put"]))]
    if payload.get("trace"):
        lines += ["", "## Profiler trace of offloaded steps", "", markdown_table([payload["trace"]], list(payload["trace"]))]
    if payload.get("prefill"):
        lines += ["", "## Prefill with and without offload", "", markdown_table(payload["prefill"], list(payload["prefill"][0]))]
    if payload.get("smollm2"):
        s = payload["smollm2"]
        lines += ["", f"## {s.get('model', 'smollm2-135m')} real text: hit rates (length {s['length']}, batch {s['batch']}, kb {s['kb']}, "
                      f"budget {s['budget']}, {s['steps']} steps)", "",
                  markdown_table(s["rows"], sorted({k for r in s["rows"] for k in r}))]
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.offload", description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default="32768,65536,98304")
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--kb", type=int, default=128)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=ROUNDS,
                   help=f"timed rounds per configuration, the median reported (default {ROUNDS})")
    p.add_argument("--round-steps", type=int, default=ROUND_STEPS,
                   help=f"back-to-back steps per timed round (default {ROUND_STEPS}: one 64-token block per row, "
                        "so a round pays the host save of its completed blocks once)")
    p.add_argument("--churn", type=float, default=0.009,
                   help="block-set renewal per step (default 0.009: Gemma 3 270M's measured miss rate at 32K with "
                        "the default pool, twice the filter's set; 0.096 with the smallest pool. SmolLM2 at 8K: "
                        "0.012 and 0.10)")
    p.add_argument("--host-fraction", type=float, default=0.7, help="share of MemAvailable the host tier may use")
    p.add_argument("--device-reserve-gib", type=float, default=None,
                   help="device memory the capacity planner leaves free for XLA's temporaries and the GEMM "
                        "autotuner (default: the largest stacked weight + 2.5 GiB, at least 4 GiB). The "
                        "offloaded step runs its layers unrolled, so XLA fuses a slice of a stacked weight into "
                        "each GEMM, and the autotuner allocates a copy of the whole stack (3.4 GiB for "
                        "Qwen3-8B's down projection): with a flat 4 GiB, every offloaded batch at 32K failed to "
                        "compile with RESOURCE_EXHAUSTED in the autotuner")
    p.add_argument("--modes", default="dense,sparse,offload",
                   help="comma list of dense, sparse (resident), offload (per-row pools), offload-shared (one pool "
                        "per layer and KV head shared by the batch), offload-paged (per-row pools on the paged host "
                        "tier, every row's capacity paged: the page indirection's cost)")
    p.add_argument("--shared-slot-impl", default="auto", choices=["auto", "pallas", "reference"],
                   help="offload-shared: the shared pool's slot assignment (sparse_jax.offload.pool."
                        "SHARED_SLOT_IMPL; auto: as the step, the kernel on the GPU)")
    p.add_argument("--save", default="deferred",
                   help="offloaded modes: how completed blocks reach the host tier (TieredRunner(save=...)): "
                        "deferred (FlashD2H: one copy a step, stored at the next step) or sync (waited for and "
                        "stored within the step: the baseline). A comma list (e.g. deferred,sync,deferred) runs "
                        "each in turn at the batch the first one found, one row each: an A/B at equal batch, "
                        "repeats showing the host's drift within the process")
    p.add_argument("--prefill-len", type=int, default=32768, help="0 skips the prefill comparison")
    p.add_argument("--smollm2", action="store_true", help="measure hit rates on SmolLM2 (needs its weights)")
    p.add_argument("--smollm2-only", action="store_true")
    p.add_argument("--locality-model", default="smollm2-135m",
                   help="the real model --smollm2 / --smollm2-only measure (default smollm2-135m; gemma3-270m)")
    p.add_argument("--locality-length", type=int, default=8000, help="its context (default 8000)")
    p.add_argument("--locality-batch", type=int, default=4)
    p.add_argument("--locality-kb", type=int, default=32, help="AsyncTLS kb of that measurement (default 32)")
    p.add_argument("--trace", action="store_true", help="profile offloaded steps at the longest context")
    p.add_argument("--no-extras", dest="extras", action="store_false",
                   help="skip the longest context's extra rows (smallest pool, raw locality, trace, device_put)")
    p.add_argument("--eq-repeats", type=int, default=2, help="alternated resident/offloaded runs at equal batch")
    p.add_argument("--no-eq-serial", dest="eq_serial", action="store_false",
                   help="skip the offloaded step under the serial schedule at equal batch")
    p.add_argument("--tiny", action="store_true", help="a small random model (CPU smoke test)")
    p.add_argument("--out", default=None)
    p.add_argument("--name", default="offload_qwen3_8b")
    p.add_argument("--merge", default="", help="comma list of this benchmark's JSON results: write them as one "
                   "results file named --name (no device work)")
    a = p.parse_args(argv)
    bad = set(a.modes.split(",")) - {"dense", "sparse", "offload", "offload-shared", "offload-paged"}
    if bad:  # before any model is built or compiled
        p.error(f"--modes: unknown {sorted(bad)}; choose from dense, sparse, offload, offload-shared, offload-paged")
    if a.rounds < 1 or a.round_steps < 1:
        p.error(f"--rounds and --round-steps: at least 1 each, got {a.rounds} and {a.round_steps}")
    a.saves = [x.strip() for x in a.save.split(",")]
    if not a.saves or set(a.saves) - {"deferred", "sync"}:
        p.error(f"--save: a comma list of deferred and sync, got {a.save!r}")
    return a


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    a = parse_args(argv)
    if a.merge:
        out = merge(a.merge.split(","), a.name, Path(a.out) if a.out else None)
        print(render(out))
        return 0
    import models
    from sparse_jax.offload import capacity

    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    pinned = capacity.plan_pinned_host_limit(a.host_fraction)  # before the GPU client starts (stamp() starts it)
    log(pinned)
    timing = dict(rounds=a.rounds, round_steps=a.round_steps)  # every configuration's timed rounds
    payload = {"stamp": stamp("python -m benchmarks.offload " + shlex.join(argv)), "budget": a.budget, "kb": a.kb,
               "pinned_host": pinned, **timing, "throughput": [], "equal_batch": []}
    out_dir = Path(a.out) if a.out else None

    def save():
        md = render(payload)
        path = write_results(a.name, {k: v for k, v in payload.items()}, md, out_dir)
        try:
            plot(payload, Path(path) / f"{a.name}.png")
        except Exception as e:  # noqa: BLE001 - the numbers matter more than the picture
            log(f"[offload] plot failed: {e}")
        return path

    if a.smollm2 or a.smollm2_only:
        payload["smollm2"] = smollm2_locality(log=log, model_name=a.locality_model, length=a.locality_length,
                                              batch=a.locality_batch, kb=a.locality_kb)
        save()
        if a.smollm2_only:
            print(render(payload))
            return 0
    contexts = [int(c) for c in a.contexts.split(",")]
    if a.tiny:
        cfg = models.ModelConfig(name="tiny", arch="qwen3", num_layers=3, hidden_size=64, num_heads=4,
                                 num_kv_heads=2, head_dim=32, intermediate_size=128, vocab_size=101,
                                 max_position=1 << 17, rope_theta=1e6, tie_embeddings=False, eos_token_id=2)
    else:
        cfg = qwen3_8b(max(131072, max(contexts) + 1024))
    method = asynctls_for(cfg, a.budget, a.kb)
    t0 = time.perf_counter()
    model = random_model(cfg, method, max(contexts) + 1024)
    dense = model.with_method("dense")
    log(f"[offload] {cfg.name}: {cfg.num_params() / 1e9:.2f}B params in {time.perf_counter() - t0:.1f}s")
    reserve = default_reserve(model.params) if a.device_reserve_gib is None else int(a.device_reserve_gib * GiB)
    dl, hl = capacity.device_budget(reserve), capacity.host_budget(a.host_fraction)
    payload["device_reserve_gib"] = reserve / GiB
    payload["limits_gib"] = {"device": dl and dl / GiB, "host": hl and hl / GiB}
    modes = a.modes.split(",")
    from sparse_jax.offload import pool as offload_pool

    offload_pool.SHARED_SLOT_IMPL = None if a.shared_slot_impl == "auto" else a.shared_slot_impl
    payload["shared_slot_impl"] = a.shared_slot_impl
    payload["save"] = a.save
    bw = measure_bandwidth((1 << 24) if a.tiny else (4 << 30))
    payload["bandwidth_gbps"] = bw / 1e9
    for ctx in contexts:
        max_len = cache_capacity(ctx, timed_steps(a.warmup, a.steps, **timing))
        found = {}
        for mode in modes:
            mdl, rmode = (dense, "resident") if mode == "dense" else (model, "resident" if mode == "sparse" else "offload")
            # "offload-shared": the offloaded tier with one pool per layer and KV head for the batch (the
            # default size: the batch times the per-row default, the same bytes as per-row pools)
            shared = mode == "offload-shared"
            paged = mode == "offload-paged"  # per-row pools on the paged host tier, every row's capacity paged
            start = capacity.max_batch(cfg, mdl.method, max_len=max_len, mode="offload" if shared or paged else mode,
                                       device_limit=dl, host_limit=hl, limit=64 if not a.tiny else 4)
            churn = a.churn if rmode == "offload" else 0.0
            saves = a.saves if rmode == "offload" else ["deferred"]
            pool = "shared" if shared else "per_row"
            r = fit_batch(mdl, rmode, ctx, start=start, steps=a.steps, warmup=a.warmup, churn=churn, log=log,
                          **timing, host_limit=hl, bandwidth=bw, pool=pool, save=saves[0], paged=paged)
            rows = [r]
            for sv in saves[1:] if r.get("batch") else ():  # the same batch: an A/B of the save alone
                try:
                    r2 = run_config(mdl, rmode, context=ctx, batch=r["batch"], steps=a.steps, warmup=a.warmup,
                                    **timing, churn=churn, host_limit=hl, bandwidth=bw, pool=pool, save=sv, paged=paged)
                except Exception as e:  # noqa: BLE001 - report, go on
                    log(f"[offload] {mode} save={sv} batch={r['batch']} failed: {type(e).__name__}: {str(e)[:200]}")
                    r2 = {"mode": rmode, "context": ctx, "batch": 0, "error": f"{type(e).__name__}"}
                r2["planner_batch"] = r.get("planner_batch")
                rows.append(r2)
            for row, sv in zip(rows, saves):
                row["label"] = mode if len(saves) == 1 else f"{mode} (save {sv})"
                row["save"] = sv
                payload["throughput"].append(row)
                log(f"[offload] ctx={ctx} {row['label']}: batch {row.get('batch')} tpot {row.get('tpot_ms', 0):.2f} "
                    f"ms {row.get('tokens_per_s', 0):.1f} tok/s hit {row.get('hit_rate', '-')}")
            found[mode] = r
            save()
        if "offload" in found and found["offload"].get("batch") and "sparse" in found and found["sparse"].get("batch"):
            b = found["sparse"]["batch"]

            def eq_run(mode, concurrent, churn):
                try:
                    return run_config(model, mode, context=ctx, batch=b, steps=a.steps, warmup=a.warmup, **timing,
                                      churn=churn, host_limit=hl, concurrent=concurrent)["tpot_ms"]
                except Exception as e:  # noqa: BLE001 - report, go on
                    log(f"[offload] equal batch {ctx} {mode} concurrent={concurrent} failed: "
                        f"{type(e).__name__}: {str(e)[:200]}")
                    return float("nan")

            # each configuration under both schedules (serial CUDA graph and concurrent one), the
            # resident and offloaded runs alternated `--eq-repeats` times: the loop is bound by the
            # host, whose speed drifts within a process, so each side's fastest run is compared (a
            # drift only adds time); the slowdown is against the faster resident schedule
            runs = {"resident_serial": [found["sparse"]["tpot_ms"]], "offload_conc": [], "resident_conc": [],
                    "offload_serial": []}
            for rep in range(a.eq_repeats):
                runs["offload_conc"].append(eq_run("offload", True, a.churn))
                runs["resident_conc"].append(eq_run("resident", True, 0.0))
                if a.eq_serial and rep == 0:
                    runs["offload_serial"].append(eq_run("offload", False, a.churn))
                if rep:
                    runs["resident_serial"].append(eq_run("resident", False, 0.0))
            best_of = {k: float(np.nanmin(v)) if v else float("nan") for k, v in runs.items()}
            best = np.nanmin([best_of["resident_serial"], best_of["resident_conc"]])
            payload["equal_batch"].append({"context": ctx, "batch": b, "churn": a.churn,
                                           "sparse_tpot_ms": best_of["resident_serial"],
                                           "sparse_concurrent_tpot_ms": best_of["resident_conc"],
                                           "offload_tpot_ms": best_of["offload_conc"],
                                           "offload_serial_tpot_ms": best_of["offload_serial"],
                                           "slowdown": best_of["offload_conc"] / best - 1,
                                           "runs_ms": {k: [round(x, 3) for x in v] for k, v in runs.items()}})
            log(f"[offload] equal batch {ctx}/B={b}: runs {payload['equal_batch'][-1]['runs_ms']}: "
                f"{100 * (best_of['offload_conc'] / best - 1):+.1f}%")
            save()
        d = found.get("dense", {}).get("tokens_per_s")
        for r in payload["throughput"]:
            if r["context"] == ctx and d and r.get("tokens_per_s"):
                r["x_dense"] = r["tokens_per_s"] / d
    # the random weights' own locality (no churn), at the longest context
    ctx = max(contexts)
    off_rows = [r for r in payload["throughput"] if r["label"].split(" (save ")[0] == "offload" and r["context"] == ctx
                and r.get("batch")]
    if off_rows and a.extras:
        b = off_rows[0]["batch"]
        trace_dir = Path(a.out or ".") / "offload_trace" if a.trace else None
        d = next((r["tokens_per_s"] for r in payload["throughput"] if r["label"] == "dense" and r["context"] == ctx
                  and r.get("tokens_per_s")), None)
        n1 = method.for_offload().offload_blocks_per_step(cache_capacity(ctx, timed_steps(a.warmup, a.steps, **timing)))
        for label, churn, pool in (("offload (smallest pool, churn 0.10)", 0.10, n1),
                                   ("offload (random weights' own locality)", 0.0, None)):
            raw = run_config(model, "offload", context=ctx, batch=b, steps=max(a.steps // 2, 2), warmup=a.warmup,
                             churn=churn, pool_slots=pool, host_limit=hl, bandwidth=bw, **timing)
            raw["label"] = label
            raw["x_dense"] = raw["tokens_per_s"] / d if d else None
            payload["throughput"].append(raw)
            log(f"[offload] {label}: {raw['tokens_per_s']:.1f} tok/s, hit {raw.get('hit_rate')}")
            save()
        if trace_dir is not None:
            tr = run_config(model, "offload", context=ctx, batch=b, steps=2, warmup=a.warmup, churn=a.churn, **timing,
                            trace_dir=trace_dir, host_limit=hl)
            payload["trace"] = tr["trace"]
            from benchmarks import trace_overlap

            png = Path(a.out or "benchmarks/results") / f"{a.name}_trace.png"
            trace_overlap.plot_timeline(tr["_trace_events"], tr["_trace_report"], png, window_ms=None)
            save()
        try:
            payload["device_put"] = device_put_alternative(
                model, context=ctx, batch=min(b, next((r["batch"] for r in payload["throughput"]
                                                       if r["label"] == "sparse" and r["context"] == ctx), b) or 1),
                mib_per_step=off_rows[0].get("mib_per_step") or 64)
        except Exception as e:  # noqa: BLE001 - report, go on
            log(f"[offload] device_put comparison failed: {type(e).__name__}: {str(e)[:200]}")
        save()
    if a.prefill_len:
        try:
            payload["prefill"] = prefill_compare(model, length=a.prefill_len, log=log)
        except Exception as e:  # noqa: BLE001 - report, go on
            log(f"[offload] prefill comparison failed: {type(e).__name__}: {str(e)[:200]}")
    path = save()
    print(render(payload))
    log(f"[offload] wrote {path} in {time.perf_counter() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
