"""Decode throughput on several GPUs against one (:mod:`models.runtime.sharding`).

``python -m benchmarks.multi_gpu`` (on a machine with two or more GPUs) times a
Qwen3-8B-shaped model with random bf16 weights (36 layers, 32/8 heads, D=128)
at each context (default 128K, 64K) and method (default dense, AsyncTLS and
Quest, all resident):

* one GPU at ``--batch`` rows per GPU (the unsharded program the rest of the
  project runs, ``models.programs.build_functions``);
* ``n`` GPUs with tensor parallelism over KV heads (``model=n``) at ``n``
  times the batch: the same KV bytes per GPU, so the throughput ratio is what
  a second GPU buys;
* optionally (``--dp``) ``n`` data-parallel replicas at the same batch.

Each row: median time per decode step over back-to-back rounds (tokens kept on
the device between steps, one sync per round), tokens/s, the ratio to one GPU,
and the HBM floor of a step (weights + KV + the method's state read once, per
GPU, at the measured cuDNN rate). The KV content is synthetic (random keys and
values drawn per row, so row ``r`` holds the same data in every
configuration); the first step's logits of the rows shared with the one-GPU run
are compared (max |difference| and argmax agreement), a numerics cross-check
of the sharded program on real shapes.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import logit_agreement, markdown_table, stamp, write_final_results, write_results
from models.runtime.sharding import shard

# HBM read rate per GPU for the floors: the H100's is cuDNN dense decode's measured rate
# (issue 18); the H200's is its nominal peak (4.8 TB/s; not measured here), so H200
# floors are optimistic and a step can land closer to them than on the H100
HBM_BYTES_PER_S = {"H100": 3.09e12, "H200": 4.8e12}


def hbm_rate(device_kind: str) -> tuple[float, str]:
    for key, rate in HBM_BYTES_PER_S.items():
        if key in device_kind:
            return rate, ("measured cuDNN rate" if key == "H100" else "nominal peak")
    return HBM_BYTES_PER_S["H100"], "H100 rate (unknown device)"


def floor_bytes(cfg, method, *, batch: int, context: int, gpus: int, data: int) -> float:
    """Bytes one GPU must read per decode step, at least: its share of the layer
    weights, the LM head, and its rows' and heads' K/V that the method attends: every
    token on dense layers, ``budget`` tokens per KV head on sparse ones (a lower bound
    for the sparse methods: their block boxes and labels are not counted)."""
    tp = gpus // data
    emb = cfg.vocab_size * cfg.hidden_size * 2
    layer_weights = cfg.num_params() * 2 - emb * (1 if cfg.tie_embeddings else 2)
    per_token_head = 2 * cfg.head_dim * 2  # K and V, bf16
    kv = 0
    for i in range(cfg.num_layers):
        sparse = method.name != "dense" and method.is_sparse_layer(i, cfg.num_layers)
        tokens = min(getattr(method, "budget", context), context) if sparse else context
        kv += tokens * per_token_head * cfg.num_kv_heads * batch
    return layer_weights / tp + emb + kv / gpus  # the head matrix is read once per step


def build_method(name: str, cfg, budget: int):
    from benchmarks.offload import asynctls_for
    from sparse_jax.methods import get_method

    if name == "asynctls":
        return asynctls_for(cfg, budget, kb=128)
    if name == "quest":
        return get_method("quest", budget=budget)
    return get_method(name)


def fill_function(cfg, method, mesh, *, batch: int, max_len: int, context: int, dtype):
    """``fill(cache, key) -> cache``: random K/V in every layer (row ``r`` of layer ``i``
    drawn from ``fold_in(fold_in(key, i), r)``: the same whatever the batch or the
    mesh), ``context`` valid tokens per row, then the method's state of each sparse
    layer built from its K/V on each device (``shard_map``)."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from models.runtime import sharding as sh
    from models.driver import Driver, prompt_state
    from models.transformer import layer_graphdef
    from sparse_jax.cache import KVCache, LayerCache
    from sparse_jax.methods.base import LayerCtx

    par = sh.Parallelism.of(mesh)
    local = sh.local_config(cfg, par.model)
    specs = sh.cache_specs(cfg, method, batch, max_len, jnp.dtype(dtype), par)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    drv = Driver(local, method, layer_graphdef(local, jnp.dtype(dtype)), True, tp_axis=sh.MODEL, tp_size=par.model)

    def kv(cache, key):
        def rows(k, shape):
            return jax.vmap(lambda r: jax.random.normal(jax.random.fold_in(k, r), shape, dtype))(jnp.arange(batch))

        layers = []
        for i, lc in enumerate(cache.layers):
            shape = lc.k.shape[1:]
            k = rows(jax.random.fold_in(key, 2 * i), shape)
            v = rows(jax.random.fold_in(key, 2 * i + 1), shape)
            layers.append(LayerCache(k, v, lc.state))
        return KVCache(tuple(layers), jnp.full((batch,), context, jnp.int32), cache.max_len)

    def states(cache):
        layers = list(cache.layers)
        b = cache.lengths.shape[0]
        for seg in drv.plan.segments:
            if not seg.spec.sparse:
                continue
            data = drv.segment_data(seg)
            for j, i in enumerate(seg.layers):
                lc = layers[i]
                q_last = jnp.zeros((b, local.num_heads, local.head_dim), dtype)
                ctx = LayerCtx(seg.spec, {key: val[j] for key, val in data.items()})
                layers[i] = LayerCache(lc.k, lc.v, prompt_state(method, lc.state, lc.k, lc.v, q_last,
                                                                cache.lengths, ctx))
        return KVCache(tuple(layers), cache.lengths, cache.max_len)

    kv_fn = jax.jit(kv, out_shardings=shardings, donate_argnums=(0,))
    state_fn = jax.jit(jax.shard_map(states, mesh=mesh, in_specs=(specs,), out_specs=specs, check_vma=False),
                       donate_argnums=(0,))
    return lambda cache, key: state_fn(kv_fn(cache, key))


