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
  kept tokens, cuDNN causal attention with the kept count as sequence length over the
  shortest length bucket that holds them, scatter back; rows marked "full length": the
  same at the padded prompt length, ``buckets=1``, as it ran before the buckets) with a
  fraction ``f`` of the prefix kept per head (``--fractions``), chosen at
  random: random weights carry no attention structure, so the fraction TSA's tau
  keeps on real text has to come from a real model (``benchmarks.accuracy`` with
  ``prefill=token_sparse``), and the time is reported per fraction.

* **kascade reuse** (``--parts kascade``): a Kascade reuse layer's tiled attention
  (``sparse_jax.methods.kascade.prefill.tiled_attention_composed``: the gather kernel over each
  32-query tile's selected keys, the causal diagonal tile, the LSE merge) at the
  paper's budget (``tile_counts``: ``min(0.1 T - 32, max(128, 0.1 x tile start), tile
  start)`` keys per tile, growing with position), with random selections (per tile,
  one key drawn in each of ``count`` equal strata of the keys before it: distinct, in
  ascending order, where an anchor's are in score order), once per kernel tuning
  (``--kascade-tunings``); and the same with every count 0 (the layout, the diagonal
  and the merge alone: the composition's overhead); and an anchor layer's selection
  (``anchor_selection_chunked``: the tile scores, from the f32 reference (exact softmax
  per chunk of tiles, the group and tile sums) or the tile-scores kernel, then the
  per-tile top-k), each also with a top-1 to separate the scoring from the top-k
  (floor: QK over the causal pairs at the bf16 peak; max_abs_err: the kernel's scores
  against the reference's at min(context, 2048) tokens; a tile's scores sum to at most
  its 32 queries times the GQA group). Cross-checked against the masked
  reference (``tiled_attention``) at ``min(context, 2048)`` tokens of the smallest
  context (max |difference|).

* **chunk** (``--parts chunk``): one chunk of a chunked prefill (``--chunk`` queries,
  B=1) starting at each context, over the keys the paged engine gathers for it (the power
  of two holding the chunk, at most ``--chunk-cap``): dense (``chunk_prefill_attention``,
  cuDNN's split form) against Token Sparse Attention's chunk form at a fixed kept fraction
  (``--chunk-keep``, as benchmark B ran it), whole and in pieces (the window scores by the
  jnp tiles and by the kernel, the kept set, the selection, the attention over the kept
  keys); the bars are drawn per chunk position. ``bash scripts/serving_gpu.sh chunk``.

Each row: median ms (``benchmarks.timing.time_fn``: warm-up, synchronised runs),
the ratio to dense, and the compute floor: causal attention's ``2 * B * Hq * D * T^2``
FLOP (QK and PV, half the square) over the kept tokens, at the H100's bf16 dense peak
(989 TFLOP/s). The compressed output is cross-checked against the masked reference at
the smallest context (max |difference|).
"""

from __future__ import annotations

import argparse
import functools
import json
import shlex
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import markdown_table, stamp, time_fn, write_final_results, write_results

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


KASCADE_TILE = 32
#: the reuse layer's kernel tunings timed by default ("default": the kernel's own
#: defaults; a tile of 32 queries x G=4 is a 128-row program, which may want 8 warps)
KASCADE_TUNINGS = "default;num_warps=8;block_k=32:num_warps=8"


def parse_tunings(spec: str) -> list[dict]:
    """``"default;num_warps=8;block_k=32:num_warps=8"`` -> ``[{}, {"num_warps": 8}, ...]``."""
    out = []
    for item in spec.split(";"):
        item = item.strip()
        if not item:
            continue
        if item == "default":
            out.append({})
            continue
        conf = {}
        for kv in item.split(":"):
            key, _, val = kv.partition("=")
            conf[key.strip()] = int(val)
        out.append(conf)
    return out


def tuning_name(conf: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in conf.items()) or "default tuning"


def random_tile_selection(key, counts, hkv: int, t: int, tile: int, width: int) -> jax.Array:
    """``int32[B, Hkv, n_tiles, width]``: for each tile ``n`` (start ``s = n * tile``) and
    its ``c = counts[b, n]``, one uniformly random key in each of ``c`` equal strata of
    ``[0, s)`` (sizes ``s // c`` or one more): distinct keys before the tile, ascending;
    zeros past the count. Integer arithmetic bounded by ``s`` (no overflow)."""
    b, nt = counts.shape
    s = (jnp.arange(nt, dtype=jnp.int32) * tile)[None, None, :, None]  # [1, 1, nt, 1]
    c = jnp.maximum(counts, 1)[:, None, :, None]  # [B, 1, nt, 1]
    j = jnp.arange(width, dtype=jnp.int32)[None, None, None, :]
    base, rem = s // c, s % c
    lo = j * base + jnp.minimum(j, rem)
    size = base + (j < rem).astype(jnp.int32)
    u = jax.random.uniform(key, (b, hkv, nt, width))
    idx = lo + jnp.minimum((u * size).astype(jnp.int32), jnp.maximum(size - 1, 0))
    return jnp.where(j < counts[:, None, :, None], idx, 0).astype(jnp.int32)


def kascade_rows(q, k, v, *, tunings, runs: int, check: bool, dense_ms: float, floor_pairs_ms,
                 anchor_impls=("reference", "pallas"), scores_tunings=()) -> list[dict]:
    """A Kascade reuse layer at the paper's budget (module docstring)."""
    from pallas_kernels.tile_scores import tile_scores_pallas
    from sparse_jax.methods.kascade import prefill as kp
    from sparse_jax.ops._dispatch import on_gpu

    b, t, hq, d = q.shape
    hkv, tile = k.shape[2], KASCADE_TILE
    rule = dict(budget=0, fraction=0.1, min_keys=128)

    def selection(t_, key):
        counts = kp.tile_counts(jnp.full((b,), t_, jnp.int32), t_, tile, **rule)
        width = kp.tile_width(t_, tile, **rule)
        return jax.jit(random_tile_selection, static_argnums=(2, 3, 4, 5))(key, counts, hkv, t_, tile, width), counts

    def pairs(counts, t_):  # (query, key) pairs attended by one query head
        diag = sum(min(tile, t_ - n * tile) * (min(tile, t_ - n * tile) + 1) // 2 for n in range(counts.shape[1]))
        rows_in = np.minimum(tile, t_ - np.arange(counts.shape[1]) * tile)
        return int((np.asarray(counts[0], np.int64) * rows_in).sum()) + diag

    idx, counts = selection(t, jax.random.PRNGKey(1))
    kept = pairs(counts, t) / (t * (t + 1) / 2)
    rows = []
    for conf in tunings:
        fn = jax.jit(lambda q, k, v, i, c, conf=conf: kp.tiled_attention_composed(q, k, v, i, c, tile, **conf))
        r = time_fn(fn, (q, k, v, idx, counts), runs=runs, cupti=False)
        row = dict(context=t, part=f"kascade reuse, composed ({tuning_name(conf)})", kept=kept, ms=r.wall_ms,
                   vs_dense=dense_ms / r.wall_ms, floor_ms=floor_pairs_ms(pairs(counts, t)))
        if check:  # against the masked reference at a small size
            tc = min(t, 2048)
            ic, cc = selection(tc, jax.random.PRNGKey(2))
            qc, kc, vc = q[:, :tc], k[:, :tc], v[:, :tc]
            want = jax.jit(kp.tiled_attention, static_argnums=5)(qc, kc, vc, ic, cc, tile)
            row["max_abs_err"] = float(jnp.max(jnp.abs(fn(qc, kc, vc, ic, cc).astype(jnp.float32)
                                                       - want.astype(jnp.float32))))
        rows.append(row)
    fn = jax.jit(lambda q, k, v, i, c: kp.tiled_attention_composed(q, k, v, i, c, tile, **tunings[0]))
    r = time_fn(fn, (q, k, v, idx, jnp.zeros_like(counts)), runs=runs, cupti=False)
    rows.append(dict(context=t, part="kascade reuse, counts 0 (layout, diagonal, merge)", kept=None, ms=r.wall_ms,
                     vs_dense=dense_ms / r.wall_ms, floor_ms=None))
    # an anchor layer's selection: the tile scores (the f32 reference: exact softmax per chunk
    # of tiles in HBM, group and tile sums; or the tile-scores kernel) and the per-tile top-k;
    # each also with a top-1 (the scoring alone). The anchor then attends its selection as a
    # reuse layer does.
    lengths = jnp.full((b,), t, jnp.int32)
    floor_all = floor_pairs_ms(t * (t + 1) // 2)
    floor_qk = None if floor_all is None else floor_all / 2  # QK alone over the causal pairs
    top1 = dict(budget=1, fraction=0.0, min_keys=1)
    variants = [(impl, label, rule_, {}) for impl, label in (("reference", "f32 softmax in HBM"),
                                                             ("pallas", "tile-scores kernel"))
                if impl in anchor_impls for rule_ in (rule, top1)]
    variants += [("pallas", f"tile-scores kernel ({tuning_name(conf)})", top1, conf) for conf in scores_tunings]
    for impl, label, sel_rule, conf in variants:
        part = f"kascade anchor selection, {label} + " + (
            "per-tile top-k" if sel_rule is rule else "top-1 (the scores alone)")
        fn = jax.jit(lambda q, k, n, sel_rule=sel_rule, impl=impl, conf=conf: kp.anchor_selection_chunked(
            q, k, n, tile=tile, scores_impl=impl, scores_tuning=conf, **sel_rule))
        r = time_fn(fn, (q, k, lengths), runs=max(1, min(runs, 3)), cupti=False)
        row = dict(context=t, part=part, kept=None, ms=r.wall_ms, vs_dense=dense_ms / r.wall_ms,
                   floor_ms=floor_qk)
        if check and impl == "pallas" and sel_rule is rule and not conf:
            # the kernel's tile scores against the reference's at a small size (max |difference|)
            tc = min(t, 2048)
            qc, kc, nc = q[:, :tc], k[:, :tc], jnp.full((b,), tc, jnp.int32)
            ref = kp.tile_scores(kp.causal_probabilities(qc, kc, nc), nc, tile, hkv)
            got = jax.jit(lambda q, k, n: tile_scores_pallas(q, k, n, 0, tile=tile, chunk=kp.num_tiles(
                tc, tile), interpret=not on_gpu()))(qc, kc, nc)
            fin = jnp.isfinite(ref)
            row["max_abs_err"] = float(jnp.max(jnp.where(fin, jnp.abs(got - ref), 0.0)))
        rows.append(row)
    return rows


def attention_rows(*, b: int, t: int, hq: int, hkv: int, d: int, window: int, fractions, dtype, runs: int,
                   check: bool, parts=("tsa", "kascade"), kascade_tunings=None, anchor_impls=("reference", "pallas"),
                   scores_tunings=(), chunk: dict | None = None, log=print) -> list[dict]:
    from sparse_jax.ops.dense import dense_prefill_attention

    kq, kk, kv, kr = jax.random.split(jax.random.PRNGKey(0), 4)
    q = jax.random.normal(kq, (b, t, hq, d), dtype)
    k = jax.random.normal(kk, (b, t, hkv, d), dtype)
    v = jax.random.normal(kv, (b, t, hkv, d), dtype)
    lengths = jnp.full((b,), t, jnp.int32)
    peak = peak_flops(jax.devices()[0].device_kind)

    def floor_ms(tokens):
        return None if peak is None else 2 * b * hq * d * tokens * tokens / peak * 1e3

    def floor_pairs_ms(pairs):  # QK and PV over the attended (query, key) pairs of each head
        return None if peak is None else 4 * b * hq * d * pairs / peak * 1e3

    rows = []
    if set(parts) & {"tsa", "kascade"}:
        dense = time_fn(jax.jit(dense_prefill_attention), (q, k, v), runs=runs, cupti=False)
        rows.append(dict(context=t, part="dense (cuDNN causal)", kept=1.0, ms=dense.wall_ms, vs_dense=1.0,
                         floor_ms=floor_ms(t)))
    if "chunk" in parts:
        rows += chunk_rows(kr, t=t, hq=hq, hkv=hkv, d=d, window=window, dtype=dtype, runs=runs, check=check,
                           peak=peak, **(chunk or {}))
    if "tsa" in parts:
        rows += tsa_rows(q, k, v, lengths, kr, window=window, fractions=fractions, runs=runs, check=check,
                         dense_ms=dense.wall_ms, floor_ms=floor_ms, log=log)
    if "kascade" in parts:
        rows += kascade_rows(q, k, v, tunings=kascade_tunings or parse_tunings(KASCADE_TUNINGS), runs=runs,
                             check=check, dense_ms=dense.wall_ms, floor_pairs_ms=floor_pairs_ms,
                             anchor_impls=anchor_impls, scores_tunings=scores_tunings)
    rows = [{key: val for key, val in row.items() if val is not None} for row in rows]  # blank cells, not "None"
    for row in rows:
        log(f"  {t:>7} {row['part']:<34} {row['ms']:9.3f} ms  x{row['vs_dense']:.2f} vs dense", flush=True)
    return rows


def tsa_rows(q, k, v, lengths, kr, *, window: int, fractions, runs: int, check: bool, dense_ms: float, floor_ms,
             log=print) -> list[dict]:
    """Token Sparse Attention's steps (module docstring)."""
    from pallas_kernels.window_scores import unsupported_reason
    from sparse_jax import prefill as tsa

    b, t, hq, d = q.shape
    dtype = q.dtype
    rows = []

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
                   vs_dense=dense_ms / ws.wall_ms, floor_ms=None)
        if check:  # the kernel against the reference (scores of a head sum to <= 1)
            scores[impl] = step1(q, k, lengths)
            if impl != "reference":
                row["max_abs_err"] = float(jnp.max(jnp.abs(scores[impl] - scores["reference"])))
        rows.append(row)
        sc = time_fn(jax.jit(scoring), (q, k, lengths), runs=runs, cupti=False)
        rows.append(dict(context=t, part=f"tsa scoring (steps 1-4), {impl}", kept=None, ms=sc.wall_ms,
                         vs_dense=dense_ms / sc.wall_ms, floor_ms=None))
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
        rows.append(dict(context=t, part=part, kept=None, ms=r.wall_ms, vs_dense=dense_ms / r.wall_ms,
                         floor_ms=None))
    # the compressed attention under both row movements (tsa.GATHER_MODES: the same numbers),
    # cut to the length buckets (the default) and at the full padded length (buckets=1: what
    # ran before the buckets, kept as the comparison), keyed by the row name's suffix:
    # "scatter" keeps the rows' old name
    attends = {("" if mode == "scatter" else f", {mode}") + ("" if nb > 1 else ", full length"):
               jax.jit(functools.partial(tsa.compressed_causal_attention, gather=mode, buckets=nb))
               for nb in (8, 1) for mode in tsa.GATHER_MODES}
    for f in fractions:
        kept = random_kept(kr, b, hq, t, window, f)
        n = int(kept[0, 0].sum())
        want = tsa.masked_causal_attention(q, k, v, kept, 512) if check else None
        for suffix, attend in attends.items():
            r = time_fn(attend, (q, k, v, kept), runs=runs, cupti=False)
            row = dict(context=t, part=f"tsa attend, {f:g} of the prefix{suffix}", kept=n / t, ms=r.wall_ms,
                       vs_dense=dense_ms / r.wall_ms, floor_ms=floor_ms(n))
            if check:
                row["max_abs_err"] = float(jnp.max(jnp.abs(attend(q, k, v, kept).astype(jnp.float32)
                                                           - want.astype(jnp.float32))))
            rows.append(row)
    return rows


def chunk_rows(key, *, t: int, hq: int, hkv: int, d: int, window: int, dtype, runs: int, check: bool, peak,
               size: int = 2048, keep: float = 0.3, cap: int = 132096, log=print) -> list[dict]:
    """One chunk of ``size`` queries starting at position ``t`` (chunked prefill, B=1), over
    the keys the engine gathers for it (``models.serving.paged.chunk_kv_len``): dense
    (``chunk_prefill_attention``, cuDNN's split form) and Token Sparse Attention's chunk form at ``keep`` of the prefix (the
    fixed fraction benchmark B ran), whole and in pieces: the window scores (the tiled jnp
    form, "reference", and the window-scores kernel, "pallas"), the kept set (steps 1-4),
    the selection alone (pool, count, step 4 from given scores; with the compressed order;
    and as one argsort, ``select="argsort"``, also timed whole), and the attention over the
    kept keys (gather + cuDNN). Floor: the chunk's QK and PV over its keys at the bf16 peak."""
    from models.serving.paged import chunk_kv_len
    from pallas_kernels.window_scores import unsupported_reason
    from sparse_jax import prefill as tsa
    from sparse_jax.ops.dense import chunk_prefill_attention

    kv_len = chunk_kv_len(t + size, 64, cap)  # pages of 64 (dense's; a chunk ends past the first page)
    if t + size > kv_len:
        raise ValueError(f"a chunk at {t} of {size} tokens passes the capacity {cap}")
    kq, kk, kv = jax.random.split(key, 3)
    q = jax.random.normal(kq, (1, size, hq, d), dtype)
    k = jax.random.normal(kk, (1, kv_len, hkv, d), dtype)
    v = jax.random.normal(kv, (1, kv_len, hkv, d), dtype)
    start = jnp.int32(t)
    lengths = jnp.asarray([t + size], jnp.int32)  # the prompt goes on past this chunk
    opts = dict(tau=0.005, min_tokens=1024, window=window, pool=7)

    def floor(keys):  # the chunk's queries over ``keys`` prefix keys and, causally, its own
        return None if peak is None else 4 * hq * d * size * (keys + size / 2) / peak * 1e3

    def timed(fn, args):
        return time_fn(jax.jit(fn), args, runs=runs, cupti=False).wall_ms

    base = dict(context=t, kv_len=kv_len)
    dense_fn = jax.jit(chunk_prefill_attention)  # timed and, for the cross-check, run: one compile
    dense_ms = time_fn(dense_fn, (q, k, v, start), runs=runs, cupti=False).wall_ms
    rows = [dict(base, part=f"chunk {size}: dense (cuDNN split)", kept=1.0, ms=dense_ms, vs_dense=1.0,
                 floor_ms=floor(t))]
    impls = ["reference"] + (["pallas"] if unsupported_reason(d, dtype, dtype) is None else [])
    scores = {}
    for impl in impls:
        def score(q, k, s, n, impl=impl):
            return tsa.chunk_window_scores(q, k, s, n, window, impl=impl)

        def kept_set(q, k, s, n, impl=impl):
            return tsa.chunk_kept_keys(q, k, s, n, keep_fraction=keep, scores_impl=impl, **opts)

        def whole(q, k, v, s, n, impl=impl):
            return tsa.token_sparse_chunk_attention(q, k, v, s, n, keep_fraction=keep, scores_impl=impl, **opts)

        label = "jnp tiles" if impl == "reference" else "kernel"
        ms = timed(score, (q, k, start, lengths))
        row = dict(base, part=f"chunk {size}: tsa window scores, {label}", ms=ms, vs_dense=dense_ms / ms)
        if check:
            scores[impl] = jax.jit(score)(q, k, start, lengths)
            if impl != "reference":
                row["max_abs_err"] = float(jnp.max(jnp.abs(scores[impl] - scores["reference"])))
        rows.append(row)
        ms = timed(kept_set, (q, k, start, lengths))
        rows.append(dict(base, part=f"chunk {size}: tsa kept set (steps 1-4), {label}", ms=ms,
                         vs_dense=dense_ms / ms))
        ms = timed(whole, (q, k, v, start, lengths))
        row = dict(base, part=f"chunk {size}: tsa whole, {keep:g} kept, {label}", kept=keep, ms=ms,
                   vs_dense=dense_ms / ms, floor_ms=floor(int(keep * t)))
        if check:  # nothing dropped: exactly the dense chunk
            exact = tsa.token_sparse_chunk_attention(q, k, v, start, lengths, keep_fraction=1.0, scores_impl=impl,
                                                     **opts)
            row["max_abs_err"] = float(jnp.max(jnp.abs(exact.astype(jnp.float32)
                                                       - dense_fn(q, k, v, start).astype(jnp.float32))))
        rows.append(row)
    sm = jax.jit(lambda q, k, s, n: tsa.smooth(tsa.chunk_window_scores(q, k, s, n, window, impl="reference"), 7))(
        q, k, start, lengths)

    def select(sm, s):
        ends = jnp.broadcast_to(s + window, (1,))
        n = tsa.fixed_keep_counts(ends, keep, min_tokens=1024, window=window)
        return tsa.kept_tokens(sm, n, ends, window) & (jnp.arange(sm.shape[-1]) < s)[None, None, :], n

    ms = timed(select, (sm, start))
    rows.append(dict(base, part=f"chunk {size}: tsa select (count + step 4 on given scores)", ms=ms,
                     vs_dense=dense_ms / ms))
    ms = timed(lambda sm, s: tsa.compress_order(select(sm, s)[0]), (sm, start))
    rows.append(dict(base, part=f"chunk {size}: tsa select + compressed order (sort, cumsum, scatter)", ms=ms,
                     vs_dense=dense_ms / ms))
    ms = timed(tsa.chunk_kept_order, (sm, start))
    rows.append(dict(base, part=f"chunk {size}: tsa kept order (one argsort)", ms=ms, vs_dense=dense_ms / ms))
    impl = impls[-1]  # what the engine runs: the kernel's scores where it has them
    whole_argsort = functools.partial(tsa.token_sparse_chunk_attention, keep_fraction=keep, scores_impl=impl,
                                      select="argsort", **opts)
    ms = timed(whole_argsort, (q, k, v, start, lengths))
    row = dict(base, part=f"chunk {size}: tsa whole, {keep:g} kept, {'jnp tiles' if impl == 'reference' else 'kernel'}"
                          f", one argsort", kept=keep, ms=ms, vs_dense=dense_ms / ms, floor_ms=floor(int(keep * t)))
    if check:  # the same keys as the sort's selection
        sorted_ = tsa.token_sparse_chunk_attention(q, k, v, start, lengths, keep_fraction=keep, scores_impl=impl,
                                                   **opts)
        row["max_abs_err"] = float(jnp.max(jnp.abs(jax.jit(whole_argsort)(q, k, v, start, lengths).astype(jnp.float32)
                                                   - sorted_.astype(jnp.float32))))
    rows.append(row)
    kept, n = jax.jit(select)(sm, start)
    ms = timed(tsa.sparse_chunk_attention, (q, k, v, start, kept, n))
    rows.append(dict(base, part=f"chunk {size}: tsa attend (gather + cuDNN), {keep:g} kept", kept=keep, ms=ms,
                     vs_dense=dense_ms / ms, floor_ms=floor(int(n[0]))))
    return rows


def render(payload) -> str:
    s = payload["stamp"]
    return (f"# Sparse prefill attention vs cuDNN causal (one layer)\n\n{s['device']}, jax {s['jax']}, {s['date']}, "
            f"commit {s.get('git_commit', '')}\n\n`{s['command']}`\n\n"
            f"B={payload['batch']}, {payload['heads']} heads, D={payload['head_dim']}, {payload['dtype']}; median ms "
            "of synchronised runs; vs_dense = dense ms / this ms (scoring: the same ratio, for scale); floor_ms: "
            "causal attention FLOP over the kept tokens at the bf16 peak; max_abs_err: the window-scores kernel "
            "against the reference (a head's scores sum to <= 1), the compressed attention against the masked one, "
            "Kascade's composed tiled attention against its masked reference at min(context, 2048) tokens. "
            "Kascade kept: the share of the causal (query, key) pairs a reuse layer attends at the paper's budget. "
            "Kept prefix tokens drawn at random "
            "(random weights have no attention structure; the fraction tau keeps on real text is measured "
            "separately).\n\n"
            + ("Chunk rows: `context` is the chunk's first position, `kv_len` the keys the paged engine gathers "
               "for it; TSA at a fixed kept fraction of the prefix (as benchmark B ran it); max_abs_err: the "
               "scoring kernel against the jnp tiles, and TSA with nothing dropped against the dense chunk.\n\n"
               if any("kv_len" in r for r in payload["rows"]) else "")
            + markdown_table(payload["rows"], ["context", "kv_len", "part", "kept", "ms", "vs_dense", "floor_ms",
                                               "max_abs_err"],
                             {"kept": ".3f", "ms": ".3f", "vs_dense": ".2f", "floor_ms": ".3f", "max_abs_err": ".2e"}))


def tsa_curves(rows) -> dict:
    """``{context: {series: [(kept, ms), ...]}}`` of the "tsa attend" rows (series: the
    row movement and length cut: "scatter", "gather", "scatter, full length", ...), and
    each context's dense ms under ``"dense"`` as ``[(1.0, ms)]``."""
    out: dict = {}
    for r in rows:
        part = r["part"]
        if part == "dense (cuDNN causal)":
            out.setdefault(r["context"], {})["dense"] = [(1.0, r["ms"])]
        elif part.startswith("tsa attend, "):
            rest = part.split(" of the prefix", 1)[1].removeprefix(", ")
            series = rest if rest.startswith("gather") else ", ".join(x for x in ("scatter", rest) if x)
            out.setdefault(r["context"], {}).setdefault(series, []).append((r["kept"], r["ms"]))
    return out


def plot(payload, path: Path):
    """TSA's compressed attention (ms, log) against the kept fraction, one panel per
    context: each row movement and length cut, cuDNN dense as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = {t: c for t, c in tsa_curves(payload["rows"]).items() if len(c) > 1}
    if not curves:
        if any("kv_len" in r for r in payload["rows"]):
            chunk_plot(payload, path)
        return
    fig, axes = plt.subplots(1, len(curves), figsize=(5 * len(curves), 4), squeeze=False)
    for ax, (t, series) in zip(axes[0], sorted(curves.items())):
        dense = series.pop("dense", [(1.0, None)])[0][1]
        for name, pts in sorted(series.items()):
            pts = sorted(pts)
            ax.plot([k for k, _ in pts], [ms for _, ms in pts], marker="o", label=name,
                    linestyle="--" if "full length" in name else "-")
        if dense:
            ax.axhline(dense, color="k", linewidth=1, label="cuDNN dense")
        ax.set_yscale("log")
        ax.set_xlabel("kept fraction of the prompt")
        ax.set_ylabel("ms per layer")
        ax.set_title(f"{t // 1024}K tokens")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    s = payload["stamp"]
    fig.suptitle(f"TSA compressed attention, {payload['heads']} heads, D={payload['head_dim']} ({s['device']})",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def chunk_plot(payload, path: Path):
    """The chunk rows as bars per chunk position (ms, log): dense, TSA whole per scoring
    implementation, and TSA's pieces."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in payload["rows"] if "kv_len" in r]
    contexts = sorted({r["context"] for r in rows})
    parts = list(dict.fromkeys(r["part"].split(": ", 1)[1] for r in rows))
    ms = {(r["context"], r["part"].split(": ", 1)[1]): r["ms"] for r in rows}
    fig, ax = plt.subplots(figsize=(max(8, 2.2 * len(contexts)), 4.5))
    width = 0.8 / len(parts)
    for i, part in enumerate(parts):
        xs = [j + i * width for j, _ in enumerate(contexts)]
        ax.bar(xs, [ms.get((t, part), 0) for t in contexts], width, label=part,
               color="k" if part.startswith("dense") else None)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(contexts))], [f"chunk at {t // 1024}K" for t in contexts])
    ax.set_yscale("log")
    ax.set_ylabel("ms per layer")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7)
    s = payload["stamp"]
    fig.suptitle(f"One chunk of a chunked prefill: dense against TSA's chunk form, {payload['heads']} heads, "
                 f"D={payload['head_dim']} ({s['device']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


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
    p.add_argument("--parts", default="tsa,kascade",
                   help="which rows: tsa, kascade (each with the whole-prompt dense row), chunk (one chunk of a "
                        "chunked prefill starting at each context: dense and TSA's chunk form)")
    p.add_argument("--chunk", type=int, default=2048, help="chunk rows: the chunk's queries")
    p.add_argument("--chunk-keep", type=float, default=0.3, help="chunk rows: TSA's kept fraction of the prefix")
    p.add_argument("--chunk-cap", type=int, default=132096,
                   help="chunk rows: the request's capacity (the largest key bucket)")
    p.add_argument("--kascade-tunings", default=KASCADE_TUNINGS,
                   help="';'-separated gather-kernel tunings for the Kascade reuse rows ('default' or "
                        "'key=val:key=val', keys from sparse_jax.ops.attention.SPARSE_TUNING_KEYS)")
    p.add_argument("--anchor-impls", default="reference,pallas",
                   help="the anchor-selection rows: reference (f32 softmax in HBM), pallas (tile-scores kernel)")
    p.add_argument("--scores-tunings", default="",
                   help="';'-separated tile-scores kernel tunings timed as extra anchor rows (scores alone), "
                        "'key=val:key=val' with keys block_k, num_warps, num_stages")
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--out", default=None)
    p.add_argument("--name", default="prefill_bench")
    p.add_argument("--replot", default=None, metavar="JSON", help="redraw a result file's plot (no run)")
    a = p.parse_args(argv)
    if a.replot:
        src = Path(a.replot)
        plot(json.loads(src.read_text()), src.with_suffix(".png"))
        print(f"wrote {src.with_suffix('.png')}")
        return 0
    try:
        contexts = [int(x) for x in a.contexts.split(",") if x]
        fractions = [float(x) for x in a.fractions.split(",") if x]
        hq, hkv = (int(x) for x in a.heads.split(","))
        parts = tuple(x for x in a.parts.split(",") if x)
        tunings = parse_tunings(a.kascade_tunings)
        scores_tunings = parse_tunings(a.scores_tunings)
        anchor_impls = tuple(x for x in a.anchor_impls.split(",") if x)
    except ValueError:
        p.error("--contexts and --fractions take comma-separated numbers, --heads two ints, "
                "--kascade-tunings and --scores-tunings key=int pairs")
    from sparse_jax.ops.attention import SPARSE_TUNING_KEYS

    if not parts or set(parts) - {"tsa", "kascade", "chunk"}:
        p.error("--parts: a comma-separated subset of tsa,kascade,chunk")
    if "chunk" in parts and (a.chunk < 1 or not 0 < a.chunk_keep <= 1
                             or max(contexts, default=0) + a.chunk > a.chunk_cap):
        p.error("chunk rows: --chunk >= 1, --chunk-keep in (0, 1], and every context + --chunk within --chunk-cap")
    if "kascade" in parts and (not tunings or any(set(c) - set(SPARSE_TUNING_KEYS) for c in tunings)):
        p.error(f"--kascade-tunings: at least one, keys from {SPARSE_TUNING_KEYS}")
    if set(anchor_impls) - {"reference", "pallas"} or any(
            set(c) - {"block_k", "num_warps", "num_stages"} for c in scores_tunings):
        p.error("--anchor-impls: a subset of reference,pallas; --scores-tunings keys: block_k, num_warps, num_stages")
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
                                          fractions=fractions, dtype=dtype, runs=a.runs, check=i == 0,
                                          parts=parts, kascade_tunings=tunings, anchor_impls=anchor_impls,
                                          scores_tunings=scores_tunings,
                                          chunk=dict(size=a.chunk, keep=a.chunk_keep, cap=a.chunk_cap))
        write_results(a.name, payload, render(payload), a.out)
    payload["wall_s"] = time.perf_counter() - t0
    write_final_results(a.name, payload, render, plot, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
