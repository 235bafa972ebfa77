"""FlashD2H against the synchronous save, in alternating order, with each run's host profile.

``python -m benchmarks.probes.flashd2h_ab --order sync,deferred,sync,deferred --batch 7`` builds
the Qwen3-8B-shaped random model once, then for each entry of ``--order`` fills a fresh
offloaded AsyncTLS batch at ``--context`` tokens and times it with
:func:`benchmarks.offload.run_config` (``TieredRunner(save=...)``: "deferred" is
SparseServe's FlashD2H, "sync" the same copy waited for and stored within the step). Each
run ends with a 3-step ``jax.profiler`` trace; the host events that cost the most per step
(``command_buffer::update``, ``cuGraphLaunch``, ...) and the device kernels are reported.

``--order`` entries may name the loop too, ``SAVE:device`` (:meth:`TieredRunner.greedy_steps`:
the argmax fed back on the device, tokens and logits in donated buffers, the same addresses
every step) against the plain ``SAVE`` (``SAVE:host``: each step's tokens a new array, as the
engine's loop): whether XLA's per-step ``command_buffer::update`` comes from those buffers.

Why alternating: the first A/B (``--save deferred,sync`` of :mod:`benchmarks.offload`,
deferred first) read deferred much slower (docs/serving.md, 'Against SparseServe', FlashD2H);
the first run in a process pays a slow first
round, and the order was the confound. ``--tiny`` runs a small model (CPU smoke test).
"""

from __future__ import annotations

import argparse
import collections
import shutil
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.timing import markdown_table, stamp, write_final_results

TRACE_STEPS = 3  # run_config traces this many steps after its timed rounds


def profile_summary(events, report: dict, top: int = 12) -> tuple[list[dict], list[dict]]:
    """Per-step milliseconds of a trace's costliest host events
    (:func:`benchmarks.trace_overlap.host_time_by_name`) and device kernels (``report``:
    its :func:`~benchmarks.trace_overlap.overlap_report`, compute and transfer kernels)."""
    from benchmarks import trace_overlap as to

    def rows(named):
        return [{"event": r["name"][:70], "ms_per_step": round(r["total_us"] / 1e3 / TRACE_STEPS, 3),
                 "count": r["count"]} for r in named]

    device = sorted((r for named in report.get("top_names", {}).values() for r in named),
                    key=lambda r: -r["total_us"])[:top]
    return rows(to.host_time_by_name(events, top=top)), rows(device)


def run(args) -> dict:
    from benchmarks import offload as ob
    from sparse_jax.offload import capacity

    if args.tiny:
        import models

        cfg = models.ModelConfig(name="tiny", arch="qwen3", num_layers=3, hidden_size=64, num_heads=4,
                                 num_kv_heads=2, head_dim=32, intermediate_size=128, vocab_size=101,
                                 max_position=1 << 17, rope_theta=1e6, tie_embeddings=False, eos_token_id=2)
        method = ob.asynctls_for(cfg, 256, 16)
    else:
        cfg = ob.qwen3_8b(max(131072, args.context + 1024))
        method = ob.asynctls_for(cfg, args.budget, args.kb)
    model = ob.random_model(cfg, method, args.context + 1024)
    host_limit = capacity.host_budget(args.host_fraction)
    runs = []
    for i, entry in enumerate(args.order):
        save, _, loop = entry.partition(":")
        loop = loop or "host"
        trace_dir = Path(tempfile.mkdtemp(prefix=f"flashd2h_{i}_"))
        t0 = time.perf_counter()
        try:
            r = ob.run_config(model, "offload", context=args.context, batch=args.batch, steps=args.steps,
                              warmup=args.warmup, churn=args.churn, host_limit=host_limit, save=save,
                              trace_dir=trace_dir, loop=loop)
            host, device = profile_summary(r.pop("_trace_events", []) or [], r.pop("_trace_report", None) or {})
        finally:
            shutil.rmtree(trace_dir, ignore_errors=True)
        row = {"run": i + 1, "save": entry, **{k: r.get(k) for k in (
            "tpot_ms", "tpot_rounds_ms", "host_dispatch_ms", "host_issue_ms", "step_ms_median_synced",
            "settle_rounds", "hit_rate")}, "wall_s": round(time.perf_counter() - t0, 1),
               "trace": r.get("trace"), "host_top": host, "device_top": device}
        runs.append(row)
        print(f"[flashd2h] run {i + 1} {entry}: tpot {row['tpot_ms']:.2f} ms, rounds {row['tpot_rounds_ms']}, "
              f"host dispatch {row['host_dispatch_ms']} ms", file=sys.stderr, flush=True)
    return {"stamp": stamp(), "context": args.context, "batch": args.batch, "churn": args.churn,
            "model": cfg.name, "runs": runs}


