"""Accuracy harness: RULER-style synthetic tasks (and optionally fidelity on real
text) for every attention method x budget x context length, against dense.

Usage::

    python -m benchmarks.accuracy --model smollm2-135m \\
        --methods dense,oracle_topk,streaming,quest,arkvale,double_sparsity,asynctls \\
        --budgets 512,1024,2048 --lengths 2048,4096,8192 --samples 20 --fidelity

    # quick CPU smoke run
    JAX_PLATFORMS=cpu python -m benchmarks.accuracy --methods dense,oracle_topk --budgets 256 \\
        --lengths 1024 --samples 2 --batch-size 2 --tasks niah_single_1,vt --out /tmp/acc

    # Gemma 3 270M (base model: prompts without a chat template; sparse methods on the
    # global layers 5, 11, 17 only, all three sparse unless --set METHOD.dense_layers=(0,))
    python -m benchmarks.accuracy --model gemma3-270m --lengths 4096,8192,16384,32768 \\
        --budgets 512,1024,2048 --samples 20 --batch-size 4 --fidelity

What it does, per context length:

1. Generates ``--samples`` samples of every task (:mod:`benchmarks.ruler_tasks`;
   deterministic per task, length, index and ``--seed``), each a chat-formatted
   prompt of at most ``length - 64`` tokens.
2. Runs dense once (budget "-"), then every method at every budget: the model
   weights are loaded once and only the method is swapped
   (``Model.with_method``: same params, new jitted prefill / decode). Samples
   of one length are batched (``--batch-size``) with the ragged prefill:
   right-padded to the length (one compilation per method and length), the real
   lengths passed along. Greedy decoding to EOS or the task's answer length;
   scored by RULER's string match (fraction of expected strings in the output),
   averaged per task and over tasks.
3. With ``--fidelity``: on standard-library source text, the per-layer and
   per-head attention-output relative error and attention-mass recovery
   (through :class:`benchmarks.fidelity.FidelityProbe`), and the next-token
   KL divergence / greedy agreement over ``--kl-steps`` teacher-forced steps.

Dense always runs (it is the baseline). A budget >= the context length is
skipped (every sparse method then attends the whole context: it *is* dense),
unless ``--keep-full-budget``. A method that cannot be built or run (unknown
name, missing calibration, an error while tracing) is reported in the table and
the run goes on.

Outputs, in ``--out`` (default ``benchmarks/results/``): ``<name>.json`` (all
numbers, per-layer/head fidelity arrays, the stamp: device, jax version, date,
command, commit), ``<name>.md`` (the table) and ``<name>.png`` (synthetic average,
mass recovered and KL against the budget, one panel per length, one line per
method); ``<name>_predictions.json`` (every output text with its score) goes to
``--predictions-dir`` (default ``bench_out/`` at the repository root, git-ignored:
per-prompt dumps are not committed results). ``<name>`` defaults to ``accuracy_<model>``.

Method hyperparameters: ``--set quest.block_size=16 --set streaming.sink=8``
(fields of the method's dataclass; the budget comes from ``--budgets``).
Variants of one method run side by side under an alias: ``--methods
asynctls,asynctls_lag=asynctls --set asynctls_lag.lag=True`` (the table names
the alias).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import json
import math
import pkgutil
import shlex
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import fidelity as fid
from benchmarks import ruler_tasks
from benchmarks.timing import markdown_table, parse_list, stamp, write_results
from models.api import with_dense_layer_rule

# Where the CLI writes the per-prompt predictions unless told (git-ignored, outside benchmarks/results).
PREDICTIONS_DIR = Path(__file__).resolve().parent.parent / "bench_out"

DEFAULT_METHODS = ("dense", "oracle_topk", "streaming", "quest", "arkvale", "double_sparsity", "asynctls")


# -----------------------------------------------------------------------------
# Methods
# -----------------------------------------------------------------------------


def import_methods() -> dict[str, str]:
    """Import every module of ``sparse_jax.methods`` so that the registry is full;
    return ``{module: error}`` for those that failed to import."""
    import sparse_jax.methods as pkg

    errors = {}
    for info in pkgutil.iter_modules(pkg.__path__):
        try:
            importlib.import_module(f"{pkg.__name__}.{info.name}")
        except Exception as e:  # noqa: BLE001 - a broken method must not stop the others
            errors[info.name] = f"{type(e).__name__}: {e}"
    return errors


def build_method(name: str, budget: int | None, options: dict | None = None):
    """The registered method ``name`` with ``options``, and ``budget`` if it has one.

    Returns ``(method, budget)``; the budget is None for a method without a
    ``budget`` field (dense).
    """
    from sparse_jax.methods import get_method

    m = get_method(base_name(name), **(options or {}))
    if not any(f.name == "budget" for f in dataclasses.fields(m)):
        return m, None
    if budget is None:
        raise ValueError(f"method {name!r} needs a budget")
    return dataclasses.replace(m, budget=int(budget)), int(budget)


def has_budget(name: str, options: dict | None = None) -> bool:
    from sparse_jax.methods import get_method

    m = get_method(base_name(name), **(options or {}))
    return any(f.name == "budget" for f in dataclasses.fields(m))


def base_name(spec: str) -> str:
    """``"alias=method"`` -> ``"method"``; a plain name is its own base."""
    return spec.split("=", 1)[1] if "=" in spec else spec


def alias_name(spec: str) -> str:
    """``"alias=method"`` -> ``"alias"`` (the name rows and ``--set`` use)."""
    return spec.split("=", 1)[0]


def parse_sets(items: Sequence[str]) -> dict[str, dict[str, Any]]:
    """``["quest.block_size=16", ...]`` -> ``{"quest": {"block_size": 16}}``."""
    out: dict[str, dict[str, Any]] = {}
    for it in items:
        if "=" not in it or "." not in it.split("=", 1)[0]:
            raise ValueError(f"--set expects METHOD.FIELD=VALUE, got {it!r}")
        lhs, val = it.split("=", 1)
        method, field = lhs.split(".", 1)
        try:
            value = ast.literal_eval(val)
        except (ValueError, SyntaxError):
            value = val
        if isinstance(value, list):
            value = tuple(value)
        out.setdefault(method, {})[field] = value
    return out


# -----------------------------------------------------------------------------
# Generation and scoring
# -----------------------------------------------------------------------------


@jax.jit
def _argmax(logits):
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def stop_ids(model, tokenizer) -> set[int]:
    s = {model.config.eos_token_id, getattr(tokenizer, "eos_token_id", None)}
    return {int(i) for i in s if i is not None}


def pad_id(model) -> int:
    for i in (model.config.pad_token_id, model.config.eos_token_id, 0):
        if i is not None:
            return int(i)
    return 0


def greedy_generate(model, prompts: Sequence[Sequence[int]], max_new: Sequence[int], *, width: int,
                    batch_size: int, stops: set[int], pad: int, timing: dict | None = None) -> list[list[int]]:
    """Greedy continuation of one batch of prompts (``len(prompts) <= batch_size``).

    Prompts are right-padded to ``width`` tokens and the batch padded to
    ``batch_size`` rows (copies of the last prompt, discarded), so every batch of
    one length has the same shapes (one compilation). The cache holds ``width``
    tokens: each prompt plus the longest ``max_new`` of the batch must fit.
    ``timing`` (a dict, updated in place): seconds in the prefill (synchronised) and
    in the decode loop, decode steps and batches: where a run's time goes.
    """
    n = len(prompts)
    if not 0 < n <= batch_size:
        raise ValueError(f"need 1..{batch_size} prompts, got {n}")
    steps = max(max_new)
    rows = list(prompts) + [prompts[-1]] * (batch_size - n)
    lens = np.asarray([len(p) for p in rows], np.int32)
    if lens.max() + steps > width:
        raise ValueError(f"a prompt of {lens.max()} tokens + {steps} new tokens exceeds {width}")
    tokens = np.full((batch_size, width), pad, np.int32)
    for r, p in enumerate(rows):
        tokens[r, : len(p)] = p
    t0 = time.perf_counter()
    cache = model.init_cache(batch_size, width)
    logits, cache = model.fns.prefill(model.params, jnp.asarray(tokens), jnp.asarray(lens), cache)
    if timing is not None:
        jax.block_until_ready(logits)
        t1 = time.perf_counter()
    out: list[list[int]] = [[] for _ in range(n)]
    done = np.zeros(batch_size, bool)
    done[n:] = True
    step = -1  # no decode step (steps == 0)
    for step in range(steps):
        tok = _argmax(logits)
        th = np.asarray(tok)
        for r in range(n):
            if done[r]:
                continue
            if int(th[r]) in stops:
                done[r] = True
            else:
                out[r].append(int(th[r]))
                done[r] = len(out[r]) >= max_new[r]
        if done.all() or step == steps - 1:
            break
        logits, cache = model.fns.decode_at(step + 1)(model.params, tok, cache)  # every row at step + 1
    if timing is not None:
        for key, val in (("prefill_s", t1 - t0), ("decode_s", time.perf_counter() - t1), ("steps", step + 1),
                         ("batches", 1)):
            timing[key] = timing.get(key, 0) + val
    return out


def engine_generate(engine, prompts: Sequence[Sequence[int]], max_new: Sequence[int], stops: set[int],
                    timing: dict | None = None) -> list[list[int]]:
    """Greedy continuations of ``prompts`` served by ``engine`` (a started
    :class:`models.serving.engine.Engine`: the serving path, e.g. its chunked prefill), each
    without its stop token, as :func:`greedy_generate` gives them."""
    from models.serving.requests import SamplingParams

    t0 = time.perf_counter()
    reqs = [engine.submit(engine.make_request(list(p), SamplingParams(max_tokens=int(n), temperature=0.0)))
            for p, n in zip(prompts, max_new)]
    for r in reqs:
        if not r.done.wait(3600) or r.finish_reason not in ("stop", "length"):
            raise RuntimeError(f"the engine ended a request {r.finish_reason!r}: {r.error}")
    if timing is not None:
        timing["engine_s"] = timing.get("engine_s", 0.0) + time.perf_counter() - t0
        timing["batches"] = timing.get("batches", 0) + 1
    return [[t for t in r.output_ids if t not in stops] for r in reqs]


def run_samples(model, samples: Sequence[ruler_tasks.Sample], tokenizer, *, batch_size: int,
                progress: bool = True, desc: str = "", timing: dict | None = None,
                prefill_chunk: int | None = None) -> list[dict]:
    """Generate and score every sample (all of one target length); ``timing``: see
    :func:`greedy_generate` (the first batch, which compiles, also as ``first_batch_s``).
    ``prefill_chunk``: serve them through the paged engine instead, ``batch_size`` slots,
    prompts prefilled ``prefill_chunk`` tokens per iteration (its chunked prefill: with a
    Token Sparse prefill, TSA's chunk form), greedy."""
    if not samples:
        return []
    width = samples[0].target_len
    if any(s.target_len != width for s in samples):
        raise ValueError("run_samples expects samples of one target length")
    stops, pad = stop_ids(model, tokenizer), pad_id(model)
    batches = [samples[i: i + batch_size] for i in range(0, len(samples), batch_size)]
    it = batches
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(batches, desc=desc, leave=False, file=sys.stderr, unit="batch")
    results = []
    engine = None
    if prefill_chunk is not None:
        from models.serving.engine import Engine
        from models.serving.paged import page_size

        page = page_size(model.method)
        engine = Engine(model, slots=batch_size, max_len=-(-width // page) * page, paged=True,
                        prefill_chunk=prefill_chunk, stop_ids=tuple(stops)).start()
    try:
        for i, batch in enumerate(it):
            t0 = time.perf_counter()
            if engine is not None:
                outs = engine_generate(engine, [s.input_ids for s in batch], [s.max_new_tokens for s in batch], stops,
                                       timing)
            else:
                outs = greedy_generate(model, [s.input_ids for s in batch], [s.max_new_tokens for s in batch],
                                       width=width, batch_size=batch_size, stops=stops, pad=pad, timing=timing)
            _score_batch(results, batch, outs, tokenizer, timing if i == 0 else None, t0)
    finally:
        if engine is not None:
            engine.stop()
    return results


def _score_batch(results: list, batch, outs, tokenizer, timing: dict | None, t0: float) -> None:
    """Append each sample's scored prediction to ``results``; ``timing`` (the first batch's
    only): its time, with the compiles, as ``first_batch_s``."""
    if timing is not None:
        timing["first_batch_s"] = time.perf_counter() - t0
    for s, ids in zip(batch, outs):
        text = tokenizer.decode(ids, skip_special_tokens=True) if _takes_skip(tokenizer) else tokenizer.decode(ids)
        results.append({"task": s.task, "index": s.index, "prompt_tokens": s.num_tokens,
                        "new_tokens": len(ids), "prediction": text, "answers": list(s.answers),
                        "score": ruler_tasks.score(text, s.answers)})


def _takes_skip(tokenizer) -> bool:
    import inspect

    try:
        return "skip_special_tokens" in inspect.signature(tokenizer.decode).parameters
    except (TypeError, ValueError):
        return False


def summarize(results: Sequence[dict], tasks: Sequence[str]) -> tuple[dict[str, float], float]:
    """Mean score per task and the mean over tasks (each task weighted equally)."""
    per = {}
    for t in tasks:
        sc = [r["score"] for r in results if r["task"] == t]
        per[t] = float(np.mean(sc)) if sc else float("nan")
    vals = [v for v in per.values() if not math.isnan(v)]
    return per, float(np.mean(vals)) if vals else float("nan")


# -----------------------------------------------------------------------------
# The whole run
# -----------------------------------------------------------------------------


def _default_tokenizer(model):
    """The model's tokenizer, or SmolLM2's for a random-weights model whose vocabulary
    is large enough (accuracy is then meaningless, fidelity still measures something)."""
    if model.tokenizer is not None:
        return model.tokenizer
    from models import gguf_loader

    tok = gguf_loader.read_gguf(gguf_loader.smollm2_gguf_path(), tensors=False).tokenizer
    if tok is None or tok.vocab_size > model.config.vocab_size:
        raise ValueError(f"model {model.config.name!r} has no tokenizer and SmolLM2's does not fit its vocabulary")
    return tok


def out_of_memory(e: BaseException) -> bool:
    """Whether ``e`` is XLA running out of device memory."""
    return "RESOURCE_EXHAUSTED" in str(e) or "Out of memory" in str(e)


def run_fitting(fn, batch_size: int, log) -> tuple[Any, int]:
    """``(fn(b), b)`` for the largest ``b`` of ``batch_size``, its half, its quarter, ... that fits
    the device: a method whose prefill asks for more than the others' (AsyncSpade with AsyncTLS's
    selector asked for 48.75 GiB at 128 rows of 8K on an H100) runs at a smaller batch instead of
    leaving its row empty. Any other error, or running out at batch 1, is raised."""
    import gc

    b = batch_size
    while True:
        try:
            return fn(b), b
        except Exception as e:  # noqa: BLE001 - only XLA's out-of-memory is retried
            if not out_of_memory(e) or b == 1:
                raise
            log(f"out of device memory at batch {b} ({str(e).splitlines()[0][:120]}); again at batch {b // 2}")
            b //= 2
            gc.collect()  # the failed batch's buffers go before the next one allocates


def run(model, *, methods: Sequence[str], budgets: Sequence[int], lengths: Sequence[int],
        tasks: Sequence[str] = ruler_tasks.TASKS, samples: int = 5, batch_size: int = 8,
        fidelity: bool = False, probe_steps: int = 16, kl_steps: int = 64, fidelity_batch: int | None = None,
        seed: int = 0,
        method_options: dict[str, dict] | None = None, keep_full_budget: bool = False,
        accuracy: bool = True, tokenizer=None, progress: bool = True, chat: bool | None = None,
        indices: Sequence[int] | None = None, log: Callable[[str], None] | None = None,
        on_row: Callable[[dict], None] | None = None, prefill_chunk: int | None = None) -> dict:
    """Run the harness on a loaded ``model`` (``models.load_model(...)``); returns the
    results payload (no stamp). See the module docstring. ``on_row`` receives the
    payload so far after every finished row (main saves it, so a run cut off by
    a time limit keeps what it measured). ``chat``: prompts in the chat template
    (None: when the tokenizer has one; a base model's GGUF has none). ``indices``: run
    those samples of each task instead of the first ``samples``. ``prefill_chunk``: serve the
    samples through the paged engine with chunked prefill (:func:`run_samples`)."""
    method_options = method_options or {}
    tokenizer = tokenizer or _default_tokenizer(model)
    if chat is None:
        chat = getattr(tokenizer, "chat_template", None) is not None
    cfg = model.config
    limit = min(model.max_len, cfg.max_position)
    for L in lengths:
        if L > limit:
            raise ValueError(f"length {L} exceeds the model's context of {limit} tokens")
        if fidelity and kl_steps >= L:
            raise ValueError(f"--kl-steps ({kl_steps}) must be below the length ({L})")
    for t in tasks:
        if t not in ruler_tasks.TASKS:
            raise ValueError(f"unknown task {t!r}; available: {', '.join(ruler_tasks.TASKS)}")
    if samples < 1 or batch_size < 1:
        raise ValueError("--samples and --batch-size must be >= 1")
    if indices is not None:
        if not indices or any(i < 0 for i in indices):
            raise ValueError(f"--indices must be non-negative sample indices, got {list(indices)}")
        samples = len(indices)
    import_errors = import_methods()

    if progress:
        from tqdm.auto import tqdm

        write = log or tqdm.write
    else:
        write = log or (lambda s: print(s, file=sys.stderr))

    # (method, budget) combinations; dense first, once
    combos: list[tuple[str, int | None]] = [("dense", None)]
    for name in methods:
        if name == "dense":
            continue
        try:
            with_budget = has_budget(name, method_options.get(alias_name(name)))
        except Exception as e:  # noqa: BLE001 - unknown method or bad options: report, go on
            combos.append((name, None))
            write(f"[accuracy] {name}: {e}")
            continue
        if with_budget:
            combos.extend((name, b) for b in budgets)
        else:
            combos.append((name, None))

    rows: list[dict] = []
    predictions: list[dict] = []

    def payload() -> dict:
        # each method's prompts against dense's at the same length (dense may run in any order)
        dense = {}
        for p in predictions:
            if p["method"] == "dense":
                dense.setdefault(p["length"], {})[(p["task"], p["index"])] = p["score"]
        for row in rows:
            if row["method"] != "dense" and row.get("scores") and row["length"] in dense:
                mine = [p for p in predictions if (p["method"], p["budget"], p["length"])
                        == (row["method"], row["budget"], row["length"])]
                row["against_dense"] = against_dense(mine, dense[row["length"]])
        return {
            "settings": {
                "model": cfg.name, "dtype": str(jnp.dtype(model.dtype)), "methods": list(methods),
                "budgets": list(budgets), "lengths": list(lengths), "tasks": list(tasks), "samples": samples,
                "batch_size": batch_size, "prefill_chunk": prefill_chunk, "seed": seed, "fidelity": fidelity,
                "probe_steps": probe_steps,
                "kl_steps": kl_steps, "fidelity_batch": fidelity_batch or batch_size,
                "method_options": method_options, "keep_full_budget": keep_full_budget,
                "answer_room": ruler_tasks.ANSWER_ROOM, "chat": chat,
                **({"indices": list(indices)} if indices is not None else {}),
            },
            "model": {"name": cfg.name, "num_layers": cfg.num_layers, "num_heads": cfg.num_heads,
                      "num_kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "max_position": cfg.max_position},
            "method_import_errors": import_errors,
            "rows": rows,
            "predictions": predictions,
        }

    total = len(combos) * len(lengths)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, desc="accuracy", file=sys.stderr, unit="run")
    for L in lengths:
        t0 = time.perf_counter()
        samp = ruler_tasks.generate_samples(tasks, L, samples, tokenizer, seed=seed, progress=progress, chat=chat,
                                            indices=indices) \
            if accuracy else []
        gen_s = time.perf_counter() - t0
        write(f"[accuracy] length {L}: {len(samp)} samples generated in {gen_s:.1f}s")
        ref = None
        fid_batch = fidelity_batch or batch_size
        for spec, budget in combos:
            name = alias_name(spec)
            if bar is not None:
                bar.set_postfix_str(f"{name} b={budget if budget is not None else '-'} L={L}")
            row: dict[str, Any] = {"method": name, "budget": budget, "length": L, "status": "ok"}
            try:
                if name == "dense":
                    method, budget = build_method("dense", None)
                else:
                    method, budget = build_method(spec, budget, method_options.get(name))
                    method = with_dense_layer_rule(method, method_options.get(name), cfg)
                row["config"] = repr(method.with_model_defaults(cfg.name))  # the model's defaults named
                if budget is not None and budget >= L and not keep_full_budget:
                    row.update(status="skipped", reason=f"budget {budget} >= length {L}: attends everything (= dense)")
                    rows.append(row)
                    if bar is not None:
                        bar.update(1)
                    continue
                mm = model.with_method(method)
                if accuracy:
                    t1 = time.perf_counter()
                    timing: dict = {}
                    res, used = run_fitting(
                        lambda b: run_samples(mm, samp, tokenizer, batch_size=b, progress=progress,
                                              desc=f"{name} b={budget if budget is not None else '-'} L={L}",
                                              timing=timing, prefill_chunk=prefill_chunk),
                        batch_size, lambda msg: write(f"[accuracy] {name} b={budget} L={L}: {msg}"))
                    if used != batch_size:  # bf16 logits depend on the batch: the table says so
                        row["batch_size"] = used
                    row["accuracy_s"] = time.perf_counter() - t1
                    row["timing"] = {k: round(v, 3) if isinstance(v, float) else v for k, v in timing.items()}
                    write(f"[accuracy] {name} b={budget} L={L}: {row['accuracy_s']:.1f}s {row['timing']}")
                    row["scores"], row["average"] = summarize(res, tasks)
                    row["n_samples"] = len(res)
                    for r in res:
                        predictions.append({"method": name, "budget": budget, "length": L, **r})
                if fidelity:
                    t1 = time.perf_counter()
                    if ref is None:
                        dense_model = mm if name == "dense" else model.with_method("dense")
                        text = fid.fidelity_text_ids(tokenizer, L, fid_batch)
                        ref = fid.reference_run(dense_model, text, kl_steps, pad_to=L, cache_len=L)
                    if name != "dense":
                        f = fid.method_kl(mm, ref)
                        probe = fid.FidelityProbe(inner=method, num_q_heads=cfg.num_heads)
                        # unrolled: a method whose selection depends on the layer's role (Kascade's
                        # dense first anchor) cannot return it from a scanned layer, and the probe
                        # needs the selection for its mass (scanned, the CPU default, it got NaN)
                        f.update(fid.probe_metrics(model.with_method(probe, unroll=True), ref, probe_steps))
                        row["fidelity"] = f
                    row["fidelity_s"] = time.perf_counter() - t1
                if name != "dense" and accuracy and "average" in row:
                    write(f"[accuracy] {name} b={budget} L={L}: avg {row['average']:.3f}"
                          + (f", mass {row['fidelity']['mass']:.3f}, KL {row['fidelity']['kl']:.4f}"
                             if "fidelity" in row else "")
                          + " | " + " ".join(f"{t}={v:.2f}" for t, v in row["scores"].items()))
                elif name == "dense" and accuracy:
                    write(f"[accuracy] dense L={L}: avg {row['average']:.3f} | "
                          + " ".join(f"{t}={v:.2f}" for t, v in row["scores"].items()))
            except Exception as e:  # noqa: BLE001 - report the method and go on with the others
                row.update(status="error", reason=f"{type(e).__name__}: {e}",
                           traceback=traceback.format_exc(limit=8))
                write(f"[accuracy] {name} b={budget} L={L} FAILED: {type(e).__name__}: {e}")
            rows.append(row)
            if bar is not None:
                bar.update(1)
            if on_row is not None:
                on_row(payload())
    if bar is not None:
        bar.close()
    return payload()


def against_dense(results: list[dict], dense: dict) -> dict:
    """``{task: {"below": [index, ...], "above": [...]}}``: the samples a method scored below
    and above dense on (``dense``: ``(task, index) -> score``), the prompts to probe next
    (``benchmarks.probes.selection_cause --indices``); tasks with neither are left out."""
    out: dict[str, dict[str, list[int]]] = {}
    for r in sorted(results, key=lambda r: (r["task"], r["index"])):
        ref = dense.get((r["task"], r["index"]))
        if ref is None or r["score"] == ref:
            continue
        out.setdefault(r["task"], {"below": [], "above": []})["below" if r["score"] < ref else "above"].append(r["index"])
    return out


# -----------------------------------------------------------------------------
# Reports
# -----------------------------------------------------------------------------


def _pct(x) -> str:
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f}"


def render_markdown(payload: dict) -> str:
    st = payload.get("stamp", {})
    s = payload["settings"]
    lines = [f"# Accuracy: {s['model']} ({s['dtype']})", ""]
    if st:
        lines += [f"- device: {st.get('device')} ({st.get('backend')}), jax {st.get('jax')}, "
                  f"python {st.get('python')}, commit {st.get('git_commit') or '?'}",
                  f"- date: {st.get('date')}", f"- command: `{st.get('command')}`"]
    which = f"samples {s['indices']} of each task" if s.get("indices") else f"{s['samples']} samples per task and length"
    lines += [f"- {which}, seed {s['seed']}; scores in % "
              "(RULER string match: fraction of expected strings in the greedy output)"]
    if s.get("prefill_chunk"):
        lines.append(f"- served by the paged engine, prompts prefilled {s['prefill_chunk']} tokens per iteration "
                     "(chunked prefill; a Token Sparse prefill runs its chunk form)")
    if payload.get("partial"):
        lines.append(f"- **partial**: the run stopped after {len(payload['rows'])} rows (a checkpoint of an interrupted "
                     "run); the rows not listed were not measured")
    lines.append("")
    tasks = s["tasks"]
    cols = ["method", "budget", "length"] + tasks + ["avg"]
    fid_cols = ["mass", "rel_err", "KL", "agree"] if s["fidelity"] else []
    cols += fid_cols + ["status"]
    rows = []
    for r in payload["rows"]:
        d = {"method": r["method"], "budget": "-" if r["budget"] is None else r["budget"], "length": r["length"]}
        for t in tasks:
            d[t] = _pct(r.get("scores", {}).get(t))
        d["avg"] = _pct(r.get("average"))
        f = r.get("fidelity")
        if f:
            d["mass"] = f"{f['mass']:.3f}"
            d["rel_err"] = f"{f['rel_err']:.3g}"
            d["KL"] = f"{f['kl']:.3g}"
            d["agree"] = f"{f['agreement']:.2f}"
        d["status"] = r["status"] if r["status"] == "ok" else f"{r['status']}: {r.get('reason', '')}"[:120]
        if r["status"] == "ok" and "batch_size" in r:
            d["status"] = f"ok at batch {r['batch_size']} (out of memory at more)"
        rows.append(d)
    lines.append(markdown_table(rows, cols))
    if s["fidelity"]:
        lines += ["", f"Fidelity on standard-library source text, teacher-forced against dense: `mass` = "
                  "dense attention mass on the method's selection / mass on the oracle top-K of the same size "
                  f"(mean over layers, query heads, {s['probe_steps']} decode steps); `rel_err` = "
                  "||o_method - o_dense|| / ||o_dense|| (same mean); `KL` = mean KL(p_dense || p_method) of "
                  f"the next-token distribution over {s['kl_steps']} steps; `agree` = fraction of those steps "
                  "with the same argmax. Per-layer and per-head values are in the JSON."]
    moved = [r for r in payload["rows"] if r.get("against_dense")]
    if moved:
        lines += ["", "Prompts where a method's score differs from dense's (sample indices per task; `-` below "
                  "dense, `+` above; `benchmarks.probes.selection_cause --indices` probes them):", ""]
        for r in moved:
            cells = [f"{t} -{v['below']}" + (f" +{v['above']}" if v["above"] else "") if v["below"]
                     else f"{t} +{v['above']}" for t, v in r["against_dense"].items()]
            lines.append(f"- {r['method']} (budget {r['budget']}, {r['length']}): " + "; ".join(cells))
    if payload.get("method_import_errors"):
        lines += ["", "Method modules that failed to import:", ""]
        lines += [f"- `{k}`: {v}" for k, v in payload["method_import_errors"].items()]
    return "\n".join(lines) + "\n"


def _save_figure(plt, fig, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _plot_tasks(plt, payload: dict, ok: list, path: Path) -> Path:
    """One budget: per length, each task's score (and the average) as grouped bars, one bar
    per method, dense first."""
    s = payload["settings"]
    lengths = s["lengths"]
    methods = ["dense"] + sorted({r["method"] for r in ok if r["method"] != "dense"})
    tasks = sorted({t for r in ok for t in r.get("scores", {})}, key=lambda t: (t != "passkey", t)) + ["average"]
    fig, axes = plt.subplots(1, len(lengths), figsize=(max(6.0, 1.1 * len(tasks) * len(methods) / 3) * len(lengths), 3.8),
                             squeeze=False)
    width = 0.8 / len(methods)
    for j, L in enumerate(lengths):
        ax = axes[0][j]
        for k, m in enumerate(methods):
            row = next((r for r in ok if r["method"] == m and r["length"] == L and r.get("scores")), None)
            if row is None:
                continue
            vals = [100 * (row["average"] if t == "average" else row["scores"].get(t, float("nan"))) for t in tasks]
            ax.bar([i + (k - (len(methods) - 1) / 2) * width for i in range(len(tasks))], vals, width,
                   label=m, color="k" if m == "dense" else None)
        budget = next(iter({r["budget"] for r in ok if r["budget"] is not None}))
        ax.set_xticks(range(len(tasks)), tasks)
        ax.set_ylim(0, 102)
        ax.set_ylabel("score (%)")
        n = s.get("samples")
        ax.set_title(f"{s['model']}, {L} tokens, budget {budget}" + (f", {n} prompts per task" if n else ""))
        ax.grid(axis="y", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return _save_figure(plt, fig, path)


def plot(payload: dict, path: Path) -> Path | None:
    """The PNG (None when there is nothing to plot or matplotlib is missing)."""
    try:
        import matplotlib
    except ImportError:
        print("[accuracy] matplotlib is not installed: no plot", file=sys.stderr)
        return None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = payload["settings"]
    lengths = s["lengths"]
    ok = [r for r in payload["rows"] if r["status"] == "ok"]
    if not ok:
        return None
    panels = []
    if any("average" in r for r in ok):
        panels.append(("synthetic average (%)", lambda r: 100 * r["average"] if "average" in r else None))
    if any("fidelity" in r for r in ok):
        panels.append(("attention mass recovered", lambda r: r["fidelity"]["mass"] if "fidelity" in r else None))
        panels.append(("KL(dense || method)", lambda r: max(r["fidelity"]["kl"], 1e-9) if "fidelity" in r else None))
    if not panels:  # e.g. a fidelity-only run saved after its dense row (dense is the reference)
        return None
    budgets_run = {r["budget"] for r in ok if r["budget"] is not None}
    if len(budgets_run) == 1 and any(r.get("scores") for r in ok):
        # one budget: a line over budgets is a dot; the scores per task say more
        return _plot_tasks(plt, payload, ok, path)
    fig, axes = plt.subplots(len(panels), len(lengths), figsize=(4.2 * len(lengths), 3.2 * len(panels)),
                             squeeze=False)
    methods = sorted({r["method"] for r in ok if r["method"] != "dense"})
    for j, L in enumerate(lengths):
        for i, (label, get) in enumerate(panels):
            ax = axes[i][j]
            for m in methods:
                pts = sorted((r["budget"], get(r)) for r in ok
                             if r["method"] == m and r["length"] == L and r["budget"] is not None and get(r) is not None)
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=m)
            dense = [get(r) for r in ok if r["method"] == "dense" and r["length"] == L and get(r) is not None]
            if dense and i == 0:
                ax.axhline(dense[0], color="k", ls="--", lw=1, label="dense")
            if label.startswith("synthetic"):
                ax.set_ylim(-2, 102)
            elif label.startswith("attention mass"):
                ax.set_ylim(0, 1.02)
            ax.set_xscale("log", base=2)
            budgets = sorted({r["budget"] for r in ok if r["budget"] is not None and r["length"] == L})
            if budgets:
                ax.set_xticks(budgets, [str(b) for b in budgets])
                ax.minorticks_off()
            ax.set_xlabel("budget (tokens per KV head)")
            if label.startswith("KL"):
                ax.set_yscale("log")
            ax.set_ylabel(label)
            ax.set_title(f"{s['model']}, {L} tokens")
            ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    if handles:
        # as many columns as the figure's width holds (one 4.2-inch panel: 3 names a row)
        cols = min(len(labels), 8, 3 * len(lengths))
        fig.legend(handles, labels, loc="lower center", ncol=cols, frameon=False)
        legend_rows = -(-len(labels) // cols)
        fig.tight_layout(rect=(0, 0.05 * legend_rows + 0.02, 1, 1))
    else:
        fig.tight_layout()
    return _save_figure(plt, fig, path)


def save(payload: dict, name: str, out_dir: Path | str | None, predictions_dir: Path | str | None = None) -> Path:
    """``<name>.json`` + ``.md`` + ``.png`` under ``out_dir``; ``<name>_predictions.json`` under
    ``predictions_dir`` (default: beside them)."""
    preds = payload.get("predictions", [])
    main = {k: v for k, v in payload.items() if k != "predictions"}
    out = write_results(name, main, render_markdown(payload), out_dir)
    pred_dir = Path(predictions_dir) if predictions_dir is not None else out
    pred_dir.mkdir(parents=True, exist_ok=True)
    (pred_dir / f"{name}_predictions.json").write_text(json.dumps(preds, indent=1))
    plot(payload, out / f"{name}.png")
    return out


# -----------------------------------------------------------------------------
# CLI
# -----------------------------------------------------------------------------


def _names(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.accuracy",
                                description="RULER-style accuracy and fidelity of attention methods against dense.",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="model preset (default: smollm2-135m)")
    p.add_argument("--weights", default=None, help="weights path passed to models.load_model (default: the preset's)")
    p.add_argument("--methods", type=_names, default=list(DEFAULT_METHODS),
                   help=f"comma-separated method names (default: {','.join(DEFAULT_METHODS)}); dense always runs")
    p.add_argument("--budgets", type=parse_list, default=[512, 1024, 2048], help="tokens per KV head (default 512,1024,2048)")
    p.add_argument("--lengths", type=parse_list, default=[2048, 4096, 8192], help="context lengths (default 2048,4096,8192)")
    p.add_argument("--tasks", type=_names, default=list(ruler_tasks.TASKS),
                   help=f"subset of {','.join(ruler_tasks.TASKS)}")
    p.add_argument("--samples", type=int, default=5, help="samples per task and length (default 5)")
    p.add_argument("--indices", type=parse_list, default=None,
                   help="run these sample indices of each task instead of the first --samples (e.g. the prompts "
                        "a method lost in a larger run)")
    p.add_argument("--batch-size", type=int, default=8, help="rows per prefill/decode batch (default 8)")
    p.add_argument("--prefill-chunk", type=int, default=None, metavar="N",
                   help="serve the samples through the paged engine (--batch-size slots), prompts prefilled N "
                        "tokens per iteration: the server's chunked prefill (with a Token Sparse prefill, TSA's "
                        "chunk form). Default: the model's whole prefill, batched")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    p.add_argument("--seed", type=int, default=0, help="task generation seed")
    p.add_argument("--fidelity", action="store_true", help="also measure fidelity on real text (see fidelity.py)")
    p.add_argument("--no-accuracy", action="store_true", help="skip the synthetic tasks (fidelity only)")
    p.add_argument("--probe-steps", type=int, default=16, help="decode steps averaged by the fidelity probe")
    p.add_argument("--kl-steps", type=int, default=64, help="teacher-forced steps of the KL / agreement measure")
    p.add_argument("--fidelity-batch", type=int, default=None,
                   help="text rows of the fidelity runs (default: --batch-size, which reuses the accuracy run's "
                        "compiled functions)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="METHOD.FIELD=VALUE",
                   help="method hyperparameter override (repeatable)")
    p.add_argument("--keep-full-budget", action="store_true", help="also run budgets >= the length")
    p.add_argument("--out", default=None, help="output directory (default benchmarks/results/)")
    p.add_argument("--name", default=None, help="output file stem (default accuracy_<model>)")
    p.add_argument("--predictions-dir", default=str(PREDICTIONS_DIR),
                   help="where <name>_predictions.json goes (default bench_out/ at the repository root, git-ignored)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bars")
    p.add_argument("--prompt-style", choices=["auto", "chat", "base"], default="auto",
                   help="chat: the model's chat template; base: the bare message and answer prefix (base "
                        "models); auto (default): chat when the tokenizer has a template")
    args = p.parse_args(argv)
    if args.no_accuracy and not args.fidelity:
        p.error("--no-accuracy needs --fidelity (otherwise there is nothing to do)")
    bad = [t for t in args.tasks if t not in ruler_tasks.TASKS]
    if bad:
        p.error(f"unknown task(s) {bad}; available: {', '.join(ruler_tasks.TASKS)}")
    if any(b < 1 for b in args.budgets) or any(L < 1 for L in args.lengths):
        p.error("budgets and lengths must be positive")
    if args.prefill_chunk is not None and args.prefill_chunk < 1:
        p.error("--prefill-chunk must be >= 1")
    if args.samples < 1 or args.batch_size < 1 or (args.fidelity_batch is not None and args.fidelity_batch < 1):
        p.error("--samples, --batch-size and --fidelity-batch must be >= 1")
    if args.probe_steps < 1 or args.kl_steps < 1 or args.probe_steps > args.kl_steps:
        p.error("need 1 <= --probe-steps <= --kl-steps (the probe runs on the KL run's first steps)")
    try:
        args.method_options = parse_sets(args.sets)
    except ValueError as e:
        p.error(str(e))
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    command = "python -m benchmarks.accuracy " + shlex.join(argv)
    import models

    dtype = {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "float16": jnp.float16}[args.dtype]
    t0 = time.perf_counter()
    model = models.load_model(args.model, dtype=dtype, max_len=max(args.lengths), weights=args.weights)
    print(f"[accuracy] loaded {model!r} in {time.perf_counter() - t0:.1f}s on {jax.devices()[0]}", file=sys.stderr)
    name = args.name or f"accuracy_{args.model}"
    st = stamp(command)

    def checkpoint(partial: dict) -> None:
        save({"stamp": st, **partial, "wall_s": time.perf_counter() - t0, "partial": True}, name, args.out,
             args.predictions_dir)

    payload = run(model, on_row=checkpoint, methods=args.methods, budgets=args.budgets, lengths=args.lengths, tasks=args.tasks,
                  samples=args.samples, indices=args.indices, batch_size=args.batch_size, fidelity=args.fidelity,
                  probe_steps=args.probe_steps, kl_steps=args.kl_steps, fidelity_batch=args.fidelity_batch,
                  seed=args.seed,
                  method_options=args.method_options, keep_full_budget=args.keep_full_budget,
                  accuracy=not args.no_accuracy, progress=not args.no_progress,
                  chat={"auto": None, "chat": True, "base": False}[args.prompt_style], prefill_chunk=args.prefill_chunk)
    payload = {"stamp": st, **payload, "wall_s": time.perf_counter() - t0}
    out = save(payload, name, args.out, args.predictions_dir)
    print(render_markdown(payload))
    print(f"[accuracy] wrote {out / name}.json/.md/.png in {payload['wall_s']:.0f}s "
          f"(predictions: {Path(args.predictions_dir) / name}_predictions.json)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
