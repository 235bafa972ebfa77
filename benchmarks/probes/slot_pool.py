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
``benchmarks/probes/offload_profile.py`` is the measure). The kernel's outputs are
checked equal to the reference's first. ``python -m benchmarks.probes.slot_pool``.

``--shared``: the shared pool (``assign_shared_pool_slots``) at the same shape: one
pool per KV head of ``--rows / --heads`` rows x ``--pool`` slots (the per-row pools'
bytes), each row needing ``--n1`` blocks of which ``misses`` are not resident. Its
kernel runs one program per pool over every row's blocks (the per-row kernel: one
program per row and head), which is what this compares.
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


def shared_tables(rng, m, r, nb, p, n1, misses, hits_oldest=False):
    """:func:`tables` for the shared pool: ``m`` rows x ``r`` pools of ``m * p`` slots,
    each (row, pool) drawn as one per-row pool of :func:`tables`, its ``p`` resident
    blocks in slots ``[row * p, (row + 1) * p)`` of the pool, ids ``row * nb + block``."""
    nxt, _, _, bslot, sblock, sused = tables(rng, m * r, nb, p, n1, misses, hits_oldest)
    row = np.arange(m)[:, None, None]
    bslot = bslot.reshape(m, r, nb)
    bslot = np.where(bslot >= 0, bslot + row * p, -1).astype(np.int32)
    sblock = (sblock.reshape(m, r, p) + row * nb).transpose(1, 0, 2).reshape(r, m * p).astype(np.int32)
    sused = sused.reshape(m, r, p).transpose(1, 0, 2).reshape(r, m * p)
    ring = np.full((m,), nb - 1, np.int32)
    clock = np.full((r,), 2000, np.int32)
    return nxt.reshape(m, r, n1), ring, clock, bslot, sblock, sused


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
    ap.add_argument("--shared", action="store_true", help="time the shared pool instead (see the docstring)")
    ap.add_argument("--heads", type=int, default=8, help="with --shared: KV heads (pools); rows / heads = batch")
    ap.add_argument("--json", default="")
    a = ap.parse_args(argv)
    if a.shared and a.rows % a.heads:
        ap.error(f"--shared needs --rows ({a.rows}) divisible by --heads ({a.heads})")
    from pallas_kernels import slot_pool as sp

    rng = np.random.default_rng(0)
    rows = []
    ref_fn, pallas_fn = ((sp.assign_shared_reference, sp.assign_shared_pallas) if a.shared
                         else (sp.assign_slots_reference, sp.assign_slots_pallas))
    impls = {"reference": lambda *x: ref_fn(*x)}
    interpret = jax.default_backend() != "gpu"  # a CPU smoke run
    for w in (int(v) for v in a.warps.split(",")):
        impls[f"pallas_w{w}"] = lambda *x, w=w: pallas_fn(*x, num_warps=w, interpret=interpret)
    for misses in (int(v) for v in a.misses.split(",")):
        for oldest in (False, True):
            if oldest and misses in (0, a.n1):
                continue
            t = (shared_tables(rng, a.rows // a.heads, a.heads, a.blocks, a.pool, a.n1, misses, oldest) if a.shared
                 else tables(rng, a.rows, a.blocks, a.pool, a.n1, misses, oldest))
            args = [jnp.asarray(x) for x in t]
            ref = jax.jit(impls["reference"])(*args)
            row = {"pool": "shared" if a.shared else "per_row", "misses": misses, "hits_oldest": oldest}
            for name, fn in impls.items():
                got = jax.jit(fn)(*args)
                ok = all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(ref[:3], got[:3]))
                # the copy lists: equal up to their counts (entries past them are unspecified)
                cnt = np.asarray(ref[5])
                ok &= np.array_equal(cnt, np.asarray(got[5])) and np.array_equal(np.asarray(ref[6]), np.asarray(got[6]))
                live = np.arange(a.n1) < cnt[..., None]
                ok &= all(np.array_equal(np.where(live, np.asarray(x), 0), np.where(live, np.asarray(y), 0))
                          for x, y in zip(ref[3:5], got[3:5]))

                @jax.jit
                def loop(nxt, ring, clock, bslot, sblock, sused, fn=fn):
                    def body(_, acc):
                        # every input depends on the carry (always + 0), so XLA
                        # cannot hoist any of the work out of the loop
                        z = jnp.minimum(acc, 0)
                        out = fn(nxt + z, ring + z, clock + z, bslot + z, sblock + z, sused + z)
                        return acc + jnp.sum(out[5]) + jnp.sum(out[6])
                    return jax.lax.fori_loop(0, a.inner, body, jnp.int32(0))

                loop(*args).block_until_ready()
                ts = []
                for _ in range(a.repeats):
                    t = time.perf_counter()
                    loop(*args).block_until_ready()
                    ts.append((time.perf_counter() - t) / a.inner)
                row[name + "_us"] = round(1e6 * float(np.median(ts)), 2)
                row[name + "_ok"] = bool(ok)
            rows.append(row)
            print(json.dumps(row), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__, "args": vars(a), "rows": rows},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
