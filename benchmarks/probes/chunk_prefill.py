"""What one chunk of the paged engine's chunked prefill costs, against its floor (GPU).

``python -m benchmarks.probes.chunk_prefill`` builds the Qwen3-8B shape with random bf16
weights and a paged engine of one slot (:class:`models.serving.engine.Engine`,
``paged=True``), then times the chunk program the engine runs beside its decode steps
(:meth:`models.serving.paged.PagedSlots.run_on_pool` over ``PagedSlots._chunk``, the whole
cache donated, waited for) for each chunk size (``--chunks``) ending at each prompt position
(``--ends``): a chunk of ``C`` tokens at ``start = end - C`` of a prompt of ``max(--ends)``
tokens, every layer writing its K/V into the pages and attending the keys before it.

Floor per chunk: the larger of
- FLOPs: the layers' matrix products (``2 x C x`` the layers' weights) plus causal attention
  (``4 x layers x Hq x D x C x (start + C/2)``), at the matrix rate measured in the same run
  (a bf16 8192^3 product, median);
- bytes: the weights read once plus the chunk's keys gathered from the pages (K and V of the
  ``kv_len`` bucket, read and written), at the copy bandwidth measured in the same run.

``--profile C:END`` traces a few calls of that chunk with :mod:`jax.profiler` and prints its
device time by kind of kernel (matrix products, attention, the pages' gathers and scatters,
the rest), which says where a chunk's time over its floor goes.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import markdown_table, parse_list, stamp, write_results

#: kernel names by kind (the first that matches)
KINDS = (("attention", re.compile(r"cudnn|fmha|flash|sdpa|attention", re.I)),
         ("matmul", re.compile(r"gemm|nvjet|cutlass|xmma|sm90|matmul|dot", re.I)),
         ("gather/scatter", re.compile(r"gather|scatter|dynamic.slice|dynamic.update|transpose|copy", re.I)))


def kind_of(name: str) -> str:
    for kind, pat in KINDS:
        if pat.search(name):
            return kind
    return "other"


def layer_weights(cfg) -> int:
    """Parameters a token multiplies through in the layers (attention and MLP projections)."""
    h, d = cfg.hidden_size, cfg.head_dim
    attn = h * d * (cfg.num_heads * 2 + cfg.num_kv_heads * 2)
    mlp = 3 * h * cfg.intermediate_size
    return cfg.num_layers * (attn + mlp)


def ceilings() -> tuple[float, float]:
    """(bf16 matrix FLOP/s, copy bytes/s) measured here: an 8192^3 product, a 2 GiB copy."""
    n = 8192
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    mm = jax.jit(lambda a, b: a @ b)
    x = jax.random.normal(jax.random.key(2), (2 ** 30,), jnp.bfloat16)
    cp = jax.jit(lambda x: x * 1)

    def med(f, *args, runs=20):
        jax.block_until_ready(f(*args))
        ts = []
        for _ in range(runs):
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args))
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    flops = 2 * n ** 3 / med(mm, a, b)
    bw = 2 * x.nbytes / med(cp, x)
    return flops, bw


def main(argv=None) -> int:
    from benchmarks import trace_overlap
    from benchmarks.offload import asynctls_for, qwen3_8b, random_model
    from models.serving.buckets import padded_prompt
    from models.serving.engine import Engine
    from models.serving.paged import chunk_kv_len, page_size
    from models.serving.requests import SamplingParams
    from sparse_jax.methods import get_method

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--methods", default="dense,asynctls")
    p.add_argument("--chunks", type=parse_list, default=[512, 1024, 2048, 4096])
    p.add_argument("--ends", type=parse_list, default=[8192, 32768, 65536, 131072],
                   help="prompt positions the timed chunks end at")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--budget", type=int, default=2048, help="asynctls: its token budget")
    p.add_argument("--kb", type=int, default=128, help="asynctls: blocks of its filter")
    p.add_argument("--profile", default=None, help="C:END, a chunk to trace (first method)")
    p.add_argument("--tiny", action="store_true", help="a small random model (a CPU check of this probe)")
    p.add_argument("--out", default=None)
    p.add_argument("--name", default="chunk_prefill")
    a = p.parse_args(argv)

    n = max(a.ends)
    max_len = n + 64
    cfg = dataclasses.replace(qwen3_8b(max_len), num_layers=a.layers)
    if a.tiny:
        cfg = dataclasses.replace(cfg, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=128)
    on_gpu = jax.default_backend() == "gpu"
    peak, bw = ceilings() if on_gpu else (1e12, 1e11)
    print(f"ceilings: {peak / 1e12:.0f} TFLOP/s bf16, {bw / 1e12:.2f} TB/s copy", flush=True)
    w_flops = 2 * layer_weights(cfg)
    w_bytes = 2 * layer_weights(cfg)  # bf16
    kv_token = 2 * cfg.num_kv_heads * cfg.head_dim * 2  # K and V, bf16, one layer
    rows, profile = [], None
    rng = np.random.default_rng(0)
    ids = rng.integers(0, cfg.vocab_size, n).tolist()
    for name in a.methods.split(","):
        method = asynctls_for(cfg, a.budget, a.kb) if name == "asynctls" else get_method(name)
        model = random_model(cfg, method, max_len)
        page = page_size(method)
        engine = Engine(model, slots=1, max_len=max_len, stop_ids=(), paged=True,
                        kv_blocks=-(-max_len // page) + 1, prefill_chunk=min(a.chunks))
        kv = engine.kv
        r = engine.make_request(ids, SamplingParams(max_tokens=1, ignore_eos=True))
        assert kv.reserve(r, n + 1)
        table = kv.blocks.table(r.id)
        lengths = jnp.asarray([n], jnp.int32)

        def call(c, end, last=False):
            start = end - c
            toks = jnp.asarray(padded_prompt(ids[start:end], c, model._pad_id()))
            logits = kv.run_on_pool(kv._chunk, "a probe chunk", (toks, jnp.int32(start), lengths), 0, table,
                                    wait=False, kv_len=chunk_kv_len(end, page), last=last)
            # the pages: a non-last chunk's logits do not wait for its layers
            jax.block_until_ready((logits, kv.cache))
            return logits

        for c in a.chunks:
            for end in a.ends:
                if end < c:
                    continue
                last = end == n  # the prompt's last chunk also computes the method state
                call(c, end, last)  # compiles
                ts = []
                for _ in range(a.rounds):
                    t0 = time.perf_counter()
                    logits = call(c, end, last)
                    ts.append(1e3 * (time.perf_counter() - t0))
                if end == n:  # a non-last chunk's logits are of no position of the prompt
                    assert np.isfinite(np.asarray(logits, np.float32)).all(), (name, c, end)
                start = end - c
                attn = 4.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim * c * (start + c / 2)
                flop_ms = 1e3 * (w_flops * c + attn) / peak
                byte_ms = 1e3 * (w_bytes + cfg.num_layers * 2 * chunk_kv_len(end, page) * kv_token) / bw
                ms = statistics.median(ts)
                row = {"method": name, "chunk": c, "end": end, "last": last, "ms": round(ms, 2),
                       "ms_per_1k_tokens": round(1e3 * ms / c, 2), "gemm_floor_ms": round(1e3 * w_flops * c / peak, 2),
                       "attn_floor_ms": round(1e3 * attn / peak, 2), "floor_ms": round(max(flop_ms, byte_ms), 2),
                       "over_floor": round(ms / max(flop_ms, byte_ms), 2)}
                rows.append(row)
                print(row, flush=True)
        if a.profile and profile is None:
            c, end = (int(x) for x in a.profile.split(":"))
            call(c, end)
            d = tempfile.mkdtemp(prefix="chunk_prefill_trace")
            jax.profiler.start_trace(d)
            for _ in range(3):
                call(c, end)
            jax.profiler.stop_trace()
            ev, _ = trace_overlap.load_events(d)
            rep = trace_overlap.overlap_report(ev, top=400)
            by_kind: dict[str, float] = {}
            top = []
            for row in rep["top_names"].get("compute", []):
                k = kind_of(row["name"])
                by_kind[k] = by_kind.get(k, 0.0) + row["total_us"] / 3e3
                top.append({"kind": k, "ms": round(row["total_us"] / 3e3, 3), "calls": row["count"] // 3,
                            "kernel": row["name"][:90]})
            profile = {"method": name, "chunk": c, "end": end,
                       "busy_ms": round(rep["gpu_busy_us"] / 3e3, 2), "idle_ms": round(rep["gpu_idle_us"] / 3e3, 2),
                       **{f"{k}_ms": round(v, 2) for k, v in sorted(by_kind.items())}}
            print(profile, flush=True)
            for t in top[:15]:
                print(t, flush=True)
            profile["top"] = top[:15]
        kv.release(r)
        del engine, kv, model

    cols = ["method", "chunk", "end", "last", "ms", "ms_per_1k_tokens", "gemm_floor_ms", "attn_floor_ms", "floor_ms",
            "over_floor"]
    md = (f"# One chunk of chunked prefill against its floor\n\n{stamp()}\n\n"
          f"{'a tiny config' if a.tiny else 'Qwen3-8B shape'}, {a.layers} layers, random bf16 weights; ceilings "
          f"measured in this run: {peak / 1e12:.0f} TFLOP/s (bf16 8192^3), {bw / 1e12:.2f} TB/s (copy).\n\n"
          + markdown_table(rows, cols) +
          "\n\n`ms`: the chunk program (`last`: the prompt's last chunk, which also computes the method state) (every layer; K/V into the pages; attention over the keys before it), "
          f"waited for, median of {a.rounds}. `floor_ms`: the larger of the FLOP time (matrix products + causal "
          "attention at the measured rate) and the byte time (weights + the keys' bucket gathered).\n")
    if profile:
        md += ("\n## Where one chunk's time goes\n\n" + markdown_table([{k: v for k, v in profile.items() if k != "top"}],
                                                                       [k for k in profile if k != "top"])
               + "\n\n" + markdown_table(profile["top"], ["kind", "ms", "calls", "kernel"]) + "\n")
    print(md)
    if a.out:
        write_results(a.name, {"rows": rows, "profile": profile, **stamp()}, md, out_dir=a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
