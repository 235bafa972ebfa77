"""AsyncSpade's cache rank on a second GPU against the one-device schedule and Quest.

``python -m benchmarks.cache_rank`` (two GPUs) times a Qwen3-8B-shaped model with
random bf16 weights (36 layers, 32/8 heads, D=128; layers 0-1 dense) and synthetic
KV at each ``--contexts`` / ``--batch`` pair (default the paper's Fig. 10 setting, 32K
at B=8, and 128K at B=2), all resident:

* ``quest`` on one GPU (the paper's comparison: "more than 20% below Quest");
* ``asyncspade`` (Quest selector, W=16) on one GPU: the one-device schedule, the
  selection for step t+1 computed inside step t's program;
* ``asyncspade`` with its cache rank on GPU 1 (:mod:`models.runtime.cache_rank`), in packs of
  ``--packs`` layers.

Each row: median ms per decode step over rounds of back-to-back greedy steps (one
sync per round), tokens/s, the ratio to Quest and to one-device AsyncSpade, the host
time to issue one step (the cache rank dispatches ``2 x packs`` programs and copies),
and for the cache rank the first step's logits against one-device AsyncSpade (same
weights, same KV, same selector state: max |difference| in bf16).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.multi_gpu import fill_function, run_config, timed_rounds
from benchmarks.timing import logit_agreement, markdown_table, stamp, write_final_results, write_results
from models.runtime.cache_rank import with_cache_rank


def spade_method(budget: int, window: int):
    from sparse_jax.methods import get_method

    # θ_t = 0: the cache rank's (its rank holds no keys), so both schedules run the same steps
    return get_method("asyncspade", budget=budget, window=window, selector="quest", dense_steps=0)


def run_cache_rank(model, method, *, batch: int, context: int, steps: int, rounds: int, pack_layers: int,
                   transfer: str = "device_put", threads: bool = True, wait_copies: bool = False,
                   profile: Path | None = None, log=print):
    """AsyncSpade with the cache rank on ``jax.devices()[1]``: the row and the first step's logits."""
    from models.runtime import sharding as sh
    from models.api import round_up
    from models.driver import init_cache

    cfg = model.config
    max_len = round_up(context + steps * (rounds + 2) + 64, 64)
    t0 = time.perf_counter()
    cr = with_cache_rank(model.with_method(method), pack_layers=pack_layers, transfer=transfer, threads=threads,
                                                   wait_copies=wait_copies)
    mesh = sh.Parallelism(1, 1).mesh()  # the fill runs on device 0, as for the one-GPU rows
    fill = fill_function(cfg, cr.method, mesh, batch=batch, max_len=max_len, context=context, dtype=jnp.bfloat16)
    cache = fill(init_cache(cfg, cr.method, batch, max_len, jnp.bfloat16), jax.random.key(7))
    split = cr.fns.split(cache)
    del cache
    tok = jnp.zeros((batch,), jnp.int32)
    logits, split = cr.fns.decode_step(cr.params, tok, split)
    first = np.asarray(logits, np.float32)
    argmax = jax.jit(lambda x: jnp.argmax(x, -1).astype(jnp.int32))
    tok = argmax(logits)
    for _ in range(2):  # the second step compiles again (its inputs come from the first's outputs)
        logits, split = cr.fns.decode_step(cr.params, tok, split)
        tok = argmax(logits)
    jax.block_until_ready(tok)
    compile_s = time.perf_counter() - t0
    held = {"split": split}
    del split
    issue = []
    cr.fns.trace_host, cr.fns.host_s = True, {}

    def step(tok):
        t = time.perf_counter()
        logits, held["split"] = cr.fns.decode_step(cr.params, tok, held["split"])
        out = argmax(logits)
        issue.append(time.perf_counter() - t)
        return out

    times = timed_rounds(step, tok, steps=steps, rounds=rounds)
    ms = statistics.median(times)
    n = max(1, len(issue))
    host = {k: v / n * 1e3 for k, v in cr.fns.host_s.items()}
    row = dict(context=context, method="asyncspade", layout=f"cache rank, packs of {pack_layers}, {transfer}"
               + ((", 2 host threads, copies of ready sources" if wait_copies else ", 2 host threads") if threads
                  else ", 1 host thread"), gpus=2,
               batch=batch, ms_per_step=ms, tokens_per_s=batch / ms * 1e3, issue_ms=statistics.median(issue) * 1e3,
               host_ms=host, compile_s=compile_s, rounds_ms=[round(x, 3) for x in times])
    if profile is not None:
        row["profile"] = profile_steps(step, tok, profile, steps=8, log=log)
    log(f"  {row['layout']:<56} B={batch:<3} {ms:7.2f} ms/step  {row['tokens_per_s']:7.1f} tok/s  "
        f"issue {row['issue_ms']:.2f} ms  host per step: "
        + ", ".join(f"{k} {v:.2f} ms" for k, v in host.items()) + f"  (compile+fill {compile_s:.0f} s)", flush=True)
    del held, cr
    gc.collect()
    return row, first


