"""Sparse prefill attention against cuDNN causal attention, one layer at a time.

``python -m benchmarks.prefill_bench --contexts 32768,65536,131072`` (on the GPU;
Qwen3-8B heads by default: 32 query / 8 KV heads, D=128, bf16, B=1) times:

* **dense**: ``dense_prefill_attention`` (cuDNN causal flash attention: the baseline);
* **tsa window scores**: Token Sparse Attention's step 1 (the last ``window``
  queries' softmax over the prompt, mean over the window), with the jnp reference
  (materialises ``[B, Hq, W, T]`` f32) and with the Pallas kernel
  (``pallas_kernels.window_scores``; cross-checked against the reference at the
  smallest context: max |difference|);
* **tsa scoring**: steps 1-4 (the scores, the pool, the count, each head's kept set),
  with either implementation of step 1;
* **tsa select / compressed order**: step 4's kept set by one value sort and a
  threshold (``kept_tokens``) against the two stable argsorts it replaced, and the
  compressed order (``compress_order``: cumulative sums and a scatter) against a stable
  argsort (the same results);
* **tsa attend @ f**: its step 5 (``compressed_causal_attention``: gather each head's
  kept tokens, cuDNN causal attention with the kept count as sequence length, scatter
  back) with a fraction ``f`` of the prefix kept per head (``--fractions``), chosen at
  random: random weights carry no attention structure, so the fraction TSA's tau
  keeps on real text has to come from a real model (``benchmarks.accuracy`` with
  ``prefill=token_sparse``), and the time is reported per fraction.

Each row: median ms (``benchmarks.timing.time_fn``: warm-up, synchronised runs),
the ratio to dense, and the compute floor: causal attention's ``2 * B * Hq * D * T^2``
FLOP (QK and PV, half the square) over the kept tokens, at the H100's bf16 dense peak
(989 TFLOP/s). The compressed output is cross-checked against the masked reference at
the smallest context (max |difference|).
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import markdown_table, stamp, time_fn, write_results

PEAK_FLOPS = {"H100": 989e12, "H200": 989e12}  # bf16 dense tensor-core peak (same SM count and clocks)


def peak_flops(device_kind: str) -> float | None:
    return next((v for k, v in PEAK_FLOPS.items() if k in device_kind), None)


def random_kept(key, b: int, hq: int, t: int, window: int, fraction: float) -> jax.Array:
    """``bool[B, Hq, T]``: per head a random ``fraction`` of the prefix ``[0, T - window)``
    (the same count in every head, as TSA's) and the whole window."""
    prefix = t - window
    keep = max(1, int(round(fraction * prefix)))
    u = jax.random.uniform(key, (b, hq, prefix))
    rank = jnp.argsort(jnp.argsort(u, axis=-1), axis=-1)
    return jnp.concatenate([rank < keep, jnp.ones((b, hq, window), bool)], axis=-1)


def attention_rows(*, b: int, t: int, hq: int, hkv: int, d: int, window: int, fractions, dtype, runs: int,
                   check: bool, log=print) -> list[dict]:
    from pallas_kernels.window_scores import unsupported_reason
    from sparse_jax import prefill as tsa
    from sparse_jax.methods.base import dense_prefill_attention

    kq, kk, kv, kr = jax.random.split(jax.random.PRNGKey(0), 4)
    q = jax.random.normal(kq, (b, t, hq, d), dtype)
    k = jax.random.normal(kk, (b, t, hkv, d), dtype)
    v = jax.random.normal(kv, (b, t, hkv, d), dtype)
    lengths = jnp.full((b,), t, jnp.int32)
    peak = peak_flops(jax.devices()[0].device_kind)

    def floor_ms(tokens):
        return None if peak is None else 2 * b * hq * d * tokens * tokens / peak * 1e3

    rows = []
    dense = time_fn(jax.jit(dense_prefill_attention), (q, k, v), runs=runs, cupti=False)
    rows.append(dict(context=t, part="dense (cuDNN causal)", kept=1.0, ms=dense.wall_ms, vs_dense=1.0,
                     floor_ms=floor_ms(t)))

    impls = ["reference"]
    why = unsupported_reason(d, dtype, dtype)
    if why is None:
        impls.append("pallas")
    else:
        log(f"  (no window-scores kernel rows: {why})")
    scores = {}
    for impl in impls:  # step 1 alone, then steps 1-4, per implementation of step 1
        def step1(q, k, lengths, impl=impl):
            return tsa.window_scores(q, k, lengths, window, impl=impl)

        def scoring(q, k, lengths, impl=impl):
            s = tsa.smooth(tsa.window_scores(q, k, lengths, window, impl=impl), 7)
            keep = tsa.keep_counts(s, lengths, tau=0.005, min_tokens=1024, window=window)
            return tsa.kept_tokens(s, keep, lengths, window)

        step1 = jax.jit(step1)
        ws = time_fn(step1, (q, k, lengths), runs=runs, cupti=False)
        row = dict(context=t, part=f"tsa window scores (step 1), {impl}", kept=None, ms=ws.wall_ms,
                   vs_dense=dense.wall_ms / ws.wall_ms, floor_ms=None)
        if check:  # the kernel against the reference (scores of a head sum to <= 1)
            scores[impl] = step1(q, k, lengths)
            if impl != "reference":
                row["max_abs_err"] = float(jnp.max(jnp.abs(scores[impl] - scores["reference"])))
        rows.append(row)
        sc = time_fn(jax.jit(scoring), (q, k, lengths), runs=runs, cupti=False)
        rows.append(dict(context=t, part=f"tsa scoring (steps 1-4), {impl}", kept=None, ms=sc.wall_ms,
                         vs_dense=dense.wall_ms / sc.wall_ms, floor_ms=None))
    # step 4 and the compressed order, each against the sorts they replaced (same results)
    sm = jax.jit(lambda q, k, n: tsa.smooth(tsa.window_scores(q, k, n, window, impl="reference"), 7))(q, k, lengths)
    keep = tsa.keep_counts(sm, lengths, tau=0.005, min_tokens=1024, window=window)
    kept_set = jax.jit(lambda s, n, c: tsa.kept_tokens(s, n, c, window))(sm, keep, lengths)
    for part, fn, args in (
            ("tsa select (step 4), one sort", lambda s, n, c: tsa.kept_tokens(s, n, c, window), (sm, keep, lengths)),
            ("tsa select (step 4), two argsorts", lambda s, n, c: tsa.kept_tokens_argsort(s, n, c, window),
             (sm, keep, lengths)),
            ("tsa compressed order, cumsum + scatter", tsa.compress_order, (kept_set,)),
            ("tsa compressed order, argsort", lambda m: jnp.argsort(~m, axis=-1, stable=True).astype(jnp.int32),
             (kept_set,))):
        r = time_fn(jax.jit(fn), args, runs=runs, cupti=False)
        rows.append(dict(context=t, part=part, kept=None, ms=r.wall_ms, vs_dense=dense.wall_ms / r.wall_ms,
                         floor_ms=None))
    attend = jax.jit(tsa.compressed_causal_attention)
    for f in fractions:
        kept = random_kept(kr, b, hq, t, window, f)
        n = int(kept[0, 0].sum())
        r = time_fn(attend, (q, k, v, kept), runs=runs, cupti=False)
        row = dict(context=t, part=f"tsa attend, {f:g} of the prefix", kept=n / t, ms=r.wall_ms,
                   vs_dense=dense.wall_ms / r.wall_ms, floor_ms=floor_ms(n))
        if check:
            want = tsa.masked_causal_attention(q, k, v, kept, 512)
            row["max_abs_err"] = float(jnp.max(jnp.abs(attend(q, k, v, kept).astype(jnp.float32)
                                                       - want.astype(jnp.float32))))
        rows.append(row)
    rows = [{key: val for key, val in row.items() if val is not None} for row in rows]  # blank cells, not "None"
    for row in rows:
        log(f"  {t:>7} {row['part']:<34} {row['ms']:9.3f} ms  x{row['vs_dense']:.2f} vs dense", flush=True)
    return rows


def render(payload) -> str:
    s = payload["stamp"]
    return (f"# Sparse prefill attention vs cuDNN causal (one layer)\n\n{s['device']}, jax {s['jax']}, {s['date']}, "
            f"commit {s.get('git_commit', '')}\n\n`{s['command']}`\n\n"
            f"B={payload['batch']}, {payload['heads']} heads, D={payload['head_dim']}, {payload['dtype']}; median ms "
            "of synchronised runs; vs_dense = dense ms / this ms (scoring: the same ratio, for scale); floor_ms: "
            "causal attention FLOP over the kept tokens at the bf16 peak; max_abs_err: the window-scores kernel "
            "against the reference (a head's scores sum to <= 1), the compressed attention against the masked one. "
            "Kept prefix tokens drawn at random "
            "(random weights have no attention structure; the fraction tau keeps on real text is measured "
            "separately).\n\n"
            + markdown_table(payload["rows"], ["context", "part", "kept", "ms", "vs_dense", "floor_ms", "max_abs_err"],
                             {"kept": ".3f", "ms": ".3f", "vs_dense": ".2f", "floor_ms": ".3f", "max_abs_err": ".2e"}))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(prog="python -m benchmarks.prefill_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default="32768,65536,131072")
    p.add_argument("--fractions", default="1.0,0.5,0.25,0.1", help="prefix fractions kept per head")
    p.add_argument("--heads", default="32,8", help="query,KV heads (default Qwen3-8B's 32,8)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--out", default=None)
    p.add_argument("--name", default="prefill_bench")
    a = p.parse_args(argv)
    try:
        contexts = [int(x) for x in a.contexts.split(",") if x]
        fractions = [float(x) for x in a.fractions.split(",") if x]
        hq, hkv = (int(x) for x in a.heads.split(","))
    except ValueError:
        p.error("--contexts and --fractions take comma-separated numbers, --heads two ints")
    if not contexts or min(contexts) <= a.window or not fractions or not all(0 < f <= 1 for f in fractions):
        p.error("contexts must exceed --window and fractions lie in (0, 1]")
    if hq % hkv or a.runs < 1 or a.batch < 1:
        p.error("query heads must be a multiple of KV heads; --runs and --batch >= 1")
    dtype = jnp.dtype(a.dtype)
    payload = {"stamp": stamp("python -m benchmarks.prefill_bench " + shlex.join(argv)), "batch": a.batch,
               "heads": f"{hq}/{hkv}", "head_dim": a.head_dim, "dtype": a.dtype, "rows": []}
    t0 = time.perf_counter()
    for i, t in enumerate(sorted(contexts)):
        payload["rows"] += attention_rows(b=a.batch, t=t, hq=hq, hkv=hkv, d=a.head_dim, window=a.window,
                                          fractions=fractions, dtype=dtype, runs=a.runs, check=i == 0)
        write_results(a.name, payload, render(payload), a.out)
    payload["wall_s"] = time.perf_counter() - t0
    write_results(a.name, payload, render(payload), a.out)
    print(render(payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
