"""How ``sparse_decode_attention``'s time grows with the budget K, and with the layout of
the selection it gathers.

Run on the GPU (device tool):

    python -m benchmarks.sparse_scaling --out $OUT

Issue 18 asks for >= 2.6 TB/s at B=8, K=2048. The kernel benchmark showed a cliff from
K=1024 to K=2048, far more time for twice the bytes (docs/kernels.md, v5 and 'A timing
defect': it was the L2). This sweep separates the causes:

* K from 256 to 4096 at one batch and context. A fixed cost plus a bandwidth term
  (``t = a + bytes / rate``) fits a kernel that streams; a step between two K marks a
  change in the kernel's structure. The fit over the larger K's gives both terms.
* Three layouts of the same number of positions per (batch, KV head):
  ``random`` (uniform over the context, what ``benchmarks.kernels`` and ``tune`` time),
  ``sorted`` (the same, ascending), and ``blocks`` (AsyncTLS's shape: K positions drawn
  from the 8,192 tokens of 128 random 64-token blocks, ascending).
* Two tilings: the op's own choice (the tuned table's entry for the class, or the
  defaults) and a fixed one (``block_k=64``, default splits), so that the curve is one
  kernel's. (The v7 files also hold ``block_k=64, prefetch=2``, an index prefetch that
  lost at every K and was removed.)

Each timed call reads another of several selections (``timing.rotation_sets``): HBM
rates, not L2. Dense cuDNN decode is timed in the same run; its rate is the reference.
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.kernels import D, HKV, dense_cudnn, make_inputs
from benchmarks.timing import RESULTS_DIR, markdown_table, parse_list, rotation_sets, stamp, time_fn, write_final_results
from sparse_jax.ops.attention import sparse_decode_attention

LAYOUTS = ("random", "sorted", "blocks")
BLOCK, KB = 64, 128  # AsyncTLS: 128 blocks of 64 tokens are the candidates


def selection(key, layout: str, b: int, s: int, k: int) -> jax.Array:
    """``int32[B, Hkv, K]`` positions in ``[0, s)``, distinct within a row."""
    shape = (b, HKV)
    if layout in ("random", "sorted"):
        keys = jax.random.uniform(key, (*shape, s))
        pos = jax.lax.top_k(keys, k)[1]  # k distinct uniform positions
        return jnp.sort(pos, -1).astype(jnp.int32) if layout == "sorted" else pos.astype(jnp.int32)
    if layout == "blocks":
        kb, kt = jax.random.split(key)
        nb = s // BLOCK
        blocks = jax.lax.top_k(jax.random.uniform(kb, (*shape, nb)), min(KB, nb))[1]
        cand = (blocks[..., None] * BLOCK + jnp.arange(BLOCK)).reshape(*shape, -1)
        pick = jax.lax.top_k(jax.random.uniform(kt, cand.shape), min(k, cand.shape[-1]))[1]
        return jnp.sort(jnp.take_along_axis(cand, pick, -1), -1).astype(jnp.int32)
    raise ValueError(f"unknown layout {layout!r}; choose from {LAYOUTS}")


def fit_fixed_cost(points: list[tuple[float, float]]) -> dict | None:
    """Least squares ``ms = a + bytes * c`` over ``(bytes, ms)``: the fixed cost ``a`` (us)
    and the streaming rate ``1 / c`` (GB/s); None with fewer than two points."""
    if len(points) < 2:
        return None
    x, y = np.array(points, np.float64).T
    c, a = np.polyfit(x, y, 1)
    return {"fixed_us": float(a * 1e3), "rate_GBs": float(1.0 / c / 1e6) if c > 0 else float("inf")}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=131072)
    p.add_argument("--budgets", type=parse_list, default=[256, 512, 768, 1024, 1536, 2048, 3072, 4096])
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--fit-from", type=int, default=1024, help="fit the fixed cost over K >= this (default %(default)s)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    p.add_argument("--name", default="sparse_scaling")
    args = p.parse_args(argv)
    layouts = [x for x in args.layouts.split(",") if x]
    bad = sorted(set(layouts) - set(LAYOUTS))
    if bad:
        p.error(f"--layouts: unknown {bad}; choose from {list(LAYOUTS)}")
    if any(k < 1 or k > args.context for k in args.budgets):
        p.error(f"--budgets must lie in [1, {args.context}]")
    if jax.default_backend() != "gpu":
        raise SystemExit("benchmarks.sparse_scaling needs a GPU (run it through the device tool)")
    info = stamp()
    b, s = args.batch, args.context
    q, k, v = make_inputs(jax.random.key(0), b, s)
    kv_bytes = 2 * b * HKV * s * D * 2
    t = time_fn(jax.jit(dense_cudnn), (q, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)), runs=args.runs)
    cudnn_rate = kv_bytes / (t.best_ms * 1e-3)
    print(f"dense cuDNN B={b} S={s}: {t.best_ms:.4f} ms, {cudnn_rate / 1e9:.0f} GB/s", flush=True)
    rows = [{"K": "", "layout": "", "tiling": "dense cuDNN", "ms": t.best_ms, "GB/s": cudnn_rate / 1e9}]
    tilings = {"op default": {}, "block_k=64": {"block_k": 64}}
    for kk in args.budgets:
        counts = jnp.full((b, HKV), kk, jnp.int32)
        nbytes = 2 * b * HKV * kk * D * 2
        for layout in layouts:
            sets = [(q, k, v, selection(jax.random.key(kk * 64 + i), layout, b, s, kk), counts)
                    for i in range(rotation_sets(nbytes))]
            for tiling, knobs in tilings.items():
                fn = jax.jit(functools.partial(sparse_decode_attention, impl="pallas", **knobs))
                t = time_fn(fn, sets, runs=args.runs, rotate=len(sets) > 1)
                main_ms = max((ms for name, ms in t.kernels or [] if "sparse_decode" in name), default=float("nan"))
                row = {"K": kk, "layout": layout, "tiling": tiling, "ms": t.best_ms, "kernel_ms": main_ms,
                       "GB/s": nbytes / (t.best_ms * 1e-3) / 1e9, "bytes": nbytes, "kernels": t.kernels}
                row["frac_cudnn_bw"] = row["GB/s"] * 1e9 / cudnn_rate
                rows.append(row)
                print(f"  K={kk:5d} {layout:7s} {tiling:11s} {t.best_ms * 1e3:7.1f} us (kernel {main_ms * 1e3:6.1f}) "
                      f"{row['GB/s']:6.0f} GB/s  {row['frac_cudnn_bw']:.2f} of cuDNN", flush=True)
    fits = []
    for layout in layouts:
        for tiling in tilings:
            pts = [(r["bytes"], r["ms"]) for r in rows[1:]
                   if r["layout"] == layout and r["tiling"] == tiling and r["K"] >= args.fit_from]
            f = fit_fixed_cost(pts)
            if f:
                fits.append({"layout": layout, "tiling": tiling, **f})
    payload = {"stamp": info, "batch": b, "context": s, "cudnn_GBs": cudnn_rate / 1e9, "rows": rows, "fits": fits}
    write_final_results(args.name, payload, render, plot, args.out)


def render(payload: dict) -> str:
    info = payload["stamp"]
    return (f"# sparse_decode_attention: time against K and the selection's layout\n\n"
            f"{info['device']}, jax {info['jax']}, {info['date']}, commit {info['git_commit']}\n\n"
            f"Command: `{info['command']}`\n\nB={payload['batch']}, S={payload['context']}, Hq=32, Hkv=8, D=128, "
            f"bf16. CUPTI kernel time summed over the call (kernel_ms: the attention kernel alone, "
            f"without the split merge); each call reads another selection (HBM, not L2). Dense cuDNN reads "
            f"{payload['cudnn_GBs']:.0f} GB/s in the same run.\n\n"
            + markdown_table(payload["rows"], ["K", "layout", "tiling", "ms", "kernel_ms", "GB/s", "frac_cudnn_bw"],
                             {"ms": ".4f", "kernel_ms": ".4f", "GB/s": ".0f", "frac_cudnn_bw": ".2f"})
            + "\n## Fixed cost and streaming rate (least squares over the larger K)\n\n"
            + markdown_table(payload["fits"], ["layout", "tiling", "fixed_us", "rate_GBs"],
                             {"fixed_us": ".1f", "rate_GBs": ".0f"}))


def plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    # the tilings the file holds, in order (older files have a third)
    tilings = list(dict.fromkeys(r["tiling"] for r in payload["rows"][1:]))
    for layout, color in zip(LAYOUTS, ("C0", "C1", "C2")):
        for tiling, style in zip(tilings, ("o-", "s--", "^:", "d-.")):
            pts = sorted((r["K"], r["GB/s"]) for r in payload["rows"][1:]
                         if r["layout"] == layout and r["tiling"] == tiling)
            if pts:
                ax.plot(*zip(*pts), style, color=color, label=f"{layout}, {tiling}")
    ax.axhline(payload["cudnn_GBs"], color="k", lw=0.8, label="dense cuDNN")
    ax.axhline(0.85 * payload["cudnn_GBs"], color="r", lw=0.8, ls="--", label="target 0.85 of cuDNN")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("selected tokens K per (batch, KV head)")
    ax.set_ylabel("GB/s on the gathered K and V rows")
    ax.set_title(f"sparse_decode_attention, B={payload['batch']}, S={payload['context'] // 1024}K, D=128")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
