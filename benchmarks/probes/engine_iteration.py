"""Where does the serving engine's decode iteration spend the time the bare step does not?

``python -m benchmarks.probes.engine_iteration`` (GPU) builds a Qwen3-8B-shaped model with
random bf16 weights and, for each method and each cache capacity (``--caps``: positions per
row), measures three things with every one of ``--batch`` rows at ``--context`` tokens:

- ``bare_ms``: the model's decode step alone (``programs.decode_step``, unrolled, cache
  donated, greedy argmax outside), back to back: what ``benchmarks.probes.host_probe``
  calls ``tpot_ms``;
- ``program_ms``: the engine's own step program (:class:`models.serving.slots.ResidentSlots`
  ``.step``: the decode step, free slots held back, per-row sampling), called back to back on
  the engine's cache after its requests ran: the device cost of what the engine runs;
- ``iteration_ms``: the engine's decode iteration (``Engine.step_times``, the median of the
  steps after the last of ``--batch`` requests was inserted): what a client is served at.

So ``program - bare`` is what the engine's program adds on the device (sampling, masking),
``iteration - program`` the host loop's share, and a row at a larger capacity with the same
lengths shows what the capacity itself costs (the engine sizes every slot at ``max_len``:
the wave-3 table compared an engine at 33,280 positions with a bare step at 16,896).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import markdown_table, parse_list, stamp, use_compile_cache_flag, write_results
from models.sampling import RowSampling


def live_table(batch: int, context: int, cap: int, page: int) -> np.ndarray:
    """``int32[batch, cap / page]``: row ``b`` holding the pages of ``context`` tokens, the
    rows' pages interleaved over the pool (as requests that grew together hold them), the
    rest the null page."""
    n = -(-(context + 1) // page)
    table = np.zeros((batch, cap // page), np.int32)
    table[:, :n] = 1 + np.arange(n * batch).reshape(n, batch).T
    return table


def resident_bytes(cfg, batch: int, cap: int, dtype_bytes: int = 2) -> int:
    """The weights plus one whole-capacity cache of ``batch`` rows: what the bare step (and the
    engine after it, one at a time) holds on the device."""
    kv = cfg.num_layers * 2 * batch * cfg.num_kv_heads * cap * cfg.head_dim * dtype_bytes
    return cfg.num_params() * dtype_bytes + kv


def probe_config(a, cap: int):
    """The model config of one row: the Qwen3-8B shape at ``cap`` positions with ``--layers``
    layers, or the ``--tiny`` one."""
    from benchmarks.offload import qwen3_8b

    cfg = dataclasses.replace(qwen3_8b(cap), num_layers=a.layers)
    if a.tiny:
        cfg = dataclasses.replace(cfg, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=32,
                                  intermediate_size=128, vocab_size=256)
    return cfg


def _check_fits(a, caps) -> None:
    """Refuse, before building anything, a batch x capacity whose cache does not fit the device
    (a 132,096-position cache of 8 rows is 156 GB: XLA's allocator then retried for minutes
    instead of failing, H200, 2026-12-05). The CPU reports no limit: not checked."""
    from sparse_jax.offload.capacity import device_budget

    limit = device_budget()
    if limit is None:
        return
    for cap in caps:
        for batch in a.batch:
            need = resident_bytes(probe_config(a, cap), batch, cap)
            if need > limit:
                raise SystemExit(f"batch {batch} at capacity {cap} needs {need / 2**30:.1f} GiB (weights + one "
                                 f"whole-capacity cache) of the device's {limit / 2**30:.1f} GiB: lower --batch or "
                                 f"--caps (capacity >= --context + --max-tokens + 2)")


def _bare_ms(model, method, cfg, batch: int, context: int, cap: int, steps: int, rounds: int,
             paged: bool = False) -> float:
    """The bare step on a zero cache (``paged``: zero pages through a block table)."""
    from models.driver import init_cache
    from models.serving.paged import page_size
    from sparse_jax.cache import paged_like

    if paged:  # the same rows in pages of one pool through a block table
        page = page_size(method)
        table = live_table(batch, context, cap, page)
        cache = jax.jit(lambda: paged_like(init_cache(cfg, method, batch, cap, jnp.bfloat16),
                                           int(table.max()) + 1, page))()
        cache = dataclasses.replace(cache, block_table=jnp.asarray(table))
    else:
        cache = init_cache(cfg, method, batch, cap, jnp.bfloat16)
    cache = dataclasses.replace(cache, lengths=jnp.full((batch,), context, jnp.int32))
    ms, _ = _bare_on(model, method, cfg, cache, steps, rounds)
    return ms


def _bare_on(model, method, cfg, cache, steps: int, rounds: int):
    """``(ms, cache)``: the bare decode step (greedy argmax outside) back to back on
    ``cache`` (donated; the returned cache is its successor)."""
    from benchmarks.probes.host_probe import _measure, _step_fns

    logits_fn = _step_fns(model.graphdef, cfg, method, 1)[0]
    batch = cache.lengths.shape[0]

    def run(st):
        tok, c = st
        logits, c = logits_fn(model.params, tok, c)
        tok = jnp.argmax(logits, -1).astype(jnp.int32)
        return tok, (tok, c)

    res, state = _measure(run, (jnp.zeros((batch,), jnp.int32), cache), steps, rounds, 1)
    return res["tpot_ms"], state[1]


#: ``--sampling``: what each request asks of the sampler. ``options``: every option the server
#: accepts on at once (temperature, top-k, min-p, the three penalties, a logit bias, min_tokens
#: and 5 top logprobs): what they cost the iteration against ``plain`` (greedy)
SAMPLING = {"plain": {}, "options": dict(temperature=0.8, top_p=0.95, top_k=50, min_p=0.05, presence_penalty=0.5,
                                         frequency_penalty=0.5, repetition_penalty=1.1, logit_bias=((5, -100.0),),
                                         min_tokens=8, logprobs=5)}


def _full_batch_iteration(engine, model, batch: int, context: int, max_tokens: int, opts: dict,
                          precompile: bool = False):
    """``(iteration_ms, steps)``: ``engine`` (not started; stopped on return) warmed up by one
    short request (its prefill and step compile), then ``batch`` requests of ``context`` random
    tokens and ``max_tokens`` each (``opts``: their sampling options); the median of its decode
    iterations after the last of them was inserted (every slot decoding), and those steps.
    ``precompile``: the engine's programs for prompts of ``context`` compiled first, in parallel
    threads (:meth:`Engine.precompile`), not one after another in front of the warm-up request:
    at 64K one method on one engine took 8-9 minutes of a 10-minute device call (2026-12-05)."""
    from models.serving.requests import SamplingParams

    if precompile:
        kw = {} if getattr(engine.kv, "offloaded", False) else {"sampled": (False, True) if opts.get("temperature")
                                                                   else (False,)}
        pre = engine.precompile(shortest_prompt=context, **kw)
        print(f"  precompiled {pre['programs']} programs in {pre['seconds']:.1f} s "
              f"({pre.get('from_cache', 0)} from the compile cache); not ahead: {pre['failed'] or 'none'}", flush=True)
    engine.start()
    rng = np.random.default_rng(0)
    try:
        warm = engine.generate(rng.integers(0, model.config.vocab_size, context).tolist(),
                               SamplingParams(max_tokens=2, ignore_eos=True))  # compiles prefill and step
        assert warm.finish_reason == "length", (warm.finish_reason, warm.error)
        reqs = [engine.make_request(rng.integers(0, model.config.vocab_size, context).tolist(),
                                    SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=i, **opts))
                for i in range(batch)]
        k = len(engine.step_times)
        for r in reqs:
            engine.submit(r)
        for r in reqs:
            assert r.done.wait(900) and r.finish_reason == "length", (r.finish_reason, r.error)
    finally:
        engine.stop()
    last_insert = max(r.t_first for r in reqs)
    full = [dt for dt, t in zip(engine.step_times[k:], engine.step_end_times[k:]) if t > last_insert]
    return 1e3 * statistics.median(full), full


def _engine_ms(model, batch: int, context: int, cap: int, max_tokens: int, steps: int,
               paged: bool = False, sampling: str = "plain",
               cond: bool = False, precompile: bool = False) -> tuple[float, float, int, float, float | None]:
    """(iteration_ms, program_ms, steps measured, bare_live_ms, program_cond_ms) of an engine of ``batch`` slots at ``cap``
    (``paged``: the paged engine, its pool as many pages as fit; ``sampling``: a :data:`SAMPLING`
    key, what every request asks for; ``cond``: also time the step program with the sampling's
    sort decided on the device, else its ms are None)."""
    from models.serving.engine import Engine

    opts = SAMPLING[sampling]
    engine = Engine(model, slots=batch, max_len=cap, stop_ids=(1,) if opts else (), paged=paged)
    iteration, full = _full_batch_iteration(engine, model, batch, context, max_tokens, opts, precompile)
    # the engine's step program on its own cache, every row active, back to back
    kv = engine.kv
    if paged:  # its requests ended and gave their pages back: give every row a context's pages again
        kv.cache = dataclasses.replace(kv.cache, block_table=jnp.asarray(live_table(batch, context, cap, kv.page)),
                                       lengths=jnp.full((batch,), context, jnp.int32))
        kv._dirty = False
    else:
        kv.cache = dataclasses.replace(kv.cache, lengths=jnp.full((batch,), context, jnp.int32))
    # the bare step on the engine's own cache: the K/V and method state its prompts left, not
    # zeros (a selection's kernels take data-dependent time: the top-k's bracket search)
    live, kv.cache = _bare_on(model, model.method, model.config, kv.cache, steps, 3)
    kv.cache = dataclasses.replace(kv.cache, lengths=jnp.full((batch,), context, jnp.int32))
    z = np.zeros(batch, np.int32)
    active = np.ones(batch, bool)
    # greedy as the engine builds it (``sampled=False``: no sampling branch in the program), and
    # with the sort's branch decided on the device (``sampled=None``: a ``lax.cond``)
    greedy = RowSampling(jnp.zeros(batch, jnp.uint32), jnp.asarray(z), jnp.zeros(batch, jnp.float32),
                         jnp.ones(batch, jnp.float32), sampled=False)
    program = {}
    variants = (("static", greedy),) + ((("cond", dataclasses.replace(greedy, sampled=None)),) if cond else ())
    for name, s in variants:
        toks = kv.step(z, active, s).tokens
        jax.block_until_ready(toks)
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(steps):
                toks = kv.step(toks, active, s).tokens
            jax.block_until_ready(toks)
            times.append(1e3 * (time.perf_counter() - t0) / steps)
        program[name] = statistics.median(times)
    return iteration, program["static"], len(full), live, program.get("cond")


#: ``--engines``: the resident engines, and the offloaded ones (KV blocks in pinned host memory;
#: ``offload-paged``: on the paged host tier)
ENGINES = ("contiguous", "paged", "offload", "offload-paged")


def _offload_engine_ms(model, batch: int, context: int, cap: int, max_tokens: int, steps: int,
                       paged: bool, precompile: bool = False) -> tuple[float, int, float]:
    """``(iteration_ms, steps measured, bare_ms)`` of an offloaded engine of ``batch`` slots at
    ``cap`` (``paged``: its host tier a pool of pages, as many as every slot full) with every
    slot decoding a ``context``-token prompt, and the bare offloaded step at the same batch,
    context (:func:`_bare_offload_ms`: the runner's decode step back to back on synthetic KV, no
    sampling, no engine)."""
    from models.serving.engine import Engine

    engine = Engine(model, slots=batch, max_len=cap, stop_ids=(), offload=True, paged=paged)
    iteration, full = _full_batch_iteration(engine, model, batch, context, max_tokens, {}, precompile)
    del engine
    return iteration, len(full), _bare_offload_ms(model, batch, context, steps, paged)


def _bare_offload_ms(model, batch: int, context: int, steps: int, paged: bool, rounds: int = 3) -> float:
    """The offloaded runner's decode step (greedy argmax outside, as the engine's loop takes
    it) back to back on synthetic KV of ``batch`` rows at ``context`` tokens: the median of
    ``rounds`` rounds of ``steps`` (its capacity holds those steps; the host tier's size does
    not change the step's work)."""
    from benchmarks.offload import _synthetic_kv, cache_capacity
    from models.runtime.tiered import TieredRunner

    max_len = cache_capacity(context, 4 + (rounds + 1) * steps)
    host_pages = batch * (max_len // model.method.for_offload().offload_block_size) + 1 if paged else None
    runner = TieredRunner(model, "offload", host_pages=host_pages)
    state = runner.state_from_kv(_synthetic_kv(model.config, batch, max_len, context, model.dtype, 0),
                                 np.full((batch,), context, np.int32), max_len)
    state.record_transfers = False  # as the engine's steps (no per-step counters kept)
    tok = jnp.zeros((batch,), jnp.int32)

    def run(n):
        nonlocal tok
        for _ in range(n):
            tok = jnp.argmax(runner.decode_step(tok, state), -1).astype(jnp.int32)
        jax.block_until_ready(tok)

    run(4)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        run(steps)
        times.append(1e3 * (time.perf_counter() - t0) / steps)
    runner.finish(state)
    return statistics.median(times)


def _markdown(a, rows: list[dict], pinned: str | None) -> str:
    return (f"# The engine's decode iteration against the bare step\n\n{stamp()}\n\n"
          f"{'a tiny config' if a.tiny else 'Qwen3-8B shape'}, {a.layers} layers, random bf16 weights; every row at {a.context} tokens. "
          "`bare_ms`: the model's decode step back to back; `program_ms`: the engine's step program "
          "(decode + greedy sampling, as the engine builds it) back to back; `program_cond_ms` the same with the "
          "sampling's sort decided on the device (a `lax.cond`, the engine's program before 2026-12-04; with "
          "`--program-cond`); `iteration_ms`: the engine's median decode iteration with "
          "every slot decoding; `engine` paged: the pages of one pool, shared by the rows, through a block table "
          "(`bare_ms` is the contiguous step at the same capacity, `bare_paged_ms` the bare step on pages; `bare_live_ms` "
          "the bare step on the engine's own cache after its requests (its prompts' K/V and method state, not "
          "zeros; on pages for the paged engine); `program_ms` "
          "of the paged engine runs its pool with every row given a context's pages again). `engine` offload / "
          "offload-paged: KV blocks in pinned host memory (offload-paged: the paged host tier); their `bare_ms` is "
          "the offloaded runner's step (greedy argmax outside) back to back on synthetic KV at the same batch and "
          "context, no sampling.\n\n"
          + markdown_table(rows, ["method", "engine", "sampling", "batch", "context", "capacity", "bare_ms", "bare_paged_ms",
                                  "bare_live_ms", "program_ms", "program_cond_ms", "iteration_ms", "iteration_over_bare",
                                  "program_over_bare", "iteration_over_live", "steps_measured"])
            + ("" if pinned is None else f"\n\n{pinned[0].upper() + pinned[1:]}.\n"))


def main(argv=None) -> int:
    from benchmarks.offload import asynctls_for, random_model
    from sparse_jax.methods import get_method

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--context", type=int, default=16384, help="tokens per row (prompt length)")
    p.add_argument("--caps", type=parse_list, default=[16896, 33280], help="cache capacities per row (comma-separated)")
    p.add_argument("--batch", type=parse_list, default=[8], help="rows (comma-separated: one row of the table each)")
    p.add_argument("--sampling", default="plain", help=f"comma-separated, of {', '.join(SAMPLING)}: what each "
                                                         "request asks of the sampler")
    p.add_argument("--methods", default="dense,asynctls")
    p.add_argument("--max-tokens", type=int, default=48, help="tokens per engine request")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--engines", default="contiguous", help=f"which engines to time, of {','.join(ENGINES)} "
                                                               "(the offloaded ones: methods that offload, not dense)")
    p.add_argument("--program-cond", action="store_true",
                   help="also time the step program with the sampling's sort in a lax.cond (the engine's before "
                        "2026-12-04: engine_iteration_sampling_h200.md; one more compile per row)")
    p.add_argument("--tiny", action="store_true", help="a small random model (a CPU check of this probe)")
    p.add_argument("--compile-cache", default=None, metavar="DIR",
                   help="keep compiled programs in DIR and load them from there (a run of another method or "
                        "engine on the same machine loads the bare step and shared programs)")
    p.add_argument("--precompile", action=argparse.BooleanOptionalAction, default=None,
                   help="compile each engine's programs in parallel threads before its requests (default: on a GPU)")
    p.add_argument("--out", default=None)
    p.add_argument("--name", default="engine_iteration")
    a = p.parse_args(argv)

    caps = a.caps
    bad = [k for k in a.engines.split(",") if k not in ENGINES]
    if bad:
        raise SystemExit(f"--engines: of {', '.join(ENGINES)}; got {bad}")
    if min(caps) < a.context + a.max_tokens + 2:
        raise SystemExit(f"--caps must each be >= context + max_tokens + 2 = {a.context + a.max_tokens + 2}")
    pinned = None
    if any(k.startswith("offload") for k in a.engines.split(",")):
        from sparse_jax.offload import capacity

        # before the GPU client starts (_check_fits starts it): XLA's pinned pool is 64 GiB unless
        # set, and 8 rows of 64K (or 4 of 128K) on the Qwen3-8B shape are 78 GB of host tier
        pinned = capacity.plan_pinned_host_limit()
        print(pinned, flush=True)
    if a.compile_cache:
        use_compile_cache_flag(a.compile_cache)
    _check_fits(a, caps)
    if a.precompile is None:  # after the pinned host limit is set: this starts the backend
        a.precompile = jax.default_backend() == "gpu"
    rows = []

    def report(final: bool = False) -> str:
        """The table so far, written after every row (a run cut off by its limit keeps its rows)."""
        md = _markdown(a, rows, pinned)
        if a.out:
            write_results(a.name, {"rows": rows, **stamp(), "complete": final, "pinned_host": pinned}, md,
                          out_dir=a.out)
        return md

    t0 = time.perf_counter()

    def phase(what: str) -> None:  # where a call's minutes go (compiles and prefills at 64K-128K)
        print(f"[{time.perf_counter() - t0:6.0f} s] {what}", flush=True)

    for name in a.methods.split(","):
        for cap in caps:
            cfg = probe_config(a, cap)
            budget = 64 if a.tiny else 2048
            method = (asynctls_for(cfg, budget=budget, kb=8 if a.tiny else 128) if name == "asynctls"
                      else get_method(name))
            phase(f"{name}: building the model at capacity {cap}")
            model = random_model(cfg, method, cap)
            for batch in a.batch:
                phase(f"{name}: the bare step, {batch} rows")
                bare = _bare_ms(model, method, cfg, batch, a.context, cap, a.steps, a.rounds)
                bare_paged = (_bare_ms(model, method, cfg, batch, a.context, cap, a.steps, a.rounds, paged=True)
                              if "paged" in a.engines.split(",") else None)
                for kind in a.engines.split(","):
                    phase(f"{name}: the {kind} engine, {batch} rows")
                    if kind.startswith("offload"):
                        if name == "dense":  # nothing selects blocks to bring back: it does not offload
                            continue
                        iteration, n, bare_off = _offload_engine_ms(model, batch, a.context, cap, a.max_tokens,
                                                                    a.steps, paged=kind == "offload-paged",
                                                                    precompile=a.precompile)
                        rows.append({"method": name, "engine": kind, "sampling": "plain", "batch": batch,
                                     "context": a.context, "capacity": cap, "bare_ms": round(bare_off, 3),
                                     "iteration_ms": round(iteration, 3), "steps_measured": n,
                                     "iteration_over_bare": round(iteration / bare_off, 3)})
                        print(rows[-1], flush=True)
                        report()
                        continue
                    for sampling in a.sampling.split(","):
                        if sampling not in SAMPLING:
                            raise SystemExit(f"--sampling: {', '.join(SAMPLING)}; got {sampling!r}")
                        iteration, program, n, live, cond = _engine_ms(model, batch, a.context, cap, a.max_tokens, a.steps,
                                                                 paged=kind == "paged", sampling=sampling,
                                                                 cond=a.program_cond, precompile=a.precompile)
                        rows.append({"method": name, "engine": kind, "sampling": sampling, "batch": batch,
                                     "context": a.context, "capacity": cap, "bare_ms": round(bare, 3),
                                     "bare_paged_ms": None if bare_paged is None else round(bare_paged, 3),
                                     "bare_live_ms": round(live, 3), "program_ms": round(program, 3),
                                     "program_cond_ms": None if cond is None else round(cond, 3),
                                     "iteration_ms": round(iteration, 3), "steps_measured": n,
                                     "iteration_over_bare": round(iteration / bare, 3),
                                     "program_over_bare": round(program / bare, 3),
                                     "iteration_over_live": round(iteration / live, 3)})
                        print(rows[-1], flush=True)
                        report()
            del model
            jax.clear_caches()
    print(report(final=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
