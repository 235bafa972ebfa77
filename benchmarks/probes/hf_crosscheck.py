"""Dense long-context retrieval: our model against Hugging Face transformers on the
same GGUF and the same prompts.

A low dense score at 32K is either the model (a 270M base model at the end of its
trained context) or our implementation (RoPE precision, the sliding-window mask,
the cache). This tells the two apart: both implementations read the same GGUF,
get the same token ids (our tokenizer's, which the parity tests check against
transformers'), decode greedily, and are scored by the same string match.

Usage (on a machine with torch + transformers + gguf, e.g. the lent GPU)::

    python -m benchmarks.probes.hf_crosscheck --model gemma3-270m --tasks passkey,niah_single_1 \\
        --lengths 16384,32768 --samples 8 --out $OUT --name hf_crosscheck_gemma3

Writes ``<name>.json`` / ``.md``: per length and task the score of each
implementation, how often their greedy outputs agree exactly, and every
prediction. transformers runs with SDPA attention (its eager path would hold a
``32K x 32K`` score matrix per head) in ``--hf-dtype`` (default bfloat16, as our
harness runs).
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks import ruler_tasks
from benchmarks.timing import markdown_table, stamp, write_results

_GGUF_PATHS = {"gemma3-270m": "gemma3_gguf_path", "smollm2-135m": "smollm2_gguf_path"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.probes.hf_crosscheck", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gemma3-270m", choices=sorted(_GGUF_PATHS))
    p.add_argument("--tasks", default="passkey", help="comma-separated RULER-style tasks (default passkey)")
    p.add_argument("--lengths", default="16384,32768", help="comma-separated context lengths")
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=8, help="rows per batch of our model")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="our model's dtype")
    p.add_argument("--hf-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--out", default=None)
    p.add_argument("--name", default=None)
    args = p.parse_args(argv)
    args.tasks = [t for t in args.tasks.split(",") if t]
    bad = [t for t in args.tasks if t not in ruler_tasks.TASKS]
    if bad:
        p.error(f"unknown task(s) {bad}; available: {', '.join(ruler_tasks.TASKS)}")
    try:
        args.lengths = [int(x) for x in args.lengths.split(",") if x]
    except ValueError:
        p.error(f"--lengths must be comma-separated integers, got {args.lengths!r}")
    if not args.lengths or min(args.lengths) < 256:
        p.error("--lengths: give lengths of at least 256 tokens")
    if args.samples < 1 or args.batch_size < 1:
        p.error("--samples and --batch-size must be >= 1")
    return args


def hf_generate(hf_model, torch, samples, stops: set[int]) -> list[list[int]]:
    """Greedy continuation of each sample alone (no padding), to EOS or its answer length."""
    outs = []
    dev = next(hf_model.parameters()).device
    for s in samples:
        ids = torch.tensor([list(s.input_ids)], device=dev)
        with torch.no_grad():
            gen = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=s.max_new_tokens,
                                    do_sample=False, eos_token_id=sorted(stops), pad_token_id=sorted(stops)[0])
        new = gen[0, ids.shape[1]:].tolist()
        cut = next((i for i, t in enumerate(new) if t in stops), len(new))
        outs.append(new[:cut])
    return outs


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    try:  # checked before any weights load: the project venv has no torch
        import torch
        import transformers
    except ImportError as e:
        print(f"hf_crosscheck needs torch and transformers (and gguf): {e}", file=sys.stderr)
        return 2
    import jax.numpy as jnp

    import models
    from benchmarks import accuracy
    from models import gguf_loader

    command = "python -m benchmarks.probes.hf_crosscheck " + shlex.join(argv)
    st = stamp(command)
    t0 = time.perf_counter()
    dtype = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}[args.dtype]
    ours = models.load_model(args.model, dtype=dtype, max_len=max(args.lengths))
    tok = ours.tokenizer
    stops = accuracy.stop_ids(ours, tok)
    gguf = Path(getattr(gguf_loader, _GGUF_PATHS[args.model])())
    hf_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.hf_dtype]
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, torch_dtype=hf_dtype, attn_implementation="sdpa")
    hf = hf.to("cuda" if torch.cuda.is_available() else "cpu").eval()
    print(f"[hf_crosscheck] loaded both in {time.perf_counter() - t0:.1f}s (transformers "
          f"{transformers.__version__}, torch {torch.__version__})", file=sys.stderr)

    rows, preds = [], []
    for L in args.lengths:
        samples = ruler_tasks.generate_samples(args.tasks, L, args.samples, tok, chat=False)
        t = time.perf_counter()
        ours_res = accuracy.run_samples(ours, samples, tok, batch_size=args.batch_size, progress=False)
        t_ours = time.perf_counter() - t
        t = time.perf_counter()
        hf_ids = hf_generate(hf, torch, samples, stops)
        t_hf = time.perf_counter() - t
        for task in args.tasks:
            idx = [i for i, s in enumerate(samples) if s.task == task]
            hf_text = [tok.decode(hf_ids[i]) for i in idx]
            hf_score = [ruler_tasks.score(x, samples[i].answers) for x, i in zip(hf_text, idx)]
            our_text = [ours_res[i]["prediction"] for i in idx]
            rows.append({"length": L, "task": task, "samples": len(idx),
                         "ours": float(np.mean([ours_res[i]["score"] for i in idx])),
                         "transformers": float(np.mean(hf_score)),
                         "same_output": float(np.mean([a.strip() == b.strip() for a, b in zip(our_text, hf_text)])),
                         "prompt_tokens": int(np.mean([samples[i].num_tokens for i in idx]))})
            for i, x, sc in zip(idx, hf_text, hf_score):
                preds.append({"length": L, "task": task, "index": samples[i].index, "answers": list(samples[i].answers),
                              "ours": ours_res[i]["prediction"], "ours_score": ours_res[i]["score"],
                              "transformers": x, "transformers_score": sc})
        print(f"[hf_crosscheck] {L}: ours {t_ours:.0f}s, transformers {t_hf:.0f}s", file=sys.stderr)

    payload = {"stamp": st, "model": args.model, "dtype": args.dtype, "hf_dtype": args.hf_dtype,
               "transformers": transformers.__version__, "torch": torch.__version__,
               "rows": rows, "predictions": preds, "wall_s": time.perf_counter() - t0}
    md = (f"# Dense retrieval: ours vs transformers ({args.model})\n\n"
          f"Device {st['device']}, jax {st['jax']}, transformers {transformers.__version__}, {st['date']}.\n"
          f"Command: `{command}`. Ours in {args.dtype}, transformers in {args.hf_dtype} (SDPA); "
          "same GGUF, same token ids, greedy.\n\n"
          + markdown_table(rows, ["length", "task", "samples", "prompt_tokens", "ours", "transformers", "same_output"],
                           {"ours": ".3f", "transformers": ".3f", "same_output": ".2f"}))
    name = args.name or f"hf_crosscheck_{args.model}"
    write_results(name, payload, md, args.out)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
