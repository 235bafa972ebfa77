"""Per-layer queries and keys of a dense forward pass, for offline calibration
(``python -m models.calibrate``) and attention analysis."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from models.transformer import layer_output, layer_qkv, rope_for
from sparse_jax.methods.base import dense_prefill_attention


@functools.partial(jax.jit, static_argnums=(0, 1))
def _capture(graphdef, cfg, params, tokens):
    model = nnx.merge(graphdef, params)
    t = tokens.shape[1]
    cos, sin = rope_for(cfg, jnp.arange(t))
    x = model.embed_tokens(tokens)
    out = []
    for layer in model.layers:
        q, k, v = layer_qkv(layer, x, cos, sin)
        out.append((q, k))
        x = layer_output(layer, x, dense_prefill_attention(q, k, v))
    return out


def capture_qk(model, tokens) -> list[tuple[jax.Array, jax.Array]]:
    """Post-RoPE ``(q [B,T,Hq,D], k [B,T,Hkv,D])`` of every layer for ``tokens
    int32[B, T]``, running every layer densely (``model`` from ``load_model``)."""
    tokens = jnp.asarray(tokens, jnp.int32)
    if tokens.ndim != 2:
        raise ValueError(f"tokens must have shape [B, T], got {tokens.shape}")
    return _capture(model.graphdef, model.config, model.params, tokens)
