"""One AsyncTLS decode step (the model path, ``benchmarks.kernels``' "method step" row) for
Nsight Compute: run on the GPU under ``ncu``.

The profiled range is one step after warm-up, between ``cudaProfilerStart`` and
``cudaProfilerStop`` (through torch's CUDA runtime, on the primary context that XLA also
uses), so ``ncu --profile-from-start off`` leaves the set-up's kernels out::

    XLA_FLAGS=--xla_gpu_enable_command_buffer= XLA_PYTHON_CLIENT_PREALLOCATE=false \\
    XLA_PYTHON_CLIENT_ALLOCATOR=platform \\
    ncu --clock-control none --profile-from-start off -k 'regex:label_logits|topk|sparse_decode|quest' \\
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \\
        --section MemoryWorkloadAnalysis --section InstructionStats --section SourceCounters \\
        -o step python -m benchmarks.probes.ncu_step --batch 8 --seq 131072 --budget 2048
    ncu -i step.ncu-rep --page raw --csv > raw.csv
    ncu -i step.ncu-rep --page source --csv --print-source sass > sass.csv
    python -m benchmarks.probes.ncu_summary raw.csv --sass sass.csv --name ncu_step_h200

Why the environment: XLA's command buffers put the step's kernels inside a CUDA graph;
with XLA's default preallocation ncu saves and restores most of the GPU's memory around
every replay pass (minutes a kernel; with the platform allocator, seconds). ``--clock-control
none`` leaves the clocks as the device's rules ask. ncu flushes the caches between passes,
so durations are cold-L2 and a little above ``benchmarks.kernels``' CUPTI medians.
"""

from __future__ import annotations

import argparse
import sys

BLOCK = 64  # AsyncTLS block size (benchmarks.kernels.BLOCK)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=131072, help="context length (a multiple of 64)")
    p.add_argument("--budget", type=int, default=2048, help="tokens attended (K)")
    p.add_argument("--warmup", type=int, default=3, help="steps before the profiled one")
    args = p.parse_args(argv)
    if args.batch < 1 or args.warmup < 0:
        p.error(f"--batch must be >= 1 and --warmup >= 0, got {args.batch} and {args.warmup}")
    if args.seq < BLOCK or args.seq % BLOCK:
        p.error(f"--seq must be a positive multiple of {BLOCK}, got {args.seq}")
    if not 1 <= args.budget <= args.seq:
        p.error(f"--budget must be in [1, --seq], got {args.budget}")
    return args


def main(argv=None):
    args = parse_args(argv)
    import jax
    import jax.numpy as jnp

    if jax.default_backend() != "gpu":
        sys.exit("benchmarks.probes.ncu_step needs a GPU (run it under ncu through the device tool)")
    try:
        import torch
    except ImportError:
        sys.exit("benchmarks.probes.ncu_step marks the profiled range through torch.cuda.profiler: install torch")
    from benchmarks.kernels import CHANNELS, D, HKV, asynctls_method_step, make_inputs

    torch.cuda.init()
    q, k, v = make_inputs(jax.random.key(0), args.batch, args.seq)
    lengths = jnp.full((args.batch,), args.seq, jnp.int32)
    channels = jnp.tile((jnp.arange(CHANNELS, dtype=jnp.int32) * 3 % D)[None], (HKV, 1))
    step, state = asynctls_method_step(args.budget, k, lengths, channels)
    out = None
    for _ in range(args.warmup):
        out = step(q, k, v, lengths, state)
    jax.block_until_ready(out)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    out = step(q, k, v, lengths, state)
    jax.block_until_ready(out)
    torch.cuda.profiler.stop()
    print(f"profiled one step: B={args.batch} S={args.seq} K={args.budget}", flush=True)


if __name__ == "__main__":
    main()
