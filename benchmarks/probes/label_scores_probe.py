"""Probe: label-score kernels (Double Sparsity / AsyncTLS token scorer) on the GPU.

Run on the GPU machine (device tool), from the repository root:

    python -m benchmarks.probes.label_scores_probe                # ~1 min of GPU time
    python -m benchmarks.probes.label_scores_probe --sweep        # + a tuning sweep at B=8 (~2-3 min more)
    python -m benchmarks.probes.label_scores_probe --out $OUT     # also write results/*.json|md

Shapes: Hq=32, Hkv=8, D=128, r=32 INT4 channels (16 bytes/token + f32 scale and
offset), a label cache of S=131072 tokens (random codes: the kernels' cost
does not depend on the values), C=8192 candidates per (b, kv-head), B=8 and
B=1. Two candidate sets:

* ``blocks``: 128 distinct random 64-token blocks per (b, kv-head), as the
  AsyncTLS operator makes them (``cand = blocks[..., None] * 64 + arange(64)``);
  timed both as a candidate array (``label_scores``) and as block ids
  (``block_label_scores``, no candidate array);
* ``random``: 8192 random token positions (``label_scores`` only).

Two layouts of the labels: ``LabelCache`` (codes, scales and offsets in three
arrays) and ``LabelRecords`` (one interleaved record per token, the "records"
variants; ``--only records`` runs those, ``--only logits`` both layouts' logits
variants).

Every variant is checked against the jnp reference (max abs error on the
probabilities, which sum to 1 over C), then timed with
``benchmarks.timing.time_fn`` over 4 rotating input sets (different
selections, so the ~13 MB of label rows a call reads are not all L2-warm),
arrays passed as arguments. The table gives the CUPTI device time (all
kernels of the call: XLA prep fusion, kernels, epilogue) and the breakdown.
Bytes that must move at B=8: 64 * 8192 * 24 B = 12.6 MB of label rows
(+ 2 MB of candidate ids for the array path) + 2 MB of output, ~6.5 us at
2.4 TB/s.
"""

from __future__ import annotations

import argparse
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import markdown_table, stamp, time_fn, write_results
from pallas_kernels.labels import LabelCache, interleave_labels
from sparse_jax.ops.scoring import block_label_scores, label_scores

HQ, HKV, D, R, BITS = 32, 8, 128, 32, 4
S, C, BLOCK = 131072, 8192, 64
NSETS = 4

# (name, which API, tuning). "api": "cand" = label_scores on a candidate array,
# "block" = block_label_scores on block ids.
VARIANTS = [
    ("per_tile c64 w8 (old)", "cand", dict(mode="per_tile", block_c=64, num_warps=8, num_stages=2)),
    ("two_pass", "cand", dict(mode="two_pass")),
    ("logits", "cand", dict(mode="logits")),
    ("two_pass", "block", dict(mode="two_pass")),
    ("logits", "block", dict(mode="logits")),
    ("logits hoist_q=False", "block", dict(mode="logits", hoist_q=False)),
    # the interleaved label record (one record per token: codes, scale, offset)
    ("logits records", "cand", dict(mode="logits", layout="records")),
    ("logits records", "block", dict(mode="logits", layout="records")),
]
SWEEP = [
    dict(hoist_q=False), dict(hoist_q=False, prefetch=1), dict(hoist_q=False, num_warps=8),
    dict(prefetch=1), dict(prefetch=3), dict(num_warps=8), dict(splits=8), dict(num_stages=2),
]


