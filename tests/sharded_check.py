"""Sharded decode against one device, run in its own process with several CPU devices.

``XLA_FLAGS=--xla_force_host_platform_device_count=4 python -m tests.sharded_check``
(``tests/test_sharding.py`` runs it; the device count must be set before jax
starts, so it cannot run inside the pytest process). For each case it runs a
ragged prefill and ``STEPS`` greedy decode steps on one device (the unsharded
``build_functions``) and under each mesh (``models.runtime.sharding``), and prints one
JSON line per case: the max |logit difference| over every step, whether the
greedy tokens agree, and the cache's sharding.

``--only offload``: offloaded decoding on a mesh (host tier and pool split by KV head and
row) against one device, resident: Quest and AsyncTLS (lag, per-head channels) on 1x2 and
2x2, a control that drops the block saves, AsyncTLS on a tiny config of 3 KV heads padded
to 4 on model=2, and the serving engine on that config over model=2: paged (AsyncSpade after
Token Sparse Attention's chunks) against the paged engine on one device, offloaded (Quest)
against single-request generation. ``--with-offload``: every case, the
offload ones included, in one process (``tests/test_sharding.py`` runs its 4-device checks
so, paying for one process start, one SmolLM2 load and one set of compilations).

Cases: a tiny random Qwen3-style config with 8 KV heads (dense, quest, asynctls,
asyncspade and quest after a Token Sparse Attention prefill, every method selecting:
budgets below the prompts): each method on one of the meshes 1x2, 2x2 and 1x4, and Kascade
(tiled prefill) on data=2; a tiny Llama-style config of 3 KV heads padded to 4,
SmolLM2's shape in small (dense, asynctls and quest after a Token Sparse prefill on model=2,
its per-head channels padded too; the paged engine, chunked, and the offloaded
one over model=2), with
``--bf16`` also in bf16 against an f32 reference, one device and model=2, to show the
sharded error is rounding of the same size as one device's. SmolLM2-135M on its real
weights once per user path: ``shard(model, model=2).generate`` and the generate CLI with
``--tensor-parallel 2``, each against one device.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from models.runtime.sharding import shard
from tests.cli_runs import run_generate, texts_with_and_without

STEPS = 4


def _run(fns, params, cache, tokens, lengths):
    logits, cache = fns.prefill(params, tokens, lengths, cache)
    out, toks = [np.asarray(logits, np.float32)], []
    nxt = jnp.argmax(logits, -1).astype(jnp.int32)
    for step in range(1, STEPS + 1):
        toks.append(np.asarray(nxt))
        logits, cache = fns.decode_at(step)(params, nxt, cache)  # past a warm-up: the steady program
        out.append(np.asarray(logits, np.float32))
        nxt = jnp.argmax(logits, -1).astype(jnp.int32)
    return out, np.stack(toks), cache


def one_device(cfg, graphdef, params, method, tokens, lengths, max_len, dtype):
    from models.driver import init_cache
    from models.programs import build_functions

    fns = build_functions(graphdef, cfg, method, unroll=False)
    return _run(fns, params, init_cache(cfg, method, tokens.shape[0], max_len, dtype), tokens, lengths)


def sharded(cfg, params, method, tokens, lengths, max_len, dtype, par):
    from models.runtime import sharding as sh

    mesh = par.mesh()
    fns = sh.build_sharded_functions(cfg, method, mesh, max_len=max_len, dtype=dtype,
                                     unroll=False)
    return _run(fns, sh.shard_params(params, mesh), sh.init_cache(cfg, method, tokens.shape[0], max_len, dtype, mesh),
                tokens, lengths)


@functools.lru_cache(maxsize=1)
def _smollm2_weights():
    import models

    return models.load_model("smollm2-135m", dtype=jnp.float32, max_len=512)


def smollm2(max_len: int):
    """SmolLM2-135M on its real weights, f32, dense, ``max_len`` positions (loaded once per process)."""
    from models.api import Model

    b = _smollm2_weights()
    return b if b.max_len == max_len else Model(b.config, b.graphdef, b.params, b.tokenizer, b.method, b.dtype,
                                                max_len)


def report(case, ref, got, cache):
    err = max(float(np.max(np.abs(a - b))) for a, b in zip(ref[0], got[0]))
    scale = max(float(np.max(np.abs(a))) for a in ref[0])
    line = dict(case=case, max_dlogit=err, logit_scale=scale, tokens_agree=bool(np.array_equal(ref[1], got[1])),
                k_spec=str(getattr(cache.layers[-1].k.sharding, "spec", "one device")), devices=len(cache.layers[-1].k.sharding.device_set))
    print(json.dumps(line), flush=True)
    return line


def tiny_cases(meshes):
    from models.config import ModelConfig
    from models.runtime.sharding import Parallelism
    from models.transformer import init_params
    from sparse_jax.methods.registry import get_method

    cfg = ModelConfig(name="tiny-kv8", arch="qwen3", num_layers=3, hidden_size=64, num_heads=16, num_kv_heads=8,
                      head_dim=16, intermediate_size=96, vocab_size=97, max_position=512, rope_theta=1e4,
                      rms_eps=1e-6)
    channels = (tuple(tuple(range(h % 4, 16, 4)) for h in range(8)),) * 3  # per head: different channels
    methods = {"dense": get_method("dense"), "quest": get_method("quest", budget=64, dense_layers=(0,)),
               "asynctls": get_method("asynctls", budget=64, block_size=16, kb=6, channels_per_layer=channels,
                                      dense_layers=(0,)),
               # θ_t = 2: two steps of the warm-up's program, then the steady one (decode_at)
               "asyncspade": get_method("asyncspade", budget=64, window=4, dense_layers=(0,), dense_steps=2),
               # Token Sparse Attention prefill: its per-row count is shared by every head (a psum)
               "quest+token_sparse": get_method("quest", budget=64, dense_layers=(0,), prefill="token_sparse",
                                                prefill_options=(("min_tokens", 16), ("window", 8), ("tau", 0.2)))}
    graphdef, params = init_params(cfg, jnp.float32, seed=1)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (4, 150)), jnp.int32)
    lengths = jnp.asarray([150, 120, 97, 141], jnp.int32)
    # each method on one mesh, every mesh under at least one: 1x2 quest, 2x2 dense, asynctls and
    # quest+TSA (rows and heads split), 1x4 asyncspade. Every sparse method's layer 0 is dense, so
    # the dense path runs on each mesh, and padded_cases' dense and asynctls run on model=2: dense
    # on 1x2 and 1x4 and asynctls on 1x4 too compiled 3 sharded programs for what these check (a
    # full method x mesh matrix, 15)
    on = {"dense": [(2, 2)], "quest": [(1, 2)], "asynctls": [(2, 2)], "asyncspade": [(1, 4)],
          "quest+token_sparse": [(2, 2)]}
    for name, m in methods.items():
        ref = one_device(cfg, graphdef, params, m, tokens, lengths, 256, jnp.float32)
        for data, model in [mesh for mesh in on[name] if mesh in meshes]:
            got = sharded(cfg, params, m, tokens, lengths, 256, jnp.float32, Parallelism(data, model))
            report(f"tiny-kv8/{name}/data={data},model={model}", ref, got, got[2])
    # forward (whole sequences, no cache) on the narrowest and the widest mesh
    from models.runtime import sharding as sh
    from models.programs import build_functions
    want = np.asarray(build_functions(graphdef, cfg, methods["dense"], unroll=False).forward(params, tokens))
    for data, model in dict.fromkeys([meshes[0], meshes[-1]]):
        mesh = Parallelism(data, model).mesh()
        fs = sh.build_sharded_functions(cfg, methods["dense"], mesh, max_len=256, dtype=jnp.float32, unroll=False)
        got = np.asarray(fs.forward(sh.shard_params(params, mesh), tokens))
        print(json.dumps(dict(case=f"tiny-kv8/forward/data={data},model={model}",
                              max_dlogit=float(np.max(np.abs(want - got))), logit_scale=float(np.max(np.abs(want))),
                              tokens_agree=bool((want.argmax(-1) == got.argmax(-1)).all()),
                              k_spec="no cache", devices=len(fs.mesh.devices.flat))), flush=True)
    # Kascade reads other heads' selections (its head map): data replicas only. With its tiled
    # prefill: the same decode (the head map) as plain Kascade's, whose prefill is the base
    # class's, every sparse case's above (plain Kascade's own case compiled two programs more)
    for name, opts in (("kascade+tiled_prefill", dict(tiled_prefill=True, prefill_tile=16)),):
        m = get_method("kascade", budget=64, anchors=(0, 1), **opts)
        ref = one_device(cfg, graphdef, params, m, tokens, lengths, 256, jnp.float32)
        got = sharded(cfg, params, m, tokens, lengths, 256, jnp.float32, Parallelism(2, 1))
        report(f"tiny-kv8/{name}/data=2,model=1", ref, got, got[2])


OFFLOAD_STEPS = 12


def _tiered(model, mode, tokens, lengths, pool=None, runner=None):
    from models.runtime.tiered import TieredRunner

    runner = runner or TieredRunner(model, mode, pool_slots=pool)
    ids, logits, state = runner.generate_ids(tokens, lengths, OFFLOAD_STEPS, 256)
    return runner, np.asarray(ids), np.asarray(logits, np.float32), state


def _drop_saves(runner):
    """Negative control: completed blocks never reach the host tier (same compiled programs)."""
    runner._store_pending = lambda state: state.pending.clear()
    return runner


def report_offload(case, ref, got, runner, state):
    ids, logits = got
    stats = runner.transfer_stats(state) if runner.mode == "offload" else {}
    host = next((h for h in state.host if h is not None), None)
    line = dict(case=case, max_dlogit=float(np.abs(logits - ref[1]).max()), logit_scale=float(np.abs(ref[1]).max()),
                tokens_agree=bool(np.array_equal(ids, ref[0])),
                k_spec=str(getattr(host.k.sharding, "spec", "one device")) if host is not None else "resident",
                host_memory=host.k.sharding.memory_kind if host is not None else None,
                devices=len(state.cache.lengths.sharding.device_set),
                later_misses=int(sum(stats.get("misses_per_step", [0])[1:])), hit_rate=stats.get("hit_rate"))
    print(json.dumps(line), flush=True)
    return line


def offload_cases(meshes):
    """Offloaded decoding on a mesh (host tier and pool split by KV head and row)
    against one device: Quest (fetches its misses) and AsyncTLS with the lag (prefetches
    the next step's blocks; per-head calibrated channels), the smallest pools."""
    import models
    from models.config import ModelConfig
    from sparse_jax.methods.registry import get_method

    cfg = ModelConfig(name="tiny-kv8", arch="qwen3", num_layers=3, hidden_size=64, num_heads=16, num_kv_heads=8,
                      head_dim=16, intermediate_size=96, vocab_size=97, max_position=512, rope_theta=1e4,
                      rms_eps=1e-6, eos_token_id=2, pad_token_id=2)
    channels = (tuple(tuple(range(h % 4, 16, 4)) for h in range(8)),) * 3
    # blocks of 4: a block a row completes leaves the ring, and is read back from the host
    # tier, within the 12 steps (the control shows it)
    # each method on one mesh (Quest split over heads, AsyncTLS over heads and rows)
    methods = {"quest": (get_method("quest", budget=32, block_size=4, dense_layers=(0,)), 8, [(1, 2)]),
               "asynctls": (get_method("asynctls", budget=32, block_size=4, kb=8, lag=True,
                                       channels_per_layer=channels, dense_layers=(0,)), 7, [(2, 2)])}
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, 97, (4, 90)).astype(np.int32)
    lengths = np.array([90, 61, 77, 85], np.int32)
    for name, (m, pool, on) in methods.items():
        base = models.load_model(config=cfg, dtype=jnp.float32, max_len=256, attention=m)
        _, *ref, _ = _tiered(base, "resident", tokens, lengths)
        for data, model in [mesh for mesh in on if mesh in meshes]:
            runner, *got, state = _tiered(shard(base, data=data, model=model), "offload", tokens, lengths, pool)
            report_offload(f"offload/tiny-kv8/{name}/data={data},model={model}", ref, got, runner, state)
        runner, *got, state = _tiered(None, "offload", tokens, lengths, runner=_drop_saves(runner))
        report_offload(f"offload-control/tiny-kv8/{name}/data={data},model={model}", ref, got, runner, state)


