"""Kascade and AsyncSpade speed on the GPU (Qwen3-8B shape, random weights).

Three parts (run on the H100):

    python -m benchmarks.kascade_bench attention --shapes 1x32768,1x65536,1x131072,8x32768,8x65536,8x131072
    python -m benchmarks.kascade_bench e2e --context 32768 --batch 4 --layers 36 \\
        --methods dense,kascade,quest,asyncspade,asyncspade_w1 --profile

``attention``: per decode-attention layer type, against cuDNN dense decode
(``[B, S, H, D]`` layout, its preferred one) at the same (B, S): Kascade's
dense first anchor (exact attention + the anchor step), an anchor (the anchor
step + attention over its top-k), a reuse layer (``sparse_decode_attention``
over ``k = 10% S`` mapped indices), and the anchor step alone with the Pallas
kernel (``group_softmax_scores``) against the XLA reference. The stack
estimate is Qwen3-8B's: 36 layers, anchors [0, 2, 7, 14, 23] (1 dense anchor,
4 anchors, 31 reuse layers), so ``speedup = 36 dense / (dense-anchor + 4
anchor + 31 reuse)``; the paper reports 4.1x over FlashAttention-3 at 128K
(Llama-3.1-8B shape, 5 of 32 anchors).

``prefill``: ms per whole-model prefill of ``--context`` tokens (``dense`` against
``kascade_tiled``: Kascade's tiled prefill, composed path, chunked anchor selection
of ``--chunk-bytes``, ``kascade_tiled[A-B]`` on layers A..B only; ``tsa``: Token
Sparse Attention at tau = 0.005 on the second half of the layers, and ``tsa@F``
keeping a fixed fraction ``F`` of each prefix: random weights have no attention
structure for tau to find; ``kascade_tiled+tsa@F``: the two composed, TSA on its
layers, the tiled prefill on the others), for the Qwen3-8B or
Llama-3.1-8B shape (``--model``). ``floor_ms``: the FLOP the method must do
(:func:`prefill_flops`) at the bf16 peak, ``x_floor`` how far above it;
``temp_gib``: the compiled program's scratch memory; ``process_peak_gib``: the
process's peak so far (the earlier rows' included: run a method alone for its own)::

    python -m benchmarks.kascade_bench prefill --context 32768 --batch 1 --methods dense,kascade_tiled,tsa@0.5

``e2e``: ms per decode step (tokens/s) of whole models through the layer
driver (unrolled, one program per step, cache donated) with ``--context``
tokens per row, for methods given as ``name`` or the aliases
``kascade`` (anchors [0,2,7,14,23], identity head map), ``asyncspade``
(over quest), ``asyncspade_w1`` (window 1: the lag, no prediction) and
``quest``. ``--profile`` traces 4 steps and reports GPU busy time and the top
kernels (AsyncSpade: the next step's Quest scoring and top-k run beside the
attention, look for them in the trace: ``--trace-dir`` keeps it).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import markdown_table, stamp, time_fn, write_results

HQ, HKV, D = 32, 8, 128
DT = jnp.bfloat16
QWEN3_ANCHORS = (0, 2, 7, 14, 23)
PREFILL_MODELS = ("qwen3-8b", "llama-3.1-8b")


def _inputs(b, s, seed=0):
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
    return (jax.random.normal(kq, (b, HQ, D), DT), jax.random.normal(kk, (b, HKV, s, D), DT),
            jax.random.normal(kv, (b, HKV, s, D), DT))


def attention_rows(b: int, s: int, runs: int) -> list[dict]:
    from benchmarks.kernels import dense_cudnn
    from sparse_jax.methods.kascade import Kascade
    from sparse_jax.methods.base import single_layer
    from sparse_jax.kv import ResidentKV
    from sparse_jax.ops.attention import dense_decode_attention, sparse_decode_attention
    from sparse_jax.ops.scoring import group_softmax_scores

    q, k, v = _inputs(b, s)
    lengths = jnp.full((b,), s, jnp.int32)
    kb, vb = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    m = Kascade(anchors=QWEN3_ANCHORS)
    kk = m.carry_tokens(s)

    def anchor(q, k, v, lengths):
        sel, _, c = m.select(q, ResidentKV(k, v), lengths, None, None, single_layer(2, data={"role": np.int32(1)}))
        return sparse_decode_attention(q, k, v, sel.indices, sel.counts), c["indices"]

    def dense_anchor(q, k, v, lengths):
        idx, _ = m.exact_topk(q, ResidentKV(k, v), lengths)
        return dense_decode_attention(q, k, v, lengths), idx

    idx = jax.random.randint(jax.random.PRNGKey(1), (b, HKV, kk), 0, s, jnp.int32)
    counts = jnp.full((b, HKV), kk, jnp.int32)
    fns = {
        "cudnn_dense": (jax.jit(dense_cudnn), (q, kb, vb)),
        "kascade_dense_anchor": (jax.jit(dense_anchor), (q, k, v, lengths)),
        "kascade_anchor": (jax.jit(anchor), (q, k, v, lengths)),
        "kascade_reuse": (jax.jit(lambda q, k, v, i, c: sparse_decode_attention(q, k, v, i, c)), (q, k, v, idx, counts)),
        "anchor_step_pallas": (jax.jit(lambda q, k, l: group_softmax_scores(q, k, l, impl="pallas")), (q, k, lengths)),
        "anchor_step_xla": (jax.jit(lambda q, k, l: group_softmax_scores(q, k, l, impl="reference")), (q, k, lengths)),
    }
    # numerics first: the kernel against the reference
    a = np.asarray(fns["anchor_step_pallas"][0](q, k, lengths))
    r = np.asarray(fns["anchor_step_xla"][0](q, k, lengths))
    err = float(np.abs(a - r).max())
    times = {n: time_fn(f, args, name=n, runs=runs).best_ms for n, (f, args) in fns.items()}
    dense = times["cudnn_dense"]
    stack = times["kascade_dense_anchor"] + 4 * times["kascade_anchor"] + 31 * times["kascade_reuse"]
    rows = []
    for n, t in times.items():
        rows.append({"B": b, "S": s, "op": n, "ms": round(t, 4), "x_dense": round(t / dense, 3)})
    rows.append({"B": b, "S": s, "op": "qwen3_stack_36_layers", "ms": round(stack, 4),
                 "x_dense": round(stack / (36 * dense), 3), "speedup": round(36 * dense / stack, 2),
                 "anchor_kernel_max_err": err, "k": kk})
    return rows


def method_for(name: str, cfg):
    from benchmarks.offload import asynctls_for
    from sparse_jax.methods import get_method

    if name == "kascade":
        return get_method("kascade", anchors=QWEN3_ANCHORS if cfg.num_layers == 36 else None)
    if name == "kascade_asynctls":
        tls = asynctls_for(cfg, budget=2048, kb=128)
        return get_method("kascade", anchors=QWEN3_ANCHORS, anchor_selector="asynctls", budget=2048,
                          dense_layers=(0,), anchor_options=(("channels_per_layer", tls.channels_per_layer),))
    if name == "asyncspade":
        return get_method("asyncspade", selector="quest", budget=2048, dense_steps=0)
    # the steady state (dense_steps=0): the first `window` steps of a request attend every key
    if name == "asyncspade_tok":  # the paper's token-level selection (issue 51)
        return get_method("asyncspade", selector="oracle_topk", budget=2048, dense_steps=0)
    if name == "asyncspade_warm":  # θ_t = window dense steps, timed past them (e2e_rows): the steady program
        return get_method("asyncspade", selector="quest", budget=2048, dense_steps=16)
    if name in ("asyncspade_tls_warm", "asyncspade_tls7_warm"):  # issue 51: AsyncTLS's label selector under
        # the prediction, past θ_t; tls7: layer 7 dense too (SmolLM2's default since 2026-12-06: one more
        # dense layer, the cost measured here on this shape)
        tls = asynctls_for(cfg, budget=2048, kb=128)
        return get_method("asyncspade", selector="asynctls", budget=2048, dense_steps=16,
                          dense_layers=(0, 1, 7) if name == "asyncspade_tls7_warm" else (0, 1),
                          selector_options=(("kb", 128), ("channels_per_layer", tls.channels_per_layer)))
    if name == "kascade_plus2":  # issue 51: two anchors more (SmolLM2 went from 6 to 8), their cost on this shape
        return get_method("kascade", anchors=tuple(sorted((*QWEN3_ANCHORS, 18, 28))))
    if name == "kascade_shared":  # issue 51: the paper's shared top-k across heads
        return get_method("kascade", anchors=QWEN3_ANCHORS if cfg.num_layers == 36 else None, shared_topk=True)
    if name == "asyncspade_w1":
        return get_method("asyncspade", selector="quest", budget=2048, window=1, dense_steps=0)
    if name == "quest":
        return get_method("quest", budget=2048)
    if name == "asynctls":
        return asynctls_for(cfg, budget=2048, kb=128)
    return get_method(name)


def e2e_rows(a) -> list[dict]:
    from benchmarks.timing import time_steps
    from benchmarks.trace_overlap import kernel_profile
    from benchmarks.offload import qwen3_8b, random_model
    from models import transformer as tfm
    from models import programs
    from models.driver import init_cache

    cap = a.context + 256
    cfg = dataclasses.replace(qwen3_8b(cap), num_layers=a.layers)
    rows = []
    for name in a.methods.split(","):
        method = method_for(name, cfg).for_model(cfg.name, num_layers=cfg.num_layers, head_dim=cfg.head_dim)
        model = random_model(cfg, method, cap)
        fns = programs.build_functions(model.graphdef, cfg, method, True)
        # rows past any warm-up (asyncspade_warm's counts are set so below): the program a caller
        # that counts steps runs then (ModelFunctions.decode_at; the engines alike)
        past = getattr(method, "window", 0) + 1
        step = lambda t, c, f=fns.decode_at(past): f(model.params, t, c)  # noqa: E731
        tokens = jnp.zeros((a.batch,), jnp.int32)
        cache = init_cache(cfg, method, a.batch, cap, jnp.bfloat16)
        if name.startswith("asyncspade"):  # the query history exists after a prefill: a short one fills it
            prompt = jnp.zeros((a.batch, 256), jnp.int32)
            _, cache = fns.prefill(model.params, prompt, jnp.full((a.batch,), 256, jnp.int32), cache)
        if name.endswith("_warm"):  # every row past its dense steps: the steady program's time
            cache = dataclasses.replace(cache, layers=tuple(
                dataclasses.replace(e, state=dict(e.state, count=jnp.full_like(e.state["count"], past)))
                if isinstance(getattr(e, "state", None), dict) and "count" in e.state else e for e in cache.layers))
        cache = dataclasses.replace(cache, lengths=jnp.full((a.batch,), a.context, jnp.int32))
        t0 = time.perf_counter()
        ms, cache = time_steps(step, cache, tokens, a.steps, a.rounds)
        row = {"method": name, "batch": a.batch, "context": a.context, "layers": cfg.num_layers, "step_ms": round(ms, 3),
               "tokens_per_s": round(a.batch * 1e3 / ms, 1), "wall_s": round(time.perf_counter() - t0, 1)}
        if a.profile:
            prof, cache = kernel_profile(step, cache, tokens, 4, f"{a.trace_dir}/{name}")
            row.update(prof)
        rows.append(row)
        print(row, flush=True)
        del cache
    return rows


def prefill_flops(cfg, method, batch: int, context: int) -> dict | None:
    """The FLOP a whole-model prefill of ``context`` tokens per row must do, by part:
    ``linear`` (the projections and MLP of every token, and the LM head of each row's
    last one), ``attention`` (QK and PV over the (query, key) pairs the method attends),
    and ``selection`` (one QK pass over the causal pairs where a method scores keys:
    Kascade's anchors; TSA's observation window). Its time at the bf16 peak is the
    ``floor_ms`` column: a lower bound no implementation can beat. Layer by layer: a TSA
    layer attends its kept tokens, a tiled Kascade layer its tiles' selections and
    diagonal tiles, any other (the dense first anchor, layers outside
    ``tiled_prefill_layers``) every causal pair; every Kascade anchor selects, on a TSA
    layer too. None for TSA at a ``tau`` (how many tokens it keeps depends on the data)."""
    from sparse_jax.methods.kascade import prefill as kp

    s, hq, d, nl = context, cfg.num_heads, cfg.head_dim, cfg.num_layers
    causal = s * (s + 1) / 2
    per_token = 2 * (cfg.hidden_size * (hq + 2 * cfg.num_kv_heads) * d + hq * d * cfg.hidden_size
                     + 3 * cfg.hidden_size * cfg.intermediate_size)
    linear = batch * (nl * per_token * s + 2 * cfg.hidden_size * cfg.vocab_size)
    qk_pv = 4 * batch * hq * d  # per attended (query, key) pair of every head
    pairs = [causal] * nl  # attended (query, key) pairs per layer
    selection = 0.0
    if getattr(method, "tiled_prefill", False):
        args = method._prefill_args()
        counts = np.asarray(kp.tile_counts(jnp.array([s]), s, args["tile"], budget=args["budget"],
                                           fraction=args["fraction"], min_keys=args["min_keys"]))[0]
        t = args["tile"]
        diag = kp.num_tiles(s, t) * t * (t + 1) / 2  # each tile's own causal square
        tiled = float(t * counts.sum() + diag)
        dense_first = method.anchors[0] if method.dense_first_anchor and method.anchors else None
        for i in range(nl):
            if (method.tiled_prefill_layers is None or i in method.tiled_prefill_layers) and i != dense_first:
                pairs[i] = tiled
        selection += len(method.anchors) * qk_pv / 2 * causal
    tsa = method.sparse_prefill()
    if tsa is not None:
        if tsa.keep_fraction is None:
            return None  # tau's count depends on the data: no floor without it
        from sparse_jax.prefill import fixed_keep_counts

        keep = int(fixed_keep_counts(jnp.array([s]), tsa.keep_fraction, min_tokens=tsa.min_tokens,
                                     window=tsa.window)[0])
        m = keep + tsa.window
        for i in range(nl):
            if method.is_sparse_prefill_layer(i, nl):
                pairs[i] = m * (m + 1) / 2
                selection += qk_pv / 2 * tsa.window * s
    return dict(linear=linear, attention=qk_pv * sum(pairs), selection=selection)


def floor_cells(flops: dict | None, peak: float | None, ms: float) -> dict:
    """A prefill row's floor columns from :func:`prefill_flops` at ``peak`` FLOP/s:
    ``floor_ms``, ``x_floor`` (``ms`` over it), ``attn_tflop``, ``linear_tflop``; none
    without a floor."""
    if flops is None or peak is None:
        return {}
    floor = sum(flops.values()) / peak * 1e3
    return {"floor_ms": round(floor, 1), "x_floor": round(ms / floor, 2),
            "attn_tflop": round(flops["attention"] / 1e12, 1), "linear_tflop": round(flops["linear"] / 1e12, 1)}


def prefill_model(model: str, context: int, layers: int | None = None):
    """The ``--model`` shape's config at ``context`` tokens, and its Kascade anchors:
    Qwen3-8B's as in the decode benchmarks; elsewhere Kascade's fallback (5 spread)."""
    from benchmarks.offload import qwen3_8b
    from models.config import get_config

    base = qwen3_8b(context) if model == "qwen3-8b" else dataclasses.replace(get_config(model), max_position=context)
    cfg = dataclasses.replace(base, num_layers=layers or base.num_layers)
    anchors = QWEN3_ANCHORS if (model == "qwen3-8b" and cfg.num_layers == 36) else None
    return cfg, anchors


def prefill_method(name: str, *, anchors=None, chunk_bytes: int = 2 << 30):
    """A ``prefill`` row's method by name (module docstring): ``dense``,
    ``kascade_tiled`` or ``kascade_tiled[A-B]`` (the tiled prefill on layers A..B only),
    each optionally ``+tsa`` or ``+tsa@F`` (Token Sparse Attention on the second half of
    the layers, at tau = 0.005 or keeping a fraction F); ``tsa`` / ``tsa@F`` alone mean
    ``dense+tsa``. SystemExit on a bad name."""
    from sparse_jax.methods import get_method

    bad = SystemExit(f"unknown prefill method {name!r}: dense, kascade_tiled or kascade_tiled[A-B], "
                     f"each optionally +tsa or +tsa@F; tsa, tsa@F")
    base, plus, tsa = name.partition("+")
    if not plus and base.startswith("tsa"):
        base, tsa = "dense", base
    opts: dict = {}
    if tsa:
        head, at, frac = tsa.partition("@")
        if head != "tsa":
            raise bad
        opts["prefill"] = "token_sparse"
        if at:
            try:
                opts["prefill_options"] = (("keep_fraction", float(frac)),)
            except ValueError:
                raise bad from None
    elif plus:
        raise bad
    if base == "dense":
        return get_method("dense", **opts)
    if base == "kascade_tiled" or (base.startswith("kascade_tiled[") and base.endswith("]")):
        if base != "kascade_tiled":
            lo, dash, hi = base[len("kascade_tiled["):-1].partition("-")
            try:
                opts["tiled_prefill_layers"] = tuple(range(int(lo), int(hi or lo) + 1))
            except ValueError:
                raise bad from None
        return get_method("kascade", anchors=anchors, tiled_prefill=True, prefill_chunk_bytes=chunk_bytes, **opts)
    raise bad


def prefill_rows(a) -> list[dict]:
    """Whole-model prefill of ``--context`` tokens per row (``prefill`` part): ms per
    prefill through the layer driver (unrolled), and the device's peak memory."""
    from benchmarks.offload import random_model
    from benchmarks.prefill_bench import peak_flops
    from models import transformer as tfm
    from models import programs
    from models.driver import init_cache

    cap = a.context
    cfg, anchors = prefill_model(a.model, cap, a.layers)

    make = functools.partial(prefill_method, anchors=anchors, chunk_bytes=a.chunk_bytes)

    names = a.methods.split(",")
    for name in names:
        make(name)  # a bad name fails before any device work
    peak = peak_flops(jax.devices()[0].device_kind)
    rows = []
    for name in names:
        method = make(name).for_model(cfg.name, num_layers=cfg.num_layers, head_dim=cfg.head_dim)
        model = random_model(cfg, method, cap)
        fns = programs.build_functions(model.graphdef, cfg, method, True)
        prompt = jax.random.randint(jax.random.PRNGKey(0), (a.batch, a.context), 0, cfg.vocab_size, jnp.int32)
        lengths = jnp.full((a.batch,), a.context, jnp.int32)
        cache = init_cache(cfg, method, a.batch, cap, jnp.bfloat16)
        t0 = time.perf_counter()
        # compiled ahead: its memory analysis is this method's own (the device's peak is
        # the process's, the earlier rows' included)
        prefill = fns.prefill.lower(model.params, prompt, lengths, cache).compile()
        mem = prefill.memory_analysis()
        temp = getattr(mem, "temp_size_in_bytes", None)
        times = []
        for i in range(a.warmup + a.runs):
            t1 = time.perf_counter()
            logits, cache = prefill(model.params, prompt, lengths, cache)  # the cache is donated, refilled
            jax.block_until_ready(logits)
            if i >= a.warmup:
                times.append((time.perf_counter() - t1) * 1e3)
        stats = jax.devices()[0].memory_stats() or {}
        ms = float(np.median(times))
        row = {"model": a.model, "method": name, "batch": a.batch, "context": a.context, "layers": cfg.num_layers,
               "prefill_ms": round(ms, 1), "tokens_per_s": round(a.batch * a.context * 1e3 / ms, 1),
               "temp_gib": None if temp is None else round(temp / 2 ** 30, 2),
               "process_peak_gib": round(stats.get("peak_bytes_in_use", 0) / 2 ** 30, 2),
               **floor_cells(prefill_flops(cfg, method, a.batch, a.context), peak, ms),
               "finite": bool(jnp.all(jnp.isfinite(logits))), "wall_s": round(time.perf_counter() - t0, 1)}
        row = {k: v for k, v in row.items() if v is not None}  # blank cells, not "None"
        rows.append(row)
        print(row, flush=True)
        del cache, model, fns
    return rows


