"""Where a decode step's time goes: a few Qwen3-8B-shaped layers (layers 0-1
dense, the rest AsyncTLS), resident and offloaded, profiled with jax.profiler;
prints the top GPU kernels per step. ``python -m benchmarks.probes.offload_profile``."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--context", type=int, default=98304)
    p.add_argument("--batch", type=int, default=3)
    p.add_argument("--churn", type=float, default=0.012)
    p.add_argument("--pool-factor", type=int, default=2)
    p.add_argument("--modes", default="dense,resident,offload",
                   help="comma list of dense, resident, offload; a suffix _conc / _serial picks the CUDA-graph "
                   "schedule (default: TieredRunner's, concurrent for offload)")
    p.add_argument("--hlo", action="store_true", help="print the async/copy ops of the offloaded step's compiled HLO")
    p.add_argument("--fusion", default="", help="with --hlo: also print the fused computations of fusions "
                   "whose name contains this")
    p.add_argument("--top", type=int, default=25, help="kernel names listed per class")
    p.add_argument("--host", action="store_true", help="also list the host events that took the most time")
    p.add_argument("--out", default="/tmp/offload_profile")
    a = p.parse_args(argv)
    import models
    from benchmarks import trace_overlap
    from benchmarks.offload import _synthetic_kv, asynctls_for, qwen3_8b, with_churn
    from models.runtime.tiered import TieredRunner

    cfg = dataclasses.replace(qwen3_8b(131072), num_layers=a.layers)
    m = asynctls_for(cfg, 2048, 128)
    model = models.load_model(config=cfg, dtype=jnp.bfloat16, max_len=a.context + 512, attention=m)
    for mode in a.modes.split(","):
        mdl = model.with_method("dense") if mode == "dense" else model
        offload = mode.startswith("offload")
        pool = (m.kb - 1) * a.pool_factor if offload else None
        conc = True if mode.endswith("_conc") else False if mode.endswith("_serial") else None
        runner = TieredRunner(with_churn(mdl, a.churn if offload else 0.0), "offload" if offload else "resident",
                              pool_slots=pool, concurrent=conc)
        max_len = a.context + 512
        st = runner.state_from_kv(_synthetic_kv(cfg, a.batch, max_len, a.context, model.dtype, 0),
                                  np.full((a.batch,), a.context, np.int32), max_len)
        tok = jnp.zeros((a.batch,), jnp.int32)
        for _ in range(3):
            tok = jnp.argmax(runner.decode_step(tok, st), -1).astype(jnp.int32)
        jax.block_until_ready(tok)
        t = time.perf_counter()
        for _ in range(5):
            tok = jnp.argmax(runner.decode_step(tok, st), -1).astype(jnp.int32)
        jax.block_until_ready(tok)
        wall = (time.perf_counter() - t) / 5
        if a.hlo and offload:
            txt = runner._decode.lower(runner.model.params, tok, st.cache, st.host).compile().as_text()
            keep = [ln.strip()[:220] for ln in txt.splitlines()
                    if any(w in ln for w in ("-start", "-done", " copy(", "custom-call", "ENTRY"))]
            print(f"-- {mode} decode step HLO ({len(txt.splitlines())} lines), async/copy/custom-call ops:")
            print("\n".join(keep[:40]))
            entry = txt[txt.index("\nENTRY"):].split("\n}", 1)[0].splitlines()[1:]
            names = [ln.strip().removeprefix("ROOT ").split(" ", 1)[0].lstrip("%") for ln in entry]
            ops = [n for n, ln in zip(names, entry) if any(w in ln for w in (" fusion(", "custom-call(", "-start(",
                                                                           "-done(", " sort(", " scatter("))]
            print(f"-- ENTRY schedule ({len(ops)} kernels/async ops): " + " ".join(ops))
            if a.fusion:
                print(_fusion_bodies(txt, a.fusion))
        d = Path(a.out) / mode
        opts = None
        if a.host:  # the runtime's own host events in detail; Python's tracer off (it would dominate)
            opts = jax.profiler.ProfileOptions()
            opts.python_tracer_level, opts.host_tracer_level = 0, 3
        jax.profiler.start_trace(str(d), create_perfetto_trace=True, profiler_options=opts)
        for _ in range(2):
            tok = jnp.argmax(runner.decode_step(tok, st), -1).astype(jnp.int32)
        jax.block_until_ready(tok)
        jax.profiler.stop_trace()
        ev, threads = trace_overlap.load_events(d)
        rep = trace_overlap.overlap_report(ev, top=a.top)
        print(f"== {mode}: {a.layers} layers, B={a.batch}, ctx={a.context}: wall {1e3 * wall:.2f} ms/step; "
              f"GPU compute busy {rep['compute_busy_us'] / 2e3:.2f} ms/step, transfer {rep['transfer_busy_us'] / 2e3:.2f} "
              f"({100 * rep['hidden_fraction']:.0f}% hidden), busy {rep['gpu_busy_us'] / 2e3:.2f}, "
              f"idle {rep['gpu_idle_us'] / 2e3:.2f}")
        for cls in ("compute", "transfer"):
            for row in rep["top_names"].get(cls, [])[:a.top]:
                print(f"  {cls[:4]} {row['total_us'] / 2e3:8.3f} ms/step x{row['count'] // 2:4d}  {row['name'][:110]}")
        if a.host:
            for row in trace_overlap.host_time_by_name(ev, top=a.top):
                print(f"  host {row['total_us'] / 2e3:8.3f} ms/step x{row['count'] // 2:4d}  [{row['thread'][:24]}] "
                      f"{row['name'][:100]}")
        del st, runner
    return 0


def _fusion_bodies(hlo: str, needle: str, limit: int = 4) -> str:
    """The instructions and called computations of fusions named like ``needle``."""
    lines = hlo.splitlines()
    comps, cur = {}, None
    for ln in lines:
        head = ln.split(" ", 2)
        if ln and not ln.startswith(" ") and ln.rstrip().endswith("{"):
            cur = head[0].lstrip("%") if head[0] != "ENTRY" else head[1].lstrip("%")
            comps[cur] = [ln]
        elif cur is not None:
            comps[cur].append(ln)
    out = []
    for ln in lines:
        name = ln.strip().removeprefix("ROOT ").split(" ", 1)[0].lstrip("%")
        if needle in name and " fusion(" in ln and "calls=" in ln:
            called = ln.split("calls=", 1)[1].split(",", 1)[0].split(" ", 1)[0].lstrip("%").rstrip("}")
            out.append(ln.strip()[:400])
            out.extend(x[:300] for x in comps.get(called, ["  (computation not found: " + called + ")"]))
            if len(out) > 60 * limit:
                break
    return "\n".join(out) if out else f"(no fusion named like {needle!r})"


if __name__ == "__main__":
    sys.exit(main())
