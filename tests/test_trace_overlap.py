"""trace_overlap: interval arithmetic, classification and the picture, on synthetic traces.

The synthetic traces mimic what jax.profiler writes on an NVIDIA GPU: a ``/host:CPU``
process (host threads, ignored) and a ``/device:GPU:0`` process whose CUPTI stream
threads are named ``Stream #<id>(<kinds>)``, next to derived rows ("XLA Ops") and a
"CUPTI overhead" row that must not count. All times are whole microseconds on top
of a large base, so every expected number is exact in float64.
"""

from __future__ import annotations

import gzip
import json
import os

import pytest

from benchmarks import trace_overlap as to

BASE = 1_234_567.0  # µs; traces do not start at 0
HOST, GPU, GPU1 = 1, 2, 3


def meta(pid, name, tid=None):
    ev = {"ph": "M", "pid": pid, "name": "process_name" if tid is None else "thread_name", "args": {"name": name}}
    if tid is not None:
        ev["tid"] = tid
    return ev


def x(pid, tid, name, start, end):
    return {"ph": "X", "pid": pid, "tid": tid, "ts": BASE + start, "dur": end - start, "name": name}


def write_trace(path, events):
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt") as fh:
        # jax's files carry displayTimeUnit "ns" (display only: ts stays µs) and end with {}
        json.dump({"displayTimeUnit": "ns", "traceEvents": events + [{}]}, fh)
    return path


def gpu_trace_events():
    """Streams 13/15 compute, 14 memcpy, 16 host_gather; expected numbers in the tests.

    compute    C: [0,10) [20,30) [40,60) ⊃ [45,50) on #13, [25,35) on #15
               -> union [0,10) [20,35) [40,60) = 10 + 15 + 20 = 45
    transfer   T: H2D [5,25), D2H [50,70) on #14, host_gather [8,12) on #16 (inside H2D)
               -> union [5,25) [50,70) = 40
    T ∩ C: [5,10) [20,25) [50,60) = 20  -> hidden 0.5
    span [0,70), T ∪ C = [0,35) [40,70) = 65 -> idle 5
    """
    return [
        meta(HOST, "/host:CPU"),
        meta(HOST, "python", tid=100),
        # a host thread whose name says "Stream": process is a host, so ignored
        meta(HOST, "tf_Stream #99 executor", tid=101),
        meta(GPU, "/device:GPU:0"),
        meta(GPU, "Stream #13(Compute)", tid=13),
        meta(GPU, "Stream #14(MemcpyH2D,MemcpyD2H)", tid=14),
        meta(GPU, "Stream #15(Compute)", tid=15),
        meta(GPU, "Stream #16(Compute)", tid=16),
        meta(GPU, "XLA Ops", tid=1000),
        meta(GPU, "CUPTI overhead", tid=1001),
        # host events, including memcpy-looking API calls: ignored
        x(HOST, 100, "PjitFunction(step)", -50, 1000),
        x(HOST, 100, "cuMemcpyHtoDAsync", 0, 100),
        x(HOST, 101, "MemcpyH2D", 0, 500),
        x(HOST, 101, "fusion_9", 0, 500),
        # GPU streams
        x(GPU, 13, "fusion_1", 0, 10),
        x(GPU, 13, "fusion_2", 20, 30),
        x(GPU, 13, "outer", 40, 60),
        x(GPU, 13, "inner", 45, 50),  # nested in "outer": must not add time
        x(GPU, 15, "gemm", 25, 35),  # concurrent with fusion_2 on another stream
        x(GPU, 14, "MemcpyH2D", 5, 25),
        x(GPU, 14, "MemcpyD2H", 50, 70),
        x(GPU, 16, "host_gather_kernel", 8, 12),
        # derived rows repeat kernels under HLO names; counting them would break every number
        x(GPU, 1000, "fusion_1", 100, 200),
        x(GPU, 1000, "copy-start", 0, 300),
        x(GPU, 1001, "CUPTI overhead", 0, 400),
    ]


@pytest.fixture
def gpu_logdir(tmp_path):
    write_trace(tmp_path / "logs" / "plugins" / "profile" / "2025_01_01_00_00_00" / "gpuhost.trace.json.gz",
                gpu_trace_events())
    return tmp_path / "logs"


# ------------------------------------------------------------------------------ intervals


