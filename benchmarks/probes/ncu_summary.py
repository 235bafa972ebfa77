"""Nsight Compute exports of a decode step, as the tables the kernel work reads: per kernel
its time, registers, occupancy, DRAM rate and stall reasons, and from the SASS its
instruction mix (which opcodes it issues, and where the warps wait).

No GPU needed: it reads the CSVs that ``ncu -i REPORT --page raw --csv`` and
``ncu -i REPORT --page source --csv --print-source sass`` print (``benchmarks.probes.ncu_step``
says how to make the report)::

    python -m benchmarks.probes.ncu_summary raw.csv --sass sass.csv --name ncu_step_h200 \\
        --note "NVIDIA H200, jax 0.11.2, 2026-11-28, commit d32cae8"

``--work NAME=COUNT`` divides a kernel's instruction count by its work items (e.g.
``label_logits=524288`` candidates), so two versions of a kernel compare per item.
"""

from __future__ import annotations

import argparse
import collections
import csv
import io
import re
import sys
from pathlib import Path

from benchmarks.timing import RESULTS_DIR, markdown_table

#: raw-page metric -> column (missing metrics are left blank: a report need not have every section)
METRICS = {
    "gpu__time_duration.sum": "us",
    "launch__registers_per_thread": "regs",
    "launch__block_size": "threads",
    "launch__grid_size": "programs",
    "sm__maximum_warps_per_active_cycle_pct": "occ_theory_%",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "occ_achieved_%",
    "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed": "dram_%",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": "sm_%",
}
STALL = re.compile(r"^smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio$")


def _num(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except (AttributeError, ValueError):
        return None


def read_raw(text: str) -> list[dict]:
    """Rows of ``--page raw --csv`` (a header, a units row, one row per kernel launch): the
    ``METRICS`` columns, and ``stalls``: the reasons a warp waited, cycles per issued
    instruction, largest first ("selected" is the issue itself)."""
    rows = list(csv.reader(io.StringIO(text)))
    if len(rows) < 2 or "Kernel Name" not in rows[0]:
        raise ValueError("not an `ncu --page raw --csv` export: no 'Kernel Name' header")
    hdr = rows[0]
    out = []
    for r in rows[2:]:
        if len(r) != len(hdr):
            continue
        rec = {"kernel": r[hdr.index("Kernel Name")]}
        for metric, col in METRICS.items():
            rec[col] = _num(r[hdr.index(metric)]) if metric in hdr else None
        stalls = []
        for h, v in zip(hdr, r):
            m = STALL.match(h)
            if m and _num(v):
                stalls.append((m.group(1), _num(v)))
        rec["stalls"] = sorted(stalls, key=lambda x: -x[1])
        out.append(rec)
    return out


def read_sass(text: str) -> dict[str, dict]:
    """Per kernel of ``--page source --csv --print-source sass``: total warp-level
    instructions executed, and per opcode (modifiers dropped) its count and its share of
    the warp-stall samples."""
    out = {}
    blocks = re.split(r'^"Kernel Name",', text, flags=re.M)
    if len(blocks) < 2:
        raise ValueError('not an `ncu --page source --csv` export: no "Kernel Name" line')
    for block in blocks[1:]:
        head, _, body = block.partition("\n")
        name = head.strip().strip(",").strip('"')
        rows = list(csv.reader(io.StringIO(body)))
        if not rows or "Source" not in rows[0] or "Instructions Executed" not in rows[0]:
            continue
        hdr = rows[0]
        i_src, i_n = hdr.index("Source"), hdr.index("Instructions Executed")
        i_st = hdr.index("Warp Stall Sampling (All Samples)") if "Warp Stall Sampling (All Samples)" in hdr else None
        counts, stalls = collections.Counter(), collections.Counter()
        for r in rows[1:]:
            if len(r) <= i_n or _num(r[i_n]) is None:
                continue
            words = r[i_src].split()
            if not words:
                continue
            op = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
            op = op.split(".")[0]
            counts[op] += int(_num(r[i_n]))
            if i_st is not None and _num(r[i_st]):
                stalls[op] += int(_num(r[i_st]))
        out[name] = {"total": sum(counts.values()), "ops": counts, "stalls": stalls}
    return out


def summarize(raw: list[dict], sass: dict[str, dict] | None = None, work: dict[str, int] | None = None,
              top: int = 8) -> str:
    """Markdown: one table of the launches, then each kernel's instruction mix."""
    work = work or {}
    kernels = []
    for rec in raw:
        row = {k: ("" if v is None else v) for k, v in rec.items() if k != "stalls"}  # blank: not collected
        row["top stalls (cycles / issue)"] = ", ".join(f"{n} {v:.2f}" for n, v in rec["stalls"][:3])
        kernels.append(row)
    cols = ["kernel", *METRICS.values(), "top stalls (cycles / issue)"]
    fmt = {"us": ".2f", "regs": ".0f", "threads": ".0f", "programs": ".0f", "occ_theory_%": ".1f",
           "occ_achieved_%": ".1f", "dram_%": ".1f", "sm_%": ".1f"}
    md = "## Launches\n\n" + markdown_table(kernels, cols, fmt)
    for name, mix in (sass or {}).items():
        total = mix["total"]
        per = next((n for key, n in work.items() if name.startswith(key)), None)
        md += f"\n## {name}: {total:,} warp instructions"
        md += f" = {total * 32 / per:.0f} a work item ({per:,} items)\n\n" if per else "\n\n"
        nst = sum(mix["stalls"].values()) or 1
        rows = [{"opcode": op, "count": float(n), "share": n / total, "stall share": mix["stalls"][op] / nst}
                for op, n in mix["ops"].most_common(top)]
        md += markdown_table(rows, ["opcode", "count", "share", "stall share"],
                             {"count": ",.0f", "share": ".1%", "stall share": ".1%"})
    return md


def parse_work(items: list[str]) -> dict[str, int]:
    out = {}
    for item in items:
        name, sep, count = item.partition("=")
        if not sep or not name or not count.isdigit() or int(count) < 1:
            raise ValueError(f"--work: expected KERNEL_PREFIX=COUNT with COUNT >= 1, got {item!r}")
        out[name] = int(count)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("raw", type=Path, help="ncu --page raw --csv export")
    p.add_argument("--sass", type=Path, default=None, help="ncu --page source --csv --print-source sass export")
    p.add_argument("--work", action="append", default=[], help="KERNEL_PREFIX=COUNT: work items a kernel does")
    p.add_argument("--note", default="", help="a line under the title: device, jax, date, commit, command")
    p.add_argument("--name", default=None, help="write <out>/<name>.md (else print)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = p.parse_args(argv)
    try:
        work = parse_work(args.work)
        raw = read_raw(args.raw.read_text())
        sass = read_sass(args.sass.read_text()) if args.sass else None
    except (OSError, ValueError) as e:
        sys.exit(f"benchmarks.probes.ncu_summary: {e}")
    md = "# Nsight Compute: a decode step's kernels\n\n" + (args.note + "\n\n" if args.note else "")
    md += summarize(raw, sass, work)
    if args.name:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{args.name}.md").write_text(md)
        print(f"wrote {args.out / (args.name + '.md')}")
    else:
        print(md)


if __name__ == "__main__":
    main()
