"""Every multi-device check in one process with four forced CPU devices
(``tests/test_multi_device.py`` runs it; the device count must be set before jax starts, so
these cannot run inside the pytest process):

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python -m tests.multi_device_check OUT_DIR

One process start, one SmolLM2 read and one set of compilations for all of them, each
printing JSON lines (``{"case": ...}``) that the tests read:

* sharded decode against one device, offloaded decoding on a mesh and the engine over it,
  and the generate CLI with ``--tensor-parallel 2`` (:mod:`tests.sharded_check`);
* AsyncSpade's cache rank on a second device, and the CLI with ``--cache-rank``
  (:mod:`tests.cache_rank_check`);
* data-parallel engine replicas (one per device), resident and offloaded;
* ``benchmarks.cache_rank`` and ``benchmarks.multi_gpu`` end to end on a tiny model, their
  results written under OUT_DIR.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import io
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from tests import cache_rank_check, sharded_check
from tests.smollm2_layers import smollm2_layers


def _freeze_what_full_collections_keep():
    """Python's full collections scan every object the process holds, and this one holds
    millions (the jitted programs, their jaxprs and executables, SmolLM2's weights): 26 full
    collections took 13-14 s of the run on the 2-core box. Each full collection's survivors are
    moved out of the collector's way (``gc.freeze``), so the next one scans only what came
    since: 1-2 s for every collection of the run. Reference counting still frees everything;
    only a frozen object's cycle is never collected (the peak RSS stayed ~4.5 GB; the process
    ends after the checks)."""
    def freeze(phase, info):
        if phase == "stop" and info["generation"] == 2:
            gc.freeze()

    gc.callbacks.append(freeze)


def cache_rank_cli_case():
    """The generate CLI with ``--cache-rank`` (:func:`tests.cache_rank_check.cli_case`: the text
    with and without it, the header, the flag refused for another method) on SmolLM2's first 12
    layers: two packs of the cache rank's default 6, its 3 KV heads, real weights and tokenizer,
    ~12 s on the 2-core box where the 30 layers' five packs took ~25 (the rank against one
    device logit by logit, packs of 2, 3 and 6 layers, both transfers and every dispatch: the
    cache_rank step). The text is no weaker a check for it: the 30 layers' text is the same
    with the lag (``window=1``, another selection), the 12 layers' is not."""
    with smollm2_layers(12):
        cache_rank_check.cli_case()


def sharded_case():
    """:mod:`tests.sharded_check`, every case (offload and bf16 included), with SmolLM2's user
    paths (``shard(model, model=2).generate`` and the CLI's ``--tensor-parallel 2``, each against
    one device) on its first 4 layers: real weights, tokenizer and 3 KV heads padded to 4, what
    the cases are about; the decode step, unrolled over the layers on the CPU, compiled for each
    side (its one-device decode compiled per layer), and four 256-token prefills run. 19.6 s
    against 26.6 for the 30 layers (those two cases alone, the 2-core box, 2026-12-07); 9.7 s
    against 13-14 for 12 layers (the weights read apart, 2026-12-07). The texts on each side must
    still be equal and non-empty (a padded head's weights left non-zero on the mesh side makes
    them differ on 4 layers as on 12)."""
    with smollm2_layers(4):
        sharded_check.main(["--bf16", "--with-offload"])