def test_interval_union_merges_touching_nested_and_drops_empty():
    assert to.interval_union([(3, 4), (0, 1), (1, 2), (0.5, 1.5), (5, 5), (7, 6), (3.5, 3.75)]) == [(0, 2), (3, 4)]
    assert to.interval_union([]) == []


def test_interval_intersection_and_measure():
    a = to.interval_union([(0, 10), (20, 30)])
    b = to.interval_union([(5, 25), (29, 40), (50, 60)])
    inter = to.interval_intersection(a, b)
    assert inter == [(5, 10), (20, 25), (29, 30)]
    assert to.measure(inter) == 11
    assert to.interval_intersection(a, []) == []


# ------------------------------------------------------------------------------ loading


def test_load_events_names_and_file_choice(gpu_logdir):
    # an older run and a perfetto_trace.json.gz next to the newest: the newest *.trace.json.gz wins
    old = write_trace(gpu_logdir / "plugins" / "profile" / "2024_01_01_00_00_00" / "gpuhost.trace.json.gz",
                      [meta(GPU, "/device:GPU:0"), meta(GPU, "Stream #1", tid=1), x(GPU, 1, "old", 0, 1)])
    os.utime(old, (1_000_000, 1_000_000))
    newest = gpu_logdir / "plugins" / "profile" / "2025_01_01_00_00_00" / "gpuhost.trace.json.gz"
    write_trace(newest.parent / "perfetto_trace.json.gz", [])
    assert to.find_trace_file(gpu_logdir) == newest

    events, thread_names = to.load_events(gpu_logdir)
    assert thread_names[(GPU, 14)] == "Stream #14(MemcpyH2D,MemcpyD2H)"
    assert thread_names[(HOST, 100)] == "python"
    assert len(events) == len(gpu_trace_events()) - 10  # the 10 metadata events are not events
    ev = next(e for e in events if e.name == "MemcpyH2D" and e.pid == GPU)
    assert (ev.ts, ev.dur, ev.end) == (BASE + 5, 20.0, BASE + 25)
    assert (ev.process, ev.thread) == ("/device:GPU:0", "Stream #14(MemcpyH2D,MemcpyD2H)")
    # a file path is read directly, and a logdir without traces says what is missing
    assert len(to.load_events(newest)[0]) == len(events)
    (gpu_logdir.parent / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="create_perfetto_trace"):
        to.find_trace_file(gpu_logdir.parent / "empty")


# ------------------------------------------------------------------------------ report


def test_report_numbers_exact(gpu_logdir):
    events, _ = to.load_events(gpu_logdir)
    r = to.overlap_report(events)
    assert r["gpu_streams_found"] is True and r["note"] is None
    assert r["span_us"] == [BASE + 0, BASE + 70]
    assert r["active_us"] == 70
    assert r["compute_busy_us"] == 45
    assert r["transfer_busy_us"] == 40
    assert r["overlap_us"] == 20
    assert r["exposed_transfer_us"] == 20
    assert r["hidden_fraction"] == 0.5
    assert r["gpu_busy_us"] == 65
    assert r["gpu_idle_us"] == 5
    json.dumps(r)  # the report is JSON-ready


def test_classification_streams_and_names(gpu_logdir):
    events, _ = to.load_events(gpu_logdir)
    r = to.overlap_report(events)
    assert r["n_events"]["transfer"] == 3 and r["n_events"]["compute"] == 5
    # 4 host events + 3 on derived / overhead rows
    assert r["n_events"]["ignored"] == {"not_a_gpu_stream": 7}
    top_t = {t["name"]: (t["count"], t["total_us"]) for t in r["top_names"]["transfer"]}
    assert top_t == {"MemcpyH2D": (1, 20), "MemcpyD2H": (1, 20), "host_gather_kernel": (1, 4)}
    assert [t["name"] for t in r["top_names"]["compute"]] == ["outer", "fusion_1", "fusion_2", "gemm", "inner"]
    assert [s["thread"] for s in r["streams"]] == [
        "Stream #13(Compute)", "Stream #14(MemcpyH2D,MemcpyD2H)", "Stream #15(Compute)", "Stream #16(Compute)"]
    s13 = r["streams"][0]
    assert (s13["n_compute"], s13["compute_busy_us"], s13["n_transfer"]) == (4, 40, 0)
    stream_flags = {t["thread"]: t["gpu_stream"] for t in r["threads"]}
    assert stream_flags == {
        "python": False, "tf_Stream #99 executor": False, "XLA Ops": False, "CUPTI overhead": False,
        "Stream #13(Compute)": True, "Stream #14(MemcpyH2D,MemcpyD2H)": True,
        "Stream #15(Compute)": True, "Stream #16(Compute)": True}
    assert r["warnings"] == []