def timed_rounds(step, tok, *, steps: int, rounds: int, warmup: int = 2) -> list[float]:
    """ms per decode step of each of ``rounds`` rounds of ``steps`` back-to-back steps
    (``step(tok) -> tok``, the greedy token kept on the device; one sync per round),
    after ``warmup`` steps."""
    for _ in range(warmup):
        tok = step(tok)
    jax.block_until_ready(tok)
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(steps):
            tok = step(tok)
        jax.block_until_ready(tok)
        times.append((time.perf_counter() - t) / steps * 1e3)
    return times


def run_config(model, method, *, devices: int, data: int, batch: int, context: int, steps: int, rounds: int,
               plain: bool, log=print):
    """One configuration: time per decode step (median over rounds) and the first step's logits."""
    from models.runtime import sharding as sh
    from models.api import round_up
    from models.driver import init_cache
    from models.programs import build_functions

    cfg = model.config
    max_len = round_up(context + steps * (rounds + 2) + 64, 64)
    t0 = time.perf_counter()
    if plain:
        mesh = sh.Parallelism(1, 1).mesh()
        fns = build_functions(model.graphdef, cfg, method, unroll=True)
        params = model.params
        cache = init_cache(cfg, method, batch, max_len, jnp.bfloat16)
    else:
        par = sh.Parallelism(data, devices // data)
        mesh = par.mesh()
        fns = sh.build_sharded_functions(cfg, method, mesh, max_len=max_len, dtype=jnp.bfloat16,
                                         unroll=True)
        params = sh.shard_params(model.params, mesh)
        cache = sh.init_cache(cfg, method, batch, max_len, jnp.bfloat16, mesh)
    fill = fill_function(cfg, method, mesh, batch=batch, max_len=max_len, context=context, dtype=jnp.bfloat16)
    cache = fill(cache, jax.random.key(7))
    nbytes = cache.nbytes()
    tok = jnp.zeros((batch,), jnp.int32)
    logits, cache = fns.decode_step(params, tok, cache)
    first = np.asarray(logits, np.float32)
    tok = jnp.argmax(logits, -1).astype(jnp.int32)
    compile_s = time.perf_counter() - t0
    held = {"cache": cache}  # the step donates the cache: each step's output replaces it
    del cache

    def step(tok):
        logits, held["cache"] = fns.decode_step(params, tok, held["cache"])
        return jnp.argmax(logits, -1).astype(jnp.int32)

    times = timed_rounds(step, tok, steps=steps, rounds=rounds)
    ms = statistics.median(times)
    tp = devices // data
    row = dict(context=context, method=method.name, gpus=devices, layout=("1 GPU" if plain else
               f"data={data} x model={tp}"), batch=batch, ms_per_step=ms, tokens_per_s=batch / ms * 1e3,
               cache_gib=nbytes / 2**30, compile_s=compile_s, rounds_ms=[round(x, 3) for x in times])
    with_floor(row, cfg, method, jax.devices()[0].device_kind)
    floor = row["floor_ms"]
    log(f"  {row['layout']:<18} B={batch:<3} {ms:7.2f} ms/step  {row['tokens_per_s']:7.1f} tok/s  "
        f"floor {floor:.2f} ms  (compile+fill {compile_s:.0f} s)", flush=True)
    del held, params, fns
    gc.collect()
    return row, first


def run_offload_config(model, method, *, devices: int, batch: int, context: int, steps: int, rounds: int,
                       plain: bool, log=print):
    """One offloaded configuration (:class:`models.runtime.tiered.TieredRunner`, ``mode="offload"``):
    the KV in pinned host memory, split by KV head over ``devices`` GPUs (``model=devices``;
    one GPU when ``plain``), each GPU gathering its heads' blocks. Same row as
    :func:`run_config`, plus the block hit rate."""
    from models.api import round_up
    from models.runtime.tiered import TieredRunner

    cfg = model.config
    m = model.with_method(method)
    bs = m.method.for_offload().offload_block_size
    max_len = round_up(context + steps * (rounds + 2) + 64, max(64, bs))
    t0 = time.perf_counter()
    runner = TieredRunner(m if plain else shard(m, model=devices), "offload")
    hkv, d = cfg.num_kv_heads, cfg.head_dim

    @jax.jit
    def layer_kv(key):  # row r of layer i from fold_in(fold_in(key, i), r): the same in every layout
        def row(r):
            kr = jax.random.fold_in(key, r)
            return (jax.random.normal(jax.random.fold_in(kr, 0), (hkv, max_len, d), jnp.bfloat16),
                    jax.random.normal(jax.random.fold_in(kr, 1), (hkv, max_len, d), jnp.bfloat16),
                    jax.random.normal(jax.random.fold_in(kr, 2), (cfg.num_heads, d), jnp.bfloat16))
        return jax.vmap(row)(jnp.arange(batch))

    state = runner.state_from_kv(lambda i: layer_kv(jax.random.fold_in(jax.random.key(7), i)),
                                 np.full((batch,), context, np.int32), max_len)
    tok = jnp.zeros((batch,), jnp.int32)
    logits = runner.decode_step(tok, state)
    first = np.asarray(logits, np.float32)
    tok = jnp.argmax(logits, -1).astype(jnp.int32)
    compile_s = time.perf_counter() - t0
    times = timed_rounds(lambda tok: jnp.argmax(runner.decode_step(tok, state), -1).astype(jnp.int32), tok,
                         steps=steps, rounds=rounds)
    runner.finish(state)
    stats = runner.transfer_stats(state)
    ms = statistics.median(times)
    row = dict(context=context, method=method.name, mode="offload", gpus=devices,
               layout="1 GPU" if plain else f"data=1 x model={devices}", batch=batch, ms_per_step=ms,
               tokens_per_s=batch / ms * 1e3, cache_gib=sum(h.k.nbytes * 2 for h in state.host if h is not None) / 2**30,
               compile_s=compile_s, rounds_ms=[round(x, 3) for x in times], hit_rate=stats.get("hit_rate"))
    with_floor(row, cfg, method, jax.devices()[0].device_kind)
    log(f"  offload {row['layout']:<18} B={batch:<3} {ms:7.2f} ms/step  {row['tokens_per_s']:7.1f} tok/s  "
        f"floor {row['floor_ms']:.2f} ms  hit rate {row['hit_rate']:.3f}  (compile+fill {compile_s:.0f} s)", flush=True)
    del state, runner, m
    gc.collect()
    return row, first


def with_floor(row: dict, cfg, method, device_kind: str) -> dict:
    """Adds ``floor_ms`` (:func:`floor_bytes` at the device's HBM rate) and ``of_floor``."""
    rate, _ = hbm_rate(device_kind)
    data = 1 if row["layout"] == "1 GPU" else int(row["layout"].split()[0].split("=")[1])
    nbytes = floor_bytes(cfg, method, batch=row["batch"], context=row["context"], gpus=row["gpus"], data=data)
    row["floor_ms"] = nbytes / rate * 1e3
    row["of_floor"] = row["floor_ms"] / row["ms_per_step"]
    return row


def plot(payload, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = payload["rows"]
    def name(r):
        return r["method"] + (" offload" if r.get("mode") == "offload" else "")

    keys = sorted({(r["context"], name(r)) for r in rows}, key=lambda k: (-k[0], k[1]))
    layouts = list(dict.fromkeys(r["layout"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(keys)), 4))
    w = 0.8 / max(1, len(layouts))
    for j, lay in enumerate(layouts):
        vals = [next((r["tokens_per_s"] for r in rows if (r["context"], name(r)) == k and r["layout"] == lay), 0)
                for k in keys]
        ax.bar(np.arange(len(keys)) + (j - (len(layouts) - 1) / 2) * w, vals, w, label=lay)
    ax.set_xticks(np.arange(len(keys)), [f"{m}\n{c // 1024}K" for c, m in keys])
    ax.set_ylabel("decode tokens/s")
    ax.legend(fontsize=8)
    ax.set_title(f"Qwen3-8B shape, random weights; {payload['stamp'].get('device', '')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def render(payload) -> str:
    s = payload["stamp"]
    lines = ["# Decode on several GPUs (Qwen3-8B shape, random weights)", "",
             f"{s['device']} x {payload['gpus']}, jax {s['jax']}, {s['date']}, commit {s.get('git_commit', '')}", "",
             f"`{s['command']}`", "",
             "Tensor parallelism over KV heads (`models.runtime.sharding`) at n x the one-GPU batch (same KV bytes per "
             "GPU). ms/step: median of rounds of back-to-back steps. floor_ms: per GPU, its share of the layer "
             "weights, the LM head, and the K/V the method attends (all tokens on dense layers, the budget's "
             f"on sparse ones; block metadata not counted) at {hbm_rate(s['device'])[0] / 1e12:.2f} TB/s "
             f"({hbm_rate(s['device'])[1]}); of_floor = floor / measured. logits: the first step's rows shared "
             "with the one-GPU run (max |difference|, argmax agreement; bf16, see docs/sharding.md).", ""]
    cols = ["context", "method", "mode", "layout", "batch", "ms_per_step", "tokens_per_s", "vs_1gpu", "floor_ms", "of_floor",
            "max_dlogit", "argmax_agree", "cache_gib", "hit_rate"]
    lines.append(markdown_table(payload["rows"], cols, {"ms_per_step": ".2f", "tokens_per_s": ".1f", "vs_1gpu": ".2f",
                                                        "floor_ms": ".2f", "of_floor": ".2f", "cache_gib": ".1f",
                                                        "max_dlogit": ".3g", "argmax_agree": ".2f",
                                                        "hit_rate": ".3f"}))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default="131072,65536")
    p.add_argument("--methods", default="dense,asynctls,quest")
    p.add_argument("--batch", default="2,4", help="one-GPU batch per context (comma list, or one value)")
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--dp", action="store_true", help="also data-parallel replicas (weights on every GPU)")
    p.add_argument("--modes", default="resident",
                   help="resident and/or offload (KV in pinned host memory, split by KV head; sparse methods only)")
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--time-limit", type=float, default=0, help="stop starting configurations after this many s")
    p.add_argument("--tiny", action="store_true", help="a small random model (CPU smoke test)")
    p.add_argument("--out", default=None)
    p.add_argument("--name", default="multi_gpu")
    p.add_argument("--rerender", default=None, help="recompute the floors of a results JSON and rewrite it")
    a = p.parse_args(argv)
    if a.rerender:
        return rerender(Path(a.rerender), a.name, Path(a.out) if a.out else None)
    start = time.perf_counter()
    from benchmarks.offload import qwen3_8b, random_model

    if len(jax.devices()) < a.gpus:
        print(f"error: --gpus {a.gpus} but {len(jax.devices())} devices are visible", file=sys.stderr)
        return 2
    contexts = [int(c) for c in a.contexts.split(",")]
    batches = [int(b) for b in a.batch.split(",")]
    batches = batches * len(contexts) if len(batches) == 1 else batches
    if len(batches) != len(contexts):
        print("error: --batch gives one value or one per context", file=sys.stderr)
        return 2
    if a.tiny:
        import dataclasses

        from models.config import get_config
        cfg = dataclasses.replace(get_config("qwen3-8b"), num_layers=4, hidden_size=64, num_heads=8, num_kv_heads=4,
                                  head_dim=32, intermediate_size=96, vocab_size=128, max_position=max(contexts) * 2)
    else:
        cfg = qwen3_8b(max(contexts) * 2)
    payload = {"stamp": stamp(), "gpus": a.gpus, "rows": []}
    out = Path(a.out) if a.out else None
    model = None
    modes = [m for m in a.modes.split(",") if m]
    if not modes or set(modes) - {"resident", "offload"}:
        print(f"error: --modes takes resident and/or offload, got {a.modes!r}", file=sys.stderr)
        return 2
    for context, b in zip(contexts, batches):
        for name, mode in [(n, m) for m in modes for n in a.methods.split(",")]:
            method = build_method(name, cfg, a.budget)
            if mode == "offload" and name == "dense":
                continue  # nothing to offload: dense reads every block every step
            if model is None:
                model = random_model(cfg, method, max(contexts) * 2)
            print(f"{name} at {context // 1024}K, {mode}", flush=True)
            layouts = [(1, 1, b, True), (a.gpus, 1, b * a.gpus, False)]
            if a.dp and mode == "resident":
                layouts.append((a.gpus, a.gpus, b * a.gpus, False))
            base = None
            for devices, data, batch, plain in layouts:
                if a.time_limit and time.perf_counter() - start > a.time_limit:
                    print(f"time limit: skipping {name} {context} {devices} GPUs", flush=True)
                    continue
                if mode == "offload":
                    row, first = run_offload_config(model, method, devices=devices, batch=batch, context=context,
                                                    steps=a.steps, rounds=a.rounds, plain=plain)
                else:
                    row, first = run_config(model, method, devices=devices, data=data, batch=batch,
                                            context=context, steps=a.steps, rounds=a.rounds, plain=plain)
                    row["mode"] = "resident"
                if base is None:
                    base = (row, first)
                else:
                    row["vs_1gpu"] = row["tokens_per_s"] / base[0]["tokens_per_s"]
                    row.update(logit_agreement(first, base[1]))
                payload["rows"].append(row)
                write_results(a.name, payload, render(payload), out)
    write_final_results(a.name, payload, render, plot, out)
    return 0


def rerender(path: Path, name: str, out: Path | None) -> int:
    """Floors recomputed (the model and methods rebuilt from the stamped command) and the
    results written again under ``name``, with the plot."""
    import json
    import shlex

    from benchmarks.offload import qwen3_8b

    payload = json.loads(path.read_text())
    argv = shlex.split(payload["stamp"]["command"])
    budget = int(argv[argv.index("--budget") + 1]) if "--budget" in argv else 2048
    contexts = max(r["context"] for r in payload["rows"])
    cfg = qwen3_8b(contexts * 2)
    for row in payload["rows"]:
        with_floor(row, cfg, build_method(row["method"], cfg, budget), payload["stamp"]["device"])
    dest = write_results(name, payload, render(payload), out)
    plot(payload, dest / f"{name}.png")
    print(render(payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
