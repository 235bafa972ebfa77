"""``python -m models.serve``: the OpenAI-compatible server's command line (the app
itself is :mod:`models.serving.server`; also the console script ``sparse-jax-serve``)."""

import argparse
import sys
import threading
from typing import Sequence

import jax
import jax.numpy as jnp

import models
from models.cli.options import add_prefill_flags, method_options
from models.runtime.sharding import shard
from models.serving.engine import Engine
from models.serving.paged import DEFAULT_PREFILL_CHUNK, check_chunked_prefill
from models.serving.precompile import compile_cache_entries, default_compile_cache_dir, use_compile_cache
from models.serving.replicas import replicate
from models.serving.server import build_app
from sparse_jax.methods import available_methods, get_method
from sparse_jax.offload import capacity


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m models.serve",
                                description="Serve a model over the OpenAI HTTP API (completions, chat, SSE).")
    p.add_argument("--model", default="smollm2-135m", help="model preset (one with real weights and a tokenizer)")
    p.add_argument("--attention", default="dense", help="attention method (sparse_jax.available_methods())")
    p.add_argument("--attention-opt", action="append", default=[], metavar="KEY=VALUE",
                   help="method option, repeatable (e.g. budget=1024)")
    add_prefill_flags(p)
    p.add_argument("--offload", action="store_true",
                   help="KV blocks in pinned host memory, per-slot device pools (methods whose selection names "
                        "blocks: quest, arkvale, asynctls)")
    p.add_argument("--pool-slots", type=int, default=None,
                   help="--offload: resident block slots per (slot, KV head) (default: twice one step's blocks); "
                        "with --pool shared, per KV head for all slots (default: slots x that)")
    p.add_argument("--pool", choices=("per_row", "shared"), default="per_row",
                   help="--offload: per_row (default) keeps a pool of --pool-slots per slot and KV head; shared "
                        "keeps one pool of --pool-slots per layer and KV head for every slot, LRU across them "
                        "(SparseServe): the working-set admission keeps the running requests' working sets "
                        "within it, and at most pool-slots // blocks-per-step requests decode at once")
    p.add_argument("--max-inject-tokens", type=int, default=None, metavar="N",
                   help="layer-segmented prefill, N prompt tokens x layers per iteration beside the decode step "
                        "(SparseServe), a layer over N in chunks of N tokens (rounded to 64), resident or --offload: "
                        "a long prompt no longer stalls the running requests; default: each prompt's whole prefill "
                        "in one iteration")
    p.add_argument("--paged", action=argparse.BooleanOptionalAction, default=None,
                   help="resident KV in one pool of pages shared by every request, a block table per request "
                        "(vLLM's PagedAttention): a request holds the pages its tokens fill, not --max-len; "
                        "admission goes by free pages, and the newest request is preempted (recomputed later) "
                        "when a running one cannot grow. With --offload the pages are the host tier's (pinned host "
                        "memory holds the tokens that exist, not --slots x --max-len; see --host-pages). Default: "
                        "on for a resident engine (measured no slower than --no-paged: "
                        "benchmarks/results/engine_iteration_live_h200.md; with --data-parallel one paged engine per "
                        "device; with --tensor-parallel the pools split by KV head over the devices), off with "
                        "--offload (not measured on a GPU yet)")
    p.add_argument("--kv-blocks", type=int, default=None, metavar="N",
                   help="--paged: pages in the pool, the null page included (default: as many as fit the device, "
                        "at most --slots full contexts)")
    p.add_argument("--host-pages", type=int, default=None, metavar="N",
                   help="--paged --offload: host pages of one block (every offloaded layer), the null page "
                        "included (default: as many as fit the pinned host memory, at most --slots full contexts)")
    p.add_argument("--prefill-chunk", type=int, default=None, metavar="N",
                   help="--paged: chunked prefill, N prompt tokens per iteration through every layer straight into "
                        "the pages, beside the decode step: a running request waits at most one chunk for a new "
                        "prompt, and prompts shorter than N prefill several per iteration (global layers, exact "
                        "prompt attention or --prefill tsa's chunk form; not with --max-inject-tokens). Default: "
                        f"{DEFAULT_PREFILL_CHUNK} where it runs (a model with sliding-window layers or Kascade's "
                        "tiled prefill gets whole prefills, and the server says so); 0: each prompt's whole "
                        "prefill in one iteration")
    p.add_argument("--prefill-chunk-parts", type=int, default=1, metavar="N",
                   help="--paged with chunked prefill: run each chunk of a prompt longer than a chunk in N parts "
                        "by layers, one an iteration beside the decode step: the longest pause a chunk puts on "
                        "the running streams shrinks N-fold with no more weight reads, the long prompt waiting "
                        "behind N-1 more decode steps a chunk (default 1: whole chunks; measured on an H200 at "
                        "64K-128K, N=4 cut the P99 gap between tokens 3x for 5%% of tokens/s and 21%% of TTFT)")
    p.add_argument("--precompile", action=argparse.BooleanOptionalAction, default=None,
                   help="compile the paged engine's programs (every decode batch bucket, greedy and sampled; every "
                        "chunk size and key bucket, or whole-prefill bucket) in parallel threads, smallest first, "
                        "while the server starts serving: a request whose program is still compiling waits for it, "
                        "none compiles twice, and /health counts programs_compiling (default: on a GPU; off on a "
                        "CPU, where requests compile what they use)")
    p.add_argument("--warm-up", action=argparse.BooleanOptionalAction, default=None,
                   help="once serving, run the short programs once (each one-chunk prompt size alone and in every "
                        "group prefilled together, every decode batch bucket, greedy and sampled) as requests in "
                        "the background, so the first users do not meet their first execution: on the H100 that "
                        "cost one 282 ms gap and twice the TTFT (docs/serving.md). Default: with --precompile")
    p.add_argument("--compile-cache", default=None, metavar="DIR",
                   help="keep compiled programs in DIR and load them from there on the next start (jax's persistent "
                        "compilation cache, XLA's autotuning results beside them): at a 128K context each program "
                        "compiles for 11-49 s. Default: on a GPU "
                        "$SPARSE_JAX_COMPILE_CACHE or ~/.cache/sparse-jax/xla; off on a CPU; 'off' turns it off")
    p.add_argument("--data-parallel", type=int, default=1, metavar="N",
                   help="N replicas of the model, one engine each on its own group of --tensor-parallel devices; "
                        "a request goes to the least-loaded replica (models.serving.replicas); default 1")
    p.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="split the model over N devices by KV heads (models.runtime.sharding), one engine over them; "
                        "default 1")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: --model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--slots", type=int, default=4, help="decode slots (R_max)")
    p.add_argument("--max-len", type=int, default=2048, help="context per slot, prompt + output (tokens)")
    p.add_argument("--max-tokens-per-iter", type=int, default=None, help="T_max, tokens per iteration (default: max-len + slots; "
                   "with chunked prefill the chunk + slots, a prompt counting its first chunk)")
    p.add_argument("--kv-bytes", type=int, default=None, help="M_avl in bytes (default: the whole decode cache)")
    p.add_argument("--dtype", default=None, help="float32 / bfloat16 (default: bfloat16 on GPU, float32 on CPU)")
    return p


