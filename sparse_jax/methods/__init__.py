"""Attention methods (one module each) and their registry.

Importing this package registers every method: ``dense``, ``oracle_topk``,
``streaming``, ``quest``, ``arkvale``, ``double_sparsity``, ``asynctls``, ``kascade``, ``asyncspade``.
"""

from sparse_jax.methods import asyncspade, asynctls, double_sparsity, kascade, oracle, quest, streaming  # noqa: E402,F401  (registration)
from sparse_jax.methods.asyncspade import AsyncSpade
from sparse_jax.methods.base import AttentionMethod, DenseAttention
from sparse_jax.methods.asynctls import AsyncTLS
from sparse_jax.methods.double_sparsity import DoubleSparsity
from sparse_jax.methods.kascade import Kascade
from sparse_jax.methods.oracle import OracleTopK
from sparse_jax.methods.quest import ArkVale, Quest
from sparse_jax.methods.registry import available_methods, get_method, register
from sparse_jax.methods.sparse_base import BlockSparseMethod, SparseMethod
from sparse_jax.methods.streaming import StreamingLLM

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
    "get_method",
    "register",
]
