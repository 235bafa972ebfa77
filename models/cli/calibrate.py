"""Offline channel calibration for Double Sparsity and AsyncTLS.

    python -m models.cli.calibrate --model smollm2-135m --method double_sparsity

Runs the model densely over a calibration text, collects every layer's
post-RoPE queries and keys, ranks the head-dim channels of each KV head
(``sparse_jax.calibration``) and saves the orders with orbax where the methods
look for them. The text is generated on the machine from the docstrings of a
fixed list of Python standard-library modules (plain English, deterministic for
a Python version, and disjoint from the source code the fidelity benchmark
reads).

It lives in ``models`` (it runs a model); the statistics and the storage are
:mod:`sparse_jax.calibration`, which never imports ``models`` (imports only go
down: pallas_kernels <- sparse_jax <- models <- benchmarks).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import sys
import warnings

import numpy as np

import models
from models.capture import capture_qk
from sparse_jax.calibration import CALIBRATION_ROOT, ChannelStats, save_channel_orders

CALIBRATION_MODULES = (
    "argparse", "collections", "contextlib", "csv", "dataclasses", "datetime", "decimal", "email.message",
    "fractions", "functools", "heapq", "http.client", "itertools", "json", "logging", "pathlib", "random",
    "re", "shutil", "sqlite3", "statistics", "string", "subprocess", "tarfile", "textwrap", "threading",
    "typing", "unittest", "urllib.parse", "zipfile",
)
METHODS = ("double_sparsity", "asynctls")


def calibration_text() -> str:
    """Docstrings of ``CALIBRATION_MODULES`` and their public members, in a fixed order."""
    parts = []
    with warnings.catch_warnings():  # touching deprecated attributes (typing.io, ...) warns
        warnings.simplefilter("ignore", DeprecationWarning)
        for name in CALIBRATION_MODULES:
            parts += _module_docs(name)
    return "\n\n".join(parts)


def _module_docs(name: str) -> list[str]:
    parts = []
    mod = importlib.import_module(name)
    if mod.__doc__:
        parts.append(inspect.cleandoc(mod.__doc__))
    for attr in sorted(dir(mod)):
        if attr.startswith("_"):
            continue
        obj = getattr(mod, attr, None)
        doc = getattr(obj, "__doc__", None)
        if isinstance(doc, str) and len(doc) > 200 and getattr(obj, "__module__", None) == name:
            parts.append(inspect.cleandoc(doc))
    return parts


def calibration_batches(token_ids: list[int], seq_len: int, samples: int) -> np.ndarray:
    """``int32[samples, seq_len]``: consecutive windows of the tokenised text."""
    need = seq_len * samples
    if len(token_ids) < need:
        raise ValueError(
            f"the calibration text has {len(token_ids)} tokens, {need} needed ({samples} x {seq_len}); "
            "lower --samples or --seq-len"
        )
    return np.asarray(token_ids[:need], np.int32).reshape(samples, seq_len)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m models.cli.calibrate", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--method", default="double_sparsity", choices=METHODS,
                   help="both methods read the same calibration (two rankings are stored)")
    p.add_argument("--samples", type=int, default=64, help="calibration sequences (Double Sparsity used 256)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--root", default=None, help=f"where to save (default {CALIBRATION_ROOT})")
    args = p.parse_args(argv)
    if args.samples < 1 or args.seq_len < 16 or args.batch < 1:
        p.error("--samples and --batch must be >= 1 and --seq-len >= 16")

    import jax.numpy as jnp
    from tqdm import tqdm

    model = models.load_model(args.model, dtype=jnp.float32)
    if model.tokenizer is None:
        p.error(f"model {args.model!r} has no tokenizer (random weights): calibrate a model with real weights")
    ids = model.tokenizer.encode(calibration_text())
    batches = calibration_batches(ids, args.seq_len, args.samples)
    cfg = model.config
    stats = ChannelStats(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    for start in tqdm(range(0, args.samples, args.batch), desc="calibrating", unit="batch"):
        tokens = jnp.asarray(batches[start:start + args.batch])
        for layer, (q, k) in enumerate(capture_qk(model, tokens)):
            q, k = np.asarray(q, np.float32), np.asarray(k, np.float32)  # [B, T, H, D]
            stats.add(layer, q.reshape(-1, *q.shape[2:]), k.reshape(-1, *k.shape[2:]))
    meta = {
        "model": args.model, "samples": args.samples, "seq_len": args.seq_len, "tokens": stats.tokens,
        "text": f"docstrings of {len(CALIBRATION_MODULES)} stdlib modules (Python {sys.version.split()[0]})",
        "command": "python -m models.cli.calibrate " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    path = save_channel_orders(args.model, stats.orders(), meta, args.root)
    print(f"saved channel orders for {args.model} ({stats.tokens} tokens) to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
