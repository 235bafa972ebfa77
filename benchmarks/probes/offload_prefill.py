"""Where an offloaded prompt's prefill spends its time (GPU): issue 49's benchmark C.

Under benchmark C's load the offloaded AsyncTLS engine prefilled a 64K prompt in 8.2 s (whole)
and 10.7 s (layer-segmented), where the dense engine's chunked prefill took 3.2 s
(``benchmarks/results/serve_load_memory_churn_h100.md``), and the load is prefill-bound. The
offloaded prefill runs the layers one program each (:class:`models.runtime.tiered_prefill.
PrefillJob`) and stores each layer's blocks into the request's pinned host pages. Until
2026-12-06 every store ran after the last layer, on the engine's thread, from fresh NumPy buffers
(``np.asarray``): 9.1 GB for a 64K prompt of Qwen3-8B. Now each layer's blocks go to pinned
staging buffers and are stored by threads while the next layers run
(:data:`models.runtime.tiered_prefill.PAGE_STORE_THREADS`). ``python -m
benchmarks.probes.offload_prefill`` times, on the Qwen3-8B shape with random bf16 weights and
AsyncTLS (one row of ``--length``):

- ``resident``: the same layer programs, the K/V kept on the device (no host tier): the compute;
- ``offload, stores after the last layer``: ``PAGE_STORE_THREADS = 0`` (the order before);
- ``offload, stores overlapped (N threads)``: each layer's blocks stored by N threads while the
  next layers run (the default now);
- with ``--segment T``, the overlapped prefill in segments of T tokens x layers, as the engine runs
  it with ``max_inject_tokens`` (no decode step between them here: the segments' own cost).

Each offloaded prefill writes into one engine-like host tier (``into=``, the request's pages), as
:class:`models.serving.offloaded_slots.OffloadedSlots` does; the rows alternate and the median of
``--rounds`` is reported, with the first token's logits and the stored pages (their sums per layer) compared across
variants: equal for whole layers, within bf16 for the segmented row (its layers run in chunks).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np

from benchmarks.timing import markdown_table, stamp, write_results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--length", type=int, default=65536)
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--threads", type=int, default=8, help="the overlapped variant's store threads")
    p.add_argument("--segment", type=int, default=32768, help="tokens x layers a segment (0: no segmented row)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tiny", action="store_true", help="a small random model (a CPU check of this probe)")
    p.add_argument("--out", default=None)
    p.add_argument("--name", default="offload_prefill")
    a = p.parse_args(argv)

    from sparse_jax.offload import capacity

    pinned = capacity.plan_pinned_host_limit(0.85)  # before the GPU client starts
    print(pinned, file=sys.stderr, flush=True)
    from benchmarks.offload import asynctls_for, cache_capacity, qwen3_8b, random_model
    from models.runtime import tiered_prefill
    from models.runtime.tiered import HostPages, TieredRunner

    cfg = dataclasses.replace(qwen3_8b(max(a.length + 1024, 40960)), num_layers=a.layers)
    if a.tiny:
        cfg = dataclasses.replace(cfg, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=128)
    method = asynctls_for(cfg, 256 if a.tiny else 2048, 32)  # serve_load's AsyncTLS
    max_len = cache_capacity(a.length, 64)
    model = random_model(cfg, method, max_len)
    tokens = np.random.default_rng(0).integers(3, cfg.vocab_size, (1, a.length)).astype(np.int32)
    lengths = np.asarray([a.length], np.int32)
    bs = method.for_offload().offload_block_size
    npages = a.length // bs + 2
    offload = TieredRunner(model, "offload", host_pages=npages)
    if not offload.offloaded_layers:
        p.error(f"--layers {a.layers}: no layer is offloaded (AsyncTLS keeps its first layers dense); take more")
    resident = TieredRunner(model, "resident")
    # the engine-like host tier: pools of npages pages per offloaded layer, the request's table
    _, engine_state = offload.prefill(tokens, lengths, max_len)
    table = engine_state.pages.table[0].copy()
    jax.block_until_ready(engine_state.cache)

    def run_offload(threads: int, segment: int):
        tiered_prefill.PAGE_STORE_THREADS = threads
        pages = HostPages(npages, 1, max_len // bs, own=False)
        pages.set_row(0, table)
        t = time.perf_counter()
        job = offload.start_prefill(tokens, lengths, max_len, pages=pages, into=engine_state.host)
        while not job.done:
            if segment:
                job.advance_budget(segment)
            else:
                job.advance(offload.num_layers)
        logits, state = job.result()
        jax.block_until_ready((logits, state.cache))
        return time.perf_counter() - t, np.asarray(logits)

    def run_resident(*_):
        t = time.perf_counter()
        logits, state = resident.prefill(tokens, lengths, max_len)
        jax.block_until_ready((logits, state.cache))
        return time.perf_counter() - t, np.asarray(logits)

    def stored_pages():
        used = table[: -(-a.length // bs)]
        return [np.asarray(h.k)[used].astype(np.float32).sum() for h in engine_state.host if h is not None]

    variants = [("resident (no host tier)", run_resident, 0, 0),
                ("offload, stores after the last layer", run_offload, 0, 0),
                (f"offload, stores overlapped ({a.threads} threads)", run_offload, a.threads, 0)]
    if a.segment:
        variants.append((f"offload, overlapped, segments of {a.segment} tokens x layers", run_offload, a.threads,
                         a.segment))
    times = {v[0]: [] for v in variants}
    logits, sums = {}, {}
    for rnd in range(a.rounds + 1):  # round 0 compiles
        for name, fn, threads, segment in variants:
            dt, lg = fn(threads, segment)
            print(f"[offload_prefill] round {rnd} {name}: {dt:.3f} s", file=sys.stderr, flush=True)
            if rnd:
                times[name].append(dt)
            logits[name] = lg
            if fn is run_offload:
                sums[name] = stored_pages()
    ref = variants[1][0]
    rows = []
    for name, *_ in variants:
        med = statistics.median(times[name])
        rows.append({"variant": name, "median_s": round(med, 3), "min_s": round(min(times[name]), 3),
                     "vs resident": round(med / statistics.median(times[variants[0][0]]), 2),
                     "max_logit_diff": float(np.abs(logits[name] - logits[ref]).max()),
                     # the segmented row's layers run in chunks (other rounding): equal within bf16
                     "pages_max_rel_diff": float(max(abs(x - y) / max(abs(y), 1e-30) for x, y in
                                                     zip(sums[name], sums[ref]))) if name in sums else ""})
    kv_gb = 2 * a.length * cfg.num_kv_heads * cfg.head_dim * 2 * len(offload.offloaded_layers) / 1e9
    payload = {"stamp": stamp("python -m benchmarks.probes.offload_prefill " + " ".join(argv or sys.argv[1:])),
               "length": a.length, "layers": a.layers, "offloaded_layers": len(offload.offloaded_layers),
               "host_kv_gb": kv_gb, "pinned_host": pinned, "rows": rows}
    s = payload["stamp"]
    md = "\n".join([
        f"# An offloaded prompt's prefill: {a.length} tokens, {cfg.name} shape ({a.layers} layers), AsyncTLS",
        "",
        f"- device: {s.get('device')}, jax {s.get('jax')}, {s.get('date')}, commit {s.get('git_commit')}",
        f"- command: `{s.get('command')}`",
        f"- one row; {len(offload.offloaded_layers)} offloaded layers store {kv_gb:.1f} GB of K/V blocks into "
        f"pinned host pages; median of {a.rounds} alternating rounds after a compile round",
        "",
        markdown_table(rows, list(rows[0])),
        ""])
    path = write_results(a.name, payload, md, None if a.out is None else Path(a.out))
    print(md)
    print(f"[offload_prefill] wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