def render(payload: dict) -> str:
    s = payload["stamp"]
    md = ["# FlashD2H (deferred save) against the synchronous save, alternating order", "",
          f"- device: {s['device']}, jax {s['jax']}, {s['date']}, commit {s['git_commit']}",
          f"- command: `{s['command']}`",
          f"- {payload['model']}, offloaded AsyncTLS, context {payload['context']}, batch {payload['batch']}, "
          f"churn {payload['churn']}; one process, each run a fresh batch; tpot = median of 3 rounds of 64 steps "
          f"(one block saved per row per round), host dispatch = one step into an idle queue (median)", ""]
    cols = ["run", "save", "tpot_ms", "tpot_rounds_ms", "host_dispatch_ms", "step_ms_median_synced", "hit_rate"]
    md += [markdown_table(payload["runs"], cols), ""]
    by = collections.defaultdict(list)
    for r in payload["runs"]:
        by[r["save"]].append(r["tpot_ms"])
    md += ["| save | runs | mean tpot ms |", "| --- | --- | --- |"]
    md += [f"| {k} | {len(v)} | {sum(v) / len(v):.2f} |" for k, v in by.items()]
    last = payload["runs"][-1]
    md += ["", f"## Host profile of run {last['run']} ({last['save']}), per step", "",
           markdown_table(last["host_top"], ["event", "ms_per_step", "count"]), "",
           "## Device kernels of that run, per step", "",
           markdown_table(last["device_top"], ["event", "ms_per_step", "count"]), ""]
    return "\n".join(md)


def plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    colors = {"deferred": "tab:blue", "sync": "tab:orange", "deferred:device": "tab:cyan",
              "sync:device": "tab:red"}
    for r in payload["runs"]:
        ax.bar(r["run"], r["tpot_ms"], color=colors.get(r["save"], "gray"), label=r["save"])
        ax.scatter([r["run"]] * len(r["tpot_rounds_ms"]), r["tpot_rounds_ms"], color="k", s=8, zorder=3)
    handles, labels = ax.get_legend_handles_labels()
    uniq = dict(zip(labels, handles))
    ax.legend(uniq.values(), uniq.keys())
    ax.set_xlabel("run (in process order); dots: the three rounds")
    ax.set_ylabel("ms per decode step")
    ax.set_title(f"{payload['model']} offloaded, {payload['context']} tokens x {payload['batch']}: "
                 f"{payload['stamp'].get('device', '')}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.probes.flashd2h_ab", description=__doc__.split("\n\n")[0])
    p.add_argument("--order", default="sync,deferred,sync,deferred",
                   help="saves in run order, comma-separated; SAVE:device feeds the tokens back on the device")
    p.add_argument("--batch", type=int, default=7)
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--kb", type=int, default=128)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--churn", type=float, default=0.009)
    p.add_argument("--host-fraction", type=float, default=0.25)
    p.add_argument("--tiny", action="store_true", help="a small random model (CPU smoke test)")
    p.add_argument("--out", default=None)
    p.add_argument("--name", default="offload_flashd2h_abab")
    a = p.parse_args(argv)
    a.order = [x.strip() for x in a.order.split(",")]
    ok = {f"{s}{loop}" for s in ("deferred", "sync") for loop in ("", ":host", ":device")}
    if not a.order or set(a.order) - ok:
        p.error(f"--order: a comma list of deferred and sync (each optionally :host or :device), got {a.order}")
    if a.batch < 1 or a.context < 256:
        p.error("need --batch >= 1 and --context >= 256")
    if a.tiny:
        a.context = min(a.context, 1024)
    return a


def main(argv=None) -> int:
    args = parse_args(argv)
    payload = run(args)
    write_final_results(args.name, payload, render, plot, Path(args.out) if args.out else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
