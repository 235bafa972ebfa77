"""What a long prompt's layer-by-layer prefill holds in temporaries (GPU): issue 49's benchmark C.

The offloaded engine's capacity check counts, beside its batch, the largest temporaries of one
layer's prefill program at the longest prompt bucket (``TieredRunner.prefill_temp_bytes``, XLA's
``memory_analysis``). At 128K on an H100 that term is what refused a sixth AsyncTLS row under
benchmark C's ~49 GB cap (the refusal: 48.18 GiB against 47.09 usable, 2026-12-06), and running
the layer's output projection and MLP in 8,192-token slices (60760c6) took the CPU's figure from
8.19 to 7.07 GiB but left the GPU's where it was. ``python -m benchmarks.probes.prefill_temps``
compiles each layer kind's prefill program at ``--length`` tokens (Qwen3-8B shape, random bf16
weights, serve_load's AsyncTLS; the programs the engine runs) and prints its argument, output and
temporary bytes; with ``--dump`` it has XLA write its memory-usage reports and prints the
largest slices of each program's buffers with the shapes that share them, so the term can be cut
where it is.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
from pathlib import Path

GIB = 1 << 30


def usage_reports(dump_dir: Path, module_hint: str, top: int) -> list[str]:
    """The head of each memory-usage report XLA dumped for modules whose file name contains
    ``module_hint``: the file, its total, and the ``top`` largest slices of its first memory
    space (each slice's size and the shapes of the values that share it over the program)."""
    out = []
    for f in sorted(dump_dir.glob(f"*{module_hint}*memory-usage-report.txt")):
        lines = f.read_text(errors="replace").splitlines()
        at = next((i for i, ln in enumerate(lines) if ln.startswith("Total bytes")), None)
        total = "Total bytes: ?" if at is None else lines[at].strip()
        rows = []
        for ln in lines[0 if at is None else at + 1:]:
            if rows and not ln.strip():
                break  # the first memory space's table ends at its blank line
            if ";" in ln and not ln.lstrip().startswith(("cumulative", "-")):
                rows.append("    " + ln.strip())
        out += [f"{f.name.split('.')[0]} ({module_hint}): {total}", *rows[:top]]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--length", type=int, default=131072, help="the prompt bucket, tokens")
    p.add_argument("--layers", type=int, default=4, help="enough for every layer kind (AsyncTLS keeps its first dense)")
    p.add_argument("--dump", action="store_true",
                   help="XLA's memory-usage reports: each program's largest buffer slices and the shapes sharing them")
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--tsa-keep", type=float, default=None, metavar="F",
                   help="prefill with Token Sparse Attention keeping this fraction (serve_load's NAME+tsa)")
    p.add_argument("--tiny", action="store_true", help="a small random model (a CPU check of this probe)")
    a = p.parse_args(argv)
    if a.length < 64:
        p.error("--length: at least one 64-token block")
    dump_dir = Path(tempfile.mkdtemp(prefix="prefill_temps_")) if a.dump else None
    if dump_dir is not None:  # read once, when the backend starts: set before jax is imported
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_dump_to={dump_dir} --xla_dump_hlo_module_re=.*prefill_layer.*")

    import jax

    from benchmarks.offload import asynctls_for, cache_capacity, qwen3_8b, random_model
    from models.runtime.tiered import TieredRunner

    cfg = dataclasses.replace(qwen3_8b(max(a.length + 1024, 40960)), num_layers=a.layers)
    if a.tiny:
        cfg = dataclasses.replace(cfg, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=128)
    method = asynctls_for(cfg, 256 if a.tiny else 2048, 32)  # serve_load's AsyncTLS
    if a.tsa_keep is not None:
        method = dataclasses.replace(method, prefill="token_sparse", prefill_options=(("keep_fraction", a.tsa_keep),))
        method.sparse_prefill()  # a bad fraction: ValueError before the weights are drawn
    max_len = cache_capacity(a.length, 64)
    model = random_model(cfg, method, max_len)
    runner = TieredRunner(model, "offload", host_pages=a.length // method.for_offload().offload_block_size + 2)
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}: one row of {a.length} tokens, cache {max_len}"
          f"{'' if a.tsa_keep is None else f', TSA prefill keeping {a.tsa_keep}'}", flush=True)
    for what, fn, args, static in runner.prefill_layer_jobs(a.length, max_len, embed=False):
        stats = fn.lower(*args, **static).compile().memory_analysis()
        get = lambda k: int(getattr(stats, k, 0) or 0) / GIB  # noqa: E731
        print(f"{what}: temporaries {get('temp_size_in_bytes'):.2f} GiB, arguments "
              f"{get('argument_size_in_bytes'):.2f}, outputs {get('output_size_in_bytes'):.2f}, "
              f"aliased {get('alias_size_in_bytes'):.2f}", flush=True)
    if dump_dir is not None:
        lines = usage_reports(dump_dir, "prefill_layer", a.top)
        if not lines:
            print(f"no memory-usage report found in {dump_dir}", file=sys.stderr)
            return 1
        print("the layer programs' largest buffer slices (XLA's memory-usage reports):")
        print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