def test_custom_transfer_regex(gpu_logdir):
    # gemm becomes a transfer, host_gather_kernel compute:
    # C = [0,12) [20,30) [40,60) = 42; T = [5,35) [50,70) = 50; T ∩ C = [5,12) [20,30) [50,60) = 27
    events, _ = to.load_events(gpu_logdir)
    r = to.overlap_report(events, transfer_regex=r"^gemm$")
    assert (r["compute_busy_us"], r["transfer_busy_us"], r["overlap_us"]) == (42, 50, 27)
    assert r["hidden_fraction"] == 27 / 50
    # ignore_regex drops events altogether: no D2H -> T = [5,25) [8,12) = 20, T ∩ C = 10
    r = to.overlap_report(events, ignore_regex=r"D2H")
    assert (r["transfer_busy_us"], r["overlap_us"], r["hidden_fraction"]) == (20, 10, 0.5)
    assert r["n_events"]["ignored"]["ignore_regex"] == 1


def test_window_keeps_events_starting_inside(gpu_logdir):
    events, _ = to.load_events(gpu_logdir)
    # starts in [45, 55]: "inner" [45,50) and MemcpyD2H [50,70) (kept whole); "outer" starts at 40
    r = to.overlap_report(events, window=(BASE + 45, BASE + 55))
    assert r["n_events"]["compute"] == 1 and r["n_events"]["transfer"] == 1
    assert (r["compute_busy_us"], r["transfer_busy_us"], r["overlap_us"], r["hidden_fraction"]) == (5, 20, 0, 0.0)
    assert r["span_us"] == [BASE + 45, BASE + 70]
    assert r["config"]["window"] == (BASE + 45, BASE + 55)


def test_no_transfer_and_warnings(tmp_path):
    evs = [meta(GPU, "/device:GPU:0"), meta(GPU, "Stream #7", tid=7), x(GPU, 7, "fusion", 0, 10)]
    r = to.overlap_report(to.load_events(write_trace(tmp_path / "a.trace.json.gz", evs))[0])
    assert (r["transfer_busy_us"], r["overlap_us"], r["hidden_fraction"], r["compute_busy_us"]) == (0, 0, 0.0, 10)
    assert "no transfer events" in r["note"]

    # device-only copies and a second GPU are flagged; no kernel matched the transfer regex
    evs += [meta(GPU1, "/device:GPU:1"), meta(GPU1, "Stream #7", tid=7),
            x(GPU, 7, "MemcpyD2D", 10, 12), x(GPU1, 7, "MemcpyH2D", 0, 4)]
    r = to.overlap_report(to.load_events(write_trace(tmp_path / "b.trace.json.gz", evs))[0])
    assert r["transfer_busy_us"] == 6 and r["overlap_us"] == 4
    text = " ".join(r["warnings"])
    assert "MemcpyD2D" in text and "2 device processes" in text and "transfer-regex" in text
    r = to.overlap_report(to.load_events(tmp_path / "b.trace.json.gz")[0], device_regex=r"GPU:0$",
                          memcpy_regex=r"MemcpyH2D|MemcpyD2H")
    assert r["transfer_busy_us"] == 0 and r["compute_busy_us"] == 12


# ------------------------------------------------------------------------------ picture and CLI


