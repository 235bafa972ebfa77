"""Token Sparse Attention's layer profile: which layers its sparse prefill runs on.

    python -m models.cli.prefill_profile --model smollm2-135m --length 4096

Runs the model densely over one long real-text prompt (the built-in notes with a
fact hidden at half depth, :mod:`models.cli.demo_prompt`, the stand-in for the paper's
Paul-Graham haystack with a needle at 50%), measures each layer's mean relative
update ``|h_out - h_in| / |h_in|`` over every token (the paper's drift, the whole
decoder layer), and marks the layers at or below the ``--quantile`` (δ = 0.5) of
the drift of the layers TSA may run on (global layers: on Gemma 3 the
sliding-window ones are excluded). The profile is saved where ``load_model``
reads it (``sparse_jax/calibration_data/<model>/token_sparse.json``); a method
with ``prefill=token_sparse`` and no ``prefill.layers`` then uses its layers.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import models
from models.cli.demo_prompt import build_demo_prompt
from models.driver import Driver, sparse_prefill_eligible
from models.transformer import layer_graphdef
from sparse_jax.methods.base import DenseAttention
from sparse_jax.prefill import layers_from_drift, save_prefill_profile


def haystack_ids(tokenizer, length: int) -> list[int]:
    """About ``length`` tokens of the demo notes (one fact at half depth), cut to ``length``."""
    n = 8
    while True:
        text = build_demo_prompt(n_paragraphs=n, fact_at=0.5).messages[0]["content"]
        ids = tokenizer.encode(text)
        if len(ids) >= length or n > 4096:
            return ids[:length]
        n *= 2


def layer_drift(model, tokens) -> np.ndarray:
    """``f32[L]``: each layer's mean relative update over ``tokens int32[1, T]`` (dense)."""
    from flax import nnx

    @jax.jit
    def run(params, tokens):
        m = nnx.merge(model.graphdef, params)
        drv = Driver(model.config, DenseAttention(), layer_graphdef(model.config, model.dtype))
        _, per_segment = drv.forward(nnx.state(m.layers), m.embed_tokens(tokens), drift=True)
        return jnp.concatenate([jnp.atleast_1d(d) for d in per_segment])

    return np.asarray(run(model.params, jnp.asarray(tokens, jnp.int32)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--length", type=int, default=4096, help="prompt tokens (default 4096)")
    p.add_argument("--quantile", type=float, default=0.5, help="δ: layers at or below this drift quantile (0.5)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--out", default=None, help="calibration root (default: the package's calibration_data)")
    a = p.parse_args(argv)
    if not 0 < a.quantile <= 1:
        p.error(f"--quantile must be in (0, 1], got {a.quantile}")
    if a.length < 16:
        p.error(f"--length must be >= 16, got {a.length}")
    model = models.load_model(a.model, dtype=jnp.dtype(a.dtype))
    if model.tokenizer is None:
        p.error(f"{a.model} has no tokenizer (random weights): profile a model with real weights")
    ids = haystack_ids(model.tokenizer, min(a.length, model.config.max_position))
    t0 = time.perf_counter()
    drift = layer_drift(model, np.asarray([ids], np.int32))
    eligible = sparse_prefill_eligible(model.config)  # global layers
    layers = layers_from_drift(drift, eligible, a.quantile)
    meta = {"model": a.model, "tokens": len(ids), "quantile": a.quantile, "dtype": a.dtype,
            "prompt": "models.cli.demo_prompt notes, fact at 50% depth", "jax": jax.__version__,
            "device": jax.devices()[0].device_kind, "date": time.strftime("%Y-%m-%d"),
            "command": "python -m models.cli.prefill_profile " + " ".join(sys.argv[1:] if argv is None else argv)}
    path = save_prefill_profile(a.model, drift, layers, meta, a.out)
    print(f"{a.model}: {len(ids)} tokens, drift per layer ({time.perf_counter() - t0:.1f} s):")
    for i, d in enumerate(drift):
        mark = "TSA" if i in layers else ("-" if eligible[i] else "local")
        print(f"  layer {i:2d}  {d:.4f}  {mark}")
    print(f"sparse-prefill layers (drift <= the {a.quantile} quantile of eligible layers): {list(layers)}")
    print(f"written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