def padded_offload_case():
    """A tiny config of 3 KV heads (padded to 4, its per-head channels too) offloaded AsyncTLS
    on model=2 against one device, resident: the padding on the offload path (SmolLM2's
    3 KV heads, real weights: the engine case)."""
    import models
    from sparse_jax.methods.registry import get_method

    cfg = _tiny_kv3(eos=True)
    channels = (tuple(tuple(range(h, 16, 4)) for h in range(3)),) * 3
    m = models.load_model(config=cfg, dtype=jnp.float32, max_len=256, attention=get_method(
        "asynctls", budget=32, block_size=8, kb=8, lag=True, channels_per_layer=channels, dense_layers=(0,)))
    rng = np.random.default_rng(1)
    tokens = rng.integers(3, 97, (2, 121)).astype(np.int32)
    lengths = np.array([121, 98], np.int32)
    _, *ref, _ = _tiered(m, "resident", tokens, lengths)
    runner, *got, state = _tiered(shard(m, model=2), "offload", tokens, lengths, 7)
    report_offload("offload/tiny-kv3/asynctls/data=1,model=2", ref, got, runner, state)


def _tiny_kv3(eos: bool = False):
    """A tiny Llama-style config of 3 KV heads (padded to 4 on model=2), SmolLM2's shape in small."""
    from models.config import ModelConfig

    return ModelConfig(name="tiny-kv3", arch="llama", num_layers=3, hidden_size=48, num_heads=6, num_kv_heads=3,
                       head_dim=16, intermediate_size=96, vocab_size=97, max_position=512, rope_theta=1e4,
                       rms_eps=1e-6, **(dict(eos_token_id=2, pad_token_id=2) if eos else {}))


