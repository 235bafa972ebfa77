"""Does the scanned layer driver cost decode-step time against the same layers unrolled?

``python -m benchmarks.probes.driver_probe`` (GPU) builds a Qwen3-8B-shaped model with
random bf16 weights and ``--layers`` layers, fills a resident cache with
``--context`` tokens per row, and times one whole decode step (one jitted
program, cache donated) of ``dense`` and ``asynctls`` with the layer driver's
segments scanned (``lax.scan`` over stacked parameters and caches) and
unrolled (static layer indices in the same program). The risk it checks: a
scanned layer reads its cache through a dynamic slice, and when the slice feeds
a custom call (a Pallas kernel) XLA may materialise it, a copy of the layer's
whole KV per step. It also counts the large ``copy`` instructions in each
compiled program, so the cause is visible, not only the time.

Run it twice to compare XLA flags (the flags are read when the backend starts),
e.g. ``XLA_FLAGS=--xla_gpu_enable_dynamic_slice_fusion=true``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import markdown_table, stamp, write_results

_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u8": 1, "s8": 1, "pred": 1}


def big_copies(hlo_text: str, min_bytes: int) -> list[str]:
    """``copy`` / ``copy-start`` instructions whose result is at least ``min_bytes``."""
    out = []
    for line in hlo_text.splitlines():
        m = re.search(r"=\s*(\w+)\[([\d,]*)\][^ ]*\s+(copy|copy-start)\(", line)
        if not m:
            continue
        n = int(np.prod([int(d) for d in m.group(2).split(",") if d])) * _BYTES.get(m.group(1), 4)
        if n >= min_bytes:
            out.append(f"{m.group(1)}[{m.group(2)}] {n / 2**20:.0f} MiB")
    return out


def time_steps(step, cache, tokens, steps: int, rounds: int):
    """Median ms per step over ``rounds`` rounds of ``steps`` back-to-back steps."""
    logits, cache = step(tokens, cache)  # warm-up (compiled before)
    jax.block_until_ready(logits)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(steps):
            logits, cache = step(tokens, cache)
        jax.block_until_ready(logits)
        times.append((time.perf_counter() - t0) * 1e3 / steps)
    return statistics.median(times), cache


SELECTION_KERNELS = r"quest_block_scores|topk_select|block_label|label_scores|label_logits"


def selection_overlap(kernels, select_regex: str = SELECTION_KERNELS) -> dict:
    """How much GPU time ran concurrently, from traced kernels (``ts``/``end``/``name``, µs).

    ``kernel_sum_us``: the kernels' summed durations; ``busy_us``: their union. Above the
    union, kernels ran side by side (a concurrent CUDA graph's branches). ``select_us``: the
    union of the kernels named by ``select_regex`` (a method's selection); ``select_hidden_us``:
    the part of it during which some other kernel also ran, i.e. selection work that left
    the step's critical path."""
    import re as _re

    from benchmarks import trace_overlap as tov

    sel_re = _re.compile(select_regex)
    sel = [k for k in kernels if sel_re.search(k.name)]
    rest = [k for k in kernels if not sel_re.search(k.name)]
    sel_u = tov.interval_union((k.ts, k.end) for k in sel)
    rest_u = tov.interval_union((k.ts, k.end) for k in rest)
    return {"kernel_sum_us": float(sum(k.dur for k in kernels)),
            "busy_us": tov.measure(tov.interval_union((k.ts, k.end) for k in kernels)),
            "select_us": tov.measure(sel_u),
            "select_hidden_us": tov.measure(tov.interval_intersection(sel_u, rest_u))}


def kernel_profile(step, cache, tokens, steps: int, logdir: str, top: int = 8):
    """Trace ``steps`` decode steps: GPU busy ms per step, span per step, the top kernels,
    and the concurrency figures of :func:`selection_overlap` per step. (XLA runs without
    CUDA graphs under the profiler unless ``--xla_enable_command_buffers_during_profiling``
    is set: a concurrent graph's overlap shows only with it.)"""
    import collections
    import re as _re

    from benchmarks import trace_overlap as tov

    with jax.profiler.trace(logdir, create_perfetto_trace=False):
        for _ in range(steps):
            logits, cache = step(tokens, cache)
        jax.block_until_ready(logits)
    events, _ = tov.load_events(logdir)
    sre, dre = _re.compile(tov.DEFAULT_STREAM_REGEX), _re.compile(tov.DEFAULT_DEVICE_REGEX)
    ks = [e for e in events if tov._is_stream(e.process, e.thread, sre, dre)]
    by = collections.Counter()
    for e in ks:
        by[_re.sub(r"[._]\d+$", "", e.name)[:60]] += e.dur
    busy = tov.measure(tov.interval_union((e.ts, e.end) for e in ks)) / 1e3 / steps
    span = (max(e.end for e in ks) - min(e.ts for e in ks)) / 1e3 / steps if ks else 0.0
    tops = "; ".join(f"{n} {t / 1e3 / steps:.2f}" for n, t in by.most_common(top))
    ov = selection_overlap(ks)
    return {"gpu_busy_ms": round(busy, 3), "gpu_span_ms": round(span, 3), "top_kernels_ms": tops,
            "kernel_sum_ms": round(ov["kernel_sum_us"] / 1e3 / steps, 3),
            "select_ms": round(ov["select_us"] / 1e3 / steps, 3),
            "select_hidden_ms": round(ov["select_hidden_us"] / 1e3 / steps, 3)}, cache

def main(argv=None):
    from benchmarks.offload import asynctls_for, qwen3_8b, random_model
    from models import transformer as tfm
    from models import programs
    from models.driver import init_cache

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--methods", default="dense,asynctls")
    p.add_argument("--tag", default="")
    p.add_argument("--profile", action="store_true", help="trace 4 steps: GPU busy time and the top kernels")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)

    cap = a.context + 128
    cfg = dataclasses.replace(qwen3_8b(cap), num_layers=a.layers)
    methods = {"dense": None, "asynctls": asynctls_for(cfg, budget=2048, kb=128)}
    rows = []
    for name in a.methods.split(","):
        from sparse_jax.methods import get_method

        method = methods[name] or get_method("dense")
        model = random_model(cfg, method, cap)
        tokens = jnp.zeros((a.batch,), jnp.int32)
        for unroll in (False, True):
            fns = programs.build_functions(model.graphdef, cfg, method, unroll)
            step = lambda t, c, f=fns: f.decode_step(model.params, t, c)  # noqa: E731
            cache = init_cache(cfg, method, a.batch, cap, jnp.bfloat16)
            cache = dataclasses.replace(cache, lengths=jnp.full((a.batch,), a.context, jnp.int32))
            t0 = time.perf_counter()
            compiled = fns.decode_step.lower(model.params, tokens, cache).compile()
            compile_s = time.perf_counter() - t0
            copies = big_copies(compiled.as_text(), 64 << 20)
            ms, cache = time_steps(step, cache, tokens, a.steps, a.rounds)
            prof = {}
            if a.profile:
                prof, cache = kernel_profile(step, cache, tokens, 4, f"/tmp/probe_{name}_{unroll}")
            kv_bytes = sum(lc.k.nbytes + lc.v.nbytes for lc in cache.layers) * a.context / cap
            rows.append({"method": name, "driver": "unroll" if unroll else "scan", "batch": a.batch,
                         "context": a.context, "layers": a.layers, "step_ms": round(ms, 3),
                         "compile_s": round(compile_s, 1), "big_copies": len(copies),
                         "copy_examples": "; ".join(copies[:3]), "kv_gib": round(kv_bytes / 2**30, 2), **prof})
            print(rows[-1], flush=True)
            del cache
    flags = os.environ.get("XLA_FLAGS", "")
    md = (f"# Layer driver: scan vs unroll (decode step, one program)\n\n{stamp()}\n\nXLA_FLAGS: `{flags}`\n\n"
          + markdown_table(rows, ["method", "driver", "batch", "context", "layers", "step_ms", "compile_s",
                                  "big_copies"] + (["gpu_busy_ms", "gpu_span_ms"] if a.profile else [])))
    if a.profile:
        md += "\n\nTop kernels (ms per step):\n\n" + "\n".join(
            f"- {r['method']} {r['driver']}: {r['top_kernels_ms']}" for r in rows)
    print(md)
    if a.out:
        write_results(f"driver_probe{a.tag}", {"rows": rows, "xla_flags": flags, **stamp()}, md, out_dir=a.out)


if __name__ == "__main__":
    main()