def combine_prefill(paths) -> list[dict]:
    """One table from several ``prefill`` result files (e.g. a method run alone at 128K,
    where one process cannot hold two 8B-shaped programs). Every row keeps the command,
    commit and date it came from; rows from before the floor column get it (the same
    :func:`prefill_flops`, H100 peak), and ``x_dense`` is over the dense row of the same
    model and context."""
    import json
    import shlex
    from pathlib import Path

    from benchmarks.prefill_bench import peak_flops

    rows = []
    for path in paths:
        d = json.loads(Path(path).read_text())
        args = shlex.split(d.get("command") or "")
        model = args[args.index("--model") + 1] if "--model" in args else "qwen3-8b"
        for r in d["rows"]:
            r = {"model": model, **r, "command": d.get("command"), "git_commit": d.get("git_commit"),
                 "date": d.get("date")}
            peak = peak_flops(d.get("device", ""))
            if "floor_ms" not in r and peak:
                cfg, anchors = prefill_model(r["model"], r["context"], r["layers"])
                method = prefill_method(r["method"], anchors=anchors).for_model(
                    cfg.name, num_layers=cfg.num_layers, head_dim=cfg.head_dim)
                r.update(floor_cells(prefill_flops(cfg, method, r["batch"], r["context"]), peak, r["prefill_ms"]))
            rows.append(r)
    dense = {(r["model"], r["context"]): r["prefill_ms"] for r in rows if r["method"] == "dense"}
    for r in rows:
        if (r["model"], r["context"]) in dense:
            r["x_dense"] = round(dense[r["model"], r["context"]] / r["prefill_ms"], 2)
    rows.sort(key=lambda r: (r["model"], r["context"], r["method"] != "dense"))
    return rows


