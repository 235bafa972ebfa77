"""``quest`` (Tang et al., 2024) and ``arkvale`` (SparseServe's metadata): block
selection by an upper bound of the block's attention score.

State per layer: a box per block and KV head, ``upper, lower [B, Hkv, NB, D]``.
Quest's box is the key min/max, updated on every append as Quest does;
ArkVale's is centre ± mean deviation, re-summarised when a token lands in the
block. The score is AsyncTLS's GEMM form of Quest's bound, summed over the
GQA group (``quest_block_scores``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from sparse_jax.methods.registry import register
from sparse_jax.methods.sparse_base import BlockSparseMethod
from sparse_jax.ops.scoring import (GROUP_REDUCTIONS, block_cuboid, block_minmax, quest_block_scores,
                                    update_block_minmax)


def check_group_reduce(name: str, value: str) -> None:
    """A clear error, at construction, for an unknown ``group_reduce``."""
    if value not in GROUP_REDUCTIONS:
        raise ValueError(f"{name}: group_reduce must be one of {GROUP_REDUCTIONS}, got {value!r}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockBoxes:
    """``upper, lower [B, Hkv, NB, D]``: per-block key bounds."""

    upper: jax.Array
    lower: jax.Array


@register("quest")
@dataclasses.dataclass(frozen=True)
class Quest(BlockSparseMethod):
    """Quest: per-block key max/min, top blocks by the Quest bound.

    Defaults from Quest's code: 16-token pages, the partially filled last page
    always attended (it counts toward the budget: ``budget // block_size``
    pages in all), no sink page, layers 0-1 dense. AsyncTLS's block filter
    uses 64-token blocks (``block_size=64``).
    """

    block_size: int = 16
    sink_blocks: int = 0
    window_blocks: int = 1
    dense_layers: tuple[int, ...] = (0, 1)
    #: how a KV head's query heads combine their block bounds: "sum" (default), or "max"
    #: (a block any one head wants ranks high; Quest itself is per head, GQA forces a rule)
    group_reduce: str = "sum"

    def __post_init__(self):
        check_group_reduce(self.name, self.group_reduce)

    def init_state(self, spec, *, batch, num_kv_heads, max_len, head_dim, dtype, num_q_heads=None):
        shape = (batch, num_kv_heads, -(-max_len // self.block_size), head_dim)
        return BlockBoxes(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

    def prefill_state(self, state, k, v, lengths, layer):
        upper, lower = block_minmax(k, lengths, block_size=self.block_size, impl=self.impl)
        return BlockBoxes(upper, lower)

    def append_state(self, state, kv, positions, layer):
        upper, lower = update_block_minmax(
            state.upper, state.lower, kv.newest_keys(positions), positions, block_size=self.block_size
        )
        return BlockBoxes(upper, lower)

    def block_scores(self, q, state):
        return quest_block_scores(q, state.upper, state.lower, group_reduce=self.group_reduce, impl=self.impl)


@register("arkvale")
@dataclasses.dataclass(frozen=True)
class ArkVale(Quest):
    """ArkVale's page summary (SparseServe's default metadata), Quest's selection.

    The box is centred at (max+min)/2 with half-width the mean |centre - key|,
    tighter than min/max. Defaults from ArkVale's code: 32-token pages, one
    sink page and two window pages always attended (the last, partial one
    among them; all count toward the budget), layers 0-1 dense, selection per
    KV head (ArkVale's default averages one page set over all heads).
    """

    block_size: int = 32
    sink_blocks: int = 1
    window_blocks: int = 2

    def prefill_state(self, state, k, v, lengths, layer):
        upper, lower = block_cuboid(k, lengths, block_size=self.block_size, impl=self.impl)
        return BlockBoxes(upper, lower)

    def append_state(self, state, kv, positions, layer):
        bs = self.block_size
        block = positions // bs
        tokens = kv.block_keys(block, bs)  # [B, Hkv, bs, D]: re-summarise only the new token's block

        def one(tok_row, up_row, lo_row, blk, pos):
            up, lo = block_cuboid(tok_row[None], (pos - blk * bs + 1)[None], block_size=bs, impl="reference")
            up_row = jax.lax.dynamic_update_slice_in_dim(up_row, up[0].astype(up_row.dtype), blk, axis=1)
            lo_row = jax.lax.dynamic_update_slice_in_dim(lo_row, lo[0].astype(lo_row.dtype), blk, axis=1)
            return up_row, lo_row

        upper, lower = jax.vmap(one)(tokens, state.upper, state.lower, block, positions)
        return BlockBoxes(upper, lower)
