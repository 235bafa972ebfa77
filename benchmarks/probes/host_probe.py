"""Where does the host time to issue a decode step go, and what removes it?

``python -m benchmarks.probes.host_probe`` (GPU) builds a Qwen3-8B-shaped model with
random bf16 weights (``--layers`` layers), fills a resident cache with
``--context`` tokens per row, and times one decode step of ``dense`` and
``asynctls`` in three program shapes, all one jitted program with the cache
donated:

- ``logits``: today's step, ``(params, tokens, cache) -> (logits, cache)``; the
  caller samples. Each step's logits is a fresh buffer.
- ``stable``: the step also takes the previous step's token buffer and writes the
  greedy next token into it (donated), so every output of the program lands
  at the address of an input: nothing in the program's buffer assignment
  moves from one step to the next. The lead it tests: XLA re-records (or
  updates) a CUDA graph whose buffers moved, a host cost per step.
- ``multi``: ``--multi`` greedy steps in one program (a ``lax.fori_loop`` over
  the step), so the host cost is paid once per ``--multi`` tokens. Measured on the
  H200 (2026-12-01, issue 49) it cost more device time per token, not less: 15.35
  against 8.46 ms for asynctls, 30.3 against 23.4 for dense.
- ``multi_unrolled``: the same ``--multi`` steps written out one after another in one
  program (no loop: straight-line code XLA schedules as one graph), issue 49's
  "several steps unrolled in one program", the form that may avoid the loop's penalty.
- ``tiered`` / ``offload``: :class:`models.runtime.tiered.TieredRunner`'s step, resident
  and offloaded (with the benchmark's block churn), on random K/V, as
  ``benchmarks.offload`` runs it.

Per shape: ``dispatch_ms`` (host time to issue one step into an idle queue),
``synced_ms`` (one step, issued and waited for), ``tpot_ms`` (median per step of
``--rounds`` rounds of ``--steps`` back-to-back steps) and, with ``--profile``,
the GPU busy time per step. Run it once per XLA flag set to compare (the flags
are read when the backend starts), e.g. with command buffers off:
``XLA_FLAGS=--xla_gpu_enable_command_buffer=``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import statistics
import time

import jax
import jax.numpy as jnp

from benchmarks.timing import markdown_table, stamp, write_results


def _step_fns(graphdef, cfg, method, multi: int):
    """The four program shapes (see the module docstring): ``(logits, stable, multi,
    multi_unrolled)`` jitted functions."""
    from flax import nnx

    from models import programs

    def step(params, tokens, cache):
        return programs.decode_step(nnx.merge(graphdef, params), cfg, method, tokens, cache, unroll=True)

    logits_fn = jax.jit(step, donate_argnums=(2,))

    @functools.partial(jax.jit, donate_argnums=(1, 2))
    def stable_fn(params, tokens, cache):
        logits, cache = step(params, tokens, cache)
        return jnp.argmax(logits, -1).astype(jnp.int32), cache

    @functools.partial(jax.jit, donate_argnums=(1, 2))
    def multi_fn(params, tokens, cache):
        def body(_, carry):
            tok, c = carry
            logits, c = step(params, tok, c)
            return jnp.argmax(logits, -1).astype(jnp.int32), c

        return jax.lax.fori_loop(0, multi, body, (tokens, cache))

    @functools.partial(jax.jit, donate_argnums=(1, 2))
    def multi_unrolled_fn(params, tokens, cache):
        for _ in range(multi):  # traced `multi` times: one straight-line program
            logits, cache = step(params, tokens, cache)
            tokens = jnp.argmax(logits, -1).astype(jnp.int32)
        return tokens, cache

    return logits_fn, stable_fn, multi_fn, multi_unrolled_fn


def _measure(run, state, steps: int, rounds: int, per_call: int):
    """``run(state) -> (sync_leaf, state)``; times per token."""
    leaf, state = run(state)  # compile + warm-up
    jax.block_until_ready(leaf)
    leaf, state = run(state)
    jax.block_until_ready(leaf)
    dispatch, synced = [], []
    for _ in range(max(4, steps // 2)):
        t0 = time.perf_counter()
        leaf, state = run(state)
        dispatch.append(time.perf_counter() - t0)
        jax.block_until_ready(leaf)
        synced.append(time.perf_counter() - t0)
    rounds_ms = []
    calls = max(1, steps // per_call)
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            leaf, state = run(state)
        jax.block_until_ready(leaf)
        rounds_ms.append((time.perf_counter() - t0) * 1e3 / (calls * per_call))
    return {"dispatch_ms": round(1e3 * statistics.median(dispatch) / per_call, 3),
            "synced_ms": round(1e3 * statistics.median(synced) / per_call, 3),
            "tpot_ms": round(statistics.median(rounds_ms), 3)}, state


def _profile(run, state, steps: int, per_call: int, logdir: str, top: int):
    """Trace ``steps`` back-to-back calls: GPU busy and span per token, the largest
    gap between kernels, and the host events that took the most time."""
    from benchmarks import trace_overlap as tov

    opts = jax.profiler.ProfileOptions()
    opts.python_tracer_level, opts.host_tracer_level = 0, 2
    jax.profiler.start_trace(logdir, profiler_options=opts)
    for _ in range(steps):
        leaf, state = run(state)
    jax.block_until_ready(leaf)
    jax.profiler.stop_trace()
    events, _ = tov.load_events(logdir)
    rep = tov.overlap_report(events, top=top)
    n = steps * per_call
    host = "; ".join(f"{r['name'][:48]} {r['total_us'] / 1e3 / n:.2f}x{r['count'] // n}"
                     for r in tov.host_time_by_name(events, top=top))
    return {"gpu_busy_ms": round(rep["gpu_busy_us"] / 1e3 / n, 3), "gpu_idle_ms": round(rep["gpu_idle_us"] / 1e3 / n, 3),
            "host_top": host}, state


def main(argv=None):
    import numpy as np

    from benchmarks.offload import _synthetic_kv, asynctls_for, qwen3_8b, random_model, with_churn
    from models.driver import init_cache
    from models.runtime.tiered import TieredRunner
    from sparse_jax.methods import get_method

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--multi", type=int, default=8)
    p.add_argument("--methods", default="dense,asynctls")
    p.add_argument("--shapes", default="logits,stable,multi,multi_unrolled")
    p.add_argument("--churn", type=float, default=0.012, help="offload shape: AsyncTLS block churn per step")
    p.add_argument("--profile", action="store_true", help="trace 4 back-to-back calls per shape")
    p.add_argument("--tag", default="")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)

    cap = a.context + 512
    cfg = dataclasses.replace(qwen3_8b(cap), num_layers=a.layers)
    rows = []
    for name in a.methods.split(","):
        method = asynctls_for(cfg, budget=2048, kb=128) if name == "asynctls" else get_method(name)
        model = random_model(cfg, method, cap)
        logits_fn, stable_fn, multi_fn, multi_unrolled_fn = _step_fns(model.graphdef, cfg, method, a.multi)
        params = model.params
        for shape in a.shapes.split(","):
            tokens = jnp.zeros((a.batch,), jnp.int32)
            if shape in ("tiered", "offload", "offload_quiet"):
                if shape != "tiered" and name == "dense":
                    continue
                runner = TieredRunner(with_churn(model, a.churn) if shape != "tiered" else model,
                                      "resident" if shape == "tiered" else "offload", host_limit=None)
                cache = runner.state_from_kv(_synthetic_kv(cfg, a.batch, cap, a.context, jnp.bfloat16, 0),
                                             np.full((a.batch,), a.context, np.int32), cap)
                # offload_quiet: the step's block counters are not kept (TieredState.record_transfers)
                cache.record_transfers = shape != "offload_quiet"

                def run(st, runner=runner):
                    tok, state = st
                    tok = jnp.argmax(runner.decode_step(tok, state), -1).astype(jnp.int32)
                    return tok, (tok, state)
            else:
                cache = init_cache(cfg, method, a.batch, cap, jnp.bfloat16)
                cache = dataclasses.replace(cache, lengths=jnp.full((a.batch,), a.context, jnp.int32))
            if shape in ("tiered", "offload", "offload_quiet"):
                per_call = 1
            elif shape == "logits":
                def run(st):
                    tok, c = st
                    logits, c = logits_fn(params, tok, c)
                    tok = jnp.argmax(logits, -1).astype(jnp.int32)
                    return tok, (tok, c)
                per_call = 1
            elif shape == "stable":
                def run(st):
                    tok, c = stable_fn(params, *st)
                    return tok, (tok, c)
                per_call = 1
            elif shape in ("multi", "multi_unrolled"):
                fn = multi_fn if shape == "multi" else multi_unrolled_fn

                def run(st, fn=fn):
                    tok, c = fn(params, *st)
                    return tok, (tok, c)
                per_call = a.multi
            else:
                raise ValueError(f"unknown shape {shape!r}: logits, stable, multi, multi_unrolled, tiered, offload, "
                                 f"offload_quiet")
            used = (2 + max(4, a.steps // 2) + a.rounds * max(1, a.steps // per_call)) * per_call
            if a.context + used > cap:
                raise ValueError(f"{used} steps overflow the cache's {cap - a.context} spare slots")
            res, (tok, cache) = _measure(run, (tokens, cache), a.steps, a.rounds, per_call)
            if a.profile:
                prof, (tok, cache) = _profile(run, (tok, cache), 4, per_call, f"/tmp/host_probe/{name}_{shape}", 12)
                res.update(prof)
                print(f"{name} {shape} host: {prof['host_top']}", flush=True)
            rows.append({"method": name, "shape": shape, "batch": a.batch, "context": a.context,
                         "layers": a.layers, "per_call": per_call, **res,
                         "dispatch_of_step": round(res["dispatch_ms"] / res["tpot_ms"], 3)})
            print(rows[-1], flush=True)
            del cache, tok
        del model
    flags = os.environ.get("XLA_FLAGS", "")
    md = (f"# Host time to issue a decode step\n\n{stamp()}\n\nXLA_FLAGS: `{flags}`\n\n"
          "`dispatch_ms`: host time to issue one call into an idle queue, per token; `synced_ms`: "
          "one call issued and waited for, per token; `tpot_ms`: back-to-back, per token\n\n"
          + markdown_table(rows, ["method", "shape", "batch", "context", "layers", "per_call", "dispatch_ms",
                                  "synced_ms", "tpot_ms", "dispatch_of_step"]
                                 + (["gpu_busy_ms", "gpu_idle_ms"] if a.profile else [])))
    if a.profile:
        md += "\n\nTop host events (ms per token x count per token):\n\n" + "\n".join(
            f"- {r['method']} {r['shape']}: {r['host_top']}" for r in rows)
    print(md)
    if a.out:
        write_results(f"host_probe{a.tag}", {"rows": rows, "xla_flags": flags, **stamp()}, md, out_dir=a.out)


if __name__ == "__main__":
    main()
