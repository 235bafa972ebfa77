"""Text generation from the command line, with timings; and the long-context demo.

::

    python -m models.generate --prompt "Tell me about the sea."           # SmolLM2-135M, dense
    python -m models.generate --chat --prompt-file question.txt --max-new-tokens 64
    python -m models.generate --attention quest --attention-opt budget=512 --prompt "..."
    python -m models.generate --demo                                       # needle in ~3.3K tokens

(also installed as the console script ``sparse-jax-generate``).

What it does: loads the model (``models.load_model``), tokenizes the prompt
(``--chat`` wraps it as one user message in the model's chat template),
right-pads it to a multiple of 256 tokens (``lengths`` carries the real
length, so one compilation serves every prompt of the same bucket), prefills,
then samples token by token with ``model.decode_step``: greedy when
``--temperature 0`` (the default), else temperature + nucleus (``--top-p``)
sampling from ``--seed``. Text is streamed to stdout as it is produced: after
each token the generated ids are decoded again and the new suffix printed, so
multi-byte characters split across tokens come out whole. Generation stops at
EOS or after ``--max-new-tokens``.

Timings: the prefill and the decode step are compiled ahead of time for the
real shapes (``jit(...).lower(...).compile()``; the compile times are printed
separately), so the reported speeds exclude compilation and nothing runs
twice. Prefill speed = prompt tokens / prefill wall time (the real prompt
length; the speed counting the padded bucket is printed beside it); decode
speed = decode steps / their wall time, sampling and the host round trip for
streaming included. Peak
memory is the device's ``peak_bytes_in_use`` when the backend reports it
(GPU); on CPU, which does not, it is the process's peak resident set size
(``getrusage``), labelled as such.

``--dtype`` defaults to bfloat16 on GPU and float32 on CPU. On CPU, float32 is
the exact path (it matches the Hugging Face float32 reference to ~6e-5 in the
logits) and bf16 buys little: measured with SmolLM2-135M on the 2-core dev box
(a Xeon with AMX-BF16, so bf16 is at its best there), bf16 prefills a little
faster and decodes no faster or slower (docs/models.md, 'CPU performance', the
table of the CPU paths). CPUs without native bf16 are slower still in bf16.

Every argument error is reported before the weights load or anything compiles:
unknown model or attention method (the valid names are listed), bad
``--attention-opt``, both ``--prompt`` and ``--prompt-file``, a missing prompt
file, ``--max-new-tokens`` < 1, and (after reading only the tokenizer) a prompt
longer than the model's context or prompt + new tokens beyond it.

``--demo`` asks the model for a passphrase hidden once in the middle of a
~3,300-token text (:mod:`models.cli.demo_prompt`), with the chat template and greedy
decoding of 24 tokens, prints whether the answer contains it, and exits with
status 1 if it does not.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import os
import resource
import sys
import time
from typing import Any, Sequence, TextIO

import jax
import jax.numpy as jnp
import numpy as np

import models
import sparse_jax.methods  # noqa: F401  (registers the built-in methods)
from models import gguf_loader
from models.api import bind_method, method_for_model, round_up
from models.cli.demo_prompt import build_demo_prompt, check_answer
from models.cli.options import CLIError, add_prefill_flags, method_options, parse_attention_opts, parse_option_value  # noqa: F401,E501 (re-exported)
from models.config import REAL_WEIGHTS, available_models
from models.detokenize import IncrementalDetokenizer
from models.runtime import shard, with_cache_rank
from models.sampling import sample_next
from sparse_jax.methods import available_methods, get_method

BUCKET = 256
DEFAULT_MODEL = "smollm2-135m"
DEFAULT_MAX_NEW_TOKENS = 128
DEMO_MAX_NEW_TOKENS = 24


# -----------------------------------------------------------------------------
# Argument parsing and validation (no weights, no compilation)
# -----------------------------------------------------------------------------


def _available_models() -> list[str]:
    return available_models()


def _available_methods() -> list[str]:
    return available_methods()


def default_dtype() -> str:
    """bfloat16 on accelerators, float32 on CPU (XLA:CPU is slow in bf16)."""
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def build_parser() -> argparse.ArgumentParser:
    models = _available_models()
    methods = _available_methods()
    p = argparse.ArgumentParser(
        prog="sparse-jax-generate",
        description="Generate text with a sparse-jax model, streaming tokens and reporting "
                    "prefill/decode speed and peak memory.",
        epilog="Examples:\n"
               "  sparse-jax-generate --prompt 'Tell me about the sea.'\n"
               "  sparse-jax-generate --chat --prompt-file q.txt --max-new-tokens 64\n"
               "  sparse-jax-generate --demo --attention dense\n",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("prompt_arg", nargs="?", metavar="PROMPT", default=None,
                   help="the prompt (same as --prompt)")
    p.add_argument("--model", default=DEFAULT_MODEL, choices=models,
                   help=f"model preset (default {DEFAULT_MODEL}); one of: {', '.join(models)}")
    p.add_argument("--prompt", default=None, help="the prompt text")
    p.add_argument("--prompt-file", default=None, metavar="PATH",
                   help="read the prompt from a UTF-8 file ('-' reads stdin)")
    p.add_argument("--chat", action="store_true",
                   help="wrap the prompt as one user message in the model's chat template")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature; 0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default 1)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help=f"tokens to generate at most (default {DEFAULT_MAX_NEW_TOKENS}; "
                        f"{DEMO_MAX_NEW_TOKENS} with --demo)")
    p.add_argument("--attention", default="dense", choices=methods, metavar="NAME",
                   help=f"attention method (default dense); one of: {', '.join(methods)}")
    p.add_argument("--attention-opt", action="append", default=[], metavar="KEY=VALUE",
                   help="an attention method option (repeatable), e.g. budget=512, "
                        "dense_layers=0,1 (tuple), use_kernel=false; values are parsed as "
                        "int / float / bool / None / tuple where they look like one")
    add_prefill_flags(p)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="parameter and KV-cache dtype (default: bfloat16 on GPU; float32 on CPU, "
                        "the exact path, where bf16 is not faster overall)")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="write a jax.profiler trace of the measured prefill + decode (compilation "
                        "excluded) to DIR; view it with TensorBoard or Perfetto")
    p.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="split the model over N devices by KV heads (models.runtime.sharding; on CPU set "
                        "XLA_FLAGS=--xla_force_host_platform_device_count=N); default 1")
    p.add_argument("--cache-rank", action="store_true",
                   help="AsyncSpade only: choose the next step's selection on a second device (its cache "
                        "rank, models.runtime.cache_rank) while the first runs the step; on CPU set "
                        "XLA_FLAGS=--xla_force_host_platform_device_count=2")
    p.add_argument("--demo", action="store_true",
                   help="built-in long-context test: find a passphrase hidden in ~3,300 tokens "
                        "(chat template, greedy, 24 tokens); exit status 1 if the answer is wrong")
    return p


@dataclasses.dataclass
class RunSpec:
    """A validated command line (before the tokenizer/model is read)."""

    model: str
    prompt: str
    chat: bool
    temperature: float
    top_p: float
    seed: int
    max_new_tokens: int
    attention: str
    attention_opts: dict[str, Any]
    method: Any  # the AttentionMethod instance
    dtype: str
    profile: str | None
    demo: Any = None  # models.cli.demo_prompt.DemoPrompt with --demo
    tensor_parallel: int = 1
    cache_rank: bool = False


def resolve_args(args: argparse.Namespace) -> RunSpec:
    """Check a parsed command line; CLIError on anything wrong. Loads nothing."""
    sources = [n for n, v in (("PROMPT", args.prompt_arg), ("--prompt", args.prompt),
                              ("--prompt-file", args.prompt_file)) if v is not None]
    if args.demo:
        sources = ["--demo"] + sources
    if len(sources) > 1:
        raise CLIError(f"give only one of PROMPT, --prompt, --prompt-file, --demo (got {' and '.join(sources)})")
    if not sources:
        raise CLIError("no prompt: give PROMPT, --prompt TEXT, --prompt-file PATH or --demo")
    if args.tensor_parallel < 1:
        raise CLIError(f"--tensor-parallel must be >= 1, got {args.tensor_parallel}")
    if args.cache_rank and args.attention != "asyncspade":
        raise CLIError(f"--cache-rank is AsyncSpade's: use --attention asyncspade (got {args.attention})")
    if args.cache_rank and args.tensor_parallel > 1:
        raise CLIError("--cache-rank and --tensor-parallel do not combine")

    demo = None
    chat = bool(args.chat)
    if args.demo:
        demo = build_demo_prompt()
        prompt = demo.text
        chat = True
    elif args.prompt_file is not None:
        path = args.prompt_file
        if path == "-":
            prompt = sys.stdin.read()
        else:
            if not os.path.exists(path):
                raise CLIError(f"prompt file {path!r} does not exist")
            if not os.path.isfile(path):
                raise CLIError(f"prompt file {path!r} is not a file")
            try:
                with open(path, encoding="utf-8") as f:
                    prompt = f.read()
            except UnicodeDecodeError as e:
                raise CLIError(f"prompt file {path!r} is not valid UTF-8: {e}") from None
    else:
        prompt = args.prompt if args.prompt is not None else args.prompt_arg
    if not prompt.strip() and not chat:
        raise CLIError("the prompt is empty")

    max_new = args.max_new_tokens
    if max_new is None:
        max_new = DEMO_MAX_NEW_TOKENS if args.demo else DEFAULT_MAX_NEW_TOKENS
    if max_new < 1:
        raise CLIError(f"--max-new-tokens must be >= 1, got {max_new}")
    if args.temperature < 0 or not np.isfinite(args.temperature):
        raise CLIError(f"--temperature must be >= 0, got {args.temperature}")
    if not 0.0 < args.top_p <= 1.0:
        raise CLIError(f"--top-p must be in (0, 1], got {args.top_p}")

    models = _available_models()
    if args.model not in models:
        raise CLIError(f"unknown model {args.model!r}; available: {', '.join(models)}")
    methods = _available_methods()
    if args.attention not in methods:
        raise CLIError(f"unknown attention method {args.attention!r}; available: {', '.join(methods)}")
    opts = method_options(args)

    try:
        method = get_method(args.attention, **opts)
    except (ValueError, TypeError) as e:
        raise CLIError(str(e)) from None

    if args.profile is not None and os.path.exists(args.profile) and not os.path.isdir(args.profile):
        raise CLIError(f"--profile {args.profile!r} exists and is not a directory")

    return RunSpec(model=args.model, prompt=prompt, chat=chat, temperature=float(args.temperature),
                   top_p=float(args.top_p), seed=int(args.seed), max_new_tokens=int(max_new),
                   attention=args.attention, attention_opts=opts, method=method,
                   dtype=args.dtype or default_dtype(), profile=args.profile, demo=demo,
                   tensor_parallel=int(args.tensor_parallel), cache_rank=bool(args.cache_rank))


@functools.lru_cache(maxsize=4)
def load_config_and_tokenizer(name: str):
    """The model's config and tokenizer without its weights (cheap; cached); CLIError if it has no tokenizer."""
    if name not in REAL_WEIGHTS:
        raise CLIError(f"model {name!r} has random weights and no tokenizer, so it cannot generate text; "
                       f"models with real weights: {', '.join(sorted(REAL_WEIGHTS))}")
    try:
        g = gguf_loader.read_gguf(gguf_loader.weights_path(name), name=name, tensors=False)
    except gguf_loader.WeightsNotFoundError as e:
        raise CLIError(str(e)) from None
    if g.tokenizer is None:
        raise CLIError(f"the weights of {name!r} carry no tokenizer")
    return g.config, g.tokenizer


