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
import time

import jax.numpy as jnp
import numpy as np

from benchmarks.timing import markdown_table, stamp, time_steps, write_results
from benchmarks.trace_overlap import kernel_profile

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
