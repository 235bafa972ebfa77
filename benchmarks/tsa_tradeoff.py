"""Token Sparse Attention's τ trade-off: speed and accuracy side by side, from results
already written (no device work).

    python -m benchmarks.tsa_tradeoff --sweep benchmarks/results/tsa_sweep_gemma3-270m_time_h100.json \\
        --accuracy benchmarks/results/accuracy_gemma3-270m_tsa_tau_h100_16k.json,... \\
        --name tsa_tradeoff_gemma3-270m_h100

Speed: :mod:`benchmarks.tsa_sweep` ``--time`` rows (the TSA layers' attention against
dense on the model's own captured queries and keys, per length and τ). Accuracy:
:mod:`benchmarks.accuracy` rows whose method is dense with ``prefill=token_sparse``;
their τ is read from the row's config (the default 0.005 when the options name none),
and each is set beside the dense row of the same file and length. Writes
``NAME.{json,md,png}``: one row per (length, τ), with the accuracy cells left blank
where no run measured that point.
"""

from __future__ import annotations

import argparse
import ast
import json
import shlex
import sys
from pathlib import Path

from benchmarks.timing import markdown_table, write_final_results

DEFAULT_TAU = 0.005  # sparse_jax.prefill.TokenSparsePrefill.tau


def row_tau(config: str) -> float | None:
    """τ of an accuracy row's method config (its repr); None if TSA is not its prefill."""
    if "prefill='token_sparse'" not in config:
        return None
    options = {}
    start = config.find("prefill_options=")
    if start >= 0:
        i = start + len("prefill_options=")
        depth, j = 0, i
        while j < len(config):  # the balanced tuple after the name
            depth += {"(": 1, ")": -1}.get(config[j], 0)
            j += 1
            if depth == 0:
                break
        options = dict(ast.literal_eval(config[i:j]))
    return float(options.get("tau", DEFAULT_TAU))


def accuracy_points(paths) -> dict:
    """``{(length, tau): {avg, dense_avg, kl, agree, n, file}}`` from accuracy result files."""
    points = {}
    for path in paths:
        d = json.loads(Path(path).read_text())
        dense = {r["length"]: r["average"] for r in d["rows"] if r.get("status") == "ok" and r["method"] == "dense"}
        for r in d["rows"]:
            tau = row_tau(r.get("config", ""))
            if tau is None or r.get("status") != "ok" or r["length"] not in dense:
                continue
            fid = r.get("fidelity") or {}
            points[r["length"], tau] = dict(avg=100 * r["average"], dense_avg=100 * dense[r["length"]],
                                            kl=fid.get("kl"), agree=fid.get("agreement"), n=r.get("n_samples"),
                                            file=Path(path).name)
    return points


def tradeoff_rows(sweep: dict, points: dict) -> list[dict]:
    rows = []
    for s in sweep["rows"]:
        row = dict(length=s["length"], tau=s["tau"], kept=round(s["kept"], 3), speedup=s.get("speedup"),
                   dense_ms=s.get("dense_ms"), tsa_ms=s.get("tsa_ms"))
        p = points.get((s["length"], s["tau"]))
        if p:
            row.update(accuracy=round(p["avg"], 1), dense_accuracy=round(p["dense_avg"], 1),
                       delta=round(p["avg"] - p["dense_avg"], 1), kl=p["kl"], agree=p["agree"], samples=p["n"])
        rows.append({k: v for k, v in row.items() if v is not None})
    return rows


def render(payload: dict) -> str:
    cols = ["length", "tau", "kept", "dense_ms", "tsa_ms", "speedup", "accuracy", "dense_accuracy", "delta", "kl",
            "agree", "samples"]
    src = "\n".join(f"- {k}: `{v}`" for k, v in payload["sources"].items())
    return (f"# Token Sparse Attention: τ against speed and accuracy ({payload['model']})\n\n"
            f"- made by: `{payload.get('command', '')}`\n{src}\n\n"
            "`speedup`: the TSA layers' attention (scoring, selection, compressed attention) against dense "
            "prefill attention on the model's own queries and keys (`tsa_sweep --time`); `accuracy`: RULER-style "
            "average (%) with TSA at that τ in prefill, `delta` against dense in the same run; blank: not "
            "measured at that point.\n\n" + markdown_table(payload["rows"], cols))


def plot(payload: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = payload["rows"]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4))
    for length in sorted({r["length"] for r in rows}):
        mine = sorted((r for r in rows if r["length"] == length), key=lambda r: r["tau"])
        ax.plot([r["tau"] for r in mine], [r["speedup"] for r in mine], "-o", label=f"{length // 1024}K")
        acc = [r for r in mine if "accuracy" in r]
        if acc:
            bx.plot([r["tau"] for r in acc], [r["delta"] for r in acc], "-o", label=f"{length // 1024}K")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_ylabel("TSA layers' attention: x dense")
    bx.axhline(0.0, color="k", lw=0.8)
    deltas = [r["delta"] for r in rows if "delta" in r] or [0.0]
    bx.set_ylim(min(-5.0, min(deltas) - 1), max(2.0, max(deltas) + 1))  # a flat line reads as flat, not as noise
    bx.set_ylabel("accuracy - dense (points)")
    for a_ in (ax, bx):
        a_.set_xscale("log")
        a_.set_xlabel("τ")
        a_.grid(alpha=0.3)
        a_.legend()
    fig.suptitle(f"Token Sparse Attention τ trade-off ({payload['model']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sweep", required=True, help="a tsa_sweep --time result JSON")
    p.add_argument("--accuracy", default="", help="comma-separated accuracy result JSONs")
    p.add_argument("--name", default=None)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    sweep = json.loads(Path(a.sweep).read_text())
    if not any("speedup" in r for r in sweep["rows"]):
        raise SystemExit(f"{a.sweep} has no timings: run benchmarks.tsa_sweep with --time")
    files = [f for f in a.accuracy.split(",") if f]
    rows = tradeoff_rows(sweep, accuracy_points(files))
    model = sweep.get("settings", {}).get("model", "?")
    sources = {"speed": sweep.get("stamp", {}).get("command", a.sweep)}
    for f in files:
        st = json.loads(Path(f).read_text()).get("stamp", {})
        sources[Path(f).name] = st.get("command", f)
    command = "python -m benchmarks.tsa_tradeoff " + shlex.join(sys.argv[1:] if argv is None else argv)
    payload = dict(model=model, rows=rows, sources=sources, command=command)
    write_final_results(a.name or f"tsa_tradeoff_{model}", payload, render, plot, out_dir=a.out)


if __name__ == "__main__":
    main()
