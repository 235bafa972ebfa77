"""How well AsyncSpade's predicted query stands in for the true next query, on real text.

    python -m benchmarks.asyncspade_probe --model smollm2-135m --length 8192 --windows 1,4,16 --budgets 512,1024,2048

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
    a = p.parse_args(argv)
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


if __name__ == "__main__":
    main()
