"""Probe: does host_gather read a pinned_host array in place, and how fast?

Run on the GPU machine (device tool), from the repository root:

    python -m benchmarks.probes.host_gather_probe                  # 1 GiB source, default sweep
    python -m benchmarks.probes.host_gather_probe --gib 2 --out $OUT

What it does:

1. Puts a ``--gib`` GiB array in ``pinned_host`` memory (prints the device's
   memories and the array's memory kind; exits with a diagnosis if the
   platform has no pinned_host memory).
2. Compiles ``host_gather`` for it and inspects the optimised HLO: is the
   Triton custom call's operand the pinned-host parameter itself (memory
   space S(5)), or did XLA put a copy / transfer of the whole source in front
   of it? A compile error is caught and printed with what it likely means.
3. For 4, 16 and 64 KiB blocks (f32 rows, plus a KV-shaped bf16 block
   ``[16 tokens, 8 heads, 64]`` = 16 KiB) and 2048 random block ids: checks
   the result is exact, then times
   * host_gather (pallas) for a small sweep of ``tile_bytes`` x ``num_warps``,
   * (i) bulk ``jax.device_put`` of the same number of bytes (one contiguous
     pinned array of M blocks -> device): the PCIe ceiling,
   * (ii) the reference path (``device_put`` of the whole source + take),
   and prints GB/s on the gathered bytes. Target: >= 45 GB/s at 16 KiB.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import markdown_table, stamp, time_fn, write_results
from sparse_jax.ops.transfer import host_gather

M = 2048


def wall_ms(fn, runs=20, warmup=3):
    for _ in range(warmup):
        jax.block_until_ready(fn())
    ts = []
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        ts.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(ts))


def place_pinned(x_np, dev):
    sh = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    return jax.device_put(x_np, sh)


def inspect_hlo(fn, src, ids):
    """(verdict, details) from the optimised HLO of ``fn(src, ids)``."""
    try:
        compiled = jax.jit(fn).lower(src, ids).compile()
    except Exception as e:  # noqa: BLE001 - this is the diagnosis
        return "COMPILE FAILED", f"{type(e).__name__}: {e}"
    txt = compiled.as_text() or ""
    lines = txt.splitlines()
    calls = [l for l in lines if "__gpu$xla.gpu.triton" in l and "custom-call(" in l]
    shape_s = "[" + ",".join(str(d) for d in src.shape) + "]"
    # an instruction that produces a copy of the whole source (result type
    # left of the opcode mentions the source's shape), or an explicit transfer
    big_copies = [
        l.strip()[:200]
        for l in lines
        if (m := re.search(r"=\s*(.*?)\s(copy|copy-start|copy-done|dynamic-update-slice)\(", l)) and shape_s in m.group(1)
    ] + [l.strip()[:200] for l in lines if "MoveToDevice" in l or "annotate_device_placement" in l]
    host_params = [l.strip()[:200] for l in lines if "parameter(" in l and shape_s in l]
    details = "\n".join(
        ["  triton custom call(s):"] + [f"    {c.strip()[:300]}" for c in calls]
        + ["  parameter 0:"] + [f"    {p}" for p in host_params]
        + (["  copies of the whole source (bad):"] + [f"    {c}" for c in big_copies] if big_copies else [])
    )
    if big_copies:
        return "XLA COPIES THE SOURCE FIRST", details
    if any("S(5)" in p for p in host_params):
        return "reads pinned_host in place (parameter in S(5), no copy)", details
    return "unclear (no S(5) annotation found; compare GB/s with the bulk copy)", details


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0, help="size of the pinned-host source")
    ap.add_argument("--out", default=None, help="directory for host_gather_probe.{json,md}")
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--quick", action="store_true", help="16 KiB only, default tuning only")
    args = ap.parse_args(argv)

    dev = jax.devices()[0]
    print(f"device: {dev.device_kind}  backend: {jax.default_backend()}  jax {jax.__version__}")
    try:
        mems = [m.kind for m in dev.addressable_memories()]
    except Exception as e:  # noqa: BLE001
        mems = [f"<addressable_memories failed: {e}>"]
    print(f"memories of {dev}: {mems}")
    if "pinned_host" not in mems:
        print("DIAGNOSIS: this backend exposes no pinned_host memory; host_gather cannot be probed here.")
        return 2

    rng = np.random.default_rng(0)
    total_bytes = int(args.gib * (1 << 30))
    rows, notes = [], []
    configs = [(16, "f32")] if args.quick else [(4, "f32"), (16, "f32"), (16, "kv_bf16"), (64, "f32")]
    sweep = [dict()] if args.quick else [
        dict(),
        dict(tile_bytes=4096),
        dict(tile_bytes=16384),
        dict(tile_bytes=32768, num_warps=8),
        dict(tile_bytes=8192, num_warps=8),
        dict(tile_bytes=2048, num_warps=2),
    ]
    for kib, kind in configs:
        block_bytes = kib << 10
        nb = total_bytes // block_bytes
        if kind == "kv_bf16":
            block_shape, dtype = (16, 8, 64), np.dtype(jnp.bfloat16)
        else:
            block_shape, dtype = (block_bytes // 4,), np.dtype(np.float32)
        assert int(np.prod(block_shape)) * dtype.itemsize == block_bytes
        label = f"{kib} KiB {kind} {block_shape}"
        print(f"\n=== {label}: source {nb} blocks = {nb * block_bytes / 2**30:.2f} GiB, gathering {M} ===")
        # random bits (as uint32) viewed as the dtype: exactness is bitwise
        src_np = rng.integers(0, 2**32, size=(nb, block_bytes // 4), dtype=np.uint32).view(dtype).reshape(nb, *block_shape)
        t0 = time.perf_counter()
        try:
            src = place_pinned(src_np, dev)
            jax.block_until_ready(src)
        except Exception as e:  # noqa: BLE001
            print(f"DIAGNOSIS: could not place {src_np.nbytes / 2**30:.2f} GiB in pinned_host: {type(e).__name__}: {e}")
            return 2
        print(f"placed in {src.sharding.memory_kind} in {time.perf_counter() - t0:.1f}s")
        ids_np = rng.integers(0, nb, size=M).astype(np.int32)
        ids = jnp.asarray(ids_np)
        gathered_bytes = M * block_bytes

        verdict, details = inspect_hlo(lambda s, i: host_gather(s, i, impl="pallas"), src, ids)
        print(f"HLO check: {verdict}\n{details}")
        notes.append(f"{label}: {verdict}")
        if verdict == "COMPILE FAILED":
            print(
                "DIAGNOSIS: the pallas_call was not accepted with a pinned_host operand. Likely causes: XLA refuses\n"
                "  a custom-call operand in host memory space on this version (look for 'memory space' in the\n"
                "  error), or the Triton lowering rejected the kernel. Workaround to measure: pass the source\n"
                "  as device memory (not the point), or report the error to the kernel author."
            )
            continue

        want = src_np[ids_np]
        try:
            out = host_gather(src, ids, impl="pallas")
            ok = bool(np.array_equal(np.asarray(out).view(np.uint8), want.view(np.uint8)))
            print(f"exact: {ok}; output memory kind: {out.sharding.memory_kind}")
        except Exception:  # noqa: BLE001
            print("DIAGNOSIS: host_gather failed at run time:")
            traceback.print_exc()
            continue
        if not ok:
            print("DIAGNOSIS: WRONG RESULT from the kernel; timings below are meaningless")

        for tuning in sweep:
            fn = jax.jit(lambda s, i, _t=tuple(sorted(tuning.items())): host_gather(s, i, impl="pallas", **dict(_t)))
            try:
                t = time_fn(fn, (src, ids), runs=args.runs, name=f"host_gather {tuning}")
            except Exception as e:  # noqa: BLE001
                print(f"  host_gather {tuning}: FAILED {type(e).__name__}: {str(e)[:300]}")
                continue
            gbs = gathered_bytes / (t.best_ms * 1e-3) / 1e9
            gbs_wall = gathered_bytes / (t.wall_ms * 1e-3) / 1e9
            print(f"  host_gather {str(tuning):<40s} {t.best_ms:8.3f} ms  {gbs:6.1f} GB/s  (wall {t.wall_ms:.3f} ms, {gbs_wall:.1f} GB/s)")
            rows.append(dict(block=label, path=f"host_gather {tuning}", ms=t.best_ms, wall_ms=t.wall_ms, gbps=gbs, exact=ok))

        # (i) bulk device_put of the same number of bytes: the PCIe ceiling
        bulk_np = np.ascontiguousarray(src_np[:M])
        bulk = place_pinned(bulk_np, dev)
        dsh = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
        ms = wall_ms(lambda: jax.device_put(bulk, dsh), runs=args.runs)
        gbs = gathered_bytes / (ms * 1e-3) / 1e9
        print(f"  (i) bulk device_put of {gathered_bytes / 2**20:.0f} MiB      {ms:8.3f} ms  {gbs:6.1f} GB/s (wall)")
        rows.append(dict(block=label, path="(i) bulk device_put, same bytes", ms=ms, wall_ms=ms, gbps=gbs, exact=True))
        bulk = None  # free the pinned copy before the next size

        # (ii) reference: whole source to device, then take
        try:
            ref_fn = jax.jit(lambda s, i: host_gather(s, i, impl="reference"))
            ref_out = ref_fn(src, ids)
            ref_ok = bool(np.array_equal(np.asarray(ref_out).view(np.uint8), want.view(np.uint8)))
            del ref_out
            ms = wall_ms(lambda: ref_fn(src, ids), runs=max(3, args.runs // 5), warmup=1)
            gbs = gathered_bytes / (ms * 1e-3) / 1e9
            print(f"  (ii) reference (full transfer + take)    {ms:8.3f} ms  {gbs:6.1f} GB/s on gathered bytes "
                  f"({nb * block_bytes / (ms * 1e-3) / 1e9:.1f} GB/s on the whole source), exact: {ref_ok}")
            rows.append(dict(block=label, path="(ii) reference", ms=ms, wall_ms=ms, gbps=gbs, exact=ref_ok))
        except Exception as e:  # noqa: BLE001
            print(f"  (ii) reference FAILED: {type(e).__name__}: {str(e)[:300]}")
        src = None

    md = "# host_gather probe\n\n" + "\n".join(f"- {n}" for n in notes) + "\n\n"
    md += markdown_table(rows, ["block", "path", "ms", "wall_ms", "gbps", "exact"], {"ms": ".3f", "wall_ms": ".3f", "gbps": ".1f"})
    print("\n" + md)
    if args.out:
        path = write_results("host_gather_probe", {"stamp": stamp(), "rows": rows, "notes": notes}, md, args.out)
        print(f"wrote {path}/host_gather_probe.{{json,md}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
