"""How much host<->device transfer time is hidden behind GPU compute, from a profiler trace.

Input: the directory given to ``jax.profiler.trace(logdir, create_perfetto_trace=True)``
(or ``jax.profiler.start_trace(logdir, create_perfetto_trace=True)``), or one of the
trace files in it. JAX writes ``plugins/profile/<run>/<host>.trace.json.gz`` (plus a
``perfetto_trace.json.gz`` with the same events): gzip-compressed Chrome trace-event
JSON. The newest ``*.trace.json.gz`` under the directory is read.

What is measured
----------------
Only complete events (``"ph": "X"``; ``ts`` and ``dur`` in microseconds) on GPU
*stream* threads count. On NVIDIA, XLA's CUPTI collector puts each CUDA stream on a
thread named ``Stream #<id>(<activity kinds>)`` inside a process named
``/device:GPU:<n>``; the same process also holds derived rows ("XLA Ops",
"XLA Modules", "Steps", ...) that repeat the kernels under HLO names, and a
"CUPTI overhead" row. Those are not streams and are skipped, as are all host
(``/host:CPU``) threads. Every stream event is put in one class:

* **transfer**: memcpy activity (name matches ``memcpy_regex``: ``MemcpyH2D``,
  ``MemcpyD2H``, ...) and kernels whose name matches ``transfer_regex`` (default
  ``host_gather``: our Pallas kernel reads pinned host memory over PCIe, so its
  time is transfer time even though it is a kernel);
* **compute**: every other stream event.

Per class the busy time is the measure of the *union* of its intervals, so
concurrent or nested events are counted once. Then, in microseconds,

* ``transfer_busy_us`` = |T|, ``compute_busy_us`` = |C|,
* ``overlap_us`` = |T ∩ C|: transfer time during which some compute ran,
* ``exposed_transfer_us`` = |T| - |T ∩ C|: transfer time nothing hid,
* ``hidden_fraction`` = |T ∩ C| / |T| (0 when there is no transfer),
* ``gpu_busy_us`` = |T ∪ C| and ``gpu_idle_us`` = span - |T ∪ C|,

over the GPU-active span (first stream event start to last stream event end), or over
the events whose *start* lies in a window ``[t0, t1]`` (whole events are kept, not
clipped, so a window boundary never splits a kernel).

Reading the picture
-------------------
``plot_timeline`` draws time (ms from the start of the active span) left to right,
one row per GPU stream, bars blue for compute and orange for transfer. Three summary
rows at the top show the unions T and C and their intersection. Wherever a
transfer is hidden (T ∩ C), a translucent yellow band runs through all rows; orange
without a yellow band behind it is exposed transfer time. Events narrower than a
pixel are still drawn as hairlines, so a dense row looks solid; zoom with
``--window-ms``.

Naming is checked on the GPU only at run time: the report lists every thread found
(and whether it was taken as a stream) and the top event names per class. Read them
before trusting the numbers; change ``--stream-regex`` / ``--memcpy-regex`` /
``--transfer-regex`` if the classification is off.

CLI::

    python -m benchmarks.trace_overlap LOGDIR --png out.png --json out.json
    python -m benchmarks.trace_overlap LOGDIR --t0-ms 5 --t1-ms 25 --window-ms 2

This module needs only the standard library and matplotlib (no jax), so a trace
copied off the GPU machine can be analysed anywhere.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gzip
import json
import math
import re
import sys
from pathlib import Path
from typing import Any, Iterable, NamedTuple, Sequence

import jax

# Defaults. All regexes are applied with re.search (a match anywhere in the name).
DEFAULT_TRANSFER_REGEX = r"host_gather"
DEFAULT_MEMCPY_REGEX = r"Memcpy|memcpy|HtoD|DtoH|H2D|D2H|CopyHostToDevice|CopyDeviceToHost"
DEFAULT_STREAM_REGEX = r"(?i)stream"
DEFAULT_DEVICE_REGEX = r"(?i)/device:|gpu|cuda"
# Memcpy kinds that never cross PCIe to the host; flagged in the report's warnings
# when they land in the transfer class (they do with the default memcpy regex).
_DEVICE_ONLY_COPY = re.compile(r"D2D|DtoD|P2P|PtoP|DeviceToDevice")

TRANSFER, COMPUTE = "transfer", "compute"
COLORS = {COMPUTE: "#1f77b4", TRANSFER: "#ff7f0e", "overlap": "#f2d200"}


class TraceEvent(NamedTuple):
    """One complete (``"ph": "X"``) trace event. Times in microseconds, trace clock."""

    name: str
    ts: float  # start, µs
    dur: float  # duration, µs (>= 0)
    pid: Any
    tid: Any
    process: str  # process name from the "process_name" metadata event, "" if none
    thread: str  # thread name from the "thread_name" metadata event, "" if none

    @property
    def end(self) -> float:
        return self.ts + self.dur


# --------------------------------------------------------------------------------------
# Interval arithmetic on half-open intervals [start, end), lists of (start, end) pairs.


def interval_union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, disjoint intervals covering exactly the union of ``intervals``.

    Touching intervals ([0, 1) and [1, 2)) merge; empty ones (end <= start) vanish.
    """
    out: list[list[float]] = []
    for s, e in sorted((s, e) for s, e in intervals if e > s):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def interval_intersection(a: Sequence[tuple[float, float]], b: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """Intersection of two *sorted, disjoint* interval lists (outputs of ``interval_union``)."""
    out = []
    i = j = 0
    while i < len(a) and j < len(b):
        s = max(a[i][0], b[j][0])
        e = min(a[i][1], b[j][1])
        if e > s:
            out.append((s, e))
        # advance whichever ends first: it cannot meet anything later in the other list
        if a[i][1] <= b[j][1]:
            i += 1
        else:
            j += 1
    return out


def measure(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length of disjoint intervals."""
    return float(sum(e - s for s, e in intervals))


# --------------------------------------------------------------------------------------
# Loading


def find_trace_file(logdir_or_file: str | Path) -> Path:
    """The trace file to read: ``logdir_or_file`` itself, or the newest trace under it.

    Newest ``*.trace.json.gz`` (recursively) by modification time, ties broken by path
    (run directories are named by timestamp); if there is none, the newest
    ``*trace.json.gz`` / ``*trace.json`` (e.g. ``perfetto_trace.json.gz``).
    """
    p = Path(logdir_or_file)
    if p.is_file():
        return p
    if not p.is_dir():
        raise FileNotFoundError(f"no such trace file or directory: {p}")
    for pattern in ("*.trace.json.gz", "*trace.json.gz", "*trace.json"):
        found = [f for f in p.rglob(pattern) if f.is_file()]
        if found:
            return max(found, key=lambda f: (f.stat().st_mtime_ns, str(f)))
    raise FileNotFoundError(
        f"no *.trace.json.gz under {p}; was the trace written with create_perfetto_trace=True?"
    )


def _read_json(path: Path) -> Any:
    with open(path, "rb") as fh:
        magic = fh.read(2)
    opener = gzip.open if magic == b"\x1f\x8b" else open
    with opener(path, "rt", encoding="utf-8") as fh:
        return json.load(fh)


def load_events(logdir_or_file: str | Path) -> tuple[list[TraceEvent], dict[tuple[Any, Any], str]]:
    """All complete events of a trace, with their process and thread names attached.

    Returns ``(events, thread_names)``: ``events`` is a list of ``TraceEvent`` (host and
    device alike, in file order; classification happens in ``overlap_report``), and
    ``thread_names`` maps ``(pid, tid)`` to the thread's name for every thread named in
    the metadata (threads without events included). Times stay in the trace's
    microseconds. The path of the file read is available as ``find_trace_file(...)``.
    """
    data = _read_json(find_trace_file(logdir_or_file))
    raw = data.get("traceEvents", []) if isinstance(data, dict) else data  # both JSON forms are legal
    process_names: dict[Any, str] = {}
    thread_names: dict[tuple[Any, Any], str] = {}
    for ev in raw:
        if not isinstance(ev, dict) or ev.get("ph") != "M":
            continue
        name = (ev.get("args") or {}).get("name")
        if name is None:
            continue
        if ev.get("name") == "process_name":
            process_names[ev.get("pid")] = str(name)
        elif ev.get("name") == "thread_name":
            thread_names[(ev.get("pid"), ev.get("tid"))] = str(name)
    events = []
    for ev in raw:
        # jax's files end with an empty {} event; anything without a start is skipped too
        if not isinstance(ev, dict) or ev.get("ph") != "X" or "ts" not in ev:
            continue
        pid, tid = ev.get("pid"), ev.get("tid")
        events.append(
            TraceEvent(
                name=str(ev.get("name", "")),
                ts=float(ev["ts"]),
                dur=max(0.0, float(ev.get("dur", 0.0))),
                pid=pid,
                tid=tid,
                process=process_names.get(pid, ""),
                thread=thread_names.get((pid, tid), ""),
            )
        )
    return events, thread_names


# --------------------------------------------------------------------------------------
# Classification and analysis


@dataclasses.dataclass(frozen=True)
class Config:
    """Classification settings (regexes, re.search semantics) and the window (µs, trace clock)."""

    transfer_regex: str = DEFAULT_TRANSFER_REGEX
    memcpy_regex: str = DEFAULT_MEMCPY_REGEX
    stream_regex: str = DEFAULT_STREAM_REGEX
    device_regex: str = DEFAULT_DEVICE_REGEX
    ignore_regex: str | None = None
    window: tuple[float, float] | None = None


@dataclasses.dataclass
class _Analysis:
    streams: list[tuple[Any, Any]]  # (pid, tid) of GPU streams, in display order
    classified: list[tuple[TraceEvent, str]]  # stream events in the window, with class
    transfer: list[tuple[float, float]]  # union T, µs
    compute: list[tuple[float, float]]  # union C, µs
    overlap: list[tuple[float, float]]  # T ∩ C, µs
    span: tuple[float, float] | None  # (first start, last end) of the classified events, µs
    ignored: dict[str, int]


def _is_stream(process: str, thread: str, stream_re: re.Pattern, device_re: re.Pattern) -> bool:
    # A host thread may well have "stream" in its name (executor threads do), so the
    # process must look like a device; traces without process names are given the
    # benefit of the doubt.
    return bool(stream_re.search(thread)) and (process == "" or bool(device_re.search(process)))


def _stream_sort_key(key_and_name: tuple[tuple[Any, Any], str]) -> tuple:
    (pid, tid), name = key_and_name
    m = re.search(r"#\s*(\d+)", name)
    return (str(pid), int(m.group(1)) if m else math.inf, name)


def _analyse(events: Sequence[TraceEvent], cfg: Config) -> _Analysis:
    transfer_re = re.compile(cfg.transfer_regex)
    memcpy_re = re.compile(cfg.memcpy_regex)
    stream_re = re.compile(cfg.stream_regex)
    device_re = re.compile(cfg.device_regex)
    ignore_re = re.compile(cfg.ignore_regex) if cfg.ignore_regex else None

    # names repeat thousands of times: decide once per thread and per name
    stream_of: dict[tuple[Any, Any], bool] = {}
    class_of: dict[str, str | None] = {}
    ignored = collections.Counter()
    classified: list[tuple[TraceEvent, str]] = []
    stream_names: dict[tuple[Any, Any], str] = {}
    for ev in events:
        key = (ev.pid, ev.tid)
        is_stream = stream_of.get(key)
        if is_stream is None:
            is_stream = stream_of[key] = _is_stream(ev.process, ev.thread, stream_re, device_re)
        if not is_stream:
            ignored["not_a_gpu_stream"] += 1
            continue
        stream_names[key] = ev.thread
        if cfg.window is not None and not (cfg.window[0] <= ev.ts <= cfg.window[1]):
            ignored["outside_window"] += 1
            continue
        if ev.name not in class_of:
            if ignore_re is not None and ignore_re.search(ev.name):
                class_of[ev.name] = None
            elif memcpy_re.search(ev.name) or transfer_re.search(ev.name):
                class_of[ev.name] = TRANSFER
            else:
                class_of[ev.name] = COMPUTE
        cls = class_of[ev.name]
        if cls is None:
            ignored["ignore_regex"] += 1
            continue
        classified.append((ev, cls))

    transfer = interval_union((e.ts, e.end) for e, c in classified if c == TRANSFER)
    compute = interval_union((e.ts, e.end) for e, c in classified if c == COMPUTE)
    span = (min(e.ts for e, _ in classified), max(e.end for e, _ in classified)) if classified else None
    streams = [k for k, _ in sorted(stream_names.items(), key=_stream_sort_key)]
    return _Analysis(
        streams=streams,
        classified=classified,
        transfer=transfer,
        compute=compute,
        overlap=interval_intersection(transfer, compute),
        span=span,
        ignored=dict(ignored),
    )


def _top_names(classified: list[tuple[TraceEvent, str]], cls: str, top: int) -> list[dict]:
    count = collections.Counter()
    total = collections.Counter()
    for ev, c in classified:
        if c == cls:
            count[ev.name] += 1
            total[ev.name] += ev.dur
    names = sorted(count, key=lambda n: (-total[n], n))[:top]
    return [{"name": n, "count": count[n], "total_us": float(total[n])} for n in names]


def overlap_report(
    events: Sequence[TraceEvent],
    *,
    transfer_regex: str = DEFAULT_TRANSFER_REGEX,
    memcpy_regex: str = DEFAULT_MEMCPY_REGEX,
    stream_regex: str = DEFAULT_STREAM_REGEX,
    device_regex: str = DEFAULT_DEVICE_REGEX,
    ignore_regex: str | None = None,
    window: tuple[float, float] | None = None,
    top: int = 10,
) -> dict:
    """Transfer/compute busy times, their overlap and the hidden fraction (JSON-ready dict).

    ``events``: from ``load_events``. Only events on GPU streams count: thread name
    matches ``stream_regex`` and process name matches ``device_regex`` (or is unknown).
    A stream event is a transfer if its name matches ``memcpy_regex`` or
    ``transfer_regex``, is dropped if it matches ``ignore_regex``, and is compute
    otherwise. ``window=(t0, t1)`` in trace microseconds (the same clock as
    ``TraceEvent.ts``; ``report["span_us"]`` of an unwindowed report gives its range)
    keeps only events whose start lies in ``[t0, t1]``.

    All times are in microseconds. Keys: ``gpu_streams_found``, ``note`` (a sentence
    when there is nothing to measure, else None), ``span_us`` ([start, end] or None),
    ``active_us``, ``transfer_busy_us``, ``compute_busy_us``, ``overlap_us``,
    ``exposed_transfer_us``, ``gpu_busy_us``, ``gpu_idle_us``, ``hidden_fraction``,
    ``n_events`` (per class, and ignored per reason), ``streams`` (per-stream counts
    and busy times), ``top_names`` (per class: name, count, total_us, by total time),
    ``threads`` (every thread with events: process, thread, n_events, gpu_stream),
    ``warnings`` and ``config`` (the settings, which ``plot_timeline`` reuses).
    """
    cfg = Config(transfer_regex, memcpy_regex, stream_regex, device_regex, ignore_regex,
                 None if window is None else (float(window[0]), float(window[1])))
    a = _analyse(events, cfg)

    transfer_busy = measure(a.transfer)
    compute_busy = measure(a.compute)
    overlap = measure(a.overlap)
    gpu_busy = measure(interval_union(a.transfer + a.compute))
    active = (a.span[1] - a.span[0]) if a.span else 0.0

    threads_count = collections.Counter((ev.pid, ev.tid) for ev in events)
    labels = {(ev.pid, ev.tid): (ev.process, ev.thread) for ev in events}
    stream_set = set(a.streams)
    threads = [
        {"pid": k[0], "tid": k[1], "process": labels[k][0], "thread": labels[k][1],
         "n_events": n, "gpu_stream": k in stream_set}
        for k, n in sorted(threads_count.items(), key=lambda kv: (str(labels[kv[0]][0]), str(labels[kv[0]][1]), str(kv[0])))
    ]

    by_stream: dict[tuple[Any, Any], list[tuple[TraceEvent, str]]] = collections.defaultdict(list)
    for e, c in a.classified:
        by_stream[(e.pid, e.tid)].append((e, c))
    streams = []
    for key in a.streams:
        evs = by_stream[key]
        name = labels[key]
        streams.append({
            "process": name[0],
            "thread": name[1],
            "n_transfer": sum(c == TRANSFER for _, c in evs),
            "n_compute": sum(c == COMPUTE for _, c in evs),
            "transfer_busy_us": measure(interval_union((e.ts, e.end) for e, c in evs if c == TRANSFER)),
            "compute_busy_us": measure(interval_union((e.ts, e.end) for e, c in evs if c == COMPUTE)),
        })

    n_transfer = sum(c == TRANSFER for _, c in a.classified)
    note = None
    if not a.streams:
        note = (
            "no GPU stream threads found in this trace (CPU-only run, or stream threads "
            f"named differently: see 'threads' and --stream-regex {cfg.stream_regex!r}, "
            f"--device-regex {cfg.device_regex!r}); nothing to measure"
        )
    elif not a.classified:
        note = "GPU streams found but no stream events in the window; nothing to measure"
    elif n_transfer == 0:
        note = "no transfer events (memcpy or transfer-regex kernels) on the GPU streams; hidden_fraction is 0"

    warnings = []
    d2d = sorted({e.name for e, c in a.classified if c == TRANSFER and _DEVICE_ONLY_COPY.search(e.name)})
    if d2d:
        warnings.append(
            f"device-only copies counted as transfers: {d2d[:5]}; exclude them with --memcpy-regex "
            "(e.g. 'MemcpyH2D|MemcpyD2H') or --ignore-regex if they are not host<->device"
        )
    devices = sorted({labels[k][0] for k in a.streams})
    if len(devices) > 1:
        warnings.append(
            f"streams from {len(devices)} device processes {devices} are pooled; restrict with "
            "--device-regex to measure one GPU"
        )
    transfer_names = {e.name for e, c in a.classified if c == TRANSFER}
    if n_transfer and not any(re.search(cfg.transfer_regex, n) for n in transfer_names):
        warnings.append(f"no kernel matched --transfer-regex {cfg.transfer_regex!r}; only memcpy counted as transfer")

    return {
        "gpu_streams_found": bool(a.streams),
        "note": note,
        "span_us": list(a.span) if a.span else None,
        "active_us": active,
        "transfer_busy_us": transfer_busy,
        "compute_busy_us": compute_busy,
        "overlap_us": overlap,
        "exposed_transfer_us": transfer_busy - overlap,
        "gpu_busy_us": gpu_busy,
        "gpu_idle_us": active - gpu_busy,
        "hidden_fraction": overlap / transfer_busy if transfer_busy > 0 else 0.0,
        "n_events": {"transfer": n_transfer, "compute": len(a.classified) - n_transfer,
                     "ignored": a.ignored},
        "streams": streams,
        "top_names": {TRANSFER: _top_names(a.classified, TRANSFER, top),
                      COMPUTE: _top_names(a.classified, COMPUTE, top)},
        "threads": threads,
        "warnings": warnings,
        "config": dataclasses.asdict(cfg),
    }


# --------------------------------------------------------------------------------------
# Plot


def host_time_by_name(events: Sequence[TraceEvent], top: int = 20,
                      device_regex: str = DEFAULT_DEVICE_REGEX) -> list[dict]:
    """Where the host's time goes: events outside the GPU processes, summed per
    (thread, name), largest total first. Nested events each count their own
    (inclusive) duration, so a parent and its children both appear."""
    dev = re.compile(device_regex)
    acc: dict[tuple[str, str], list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for e in events:
        if dev.search(e.process):
            continue
        a = acc[(e.thread, e.name)]
        a[0] += e.dur
        a[1] += 1
    rows = [{"thread": t, "name": n, "total_us": v[0], "count": int(v[1])} for (t, n), v in acc.items()]
    rows.sort(key=lambda r: -r["total_us"])
    return rows[:top]


def _clip(intervals: Iterable[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    return [(max(s, lo), min(e, hi)) for s, e in intervals if e > lo and s < hi]


def plot_timeline(
    events: Sequence[TraceEvent],
    report: dict,
    path: str | Path,
    *,
    window_ms: float | None = None,
    title: str | None = None,
    dpi: int = 120,
) -> Path:
    """Write a timeline PNG of the GPU streams to ``path``; returns the path.

    ``events`` and ``report`` as from ``load_events`` / ``overlap_report`` (the report's
    ``config`` re-derives the classification, so the picture matches the numbers).
    x axis: ms since the start of the report's active span; ``window_ms`` shows only its
    first ``window_ms`` ms. Rows: T ∪, C ∪, T ∩ C, then one per stream; a yellow band
    across all rows marks hidden transfer time. The title's numbers are the report's
    (its whole window), not only the zoomed part.
    """
    # Figure + Agg canvas directly (no pyplot): no global backend state, safe in tests
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    cfg_d = dict(report["config"])
    if cfg_d.get("window") is not None:
        cfg_d["window"] = tuple(cfg_d["window"])
    a = _analyse(events, Config(**cfg_d))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)

    labels = {(e.pid, e.tid): e.thread for e, _ in a.classified}
    multi_device = len({e.process for e, _ in a.classified}) > 1
    if multi_device:
        labels = {(e.pid, e.tid): f"{e.process} {e.thread}" for e, _ in a.classified}
    streams = [k for k in a.streams if k in labels]
    rows = ["T ∪ (transfer)", "C ∪ (compute)", "T ∩ C (hidden)"] + [labels[k] for k in streams]
    fig = Figure(figsize=(12, max(2.8, 0.42 * len(rows) + 1.6)))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)

    if a.span is None:
        ax.text(0.5, 0.5, report.get("note") or "no GPU stream events", ha="center", va="center",
                wrap=True, transform=ax.transAxes)
        ax.set_axis_off()
        fig.suptitle(title or "GPU timeline: nothing to draw")
        fig.savefig(path, dpi=dpi)
        return path

    t0 = a.span[0]
    hi = a.span[1] if window_ms is None else t0 + window_ms * 1e3

    def to_ms(intervals):  # broken_barh wants (start, width) pairs
        return [((s - t0) / 1e3, (e - s) / 1e3) for s, e in _clip(intervals, t0, hi)]

    # row y = index from the top; bars take 0.8 of a row
    ny = len(rows)

    def y_of(i):
        return ny - 1 - i

    hair = dict(linewidth=0.3)  # edge in the face colour: sub-pixel events stay visible
    overlap_ms = to_ms(a.overlap)
    ax.broken_barh(overlap_ms, (-0.5, ny), facecolor=COLORS["overlap"], alpha=0.28, zorder=0)
    ax.broken_barh(to_ms(a.transfer), (y_of(0) - 0.4, 0.8), facecolor=COLORS[TRANSFER], edgecolor=COLORS[TRANSFER], **hair)
    ax.broken_barh(to_ms(a.compute), (y_of(1) - 0.4, 0.8), facecolor=COLORS[COMPUTE], edgecolor=COLORS[COMPUTE], **hair)
    ax.broken_barh(overlap_ms, (y_of(2) - 0.4, 0.8), facecolor=COLORS["overlap"], edgecolor=COLORS["overlap"], **hair)
    per_row: dict[tuple[Any, Any], dict[str, list]] = {k: {TRANSFER: [], COMPUTE: []} for k in streams}
    for e, c in a.classified:
        per_row[(e.pid, e.tid)][c].append((e.ts, e.end))
    for i, k in enumerate(streams, start=3):
        for cls in (COMPUTE, TRANSFER):
            # union per row: fewer rectangles, and nested events draw as one bar
            bars = to_ms(interval_union(per_row[k][cls]))
            if bars:
                ax.broken_barh(bars, (y_of(i) - 0.4, 0.8), facecolor=COLORS[cls], edgecolor=COLORS[cls], **hair)
    ax.axhline(y_of(2) - 0.5, color="0.5", linewidth=0.8)

    ax.set_yticks([y_of(i) for i in range(ny)])
    ax.set_yticklabels(rows, fontsize=8)
    ax.set_ylim(-0.5, ny - 0.5)
    ax.set_xlim(0, (hi - t0) / 1e3)
    ax.set_xlabel("time since first GPU stream event (ms)")
    ax.grid(axis="x", linewidth=0.3, alpha=0.5)
    ax.legend(
        handles=[Patch(color=COLORS[COMPUTE], label="compute"), Patch(color=COLORS[TRANSFER], label="transfer"),
                 Patch(color=COLORS["overlap"], alpha=0.5, label="transfer hidden by compute")],
        # above the axes, so it never hides bars
        loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=3, fontsize=8, frameon=False,
    )
    hf = report["hidden_fraction"]
    head = title or "GPU timeline"
    zoom = f", first {window_ms:g} ms shown" if window_ms is not None else ""
    fig.suptitle(
        f"{head}: hidden fraction {hf:.1%} (overlap {report['overlap_us'] / 1e3:.3f} ms of "
        f"{report['transfer_busy_us'] / 1e3:.3f} ms transfer; compute {report['compute_busy_us'] / 1e3:.3f} ms, "
        f"span {report['active_us'] / 1e3:.3f} ms{zoom})",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    return path


# --------------------------------------------------------------------------------------
# CLI


def format_summary(report: dict, trace_file: str | None = None) -> str:
    """A short human-readable summary (markdown tables) of ``overlap_report``'s dict."""
    lines = []
    if trace_file:
        lines.append(f"trace: {trace_file}")
    n_threads = len(report["threads"])
    lines.append(f"GPU streams: {len(report['streams'])} of {n_threads} threads with events")
    if report["note"]:
        lines.append(f"NOTE: {report['note']}")
    if report["span_us"] is not None:
        span = report["active_us"]

        def row(label, us):
            pct = f"{100 * us / span:.1f}" if span > 0 else "-"
            return f"| {label} | {us / 1e3:.4f} | {pct} |"

        lines += [
            "",
            "| quantity | ms | % of span |",
            "| --- | --- | --- |",
            row("GPU-active span", span),
            row("transfer busy (T)", report["transfer_busy_us"]),
            row("compute busy (C)", report["compute_busy_us"]),
            row("overlap (T ∩ C)", report["overlap_us"]),
            row("exposed transfer (T - C)", report["exposed_transfer_us"]),
            row("GPU idle", report["gpu_idle_us"]),
            "",
            f"hidden_fraction = {report['hidden_fraction']:.4f} (share of transfer time overlapped by compute)",
        ]
    for cls in (TRANSFER, COMPUTE):
        tops = report["top_names"][cls]
        if tops:
            lines += ["", f"top {cls} events (by total time):", "| name | count | total ms |", "| --- | --- | --- |"]
            lines += [f"| {t['name'][:90]} | {t['count']} | {t['total_us'] / 1e3:.4f} |" for t in tops]
    lines += ["", "threads (x = taken as GPU stream):"]
    lines += [f"  [{'x' if t['gpu_stream'] else ' '}] {t['process']!s} / {t['thread']!s}: {t['n_events']} events"
              for t in report["threads"]]
    for w in report["warnings"]:
        lines.append(f"WARNING: {w}")
    return "\n".join(lines)


SELECTION_KERNELS = r"quest_block_scores|topk_select|block_label|label_scores|label_logits"


def selection_overlap(kernels, select_regex: str = SELECTION_KERNELS) -> dict:
    """How much GPU time ran concurrently, from traced kernels (``ts``/``end``/``name``, µs).

    ``kernel_sum_us``: the kernels' summed durations; ``busy_us``: their union. Above the
    union, kernels ran side by side (a concurrent CUDA graph's branches). ``select_us``: the
    union of the kernels named by ``select_regex`` (a method's selection); ``select_hidden_us``:
    the part of it during which some other kernel also ran, i.e. selection work that left
    the step's critical path."""
    sel_re = re.compile(select_regex)
    sel = [k for k in kernels if sel_re.search(k.name)]
    rest = [k for k in kernels if not sel_re.search(k.name)]
    sel_u = interval_union((k.ts, k.end) for k in sel)
    rest_u = interval_union((k.ts, k.end) for k in rest)
    return {"kernel_sum_us": float(sum(k.dur for k in kernels)),
            "busy_us": measure(interval_union((k.ts, k.end) for k in kernels)),
            "select_us": measure(sel_u),
            "select_hidden_us": measure(interval_intersection(sel_u, rest_u))}


def kernel_profile(step, cache, tokens, steps: int, logdir: str, top: int = 8):
    """Trace ``steps`` decode steps: GPU busy ms per step, span per step, the top kernels,
    and the concurrency figures of :func:`selection_overlap` per step. (XLA runs without
    CUDA graphs under the profiler unless ``--xla_enable_command_buffers_during_profiling``
    is set: a concurrent graph's overlap shows only with it.)"""
    import collections
    with jax.profiler.trace(logdir, create_perfetto_trace=False):
        for _ in range(steps):
            logits, cache = step(tokens, cache)
        jax.block_until_ready(logits)
    events, _ = load_events(logdir)
    sre, dre = re.compile(DEFAULT_STREAM_REGEX), re.compile(DEFAULT_DEVICE_REGEX)
    ks = [e for e in events if _is_stream(e.process, e.thread, sre, dre)]
    by = collections.Counter()
    for e in ks:
        by[re.sub(r"[._]\d+$", "", e.name)[:60]] += e.dur
    busy = measure(interval_union((e.ts, e.end) for e in ks)) / 1e3 / steps
    span = (max(e.end for e in ks) - min(e.ts for e in ks)) / 1e3 / steps if ks else 0.0
    tops = "; ".join(f"{n} {t / 1e3 / steps:.2f}" for n, t in by.most_common(top))
    ov = selection_overlap(ks)
    return {"gpu_busy_ms": round(busy, 3), "gpu_span_ms": round(span, 3), "top_kernels_ms": tops,
            "kernel_sum_ms": round(ov["kernel_sum_us"] / 1e3 / steps, 3),
            "select_ms": round(ov["select_us"] / 1e3 / steps, 3),
            "select_hidden_ms": round(ov["select_hidden_us"] / 1e3 / steps, 3)}, cache


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.trace_overlap", description=__doc__.split("\n")[0])
    ap.add_argument("logdir", help="jax.profiler logdir, or a *.trace.json.gz file")
    ap.add_argument("--png", help="write the timeline picture here")
    ap.add_argument("--json", help="write the report here")
    ap.add_argument("--transfer-regex", default=DEFAULT_TRANSFER_REGEX, help="kernels counted as transfers")
    ap.add_argument("--memcpy-regex", default=DEFAULT_MEMCPY_REGEX, help="memcpy event names")
    ap.add_argument("--stream-regex", default=DEFAULT_STREAM_REGEX, help="GPU stream thread names")
    ap.add_argument("--device-regex", default=DEFAULT_DEVICE_REGEX, help="GPU process names")
    ap.add_argument("--ignore-regex", default=None, help="stream events to drop (e.g. 'Memset')")
    ap.add_argument("--t0-ms", type=float, help="window start, ms after the first GPU stream event")
    ap.add_argument("--t1-ms", type=float, help="window end, ms after the first GPU stream event")
    ap.add_argument("--window-ms", type=float, help="picture: show only the first N ms of the span")
    ap.add_argument("--top", type=int, default=10, help="event names listed per class")
    args = ap.parse_args(argv)

    trace_file = find_trace_file(args.logdir)
    events, _ = load_events(trace_file)
    kw = dict(transfer_regex=args.transfer_regex, memcpy_regex=args.memcpy_regex, stream_regex=args.stream_regex,
              device_regex=args.device_regex, ignore_regex=args.ignore_regex, top=args.top)
    report = overlap_report(events, **kw)
    if (args.t0_ms is not None or args.t1_ms is not None) and report["span_us"] is not None:
        # the window is given relative to the unwindowed active span, converted to trace µs
        s0, s1 = report["span_us"]
        w0 = s0 + 1e3 * (args.t0_ms if args.t0_ms is not None else 0.0)
        w1 = s0 + 1e3 * args.t1_ms if args.t1_ms is not None else s1
        report = overlap_report(events, window=(w0, w1), **kw)
    report["trace_file"] = str(trace_file)

    print(format_summary(report, str(trace_file)))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))
        print(f"wrote {args.json}")
    if args.png:
        plot_timeline(events, report, args.png, window_ms=args.window_ms)
        print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