def make_cache(key, b):
    k1, k2, k3 = jax.random.split(key, 3)
    packed = jax.random.randint(k1, (b, HKV, S, R * BITS // 8), 0, 256, jnp.int32).astype(jnp.uint8)
    scale = jax.random.uniform(k2, (b, HKV, S), jnp.float32, 0.05, 0.4)
    offset = jax.random.normal(k3, (b, HKV, S), jnp.float32) - 1.5
    return LabelCache(packed, scale, offset)


def make_sets(key, b):
    """NSETS input sets: (block ids, block-expanded candidates, random candidates)."""
    sets = []
    nb_total = S // BLOCK
    for i in range(NSETS):
        kb, kr = jax.random.split(jax.random.fold_in(key, i))
        # 128 distinct blocks per row: the first 128 of a random permutation.
        perm = jax.vmap(lambda k: jax.random.permutation(k, nb_total))(
            jax.random.split(kb, b * HKV)).reshape(b, HKV, nb_total)
        blocks = perm[..., : C // BLOCK].astype(jnp.int32)
        cand_blk = (blocks[..., None] * BLOCK + jnp.arange(BLOCK, dtype=jnp.int32)).reshape(b, HKV, C)
        cand_rnd = jax.random.randint(kr, (b, HKV, C), 0, S, jnp.int32)
        sets.append((blocks, cand_blk, cand_rnd))
    return sets


def run_shape(b, variants, rows, check=True):
    key = jax.random.key(b)
    cache = make_cache(key, b)
    q = jax.random.normal(jax.random.fold_in(key, 1), (b, HQ, D), jnp.bfloat16)
    channels = jnp.tile((jnp.arange(R, dtype=jnp.int32) * 3 % D)[None], (HKV, 1))
    lengths = jnp.full((b,), S, jnp.int32)
    counts = jnp.full((b, HKV), C, jnp.int32)
    bcounts = jnp.full((b, HKV), C // BLOCK, jnp.int32)
    sets = make_sets(jax.random.fold_in(key, 2), b)
    ref_fn = jax.jit(lambda q, lab, ch, cand, n, L: label_scores(q, lab, ch, cand, n, lengths=L,
                                                                impl="reference"))
    refs = {name: np.asarray(ref_fn(q, cache, channels, cand, counts, lengths))
            for name, cand in (("blocks", sets[0][1]), ("random", sets[0][2]))}
    records = interleave_labels(cache, bits=BITS)
    for name, api, tuning in variants:
        tuning = dict(tuning)
        labels = records if tuning.pop("layout", "cache") == "records" else cache
        if api == "block":
            fn = jax.jit(lambda q, lab, ch, bid, n, L, t=tuning: block_label_scores(
                q, lab, ch, bid, n, L, block_size=BLOCK, impl="pallas", **t))
        else:  # one compiled function for both candidate sets (same shapes)
            fn = jax.jit(lambda q, lab, ch, cand, n, L, t=tuning: label_scores(
                q, lab, ch, cand, n, lengths=L, impl="pallas", **t))
        for cands in (("blocks",) if api == "block" else ("blocks", "random")):
            label = f"{name} [{'block ids' if api == 'block' else 'cand array'}]"
            try:
                if api == "block":
                    argsets = [(q, labels, channels, s[0], bcounts, lengths) for s in sets]
                else:
                    argsets = [(q, labels, channels, s[1] if cands == "blocks" else s[2], counts, lengths)
                               for s in sets]
                err = float("nan")
                if check:
                    got = np.asarray(fn(*argsets[0]))
                    err = float(np.max(np.abs(got - refs[cands])))
                t = time_fn(fn, argsets, name=label, rotate=True, runs=30 if NSETS > 2 else 2,
                            warmup=3 if NSETS > 2 else 1)
                kern = ", ".join(f"{_short(n)} {ms * 1e3:.1f}" for n, ms in (t.kernels or []))
                rows.append({"B": b, "cands": cands, "variant": label, "tuning": str(tuning),
                             "layout": type(labels).__name__, "device_us": (t.device_ms or float("nan")) * 1e3,
                             "wall_us": t.wall_ms * 1e3,
                             "max_err": err, "kernels_us": kern})
            except Exception as e:  # noqa: BLE001 - report and go on
                traceback.print_exc()
                rows.append({"B": b, "cands": cands, "variant": label, "tuning": str(tuning),
                             "device_us": float("nan"), "wall_us": float("nan"), "max_err": float("nan"),
                             "kernels_us": f"FAILED: {type(e).__name__}: {str(e)[:120]}"})
            r = rows[-1]
            print(f"B={b} {cands:6s} {label:34s} {r['tuning']:60s} dev {r['device_us']:8.1f} us  "
                  f"wall {r['wall_us']:8.1f} us  err {r['max_err']:.2e}  | {r['kernels_us']}", flush=True)


def _short(name: str) -> str:
    for key in ("label_stats", "label_scores", "label_logits", "label_normalize"):
        if key in name:
            return name[name.index(key):][:40]
    return name[:28]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="8,1")
    ap.add_argument("--sweep", action="store_true", help="also a few tunings of the two modes at B=8")
    ap.add_argument("--out", default=None, help="write label_scores_probe.{json,md} there")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU check of this script)")
    ap.add_argument("--only", default=None, help="only the variants whose name contains this")
    args = ap.parse_args(argv)
    if args.smoke:
        global S, C, NSETS
        S, C, NSETS = 2048, 256, 2
    print(stamp(), flush=True)
    if jax.default_backend() != "gpu":
        print("warning: no GPU: the Pallas kernels run in interpret mode (very slow)", file=sys.stderr)
    rows = []
    variants = [v for v in VARIANTS if args.only is None or args.only in v[0]]
    for b in (int(x) for x in args.batches.split(",")):
        run_shape(b, variants, rows)
    if args.sweep:
        sweep = [(f"{mode} {t}", api, dict(mode=mode, **t)) for mode in ("logits", "two_pass")
                 for api in ("block", "cand") for t in SWEEP]
        run_shape(8, sweep, rows, check=True)
    cols = ["B", "cands", "variant", "layout", "tuning", "device_us", "wall_us", "max_err", "kernels_us"]
    table = markdown_table(rows, cols, {"device_us": ".1f", "wall_us": ".1f", "max_err": ".1e"})
    print()
    print(table)
    if args.out:
        write_results("label_scores_probe", {"stamp": stamp(), "rows": rows}, table, args.out)


if __name__ == "__main__":
    main()
