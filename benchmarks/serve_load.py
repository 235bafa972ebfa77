"""Serving under load: Poisson arrivals at a sweep of rates through the engine.

``python -m benchmarks.serve_load`` drives :class:`models.serving.engine.Engine` (no
HTTP: the engine is what is measured) on a Qwen3-8B-shaped model with random
bf16 weights (content does not change decode time; requests run to their
output length, ``ignore_eos``). For each attention method (``--methods``;
``dense`` is the dense engine baseline, all KV resident; a sparse method runs
resident) and each arrival rate (``--rates``, requests/s):

* ``--requests`` requests arrive as a Poisson process (seeded). Prompt lengths
  come from ``--prompt-mix`` (``LENGTH:WEIGHT,...``; each draw is uniform in
  ``(LENGTH/2, LENGTH]``, so a mix entry is one prefill bucket), outputs are
  uniform in ``[--output-min, --output-max]`` tokens;
* reported: mean and P99 TTFT (arrival to first token), mean and P99 TBT
  (gaps between a request's tokens), mean queueing delay (arrival to prefill
  start), output-token throughput, mean decode batch, completed requests;
* goodput: the largest rate with P99 TBT <= 25x one **dense** decode iteration and
  mean queueing <= 2 s (SparseServe / Sarathi-Serve; issue 49), every request
  completed. One decode iteration is measured per method before the sweep: the
  median step with every slot (or as many rows as its pool holds) decoding a prompt
  of the smallest mix length; the SLO takes a dense run's (the same engine's where
  the results hold one, merged ones included), else the run's own.

Bounded: at most ``--requests`` per rate, and a rate stops after
``--time-limit`` seconds (unfinished requests are cancelled and reported).
Every prefill bucket and the step compile in a warm-up before the sweep.

``NAME+tsa`` (e.g. ``asynctls+tsa:paged``) prefills with Token Sparse Attention
(``--prefill-opt`` its options), whole prefills only.
``NAME:offload`` in ``--methods`` runs the method offloaded (KV blocks in
pinned host memory, per-slot pools); its rows report the KV blocks loaded
from the host per iteration. ``NAME:segmented`` adds layer-segmented prefill
interleaved with decode, ``NAME:resident-segmented`` the same with the KV on the
device; ``NAME:shared`` / ``NAME:shared-segmented`` run one
pool shared by the slots with working-set admission (SparseServe's design),
``NAME:shared-nows`` the shared pool without the admission (M_avl unbounded):
with ``dense`` and ``NAME`` (resident) that is SparseServe's Figure 13
ablation, one component at a time (:data:`PLACES`). ``NAME:offload-paged`` /
``NAME:offload-paged-segmented`` run it offloaded on paged host memory (the host pages
held by the requests, admission by free pages: ``Engine(paged=True, offload=True)``);
``NAME:offload-paged-shared`` / ``NAME:offload-paged-shared-segmented`` the same on one device
pool shared by the slots with working-set admission (SparseServe's whole design).

``--churn F`` (offloaded AsyncTLS): random weights have no temporal locality, so an offloaded
row's next block set shares little with its last and every step misses (measured 2026-12-06:
18% of the blocks a step reads at 64K, a pool of 128 blocks per row and head); real text
renews about 1% a step (Gemma 3 at 32K: 0.009, ``benchmarks.offload``'s default). With
``F`` > 0 each step's prefetch is the last set with ``round(F * (kb - 1))`` blocks moved
(``AsyncTLS.churn``; the filter still runs, so its cost is paid), as the offload benchmark
emulates real text's hit rate. 0 (the default): the random model's own selection.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gc
import json
import sys
import threading
import time
from pathlib import Path

import numpy as np

from benchmarks.timing import markdown_table, stamp, use_compile_cache_flag, write_final_results


@dataclasses.dataclass(frozen=True)
class Workload:
    rate: float
    arrivals: tuple[float, ...]       # seconds after the start
    prompt_lens: tuple[int, ...]
    output_lens: tuple[int, ...]


def parse_mix(text: str) -> list[tuple[int, float]]:
    """``"8192:0.5,16384:0.5"`` -> [(8192, 0.5), (16384, 0.5)] (weights normalised)."""
    out = []
    for part in text.split(","):
        length, _, weight = part.partition(":")
        try:
            out.append((int(length), float(weight or 1)))
        except ValueError:
            raise ValueError(f"--prompt-mix entries are LENGTH:WEIGHT, got {part!r}") from None
    if not out or any(n < 2 or w <= 0 for n, w in out):
        raise ValueError(f"--prompt-mix needs lengths >= 2 and weights > 0, got {text!r}")
    total = sum(w for _, w in out)
    return [(n, w / total) for n, w in out]


def parse_slots(text: str, labels) -> dict[str, int]:
    """``--slots``: ``"4"`` (every method), or a default and per-method counts,
    ``"6,dense=3"`` (the dense engine's cache holds ``slots x max_len`` on the device, an
    offloaded engine's on the host: at long prompts they fit different counts). A method
    with no count of its own takes the default; ValueError if there is none, or on a
    count below 1 or a label not in ``labels``."""
    default, per = None, {}
    for part in (x.strip() for x in text.split(",")):
        label, eq, n = part.rpartition("=") if "=" in part else ("", "", part)
        try:
            count = int(n)
        except ValueError:
            raise ValueError(f"--slots entries are N or LABEL=N, got {part!r}") from None
        if count < 1:
            raise ValueError(f"--slots must be >= 1, got {part!r}")
        if eq:
            if label not in labels:
                raise ValueError(f"--slots names {label!r}, not one of --methods {list(labels)}")
            per[label] = count
        else:
            default = count
    missing = [x for x in labels if x not in per]
    if missing and default is None:
        raise ValueError(f"--slots gives no count for {missing} (add a default: N,LABEL=N)")
    return {x: per.get(x, default) for x in labels}


def make_workload(rate: float, n: int, mix, out_min: int, out_max: int, seed: int) -> Workload:
    """``n`` requests arriving as a Poisson process of ``rate``: one seed gives the same
    prompt and output lengths at every rate, and arrival times that scale with ``1 / rate``."""
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, n)
    arrivals = np.cumsum(gaps) - gaps[0]  # the first request arrives at once
    lens = np.asarray([m for m, _ in mix])
    picks = lens[rng.choice(len(mix), n, p=[w for _, w in mix])]
    prompts = np.asarray([rng.integers(p // 2 + 1, p + 1) for p in picks])
    outs = rng.integers(out_min, out_max + 1, n)
    return Workload(rate, tuple(float(a) for a in arrivals), tuple(int(p) for p in prompts), tuple(int(o) for o in outs))


def _pct(x, q):
    return float(np.percentile(x, q)) if len(x) else float("nan")


def run_rate(engine, wl: Workload, time_limit: float, vocab: int, seed: int,
             mix_lengths: tuple[int, ...] = ()) -> dict:
    """Submit ``wl`` in real time to the running engine; metrics of this rate.
    ``mix_lengths``: the prompt mix's lengths, to report prefill times per length."""
    from models.serving.requests import SamplingParams

    rng = np.random.default_rng(seed + 1)
    reqs = []
    steps0 = engine.steps
    blocks0, hits0 = engine.blocks_loaded, getattr(engine.kv, "blocks_hit", 0)
    start = time.perf_counter()
    stop_submitting = threading.Event()

    def submitter():
        for a, p, o in zip(wl.arrivals, wl.prompt_lens, wl.output_lens):
            delay = start + a - time.perf_counter()
            if delay > 0 and stop_submitting.wait(delay):
                return
            ids = rng.integers(0, vocab, p).tolist()
            reqs.append(engine.submit(engine.make_request(ids, SamplingParams(max_tokens=o, ignore_eos=True))))

    t = threading.Thread(target=submitter, daemon=True)
    t.start()
    deadline = start + time_limit
    ws_samples = []  # the running requests' working sets (the scheduler's estimate), sampled
    while time.perf_counter() < deadline:
        if not t.is_alive() and len(reqs) == len(wl.arrivals) and all(r.done.is_set() for r in reqs):
            break
        st = engine.stats()
        if st["active_slots"]:
            ws_samples.append(st["working_set_bytes"])
        time.sleep(0.01)
    stop_submitting.set()
    t.join()
    for r in reqs:
        if not r.done.is_set():
            engine.cancel(r)
    for r in reqs:
        r.done.wait(60)
    end = max((r.token_times[-1] for r in reqs if r.token_times), default=time.perf_counter())
    done = [r for r in reqs if r.finish_reason == "length"]
    failed = [r for r in reqs if r.finish_reason == "error"]
    ttft = [r.t_first - r.t_arrival for r in done]
    queue = [r.t_scheduled - r.t_arrival for r in done]
    prefill = [r.t_first - r.t_scheduled for r in done]  # prefill started to first token
    gaps = [np.diff(r.token_times) for r in done]
    tbt = [g for gs in gaps for g in gs]
    # prefill per mix length (the (L/2, L] a prompt came from)
    prefill_by_len = collections.defaultdict(list)
    for r, p in zip(done, prefill):
        prefill_by_len[min((n for n in mix_lengths if r.prompt_len <= n), default=r.prompt_len)].append(p)
    worst = max(((g, r.prompt_len, i + 1) for r, gs in zip(done, gaps) for i, g in enumerate(gs)), default=None)
    out_tokens = sum(len(r.output_ids) for r in reqs)
    steps = engine.steps - steps0
    decode_tokens = sum(max(0, len(r.output_ids) - 1) for r in reqs)  # the first token comes from the prefill
    return {"rate": wl.rate, "submitted": len(reqs), "requests": len(wl.arrivals), "completed": len(done),
            "failed": len(failed), "errors": sorted({r.error for r in failed})[:3],
            "wall_s": end - start, "mean_ttft_s": float(np.mean(ttft)) if ttft else float("nan"),
            "p99_ttft_s": _pct(ttft, 99), "mean_tbt_ms": 1e3 * float(np.mean(tbt)) if tbt else float("nan"),
            "p99_tbt_ms": 1e3 * _pct(tbt, 99), "max_tbt_ms": 1e3 * float(max(tbt)) if tbt else float("nan"),
            "max_tbt_at": None if worst is None else f"{worst[1]}-token prompt, before output token {worst[2]}",
            "mean_queue_s": float(np.mean(queue)) if queue else float("nan"),
            "mean_prefill_s": float(np.mean(prefill)) if prefill else float("nan"),
            "prefill_s_by_length": {str(n): round(float(np.mean(v)), 3) for n, v in sorted(prefill_by_len.items())},
            "throughput_tok_s": out_tokens / max(end - start, 1e-9), "output_tokens": out_tokens,
            "decode_steps": steps, "mean_batch": decode_tokens / steps if steps else 0.0,
            "blocks_loaded_per_iter": (engine.blocks_loaded - blocks0) / steps if steps else 0.0,
            # offloaded: the share of the blocks the steps read that the device pool held
            "pool_hit_rate": _hit_rate(getattr(engine.kv, "blocks_hit", 0) - hits0, engine.blocks_loaded - blocks0),
            "mean_working_set_mib": float(np.mean(ws_samples)) / 2**20 if ws_samples else 0.0}


def _hit_rate(hits: int, misses: int) -> float | None:
    """``hits / (hits + misses)``; None where no block was read (a resident engine)."""
    return hits / (hits + misses) if hits + misses else None


def decoding_rows(engine, tokens: int) -> int:
    """Requests of ``tokens`` positions that decode at once: every slot, or fewer where a
    paged pool smaller than ``slots x max_len`` (benchmark C's capped device) holds fewer."""
    kv, sched = engine.kv, engine.scheduler
    if not engine.paged or kv.holds_every_slot_full:
        return engine.slots
    total = kv.kv_blocks_total
    # the scheduler admits a request only while its watermark of pages stays free
    headroom = -(-sched.headroom_bytes * total // max(sched.kv_bytes, 1))
    return max(1, min(engine.slots, (total - headroom) // kv.blocks.blocks_for(tokens)))


FULL_STEPS = 24  # warm-up: decode steps measured with every row decoding


def bucket_prompts(engine, n: int) -> list[int]:
    """Prompt lengths of (n/2, n] (the workload's draws for a mix length ``n``), the longest
    of each prefill bucket, where the engine's prompts run at buckets
    (``engine.kv.prompt_tokens``: the offloaded layer-by-layer prefill, four an octave); else
    ``[n]`` (chunked prefill: one program per chunk whatever the prompt)."""
    bucket = getattr(engine.kv, "prompt_tokens", None)
    if bucket is None:
        return [n]
    longest = {}
    for m in range(n // 2 + 1, n + 1):
        longest[bucket(m)] = m
    return sorted(longest.values())


def warm_up(engine, mix, vocab: int) -> tuple[float, int, int]:
    """Compile every prefill bucket of the mix and the step; returns one decode iteration
    (ms), its rows and their prompt's tokens: the median step with as many rows decoding a
    prompt of the smallest mix length as the pool holds at once (every slot, where it holds
    them); a shorter prompt where that length leaves a row no room to decode while the others
    prefill (:func:`warm_up_prompt`)."""
    from models.serving.requests import SamplingParams

    rng = np.random.default_rng(0)
    segments = {}  # prefill iterations of one prompt of each length (layer-segmented prefill; else 0)
    for n, _ in mix:
        # an engine whose prompts run at buckets (the offloaded layer-by-layer prefill) compiles
        # each bucket the load's prompts of (n/2, n] reach, the longest first, not in the timed load
        for m in sorted(bucket_prompts(engine, n), reverse=True):
            before = engine.prefill_segments
            r = engine.generate(rng.integers(0, vocab, m).tolist(), SamplingParams(max_tokens=2, ignore_eos=True))
            if r.finish_reason != "length":  # e.g. its bucket's prefill ran out of device memory
                raise RuntimeError(f"warm-up: a {m}-token prompt ended {r.finish_reason!r}: {r.error}")
            if m == n:
                segments[n] = engine.prefill_segments - before
    # every short prompt program the precompile compiled, alone and in groups, run once (the
    # grouped engine's first timed rate was its slow one before: docs/serving.md)
    engine.warm_up(shortest_prompt=min(m // 2 + 1 for m, _ in mix), sampled=False)
    n = min(m for m, _ in mix)
    # the pool is sized for the tokens a row holds when the last is inserted: a segmented prefill
    # takes `segments` iterations a prompt, each with a decode step
    steps = min(FULL_STEPS + engine.slots * segments[n], engine.context - n)
    rows = decoding_rows(engine, n + steps)
    n = warm_up_prompt(engine.context, n, rows, segments[n])
    # each may decode to the context, and is cancelled once FULL_STEPS steps ran with every row
    # decoding: a fixed output ran out before the last insertion (10 rows of 64K, segmented,
    # 2026-12-06), as 24 tokens each did before
    reqs = [engine.make_request(rng.integers(0, vocab, n).tolist(),
                                SamplingParams(max_tokens=engine.context - n, ignore_eos=True))
            for _ in range(rows)]
    k = len(engine.step_times)
    for r in reqs:
        engine.submit(r)
    give_up = time.perf_counter() + 600
    while time.perf_counter() < give_up and not any(r.done.is_set() for r in reqs):
        if all(r.t_first is not None for r in reqs):
            last_insert = max(r.t_first for r in reqs)
            if sum(t > last_insert for t in engine.step_end_times[k:]) >= FULL_STEPS:
                break
        time.sleep(0.005)
    for r in reqs:
        engine.cancel(r)
    for r in reqs:
        if not r.done.wait(60) or r.finish_reason not in ("cancelled", "length") or r.t_first is None:
            raise RuntimeError(f"warm-up: {rows} requests of {n} tokens at once: one ended "
                               f"{r.finish_reason!r}: {r.error}")
    times, ends = engine.step_times[k:], engine.step_end_times[k:]
    # the steps after the last insertion and before the first request ended: every slot decoding
    last_insert = max(r.t_first for r in reqs)
    first_end = min(r.token_times[-1] for r in reqs)  # then a row leaves the batch
    full = [dt for dt, t in zip(times, ends) if last_insert < t <= first_end]
    if not full:
        t0 = min(r.t_arrival for r in reqs)
        raise RuntimeError(
            f"warm-up: no decode step with all {rows} requests decoding ({len(times)} steps; first "
            f"tokens at {[round(r.t_first - t0, 2) for r in reqs]} s, the first request's last at "
            f"{first_end - t0:.2f} s, {len(reqs[0].output_ids)} tokens)")
    return 1e3 * float(np.median(full)), rows, n


def warm_up_prompt(context: int, n: int, rows: int, segments: int) -> int:
    """The warm-up's prompt length: ``n``, or shorter where ``rows`` prompts of ``n`` leave the
    first no room in ``context`` to decode while each later one prefills (``segments``
    iterations each) and then ``FULL_STEPS`` beside them all. A prompt near ``max_len`` whose
    chunks run in layer parts needs it: 4 rows of 64K in a 66,048 context, 8 parts, 256
    iterations a prompt (H100, 2026-12-07: the first row ended at its context before the last
    was inserted, and the warm-up failed)."""
    # + the first token, the step in flight, and the few steps that may pass between the loop's
    # poll and its cancel
    room = FULL_STEPS + (rows - 1) * segments + 8
    if n + room <= context:
        return n
    if context - room < n // 2:  # the iteration would no longer be the mix's
        raise ValueError(f"warm-up: {rows} rows of {n} tokens, {segments} prefill iterations each, need "
                         f"{room} decode positions beyond the prompt in a {context}-token context; "
                         f"give the engine a longer max_len or fewer slots")
    return context - room


def goodput(rows: list[dict], iteration_ms: float) -> float | None:
    ok = [r["rate"] for r in rows if r["completed"] == r["requests"] and r["p99_tbt_ms"] <= 25 * iteration_ms
          and r["mean_queue_s"] <= 2.0]
    return max(ok) if ok else None


def apply_dense_slo(runs: list[dict]) -> None:
    """Goodput's SLO on one **dense** iteration, as issue 49 and Sarathi-Serve define it: each
    run's ``slo_iteration_ms`` is the iteration of a dense run in the same results (the one on
    the same engine, ``NAME:PLACE``'s place, where there is one), its goodput recomputed on it;
    a set without a dense run keeps each run's own iteration (``slo_base`` says which)."""
    def place(r):
        return r["method"].split(" (")[0].partition(":")[2]

    dense = [r for r in runs if "error" not in r and r["method"].split(":")[0].split("+")[0] == "dense"]
    for r in runs:
        if "error" in r:
            continue
        base = next((d for d in dense if place(d) == place(r)), dense[0] if dense else None)
        r["slo_iteration_ms"] = r["iteration_ms"] if base is None else base["iteration_ms"]
        r["slo_base"] = "own iteration" if base is None else f"{base['method']}'s iteration"
        r["goodput_rps"] = goodput(r["rows"], r["slo_iteration_ms"])


def with_prefill(method, args, tsa: bool):
    """``method`` with Token Sparse Attention's prefill (``NAME+tsa``; ``--prefill-opt`` its
    options), or as it is."""
    if not tsa:
        return method
    from models.cli.options import parse_attention_opts

    opts = parse_attention_opts(args.prefill_opt, flag="--prefill-opt")
    method = dataclasses.replace(method, prefill="token_sparse", prefill_options=tuple(opts.items()))
    method.sparse_prefill()  # a bad option: ValueError before the weights are drawn
    return method


def build_model(args, method_name: str):
    """The model of ``method_name`` (``NAME`` or ``NAME+tsa``), random bf16 weights."""
    import models
    from benchmarks.offload import asynctls_for, qwen3_8b, random_model
    from sparse_jax.methods import get_method

    if args.tiny:
        cfg = models.ModelConfig(name="tiny", arch="qwen3", num_layers=3, hidden_size=64, num_heads=4,
                                 num_kv_heads=2, head_dim=32, intermediate_size=128, vocab_size=256,
                                 max_position=args.max_len, rope_theta=1e6, rms_eps=1e-6, tie_embeddings=False)
    else:
        cfg = qwen3_8b(max(args.max_len, 40960))
    method_name, _, tsa = method_name.partition("+")
    if method_name == "asynctls":
        method = asynctls_for(cfg, args.budget, args.kb)
        if args.churn:  # offloaded only: it moves the lagged filter's prefetch (AsyncTLS.churn)
            method = dataclasses.replace(method, churn=args.churn)
        if args.tiny:  # 64-token blocks do not fit the tiny prompts
            method = dataclasses.replace(method, block_size=16)
    elif method_name == "double_sparsity":
        chans = tuple(tuple(range(h % 4, cfg.head_dim, 4))[:cfg.head_dim // 4] for h in range(cfg.num_kv_heads))
        method = get_method("double_sparsity", budget=args.budget, channels_per_layer=(chans,) * cfg.num_layers)
    elif method_name == "dense":
        method = get_method("dense")
    else:
        method = get_method(method_name, budget=args.budget)
    return random_model(cfg, with_prefill(method, args, tsa), args.max_len, seed=0)


def run(args) -> dict:
    import jax

    from sparse_jax.offload import capacity

    pinned = None
    if any("offload" in label for label in args.methods.split(",")):  # before the GPU client starts
        pinned = capacity.plan_pinned_host_limit()
        print(pinned, file=sys.stderr, flush=True)
    if args.tensor_parallel < 1 or args.tensor_parallel > len(jax.devices()):
        raise SystemExit(f"--tensor-parallel {args.tensor_parallel}: {len(jax.devices())} devices visible")
    mix = parse_mix(args.prompt_mix)
    rates = [float(r) for r in args.rates.split(",")]
    slots = parse_slots(args.slots, args.methods.split(","))
    runs = []
    for label in args.methods.split(","):
        try:
            runs.append(run_method(args, label, mix, rates, slots[label]))
        except Exception as e:  # noqa: BLE001 - reported in the results, the next method runs
            msg = f"{type(e).__name__}: {str(e).strip()[:600]}"
            print(f"[{label}] FAILED: {msg}", file=sys.stderr, flush=True)
            runs.append({"method": label, "slots": slots[label], "error": msg, "rows": []})
        finally:
            gc.collect()
            jax.clear_caches()
    return {"stamp": stamp(), "model": "tiny" if args.tiny else "qwen3-8b (random bf16 weights)",
            "prompt_mix": mix, "output_range": [args.output_min, args.output_max], "requests_per_rate": args.requests,
            "time_limit_s": args.time_limit, "budget": args.budget, "kb": args.kb,
            "tensor_parallel": args.tensor_parallel, "runs": runs,
            **({"pinned_host": pinned} if pinned else {})}


def run_method(args, label: str, mix, rates, slots: int) -> dict:
    """One method's warm-up and rate sweep on its own engine (stopped at the end)."""
    import jax

    from models.runtime.sharding import shard
    from models.serving.engine import Engine
    from sparse_jax.offload.capacity import CapacityError

    method_name, _, where = label.partition(":")
    check_label(label)
    model = build_model(args, method_name)
    if args.tensor_parallel > 1:  # the unsharded copy goes with `model`
        model = shard(model, model=args.tensor_parallel)
    shared = "shared" in where
    inject = (args.max_inject_tokens or max(length for length, _ in mix)) if where.endswith("segmented") else None
    ws_admission = shared and where != "shared-nows"
    t_build = time.perf_counter()

    def build(n: int):
        return Engine(model, slots=n, max_len=args.max_len, max_tokens_per_iter=args.max_tokens_per_iter,
                      offload=where not in RESIDENT_PLACES,
                      pool_slots=args.shared_pool_slots if shared else args.pool_slots,
                      pool="shared" if shared else "per_row", max_inject_tokens=inject,
                      kv_bytes=UNBOUNDED_KV_BYTES if shared and not ws_admission else None,
                      paged=where.startswith(("paged", "offload-paged")),
                      prefill_chunk=args.prefill_chunk if where == "paged-chunked" else None,
                      group_prompts=args.group_prompts or where != "paged-chunked",
                      chunk_parts=args.chunk_parts if where == "paged-chunked" else 1)

    engine = None
    while engine is None:
        try:
            engine = build(slots)
        except CapacityError as e:  # refused before allocating: with --fit-slots, one row fewer
            if not args.fit_slots or slots == 1:
                raise
            print(f"[{label}] {slots} slots refused ({e}); trying {slots - 1}", flush=True)
            slots -= 1
    build_s = time.perf_counter() - t_build  # a paged engine on a GPU compiles its largest prompt program here
    print(f"[{label}] engine built in {build_s:.1f} s", flush=True)
    checked = getattr(getattr(engine.kv, "runner", None), "checked_footprint", None)
    if checked is not None:  # an offloaded engine on a GPU: what its capacity check counted
        print(f"[{label}] capacity check: {checked.describe()}", flush=True)
    try:
        pre = {"programs": 0, "seconds": 0.0, "failed": []}
        if args.precompile if args.precompile is not None else jax.default_backend() == "gpu":
            # the programs in parallel threads, before the engine runs: those the load's greedy
            # requests of at least the mix's shortest prompt run (offloaded: its prompt buckets' prefills)
            opts = {} if getattr(engine.kv, "offloaded", False) else {"sampled": (False,)}
            pre = engine.precompile(shortest_prompt=min(n // 2 + 1 for n, _ in mix), progress=True, **opts)
            print(f"[{label}] precompiled {pre['programs']} programs in {pre['seconds']:.1f} s "
                  f"({pre.get('from_cache', 0)} loaded from the compile cache); not ahead: "
                  f"{pre['failed'] or 'none'}", flush=True)
        engine.start()
        t0 = time.perf_counter()
        iteration_ms, iteration_rows, iteration_tokens = warm_up(engine, mix, model.config.vocab_size)
        warm_s = time.perf_counter() - t0
        print(f"[{label}] warm-up {warm_s:.1f} s; one decode iteration ({iteration_rows} rows of "
              f"{iteration_tokens} tokens) {iteration_ms:.2f} ms", flush=True)
        rows = []
        for rate in rates:
            # every rate (and method) runs the same requests, their arrivals scaled: rows compare
            wl = make_workload(rate, args.requests, mix, args.output_min, args.output_max, args.seed)
            row = run_rate(engine, wl, args.time_limit, model.config.vocab_size, args.seed,
                           tuple(n for n, _ in mix))
            row["method"] = label
            rows.append(row)
            shown = {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}
            print(f"[{label}] rate {rate}: {json.dumps(shown)}", flush=True)
        return {"method": label, "offloaded": where not in RESIDENT_PLACES,
                "pool": ("shared" if shared else "per_row") if where not in RESIDENT_PLACES else None,
                "ws_admission": ws_admission,
                "churn": args.churn if where not in RESIDENT_PLACES and method_name.startswith("asynctls") else None,
                "max_inject_tokens": inject,
                "prefill_chunk": args.prefill_chunk if where == "paged-chunked" else None,
                "group_prompts": bool(args.group_prompts) if where == "paged-chunked" else None,
                "chunk_parts": args.chunk_parts if where == "paged-chunked" else None,
                "prompt_groups": getattr(engine.kv, "prompt_groups", 0), "prefill_segments": engine.prefill_segments, "slots": engine.slots,
                "max_len": engine.max_len, "paged": engine.paged,
                "kv_blocks_total": engine.stats()["kv_blocks_total"], "preempted": engine.preempted,
                "iteration_ms": iteration_ms, "iteration_rows": iteration_rows,
                "iteration_tokens": iteration_tokens, "precompile": pre, "engine_build_s": build_s, "warmup_s": warm_s, "rows": rows}
    finally:
        engine.stop()


def render(payload: dict) -> str:
    s = payload["stamp"]
    md = [f"# Serving under load ({payload['model']})", ""]
    parts = payload.get("parts") or [s]
    if len(parts) == 1:
        md += [f"- device: {s['device']} ({s['backend']}), jax {s['jax']}, {s['date']}, commit {s['git_commit']}",
               f"- command: `{s['command']}`"]
    else:  # joined by --merge: where and how each part ran
        md += [f"- joined from {len(parts)} runs (`--merge`), each:"]
        md += [f"  {i}. {p['device']} ({p['backend']}), jax {p['jax']}, {p['date']}, commit {p['git_commit']}: "
               f"`{p['command']}`" for i, p in enumerate(parts, 1)]
    md += [f"- prompt mix {payload['prompt_mix']}, outputs {payload['output_range']} tokens, "
          f"{payload['requests_per_rate']} requests per rate, at most {payload['time_limit_s']} s per rate"]
    if payload.get("tensor_parallel", 1) > 1:
        md.append(f"- tensor parallel: each engine over {payload['tensor_parallel']} devices (the model and its KV "
                  f"split by KV heads)")
    md.append("")
    summary = [{"method": r["method"], "slots": r["slots"], "max_len": r["max_len"],
                "iteration_ms": r["iteration_ms"], "iteration rows": r.get("iteration_rows", r["slots"]),
                "SLO P99 TBT ms (25x dense iteration)": 25 * r.get("slo_iteration_ms", r["iteration_ms"]),
                # which iteration the SLO took: a dense run's, or the run's own where the results hold none
                "SLO base": r.get("slo_base", ""),
                "goodput req/s": r["goodput_rps"] if r["goodput_rps"] is not None else "none",
                # starting: the engine's build (its pool sized by a compile) and its precompile
                "build + precompile s": (f"{r['engine_build_s']:.0f} + {r['precompile']['seconds']:.0f} "
                                         f"({r['precompile']['programs']} programs, "
                                         f"{r['precompile'].get('from_cache', 0)} cached)"
                                         if "engine_build_s" in r else "")}
               for r in payload["runs"] if "error" not in r]
    md += [markdown_table(summary, list(summary[0])) if summary else "", ""]
    md += [f"- **{r['method']} ({r['slots']} slots) failed**: {r['error']}" for r in payload["runs"] if "error" in r]
    md += [f"- {r['method']}: churn {r['churn']} (each step's prefetch is the last block set with that share moved, "
           f"emulating real text's hit rate on random weights: `--churn`)" for r in payload["runs"] if r.get("churn")]
    md += [f"- {n}" for n in payload.get("notes", [])] + [""]
    rows = [row for r in payload["runs"] for row in r["rows"]]
    cols = ["method", "rate", "completed", "failed", "requests", "mean_ttft_s", "p99_ttft_s", "mean_tbt_ms", "p99_tbt_ms",
            "max_tbt_ms", "mean_queue_s", "mean_prefill_s", "throughput_tok_s", "mean_batch",
            "blocks_loaded_per_iter", "pool_hit_rate", "mean_working_set_mib"]
    md += [markdown_table([{"mean_prefill_s": float("nan"), **row,
                            "pool_hit_rate": "" if row.get("pool_hit_rate") is None else row["pool_hit_rate"]}
                           for row in rows], cols), ""]
    # where the time went (results from before these fields lack them)
    md += [f"- {row['method']} at {row['rate']} req/s: mean prefill (scheduled to first token) by prompt length "
           f"{row['prefill_s_by_length']} s; the longest token gap came {row['max_tbt_at']}"
           for row in rows if row.get("prefill_s_by_length")]
    return "\n".join(md + [""])


def plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # the longest gap shows what P99 hides: a dense engine stalls its running requests for whole prefills
    keys = [("mean_ttft_s", "mean TTFT (s)"), ("p99_tbt_ms", "P99 TBT (ms)"), ("max_tbt_ms", "max TBT (ms, log)"),
            ("throughput_tok_s", "tokens/s")]
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.8))
    axes[2].set_yscale("log")
    for run_ in payload["runs"]:
        if "error" in run_:
            continue
        rates = [r["rate"] for r in run_["rows"]]
        for ax, (k, title) in zip(axes, keys):
            ax.plot(rates, [r.get(k, float("nan")) for r in run_["rows"]], marker="o", label=run_["method"])
            ax.set_title(title)
            ax.set_xlabel("request rate (req/s)")
        axes[1].axhline(25 * run_.get("slo_iteration_ms", run_["iteration_ms"]), ls=":", lw=0.8,
                        color=axes[1].lines[-1].get_color())
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=max(1, len(labels)), fontsize=8)
    fig.suptitle(f"{payload['model']}, {payload['stamp'].get('device', '')}", fontsize=9)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def merge(paths: list[str]) -> dict:
    """One payload from several runs (e.g. one method per device command). Runs of one
    method and configuration (slots, pool, max_inject_tokens) join into one, their rows
    in rate order (the iteration time is their mean; every goodput is computed afterwards,
    :func:`apply_dense_slo`); one method at several ``max_inject_tokens`` or ``prefill_chunk``
    gets labels that say which."""
    parts = [json.loads(Path(p).read_text()) for p in paths]
    out = dict(parts[0])
    # the header's "at most N s per rate" holds for every part (parts ran under their own limits)
    out["time_limit_s"] = max(p.get("time_limit_s", 0) for p in parts)
    runs = [dict(r) for p in parts for r in p["runs"]]
    out["parts"] = [st for p in parts for st in (p.get("parts") or [p["stamp"]])]  # a merged input keeps its own
    for label in {r["method"] for r in runs}:
        same = [r for r in runs if r["method"] == label]
        for knob, word in (("max_inject_tokens", "inject"), ("prefill_chunk", "chunk"),
                           ("group_prompts", "grouped"), ("chunk_parts", "parts"), ("churn", "churn")):
            if len({r.get(knob) for r in same}) > 1:
                for r in same:
                    r["method"] = f"{r['method']} ({word} {r.get(knob)})"
                    r["rows"] = [{**row, "method": r["method"]} for row in r["rows"]]
    groups: dict = {}  # in order of first appearance; a failed run stays alone
    for r in runs:
        key = id(r) if "error" in r else (r["method"], r.get("slots"), r.get("pool"), r.get("max_inject_tokens"),
                                          r.get("prefill_chunk"), r.get("group_prompts"), r.get("chunk_parts"),
                                          r.get("churn"))
        groups.setdefault(key, []).append(r)
    out["runs"] = []
    for first, *more in groups.values():
        if more:
            same = [first, *more]
            first["iteration_ms"] = sum(r["iteration_ms"] for r in same) / len(same)
            first["rows"] = sorted((row for r in same for row in r["rows"]), key=lambda row: row["rate"])
        out["runs"].append(first)
    return out


#: where a method runs: resident ("", or with layer-segmented prefill), offloaded with a pool per
#: slot, + layer-segmented prefill,
#: on one shared pool with working-set admission (+ segmented prefill), or on the shared pool
#: without it ("shared-nows": M_avl unbounded, only R_max's one-step cap): SparseServe's
#: Figure 13 ablation is dense, NAME, NAME:offload, NAME:shared-nows, NAME:shared,
#: NAME:shared-segmented; resident on one pool of pages shared by the requests ("paged", + segmented
#: prefill: "paged-segmented", + chunked prefill through every layer into the pages: "paged-chunked");
#: offloaded on paged host memory, per-slot pools ("offload-paged", + segmented prefill), or one shared
#: pool with working-set admission ("offload-paged-shared", + segmented prefill)
PLACES = ("", "offload", "segmented", "resident-segmented", "shared", "shared-segmented", "shared-nows", "paged",
          "paged-segmented", "paged-chunked", "offload-paged", "offload-paged-segmented", "offload-paged-shared",
          "offload-paged-shared-segmented")
RESIDENT_PLACES = ("", "resident-segmented", "paged", "paged-segmented", "paged-chunked")
UNBOUNDED_KV_BYTES = 1 << 62


def check_label(label: str) -> None:
    """ValueError unless ``label`` is NAME or NAME:WHERE (WHERE one of :data:`PLACES`), NAME a
    method or METHOD+tsa (Token Sparse Attention's prefill)."""
    name, _, where = label.partition(":")
    if name.partition("+")[2] not in ("", "tsa"):
        raise ValueError(f"method label {label!r}: NAME or NAME+tsa (Token Sparse Attention's prefill)")
    if where not in PLACES:
        raise ValueError(f"method label {label!r}: NAME, NAME:offload, NAME:segmented, NAME:resident-segmented, "
                         f"NAME:shared, NAME:shared-segmented, NAME:shared-nows, NAME:paged, NAME:paged-segmented, "
                         f"NAME:paged-chunked, NAME:offload-paged, NAME:offload-paged-segmented, "
                         f"NAME:offload-paged-shared or NAME:offload-paged-shared-segmented")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.serve_load", description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", default="dense,asynctls,asynctls:offload",
                   help="comma-separated: dense, asynctls, quest, ...; NAME:offload runs it offloaded (a pool per "
                        "slot), NAME:segmented offloaded with layer-segmented prefill (NAME:resident-segmented: "
                        "resident), NAME:shared and "
                        "NAME:shared-segmented the same on one pool shared by the slots (SparseServe's), "
                        "NAME:shared-nows on the shared pool without working-set admission (the ablation)")
    p.add_argument("--pool-slots", type=int, default=None, help="offloaded: block slots per (slot, KV head)")
    p.add_argument("--shared-pool-slots", type=int, default=None,
                   help="NAME:shared / NAME:shared-segmented: block slots per (layer, KV head) of the pool all slots "
                        "share (default: slots x the per-slot default)")
    p.add_argument("--max-inject-tokens", type=int, default=None,
                   help="NAME:segmented / NAME:resident-segmented (layer-segmented prefill): prompt tokens x layers per iteration "
                        "(default: the longest prompt of the mix, one layer of it per iteration)")
    p.add_argument("--prefill-opt", action="append", default=[], metavar="KEY=VALUE",
                   help="NAME+tsa: an option of sparse_jax.prefill.TokenSparsePrefill (repeatable), e.g. "
                        "min_tokens=8192")
    p.add_argument("--precompile", action=argparse.BooleanOptionalAction, default=None,
                   help="compile each paged engine's programs in parallel before its warm-up (Engine.precompile; "
                        "default: on a GPU)")
    p.add_argument("--compile-cache", default=None, metavar="DIR",
                   help="keep compiled programs in DIR and load them from there (jax's persistent compilation "
                        "cache, models.serving.precompile.use_compile_cache): a second run on the same machine "
                        "loads what the first compiled; the precompile's time and count of programs loaded are "
                        "in the results")
    p.add_argument("--group-prompts", action=argparse.BooleanOptionalAction, default=True,
                   help="NAME:paged-chunked: short prompts starting in an iteration prefill as the rows of one "
                        "program (default); --no-group-prompts: one program each (Engine(group_prompts=False))")
    p.add_argument("--prefill-chunk", type=int, default=2048,
                   help="NAME:paged-chunked: prompt tokens per iteration, through every layer into the pages")
    p.add_argument("--chunk-parts", type=int, default=1,
                   help="NAME:paged-chunked: each chunk of a longer prompt in this many parts by layers, one an "
                        "iteration (Engine(chunk_parts=N))")
    p.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="each engine over N devices, the model and its KV split by KV heads (the paged engine's "
                        "pools included; models.runtime.sharding): against a run of 1 in the same session")
    p.add_argument("--rates", default="0.1,0.2,0.4,0.8", help="arrival rates, requests/s")
    p.add_argument("--requests", type=int, default=12, help="requests per rate")
    p.add_argument("--prompt-mix", default="8192:0.5,16384:0.5", help="LENGTH:WEIGHT,... (each (L/2, L])")
    p.add_argument("--output-min", type=int, default=128)
    p.add_argument("--output-max", type=int, default=512)
    p.add_argument("--slots", default="4",
                   help="decode slots (R_max): N for every method, or a default and per-method counts, e.g. "
                        "6,dense=3 (the dense engine's cache is on the device, an offloaded one's on the host)")
    p.add_argument("--max-len", type=int, default=None, help="cache per slot (default: max prompt + max output)")
    p.add_argument("--max-tokens-per-iter", type=int, default=None, help="T_max")
    p.add_argument("--budget", type=int, default=2048, help="sparse methods' token budget")
    p.add_argument("--kb", type=int, default=128, help="asynctls: blocks of the filter")
    p.add_argument("--churn", type=float, default=0.0,
                   help="offloaded asynctls: the share of its block set renewed per step, emulating real text's "
                        "hit rate on random weights (0.009: Gemma 3 at 32K; default 0, the random model's own)")
    p.add_argument("--time-limit", type=float, default=120.0, help="seconds per rate at most")
    p.add_argument("--fit-slots", action="store_true",
                   help="where the capacity check refuses an engine's slots (before allocating), one fewer until "
                        "it fits: benchmark C's most rows under the cap, found without a call per try")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny", action="store_true", help="a small random model (CPU smoke test)")
    p.add_argument("--out", default=None, help="results directory (default benchmarks/results)")
    p.add_argument("--name", default="serve_load")
    p.add_argument("--merge", default=None, help="comma-separated result JSONs to join (no run)")
    p.add_argument("--note", action="append", default=[], help="a line for the results' notes (repeatable)")
    a = p.parse_args(argv)
    if a.merge is None:
        for label in a.methods.split(","):
            try:
                check_label(label)
            except ValueError as e:
                p.error(str(e))
        if not a.group_prompts and not any(m.endswith(":paged-chunked") for m in a.methods.split(",")):
            p.error("--no-group-prompts applies to NAME:paged-chunked engines, and --methods names none")
        if a.chunk_parts != 1 and not any(m.endswith(":paged-chunked") for m in a.methods.split(",")):
            p.error("--chunk-parts applies to NAME:paged-chunked engines, and --methods names none")
        if a.chunk_parts < 1:
            p.error("--chunk-parts must be >= 1")
        if not 0 <= a.churn < 1:
            p.error(f"--churn must be in [0, 1), got {a.churn}")
        if a.churn and not any(m.partition("+")[0].partition(":")[0] == "asynctls"
                               and m.partition(":")[2] not in RESIDENT_PLACES for m in a.methods.split(",")):
            p.error("--churn applies to offloaded asynctls engines (asynctls:offload..., asynctls:shared...), "
                    "and --methods names none")
        mix = parse_mix(a.prompt_mix)
        if not 1 <= a.output_min <= a.output_max:
            p.error("need 1 <= --output-min <= --output-max")
        if a.max_len is None:
            from models.api import round_up

            a.max_len = round_up(max(m for m, _ in mix) + a.output_max, 64)
        if max(m for m, _ in mix) + a.output_max > a.max_len:
            p.error(f"--max-len {a.max_len} is below the longest prompt + output")
        if a.requests < 1 or a.time_limit <= 0:
            p.error("--requests and --time-limit must be positive")
        try:
            parse_slots(a.slots, a.methods.split(","))
        except ValueError as e:
            p.error(str(e))
        try:
            rates = [float(r) for r in a.rates.split(",")]
        except ValueError:
            p.error(f"--rates must be comma-separated numbers, got {a.rates!r}")
        if any(r <= 0 for r in rates):
            p.error("--rates must be > 0")
    return a


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.compile_cache and not args.merge:
        use_compile_cache_flag(args.compile_cache)
    payload = merge(args.merge.split(",")) if args.merge else run(args)
    apply_dense_slo(payload["runs"])
    if args.note:
        payload["notes"] = payload.get("notes", []) + args.note
    write_final_results(args.name, payload, render, plot, Path(args.out) if args.out else None)
    return 1 if any("error" in r for r in payload["runs"]) else 0


if __name__ == "__main__":
    sys.exit(main())
