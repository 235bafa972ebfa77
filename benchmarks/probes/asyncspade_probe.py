"""How well AsyncSpade's predicted query stands in for the true next query, on real text.

    python -m benchmarks.probes.asyncspade_probe --model smollm2-135m --length 8192 --windows 1,4,16 --budgets 512,1024,2048

Teacher-forced: one dense pass over ``--length`` tokens of real text (the
fidelity benchmark's source text) captures every layer's post-RoPE queries and
keys; at ``--samples`` positions ``t`` per layer, the predictor
(:func:`sparse_jax.methods.asyncspade.predict_next_query`, window W) sees
``q_{t-W..t}`` and predicts ``q̂_{t+1}``. Reported per W (W=1 is AsyncTLS's
lag: ``q̂_{t+1} = q_t``), averaged over layers 2.. (the sparse ones) and
positions:

* ``cos``: cosine of ``q̂_{t+1}`` and ``q_{t+1}`` per query head;
* ``overlap@k``: ``|top_k(q̂) ∩ top_k(q)| / k`` of the exact group-summed
  attention probabilities over keys ``0..t+1`` (the paper's overlap ratio).

``--time`` instead times the predictor itself, one layer's call (no model):

    python -m benchmarks.probes.asyncspade_probe --time --out benchmarks/results

at ``B x Hq x W x D`` = ``--time-shapes`` (default ``4x32x16x128,1x32x16x128``,
Qwen3-8B's query heads), full histories: the ``W - 1`` LU solves (the
reference), the jnp Cholesky form and the Pallas kernel (per ``--warps``), CUPTI
medians (``benchmarks.timing.time_fn``) and each one's largest difference from
a float64 window-by-window oracle, relative to the history's largest entry.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import markdown_table, stamp, write_results


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--length", type=int, default=8192)
    p.add_argument("--windows", default="1,4,16")
    p.add_argument("--budgets", default="512,1024,2048")
    p.add_argument("--samples", type=int, default=64, help="positions per layer, spread over the second half")
    p.add_argument("--ridge", type=float, default=1e-2)
    p.add_argument("--first-layer", type=int, default=2)
    p.add_argument("--out", default=None)
    p.add_argument("--name", default=None)
    p.add_argument("--time", action="store_true", help="time the predictor (reference, cholesky-jnp, pallas)")
    p.add_argument("--time-shapes", default="4x32x16x128,1x32x16x128", help="BxHqxWxD,...")
    p.add_argument("--warps", default="1,2,4", help="the kernel's num_warps to time")
    p.add_argument("--runs", type=int, default=50)
    a = p.parse_args(argv)
    if a.time:
        return time_predictor(a)
    windows = [int(x) for x in a.windows.split(",")]
    budgets = [int(x) for x in a.budgets.split(",")]

    import models
    from benchmarks.fidelity import fidelity_text_ids
    from models.capture import capture_qk
    from sparse_jax.methods.asyncspade import predict_next_query
    from sparse_jax.ops.scoring import group_softmax_scores

    model = models.load_model(a.model, dtype=jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16)
    per_layer = capture_qk(model, fidelity_text_ids(model.tokenizer, a.length, 1))
    rng = np.random.default_rng(0)
    pos = np.sort(rng.choice(np.arange(a.length // 2, a.length - 1), size=a.samples, replace=False))
    wmax = max(windows)

    @jax.jit
    def overlap(q_hat, q_true, k, lengths):
        # k [1, Hkv, T, D] shared; q [N, Hq, D]: one row per sample position
        n = q_hat.shape[0]
        kk = jnp.broadcast_to(k, (n, *k.shape[1:]))
        return group_softmax_scores(q_hat, kk, lengths), group_softmax_scores(q_true, kk, lengths)

    stats = {w: {"cos": [], **{b: [] for b in budgets}} for w in windows}
    for layer, (q, k) in enumerate(per_layer):
        if layer < a.first_layer:
            continue
        q, k = q[0].astype(jnp.float32), k[0]  # [T, Hq, D], [T, Hkv, D]
        hist_idx = pos[:, None] - wmax + np.arange(wmax + 1)[None, :]  # [N, W+1]
        hist = q[np.clip(hist_idx, 0, None)].transpose(0, 2, 1, 3)  # [N, Hq, W+1, D]
        q_true = q[pos + 1]
        lengths = jnp.asarray(pos + 2, jnp.int32)
        kh = k.transpose(1, 0, 2)[None]
        for w in windows:
            count = jnp.asarray(np.minimum(pos + 1, w + 1), jnp.int32)
            q_hat = predict_next_query(hist[:, :, -(w + 1):], count, w, a.ridge)
            cos = jnp.sum(q_hat * q_true, -1) / (jnp.linalg.norm(q_hat, axis=-1) * jnp.linalg.norm(q_true, axis=-1))
            stats[w]["cos"].append(float(cos.mean()))
            ph, pt = overlap(q_hat, q_true, kh, lengths)
            for b in budgets:
                th = np.asarray(jax.lax.top_k(ph, b)[1])
                tt = np.asarray(jax.lax.top_k(pt, b)[1])
                ov = [len(np.intersect1d(x, y)) / b for x, y in zip(th.reshape(-1, b), tt.reshape(-1, b))]
                stats[w][b].append(float(np.mean(ov)))
    rows = []
    for w in windows:
        r = {"window": w, "cos": round(float(np.mean(stats[w]["cos"])), 4)}
        r.update({f"overlap@{b}": round(float(np.mean(stats[w][b])), 4) for b in budgets})
        rows.append(r)
        print(r, flush=True)
    md = (f"# AsyncSpade: predicted vs true next query ({a.model}, {a.length} tokens, layers {a.first_layer}.., "
          f"{a.samples} positions per layer)\n\n{stamp()}\n\nW=1 is the one-step lag (AsyncTLS).\n\n"
          + markdown_table(rows, ["window", "cos"] + [f"overlap@{b}" for b in budgets]))
    print(md)
    if a.out:
        write_results(a.name or f"asyncspade_probe_{a.model}", {"rows": rows, **stamp()}, md, out_dir=a.out)


def _oracle(hist, count, window, ridge):
    """The predictor window by window in float64 (``hist [N, W+1, D]``, ``count [N]``)."""
    out = []
    for h, c in zip(hist, count):
        q_t = h[-1]
        eps = ridge * max(q_t @ q_t, 1e-12)
        cands = [q_t]
        for k in range(2, window + 1):
            if c > k:
                x = h[-1 - k:-1]
                w = np.linalg.solve(x @ x.T + eps * np.eye(k), x @ q_t)
                w = np.exp(w - w.max())
                cands.append((w / w.sum()) @ h[-k:])
        out.append(np.mean(cands, axis=0))
    return np.stack(out)


def time_predictor(a):
    from benchmarks.timing import time_fn
    from sparse_jax.ops.prediction import predict_query

    rows = []
    for shape in a.time_shapes.split(","):
        b, hq, w, d = (int(x) for x in shape.split("x"))
        rng = np.random.default_rng(0)
        h = rng.normal(size=(b, hq, w + 1, d))
        for t in range(1, w + 1):  # temporally correlated, as real queries are
            h[:, :, t] = 0.8 * h[:, :, t - 1] + 0.6 * h[:, :, t]
        h = h.astype(np.float32)
        count = np.full((b,), w + 1, np.int32)
        want = _oracle(h.reshape(b * hq, w + 1, d).astype(np.float64), np.repeat(count, hq), w, a.ridge)
        hist, cnt = jnp.asarray(h), jnp.asarray(count)
        impls = [("reference (W-1 LU solves)", dict(impl="reference")),
                 ("cholesky-jnp", dict(impl="reference", reference="cholesky"))]
        impls += [(f"pallas num_warps={nw}", dict(impl="pallas", num_warps=nw)) for nw in map(int, a.warps.split(","))]
        for name, kw in impls:
            fn = jax.jit(lambda x, c, kw=kw: predict_query(x, c, window=w, ridge=a.ridge, **kw))
            got = np.asarray(fn(hist, cnt)).reshape(b * hq, d)
            err = float(np.abs(got - want).max() / np.abs(h).max())
            t = time_fn(fn, (hist, cnt), name=name, runs=a.runs)
            r = {"shape": shape, "impl": name, "device_us": None if t.device_ms is None else round(t.device_ms * 1e3, 1),
                 "wall_us": round(t.wall_ms * 1e3, 1), "launches": None if t.kernels is None else len(t.kernels),
                 "x36_layers_ms": round(t.best_ms * 36, 3), "err_vs_f64": float(f"{err:.3g}"),
                 "kernels": t.kernels}
            rows.append(r)
            print({k: v for k, v in r.items() if k != "kernels"}, flush=True)
    cols = ["shape", "impl", "device_us", "wall_us", "launches", "x36_layers_ms", "err_vs_f64"]
    md = (f"# AsyncSpade's query predictor, one layer's call (B x Hq x W x D, full histories)\n\n{stamp()}\n\n"
          "device_us: CUPTI median of the kernels' summed time; x36_layers_ms: per decode step of a 36-layer "
          "model (device time, else wall); err_vs_f64: max |q̂ - float64 oracle| / max |history|.\n\n"
          + markdown_table(rows, cols))
    print(md)
    if a.out:
        write_results(a.name or "asyncspade_predictor_time", {"rows": rows, **stamp()}, md, out_dir=a.out)
    return rows


if __name__ == "__main__":
    main()