@dataclasses.dataclass
class Prepared:
    ids: list[int]
    text: str           # what was tokenized (chat-rendered with --chat)
    bucket: int         # padded prompt length
    cache_len: int      # KV-cache capacity
    context: int        # the model's maximum context


def prepare_prompt(spec: RunSpec, config, tokenizer) -> Prepared:
    """Tokenize and check the lengths against the model's context; CLIError if they do not fit."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": spec.prompt}]) if spec.chat else spec.prompt
    ids = tokenizer.encode(text)
    n = len(ids)
    ctx = int(config.max_position)
    if n == 0:
        raise CLIError("the prompt is empty (no tokens)")
    if n > ctx:
        raise CLIError(f"the prompt is {n} tokens, longer than the context of model {config.name!r} "
                       f"({ctx} tokens)")
    if n + spec.max_new_tokens > ctx:
        raise CLIError(f"the prompt ({n} tokens) + --max-new-tokens ({spec.max_new_tokens}) = "
                       f"{n + spec.max_new_tokens} tokens exceeds the context of model {config.name!r} "
                       f"({ctx} tokens); lower --max-new-tokens to at most {ctx - n}")
    cache_len = min(round_up(n + spec.max_new_tokens, BUCKET), ctx)
    bucket = min(round_up(n, BUCKET), cache_len)
    # Bind the method to this model first (calibrated channels for double_sparsity / asynctls), as
    # load_model does: checking the unbound method refused every calibrated method.
    # The model's dense-layer rule too (Gemma 3: every global layer sparse unless
    # --attention-opt dense_layers=... says otherwise).

    try:
        spec.method = bind_method(method_for_model(spec.attention, spec.attention_opts, config), config, cache_len)
    except (ValueError, FileNotFoundError) as e:
        raise CLIError(f"attention method {spec.attention!r} cannot run this model: {e}") from None
    return Prepared(ids=ids, text=text, bucket=bucket, cache_len=cache_len, context=ctx)


# -----------------------------------------------------------------------------
# The run
# -----------------------------------------------------------------------------


def _sync(x):
    return jax.block_until_ready(x)


def peak_memory() -> tuple[int | None, str]:
    """(bytes, label): the device's peak_bytes_in_use where reported, else the process peak RSS."""
    try:
        stats = jax.local_devices()[0].memory_stats()
    except Exception:  # noqa: BLE001  (backends without memory stats)
        stats = None
    if stats and stats.get("peak_bytes_in_use") is not None:
        return int(stats["peak_bytes_in_use"]), f"peak device memory ({jax.local_devices()[0].device_kind})"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    rss = rss if sys.platform == "darwin" else rss * 1024
    return int(rss), "process peak RSS (host; this backend reports no device memory stats)"


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return f"{n}"


