"""What a decode-time hook sees of a layer's KV: a *view*, not the arrays.

A method's ``append_state``, ``select`` and ``decode`` get ``kv``, a view of
the layer's keys and values whose first ``lengths`` positions are valid (the
new token included). Where the KV lives is the view's business:

* :class:`ResidentKV`: the whole layer on the device, ``k, v [B, Hkv, S, D]``;
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
