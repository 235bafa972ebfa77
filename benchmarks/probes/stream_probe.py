"""Probe: can the host->device block copy run on a second GPU stream, overlapped
with the MLP of the same jitted call? (Issue 5: hide the PCIe copy.)

Run on the GPU machine, from the repository root:

    python -m benchmarks.probes.stream_probe --out $OUT

One jitted call holds a Qwen3-8B-shaped MLP (``[B, 4096] @ [4096, 2x12288]``,
then ``@ [12288, 4096]``, bf16) and an independent ``host_gather_into`` of
``B * 8 * 2`` KV blocks (64 tokens x 128, K and V) from ``pinned_host``. For
each way of launching the copy it prints where XLA scheduled it (the entry
computation's order between the copy's start and its completion) and the
call's median time, next to the MLP alone and the copy alone: overlap shows as
``both < mlp + copy``.
"""

from __future__ import annotations

import argparse
import functools
import re
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.compute_on import compute_on

from benchmarks.timing import markdown_table, stamp, write_results
from pallas_kernels.host_gather import host_gather_into_pallas

BS, D, HID, FF = 64, 128, 4096, 12288


def _mlp(x, wg, wu, wd):
    h = jax.nn.silu(x @ wg) * (x @ wu)
    return h @ wd


def _gather(hk, hv, pk, pv, ids, slots, count, **tuning):
    return host_gather_into_pallas(hk, hv, pk, pv, ids, slots, count, **tuning)


def _gather_on_stream(stream, hk, hv, pk, pv, ids, slots, count):
    dev = jax.memory.Space.Device
    run = compute_on(_gather, compute_type=f"gpu_stream:{stream}", out_memory_spaces=(dev, dev))
    return run(hk, hv, pk, pv, ids, slots, count)


def _mlp_on_stream(stream, x, wg, wu, wd):
    dev = jax.memory.Space.Device
    return compute_on(_mlp, compute_type=f"gpu_stream:{stream}", out_memory_spaces=dev)(x, wg, wu, wd)


def variants():
    def serial(x, wg, wu, wd, hk, hv, pk, pv, ids, slots, count):
        pk, pv = _gather(hk, hv, pk, pv, ids, slots, count)
        return _mlp(x, wg, wu, wd), pk, pv

    def copy_stream(x, wg, wu, wd, hk, hv, pk, pv, ids, slots, count):
        pk, pv = _gather_on_stream(1, hk, hv, pk, pv, ids, slots, count)
        return _mlp(x, wg, wu, wd), pk, pv

    def mlp_stream(x, wg, wu, wd, hk, hv, pk, pv, ids, slots, count):
        pk, pv = _gather(hk, hv, pk, pv, ids, slots, count)
        return _mlp_on_stream(1, x, wg, wu, wd), pk, pv

    def mlp_only(x, wg, wu, wd, hk, hv, pk, pv, ids, slots, count):
        return _mlp(x, wg, wu, wd), pk, pv

    def copy_only(x, wg, wu, wd, hk, hv, pk, pv, ids, slots, count):
        pk, pv = _gather(hk, hv, pk, pv, ids, slots, count)
        return x, pk, pv

    out = {"serial": serial, "copy_stream": copy_stream, "mlp_stream": mlp_stream,
           "mlp_only": mlp_only, "copy_only": copy_only}
    for n, u in ((4, 2), (8, 2), (8, 4), (16, 2), (32, 2), (64, 2)):
        def serial_n(x, wg, wu, wd, hk, hv, pk, pv, ids, slots, count, n=n, u=u):
            pk, pv = _gather(hk, hv, pk, pv, ids, slots, count, programs=n, unroll=u)
            return _mlp(x, wg, wu, wd), pk, pv

        def copy_only_n(x, wg, wu, wd, hk, hv, pk, pv, ids, slots, count, n=n, u=u):
            pk, pv = _gather(hk, hv, pk, pv, ids, slots, count, programs=n, unroll=u)
            return x, pk, pv
        tag = f"p{n}" + ("" if u == 2 else f"u{u}")
        out[f"serial_{tag}"], out[f"copy_only_{tag}"] = serial_n, copy_only_n
    return out