def _stop_ids(model) -> set[int]:
    ids = {model.config.eos_token_id, getattr(model.tokenizer, "eos_token_id", None)}
    try:
        eot = model.tokenizer.backend.token_to_id("<|endoftext|>")
    except Exception:  # noqa: BLE001
        eot = None
    ids.add(eot)
    return {int(i) for i in ids if i is not None}


def generate_timed(model, prep: Prepared, spec: RunSpec, out: TextIO) -> dict[str, Any]:
    """Compile prefill and decode ahead of time for the real shapes, then run the
    measured prefill + decode loop (under ``jax.profiler.trace(spec.profile)``
    when given), streaming text to ``out``. Returns the ids, the text and the
    timings."""
    n = len(prep.ids)
    pad = next((i for i in (model.config.pad_token_id, model.config.eos_token_id) if i is not None), 0)
    tokens_np = np.full((1, prep.bucket), pad, np.int32)
    tokens_np[0, :n] = prep.ids
    tokens = jnp.asarray(tokens_np)
    lengths = jnp.asarray([n], jnp.int32)
    samp = functools.partial(sample_next, temperature=spec.temperature, top_p=spec.top_p)
    params = model.params

    # compile (ahead of time, nothing runs): prefill, decode_step, sampling
    cache = model.init_cache(1, prep.cache_len)
    t0 = time.perf_counter()
    if hasattr(model.fns.prefill, "lower"):
        prefill = model.fns.prefill.lower(params, tokens, lengths, cache).compile()
        t1 = time.perf_counter()
        logits_shape, cache_shape = jax.eval_shape(model.fns.prefill, params, tokens, lengths, cache)
        decode = model.fns.decode_step.lower(params, jax.ShapeDtypeStruct((1,), jnp.int32), cache_shape).compile()
        t2 = time.perf_counter()
    else:  # several programs per step (the cache rank): compiled by a warm-up run on a spare cache
        prefill, decode = model.fns.prefill, model.fns.decode_step
        logits, warm = prefill(params, tokens, lengths, model.init_cache(1, prep.cache_len))
        _sync(logits)
        t1 = time.perf_counter()
        tok = jnp.argmax(logits, -1).astype(jnp.int32)
        for _ in range(2):  # the second step compiles again (its inputs are the first one's outputs)
            logits, warm = decode(params, tok, warm)
        _sync(logits)
        del warm
        t2 = time.perf_counter()
        logits_shape = logits
    _sync(samp(jnp.zeros(logits_shape.shape, logits_shape.dtype), jax.random.key(0)))
    t3 = time.perf_counter()

    # the measured run
    detok = IncrementalDetokenizer(model.tokenizer.decode)

    def stream(ids: list[int], final: bool = False) -> None:
        if piece := detok.update(ids, final):
            out.write(piece)
            out.flush()

    stops = _stop_ids(model)
    key = jax.random.key(spec.seed)
    _sync(cache)
    with jax.profiler.trace(spec.profile) if spec.profile else contextlib.nullcontext():
        res = _measured_run(prefill, decode, samp, params, tokens, lengths, cache, key, stops, stream, spec)
    stream(res["ids"], final=True)
    out.write("\n")
    out.flush()
    res.update(text=model.tokenizer.decode(res["ids"]), prompt_tokens=n, compile_prefill_s=t1 - t0,
               compile_decode_s=t2 - t1, compile_sample_s=t3 - t2)
    return res


