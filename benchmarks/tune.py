"""Sweep the kernels' tuning knobs on the GPU and print the best per shape.

    python -m benchmarks.tune --out $OUT

Checks every configuration against the reference before timing it (a fast
wrong kernel is not a result). The defaults in pallas_kernels/ are set from
this sweep's output (committed under benchmarks/results/tune.*).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import RESULTS_DIR, hbm_floor_ms, markdown_table, stamp, time_fn, write_results
from sparse_jax.ops.attention import block_sparse_decode_attention, sparse_decode_attention
from sparse_jax.ops.scoring import build_label_cache, label_scores, quest_block_scores
from sparse_jax.ops.selection import topk_indices

HQ, HKV, D = 32, 8, 128
DEADLINE = float("inf")


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def sweep(name, fn, args, ref, configs, nbytes, runs, rows, shape, tol=2e-2, exact=False):
    """``fn(*args, **cfg)`` for each cfg. The arrays are passed as arguments:
    closing over them would embed gigabytes of constants in the program."""
    best = None
    for cfg in configs:
        if time.time() > DEADLINE:
            print(f"  {name} {cfg}: skipped (time budget)", flush=True)
            continue
        try:
            f = jax.jit(functools.partial(fn, **cfg))
            out = f(*args)
            err = float(np.mean(np.sort(np.asarray(out), -1) != np.sort(np.asarray(ref), -1))) if exact else rel_err(out, ref)
            if err > tol:
                print(f"  {name} {cfg}: WRONG (err {err:.3g})", flush=True)
                rows.append({"kernel": name, "shape": shape, "config": json.dumps(cfg), "ms": float("nan"), "err": err})
                continue
            t = time_fn(f, args, runs=runs)
        except Exception as e:  # noqa: BLE001 - a config that fails to lower is a result too
            print(f"  {name} {cfg}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
            rows.append({"kernel": name, "shape": shape, "config": json.dumps(cfg), "ms": float("nan"), "err": -1.0})
            continue
        gbs = nbytes / (t.best_ms * 1e-3) / 1e9
        rows.append({"kernel": name, "shape": shape, "config": json.dumps(cfg), "ms": t.best_ms, "GB/s": gbs,
                     "x_floor": t.best_ms / hbm_floor_ms(nbytes), "err": err, "kernels": t.kernels})
        print(f"  {name} {shape} {cfg}: {t.best_ms:.4f} ms {gbs:.0f} GB/s err {err:.1e}  kernels: "
              + ", ".join(f"{n[:40]}={ms * 1e3:.1f}us" for n, ms in (t.kernels or [])), flush=True)
        if best is None or t.best_ms < best[1]:
            best = (cfg, t.best_ms)
    if best:
        print(f"BEST {name} {shape}: {best[0]} {best[1]:.4f} ms", flush=True)
    return best


def topk_candidates(n: int, k: int) -> list[dict]:
    """The radix-select kernel's knobs for one shape (``pallas_kernels.topk.topk_pallas``):
    warps x radix bits x early exit, and for long rows the chunking; only plans the
    kernel accepts (``plan_topk``)."""
    from pallas_kernels.topk import DEFAULT_MAX_SINGLE, plan_topk

    extra = [dict()]
    if n > DEFAULT_MAX_SINGLE:
        extra = [dict(), dict(chunk=8192), dict(chunk=16384), dict(max_single=8192)]
    elif n <= 4096:
        extra = [dict(), dict(block_rows=2)]
    out = []
    for nw, rb, ee in itertools.product((None, 4, 8, 16), (1, 2, 4), (True, False)):
        for ex in extra:
            cfg = {"num_warps": nw, "radix_bits": rb, "early_exit": ee, **ex}
            plan_args = {a: cfg[a] for a in ("max_single", "chunk", "block_rows", "num_warps") if a in cfg}
            if plan_topk(n, k, **plan_args) is not None:
                out.append(cfg)
    return out


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--only", default="", help="comma list: sparse,block,quest,labels,topk")
    p.add_argument("--budget-s", type=float, default=480, help="stop starting new configs after this long")
    args = p.parse_args(argv)
    if jax.default_backend() != "gpu":
        sys.exit("benchmarks.tune needs a GPU")
    global DEADLINE
    DEADLINE = time.time() + args.budget_s
    only = set(filter(None, args.only.split(",")))
    rows, best = [], {}
    key = jax.random.key(0)
    for b, s in ((8, 131072), (1, 32768)):
        kq, kk, kv = jax.random.split(jax.random.fold_in(key, b), 3)
        q = jax.random.normal(kq, (b, HQ, D), jnp.bfloat16)
        k = jax.random.normal(kk, (b, HKV, s, D), jnp.bfloat16)
        v = jax.random.normal(kv, (b, HKV, s, D), jnp.bfloat16)
        lengths = jnp.full((b,), s, jnp.int32)
        K = 2048
        shape = f"B={b} S={s} K={K}"
        idx = jax.random.randint(jax.random.key(1), (b, HKV, K), 0, s, jnp.int32)
        counts = jnp.full((b, HKV), K, jnp.int32)
        nbytes = 2 * b * HKV * K * D * 2
        if not only or "sparse" in only:
            ref = sparse_decode_attention(q, k, v, idx, counts, impl="reference")
            cfgs = [dict(block_k=bk, num_splits=ns, num_warps=nw, num_stages=st)
                    for bk, ns, nw, st in itertools.product((32, 64, 128), (None, 8, 16), (4,), (2,))] + [dict(block_k=64, num_warps=8), dict(block_k=64, num_stages=3)]
            best[("sparse", shape)] = sweep("sparse_decode_attention",
                                            lambda *a, **c: sparse_decode_attention(*a, impl="pallas", **c),
                                            (q, k, v, idx, counts), ref, cfgs, nbytes, args.runs, rows, shape)
        if not only or "block" in only:
            bidx = jax.random.randint(jax.random.key(2), (b, HKV, K // 64), 0, s // 64, jnp.int32)
            bc = jnp.full((b, HKV), K // 64, jnp.int32)
            ref = block_sparse_decode_attention(q, k, v, bidx, bc, lengths, block_size=64, impl="reference")
            cfgs = [dict(block_k=bk, num_splits=ns, num_warps=nw, num_stages=st)
                    for bk, ns, nw, st in itertools.product((64, 128), (None, 8, 16), (4,), (2,))] + [dict(block_k=64, num_warps=8)]
            best[("block", shape)] = sweep("block_sparse_decode_attention",
                                           lambda *a, **c: block_sparse_decode_attention(*a, block_size=64, impl="pallas", **c),
                                           (q, k, v, bidx, bc, lengths), ref, cfgs, nbytes, args.runs, rows, shape)
        if not only or "quest" in only:
            nb = s // 64
            kmax = jax.random.normal(jax.random.key(3), (b, HKV, nb, D), jnp.bfloat16)
            kmin = kmax - 1
            ref = quest_block_scores(q, kmax, kmin, impl="reference")
            cfgs = [dict(block_n=bn, num_warps=nw, num_stages=st) for bn, nw, st in itertools.product((64, 128, 256), (4,), (2,))]
            best[("quest", shape)] = sweep("quest_block_scores", lambda *a, **c: quest_block_scores(*a, impl="pallas", **c),
                                           (q, kmax, kmin), ref, cfgs, 2 * kmax.size * 2, args.runs, rows, shape, tol=1e-3)
        if not only or "labels" in only:
            channels = jnp.tile((jnp.arange(32, dtype=jnp.int32) * 3 % D)[None], (HKV, 1))
            labels = build_label_cache(k, channels)
            cand = jax.random.randint(jax.random.key(4), (b, HKV, 8192), 0, s, jnp.int32)
            cc = jnp.full((b, HKV), 8192, jnp.int32)
            ref = label_scores(q, labels, channels, cand, cc, impl="reference")
            # The looped kernel keeps block_c = 32 * num_warps; sweep the mode and register plan.
            cfgs = [dict(mode=m, hoist_q=hq, num_warps=nw)
                    for m, hq, nw in itertools.product(("logits", "two_pass"), (True, False), (4, 8))]
            best[("labels", shape)] = sweep("label_scores", lambda *a, **c: label_scores(*a, impl="pallas", **c),
                                            (q, labels, channels, cand, cc), ref, cfgs, b * HKV * 8192 * (16 + 8 + 4), args.runs, rows, shape, tol=1e-3)
    if not only or "topk" in only:
        for rows_, n, kk in ((64, 2048, 128), (64, 8192, 512), (64, 8192, 2048), (8, 8192, 2048), (64, 131072, 2048)):
            shape = f"{rows_}x{n} k={kk}"
            sc = jax.random.normal(jax.random.key(n + kk), (rows_, n), jnp.float32)
            ref = jax.lax.top_k(sc, kk)[1]
            cfgs = [dict()] + topk_candidates(n, kk)
            best[("topk", shape)] = sweep("topk_indices", lambda x, **c: topk_indices(x, kk, impl="pallas", **c), (sc,), ref, cfgs,
                                          sc.size * 4, args.runs, rows, shape, exact=True, tol=0.0)
            t = time_fn(jax.jit(lambda x: jax.lax.top_k(x, kk)[1]), (sc,), runs=args.runs)
            rows.append({"kernel": "lax.top_k", "shape": shape, "config": "{}", "ms": t.best_ms, "err": 0.0})
            print(f"  lax.top_k {shape}: {t.best_ms:.4f} ms", flush=True)
    info = stamp()
    payload = {"stamp": info, "rows": rows, "best": {f"{k[0]} {k[1]}": v for k, v in best.items()}}
    md = (f"# Kernel tuning sweep\n\n{info['device']}, jax {info['jax']}, {info['date']}\n\nCommand: `{info['command']}`\n\n"
          + markdown_table([r for r in rows if r["ms"] == r["ms"]], ["kernel", "shape", "config", "ms", "GB/s", "x_floor", "err"],
                           {"ms": ".4f", "GB/s": ".0f", "x_floor": ".2f", "err": ".1e"}))
    write_results("tune", payload, md, args.out)
    print("\n".join(f"BEST {k}: {v}" for k, v in payload["best"].items()))


if __name__ == "__main__":
    main()
