"""Chunked prefill's attention: one chunk of a long prompt over the keys so far.

``python -m benchmarks.probes.chunk_attention --tokens 98304 --chunk 32768`` times
:func:`sparse_jax.ops.dense.chunk_prefill_attention` for each chunk of a prompt
cut in ``--chunk`` tokens (the layer-segmented prefill of the serving engine, when one
layer of a prompt exceeds ``max_inject_tokens``), per backend (``--impls``), against
the whole prompt's causal attention in one cuDNN call (what an unchunked layer pays),
in the same run. Each chunk's output is checked against the rows of that whole call.
Backends: ``blockwise`` (the jnp loop), ``cudnn`` (split: the keys before the chunk and its
own, merged by log-sum-exp) and ``cudnn:padded`` (the chunk in a padded query array).

Reported per chunk: milliseconds (median), the attention's FLOP floor at the H100's
bf16 rate (``4 * B * Hq * D * C * (start + C / 2)``), and the largest difference from
the whole call. ``--tiny`` runs small shapes (CPU smoke test: "xla" stands in for cuDNN).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks.timing import H100_BF16_FLOPS, markdown_table, parse_list, stamp, time_fn, write_final_results


def chunk_flops(batch: int, heads: int, head_dim: int, start: int, chunk: int) -> float:
    """FLOPs of a chunk's causal attention (QK^T and PV, 2 each per score): only the
    scores it needs, ``C * start`` over the keys before it and ``C^2 / 2`` over its own."""
    return 4.0 * batch * heads * head_dim * chunk * (start + chunk / 2)


def run(args) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from sparse_jax.ops.dense import chunk_prefill_attention, dense_prefill_attention

    b, t, c, hq, hkv, d = args.batch, args.tokens, args.chunk, args.heads, args.kv_heads, args.head_dim
    dtype = jnp.dtype(args.dtype)
    kq, kk, kv = jax.random.split(jax.random.key(args.seed), 3)
    q = jax.random.normal(kq, (b, t, hq, d), dtype)
    k = jax.random.normal(kk, (b, t, hkv, d), dtype)
    v = jax.random.normal(kv, (b, t, hkv, d), dtype)
    whole_impl = "xla" if args.tiny else "cudnn"

    def whole_fn(q, k, v):
        if args.tiny:
            return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
        return dense_prefill_attention(q, k, v)

    whole = jax.jit(whole_fn)
    ref = np.asarray(whole(q, k, v).astype(jnp.float32))
    tw = time_fn(whole, (q, k, v), name="whole", warmup=2, runs=args.runs, cupti=False)
    whole_floor = chunk_flops(b, hq, d, 0, t) / H100_BF16_FLOPS * 1e3
    rows = [{"impl": f"whole ({whole_impl})", "start": 0, "chunk": t, "ms": round(tw.wall_ms, 3),
             "floor_ms": round(whole_floor, 3), "x_floor": round(tw.wall_ms / whole_floor, 2), "max_err": 0.0}]
    print(f"[chunk_attention] whole {t}: {tw.wall_ms:.2f} ms", file=sys.stderr, flush=True)
    for impl in args.impls:
        name, _, form = impl.partition(":")
        fn = jax.jit(lambda qc, k, v, s, name=name, split=form != "padded": chunk_prefill_attention(
            qc, k, v, s, implementation=name, split=split if name != "blockwise" else None))
        for start in range(0, t, c):
            size = min(c, t - start)
            if size != c:  # another chunk size is another program: time only whole chunks
                continue
            qc = q[:, start:start + size]
            s = jnp.int32(start)
            got = np.asarray(fn(qc, k, v, s).astype(jnp.float32))
            err = float(np.max(np.abs(got - ref[:, start:start + size])))
            # blockwise: fewer runs, seconds a call at 98K (docs/architecture.md, chunked prefill)
            runs = args.runs if impl != "blockwise" else max(2, args.runs // 5)
            tm = time_fn(fn, (qc, k, v, s), name=f"{impl}@{start}", warmup=1, runs=runs, cupti=False)
            floor = chunk_flops(b, hq, d, start, size) / H100_BF16_FLOPS * 1e3
            rows.append({"impl": impl, "start": start, "chunk": size, "ms": round(tm.wall_ms, 3),
                         "floor_ms": round(floor, 3), "x_floor": round(tm.wall_ms / floor, 2),
                         "max_err": round(err, 5)})
            print(f"[chunk_attention] {impl} start {start}: {tm.wall_ms:.2f} ms, max err {err:.4f}",
                  file=sys.stderr, flush=True)
    totals = {}
    for r in rows[1:]:
        totals[r["impl"]] = totals.get(r["impl"], 0.0) + r["ms"]
    return {"stamp": stamp(), "shape": {"batch": b, "tokens": t, "chunk": c, "heads": hq, "kv_heads": hkv,
                                        "head_dim": d, "dtype": str(dtype)},
            "rows": rows, "whole_ms": rows[0]["ms"], "chunked_total_ms": {k: round(x, 3) for k, x in totals.items()}}


def render(payload: dict) -> str:
    s, sh = payload["stamp"], payload["shape"]
    md = ["# Chunked prefill's attention: one chunk of a prompt over the keys so far", "",
          f"- device: {s['device']}, jax {s['jax']}, {s['date']}, commit {s['git_commit']}",
          f"- command: `{s['command']}`",
          f"- B={sh['batch']}, T={sh['tokens']} in chunks of {sh['chunk']}, {sh['heads']}/{sh['kv_heads']} heads, "
          f"D={sh['head_dim']}, {sh['dtype']}; ms = wall-clock median of jitted calls; floor = the chunk's causal "
          f"FLOPs at {H100_BF16_FLOPS / 1e12:.0f} TFLOP/s; max_err = largest difference from the whole prompt's "
          f"causal attention (the first row), same rows", "",
          markdown_table(payload["rows"], ["impl", "start", "chunk", "ms", "floor_ms", "x_floor", "max_err"]), "",
          "| impl | all chunks ms | x whole |", "| --- | --- | --- |"]
    md += [f"| {k} | {v:.2f} | {v / payload['whole_ms']:.2f} |" for k, v in payload["chunked_total_ms"].items()]
    return "\n".join(md + [""])


def plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = payload["rows"][1:]
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    starts = sorted({r["start"] for r in rows})
    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    w = 0.8 / max(1, len(impls))
    for j, impl in enumerate(impls):
        ms = [next((r["ms"] for r in rows if r["impl"] == impl and r["start"] == st), 0) for st in starts]
        ax.bar([i + j * w for i in range(len(starts))], ms, w, label=impl)
    floors = [next(r["floor_ms"] for r in rows if r["start"] == st) for st in starts]
    ax.plot([i + 0.4 - w / 2 for i in range(len(starts))], floors, "k_", ms=20, label="FLOP floor")
    ax.set_yscale("log")
    ax.set_xticks([i + 0.4 - w / 2 for i in range(len(starts))], [f"chunk at {st}" for st in starts])
    ax.set_ylabel("ms per chunk (log)")
    sh = payload["shape"]
    ax.set_title(f"chunked prefill attention, T={sh['tokens']}, C={sh['chunk']}; "
                 f"{payload['stamp'].get('device', '')}", fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.probes.chunk_attention", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=98304, help="prompt length T")
    p.add_argument("--chunk", type=int, default=32768, help="chunk length C")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--impls", default="blockwise,cudnn:padded,cudnn",
                   help="backends of chunk_prefill_attention, NAME or NAME:padded (cudnn, xla: the padded-query "
                        "form instead of the split one)")
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny", action="store_true", help="small shapes on CPU ('xla' for 'cudnn')")
    p.add_argument("--out", default=None)
    p.add_argument("--name", default="chunk_attention")
    args = p.parse_args(argv)
    from sparse_jax.ops.dense import CHUNK_ATTENTION_IMPLS

    args.impls = parse_list(args.impls, str)
    bad = [i for i in args.impls if i.partition(":")[0] not in CHUNK_ATTENTION_IMPLS
           or i.partition(":")[2] not in ("", "padded") or i == "blockwise:padded"]
    if bad:
        p.error(f"--impls: {bad}: each NAME or NAME:padded, NAME in {CHUNK_ATTENTION_IMPLS}")
    if args.tiny:
        args.tokens, args.chunk, args.heads, args.kv_heads, args.head_dim, args.dtype = 300, 128, 4, 2, 16, "float32"
        args.impls = [i.replace("cudnn", "xla") for i in args.impls]
        args.runs = 2
    if not 0 < args.chunk <= args.tokens:
        p.error(f"--chunk must be in [1, --tokens], got {args.chunk}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    write_final_results(args.name, run(args), render, plot, Path(args.out) if args.out else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