def plot_prefill(rows: list[dict], path) -> None:
    """Whole-model prefill: speed over dense (left) and time over the FLOP floor (right)
    against context, one line per (model, method)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.2))
    models = sorted({r.get("model", "qwen3-8b") for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    color = {m: f"C{i}" for i, m in enumerate(methods)}  # one colour per method in both panels
    for model in models:
        mine = [r for r in rows if r.get("model", "qwen3-8b") == model]
        dense = {r["context"]: r["prefill_ms"] for r in mine if r["method"] == "dense"}
        for method in dict.fromkeys(r["method"] for r in mine):
            pts = sorted((r["context"], r) for r in mine if r["method"] == method)
            style = "-o" if model == "qwen3-8b" else "--s"
            label = f"{method} ({model})"
            if method != "dense":
                xs = [c for c, _ in pts if c in dense]
                ax.plot(xs, [dense[c] / r["prefill_ms"] for c, r in pts if c in dense], style, label=label,
                        color=color[method])
            xs = [c for c, r in pts if "x_floor" in r]
            bx.plot(xs, [r["x_floor"] for c, r in pts if "x_floor" in r], style, label=label, color=color[method])
    for a_, title in ((ax, "prefill speed over cuDNN dense (B=1)"), (bx, "time over its FLOP floor")):
        a_.set_xscale("log", base=2)
        a_.set_xlabel("context (tokens)")
        a_.set_title(title)
        a_.grid(alpha=0.3)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_ylabel("x dense")
    bx.set_ylabel("x floor")
    bx.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


PREFILL_COLS = ["model", "method", "batch", "context", "layers", "prefill_ms", "x_dense", "tokens_per_s", "floor_ms",
                "x_floor", "attn_tflop", "linear_tflop", "temp_gib", "finite"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="part", required=True)
    pa = sub.add_parser("attention")
    pa.add_argument("--shapes", default="1x32768,1x65536,1x131072,8x32768,8x65536,8x131072")
    pa.add_argument("--runs", type=int, default=30)
    pe = sub.add_parser("e2e")
    pe.add_argument("--context", type=int, default=32768)
    pe.add_argument("--batch", type=int, default=4)
    pe.add_argument("--layers", type=int, default=36)
    pe.add_argument("--steps", type=int, default=16)
    pe.add_argument("--rounds", type=int, default=3)
    pe.add_argument("--methods", default="dense,kascade,quest,asyncspade,asyncspade_w1")
    pe.add_argument("--profile", action="store_true")
    pe.add_argument("--trace-dir", default="/tmp/kascade_bench_trace")
    pp = sub.add_parser("prefill")
    pp.add_argument("--context", type=int, default=32768)
    pp.add_argument("--batch", type=int, default=1)
    pp.add_argument("--layers", type=int, default=None, help="default: the model's (36 Qwen3-8B, 32 Llama-3.1-8B)")
    pp.add_argument("--model", default="qwen3-8b", choices=PREFILL_MODELS, help="the shape (random weights)")
    pp.add_argument("--warmup", type=int, default=1)
    pp.add_argument("--runs", type=int, default=3)
    pp.add_argument("--methods", default="dense,kascade_tiled",
                    help="dense, kascade_tiled (composed), kascade_tiled[A-B] (on layers A..B only), tsa (Token "
                         "Sparse at tau=0.005 on the second half of the layers), tsa@F (the same keeping a fraction "
                         "F of each prefix); NAME+tsa / NAME+tsa@F composes Kascade's with TSA")
    pp.add_argument("--chunk-bytes", type=int, default=2 << 30, help="Kascade.prefill_chunk_bytes")
    pc = sub.add_parser("combine", help="one table and plot from several prefill result files")
    pc.add_argument("files", nargs="+")
    for sp in (pa, pe, pp, pc):
        sp.add_argument("--out", default=None)
        sp.add_argument("--name", default=None)
    a = p.parse_args(argv)
    if a.part == "combine":
        from pathlib import Path

        from benchmarks.timing import RESULTS_DIR

        rows = combine_prefill(a.files)
        name = a.name or "kascade_prefill_model_combined"
        sources = sorted({(r["command"], r["git_commit"], r["date"]) for r in rows})
        md = (f"# Whole-model prefill against cuDNN dense (random bf16 weights, unrolled, B=1)\n\n"
              + "\n".join(f"- `{c}` (commit {g}, {d})" for c, g, d in sources) + "\n\n"
              + markdown_table(rows, PREFILL_COLS))
        out = Path(a.out or RESULTS_DIR)
        write_results(name, {"rows": rows, "sources": sources}, md, out_dir=out)
        plot_prefill(rows, out / f"{name}.png")
        print(md)
        return
    if a.part == "attention":
        rows = []
        for shape in a.shapes.split(","):
            b, s = (int(x) for x in shape.lower().split("x"))
            rows += attention_rows(b, s, a.runs)
            print(rows[-1], flush=True)
        cols = ["B", "S", "op", "ms", "x_dense", "speedup", "k", "anchor_kernel_max_err"]
        title = "Kascade decode attention against cuDNN dense (Qwen3-8B heads: 32/8, D=128, bf16)"
    elif a.part == "prefill":
        rows = prefill_rows(a)
        cols = [c for c in PREFILL_COLS if c != "x_dense"] + ["process_peak_gib"]
        title = (f"Whole-model prefill through the layer driver ({a.model} shape, random bf16 weights, "
                 "unrolled)")
    else:
        rows = e2e_rows(a)
        cols = ["method", "batch", "context", "layers", "step_ms", "tokens_per_s"] + (
            ["gpu_busy_ms", "gpu_span_ms", "kernel_sum_ms", "select_ms", "select_hidden_ms"] if a.profile else [])
        title = "Decode step through the layer driver (Qwen3-8B shape, random bf16 weights, unrolled)"
    flags = os.environ.get("XLA_FLAGS", "")
    md = f"# {title}\n\n{stamp()}\n\nXLA_FLAGS: `{flags}`\n\n" + markdown_table(rows, cols)
    if a.part == "e2e" and a.profile:
        md += "\n\nTop kernels (ms per step):\n\n" + "\n".join(f"- {r['method']}: {r['top_kernels_ms']}" for r in rows)
    print(md)
    if a.out:
        write_results(a.name or f"kascade_{a.part}", {"rows": rows, "xla_flags": flags, **stamp()}, md,
                      out_dir=a.out)


if __name__ == "__main__":
    main()
