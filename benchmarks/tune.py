"""Sweep the kernels' tuning knobs on the GPU and print the best per shape.

    python -m benchmarks.tune --out $OUT

Checks every configuration against the reference before timing it (a fast
wrong kernel is not a result). The defaults in pallas_kernels/ are set from
this sweep's output (committed under benchmarks/results/tune.*).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import (RESULTS_DIR, cold_sets, hbm_floor_ms, markdown_table, rotation_sets, stamp, time_fn,
                               write_results)
from sparse_jax.ops.attention import block_sparse_decode_attention, sparse_decode_attention
from sparse_jax.ops.scoring import (block_label_scores, block_label_topk, build_label_cache, label_scores,
                                    quantize_block_boxes, quest_block_scores, quest_block_scores_quantized)
from sparse_jax.ops.selection import topk_indices

DEADLINE = float("inf")


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def config_key(cfg: dict) -> str:
    """One config as the table stores it (knobs set to None left out), as a comparable string."""
    return json.dumps({k: v for k, v in cfg.items() if v is not None}, sort_keys=True)


@dataclasses.dataclass(frozen=True)
class SweepBest:
    """The fastest correct config of a sweep (falsy when none was timed), whether every
    candidate got its turn (``complete``: none skipped by ``--budget-s``), and the configs that
    were timed (``tried``, as ``config_key``s)."""

    config: dict | None
    ms: float = float("inf")
    complete: bool = True
    tried: frozenset = frozenset()

    def __bool__(self):
        return self.config is not None

    def __getitem__(self, i):  # ``best[0]``, ``best[1]``: what sweep returned before, a (config, ms) tuple
        return (self.config, self.ms)[i]

    def join(self, other: "SweepBest") -> "SweepBest":
        """The faster of two sweeps of one shape, whole only if both were."""
        win = self if not other or (self and self.ms <= other.ms) else other
        return dataclasses.replace(win, complete=self.complete and other.complete, tried=self.tried | other.tried)


def sweep(name, fn, args, ref, configs, nbytes, runs, rows, shape, tol=2e-2, exact=False):
    """``fn(*args, **cfg)`` for each cfg. The arrays are passed as arguments:
    closing over them would embed gigabytes of constants in the program.

    ``args``: one argument tuple, or a list of them that the timed calls cycle
    through (``time_fn(rotate=True)``) so that a kernel whose inputs fit in the L2
    is timed at HBM speed, as in a model; one tuple is cycled with copies of itself
    (``timing.cold_sets`` of ``nbytes``). ``ref`` is the output for the first."""
    best, skipped, tried, sets = None, False, set(), None
    for cfg in configs:
        if time.time() > DEADLINE:
            print(f"  {name} {cfg}: skipped (time budget)", flush=True)
            skipped = True
            continue
        if sets is None:  # built for the first config that runs: none when the budget is spent
            sets = list(args) if isinstance(args, list) else cold_sets(args, nbytes)
        try:
            f = jax.jit(functools.partial(fn, **cfg))
            out = f(*sets[0])
            err = float(np.mean(np.sort(np.asarray(out), -1) != np.sort(np.asarray(ref), -1))) if exact else rel_err(out, ref)
            if err > tol:
                print(f"  {name} {cfg}: WRONG (err {err:.3g})", flush=True)
                rows.append({"kernel": name, "shape": shape, "config": json.dumps(cfg), "ms": float("nan"), "err": err})
                continue
            t = time_fn(f, sets, runs=runs, rotate=True) if len(sets) > 1 else time_fn(f, sets[0], runs=runs)
        except Exception as e:  # noqa: BLE001 - a config that fails to lower is a result too
            print(f"  {name} {cfg}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
            rows.append({"kernel": name, "shape": shape, "config": json.dumps(cfg), "ms": float("nan"), "err": -1.0})
            continue
        gbs = nbytes / (t.best_ms * 1e-3) / 1e9
        rows.append({"kernel": name, "shape": shape, "config": json.dumps(cfg), "ms": t.best_ms, "GB/s": gbs,
                     "x_floor": t.best_ms / hbm_floor_ms(nbytes), "err": err, "kernels": t.kernels})
        print(f"  {name} {shape} {cfg}: {t.best_ms:.4f} ms {gbs:.0f} GB/s err {err:.1e}  kernels: "
              + ", ".join(f"{n[:40]}={ms * 1e3:.1f}us" for n, ms in (t.kernels or [])), flush=True)
        tried.add(config_key(cfg))
        if best is None or t.best_ms < best[1]:
            best = (cfg, t.best_ms)
    if best:
        print(f"BEST {name} {shape}: {best[0]} {best[1]:.4f} ms", flush=True)
    return SweepBest(*(best or (None, float("inf"))), complete=not skipped, tried=frozenset(tried))


def topk_candidates(n: int, k: int, searches=("radix", "bracket"), rows: int | None = None) -> list[dict]:
    """The select kernel's knobs for one shape (``pallas_kernels.topk.topk_pallas``): for the
    radix search warps x radix bits x early exit, for the bracketing search warps (it has no
    radix bits), and for long rows the chunking; only plans the kernel accepts
    (``plan_topk``). Without ``"radix"`` in ``searches``, the tuned table's entry for
    ``rows`` rows (when there is one) stays a candidate, so a sweep of the other search is
    still a comparison in one run."""
    from pallas_kernels.topk import DEFAULT_MAX_SINGLE, plan_topk
    from pallas_kernels.tuning import tuned

    extra = [dict()]
    if n > DEFAULT_MAX_SINGLE:
        extra = [dict(), dict(chunk=8192), dict(chunk=16384), dict(max_single=8192)]
    elif n <= 4096:
        extra = [dict(), dict(block_rows=2)]
    out = []
    # 32 warps for long rows: 8 keys a thread, so each round's count chain is a quarter of
    # 8 warps' (the chain binds the single-row search at B=1: docs/kernels.md, 'Nsight Compute
    # on the step')
    warps = (None, 4, 8, 16, 32) if n >= 8192 else (None, 4, 8, 16)
    cfgs = []
    if "radix" in searches:
        cfgs += [{"num_warps": nw, "radix_bits": rb, "early_exit": ee, **ex}
                 for nw, rb, ee in itertools.product(warps, (1, 2, 4), (True, False)) for ex in extra]
    elif rows and (current := tuned("topk", rows=rows, n=n, k=k)):
        cfgs.append(dict(current))
    if "bracket" in searches:
        cfgs += [{"num_warps": nw, "search": "bracket", "early_exit": True, **ex} for nw in warps for ex in extra]
    for cfg in cfgs:
        plan_args = {a: cfg[a] for a in ("max_single", "chunk", "block_rows", "num_warps") if a in cfg}
        if plan_topk(n, k, **plan_args) is not None:
            out.append(cfg)
    return out


# (B, S, Hq, Hkv, D): the decode shape classes the table covers. Qwen3-8B heads at
# batch 1 / 8 / 32 (the grid), Gemma 3 270M's global layers (MQA, D=256)
# and SmolLM2's (9/3 heads, D=64); then the rest of the issue's grid: B=32 at 128K (index 5),
# B=1 and B=8 at 32K (6, 7). Only the block filter's classes depend on S (blocks a row).
SHAPES = [(1, 131072, 32, 8, 128), (8, 131072, 32, 8, 128), (32, 32768, 32, 8, 128),
          (8, 32768, 4, 1, 256), (8, 8192, 9, 3, 64), (32, 131072, 32, 8, 128),
          (1, 32768, 32, 8, 128), (8, 32768, 32, 8, 128)]
BUDGETS = (1024, 2048)
# (rows, N, k) of the top-k sweep: block top-k over 2048 or 512 block scores, the token
# selection over 8192 candidates, and a full 128K row (oracle top-k); rows = B * Hkv
TOPK_SHAPES = ((8, 2048, 127), (64, 2048, 127), (256, 512, 127), (8, 8192, 2048), (64, 8192, 1024),
               (64, 8192, 2048), (256, 8192, 2048), (64, 131072, 2048))


def topk_sweep_scores(key, rows: int, n: int, kind: str = "auto"):
    """``(float32[rows, n] scores, kind)`` for the top-k sweep. The searches' round counts depend on
    the scores' distribution (the bracketing search interpolates on the values), so the sweep
    times each class on the kind of scores it selects from in the step: ``"labels"``, sums of
    4 softmaxes over the row (AsyncTLS's normalized label scores, 4 query heads a KV head),
    or ``"normal"`` (block bounds are sums of many products). ``"auto"``: labels for rows of
    at least 4,096 (the token selection over a filter's candidates), normal below (the block
    filter)."""
    if kind == "auto":
        kind = "labels" if n >= 4096 else "normal"
    if kind == "normal":
        return jax.random.normal(key, (rows, n), jnp.float32), kind
    if kind == "labels":
        return jax.nn.softmax(jax.random.normal(key, (rows, 4, n), jnp.float32) * 2.0, axis=-1).sum(1), kind
    raise ValueError(f"topk scores: auto, labels or normal, got {kind!r}")


def parse_topk_shapes(text: str) -> list[tuple[int, int, int]]:
    """``"8x8192:2048,64x2048:127"`` -> ``[(8, 8192, 2048), (64, 2048, 127)]``."""
    out = []
    for part in filter(None, text.split(",")):
        try:
            rn, k = part.split(":")
            r, n = rn.split("x")
            out.append((int(r), int(n), int(k)))
        except ValueError:
            raise SystemExit(f"--topk-shapes: expected ROWSxN:K entries, got {part!r}") from None
    return out


def split_candidates(rows: int, work_tiles: int) -> list:
    """``num_splits`` to try: the default (None) and enough for ~1, 2, 4 and 8 waves
    of programs on 132 SMs, never more than the tiles."""
    out = [None]
    for programs in (132, 264, 528, 1056):
        ns = min(work_tiles, max(1, -(-programs // rows)))
        if ns not in out:
            out.append(ns)
    return out


def label_grid_candidates(rows: int, num_cand: int) -> list[dict]:
    """Second-stage knobs of the label kernels: programs per row (``splits``: about 2, 4 and 8
    waves' worth on 132 SMs, at most one per 64 candidates), the candidates a tile holds, and
    how many tiles ahead the gathers are issued (default 2), the query side gathered in the
    kernel (``q_prep="kernel"``, hoisted) instead of an XLA fusion before it, and the heads split
    over two programs (``head_split=2``, the "logits" mode: half the query's registers; ncu saw
    the kernel at 225 registers, 8 warps an SM, waiting on its gathers)."""
    out = []
    for programs in (528, 1056, 2112):
        sp = max(1, min(num_cand // 64, -(-programs // rows)))
        if dict(splits=sp) not in out:
            out.append(dict(splits=sp))
    return out + [dict(block_c=64), dict(block_c=256), dict(prefetch=1), dict(prefetch=3),
                  dict(q_prep="kernel", hoist_q=True), dict(mode="logits", head_split=2),
                  dict(mode="logits", head_split=2, q_prep="kernel", hoist_q=True)]


def two_stage(name, fn, args, ref, first, second, nbytes, runs, rows, shape, **kw):
    """Sweep ``first``, then ``second`` (dicts merged into the best of the first)."""
    best = sweep(name, fn, args, ref, first, nbytes, runs, rows, shape, **kw)
    if not best or not second:
        return best
    more = [{**best.config, **extra} for extra in second]
    return best.join(sweep(name, fn, args, ref, more, nbytes, runs, rows, shape, **kw))


def main(argv=None):
    from pallas_kernels.tuning import TABLE_PATH, shape_class

    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--only", default="",
                   help="comma list: sparse,block,quest,labels,topk,labeltopk,quest8 (the last two only when named)")
    p.add_argument("--shapes", default="", help="indices into SHAPES (default all), e.g. 0,1")
    p.add_argument("--budgets", default=",".join(map(str, BUDGETS)),
                   help="selected tokens K for the sparse and block decode sweeps (default %(default)s)")
    p.add_argument("--topk-shapes", default=",".join(f"{r}x{n}:{k}" for r, n, k in TOPK_SHAPES),
                   help="the top-k sweep's ROWSxN:K shapes (default %(default)s)")
    p.add_argument("--topk-search", default="radix,bracket",
                   help="the top-k sweep's searches (radix, bracket; default both). Without radix the "
                        "tuned table's current entry is timed beside the bracket candidates")
    p.add_argument("--topk-scores", default="auto", choices=("auto", "labels", "normal"),
                   help="the top-k sweep's scores (topk_sweep_scores; default: label-like for rows of "
                        ">= 4,096, normal below)")
    p.add_argument("--budget-s", type=float, default=480, help="stop starting new configs after this long")
    p.add_argument("--table", type=Path, default=None,
                   help=f"write the best configs as the tuned table (e.g. {TABLE_PATH}), under this GPU's "
                        "device kind; merged into an existing file, so a sweep split over several calls (and "
                        "GPUs) builds one table")
    args = p.parse_args(argv)
    if set(args.topk_search.split(",")) - {"radix", "bracket"}:
        p.error(f"--topk-search: radix and/or bracket, got {args.topk_search!r}")
    if jax.default_backend() != "gpu":
        sys.exit("benchmarks.tune needs a GPU")
    global DEADLINE
    DEADLINE = time.time() + args.budget_s
    only = set(filter(None, args.only.split(",")))
    shapes = [SHAPES[int(i)] for i in args.shapes.split(",")] if args.shapes else SHAPES
    rows, best, classes = [], {}, {}
    key = jax.random.key(0)
    for b, s, hq, hkv, d in (shapes if not only or only - {"topk"} else []):
        kq, kk, kv = jax.random.split(jax.random.fold_in(key, b * 1000 + d), 3)
        q = jax.random.normal(kq, (b, hq, d), jnp.bfloat16)
        k = jax.random.normal(kk, (b, hkv, s, d), jnp.bfloat16)
        v = jax.random.normal(kv, (b, hkv, s, d), jnp.bfloat16)
        lengths = jnp.full((b,), s, jnp.int32)
        g = hq // hkv
        for K in [int(x) for x in args.budgets.split(",")]:
            shape = f"B={b} S={s} H={hq}/{hkv} D={d} K={K}"
            counts = jnp.full((b, hkv), K, jnp.int32)
            nbytes = 2 * b * hkv * K * d * 2
            # several random selections, cycled (kernels.py does the same): one selection's
            # rows (64 MB at B=8, K=2048) would otherwise be timed partly from the L2, which
            # tuned K=2048 for a cache that a model never has
            n_sets = rotation_sets(nbytes)
            idx_sets = [jax.random.randint(jax.random.key(K * 16 + i), (b, hkv, K), 0, s, jnp.int32)
                        for i in range(n_sets)]
            idx = idx_sets[0]
            if not only or "sparse" in only:
                ref = sparse_decode_attention(q, k, v, idx, counts, impl="reference")
                first = [dict(block_k=bk, num_splits=ns) for bk in (32, 64, 128)
                         for ns in split_candidates(b * hkv, -(-K // bk))]
                second = [dict(num_warps=4, num_stages=3), dict(num_warps=8, num_stages=2), dict(num_warps=2, num_stages=2),
                          dict(prefetch=1), dict(prefetch=1, num_warps=8), dict(prefetch=1, block_k=64),
                          dict(prefetch=1, block_k=64, num_warps=8), dict(prefetch=1, block_k=32),
                          dict(merge="pallas")]  # the splits merged by one kernel, not XLA's fusions
                r = two_stage("sparse_decode_attention", lambda *a, **c: sparse_decode_attention(*a, impl="pallas", **c),
                              [(q, k, v, i, counts) for i in idx_sets], ref, first, second, nbytes, args.runs,
                              rows, shape)
                if r:
                    best[("sparse", shape)] = r
                    classes[shape_class("sparse_decode", rows=b * hkv, k=K, d=d, g=g)] = (r, shape)
            if not only or "block" in only:
                bidx_sets = [jax.random.randint(jax.random.key(K * 16 + 8 + i), (b, hkv, K // 64), 0, s // 64, jnp.int32)
                             for i in range(n_sets)]
                bidx = bidx_sets[0]
                bc = jnp.full((b, hkv), K // 64, jnp.int32)
                ref = block_sparse_decode_attention(q, k, v, bidx, bc, lengths, block_size=64, impl="reference")
                first = [dict(block_k=bk, num_splits=ns) for bk in (64, 128)
                         for ns in split_candidates(b * hkv, -(-K // bk))]
                second = [dict(num_warps=4, num_stages=3), dict(num_warps=8, num_stages=2), dict(num_warps=8, num_stages=3),
                          dict(merge="pallas")]
                r = two_stage("block_sparse_decode_attention",
                              lambda *a, **c: block_sparse_decode_attention(*a, block_size=64, impl="pallas", **c),
                              [(q, k, v, bi, bc, lengths) for bi in bidx_sets], ref, first, second, nbytes,
                              args.runs, rows, shape)
                if r:
                    best[("block", shape)] = r
                    classes[shape_class("block_sparse_decode", rows=b * hkv, k=K, d=d, g=g, block=64)] = (r, shape)
        shape = f"B={b} S={s} H={hq}/{hkv} D={d}"
        if not only or "quest" in only:
            nb = s // 64
            kmax = jax.random.normal(jax.random.key(3), (b, hkv, nb, d), jnp.bfloat16)
            kmin = kmax - 1
            ref = quest_block_scores(q, kmax, kmin, impl="reference")
            cfgs = [dict(block_n=bn, num_warps=nw, num_stages=st)
                    for bn, nw, st in itertools.product((32, 64, 128, 256), (4, 8), (2, 3))]
            r = sweep("quest_block_scores", lambda *a, **c: quest_block_scores(*a, impl="pallas", **c),
                      (q, kmax, kmin), ref, cfgs, 2 * kmax.size * 2, args.runs, rows, shape, tol=1e-3)
            if r:
                best[("quest", shape)] = r
                classes[shape_class("quest_block_scores", rows=b * hkv, nb=nb, d=d, g=g)] = (r, shape)
        if only and "quest8" in only:  # the 8-bit boxes, in the model path's group-max form
            nb = s // 64
            kmax = jax.random.normal(jax.random.key(3), (b, hkv, nb, d), jnp.bfloat16)
            boxes = quantize_block_boxes(kmax, kmax - 1, jnp.full((b,), s, jnp.int32), block_size=64)
            ref = quest_block_scores_quantized(q, boxes, group_reduce="max", impl="reference")
            # one tile a program (no stages to pipeline), then looping programs; the tensor-core
            # forms with their query side made in every program or once by a small kernel
            cfgs = [dict(block_n=bn, num_warps=nw, num_stages=2, mode=m, prep=pr)
                    for m, pr, bn, nw in itertools.product(("imma", "dot"), ("program", "kernel"), (64, 128, 256), (4, 8))]
            cfgs += [dict(block_n=64, num_warps=4, num_stages=2, mode="fma")]  # the CUDA-core form, for reference
            # programs looping over 2 or 4 tiles: the query side once, the next tile's loads
            # pipelined under this one's dots (ncu: one-shot programs left DRAM underused at B=8;
            # docs/kernels.md, 'Nsight Compute on the step')
            cfgs += [dict(block_n=bn, num_warps=nw, num_stages=ns, mode="imma", prep=pr, tiles=t)
                     for pr, bn, nw, ns, t in itertools.product(("program", "kernel"), (64, 128), (4, 8), (2, 3), (2, 4))
                     if bn == 128 or (nw, ns, t) == (4, 3, 4)]
            r = sweep("quest_block_scores_q8",
                      lambda *a, **c: quest_block_scores_quantized(*a, group_reduce="max", impl="pallas", **c),
                      (q, boxes), ref, cfgs, 2 * kmax.size + 2 * b * hkv * nb * 4, args.runs, rows, shape, tol=1e-3)
            if r:
                best[("quest8", shape)] = r
                classes[shape_class("quest_block_scores_q8", rows=b * hkv, nb=nb, d=d, g=g)] = (r, shape)
        if (not only or "labels" in only) and d // 4 * 4 // 8 in (4, 8, 16, 32):
            r_ch = d // 4
            channels = jnp.tile((jnp.arange(r_ch, dtype=jnp.int32) * 3 % d)[None], (hkv, 1))
            labels = build_label_cache(k, channels)
            nsel = min(128, s // 64)
            blocks = jax.random.randint(jax.random.key(4), (b, hkv, nsel), 0, s // 64, jnp.int32)
            cand = (blocks[..., None] * 64 + jnp.arange(64, dtype=jnp.int32)).reshape(b, hkv, -1)
            cc = jnp.full((b, hkv), cand.shape[-1], jnp.int32)
            ref = label_scores(q, labels, channels, cand, cc, impl="reference")
            w = r_ch // 2
            cfgs = [dict(mode=m, hoist_q=hq_, num_warps=nw)
                    for m, hq_, nw in itertools.product(("logits", "two_pass"), (True, False), (2, 4, 8))]
            # then the grid and the tile on the best: a program walks its share of the candidates
            # one dependent gather at a time, so more programs might hide more of the latency
            # (on the H100 at 128K they did not: tune_labels_quest_h100.md)
            more = label_grid_candidates(b * hkv, cand.shape[-1])
            r = two_stage("label_scores", lambda *a, **c: label_scores(*a, impl="pallas", **c),
                          (q, labels, channels, cand, cc), ref, cfgs, more, b * hkv * cand.shape[-1] * (w + 8 + 4),
                          args.runs, rows, shape, tol=1e-3)
            if r:
                best[("labels", shape)] = r
                classes[shape_class("label_scores", rows=b * hkv, c=cand.shape[-1], w=w, g=g)] = (r, shape)
            # over block ids, as AsyncTLS scores them (no candidate array)
            bcount = jnp.full((b, hkv), nsel, jnp.int32)
            ref = block_label_scores(q, labels, channels, blocks, bcount, lengths, block_size=64, impl="reference")
            r = two_stage("block_label_scores",
                          lambda *a, **c: block_label_scores(*a, block_size=64, impl="pallas", **c),
                          (q, labels, channels, blocks, bcount, lengths), ref, cfgs, more,
                          b * hkv * cand.shape[-1] * (w + 8), args.runs, rows, shape, tol=1e-3)
            if r:
                best[("block_labels", shape)] = r
                classes[shape_class("block_label_scores", rows=b * hkv, c=cand.shape[-1], w=w, g=g, block=64)] = (r, shape)
        if "labeltopk" in only and d // 4 * 4 // 8 in (4, 8, 16, 32):
            # AsyncTLS's second level: unfused kernels against the fused selection kernel,
            # its warps and radix (not in the table: FUSED_LABEL_TOPK says which one runs)
            r_ch = d // 4
            channels = jnp.tile((jnp.arange(r_ch, dtype=jnp.int32) * 3 % d)[None], (hkv, 1))
            labels = build_label_cache(k, channels)
            nsel = min(128, s // 64)
            blocks = jax.random.randint(jax.random.key(4), (b, hkv, nsel), 0, s // 64, jnp.int32)
            bcount = jnp.full((b, hkv), nsel, jnp.int32)
            for K in [int(x) for x in args.budgets.split(",")]:
                kk = min(K, nsel * 64)
                ref = block_label_topk(q, labels, channels, blocks, bcount, lengths, block_size=64, k=kk,
                                       impl="reference")[0]
                cfgs = [dict(fused=False)] + [dict(fused=True, select_num_warps=nw, radix_bits=rb)
                                              for nw, rb in itertools.product((4, 8, 16), (1, 2))]
                r = sweep("block_label_topk",
                          lambda *a, **c: block_label_topk(*a, block_size=64, k=kk, impl="pallas", **c)[0],
                          (q, labels, channels, blocks, bcount, lengths), ref, cfgs,
                          b * hkv * nsel * 64 * (r_ch // 2 + 8), args.runs, rows, f"{shape} K={kk}", exact=True,
                          tol=1e-3)
                if r:
                    best[("labeltopk", f"{shape} K={kk}")] = r
        del q, k, v
    if not only or "topk" in only:
        for rows_, n, kk in parse_topk_shapes(args.topk_shapes):
            sc, kind = topk_sweep_scores(jax.random.key(n + kk), rows_, n, args.topk_scores)
            shape = f"{rows_}x{n} k={kk} ({kind} scores)"
            ref = jax.lax.top_k(sc, kk)[1]
            # every candidate names its knobs: an empty config would read the tuned table
            # (topk_indices does on the GPU), and a win for it would be written back as the
            # kernel's defaults; the defaults are among the candidates
            cfgs = topk_candidates(n, kk, tuple(args.topk_search.split(",")), rows=rows_)
            r = sweep("topk_indices", lambda x, **c: topk_indices(x, kk, impl="pallas", **c), (sc,), ref, cfgs,
                      sc.size * 4, args.runs, rows, shape, exact=True, tol=0.0)
            if r:
                best[("topk", shape)] = r
                classes[shape_class("topk", rows=rows_, n=n, k=kk)] = (r, shape)
            t = time_fn(jax.jit(lambda x: jax.lax.top_k(x, kk)[1]), (sc,), runs=args.runs)
            rows.append({"kernel": "lax.top_k", "shape": shape, "config": "{}", "ms": t.best_ms, "err": 0.0})
            print(f"  lax.top_k {shape}: {t.best_ms:.4f} ms", flush=True)
    info = stamp()
    payload = {"stamp": info, "rows": rows, "best": {f"{k[0]} {k[1]}": (v.config, v.ms) for k, v in best.items()}}
    md = (f"# Kernel tuning sweep\n\n{info['device']}, jax {info['jax']}, {info['date']}\n\nCommand: `{info['command']}`\n\n"
          + markdown_table([r for r in rows if r["ms"] == r["ms"]], ["kernel", "shape", "config", "ms", "GB/s", "x_floor", "err"],
                           {"ms": ".4f", "GB/s": ".0f", "x_floor": ".2f", "err": ".1e"}))
    write_results("tune" + (f"_{args.only.replace(',', '_')}" if args.only else ""), payload, md, args.out)
    print("\n".join(f"BEST {k}: {v}" for k, v in payload["best"].items()))
    if args.table is not None:
        write_table(args.table, classes, info)


def write_table(path: Path, classes: dict, info: dict) -> None:
    """Merge the measured best per shape class (``{class: (SweepBest, shape)}``) into the tuned
    table (``pallas_kernels.tuning``), under the device kind that measured it
    (``info["device"]``, ``jax.devices()[0].device_kind``): another device's entries are left
    as they are, and a lookup on that device never reads these.

    A sweep cut short by ``--budget-s`` replaces a class's entry (this device's) only if it
    timed that entry's config too: otherwise the entry, which may be the faster one, was never
    compared (and the label classes are shared across context lengths, so a short sweep at 32K
    could undo a full one at 128K)."""
    path = Path(path)
    table = json.loads(path.read_text()) if path.exists() else {"devices": {}}
    if "configs" in table:
        raise SystemExit(f"{path}: a tuned table of the old layout (configs by class alone); the table is "
                         "now keyed by device kind, {\"devices\": {kind: {class: entry}}}")
    device = info["device"]
    configs = table.setdefault("devices", {}).setdefault(device, {})
    written = 0
    for cls, (best, shape) in sorted(classes.items()):
        old = configs.get(cls)
        if old and not best.complete and config_key(old["config"]) not in best.tried:
            print(f"kept {cls}: {old['config']} (the sweep at {shape} was cut short before timing it)")
            continue
        configs[cls] = {"config": {k: v for k, v in best.config.items() if v is not None}, "ms": best.ms,
                        "measured_at": shape, "device": device, "date": info["date"]}
        written += 1
    if not configs:  # nothing measured on a device new to the table: no empty entry for it
        del table["devices"][device]
    table["about"] = ("Best kernel tuning per device kind and shape class, written by benchmarks/tune.py --table "
                      "(see pallas_kernels/tuning.py): devices[jax device_kind][shape class]. A device reads only "
                      "its own entries; each entry names the shape it was measured at.")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    print(f"wrote {written} of {len(classes)} classes to {path} under {device!r}")


if __name__ == "__main__":
    main()
