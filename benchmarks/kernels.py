"""Decode-kernel benchmark against dense cuDNN decode attention.

Run on the GPU (device tool):

    python -m benchmarks.kernels --out $OUT            # full grid
    python -m benchmarks.kernels --quick --out $OUT    # one size, every kernel

For each (B, S): dense cuDNN decode (`jax.nn.dot_product_attention(
implementation="cudnn")`, its preferred `[B, S, H, D]` layout) is timed in the
same run; each kernel reports its time, the bytes it must move, GB/s on those
bytes, the distance to the HBM floor, and the ratio to dense. Numerics are
cross-checked against the pure-jnp references first.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import (
    H100_HBM_BYTES_PER_S,
    RESULTS_DIR,
    Timing,
    cold_sets,
    hbm_floor_ms,
    markdown_table,
    per_step_wall_ms,
    rotation_sets,
    stamp,
    time_fn,
    write_results,
)
from pallas_kernels.tuning import tuned, untuned_classes
from sparse_jax.ops.attention import block_sparse_decode_attention, dense_decode_attention, sparse_decode_attention
from sparse_jax.ops.scoring import (block_label_scores, block_label_topk, block_minmax, build_label_cache,
                                    interleave_labels, label_scores, quantize_block_boxes, quest_block_scores,
                                    quest_block_scores_quantized)
from sparse_jax.ops.selection import topk_indices

HQ, HKV, D = 32, 8, 128
BLOCK = 64  # AsyncTLS block size
KB = 128  # blocks kept by the Quest filter (8,192 candidate tokens)
CHANNELS = 32  # label channels for GQA (AsyncTLS)
DT = jnp.bfloat16


def rel_err(a, b) -> float:
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def make_inputs(key, b, s):
    kq, kk, kv = jax.random.split(key, 3)
    q = jax.random.normal(kq, (b, HQ, D), DT)
    k = jax.random.normal(kk, (b, HKV, s, D), DT)
    v = jax.random.normal(kv, (b, HKV, s, D), DT)
    return q, k, v


def dense_cudnn(q, k_bshd, v_bshd):
    out = jax.nn.dot_product_attention(q[:, None], k_bshd, v_bshd, implementation="cudnn")
    return out[:, 0]


def asynctls_operator(q, k, v, k_max, k_min, labels, channels, lengths, *, budget, impl="auto", return_parts=False,
                      fused=False):
    """AsyncTLS two-level selection + sparse attention, one decode step.

    Quest GEMM block scores over 64-token blocks -> top-KB blocks -> label
    scores over their KB*64 tokens (over the block ids) -> top-``budget`` tokens
    -> sparse attention. ``fused``: the second level is ``block_label_topk(fused=True)``
    (label logits, then one kernel normalizing, selecting and mapping to tokens); else
    ``block_label_scores`` + ``topk_indices`` mapping the slots to tokens (what the method runs by
    default).
    """
    b = q.shape[0]
    nb = k_max.shape[2]
    scores = quest_block_scores(q, k_max, k_min, impl=impl)
    nvalid = (lengths + BLOCK - 1) // BLOCK
    blocks = topk_indices(scores, KB, nvalid[:, None].astype(jnp.int32), impl=impl)  # [B, Hkv, KB]
    # the labels scored over the block ids (no candidate array), as the method does
    kept = jnp.full((b, HKV), KB, jnp.int32)
    if fused:
        tokens, counts = block_label_topk(q, labels, channels, blocks, kept, lengths, block_size=BLOCK, k=budget,
                                          impl=impl, fused=True)
    else:
        ls = block_label_scores(q, labels, channels, blocks, kept, lengths, block_size=BLOCK, impl=impl)
        # the top slots of the KB * BLOCK candidates, written as tokens through the block ids
        tokens = topk_indices(ls, budget, impl=impl, block_table=blocks, block_size=BLOCK)
        counts = jnp.full((b, HKV), budget, jnp.int32)
    out = sparse_decode_attention(q, k, v, tokens, counts, impl=impl)
    if return_parts:
        return out, tokens
    return out


def asynctls_method_step(budget, k, lengths, channels, **method_kw):
    """``(jitted fn(q, k, v, lengths, state) -> out [B, Hq, D], state)``: one decode step
    of ``sparse_jax.methods``' AsyncTLS on a sparse layer, as the model's driver calls it
    (``method.decode``), with the state (block boxes, label cache) built from ``k``."""
    from sparse_jax.kv import ResidentKV
    from sparse_jax.methods import get_method
    from sparse_jax.methods.base import single_layer

    b, hkv, s, d = k.shape
    cpl = (tuple(tuple(int(c) for c in row) for row in np.asarray(channels)),)  # one layer
    method = get_method("asynctls", budget=budget, kb=KB, block_size=BLOCK, channels_per_layer=cpl, **method_kw)
    method.check(num_q_heads=HQ, num_kv_heads=hkv, head_dim=d, max_len=s)
    state = jax.jit(method.state_from_keys)(k, lengths, channels)

    def step(q, k, v, lengths, state):
        layer = single_layer(0, data={k_: jnp.asarray(v_) for k_, v_ in method.layer_data(0).items()})
        return method.decode(q, ResidentKV(k, v), lengths, state, None, layer)[0]

    return jax.jit(step), state


def check_numerics(key) -> list[dict]:
    """Kernel vs reference on one mid-size input; prints and returns the errors."""
    b, s = 2, 16384 + 100
    q, k, v = make_inputs(key, b, s)
    lengths = jnp.array([s, s - 777], jnp.int32)
    rows = []
    kk = 1000
    idx = jax.random.randint(jax.random.key(5), (b, HKV, kk), 0, s - 777, jnp.int32)
    counts = jnp.array([[kk] * HKV, [kk - 37] * HKV], jnp.int32)
    for name, fn in {
        "sparse_decode_attention": lambda impl: sparse_decode_attention(q, k, v, idx, counts, impl=impl),
        "block_sparse_decode_attention": lambda impl: block_sparse_decode_attention(
            q, k, v, idx[..., :40] // BLOCK, counts // 25, lengths, block_size=BLOCK, impl=impl
        ),
        "block_minmax": lambda impl: block_minmax(k, lengths, block_size=BLOCK, impl=impl),
    }.items():
        got, ref = fn("pallas"), fn("reference")
        err = max(rel_err(g, r) for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref)))
        rows.append({"kernel": name, "rel_err": err})
    kmax, kmin = block_minmax(k, lengths, block_size=BLOCK, impl="reference")
    rows.append({
        "kernel": "quest_block_scores",
        "rel_err": rel_err(quest_block_scores(q, kmax, kmin, impl="pallas"), quest_block_scores(q, kmax, kmin, impl="reference")),
    })
    boxes8 = quantize_block_boxes(kmax, kmin, lengths, block_size=BLOCK)
    for reduce in ("sum", "max"):
        rows.append({
            "kernel": f"quest_block_scores_quantized [{reduce}]",
            "rel_err": rel_err(quest_block_scores_quantized(q, boxes8, group_reduce=reduce, impl="pallas"),
                               quest_block_scores_quantized(q, boxes8, group_reduce=reduce, impl="reference")),
        })
    # the 8-bit bound is a bound: its least margin over the exact boxes' bound (>= 0 up to f32 rounding)
    nvalid = int((int(lengths.min()) + BLOCK - 1) // BLOCK)
    margin = (quest_block_scores_quantized(q, boxes8, group_reduce="max", impl="pallas")
              - quest_block_scores(q, kmax, kmin, group_reduce="max", impl="pallas"))[..., :nvalid]
    rows.append({"kernel": "8-bit bound minus exact bound (min, should be >= -1e-3)", "rel_err": float(margin.min())})
    channels = jnp.tile(jnp.arange(CHANNELS, dtype=jnp.int32)[None] * 3 % D, (HKV, 1))
    lab_p = build_label_cache(k, channels, impl="pallas")
    lab_r = build_label_cache(k, channels, impl="reference")
    rows.append({"kernel": "build_label_cache", "rel_err": float(np.mean(np.asarray(lab_p.packed) != np.asarray(lab_r.packed)))})
    cand = jax.random.randint(jax.random.key(6), (b, HKV, 8192), 0, s - 777, jnp.int32)
    cc = jnp.full((b, HKV), 8000, jnp.int32)
    rows.append({
        "kernel": "label_scores",
        "rel_err": rel_err(label_scores(q, lab_r, channels, cand, cc, impl="pallas"), label_scores(q, lab_r, channels, cand, cc, impl="reference")),
    })
    for n, kk2 in ((2048, 128), (8192, 2048), (131072, 2048)):
        sc = jax.random.normal(jax.random.key(n), (64, n), jnp.float32)
        got = np.sort(np.asarray(topk_indices(sc, kk2, impl="pallas")), -1)
        ref = np.sort(np.asarray(jax.lax.top_k(sc, kk2)[1]), -1)
        rows.append({"kernel": f"topk_indices {64}x{n} k={kk2}", "rel_err": float(np.mean(got != ref))})
    # AsyncTLS end to end: kernel path vs reference path on the same selections.
    kmax, kmin = block_minmax(k, lengths, block_size=BLOCK)
    out_p = asynctls_operator(q, k, v, kmax, kmin, lab_r, channels, lengths, budget=1024, impl="pallas")
    out_r = asynctls_operator(q, k, v, kmax, kmin, lab_r, channels, lengths, budget=1024, impl="reference")
    rows.append({"kernel": "asynctls operator (pallas vs reference path)", "rel_err": rel_err(out_p, out_r)})
    # the fused second level against the unfused kernels: the same token sets (fraction differing)
    _, tok_f = asynctls_operator(q, k, v, kmax, kmin, lab_r, channels, lengths, budget=1024, impl="pallas",
                                 return_parts=True, fused=True)
    _, tok_u = asynctls_operator(q, k, v, kmax, kmin, lab_r, channels, lengths, budget=1024, impl="pallas",
                                 return_parts=True)
    diff = np.mean(np.sort(np.asarray(tok_f), -1) != np.sort(np.asarray(tok_u), -1))
    rows.append({"kernel": "asynctls selection (fused vs unfused kernels)", "rel_err": float(diff)})
    for r in rows:
        print(f"  check {r['kernel']:<48s} rel_err/mismatch = {r['rel_err']:.2e}")
    return rows


def bench_shape(b, s, budgets, key, runs, baselines=True, one_program=False, flush=None):
    """``baselines``: also time the jnp references, XLA dense and full-context
    top-k (done at one shape only, to keep the run inside the device limits).
    ``one_program``: also time dense cuDNN, the AsyncTLS operator and the method's step
    as the wall time of one step among many in one program (``per_step_wall_ms``: the
    gaps between kernels count, which CUPTI's kernel sums leave out). ``flush(rows)``
    is called after each budget with this shape's rows so far (a run cut off by its
    time limit keeps them)."""
    q, k, v = make_inputs(key, b, s)
    lengths = jnp.full((b,), s, jnp.int32)
    k_bshd, v_bshd = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
    kv_bytes = 2 * b * HKV * s * D * 2
    rows = []

    def add(kernel, t, nbytes, budget=None, dense_ms=None, **extra):
        row = {
            "B": b, "S": s, "K": budget or "", "kernel": kernel,
            "ms": t.best_ms, "wall_ms": t.wall_ms, "device_ms": t.device_ms,
            "bytes": nbytes, "GB/s": nbytes / (t.best_ms * 1e-3) / 1e9,
            "floor_ms": hbm_floor_ms(nbytes), "x_floor": t.best_ms / hbm_floor_ms(nbytes),
        }
        if dense_ms:
            row["speedup_vs_dense"] = dense_ms / t.best_ms
            # against the rate cuDNN reaches in this run (the real HBM rate, above the copy
            # probe's; docs/kernels.md, 'A timing defect'): a fraction of it, and time over
            # the byte floor at it
            cudnn_rate = kv_bytes / (dense_ms * 1e-3)
            row["frac_cudnn_bw"] = row["GB/s"] * 1e9 / cudnn_rate
            row["x_floor_cudnn"] = t.best_ms / (nbytes / cudnn_rate * 1e3)
        row["kernels"] = t.kernels
        row.update(extra)
        rows.append(row)
        print(f"  B={b} S={s} K={budget or '-':>5} {kernel:<34s} {t.best_ms:8.4f} ms  {row['GB/s']:7.0f} GB/s"
              + (f"  x{row['speedup_vs_dense']:.2f} vs dense" if dense_ms else ""), flush=True)
        return row

    def timed(fn, args, nbytes, **kw):
        # every timed call reads another copy of its inputs (timing.cold_sets): HBM, as a
        # model's layer reads its own cache, not the L2 the previous call filled
        return time_fn(fn, cold_sets(args, nbytes), runs=runs, rotate=True, **kw)

    def wall_row(kernel, step, args, nbytes, budget=None, dense_ms=None):
        w = per_step_wall_ms(step, cold_sets(args, nbytes), counts=(6, 30), runs=runs)
        return add(f"{kernel} [one program, wall/step]", Timing(kernel, w, w, w, None, None, runs), nbytes, budget,
                   dense_ms)["ms"]

    t_dense = timed(jax.jit(dense_cudnn), (q, k_bshd, v_bshd), kv_bytes, name="dense_cudnn")
    dense_ms = add("dense cuDNN", t_dense, kv_bytes)["ms"]
    dense_wall = wall_row("dense cuDNN", dense_cudnn, (q, k_bshd, v_bshd), kv_bytes) if one_program else None
    if baselines:
        t_xla = timed(jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q[:, None], k, v, implementation="xla")[:, 0]),
                      (q, k_bshd, v_bshd), kv_bytes)
        add("dense XLA", t_xla, kv_bytes, dense_ms=dense_ms)
    del k_bshd, v_bshd
    # exact decode on our head-major cache: the masked einsum the model runs today, and the
    # block kernel over every block (sparse_jax.dense_decode_attention, impl="pallas")
    for name, impl in (("dense head-major XLA", "reference"), ("dense head-major Pallas", "pallas")):
        fn = jax.jit(functools.partial(dense_decode_attention, impl=impl))
        add(name, timed(fn, (q, k, v, lengths), kv_bytes, name=name), kv_bytes, dense_ms=dense_ms)

    k_max, k_min = jax.jit(functools.partial(block_minmax, block_size=BLOCK))(k, lengths)
    nb = k_max.shape[2]
    meta_bytes = 2 * b * HKV * nb * D * 2
    t = timed(jax.jit(quest_block_scores), (q, k_max, k_min), meta_bytes)
    add("quest_block_scores", t, meta_bytes, dense_ms=dense_ms)
    t = timed(jax.jit(functools.partial(quest_block_scores, group_reduce="max")), (q, k_max, k_min), meta_bytes)
    add("quest_block_scores [group max]", t, meta_bytes, dense_ms=dense_ms)
    # the 8-bit boxes (AsyncTLS(box_bits=8)): codes, plus a slack pair per block and a range per channel
    boxes8 = jax.jit(functools.partial(quantize_block_boxes, block_size=BLOCK))(k_max, k_min, lengths)
    q8_bytes = 2 * b * HKV * nb * D + 2 * b * HKV * nb * 4 + 2 * b * HKV * D * 4
    for reduce in ("sum", "max"):
        t = timed(jax.jit(functools.partial(quest_block_scores_quantized, group_reduce=reduce)), (q, boxes8), q8_bytes)
        add(f"quest_block_scores [8-bit boxes{', group max' if reduce == 'max' else ''}]", t, q8_bytes,
            dense_ms=dense_ms)
    # the FMA form (each head's row reduction on the CUDA cores), which the tensor-core form replaced
    t = timed(jax.jit(functools.partial(quest_block_scores_quantized, group_reduce="max", mode="fma")), (q, boxes8),
              q8_bytes)
    add("quest_block_scores [8-bit boxes, group max, fma]", t, q8_bytes, dense_ms=dense_ms)
    del boxes8
    channels = jnp.tile((jnp.arange(CHANNELS, dtype=jnp.int32) * 3 % D)[None], (HKV, 1))
    labels = jax.jit(build_label_cache)(k, channels)
    scores = quest_block_scores(q, k_max, k_min)
    impls = ("pallas", "reference") if baselines else ("pallas",)
    for impl in impls:
        t = timed(jax.jit(functools.partial(topk_indices, k=KB, impl=impl)), (scores,), scores.size * 4)
        add(f"topk blocks {nb}->{KB} [{impl}]", t, scores.size * 4, dense_ms=dense_ms)
    blocks = topk_indices(scores, KB)
    cand = (blocks[..., None] * BLOCK + jnp.arange(BLOCK, dtype=jnp.int32)).reshape(b, HKV, -1)
    cc = jnp.full((b, HKV), cand.shape[-1], jnp.int32)
    lab_bytes = b * HKV * cand.shape[-1] * (CHANNELS // 2 + 8) + cand.size * 4 * 2
    t = timed(jax.jit(label_scores), (q, labels, channels, cand, cc), lab_bytes)
    add("label_scores 8192 cand", t, lab_bytes, dense_ms=dense_ms)
    # the interleaved records (one int32 record per token: codes, scale, offset, padding), on the
    # block candidates and on scattered ones (where three arrays cost three sectors a candidate)
    records = jax.jit(functools.partial(interleave_labels, bits=4))(labels)
    rec_bytes = b * HKV * cand.shape[-1] * records.words.shape[-1] * 4 + cand.size * 4 * 2
    t = timed(jax.jit(label_scores), (q, records, channels, cand, cc), rec_bytes)
    add("label_scores 8192 cand [records]", t, rec_bytes, dense_ms=dense_ms)
    scattered = jax.random.randint(jax.random.key(11), cand.shape, 0, s, jnp.int32)
    for layout, lab, nbytes in (("cache", labels, lab_bytes), ("records", records, rec_bytes)):
        t = timed(jax.jit(label_scores), (q, lab, channels, scattered, cc), nbytes)
        add(f"label_scores 8192 scattered [{layout}]", t, nbytes, dense_ms=dense_ms)
    ls = label_scores(q, labels, channels, cand, cc)
    for budget in budgets:
        for impl in impls:
            t = timed(jax.jit(functools.partial(topk_indices, k=budget, impl=impl)), (ls,), ls.size * 4)
            add(f"topk tokens 8192->K [{impl}]", t, ls.size * 4, budget, dense_ms)
        # several selections, cycled: the rows one selection reads (34 MB at B=8, K=1024) would
        # otherwise stay in the 50 MB L2 between runs and read faster than HBM allows
        n_sets = rotation_sets(2 * b * HKV * budget * D * 2)
        idx_sets = [jax.random.randint(jax.random.key(budget * 16 + i), (b, HKV, budget), 0, s, jnp.int32)
                    for i in range(n_sets)]
        counts = jnp.full((b, HKV), budget, jnp.int32)
        sel_bytes = 2 * b * HKV * budget * D * 2 + idx_sets[0].size * 4
        for impl in impls:
            t = time_fn(jax.jit(functools.partial(sparse_decode_attention, impl=impl)),
                        [(q, k, v, i, counts) for i in idx_sets], runs=runs, rotate=True)
            add(f"sparse_decode_attention [{impl}]", t, sel_bytes, budget, dense_ms)
        if budget == max(budgets):  # one more compile a shape: the largest K only
            # the same kernel with its splits merged by one Pallas kernel, not XLA's fusions: the
            # table's knobs plus the merge (a caller's knob would otherwise replace the table's)
            knobs = {**tuned("sparse_decode", rows=b * HKV, k=budget, d=D, g=HQ // HKV), "merge": "pallas"}
            t = time_fn(jax.jit(functools.partial(sparse_decode_attention, impl="pallas", **knobs)),
                        [(q, k, v, i, counts) for i in idx_sets], runs=runs, rotate=True)
            add("sparse_decode_attention [pallas merge]", t, sel_bytes, budget, dense_ms)
        bidx_sets = [jax.random.randint(jax.random.key(budget * 16 + 8 + i), (b, HKV, budget // BLOCK), 0, nb, jnp.int32)
                     for i in range(n_sets)]
        bcounts = jnp.full((b, HKV), budget // BLOCK, jnp.int32)
        t = time_fn(jax.jit(functools.partial(block_sparse_decode_attention, block_size=BLOCK)),
                    [(q, k, v, bi, bcounts, lengths) for bi in bidx_sets], runs=runs, rotate=True)
        add("block_sparse_decode_attention", t, sel_bytes, budget, dense_ms)
        op = jax.jit(functools.partial(asynctls_operator, budget=budget))
        op_bytes = meta_bytes + lab_bytes + sel_bytes
        t = timed(op, (q, k, v, k_max, k_min, labels, channels, lengths), op_bytes)
        add("AsyncTLS operator (end to end)", t, op_bytes, budget, dense_ms)
        fused = jax.jit(functools.partial(asynctls_operator, budget=budget, fused=True))
        t = timed(fused, (q, k, v, k_max, k_min, labels, channels, lengths), op_bytes)
        add("AsyncTLS operator (end to end) [fused selection]", t, op_bytes, budget, dense_ms)
        t = timed(op, (q, k, v, k_max, k_min, records, channels, lengths), meta_bytes + rec_bytes + sel_bytes)
        add("AsyncTLS operator (end to end) [records]", t, meta_bytes + rec_bytes + sel_bytes, budget, dense_ms)
        # the step as the model runs it: the method's selection (the filter over all blocks
        # but the newest, its labels, the sink/window/fallback masks) and its attention
        # (the method's default boxes: 8-bit codes since 2026-11-28)
        fn, state = asynctls_method_step(budget, k, lengths, channels)
        step_bytes = op_bytes - meta_bytes + q8_bytes
        t = timed(fn, (q, k, v, lengths, state), step_bytes)
        add("AsyncTLS method step (model path)", t, step_bytes, budget, dense_ms)
        # the same with the fused second level: in the model path the unfused kernels come with
        # XLA's mask, count and gather around the top-k, which the benchmark operator leaves out
        fn_f, state_f = asynctls_method_step(budget, k, lengths, channels, fused_selection=True)
        t = timed(fn_f, (q, k, v, lengths, state_f), step_bytes)
        add("AsyncTLS method step (model path) [fused selection]", t, step_bytes, budget, dense_ms)
        del state_f
        # the same with block boxes in the cache's dtype (box_bits=None): twice the filter's bytes
        fn_b, state_b = asynctls_method_step(budget, k, lengths, channels, box_bits=None)
        t = timed(fn_b, (q, k, v, lengths, state_b), op_bytes)
        add("AsyncTLS method step (model path) [bf16 boxes]", t, op_bytes, budget, dense_ms)
        del state_b
        if one_program and budget == max(budgets):  # each chain is a compile: the largest K only
            wall_row("AsyncTLS operator [fused selection]", functools.partial(asynctls_operator, budget=budget, fused=True),
                     (q, k, v, k_max, k_min, labels, channels, lengths), op_bytes, budget, dense_wall)
            wall_row("AsyncTLS operator", functools.partial(asynctls_operator, budget=budget),
                     (q, k, v, k_max, k_min, labels, channels, lengths), op_bytes, budget, dense_wall)
            wall_row("AsyncTLS method step (model path)", fn, (q, k, v, lengths, state), step_bytes, budget,
                     dense_wall)
        del state
        if baselines and budget == max(budgets):
            sfull = jax.random.normal(jax.random.key(7), (b, HKV, s), jnp.float32)
            for impl in ("pallas", "reference"):
                t = timed(jax.jit(functools.partial(topk_indices, k=budget, impl=impl)), (sfull,), sfull.size * 4)
                add(f"topk full context S->K [{impl}]", t, sfull.size * 4, budget, dense_ms)
        if flush is not None:
            flush(rows)
    return rows


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r["B"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(6.5 * len(batches), 4.5), squeeze=False)
    for ax, b in zip(axes[0], batches):
        for kernel, style in (("AsyncTLS operator (end to end)", "o-"), ("sparse_decode_attention [pallas]", "s--"),
                              ("block_sparse_decode_attention", "^:")):
            for budget in sorted({r["K"] for r in rows if r["K"]}):
                pts = [(r["S"], r["speedup_vs_dense"]) for r in rows
                       if r["B"] == b and r["kernel"] == kernel and r["K"] == budget]
                if pts:
                    xs, ys = zip(*sorted(pts))
                    ax.plot([x // 1024 for x in xs], ys, style, label=f"{kernel.split(' [')[0]} K={budget}")
        ax.axhline(1.0, color="k", lw=0.8)
        target = 8.0 if b == 1 else 20.0  # the targets for the AsyncTLS operator (B=1 / B=8, 128K)
        ax.axhline(target, color="r", lw=0.8, ls="--", label=f"target {target:.0f}x (AsyncTLS op, 128K)")
        ax.set_xlabel("context S (K tokens)")
        ax.set_ylabel("speedup vs dense cuDNN decode")
        ax.set_yscale("log")
        ax.set_title(f"B={b}, Hq=32, Hkv=8, D=128, bf16")
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="one size only (B=8, S=32K, K=2048)")
    p.add_argument("--runs", type=int, default=30)
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    p.add_argument("--skip-check", action="store_true")
    p.add_argument("--shapes", default=None, help="BxS list, e.g. 1x131072,8x131072 (default: the full grid)")
    p.add_argument("--name", default=None, help="output file stem")
    p.add_argument("--one-program", action="store_true",
                   help="also time dense, the operator and the method step as one step among many in one program "
                        "(wall clock, gaps between kernels included)")
    p.add_argument("--budgets", default=None, help="comma-separated K list (default 512,1024,2048)")
    p.add_argument("--no-baselines", action="store_true",
                   help="skip the jnp references, XLA dense and full-context top-k at the last shape "
                        "(dense cuDNN still runs at every shape)")
    p.add_argument("--merge", default=None, help="comma-separated result JSONs of one device to join (no run)")
    args = p.parse_args(argv)
    budgets = [2048] if args.quick else [512, 1024, 2048]
    if args.budgets:  # checked before any device work
        try:
            budgets = [int(x) for x in args.budgets.split(",")]
        except ValueError:
            sys.exit(f"--budgets: expected comma-separated integers, got {args.budgets!r}")
        if any(k < 1 for k in budgets):
            sys.exit(f"--budgets: every K must be >= 1, got {args.budgets!r}")
    if args.merge:
        runs = [json.loads(Path(f).read_text()) for f in args.merge.split(",")]
        devices = {r["stamp"]["device"] for r in runs}
        if len(devices) > 1:
            sys.exit(f"--merge: the files come from different devices ({sorted(devices)}); compare within one")
        info = dict(runs[0]["stamp"], command=" + ".join(r["stamp"]["command"] for r in runs))
        rows = [row for r in runs for row in r["rows"]]
        name = args.name or "kernels_merged"
        untuned = (sorted({c for r in runs for c in r.get("untuned_classes", [])})
                   if any("untuned_classes" in r for r in runs) else None)
        md = write_all(name, info, runs[0].get("checks", []), rows, args.out, untuned)
        plot(rows, Path(args.out) / f"{name}.png")
        print(md)
        return
    if jax.default_backend() != "gpu":
        sys.exit("benchmarks.kernels needs a GPU (run it through the device tool)")
    info = stamp()
    print(json.dumps(info))
    checks = [] if args.skip_check else check_numerics(jax.random.key(0))
    # B=8, S=128K last: the baselines (references, XLA, full top-k) run there.
    grid = [(8, 32768)] if args.quick else [(b, s) for b in (1, 8, 32) for s in (32768, 131072)]
    if args.shapes:
        grid = [tuple(int(x) for x in item.split("x")) for item in args.shapes.split(",")]
    rows = []
    name = args.name or ("kernels_quick" if args.quick else "kernels")
    for i, (b, s) in enumerate(grid):
        # written after every K of every shape (bench_shape's flush): a run cut off by its time
        # limit keeps its rows
        rows += bench_shape(b, s, budgets, jax.random.key(100 + i), args.runs,
                            baselines=(b, s) == grid[-1] and not args.no_baselines,
                            one_program=args.one_program,
                            flush=lambda shape_rows: write_all(name, info, checks, rows + shape_rows, args.out,
                                                               untuned_classes()))
    md = write_all(name, info, checks, rows, args.out, untuned_classes())
    if not args.quick:
        plot(rows, Path(args.out) / f"{name}.png")
    print(md)


def write_all(name, info, checks, rows, out, untuned=None):
    """``untuned``: the tuned table's shape classes this run looked up and found no entry for
    (``pallas_kernels.tuning.untuned_classes``; those kernels ran their defaults)."""
    payload = {"stamp": info, "hbm_bytes_per_s": H100_HBM_BYTES_PER_S, "checks": checks, "rows": rows}
    if untuned is not None:
        payload["untuned_classes"] = untuned
    cols = ["B", "S", "K", "kernel", "ms", "GB/s", "frac_cudnn_bw", "x_floor_cudnn", "speedup_vs_dense"]
    md = (f"# Decode kernels vs dense cuDNN\n\n{info['device']}, jax {info['jax']}, {info['date']}\n\n"
          f"Command: `{info['command']}`\n\nTimes are CUPTI kernel time (median) where available; "
          "GB/s on the bytes each kernel must move; frac_cudnn_bw = that rate over the rate dense cuDNN reaches "
          "in the same run (its byte floor); x_floor_cudnn = time over the byte floor at cuDNN's rate. "
          "The JSON keeps x_floor against the 2,458 GB/s copy probe and each row's kernel list.\n\n"
          + markdown_table(rows, cols, {"ms": ".4f", "GB/s": ".0f", "frac_cudnn_bw": ".2f", "x_floor_cudnn": ".2f",
                                        "speedup_vs_dense": ".2f"}))
    if checks:
        md += "\n## Numerics (kernel vs reference)\n\n" + markdown_table(checks, ["kernel", "rel_err"], {"rel_err": ".2e"})
    if untuned:
        md += ("\n## Shape classes without a tuned entry\n\nLooked up in this run (the numerics checks' shapes "
               "included) and run with the kernels' defaults; `python -m benchmarks.tune --table` measures "
               "them.\n\n" + "".join(f"- `{c}`\n" for c in untuned))
    write_results(name, payload, md, out)
    return md

if __name__ == "__main__":
    main()
