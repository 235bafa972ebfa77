"""Attention methods (one module each) and their registry.

Importing this package registers every method: ``dense``, ``oracle_topk``,
``streaming``, ``quest``, ``arkvale``, ``double_sparsity``, ``asynctls``, ``kascade``, ``asyncspade``.
"""

from sparse_jax.methods.base import (
    AttentionMethod,
    DenseAttention,
    dense_prefill_attention,
    masked_decode_attention,
)
from sparse_jax.methods.registry import available_methods, get_method, register
from sparse_jax.methods.sparse_base import BlockSparseMethod, SparseMethod
from sparse_jax.methods import oracle, streaming, quest, double_sparsity, kascade, asyncspade  # noqa: E402,F401  (registration)
from sparse_jax.methods.oracle import OracleTopK
from sparse_jax.methods.streaming import StreamingLLM
from sparse_jax.methods.quest import ArkVale, Quest
from sparse_jax.methods.double_sparsity import AsyncTLS, DoubleSparsity
from sparse_jax.methods.kascade import Kascade
from sparse_jax.methods.asyncspade import AsyncSpade

__all__ = [
    "ArkVale",
    "AsyncSpade",
    "AsyncTLS",
    "AttentionMethod",
    "BlockSparseMethod",
    "DenseAttention",
    "DoubleSparsity",
    "Kascade",
    "OracleTopK",
    "Quest",
    "SparseMethod",
    "StreamingLLM",
    "available_methods",
    "dense_prefill_attention",
    "get_method",
    "masked_decode_attention",
    "register",
]