def profile_steps(step, tok, logdir: Path, *, steps: int, log=print) -> dict:
    """``steps`` back-to-back steps under ``jax.profiler.trace(logdir)``; per GPU, the
    busy and idle time of its streams over the steps' span (``benchmarks.trace_overlap``:
    whether device 0 waits, for the host or for the cache rank). The trace file stays
    under ``logdir``."""
    from benchmarks import trace_overlap as to

    logdir.mkdir(parents=True, exist_ok=True)
    jax.block_until_ready(tok)
    with jax.profiler.trace(str(logdir), create_perfetto_trace=True):
        for _ in range(steps):
            tok = step(tok)
        jax.block_until_ready(tok)
    events, _ = to.load_events(logdir)
    out = {"steps": steps, "trace": str(to.find_trace_file(logdir))}
    for i, d in enumerate(jax.devices()[:2]):
        rep = to.overlap_report(events, device_regex=rf"/device:GPU:{d.id}\b")
        if rep["note"] is not None and not rep["gpu_streams_found"]:
            out["note"] = rep["note"]
            break
        active = rep["active_us"] or 1.0
        out[f"gpu{i}"] = {"busy_ms_per_step": rep["gpu_busy_us"] / steps / 1e3,
                          "idle_ms_per_step": rep["gpu_idle_us"] / steps / 1e3,
                          "busy_fraction": rep["gpu_busy_us"] / active,
                          "top": [(t["name"][:60], round(t["total_us"] / steps, 1))
                                  for t in rep["top_names"].get("compute", [])[:6]]}
        log(f"    GPU {i}: busy {out[f'gpu{i}']['busy_ms_per_step']:.2f} ms, idle "
            f"{out[f'gpu{i}']['idle_ms_per_step']:.2f} ms per step", flush=True)
    return out


def render(payload) -> str:
    s = payload["stamp"]
    lines = ["# AsyncSpade's cache rank on a second GPU (Qwen3-8B shape, random weights)", "",
             f"{s['device']} x 2, jax {s['jax']}, {s['date']}, commit {s.get('git_commit', '')}", "",
             f"`{s['command']}`", "",
             "ms/step: median of rounds of back-to-back greedy steps, all resident. vs_quest / vs_spade_1gpu: "
             "time per output token relative to Quest and to one-device AsyncSpade (below 1 is faster). "
             "issue_ms: host time to dispatch one step (cache rank only; the JSON splits it by call). max_dlogit: the cache rank's first "
             "step against one-device AsyncSpade (same weights, KV and selector state; bf16).", ""]
    cols = ["context", "method", "layout", "batch", "ms_per_step", "tokens_per_s", "vs_quest", "vs_spade_1gpu",
            "issue_ms", "max_dlogit", "argmax_agree"]
    lines.append(markdown_table(payload["rows"], cols, {"ms_per_step": ".2f", "tokens_per_s": ".1f",
                                                        "vs_quest": ".3f", "vs_spade_1gpu": ".3f",
                                                        "issue_ms": ".2f", "max_dlogit": ".3g",
                                                        "argmax_agree": ".2f"}))
    return "\n".join(lines) + "\n"