def _measured_run(prefill, decode, samp, params, tokens, lengths, cache, key, stops, stream, spec):
    t4 = time.perf_counter()
    logits, cache = prefill(params, tokens, lengths, cache)
    _sync(logits)
    prefill_s = time.perf_counter() - t4

    generated: list[int] = []
    stopped = None
    decode_steps = 0
    t5 = time.perf_counter()
    for step in range(spec.max_new_tokens):
        key, sub = jax.random.split(key)
        tok = samp(logits, sub)
        t = int(np.asarray(tok)[0])
        if t in stops:
            stopped = "eos"
            break
        generated.append(t)
        stream(generated)
        if step == spec.max_new_tokens - 1:
            break
        logits, cache = decode(params, tok, cache)
        decode_steps += 1
    _sync(logits)
    decode_s = time.perf_counter() - t5
    return {"ids": generated, "stopped": stopped or "max_new_tokens", "prefill_s": prefill_s,
            "decode_steps": decode_steps, "decode_s": decode_s}


def report(res: dict[str, Any], prep: Prepared, out: TextIO) -> None:
    n = res["prompt_tokens"]
    out.write("-" * 72 + "\n")
    out.write(f"prefill: {n} tokens in {res['prefill_s']:.3f} s = {n / res['prefill_s']:.1f} tok/s "
              f"(computed padded to {prep.bucket}: {prep.bucket / res['prefill_s']:.1f} padded tok/s; "
              "compiled beforehand)\n")
    if res["decode_steps"]:
        # each decode step produces one token (the first token comes from the prefill)
        out.write(f"decode: {res['decode_steps']} steps in {res['decode_s']:.3f} s = "
                  f"{res['decode_steps'] / res['decode_s']:.2f} tok/s "
                  f"(sampling and streaming included; cache {prep.cache_len} tokens)\n")
    else:
        out.write("decode: n/a (no decode step: one new token, taken from the prefill)\n")
    out.write(f"compile (trace + XLA compile ahead of time, not in the speeds): prefill {res['compile_prefill_s']:.2f} s, "
              f"decode step {res['compile_decode_s']:.2f} s, sampling {res['compile_sample_s']:.2f} s\n")
    b, label = peak_memory()
    out.write(f"{label}: {_fmt_bytes(b)}\n")
    out.write(f"generated {len(res['ids'])} tokens, stopped at {res['stopped']}\n")


