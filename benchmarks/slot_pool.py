"""Time ``assign_pool_slots`` (the offloaded step's LRU bookkeeping): the Pallas
kernel at several warp counts against the jnp reference, at the Qwen3-8B
offload shape (B=3 x 8 KV heads, 96K context: 1544 blocks of 64, kb 128 ->
127 chosen blocks, pool of 254), for several misses per row.

Each figure is the median over repeats of a jitted ``fori_loop`` of ``--inner``
calls divided by ``--inner`` (a single ~us kernel is below dispatch time), so
it includes the loop's per-iteration elementwise ``+ 0`` on every input
(which keeps XLA from hoisting loop-invariant work). The kernel's figures
also include a copy of ``block_slot`` per iteration (the kernel updates it in
place, and the loop reuses the input), which the reference does not need;
and inside the loop XLA fuses the reference into a few kernels, so its
figure is not what it costs inside a layer's jit (there, the profile of
``benchmarks/offload_profile.py`` is the measure). The kernel's outputs are
checked equal to the reference's first. ``python -m benchmarks.slot_pool``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np


def tables(rng, r, nb, p, n1, misses, hits_oldest=False):
    """Full pools; ``nxt`` = ``n1 - misses`` resident blocks + ``misses`` others.
    Hits carry the newest clocks (the real pattern: the last step used them),
    or the oldest with ``hits_oldest`` (the loop's worst case)."""
    bslot = np.full((r, nb), -1, np.int32)
    sblock = np.zeros((r, p), np.int32)
    sused = np.zeros((r, p), np.int32)
    nxt = np.zeros((r, n1), np.int32)
    for i in range(r):
        blocks = rng.choice(nb - 2, size=p, replace=False)
        sblock[i], bslot[i, blocks] = blocks, np.arange(p)
        sused[i] = rng.integers(0, 1000, size=p)
        hit_slots = rng.choice(p, size=n1 - misses, replace=False)
        sused[i, hit_slots] = 0 if hits_oldest else 1000 + rng.integers(0, 10, size=n1 - misses)
        others = np.setdiff1d(np.arange(nb - 2), blocks)
        nxt[i] = np.concatenate([blocks[hit_slots], rng.choice(others, size=misses, replace=False)])
    ring = np.full((r,), nb - 1, np.int32)
    clock = np.full((r,), 2000, np.int32)
    return nxt, ring, clock, bslot, sblock, sused


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=24)
    ap.add_argument("--blocks", type=int, default=1544)
    ap.add_argument("--pool", type=int, default=254)
    ap.add_argument("--n1", type=int, default=127)
    ap.add_argument("--misses", default="0,2,13,43,127")
    ap.add_argument("--warps", default="1,2,4")
    ap.add_argument("--inner", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", default="")
    a = ap.parse_args(argv)
    from pallas_kernels import slot_pool as sp

    rng = np.random.default_rng(0)
    rows = []
    impls = {"reference": lambda *x: sp.assign_slots_reference(*x)}
    interpret = jax.default_backend() != "gpu"  # a CPU smoke run
    for w in (int(v) for v in a.warps.split(",")):
        impls[f"pallas_w{w}"] = lambda *x, w=w: sp.assign_slots_pallas(*x, num_warps=w, interpret=interpret)
    for misses in (int(v) for v in a.misses.split(",")):
        for oldest in (False, True):
            if oldest and misses in (0, a.n1):
                continue
            args = [jnp.asarray(t) for t in tables(rng, a.rows, a.blocks, a.pool, a.n1, misses, oldest)]
            ref = jax.jit(impls["reference"])(*args)
            row = {"misses": misses, "hits_oldest": oldest}
            for name, fn in impls.items():
                got = jax.jit(fn)(*args)
                ok = all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(ref, got))

                @jax.jit
                def loop(nxt, ring, clock, bslot, sblock, sused, fn=fn):
                    def body(_, acc):
                        # every input depends on the carry (always + 0), so XLA
                        # cannot hoist any of the work out of the loop
                        z = jnp.minimum(acc, 0)
                        out = fn(nxt + z, ring + z, clock + z, bslot + z, sblock + z, sused + z)
                        return acc + out[5][0] + out[6][0]
                    return jax.lax.fori_loop(0, a.inner, body, jnp.int32(0))

                loop(*args).block_until_ready()
                ts = []
                for _ in range(a.repeats):
                    t = time.perf_counter()
                    loop(*args).block_until_ready()
                    ts.append((time.perf_counter() - t) / a.inner)
                row[name + "_us"] = round(1e6 * float(np.median(ts)), 2)
                row[name + "_ok"] = ok
            rows.append(row)
            print(json.dumps(row), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__, "args": vars(a), "rows": rows},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