def engine_case():
    """The serving engine over a mesh (tiny-kv3 padded to 4 KV heads, model=2).

    The paged engine (the server's default: pools split by KV head, chunked prefill) serving
    AsyncSpade with two dense steps (the warm-up's and the steady program) after Token Sparse
    Attention's chunk form: three prompts through two slots get the one-device paged engine's
    tokens. Each chunk's kept count comes from every device's heads (``head_axis``), the padded
    heads left out of its head mean (``TokenSparsePrefill.query_heads``): with either undone by
    hand (``head_axis=None``; no ``query_heads``) the mesh's tokens differed. (Before,
    AsyncSpade's paged engine was checked against single-request generation and TSA's chunks
    on tiny-kv8 in an engine of their own: two engines over the mesh where one checks both; the
    engine's chunked prefill against whole prompts is tests/test_engine.py's, on one device.)

    The contiguous offloaded engine serving Quest (budget 32, below every prompt: it really
    selects): five requests through two slots give each request's single-request tokens on one
    device.

    Both report the programs their step compiled while serving (the jitted step's cache; the
    offloaded engine's sampling after its runner's step): one per batch bucket and sampling
    structure. Before the step's inputs were placed on the mesh (``models.serving.slots.step_inputs``),
    the tokens, lengths and block table came now from the host (one device), now from the last step
    (the mesh), and each mix compiled the step once more (the paged steps 4 + 3 programs, not 2 + 2;
    the offloaded sampling 2, not 1)."""
    import models
    from models.sampling import sample_program, sample_step_program
    from models.serving.engine import Engine
    from models.serving.requests import SamplingParams

    rng = np.random.default_rng(3)
    # three chunks of 32 at most (three chunk programs a side); shorter prompts (two chunks) hid
    # a count of each device's own heads
    ids = [rng.integers(3, 97, n).tolist() for n in (96, 80, 70)]
    opts = dict(budget=32, window=4, dense_steps=2, dense_layers=(0,), prefill="token_sparse",
                prefill_options=(("min_tokens", 16), ("window", 8), ("tau", 0.3)))
    model = models.load_model(config=_tiny_kv3(eos=True), dtype=jnp.float32, max_len=256, attention="asyncspade",
                              attention_options=opts)
    outs = []
    # the second and third requests penalised: the third's first token is sampled after steps
    # have returned the penalty counts (on the mesh), the second's before any has
    params = [SamplingParams(max_tokens=18), SamplingParams(max_tokens=18, presence_penalty=0.5),
              SamplingParams(max_tokens=18, presence_penalty=0.5)]
    for m in (model, shard(model, model=2)):
        engine = Engine(m, slots=2, max_len=256, stop_ids=(), paged=True, prefill_chunk=32).start()
        first_token_programs = sample_program._cache_size()
        try:
            reqs = [engine.submit(engine.make_request(i, p)) for i, p in zip(ids, params)]
            done = all(r.done.wait(300) for r in reqs)
            outs.append([r.output_ids for r in reqs] if done else None)
            s, kv = engine.stats(), engine.kv
            kv.check()
            first_token_programs = sample_program._cache_size() - first_token_programs
        finally:
            engine.stop()
    pool = kv.cache.layers[-1].pool_k
    print(json.dumps(dict(case="engine/tiny-kv3/asyncspade+token_sparse/paged-chunked/data=1,model=2",
                          completed=outs[1] is not None, tokens_agree=outs[0] is not None and outs[0] == outs[1],
                          devices=2, blocks_free=[s["kv_blocks_free"], s["kv_blocks_total"]],
                          pool_spec=str(pool.sharding.spec), pool_shard=list(pool.addressable_shards[0].data.shape),
                          pool=list(pool.shape), warm_steps=kv.warmup.warm_steps,
                          steady_steps=kv.warmup.steady_steps,
                          # the jitted warm-up and steady steps' programs (two batch buckets: rows 1, 2)
                          step_programs=[kv._step._cache_size(), kv._steady_step._cache_size()],
                          # the mesh run's first-token samplers: plain and penalised
                          first_token_programs=first_token_programs)), flush=True)

    # one prefill bucket (64): fewer programs to compile on both sides, every prompt above the budget
    ids = [rng.integers(3, 97, n).tolist() for n in (60, 41, 64, 53, 45)]
    model = models.load_model(config=_tiny_kv3(eos=True), dtype=jnp.float32, max_len=256, attention="quest",
                              attention_options=dict(budget=32, block_size=8, dense_layers=(0,)))
    refs = [model.generate_ids(np.asarray([i], np.int32), np.asarray([len(i)], np.int32), max_new_tokens=18,
                               stop_ids=())[0] for i in ids]
    engine = Engine(shard(model, model=2), slots=2, max_len=256, stop_ids=(), offload=True).start()
    samplers = sample_step_program._cache_size()
    try:
        reqs = [engine.submit(engine.make_request(i, SamplingParams(max_tokens=18))) for i in ids]
        done = all(r.done.wait(300) for r in reqs)
        print(json.dumps(dict(case="engine/tiny-kv3/quest/offload/data=1,model=2", completed=done,
                              tokens_agree=done and [r.output_ids for r in reqs] == refs,
                              blocks_loaded=engine.stats().get("blocks_loaded"), devices=2,
                              step_programs=[sample_step_program._cache_size() - samplers])), flush=True)
    finally:
        engine.stop()


