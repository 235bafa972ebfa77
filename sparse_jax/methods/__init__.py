"""Attention methods (one module each) and their registry."""

from sparse_jax.methods.base import (
    AttentionMethod,
    DenseAttention,
    dense_prefill_attention,
    masked_decode_attention,
)
from sparse_jax.methods.registry import available_methods, get_method, register

__all__ = [
    "AttentionMethod",
    "DenseAttention",
    "available_methods",
    "dense_prefill_attention",
    "get_method",
    "masked_decode_attention",
    "register",
]