FLAG_SETS = {
    "default": {},
    "lhs": {"xla_gpu_enable_latency_hiding_scheduler": True},
    "annot": {"xla_gpu_experimental_stream_annotation": True},
    "lhs+annot": {"xla_gpu_enable_latency_hiding_scheduler": True, "xla_gpu_experimental_stream_annotation": True},
    # a CUDA graph whose independent kernels are not serialised by barriers
    "concurrent": {"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"},
    "concurrent_min1": {"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT", "xla_gpu_graph_min_graph_size": 1},
}


def entry_schedule(text: str) -> list[str]:
    """Opcode-ish summary of the scheduled entry computation, in order."""
    body = text[text.index("\nENTRY"):]
    body = body[: body.index("\n}")]
    out = []
    for line in body.splitlines()[1:]:
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = .*?\b([a-z][\w\-]*)\(", line)
        if not m:
            continue
        name, op = m.groups()
        if op in ("parameter", "constant", "get-tuple-element", "tuple", "bitcast"):
            continue
        tag = ""
        if "custom_call_target=" in line:
            tag = re.search(r'custom_call_target="([^"]+)"', line).group(1)
        if 'calls=' in line and op == "fusion":
            tag = "fusion"
        out.append(f"{op}:{name}" + (f"[{tag}]" if tag else ""))
    return out


def timed(fn, args, runs: int, iters: int):
    """Median over ``runs`` of ``iters`` back-to-back calls (ms per call); the
    pool buffers are threaded through so donation works as in the model."""
    args = list(args)

    def one():
        y, args[6], args[7] = fn(*args)
        return y

    for _ in range(3):
        jax.block_until_ready(one())
    ts = []
    for _ in range(runs):
        jax.block_until_ready(args[6])
        t0 = time.perf_counter()
        for _ in range(iters):
            y = one()
        jax.block_until_ready((y, args[6], args[7]))
        ts.append((time.perf_counter() - t0) * 1e3 / iters)
    return statistics.median(ts)


def _trace_report(comp, args, logdir: Path):
    """Profile 5 calls; print each GPU stream's kernels of the last call and the overlap."""
    from benchmarks import trace_overlap as to
    args = list(args)
    for _ in range(2):
        y, args[6], args[7] = comp(*args)
    jax.block_until_ready((y, args[6]))
    with jax.profiler.trace(str(logdir), create_perfetto_trace=True):
        for _ in range(5):
            y, args[6], args[7] = comp(*args)
        jax.block_until_ready((y, args[6]))
    events, names = to.load_events(logdir)
    rep = to.overlap_report(events)
    print(f"   trace: transfer {rep.get('transfer_busy_us')} us, overlap {rep.get('overlap_us')} us, "
          f"hidden {rep.get('hidden_fraction')}; streams {rep.get('gpu_streams_found')}")
    dev_ev = [e for e in events if "Stream" in e.thread]
    dev_ev.sort(key=lambda e: e.ts)
    for e in dev_ev[-14:]:
        print(f"     {e.thread[:16]:16s} t={e.ts - dev_ev[-14].ts:8.1f} dur={e.dur:7.1f} {e.name[:60]}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=11)
    p.add_argument("--copies-per-row", type=int, default=2, help="blocks copied per (row, KV head)")
    p.add_argument("--n1", type=int, default=127, help="entries per (row, KV head) segment of the copy list")
    p.add_argument("--runs", type=int, default=15)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--flags", default="default", help=f"comma list of {', '.join(FLAG_SETS)}")
    p.add_argument("--variants", default="", help="comma list (default: all)")
    p.add_argument("--trace", action="store_true", help="with --out: profile the serial* variants, print the streams")
    p.add_argument("--out", default=None)
    p.add_argument("--name", default="stream_probe")
    p.add_argument("--from-json", default="", help="re-render a saved result (markdown and plot) into --out")
    a = p.parse_args(argv)
    if a.from_json:
        import json

        payload = json.loads(Path(a.from_json).read_text())
        write_results(a.name, payload, render(payload), out_dir=a.out)
        plot(payload, Path(a.out or "benchmarks/results") / f"{a.name}.png")
        return

    dev = jax.devices()[0]
    rng = np.random.default_rng(0)
    b = a.batch
    # the offloaded layer's copy list: one segment of n1 entries per (row, KV head),
    # the first `copies_per_row` live (the misses), the rest junk
    rows_, n1 = b * 8, a.n1
    m = rows_ * a.copies_per_row
    nb, ns = 16384, 8192
    pinned = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    hk_np = rng.standard_normal((nb, BS, D), np.float32).astype(jnp.bfloat16)
    hk = jax.device_put(hk_np, pinned)
    hv = jax.device_put(rng.standard_normal((nb, BS, D), np.float32).astype(jnp.bfloat16), pinned)
    ids_np = rng.integers(0, nb, (rows_, n1)).astype(np.int32)
    slots_np = rng.integers(0, ns, (rows_, n1)).astype(np.int32)
    live_ids = rng.choice(nb, m, replace=False).astype(np.int32).reshape(rows_, -1)
    live_slots = rng.choice(ns, m, replace=False).astype(np.int32).reshape(rows_, -1)
    ids_np[:, :a.copies_per_row], slots_np[:, :a.copies_per_row] = live_ids, live_slots
    ids, slots = jnp.asarray(ids_np.reshape(-1)), jnp.asarray(slots_np.reshape(-1))
    count = jnp.full((rows_,), a.copies_per_row, jnp.int32)
    x = jnp.asarray(rng.standard_normal((b, HID), np.float32), jnp.bfloat16)
    w = [jnp.asarray(rng.standard_normal(s, np.float32) * 0.02, jnp.bfloat16)
         for s in ((HID, FF), (HID, FF), (FF, HID))]
    copy_bytes = 2 * m * BS * D * 2
    mlp_bytes = sum(int(t.size) * 2 for t in w)
    print(f"B={b}: {rows_} segments of {n1}; copy {m} blocks x2 = {copy_bytes / 2**20:.1f} MiB; MLP weights {mlp_bytes / 2**20:.0f} MiB")

    def fresh_pools():  # the timed calls donate the pools: new ones for every use
        return tuple(jnp.asarray(rng.standard_normal((ns, BS, D), np.float32), jnp.bfloat16) for _ in range(2))

    rows = []
    ref = None
    for fname in a.flags.split(","):
        flags = FLAG_SETS[fname]
        for vname, f in variants().items():
            if fname != "default" and (vname.startswith(("mlp_only", "copy_only")) or vname == "mlp_stream"):
                continue
            if a.variants and vname not in a.variants.split(","):
                continue
            label = f"{vname}/{fname}"
            args = (x, *w, hk, hv, *fresh_pools(), ids, slots, count)
            try:
                jf = jax.jit(f, donate_argnums=(6, 7), compiler_options=flags or None)
                comp = jf.lower(*args).compile()
            except Exception as e:  # noqa: BLE001  (a probe: report and go on)
                print(f"{label}: compile failed: {type(e).__name__}: {str(e)[:300]}")
                rows.append({"variant": label, "ms": None, "note": "compile failed"})
                continue
            sched = entry_schedule(comp.as_text())
            starts = [i for i, s in enumerate(sched) if "-start" in s.split(":")[0]]
            dones = [i for i, s in enumerate(sched) if "-done" in s.split(":")[0]]
            between = sched[starts[0] + 1:dones[0]] if starts and dones else []
            print(f"\n== {label}: {len(sched)} ops; async start at {starts}, done at {dones}")
            print("   " + " | ".join(sched))
            # correctness: the copied slots hold the host blocks
            y, pk2, pv2 = comp(*args)
            ok = bool(np.array_equal(np.asarray(pk2[live_slots.reshape(-1)]), hk_np[live_ids.reshape(-1)])) if vname != "mlp_only" else True
            if not vname.startswith("copy_only"):
                ref = y if ref is None else ref
                ok &= bool(jnp.allclose(y.astype(jnp.float32), ref.astype(jnp.float32), atol=1e-2, rtol=1e-2))
            ms = timed(comp, (x, *w, hk, hv, *fresh_pools(), ids, slots, count), a.runs, a.iters)
            if a.out and vname.startswith("serial") and a.trace:
                _trace_report(comp, (x, *w, hk, hv, *fresh_pools(), ids, slots, count), Path(a.out) / f"trace_{label}")
            rows.append({"variant": label, "ms": round(ms, 4), "ops_between_start_done": len(between), "ok": ok})
            print(f"   {ms * 1e3:.1f} us per call, correct={ok}, ops between start/done={len(between)}")

    payload = {"stamp": stamp(), "batch": b, "copy_bytes": copy_bytes, "mlp_bytes": mlp_bytes, "rows": rows}
    md = render(payload)
    print(md)
    if a.out:
        write_results(a.name, payload, md, out_dir=a.out)
        plot(payload, Path(a.out) / f"{a.name}.png")


def _derive(payload):
    rows = payload["rows"]
    by = {r["variant"]: r["ms"] for r in rows}
    mlp, cp = by.get("mlp_only/default"), by.get("copy_only/default")
    if mlp and cp:
        for r in rows:
            if r["ms"] and not r["variant"].startswith(("mlp_only", "copy_only")):
                r["hidden_fraction"] = round((mlp + cp - r["ms"]) / cp, 3)
                r["vs_mlp_alone"] = round(r["ms"] / mlp, 3)
    return mlp, cp


def render(payload) -> str:
    st = payload["stamp"]
    mlp, cp = _derive(payload)
    lines = ["# Stream probe: the host copy beside the MLP in one jitted call", "",
             f"- device: {st.get('device')}, jax {st.get('jax')}, commit {st.get('git_commit')}"
             + (f" ({st['note']})" if st.get("note") else ""),
             f"- date: {st.get('date')}", f"- command: `{st.get('command')}`",
             f"- B={payload['batch']}: copy {payload['copy_bytes'] / 2**20:.1f} MiB (K+V blocks listed per (row, KV "
             f"head), 2 live of 127 per segment), MLP weights {payload.get('mlp_bytes', 0) / 2**20:.0f} MiB", ""]
    if mlp and cp:
        lines += [f"MLP alone {mlp * 1e3:.1f} us, copy alone {cp * 1e3:.1f} us "
                  f"({payload['copy_bytes'] / cp / 1e6:.1f} GB/s). `hidden_fraction` = (MLP + copy - both) / copy; "
                  "`pN[uK]` = the strided copy kernel with N programs, K entries in flight (default K=2 here); "
                  "`/concurrent` = XLA's concurrent CUDA-graph schedule.", ""]
    lines.append(markdown_table(payload["rows"], ["variant", "ms", "vs_mlp_alone", "hidden_fraction", "ok"]))
    return "\n".join(lines) + "\n"


def plot(payload, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in payload["rows"] if r.get("ms")]
    fig, ax = plt.subplots(figsize=(8, 0.3 * len(rows) + 1.2))
    names = [r["variant"] for r in rows]
    ax.barh(range(len(rows)), [1e3 * r["ms"] for r in rows],
            color=["tab:green" if "concurrent" in n else "tab:gray" for n in names])
    ax.set_yticks(range(len(rows)), names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("us per call (MLP + copy in one jit; green: concurrent CUDA graph)")
    ax.set_title(f"{payload['stamp'].get('device')}, B={payload['batch']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