def test_plot_timeline_writes_png(gpu_logdir, tmp_path):
    events, _ = to.load_events(gpu_logdir)
    r = to.overlap_report(events)
    out = to.plot_timeline(events, r, tmp_path / "pics" / "t.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = to.plot_timeline(events, r, tmp_path / "zoom.png", window_ms=0.03)
    assert out.stat().st_size > 1000


def test_plot_many_events(tmp_path):
    # thousands of events: one broken_barh per row and class keeps this quick
    evs = [meta(GPU, "/device:GPU:0")] + [meta(GPU, f"Stream #{s}", tid=s) for s in range(4)]
    for i in range(3000):
        s = i % 4
        evs.append(x(GPU, s, "MemcpyH2D" if s == 3 else f"fusion_{i % 7}", i * 3, i * 3 + 2 + s))
    events, _ = to.load_events(write_trace(tmp_path / "m.trace.json.gz", evs))
    r = to.overlap_report(events)
    assert r["n_events"]["transfer"] == 750 and 0 < r["hidden_fraction"] <= 1
    assert to.plot_timeline(events, r, tmp_path / "m.png").stat().st_size > 1000


def test_cli(gpu_logdir, tmp_path, capsys):
    png, js = tmp_path / "o.png", tmp_path / "o.json"
    assert to.main([str(gpu_logdir), "--png", str(png), "--json", str(js), "--window-ms", "0.05"]) == 0
    out = capsys.readouterr().out
    assert "hidden_fraction = 0.5000" in out and "host_gather_kernel" in out and "[x] /device:GPU:0" in out
    rep = json.loads(js.read_text())
    assert rep["hidden_fraction"] == 0.5 and rep["trace_file"].endswith("gpuhost.trace.json.gz")
    assert png.read_bytes()[:4] == b"\x89PNG"
    # window relative to the active span: [0.045, 0.055] ms == the window test above
    assert to.main([str(gpu_logdir), "--t0-ms", "0.045", "--t1-ms", "0.055", "--json", str(js)]) == 0
    rep = json.loads(js.read_text())
    assert (rep["compute_busy_us"], rep["transfer_busy_us"], rep["overlap_us"]) == (5, 20, 0)


# ------------------------------------------------------------------------------ a real (CPU) trace


def test_real_cpu_trace_has_no_gpu_streams(tmp_path, capsys):
    import jax
    import jax.numpy as jnp

    if jax.default_backend() != "cpu":
        pytest.skip("on a GPU machine the trace holds the GPU's streams (test_gpu_* read a recorded one)")
    f = jax.jit(lambda a: (a @ a).sum())
    a = jnp.ones((32, 32), jnp.float32)
    f(a).block_until_ready()  # compile outside the trace
    with jax.profiler.trace(str(tmp_path / "trace"), create_perfetto_trace=True):
        f(a).block_until_ready()

    events, thread_names = to.load_events(tmp_path / "trace")
    assert events and thread_names
    r = to.overlap_report(events)
    assert r["gpu_streams_found"] is False and "no GPU stream" in r["note"]
    assert (r["transfer_busy_us"], r["compute_busy_us"], r["hidden_fraction"]) == (0, 0, 0.0)
    assert r["threads"] and not any(t["gpu_stream"] for t in r["threads"])
    assert to.plot_timeline(events, r, tmp_path / "cpu.png").read_bytes()[:4] == b"\x89PNG"
    assert to.main([str(tmp_path / "trace"), "--json", str(tmp_path / "cpu.json")]) == 0
    assert "NOTE: no GPU stream" in capsys.readouterr().out


def test_host_time_by_name(gpu_logdir):
    events, _ = to.load_events(gpu_logdir)
    rows = to.host_time_by_name(events)
    # only the host process's events, per (thread, name), largest first; GPU streams never count
    assert rows[0] == {"thread": "python", "name": "PjitFunction(step)", "total_us": 1050.0, "count": 1}
    assert {(r["thread"], r["name"]) for r in rows} == {
        ("python", "PjitFunction(step)"), ("python", "cuMemcpyHtoDAsync"),
        ("tf_Stream #99 executor", "MemcpyH2D"), ("tf_Stream #99 executor", "fusion_9")}
    assert len(to.host_time_by_name(events, top=2)) == 2


def test_selection_overlap_counts_only_concurrent_selection_time():
    from benchmarks.trace_overlap import selection_overlap

    def ev(name, ts, dur, tid=1):
        return to.TraceEvent(name, ts, dur, 1, tid, "/device:GPU:0", f"stream {tid}")

    # attention 0-10 on one stream; the selection's scores 5-15 on another (5 µs hidden),
    # its top-k 20-22 alone (not hidden); an MLP gemm 30-40
    ks = [ev("sparse_decode_bk64", 0, 10), ev("quest_block_scores", 5, 10, tid=2),
          ev("topk_select_l0", 20, 2, tid=2), ev("gemm_fusion", 30, 10)]
    ov = selection_overlap(ks)
    assert ov["kernel_sum_us"] == 32 and ov["busy_us"] == 27
    assert ov["select_us"] == 12 and ov["select_hidden_us"] == 5
    serial = selection_overlap([ev("quest_block_scores", 0, 4), ev("gemm", 4, 4)])
    assert serial["select_hidden_us"] == 0 and serial["kernel_sum_us"] == serial["busy_us"]
