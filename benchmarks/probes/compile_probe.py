"""What does the paged engine's compiler cost at a long context, and what would cut it?

``python -m benchmarks.probes.compile_probe`` (GPU) builds the paged chunked engine of a
Qwen3-8B-shaped model with random bf16 weights at ``--max-len`` (the pool as large as fits)
and, for the layer driver unrolled (what the GPU runs) and scanned (one layer body, which
XLA compiles once), times:

- ``lower_s`` / ``compile_s``: tracing and XLA's compile of one program, one at a time;
- ``run_ms``: the compiled program on the engine's pool (a chunk of ``--chunk`` prompt
  tokens ending at ``kv_len``; the decode step on every slot), median of ``--runs``
  after one warm-up call, synchronised.

Programs: the decode step on all slots (greedy) and one chunk per ``--kv-lens`` bucket (not
the last chunk of a prompt). At max_len 132,096 the engine's precompile did not finish in
575 s on the H200 (docs/serving.md, 'Precompiling'): this says how much of that is the
unrolled layers, and, run again with ``XLA_FLAGS=--xla_gpu_autotune_level=0``, how much is
the autotuner (the flag is read once per process, so each setting is its own run; the table
records ``XLA_FLAGS``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.offload import qwen3_8b, random_model
from benchmarks.timing import markdown_table, parse_list, stamp, write_results
from models.serving.engine import Engine
from models.serving.paged import chunk_kv_len
from models.serving.pool_programs import paged_programs
from models.sampling import RowSampling
from sparse_jax.methods import get_method


COLUMNS = ["program", "unroll", "lower_s", "compile_s", "run_ms"]


def _time(fn, runs: int) -> float:
    """Median ms of ``fn()`` (which returns what to wait for) after one warm-up call."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def compile_phases(lowered, logdir: str, top: int = 15) -> list[dict]:
    """Where one compile's time goes: ``lowered.compile()`` under ``jax.profiler.trace``, and
    the host events of the trace summed by name (the compiler's passes, autotuning, cuDNN
    graph builds, LLVM and PTX compiles, as XLA names them), longest first: ``{"event",
    "ms", "count"}``. Nested events each count their whole time (a pass pipeline and its
    passes), so the rows overlap; they say which parts are large."""
    import collections
    import re

    from benchmarks.trace_overlap import load_events

    with jax.profiler.trace(logdir):
        lowered.compile()
    events, _ = load_events(logdir)
    total, count = collections.Counter(), collections.Counter()
    for e in events:
        # host events only (the compile is the host's work), not the Python tracer's frames ("$file.py")
        if "/device:" in str(e.process) or e.name.startswith("$"):
            continue
        name = re.sub(r"[._:#]\d+.*$", "", e.name)[:80]
        total[name] += e.dur
        count[name] += 1
    return [{"event": n, "ms": round(t / 1e3, 1), "count": count[n]} for n, t in total.most_common(top)]


