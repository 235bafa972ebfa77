"""Argument checks shared by the public ops: they run on shapes and dtypes
only (no device work), so bad input fails before any compilation."""

from __future__ import annotations

import jax.numpy as jnp

FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def check_rank(name: str, x, rank: int, layout: str) -> None:
    if getattr(x, "ndim", None) != rank:
        raise ValueError(f"{name} must have shape {layout} (rank {rank}), got shape {getattr(x, 'shape', None)}")


def check_float(name: str, x) -> None:
    if not any(x.dtype == d for d in FLOAT_DTYPES):
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")


def check_int(name: str, x) -> None:
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer array (int32), got {x.dtype}")


def check_gqa(num_q_heads: int, num_kv_heads: int) -> int:
    """Return the group size Hq // Hkv, or raise if Hq is not a multiple of Hkv."""
    if num_kv_heads <= 0 or num_q_heads % num_kv_heads:
        raise ValueError(
            f"query heads ({num_q_heads}) must be a multiple of KV heads ({num_kv_heads})"
        )
    return num_q_heads // num_kv_heads


def check_shape(name: str, x, expected: tuple, layout: str) -> None:
    if tuple(x.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {layout} = {tuple(expected)}, got {tuple(x.shape)}")


def check_int_array(name: str, x, expected: tuple, layout: str) -> None:
    """An integer array of exactly ``expected`` shape (rank, dtype, then shape)."""
    check_rank(name, x, len(expected), layout)
    check_int(name, x)
    check_shape(name, x, expected, layout)