def padded_cases(bf16: bool):
    """Padded KV heads (3 -> 4) on a mesh, SmolLM2's case in small: dense, asynctls
    (per-head channels, padded too) and quest after a Token Sparse prefill on model=2 (data=2 pads nothing: tiny-kv8's asynctls on
    data=2,model=2 and Kascade on data=2 split rows); with ``bf16``, dense in
    bf16 against an f32 reference on one device and on model=2 (the sharded error is
    rounding of the same size as one device's)."""
    from models.runtime import sharding as sh
    from models.runtime.sharding import Parallelism
    from models.transformer import init_params
    from sparse_jax.methods.registry import get_method

    cfg = _tiny_kv3()
    graphdef, params = init_params(cfg, jnp.float32, seed=2)
    channels = (tuple(tuple(range(h, 16, 4)) for h in range(3)),) * 3
    rng = np.random.default_rng(5)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 200)), jnp.int32)
    lengths = jnp.asarray([200, 170], jnp.int32)
    # (plain quest's padded decode and metadata are quest+token_sparse's below: only the prefill
    # differs, the dense one every other case runs)
    cases = [("dense", get_method("dense"), Parallelism(1, 2)),
             ("asynctls", get_method("asynctls", budget=64, block_size=16, kb=6, channels_per_layer=channels,
                                     dense_layers=(0,)), Parallelism(1, 2)),
             # Token Sparse prefill: the padded heads stay out of the head mean that sets the count
             # (TokenSparsePrefill.query_heads, set by pad_kv_heads); with them in, the tokens differed
             ("quest+token_sparse", get_method("quest", budget=64, dense_layers=(0,), prefill="token_sparse",
                                               prefill_options=(("min_tokens", 16), ("window", 8), ("tau", 0.2))),
              Parallelism(1, 2))]
    for name, m, par in cases:
        ref = one_device(cfg, graphdef, params, m, tokens, lengths, 256, jnp.float32)
        pcfg, pparams, pm = sh.pad_kv_heads(cfg, params, par.model, m)
        got = sharded(pcfg, pparams, pm, tokens, lengths, 256, jnp.float32, par)
        report(f"tiny-kv3/{name}/data={par.data},model={par.model}", ref, got, got[2])
    if bf16:
        m = get_method("dense")
        ref = one_device(cfg, graphdef, params, m, tokens, lengths, 256, jnp.float32)
        p16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
        one = one_device(cfg, graphdef, p16, m, tokens, lengths, 256, jnp.bfloat16)
        report("tiny-kv3-bf16/dense/one device vs f32", ref, one, one[2])
        pcfg, pparams = sh.pad_kv_heads(cfg, p16, 2)
        got = sharded(pcfg, pparams, m, tokens, lengths, 256, jnp.bfloat16, Parallelism(1, 2))
        report("tiny-kv3-bf16/dense/model=2 vs f32", ref, got, got[2])


