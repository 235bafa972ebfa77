"""How many arrays XLA's pinned-host pool places under its limit, against the planner's model (GPU).

Issue 49's benchmark C: the paged offloaded engine's host tier is two page arrays (K and V) per
offloaded layer, allocated from XLA's pinned-host pool, a growing best-fit allocator whose limit
is ``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB``. On an H100 (2026-12-07) the 68th array of 1.503 GiB
failed under a 105 GiB limit that the arrays' bytes fit by 0.01 GiB.
:func:`sparse_jax.offload.capacity.bfc_fits` models the allocator (regions doubling from 2 MiB,
no array across two regions) and the engine plans its host pages by it
(:func:`~sparse_jax.offload.capacity.pages_the_pool_places`). This probe checks the model where
it matters, on the machine, with no model or compile: for each array size, a fresh process (the
limit is read once, when jax's GPU client starts) copies one device array of that size to
``pinned_host`` until an allocation fails (at most ``--count``), and the table puts the count
placed beside the model's::

    python -m benchmarks.probes.pinned_pool --limit-gib 105 --sizes 1613496320,1572208640,1073741824

(the defaults: the failed run's 12,310-page array, the 11,995 pages the planner now gives that
run, and 1 GiB, which packs every region). The CPU has no such pool (its ``pinned_host`` memory
is ordinary memory): there every copy is placed, and the model's column is the only figure.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

GIB = 1 << 30
#: the failed H100 run's page array (12,310 pages of 131,072 bytes), what the planner now gives
#: that run (11,995 pages), and a power of two
DEFAULT_SIZES = (1_613_496_320, 1_572_208_640, GIB)


def place(size: int, count: int) -> dict:
    """Copy one device array of ``size`` bytes to ``pinned_host`` up to ``count`` times, every
    copy kept, until an allocation fails: how many were placed, the first error line, seconds."""
    import jax
    import jax.numpy as jnp

    from sparse_jax.offload.tiers import pinned_host_sharding

    pinned = pinned_host_sharding()  # the first device's pinned_host memory, as the host tier's arrays
    x = jnp.zeros((size,), jnp.uint8)
    kept, error, t0 = [], None, time.perf_counter()
    for _ in range(count):
        try:
            y = jax.device_put(x, pinned)
            y.block_until_ready()
        except Exception as e:  # noqa: BLE001 - the allocator's refusal is the measurement
            error = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            break
        kept.append(y)
    placed = len(kept)
    del kept
    return {"placed": placed, "error": error, "seconds": round(time.perf_counter() - t0, 2)}


def probe(sizes, count: int, limit_bytes: int, *, fresh_process: bool = True, limit_gib: int | None = None) -> list[dict]:
    """One row per size: ``placed`` (measured), ``model`` (:func:`bfc_fits` of ``count`` such
    arrays under ``limit_bytes``), whether they agree. ``fresh_process``: each size in its own
    process with the pool's limit set to ``limit_gib`` (a GPU's pool is per process and grows
    only); else here, in this process's pool (the CPU test's form)."""
    from sparse_jax.offload.capacity import PINNED_LIMIT_ENV, bfc_fits

    rows = []
    for size in sizes:
        if fresh_process:
            env = dict(os.environ, **{PINNED_LIMIT_ENV: str(limit_gib)})
            proc = subprocess.run([sys.executable, "-m", "benchmarks.probes.pinned_pool", "--one", str(size),
                                   "--count", str(count)], env=env, capture_output=True, text=True)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
            got = json.loads(lines[-1]) if proc.returncode == 0 and lines else {
                "placed": None, "error": f"the probe process failed (rc={proc.returncode}): "
                                         f"{proc.stderr.strip()[-300:]}", "seconds": None}
        else:
            got = place(size, count)
        model = bfc_fits(limit_bytes, [size] * count)
        rows.append({"bytes": int(size), "gib": round(size / GIB, 4), "count": count, "model": model, **got,
                     "agree": got["placed"] == model})
        # each size as it lands: pinning ~100 GiB takes minutes, and a call cut off keeps what it printed
        print(json.dumps(rows[-1]), flush=True)
    return rows


def render(payload: dict) -> str:
    s = payload["stamp"]
    lines = [f"# XLA's pinned-host pool against `capacity.bfc_fits` ({s['device']}, jax {s['jax']}, {s['date']})", "",
             f"`{s['command']}` (commit {s['git_commit']}); limit {payload['limit_gib']} GiB"
             f"{'' if payload['pool'] else ' (no pinned pool on this backend: every copy is placed)'}.", "",
             "| array bytes | GiB | tried | placed | model | agree | seconds | first error |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in payload["rows"]:
        lines.append(f"| {r['bytes']:,} | {r['gib']} | {r['count']} | {r['placed']} | {r['model']} | "
                     f"{'yes' if r['agree'] else '**no**'} | {r['seconds']} | {r['error'] or ''} |")
    n = sum(r["agree"] for r in payload["rows"])
    lines += ["", f"The model agrees on {n} of {len(payload['rows'])} sizes."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--limit-gib", type=int, default=105, help="the pinned pool's limit (XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB)")
    p.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)), help="array sizes in bytes, comma-separated")
    p.add_argument("--count", type=int, default=0, help="most arrays tried a size (default: the limit's worth + 2)")
    p.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    p.add_argument("--name", default="pinned_pool")
    p.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # a fresh process's one size
    a = p.parse_args(argv)
    if a.one is not None:
        print(json.dumps(place(a.one, a.count)), flush=True)
        return 0
    try:
        sizes = [int(x) for x in a.sizes.split(",") if x.strip()]
    except ValueError:
        p.error(f"--sizes: comma-separated byte counts, got {a.sizes!r}")
    if not sizes or min(sizes) < 1:
        p.error("--sizes: at least one size of at least 1 byte")
    if a.limit_gib < 1 or a.count < 0:
        p.error("--limit-gib: at least 1; --count: not negative")
    limit = a.limit_gib * GIB
    count = a.count or limit // min(sizes) + 2
    # neither this process nor a size's own takes 75% of the GPU up front: each would refuse the next
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"

    import jax

    from benchmarks.timing import stamp, write_results

    pool = jax.default_backend() == "gpu"
    if not pool and count * max(sizes) > GIB:  # nothing to measure there, and the copies are real memory
        p.error(f"no pinned pool on the {jax.default_backend()} backend: {count} copies of up to {max(sizes):,} bytes "
                f"would only fill ordinary memory; on a CPU keep --count x the largest size within 1 GiB")
    rows = probe(sizes, count, limit, fresh_process=pool, limit_gib=a.limit_gib)
    payload = {"stamp": stamp(), "limit_gib": a.limit_gib, "pool": pool, "rows": rows}
    md = render(payload)
    write_results(a.name, payload, md, a.out)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
