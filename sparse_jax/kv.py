"""What a decode-time hook sees of a layer's KV: a *view*, not the arrays.

A method's ``append_state``, ``select`` and ``decode`` get ``kv``, a view of
the layer's keys and values whose first ``lengths`` positions are valid (the
new token included). Where the KV lives is the view's business:

* :class:`ResidentKV`: the whole layer on the device, ``k, v [B, Hkv, S, D]``;
* :class:`PagedKV`: the whole layer on the device in one pool of pages shared by the
  batch, ``pool_k, pool_v [1, Hkv, P * page, D]``, and a block table per row (the paged
  serving engine's layout; not yet used by a model);
* :class:`sparse_jax.offload.pool.PooledKV`: an offloaded layer, whose device
  holds a pool of blocks (the ones recent steps selected) and a ring with the
  newest blocks, the rest on the host. It has no ``k``/``v``: a method that
  reads every key (``reads_all_keys``) cannot run offloaded.

Every view answers the same questions: its ``capacity`` (positions it can
hold), ``num_kv_heads``, the newest key of each row, the keys of the block a
row's newest token is in, and the attention of a query over a
:class:`~sparse_jax.selection.Selection`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.block_sparse_decode import paged_rows
from sparse_jax.ops import attention as ops
from sparse_jax.selection import Selection, attend


def newest_token(x: jax.Array, positions: jax.Array) -> jax.Array:
    """``x [B,Hkv,S,D]`` at ``positions int32[B]`` -> ``[B,Hkv,D]``."""
    return jax.vmap(lambda row, p: jax.lax.dynamic_index_in_dim(row, p, axis=1, keepdims=False))(x, positions)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ResidentKV:
    """A resident layer: ``k, v [B, Hkv, S, D]`` (a local layer's ring: slot ``p % S``)."""

    k: jax.Array
    v: jax.Array

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[1]

    def newest_keys(self, positions: jax.Array) -> jax.Array:
        """The key at ``positions int32[B]`` of each row: ``[B, Hkv, D]``."""
        return newest_token(self.k, positions)

    def block_keys(self, blocks: jax.Array, block_size: int) -> jax.Array:
        """Keys of block ``blocks int32[B]`` of each row (the block of its newest
        token): ``[B, Hkv, block_size, D]``."""
        return jax.vmap(lambda row, blk: jax.lax.dynamic_slice_in_dim(row, blk * block_size, block_size, axis=1))(
            self.k, blocks)

    def attend(self, q: jax.Array, lengths: jax.Array, sel: Selection, *, impl: str = "auto") -> jax.Array:
        """Decode attention of ``q [B,Hq,D]`` over what ``sel`` names: ``[B,Hq,D]``."""
        return attend(q, self.k, self.v, lengths, sel, impl=impl)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKV:
    """A paged layer: ``pool_k, pool_v [1, Hkv, P * page, D]`` (page ``i`` is rows
    ``[i * page, (i + 1) * page)``), shared by the batch, and ``block_table int32[B, W]``:
    row ``b``'s position ``p`` is pool row ``block_table[b, p // page] * page + p % page``
    (:class:`models.serving.blocks.BlockManager` makes the tables; unused entries name the
    null page 0, never read as a real token: every reader masks by the row's length)."""

    pool_k: jax.Array
    pool_v: jax.Array
    block_table: jax.Array
    page: int = dataclasses.field(metadata=dict(static=True))

    @property
    def capacity(self) -> int:
        return self.block_table.shape[1] * self.page

    @property
    def num_kv_heads(self) -> int:
        return self.pool_k.shape[1]

    @property
    def k(self) -> jax.Array:
        """Every row's keys ``[B, Hkv, capacity, D]``, contiguous: a copy of its pages, for a
        method that scores every key (``reads_all_keys``); attention reads the pages in place."""
        return paged_rows(self.pool_k, self.block_table, self.page)

    @property
    def v(self) -> jax.Array:
        return paged_rows(self.pool_v, self.block_table, self.page)

    def rows(self, positions: jax.Array) -> jax.Array:
        """Pool rows of logical ``positions int32[B, ...]`` (each row through its own table)."""
        b = positions.shape[0]
        flat = positions.reshape(b, -1)
        page = jnp.take_along_axis(self.block_table, jnp.clip(flat // self.page, 0, self.block_table.shape[1] - 1),
                                   axis=1)
        return (page * self.page + flat % self.page).reshape(positions.shape).astype(jnp.int32)

    def newest_keys(self, positions: jax.Array) -> jax.Array:
        """The key at ``positions int32[B]`` of each row: ``[B, Hkv, D]``."""
        return jnp.swapaxes(self.pool_k[0][:, self.rows(positions)], 0, 1)

    def block_keys(self, blocks: jax.Array, block_size: int) -> jax.Array:
        """Keys of logical block ``blocks int32[B]`` of each row: ``[B, Hkv, block_size, D]``
        (any block size: its tokens' rows, through the table, across pages where it spans several)."""
        rows = self.rows(blocks[:, None] * block_size + jnp.arange(block_size, dtype=jnp.int32))  # [B, bs]
        return jnp.moveaxis(self.pool_k[0][:, rows], 0, 1)

    def attend(self, q: jax.Array, lengths: jax.Array, sel: Selection, *, impl: str = "auto") -> jax.Array:
        """Decode attention of ``q [B,Hq,D]`` over what ``sel`` names: ``[B,Hq,D]``. Every
        valid page ("all": :func:`sparse_jax.ops.dense_decode_attention`), or blocks of the
        page's size (:func:`sparse_jax.ops.block_sparse_decode_attention`), read in place
        through the table; other selections as token rows of the pool
        (:func:`sparse_jax.ops.sparse_decode_attention`)."""
        lengths = jnp.minimum(lengths, self.capacity).astype(jnp.int32)
        if sel.kind == "all":
            return ops.dense_decode_attention(q, self.pool_k, self.pool_v, lengths, block_size=self.page, impl=impl,
                                              block_table=self.block_table)
        if sel.kind == "blocks" and sel.block_size == self.page:
            return ops.block_sparse_decode_attention(q, self.pool_k, self.pool_v, sel.indices, sel.counts, lengths,
                                                     block_size=self.page, impl=impl, block_table=self.block_table)
        indices, counts = sel.token_view(lengths)
        return ops.sparse_decode_attention(q, self.pool_k, self.pool_v, self.rows(indices), counts, impl=impl)