def smollm2_cases():
    """SmolLM2-135M on its real weights (3 KV heads padded to 4), the user's paths once each:
    ``shard(model, model=2).generate`` equal to one device's text, and the generate CLI with
    ``--tensor-parallel 2`` equal to the CLI without it (in this process: one weights load
    and one set of compiled programs for both); ``--tensor-parallel 8`` is refused."""
    base = smollm2(256)
    # 201 tokens + 12: the API's prompt bucket (a multiple of 64: 256) and cache (256) are the CLI's,
    # so the CLI runs below reuse the programs compiled here (one device: the same jitted functions;
    # model=2: through the persistent compilation cache)
    prompt = "The capital of France is Paris. The capital of Italy is Rome. " * 14 + "The capital of Germany is"
    sharded_model = shard(base, model=2)
    a, b = base.generate(prompt, max_new_tokens=12), sharded_model.generate(prompt, max_new_tokens=12)
    print(json.dumps(dict(case="smollm2/api-generate/dense/data=1,model=2", max_dlogit=0.0, logit_scale=1.0,
                          tokens_agree=a == b, k_spec="P(None, 'model')", devices=2,
                          text=b, kv_heads=sharded_model.config.num_kv_heads)), flush=True)
    texts, heads = texts_with_and_without(["--model", "smollm2-135m", "--prompt", prompt, "--max-new-tokens", "12"],
                                          ["--tensor-parallel", "2"])
    refused = run_generate(["--model", "smollm2-135m", "--prompt", "hi", "--tensor-parallel", "8"])
    print(json.dumps(dict(case="smollm2/cli/tensor-parallel=2", texts=texts, heads=heads, refused_rc=refused.rc,
                          refused=refused.err[-500:])), flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", choices=["tiny", "smollm2", "offload"], default=None)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--with-offload", action="store_true",
                   help="the offload cases too (SmolLM2's included), after the others, in this process")
    a = p.parse_args(argv)
    n = len(jax.devices())
    meshes = [m for m in [(1, 2), (2, 2), (1, 4)] if m[0] * m[1] <= n]
    if a.only in (None, "tiny"):
        tiny_cases(meshes)
    if a.only in (None, "tiny"):
        padded_cases(a.bf16)
    if a.only in (None, "smollm2"):
        smollm2_cases()
    if a.only == "offload" or (a.with_offload and a.only is None):  # 4 devices (tests/test_sharding.py)
        offload_cases([m for m in meshes if m != (1, 4)])
        padded_offload_case()
        engine_case()
    return 0


if __name__ == "__main__":
    sys.exit(main())