def resolve_prefill_chunk(args, model) -> int | None:
    """The paged engine's chunk (None: whole prefills): ``--prefill-chunk`` as given (0: None), or
    by default :data:`DEFAULT_PREFILL_CHUNK` where chunked prefill runs, with a note on stderr
    saying why a model gets whole prefills instead (an explicit chunk that cannot run is refused
    by the engine, before anything compiles)."""
    if args.prefill_chunk is not None:
        return args.prefill_chunk or None
    if args.max_inject_tokens is not None:
        return None
    try:
        check_chunked_prefill(model)
    except ValueError as e:
        print(f"whole prefills (no chunked prefill): {e}", file=sys.stderr, flush=True)
        return None
    return DEFAULT_PREFILL_CHUNK


def make_engine(args) -> tuple[Engine, str]:
    """Load the model and build the engine from parsed arguments (SystemExit-free: ValueError on bad input)."""
    if args.model not in models.available_models():
        raise ValueError(f"unknown model {args.model!r}; available: {', '.join(models.available_models())}")
    if args.attention not in available_methods():
        raise ValueError(f"unknown attention method {args.attention!r}; available: {', '.join(available_methods())}")
    if args.prefill_chunk_parts != 1 and not (args.paged and not args.offload):
        raise ValueError("--prefill-chunk-parts cuts the paged resident engine's chunks: drop it, or --no-paged / "
                         "--offload")
    for name in ("slots", "max_len", "tensor_parallel", "data_parallel"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if args.max_inject_tokens is not None and args.max_inject_tokens < 1:
        raise ValueError("--max-inject-tokens must be >= 1 (prompt tokens x layers per iteration)")
    if args.pool == "shared" and not args.offload:
        raise ValueError("--pool shared needs --offload (it is the offloaded tier's pool)")
    if args.pool == "shared" and (args.tensor_parallel > 1 or args.data_parallel > 1):
        raise ValueError("--pool shared does not run on several devices yet: use --pool per_row")
    if args.offload:  # before anything starts the GPU client, which reads the limit once
        print(capacity.plan_pinned_host_limit(), file=sys.stderr, flush=True)
    if args.paged is None:  # the default: paged where it runs
        args.paged = not args.offload
    if args.kv_blocks is not None and not args.paged:
        raise ValueError("--kv-blocks sizes the page pool of the paged engine (not --no-paged or --offload)")
    if args.paged and args.offload and args.kv_blocks is not None:
        raise ValueError("--kv-blocks sizes the resident page pool; --paged --offload pages the host tier: "
                         "pass --host-pages")
    if args.host_pages is not None and not (args.paged and args.offload):
        raise ValueError("--host-pages sizes the paged host tier: pass --paged --offload")
    if args.paged and not args.offload and args.tensor_parallel > 1 and args.max_inject_tokens is not None:
        raise ValueError("--max-inject-tokens (layer-segmented prefill) runs on one device; under --tensor-parallel "
                         "the paged engine prefills into its pages, in chunks (--prefill-chunk) or whole")
    if args.paged and args.offload and args.data_parallel > 1:
        raise ValueError("--paged --offload runs one device: drop --data-parallel (or --paged)")
    if args.precompile and (not args.paged or args.offload):
        raise ValueError("--precompile compiles the paged resident engine's programs; --no-paged and --offload "
                         "compile as requests arrive: drop --precompile")
    if args.prefill_chunk is not None and args.prefill_chunk != 0:
        if args.prefill_chunk < 1:
            raise ValueError("--prefill-chunk must be >= 1 (prompt tokens per iteration), or 0 (whole prefills)")
        if not args.paged or args.offload:
            raise ValueError("--prefill-chunk prefills into the paged engine's pages (not --no-paged or --offload; "
                             "those chunk with --max-inject-tokens)")
        if args.max_inject_tokens is not None:
            raise ValueError("--prefill-chunk and --max-inject-tokens are two ways to split a prompt: pass one")
    need = args.tensor_parallel * args.data_parallel
    if need > len(jax.devices()):
        what = (f"--tensor-parallel {args.tensor_parallel}" if args.data_parallel == 1 else
                f"--data-parallel {args.data_parallel} x --tensor-parallel {args.tensor_parallel} = {need} devices")
        raise ValueError(f"{what}: {len(jax.devices())} devices visible "
                         f"(on CPU, set XLA_FLAGS=--xla_force_host_platform_device_count={need})")
    method = get_method(args.attention, **method_options(args))
    dtype = args.dtype or ("bfloat16" if jax.default_backend() == "gpu" else "float32")
    model = models.load_model(args.model, dtype=jnp.dtype(dtype), attention=method, max_len=args.max_len)
    if model.tokenizer is None:
        raise ValueError(f"model {args.model!r} has random weights and no tokenizer: it cannot serve text")
    options = dict(slots=args.slots, max_len=args.max_len, max_tokens_per_iter=args.max_tokens_per_iter,
                   kv_bytes=args.kv_bytes, offload=args.offload, pool_slots=args.pool_slots, pool=args.pool,
                   max_inject_tokens=args.max_inject_tokens)
    if args.paged and args.offload:  # pages of the host tier; prompts prefill whole or layer-segmented
        options.update(paged=True, host_pages=args.host_pages)
    elif args.paged:
        options.update(paged=True, kv_blocks=args.kv_blocks, prefill_chunk=resolve_prefill_chunk(args, model))
        if args.prefill_chunk_parts != 1:
            options.update(chunk_parts=args.prefill_chunk_parts)
    if args.data_parallel > 1:
        # one copy per device group; the loaded copy is dropped with `model`
        return replicate(model, args.data_parallel, tensor_parallel=args.tensor_parallel, **options), \
            args.served_model_name or args.model
    if args.tensor_parallel > 1:
        model = shard(model, model=args.tensor_parallel)  # the unsharded copy is dropped with `model`
    return Engine(model, **options), args.served_model_name or args.model


def main(argv: Sequence[str] | None = None) -> int:
    import uvicorn  # the server's optional dependency, imported only to run it

    parser = build_parser()
    args = parser.parse_args(argv)
    cache = args.compile_cache
    if cache is None and jax.default_backend() == "gpu":
        cache = default_compile_cache_dir()
    if cache is not None and cache != "off":
        try:  # before the engine is built: building it compiles (its pool is sized by a compile)
            cache = use_compile_cache(cache)
        except (ValueError, OSError) as e:
            parser.error(f"--compile-cache: {e}")
        print(f"compile cache: {cache} ({compile_cache_entries(cache)} programs kept)", file=sys.stderr, flush=True)
    try:
        engine, name = make_engine(args)
    except (ValueError, TypeError, FileNotFoundError) as e:
        parser.error(str(e))
    precompile = args.precompile if args.precompile is not None else jax.default_backend() == "gpu"
    if precompile:
        # in the background: at a 128K context the long key buckets take minutes each, and the
        # short prompts need not wait for them
        done = engine.precompile(progress=True, background=True)
        if done["programs"]:
            print(f"compiling {done['programs']} programs in the background, smallest first (GET /health: "
                  f"programs_compiling)", file=sys.stderr, flush=True)
    engine.start()
    if args.warm_up if args.warm_up is not None else precompile:
        threading.Thread(target=warm_up_in_background, args=(engine,), name="sparse-jax-warm-up", daemon=True).start()
    reps = f"{args.data_parallel} replicas, " if args.data_parallel > 1 else ""
    chunk = f", prefill in chunks of {engine.prefill_chunk}" if getattr(engine, "prefill_chunk", None) else ""
    print(f"serving {name!r} ({engine.model.method!r}{', offloaded' if args.offload else ''}{', paged' if args.paged else ''}{chunk}, {reps}{engine.slots} slots "
          f"of {engine.max_len} tokens) on "
          f"http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    kv = getattr(engine, "engines", [engine])[0].kv  # replicas: each the same
    print(getattr(kv, "kv_plan", f"KV: {engine.slots} slots of {engine.max_len:,} tokens, each reserved whole; the "
                                 f"batch is bound by the slots"), file=sys.stderr, flush=True)
    try:
        uvicorn.run(build_app(engine, name), host=args.host, port=args.port, log_level="info")
    finally:
        engine.stop()
    return 0


def warm_up_in_background(engine) -> None:
    """Each replica's :meth:`Engine.warm_up`, saying on stderr when it is done (or why not)."""
    for e in getattr(engine, "engines", [engine]):
        try:
            done = e.warm_up()
        except Exception as err:  # noqa: BLE001  (the server keeps serving; the first users pay the first runs)
            print(f"warm-up stopped: {err}", file=sys.stderr, flush=True)
            return
    print(f"warmed up: {done['requests']} requests in {done['bursts']} bursts ran the short programs once "
          f"({done['seconds']:.1f} s)", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
