"""Per-layer queries and keys of a dense forward pass, for offline calibration
(``python -m models.cli.calibrate``) and attention analysis. Runs through the layer
driver (:mod:`models.driver`), like every other pass over the model."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from models.driver import Driver
from models.transformer import layer_graphdef
from sparse_jax.methods.base import DenseAttention


@functools.partial(jax.jit, static_argnums=(0, 1))
def _capture(graphdef, cfg, params, tokens):
    model = nnx.merge(graphdef, params)
    drv = Driver(cfg, DenseAttention(), layer_graphdef(cfg, model.embed_tokens.weight[...].dtype))
    _, per_segment = drv.forward(nnx.state(model.layers), model.embed_tokens(tokens), capture=True)
    out = []
    for q, k in per_segment:  # [L_seg, B, T, H*, D]
        out += [(q[i], k[i]) for i in range(q.shape[0])]
    return out


def capture_qk(model, tokens) -> list[tuple[jax.Array, jax.Array]]:
    """Post-RoPE ``(q [B,T,Hq,D], k [B,T,Hkv,D])`` of every layer for ``tokens
    int32[B, T]``, running every layer densely (``model`` from ``load_model``)."""
    tokens = jnp.asarray(tokens, jnp.int32)
    if tokens.ndim != 2:
        raise ValueError(f"tokens must have shape [B, T], got {tokens.shape}")
    return _capture(model.graphdef, model.config, model.params, tokens)
