"""Token Sparse Attention's coverage τ on real text: how many prompt tokens each τ
keeps, layer by layer, and what that saves.

    python -m benchmarks.tsa_sweep --model gemma3-270m --lengths 4096,8192 --taus 0.001,0.005,0.02,0.05

For each length, one dense forward pass over real text captures every layer's
post-RoPE queries and keys (:func:`models.capture.capture_qk`): prose (the demo
notes with one fact at half depth, ``--text prose``, the profile's haystack) or
standard-library Python source (``--text source``, the fidelity probe's text), one
row per ``--rows``. On each layer TSA runs on (the model's shipped drift profile,
global layers only), steps 1-3 of :mod:`sparse_jax.prefill` give the kept prefix
count for each τ (the same count in every head of a row): the table reports the
kept fraction of the prompt (kept prefix + the window over the length) averaged
over rows and TSA layers, its range over layers, and the causal attention work it
leaves, ``(kept / L)²`` of dense (the compressed sequence is kept long, causal).

``--time``: on each TSA layer, the layer's attention is also timed on the device for
each τ (median of ``--runs`` synchronised runs): the whole TSA step
(:func:`sparse_jax.prefill.token_sparse_attention`: scoring, selection, the compressed
attention at its length bucket) against the dense prefill attention (cuDNN on the GPU)
on the captured queries and keys (the keys stand in for the values: the time does not
depend on them); ``tsa_ms``/``dense_ms`` are sums over the TSA layers and ``speedup``
their ratio. This is the speed side of the τ trade-off on the model's own shapes
and attention.

What τ costs in accuracy is the accuracy harness's to measure, with the same
options: ``benchmarks.accuracy --methods dense,tsa=dense --set tsa.prefill=token_sparse
--set "tsa.prefill_options=[('tau', 0.02)]"``. Writes ``NAME.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import functools
import shlex
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import markdown_table, parse_list, stamp, write_final_results


def text_ids(tokenizer, kind: str, length: int, rows: int) -> np.ndarray:
    """``int32[rows, length]`` of real text: ``prose`` (the demo haystack; every row the
    same text, shifted by a paragraph's worth of tokens per row) or ``source``."""
    if kind == "source":
        from benchmarks.fidelity import fidelity_text_ids

        return np.asarray(fidelity_text_ids(tokenizer, length, rows), np.int32)
    from models.cli.prefill_profile import haystack_ids

    shift = 97
    ids = haystack_ids(tokenizer, length + shift * (rows - 1))
    if len(ids) < length + shift * (rows - 1):
        raise ValueError(f"the prose haystack has only {len(ids)} tokens; ask for a shorter length")
    return np.stack([np.asarray(ids[r * shift: r * shift + length], np.int32) for r in range(rows)])


def kept_fractions(q, k, lengths, taus, *, min_tokens: int, window: int, pool: int) -> np.ndarray:
    """``f64[len(taus), B]``: kept prompt fraction per τ and row on one layer
    (``q [B,T,Hq,D]``, ``k [B,T,Hkv,D]``)."""
    from sparse_jax import prefill as tsa

    scores = tsa.smooth(tsa.window_scores(q, k, lengths, window, impl="reference"), pool)
    out = []
    for tau in taus:
        keep = tsa.keep_counts(scores, lengths, tau=tau, min_tokens=min_tokens, window=window)
        kept = np.asarray(keep, np.float64) + np.minimum(np.asarray(lengths), window)
        out.append(kept / np.asarray(lengths, np.float64))
    return np.stack(out)


def layer_times(q, k, lengths, taus, *, min_tokens: int, window: int, pool: int, runs: int):
    """``(dense_ms, [tsa_ms per τ])`` of one layer: the dense prefill attention and the
    whole TSA step (module docstring) on ``q [B,T,Hq,D]``, ``k [B,T,Hkv,D]``."""
    from benchmarks.timing import time_fn
    from sparse_jax import prefill as tsa
    from sparse_jax.ops.dense import dense_prefill_attention

    dense = time_fn(jax.jit(dense_prefill_attention), (q, k, k), runs=runs, cupti=False).wall_ms
    out = []
    for tau in taus:
        fn = jax.jit(functools.partial(tsa.token_sparse_attention, tau=tau, min_tokens=min_tokens, window=window,
                                       pool=pool))
        out.append(time_fn(fn, (q, k, k, lengths), runs=runs, cupti=False).wall_ms)
    return dense, out


def sweep(model, tokenizer, *, lengths, taus, rows: int, text: str, time_runs: int = 0, log=print) -> dict:
    """The kept fractions on ``model``'s TSA layers (its method must have
    ``prefill="token_sparse"``) for each length and τ; with ``time_runs`` > 0 also the
    layers' dense and TSA attention times (:func:`layer_times`)."""
    from models.capture import capture_qk

    method = model.method
    opts = method.sparse_prefill()
    if opts is None:
        raise ValueError(f"tsa_sweep needs a model whose method has prefill='token_sparse', got {method!r}")
    nl = model.config.num_layers
    layers = [i for i in range(nl) if method.is_sparse_prefill_layer(i, nl)]
    results = []
    for length in lengths:
        t0 = time.perf_counter()
        ids = text_ids(tokenizer, text, length, rows)
        qk = capture_qk(model, ids)
        lens = jnp.full((rows,), length, jnp.int32)
        per_layer = {i: kept_fractions(qk[i][0], qk[i][1], lens, taus, min_tokens=opts.min_tokens,
                                       window=opts.window, pool=opts.pool) for i in layers}
        times = {i: layer_times(qk[i][0], qk[i][1], lens, taus, min_tokens=opts.min_tokens, window=opts.window,
                                pool=opts.pool, runs=time_runs) for i in layers} if time_runs else {}
        for j, tau in enumerate(taus):
            fr = np.array([per_layer[i][j].mean() for i in layers])
            row = {"length": length, "tau": tau, "kept": float(fr.mean()), "kept_min": float(fr.min()),
                   "kept_max": float(fr.max()), "attention_work": float(np.mean(fr ** 2)),
                   "per_layer": {str(i): float(f) for i, f in zip(layers, fr)}}
            if times:
                row["dense_ms"] = float(sum(times[i][0] for i in layers))
                row["tsa_ms"] = float(sum(times[i][1][j] for i in layers))
                row["speedup"] = row["dense_ms"] / row["tsa_ms"]
            results.append(row)
            log(f"[tsa_sweep] L={length} tau={tau:g}: kept {fr.mean():.3f} ({fr.min():.3f}-{fr.max():.3f}), "
                f"attention work {np.mean(fr ** 2):.3f} of dense"
                + (f", TSA {row['tsa_ms']:.2f} ms against dense {row['dense_ms']:.2f} ms" if times else ""))
        log(f"[tsa_sweep] L={length}: {time.perf_counter() - t0:.1f}s")
    return {"layers": layers, "options": {"min_tokens": opts.min_tokens, "window": opts.window, "pool": opts.pool},
            "rows": results}


def render(payload) -> str:
    st, s = payload["stamp"], payload["settings"]
    lines = [f"# Token Sparse Attention: kept tokens against τ ({s['model']}, {s['text']} text)", "",
             f"- device: {st.get('device')}, jax {st.get('jax')}, commit {st.get('git_commit') or '?'}",
             f"- date: {st.get('date')}", f"- command: `{st.get('command')}`",
             f"- TSA layers {payload['layers']} (the shipped drift profile), min_tokens "
             f"{payload['options']['min_tokens']}, window {payload['options']['window']}, pool "
             f"{payload['options']['pool']}; {s['rows']} rows of real text per length",
             "- `kept`: the kept prompt fraction (prefix kept + window) / length, mean over rows and TSA layers "
             "(range over layers); `attention_work`: mean of kept² (causal attention on the compressed "
             "sequence, against dense)", ""]
    cols = ["length", "tau", "kept", "kept_min", "kept_max", "attention_work"]
    fmt = {c: ".3f" for c in cols[2:]}
    if any("speedup" in r for r in payload["rows"]):
        lines.insert(-1, "- `dense_ms`, `tsa_ms`: the TSA layers' attention, summed (dense prefill attention; the whole "
                         "TSA step: scoring, selection, the compressed attention), median of synchronised runs; "
                         "`speedup` = dense / TSA")
        cols += ["dense_ms", "tsa_ms", "speedup"]
        fmt.update({"dense_ms": ".3f", "tsa_ms": ".3f", "speedup": ".2f"})
    lines.append(markdown_table(payload["rows"], cols, fmt))
    return "\n".join(lines) + "\n"


def plot(payload, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = any("speedup" in r for r in payload["rows"])
    fig, axes = plt.subplots(1, 2 if timed else 1, figsize=(11 if timed else 6, 4), squeeze=False)
    ax = axes[0][0]
    for length in sorted({r["length"] for r in payload["rows"]}):
        rs = [r for r in payload["rows"] if r["length"] == length]
        ax.errorbar([r["tau"] for r in rs], [r["kept"] for r in rs],
                    yerr=[[r["kept"] - r["kept_min"] for r in rs], [r["kept_max"] - r["kept"] for r in rs]],
                    marker="o", capsize=3, label=f"{length} tokens")
        if timed:
            axes[0][1].plot([r["tau"] for r in rs], [r.get("speedup", np.nan) for r in rs], marker="o",
                            label=f"{length} tokens")
    ax.set_xscale("log")
    ax.set_xlabel("coverage τ")
    ax.set_ylabel("kept fraction of the prompt")
    ax.set_title(f"TSA on {payload['settings']['model']} ({payload['settings']['text']})")
    ax.grid(alpha=0.3)
    ax.legend()
    if timed:
        ax = axes[0][1]
        ax.axhline(1.0, color="k", linewidth=1)
        ax.set_xscale("log")
        ax.set_xlabel("coverage τ")
        ax.set_ylabel("TSA layers' attention speed-up over dense")
        ax.set_title(f"on {payload['stamp'].get('device', '?')}")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.tsa_sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--lengths", type=parse_list, default=[4096])
    p.add_argument("--taus", type=functools.partial(parse_list, cast=float), default=[0.001, 0.005, 0.02, 0.05])
    p.add_argument("--rows", type=int, default=2, help="rows of text per length (default 2)")
    p.add_argument("--text", choices=["prose", "source"], default="prose")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--time", action="store_true", help="also time the TSA layers' attention against dense")
    p.add_argument("--runs", type=int, default=10, help="with --time: synchronised runs per timing")
    p.add_argument("--out", default=None)
    p.add_argument("--name", default=None)
    a = p.parse_args(argv)
    if not a.lengths or min(a.lengths) < 1:
        p.error(f"--lengths must be positive integers, got {a.lengths}")
    if not a.taus or not all(t >= 0 for t in a.taus):
        p.error(f"--taus must be non-negative numbers, got {a.taus}")
    if a.rows < 1 or a.runs < 1:
        p.error("--rows and --runs must be >= 1")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    import models

    t0 = time.perf_counter()
    model = models.load_model(a.model, dtype=getattr(jnp, a.dtype), max_len=max(a.lengths),
                              attention="dense", attention_options={"prefill": "token_sparse"})
    too_long = [n for n in a.lengths if n > model.config.max_position]
    if too_long:
        print(f"error: lengths {too_long} exceed {a.model}'s context of {model.config.max_position}", file=sys.stderr)
        return 2
    payload = {"settings": {"model": a.model, "lengths": a.lengths, "taus": a.taus, "rows": a.rows, "text": a.text,
                            "dtype": a.dtype}}
    payload.update(sweep(model, model.tokenizer, lengths=a.lengths, taus=a.taus, rows=a.rows, text=a.text,
                         time_runs=a.runs if a.time else 0))
    payload["stamp"] = stamp("python -m benchmarks.tsa_sweep " + " ".join(shlex.quote(x) for x in (argv or sys.argv[1:])))
    name = a.name or f"tsa_sweep_{a.model}_{a.text}"
    if a.out:
        write_final_results(name, payload, render, plot, a.out)
        print(f"[tsa_sweep] wrote {a.out}/{name}.json/.md/.png in {time.perf_counter() - t0:.0f}s")
    else:
        print(render(payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
