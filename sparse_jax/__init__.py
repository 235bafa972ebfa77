"""sparse-jax: sparse attention and KV-cache offloading for long-context decoding.

The public ops live at the top level (each dispatches between a Pallas GPU kernel
and a pure-jnp reference with ``impl="auto" | "pallas" | "reference"``); the
submodules (``sparse_jax.ops.attention``, ``.scoring``, ``.selection``,
``.transfer``, ``.slot_pool``) stay importable::

    import sparse_jax as sj
    out = sj.sparse_decode_attention(q, k, v, indices, counts)          # [B, Hq, D]
    idx = sj.topk_indices(scores, 256, counts)                          # [B, Hkv, 256]

Attention methods (the registry): :func:`get_method`, :func:`available_methods`.
"""

from sparse_jax.cache import KVCache, LayerCache
from sparse_jax.methods import AttentionMethod, available_methods, get_method, register
from sparse_jax.ops.attention import (
    block_sparse_decode_attention,
    dense_decode_attention,
    merge_attention,
    sparse_decode_attention,
)
from sparse_jax.ops.scoring import (
    block_cuboid,
    block_label_scores,
    block_minmax,
    build_label_cache,
    label_scores,
    quantize_block_boxes,
    quest_block_scores,
    quest_block_scores_quantized,
    update_block_minmax,
    update_label_cache,
    update_quantized_block_boxes,
)
from sparse_jax.ops.selection import topk_indices
from sparse_jax.ops.slot_pool import assign_pool_slots, assign_shared_pool_slots
from sparse_jax.ops.transfer import host_gather, host_gather_into

__version__ = "0.1.0"

__all__ = [
    "AttentionMethod",
    "KVCache",
    "LayerCache",
    "assign_pool_slots",
    "assign_shared_pool_slots",
    "available_methods",
    "block_cuboid",
    "block_label_scores",
    "block_minmax",
    "block_sparse_decode_attention",
    "build_label_cache",
    "dense_decode_attention",
    "get_method",
    "host_gather",
    "host_gather_into",
    "label_scores",
    "merge_attention",
    "quest_block_scores",
    "quest_block_scores_quantized",
    "quantize_block_boxes",
    "update_quantized_block_boxes",
    "register",
    "sparse_decode_attention",
    "topk_indices",
    "update_block_minmax",
    "update_label_cache",
]
