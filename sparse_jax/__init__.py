"""sparse-jax: sparse attention and KV-cache offloading for long-context decoding."""

from sparse_jax.cache import KVCache, LayerCache
from sparse_jax.methods import AttentionMethod, available_methods, get_method, register

__version__ = "0.1.0"