def replicas_case():
    """Two engine replicas (one per device) on a tiny random model, resident, offloaded and
    paged (chunked prefill; each replica's pool on its own device): each request gets its
    single-request tokens, requests alternate while none finishes, both devices serve. (A
    paged engine over a group of devices: ``tests/sharded_check.py``'s engine case.)"""
    import models
    from models.serving.replicas import replicate
    from models.serving.requests import SamplingParams
    from tests.test_engine import _tiny_config

    # prompts of one prefill bucket (64; the paged engine's one chunk of 64): each replica's
    # device compiles a program once, not once per bucket (buckets and a prompt's several chunks
    # are the engine's: tests/test_engine.py, and the sharded engine case over a mesh); budget 32
    # (64 was above two of the five prompts), so Quest selects on all but the shortest
    base = models.load_model(config=_tiny_config(), dtype=jnp.float32, attention="quest",
                             attention_options=dict(budget=32), max_len=256)
    rng = np.random.default_rng(0)
    ids = [rng.integers(4, 97, n).tolist() for n in (60, 40, 50, 55, 30)]
    refs = [base.generate_ids(np.asarray([i], np.int32), np.asarray([len(i)], np.int32), max_new_tokens=6,
                              stop_ids=())[0] for i in ids]
    for where, opts in (("resident", {}), ("offload", dict(offload=True)), ("paged", dict(paged=True, prefill_chunk=64))):
        reps = replicate(base, 2, slots=2, max_len=256, stop_ids=(), **opts).start()
        try:
            reqs = [reps.submit(reps.make_request(i, SamplingParams(max_tokens=6))) for i in ids]
            done = all(r.done.wait(600) for r in reqs)
            s = reps.stats()
            pools = sorted({str(d) for e in reps.engines if e.paged for d in e.kv.cache.layers[-1].pool_k.devices()})
            print(json.dumps(dict(case=f"replicas/{where}", completed=done, pools=pools,
                                  equal=[r.output_ids == ref for r, ref in zip(reqs, refs)],
                                  replicas=[reps.replica_of(r) for r in reqs], given=s["requests_given"],
                                  finished=s["finished"], slots=s["slots"], idle=reps.idle(),
                                  devices=sorted({str(d) for e in reps.engines
                                                  for d in jax.tree.leaves(e.model.params)[0].devices()}))),
                  flush=True)
        finally:
            reps.stop()


def benchmarks_case(out: Path):
    """``benchmarks.cache_rank``, ``benchmarks.multi_gpu`` and ``benchmarks.serve_load
    --tensor-parallel 2`` (their ``main``) on a tiny model."""
    from benchmarks import cache_rank, multi_gpu, serve_load

    # the smallest run of each: one 1-device baseline and one 2-device row (the one-device
    # methods and the sharded layouts themselves are checked by the sharded and cache-rank steps)
    runs = {"cache_rank": (cache_rank, ["--tiny", "--contexts", "512", "--batch", "2", "--budget", "64", "--window",
                                        "4", "--packs", "2", "--steps", "2", "--rounds", "1", "--transfers",
                                        "device_put", "--dispatch", "threads-wait", "--baselines", "asyncspade"]),
            "multi_gpu": (multi_gpu, ["--tiny", "--contexts", "256", "--batch", "1", "--methods", "quest",
                                      "--steps", "2", "--rounds", "1", "--budget", "64"]),
            # the paged engine over two devices under load (issue 52's run, in small)
            "serve_load": (serve_load, ["--tiny", "--tensor-parallel", "2", "--methods", "quest:paged-chunked",
                                        "--prefill-chunk", "64", "--budget", "32", "--rates", "200", "--requests",
                                        "2", "--prompt-mix", "64:1", "--output-min", "2", "--output-max", "3",
                                        "--slots", "2", "--time-limit", "60", "--name", "serve_load"])}
    for name, (mod, args) in runs.items():
        with contextlib.redirect_stdout(io.StringIO()):
            rc = mod.main([*args, "--out", str(out)])
        print(json.dumps(dict(case=f"benchmarks/{name}", rc=rc)), flush=True)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    out = Path(argv[0]) if argv else Path("bench_out/multi_device_check")
    out.mkdir(parents=True, exist_ok=True)
    if len(jax.devices()) < 4:
        raise SystemExit("needs 4 devices: XLA_FLAGS=--xla_force_host_platform_device_count=4")
    # SmolLM2's weights read once for the process, as tests/conftest.py does in the pytest processes:
    # the API case, the generate CLI's five runs (with and without --tensor-parallel and --cache-rank,
    # the refused --tensor-parallel 8) each read them again (~2-9 s a read)
    from models import api
    api.read_real_weights = functools.lru_cache(maxsize=4)(api.read_real_weights)
    _freeze_what_full_collections_keep()
    steps = {"sharded": sharded_case,
             "cache_rank": cache_rank_check.tiny_cases, "cache_rank_cli": cache_rank_cli_case,
             "replicas": replicas_case, "benchmarks": lambda: benchmarks_case(out)}
    for name, step in steps.items():  # each step's time, so the slow one shows in the test's output
        t0 = time.perf_counter()
        step()
        print(json.dumps(dict(case=f"time/{name}", seconds=round(time.perf_counter() - t0, 1))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
