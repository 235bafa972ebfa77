"""Where a decode step's time goes: the CUPTI kernel list of a ``benchmarks.kernels`` row,
grouped by stage, as a table and a stacked bar per row.

No GPU needed: it reads a results JSON that ``benchmarks.kernels`` wrote (each row keeps
its kernels and their median CUPTI times).

    python -m benchmarks.breakdown benchmarks/results/kernels_h200_v20_128k.json \\
        --rows "AsyncTLS operator (end to end),AsyncTLS method step (model path)" --K 2048 \\
        --name breakdown_h200_v20

(``breakdown_h200_v19`` came from v19's grid, now in git history:
``git show 9ad4a25:benchmarks/results/kernels_h200_v19_all.json``.)

The stages follow the AsyncTLS operator: the Quest block bound, the block top-k, the label
logits and their normalization, the token top-k (or the fused selection), the sparse
attention, the merge of its splits, and the small XLA fusions between them ("glue": masks,
broadcasts, the query layout, the token map). A kernel of no known stage is counted as
"other" and named in the table, so nothing is dropped.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from benchmarks.timing import RESULTS_DIR, markdown_table, write_final_results

#: (stage, test on the kernel name), first match wins; XLA names its fusions "loop_*" /
#: "input_*", our Pallas kernels carry their own names
STAGES = (
    ("block bound (Quest)", lambda n: n.startswith(("quest_block_scores", "quest_q8_query_prep"))),
    ("label logits", lambda n: n.startswith(("label_logits", "label_stats", "label_scores_"))),
    ("label normalize", lambda n: n.startswith("label_normalize")),
    ("fused label top-k", lambda n: n.startswith("label_topk")),
    ("sparse attention", lambda n: n.startswith(("sparse_decode", "block_sparse_decode"))),
    ("split merge", lambda n: n.startswith("split_merge")),  # merge="pallas": one kernel
    ("XLA glue", lambda n: n.startswith(("loop_", "input_"))),
)
ORDER = ("block bound (Quest)", "block top-k", "label logits", "label normalize", "token top-k",
         "fused label top-k", "sparse attention", "split merge", "XLA glue", "other")
COLORS = dict(zip(ORDER, ("C0", "C1", "C2", "C8", "C3", "C6", "C4", "C9", "C7", "k")))


def stage_of(name: str, topk_seen: int, after_attention: bool) -> str:
    """The stage of kernel ``name``; ``topk_seen`` = top-k kernels before it in the row
    (the first top-k of a step picks blocks, a later one tokens); ``after_attention``: the
    sparse attention ran before it (the kernel list is in launch order), so an XLA fusion
    is the merge of the attention's splits."""
    if name.startswith("topk_select"):
        return "block top-k" if topk_seen == 0 else "token top-k"
    for stage, test in STAGES:
        if test(name):
            return "split merge" if stage == "XLA glue" and after_attention else stage
    return "other"


def breakdown(row: dict) -> dict:
    """``{stage: {"us": total, "kernels": [names]}}`` of one results row (times in µs)."""
    out: dict[str, dict] = {}
    topk_seen, after_attention = 0, False
    for name, ms in row.get("kernels") or []:
        stage = stage_of(name, topk_seen, after_attention)
        topk_seen += name.startswith("topk_select")
        after_attention = after_attention or stage == "sparse attention"
        entry = out.setdefault(stage, {"us": 0.0, "kernels": []})
        entry["us"] += ms * 1e3
        entry["kernels"].append(name)
    return out


def select_rows(payload: dict, names: list[str], k) -> list[dict]:
    """The rows called ``names`` (in that order) at budget ``k``, each with its kernel list;
    a missing one is an error that lists what the file holds."""
    rows = payload["rows"]
    found = []
    for name in names:
        hit = [r for r in rows if r["kernel"] == name and (k is None or r["K"] == k) and r.get("kernels")]
        if not hit:
            have = sorted({r["kernel"] for r in rows if r.get("kernels")})
            raise SystemExit(f"no row {name!r} at K={k} with a kernel list; the file has: {have}")
        found.extend(hit)
    return found


def render(payload: dict) -> str:
    info = payload["stamp"]
    table = []
    for r in payload["rows"]:
        for stage in ORDER:
            e = r["stages"].get(stage)
            if e:
                table.append({"B": r["B"], "S": r["S"], "K": r["K"], "row": r["kernel"], "stage": stage,
                              "us": e["us"], "share": e["us"] / (r["ms"] * 1e3),
                              "kernels": len(e["kernels"]),
                              "names": ", ".join(e["kernels"]) if stage in ("XLA glue", "other") else ""})
    return (f"# Where the decode step's time goes\n\nFrom `{payload['source']}` ({info['device']}, jax "
            f"{info['jax']}, {info['date']}, commit {info['git_commit']}; its command: `{info['command']}`). "
            f"CUPTI kernel times (medians), summed by stage; `share` is of the row's total. This file: "
            f"`{payload.get('derived_by', 'python -m benchmarks.breakdown')}`.\n\n"
            + markdown_table(table, ["B", "S", "K", "row", "stage", "us", "share", "kernels", "names"],
                             {"us": ".1f", "share": ".2f"}))


def plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = payload["rows"]
    labels = [f"B={r['B']}, {r['S'] // 1024}K, K={r['K']}\n{r['kernel']}" for r in rows]
    fig, ax = plt.subplots(figsize=(9, 0.9 * len(rows) + 2.2))
    left = [0.0] * len(rows)
    for stage in ORDER:
        widths = [r["stages"].get(stage, {}).get("us", 0.0) for r in rows]
        if any(widths):
            ax.barh(range(len(rows)), widths, left=left, color=COLORS[stage], label=stage)
            left = [a + b for a, b in zip(left, widths)]
    for i, r in enumerate(rows):
        ax.text(left[i] + 0.5, i, f"{r['ms'] * 1e3:.1f} µs", va="center", fontsize=8)
    ax.set_yticks(range(len(rows)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("CUPTI kernel time (µs)")
    ax.set_xlim(0, max(left) * 1.15)
    ax.legend(fontsize=7, ncol=5, loc="upper center", bbox_to_anchor=(0.4, -0.1 - 0.3 / len(rows)))
    ax.set_title("Decode step by stage")
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", type=Path, help="a benchmarks.kernels results JSON")
    p.add_argument("--rows", default="AsyncTLS operator (end to end),AsyncTLS method step (model path)",
                   help="comma-separated row names (default: %(default)s)")
    p.add_argument("--K", type=int, default=2048, help="the budget of the rows (default %(default)s)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    p.add_argument("--name", default=None, help="output stem (default: breakdown_<results stem>)")
    args = p.parse_args(argv)
    if not args.results.is_file():
        raise SystemExit(f"no such results file: {args.results}")
    src = json.loads(args.results.read_text())
    rows = select_rows(src, [n.strip() for n in args.rows.split(",") if n.strip()], args.K)
    out_rows = [{k: r[k] for k in ("B", "S", "K", "kernel", "ms")} | {"stages": breakdown(r)} for r in rows]
    payload = {"stamp": src["stamp"], "source": args.results.name, "rows": out_rows,
               "derived_by": "python -m benchmarks.breakdown " + shlex.join(sys.argv[1:] if argv is None else argv)}
    write_final_results(args.name or f"breakdown_{args.results.stem}", payload, render, plot, args.out)


if __name__ == "__main__":
    main()