def plot(payload, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = payload["rows"]
    ctxs = list(dict.fromkeys((r["context"], r["batch"]) for r in rows))
    fig, axes = plt.subplots(1, len(ctxs), figsize=(4.5 * len(ctxs), 3.6), squeeze=False)
    for ax, (c, b) in zip(axes[0], ctxs):
        sub = [r for r in rows if r["context"] == c and r["batch"] == b]
        names = [f"{r['method']}\n{r['layout']}" for r in sub]
        ax.barh(range(len(sub)), [r["ms_per_step"] for r in sub], color=["C0" if r["gpus"] == 1 else "C2" for r in sub])
        ax.set_yticks(range(len(sub)), names, fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("ms per decode step (lower is better)")
        ax.set_title(f"{c // 1024}K, B={b}", fontsize=9)
    fig.suptitle(f"AsyncSpade cache rank; Qwen3-8B shape; {payload['stamp'].get('device', '')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default="32768,131072")
    p.add_argument("--batch", default="8,2", help="batch per context (comma list, or one value)")
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--window", type=int, default=16)
    p.add_argument("--packs", default="6", help="layers per pack of the cache rank (comma list)")
    p.add_argument("--transfers", default="device_put,collective",
                   help="how the ranks exchange (comma list): device_put, collective (a ppermute program)")
    p.add_argument("--dispatch", default="threads",
                   help="comma list: threads (the cache rank's calls from a second host thread), threads-wait "
                        "(that thread copies only computed sources), one")
    p.add_argument("--baselines", default="quest,asyncspade", help="one-GPU rows (comma list; may be empty)")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--time-limit", type=float, default=0, help="stop starting configurations after this many s")
    p.add_argument("--profile", default=None,
                   help="DIR: trace 8 steps of each cache-rank configuration (jax.profiler) and report each "
                        "GPU's busy and idle time per step; the traces stay under DIR/<config>")
    p.add_argument("--tiny", action="store_true", help="a small random model (CPU smoke test)")
    p.add_argument("--out", default=None)
    p.add_argument("--name", default="cache_rank")
    a = p.parse_args(argv)
    start = time.perf_counter()
    from benchmarks.multi_gpu import build_method
    from benchmarks.offload import qwen3_8b, random_model

    if len(jax.devices()) < 2:
        print(f"error: the cache rank needs 2 devices, {len(jax.devices())} visible "
              f"(on CPU: XLA_FLAGS=--xla_force_host_platform_device_count=2)", file=sys.stderr)
        return 2
    contexts = [int(c) for c in a.contexts.split(",")]
    batches = [int(b) for b in a.batch.split(",")]
    batches = batches * len(contexts) if len(batches) == 1 else batches
    if len(batches) != len(contexts):
        print("error: --batch gives one value or one per context", file=sys.stderr)
        return 2
    packs = [int(x) for x in a.packs.split(",")]
    if a.tiny:
        import dataclasses

        from models.config import get_config
        cfg = dataclasses.replace(get_config("qwen3-8b"), num_layers=5, hidden_size=64, num_heads=8, num_kv_heads=4,
                                  head_dim=32, intermediate_size=96, vocab_size=128, max_position=max(contexts) * 2)
    else:
        cfg = qwen3_8b(max(contexts) * 2)
    payload = {"stamp": stamp(), "rows": []}
    out = Path(a.out) if a.out else None
    spade = spade_method(a.budget, a.window)
    model = random_model(cfg, spade, max(contexts) * 2)
    for context, b in zip(contexts, batches):
        print(f"{context // 1024}K, B={b}", flush=True)
        quest = spade_ref = None
        configs = [(n, None, None, None) for n in a.baselines.split(",") if n] + [
            ("asyncspade", n, t, d) for d in a.dispatch.split(",") for t in a.transfers.split(",") for n in packs]
        if any(c[3] not in (None, "threads", "threads-wait", "one") for c in configs):
            print(f"error: --dispatch takes threads, threads-wait and one, got {a.dispatch!r}", file=sys.stderr)
            return 2
        for name, pack, transfer, dispatch in configs:
            if a.time_limit and time.perf_counter() - start > a.time_limit:
                print(f"time limit: skipping {name} pack={pack} at {context}", flush=True)
                continue
            if pack is None:
                method = build_method("quest", cfg, a.budget) if name == "quest" else spade
                row, first = run_config(model, method, devices=1, data=1, batch=b, context=context, steps=a.steps,
                                        rounds=a.rounds, plain=True)
                row["method"] = name
                for k in ("floor_ms", "of_floor", "cache_gib"):
                    row.pop(k, None)
            else:
                row, first = run_cache_rank(model, spade, batch=b, context=context, steps=a.steps, rounds=a.rounds,
                                            pack_layers=pack, transfer=transfer, threads=dispatch != "one",
                                            wait_copies=dispatch == "threads-wait",
                                            profile=None if a.profile is None else
                                            Path(a.profile) / f"{context}_{pack}_{transfer}_{dispatch}")
            if name == "quest":
                quest = row
            elif pack is None:
                spade_ref = (row, first)
            if quest is not None:
                row["vs_quest"] = row["ms_per_step"] / quest["ms_per_step"]
            if spade_ref is not None and name == "asyncspade":
                row["vs_spade_1gpu"] = row["ms_per_step"] / spade_ref[0]["ms_per_step"]
                if pack is not None:
                    row.update(logit_agreement(first, spade_ref[1]))
            payload["rows"].append(row)
            write_results(a.name, payload, render(payload), out)
    write_final_results(a.name, payload, render, plot, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