def probe(model, kv, unroll: bool, kv_lens: list[int], chunk: int, runs: int) -> list[dict]:
    """Rows for one driver form: each program lowered, compiled and run on ``kv``'s pool (the
    pool is donated and replaced on every call, as the engine does)."""
    step, _, _, _, chunk_fn, _ = paged_programs(model.graphdef, model.config, model.method, unroll)
    slots = kv.slots
    table = np.zeros(kv.pages_per_request, np.int32)  # the null page: the program's work, not the data's
    z = jnp.zeros((slots,), jnp.int32)
    greedy = RowSampling(jnp.zeros(slots, jnp.uint32), z, jnp.zeros(slots, jnp.float32),
                         jnp.ones(slots, jnp.float32), sampled=False)
    rows = []

    def one(what, fn, args, static, call):
        t0 = time.perf_counter()
        low = fn.lower(*args, **static)
        t1 = time.perf_counter()
        exe = low.compile()
        t2 = time.perf_counter()
        row = dict(program=what, unroll=unroll, lower_s=round(t1 - t0, 2), compile_s=round(t2 - t1, 2))
        try:  # the scanned form of the pool programs ran out of memory on an H100 (its scan copies the pool)
            row["run_ms"] = round(_time(lambda: call(exe), runs), 3)
        except Exception as e:  # noqa: BLE001 - the row says why; the other programs still run
            row["run_ms"] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
        print(row, flush=True)
        rows.append(row)

    def run_step(exe):
        out, kv.cache = exe(model.params, z, kv.cache, jnp.ones((slots,), bool), greedy)
        return out.tokens

    one(f"decode step, {slots} rows", step, (model.params, z, kv.cache, jnp.ones((slots,), bool), greedy),
        {"rows": slots}, run_step)
    for n in kv_lens:
        kv_len = chunk_kv_len(n, kv.page, kv.max_len)
        start = max(0, min(n, kv.max_len) - chunk)
        head = (jnp.zeros((1, chunk), jnp.int32), jnp.int32(start), jnp.asarray([kv.max_len - 1], jnp.int32))

        def run_chunk(exe, head=head):
            logits, kv.cache = exe(model.params, *head, kv.cache, jnp.int32(0), jnp.asarray(table))
            return logits

        one(f"chunk of {chunk} tokens, keys {kv_len}", chunk_fn,
            (model.params, *head, kv.cache, jnp.int32(0), jnp.asarray(table)), {"kv_len": kv_len, "last": False},
            run_chunk)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--method", default="dense")
    p.add_argument("--max-len", type=int, default=132096)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--kv-lens", type=parse_list, default=[8192, 131072], help="chunk key buckets to compile")
    p.add_argument("--unroll", default="both", choices=["both", "unrolled", "scanned"])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--tiny", action="store_true", help="a small random model (a CPU check of this probe)")
    p.add_argument("--trace-compile", default=None, metavar="DIR",
                   help="also compile the unrolled chunk of the largest --kv-lens once under jax.profiler.trace "
                        "(into DIR) and list where the compiler's time goes")
    p.add_argument("--out", default=None)
    p.add_argument("--name", default="compile_probe")
    a = p.parse_args(argv)
    if a.chunk < 1 or a.slots < 1 or a.runs < 1 or any(n < 1 for n in a.kv_lens):
        raise SystemExit("--chunk, --slots, --runs and --kv-lens must be >= 1")
    if max(a.kv_lens) > a.max_len:
        raise SystemExit(f"--kv-lens must be <= --max-len {a.max_len}")

    cfg = dataclasses.replace(qwen3_8b(a.max_len), num_layers=a.layers)
    if a.tiny:
        cfg = dataclasses.replace(cfg, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=32,
                                  intermediate_size=128, vocab_size=256)
    method = get_method(a.method)
    model = random_model(cfg, method, a.max_len)
    t0 = time.perf_counter()
    # on a GPU the engine compiles its largest chunk (the last one, keys max_len) to size its pool
    engine = Engine(model, slots=a.slots, max_len=a.max_len, paged=True, prefill_chunk=a.chunk)
    build_s = round(time.perf_counter() - t0, 1)
    print(f"the engine (its pool sized by compiling its largest chunk on a GPU): {build_s} s", flush=True)
    kv = engine.kv
    forms = {"both": (True, False), "unrolled": (True,), "scanned": (False,)}[a.unroll]
    rows = []
    for unroll in forms:
        rows += probe(model, kv, unroll, a.kv_lens, a.chunk, a.runs)
    phases = []
    if a.trace_compile:
        n = max(a.kv_lens)
        chunk_fn = paged_programs(model.graphdef, model.config, model.method, True)[4]
        head = (jnp.zeros((1, a.chunk), jnp.int32), jnp.int32(max(0, n - a.chunk)),
                jnp.asarray([a.max_len - 1], jnp.int32))
        jax.clear_caches()  # compiled above: the traced compile must not be a cache hit
        low = chunk_fn.lower(model.params, *head, kv.cache, jnp.int32(0), jnp.zeros(kv.pages_per_request, jnp.int32),
                             kv_len=chunk_kv_len(n, kv.page, kv.max_len), last=False)
        phases = compile_phases(low, a.trace_compile)
        for r in phases:
            print(r, flush=True)
    st = stamp("python -m benchmarks.probes.compile_probe " + " ".join(sys.argv[1:] if argv is None else argv))
    flags = os.environ.get("XLA_FLAGS", "")
    what = "a tiny config" if a.tiny else "Qwen3-8B shape"
    md = (f"# The paged engine's programs: compile time and run time, unrolled against scanned\n\n{st}\n\n"
          f"{what}, {cfg.num_layers} layers, random bf16 weights, `{a.method}`, max_len {a.max_len}, "
          f"{a.slots} slots, chunks of {a.chunk} tokens; XLA_FLAGS: `{flags}`; the pool "
          f"{kv.blocks.total} pages of {kv.page}. Each program lowered and compiled alone; `run_ms` the "
          f"median of {a.runs} calls after one, on the engine's pool. Building the engine took {build_s} s "
          f"(on a GPU it compiles its largest chunk, the last one with keys {a.max_len}, unrolled, to size its "
          f"pool).\n\n" + markdown_table(rows, COLUMNS) + "\n")
    if phases:
        md += (f"\n## Where the unrolled chunk's compile goes (keys {max(a.kv_lens)}, one compile traced)\n\n"
               "Host events of the trace summed by name; nested events each count their whole time.\n\n"
               + markdown_table(phases, ["event", "ms", "count"]) + "\n")
    write_results(a.name, {"stamp": st, "xla_flags": flags, "engine_build_s": build_s, "rows": rows,
                           "compile_phases": phases}, md, a.out)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