def run(spec: RunSpec, out: TextIO | None = None) -> dict[str, Any]:
    """Read the tokenizer, check lengths, load the model, generate with timings
    (text and report written to ``out``, default stdout)."""
    out = sys.stdout if out is None else out

    config, tokenizer = load_config_and_tokenizer(spec.model)
    prep = prepare_prompt(spec, config, tokenizer)
    t0 = time.perf_counter()
    model = models.load_model(spec.model, dtype=jnp.dtype(spec.dtype), attention=spec.method)
    devices = ""
    if spec.tensor_parallel > 1:
        try:
            model = shard(model, model=spec.tensor_parallel)
        except ValueError as e:
            raise CLIError(f"--tensor-parallel {spec.tensor_parallel}: {e}") from e
        devices = f" x {spec.tensor_parallel} (tensor parallel)"
    if spec.cache_rank:
        try:
            model = with_cache_rank(model)
        except ValueError as e:
            raise CLIError(f"--cache-rank: {e}") from e
        devices = f" + cache rank on {model.devices[1]}"
    load_s = time.perf_counter() - t0
    opts = ", ".join(f"{k}={v}" for k, v in spec.attention_opts.items())
    out.write(f"[{spec.model} | attention {spec.attention}{f' ({opts})' if opts else ''} | {spec.dtype} | {jax.devices()[0].platform}{devices} | "
              f"prompt {len(prep.ids)} tokens{' (chat)' if spec.chat else ''}, padded to {prep.bucket} | "
              f"cache {prep.cache_len} | weights loaded in {load_s:.1f} s]\n")
    out.flush()
    res = generate_timed(model, prep, spec, out)
    report(res, prep, out)
    if spec.profile:
        out.write(f"profile of the measured prefill + decode written to {spec.profile}\n")
    res["load_s"] = load_s
    res["prep"] = prep
    return res


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        spec = resolve_args(args)
        if spec.demo is not None:
            sys.stdout.write(f"demo: {len(spec.prompt)} characters of notes with one hidden fact "
                             f"({spec.demo.fact!r}); asking for it.\n")
        res = run(spec)
    except CLIError as e:
        parser.error(str(e))  # exits with status 2
    if spec.demo is not None:
        ok = check_answer(res["text"], spec.demo.passphrase)
        print(f"demo: the answer {'contains' if ok else 'does NOT contain'} the passphrase "
              f"{spec.demo.passphrase!r}: {'PASS' if ok else 'FAIL'}")
        return 0 if ok else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
