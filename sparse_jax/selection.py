"""``Selection``: what a method chose to attend for one decode step, as data.

A method's ``select`` returns a :class:`Selection`; one generic attention,
:func:`attend`, runs it. Between the two anyone may read or rewrite it: the
offloaded cache maps it to resident pool rows and prefetches its ``prefetch``
blocks, Kascade's reuse layers take an anchor layer's selection from the
carry, composition wrappers filter it.

Granularities (``Selection.kind``, static):

* ``"all"``: every valid token (``[0, lengths)``, or the whole ring of a local
  layer): exact attention. ``indices`` and ``counts`` are None.
* ``"tokens"``: ``indices int32[B, Hkv, K]`` token positions, the first
  ``counts int32[B, Hkv]`` valid per KV head (entries past the count are ignored).
* ``"blocks"``: ``indices int32[B, Hkv, n]`` block ids of ``block_size`` tokens,
  the first ``counts`` valid; the tokens of a block at or past ``lengths`` are
  masked.

``prefetch int32[B, Hkv, m]`` (optional, any granularity): the block ids of
``block_size`` tokens the *next* step will read (-1: none), known one step
early: AsyncTLS's one-step lag, AsyncSpade's predicted query. An offloaded
cache copies the missing ones from the host while this step computes.

``within_prefetch`` (static): every block this selection reads was in the
*previous* step's ``prefetch`` (or is one of the two newest blocks). An
offloaded cache then reads the pool directly; otherwise it first fetches the
selection's missing blocks (a copy the attention waits for).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from sparse_jax.ops import attention as ops

KINDS = ("all", "tokens", "blocks")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Selection:
    indices: Any = None
    counts: Any = None
    prefetch: Any = None
    kind: str = dataclasses.field(default="all", metadata=dict(static=True))
    block_size: int = dataclasses.field(default=1, metadata=dict(static=True))
    within_prefetch: bool = dataclasses.field(default=False, metadata=dict(static=True))

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"Selection.kind must be one of {KINDS}, got {self.kind!r}")

    # -- constructors ---------------------------------------------------------
    @classmethod
    def all_tokens(cls, prefetch=None, block_size: int = 1) -> "Selection":
        return cls(None, None, prefetch, "all", block_size)

    @classmethod
    def tokens(cls, indices, counts, prefetch=None, block_size: int = 1,
               within_prefetch: bool = False) -> "Selection":
        """``block_size`` only names the granularity of ``prefetch`` (and of the blocks
        an offloaded cache moves)."""
        return cls(indices, counts, prefetch, "tokens", block_size, within_prefetch)

    @classmethod
    def blocks(cls, block_ids, counts, block_size: int, prefetch=None,
               within_prefetch: bool = False) -> "Selection":
        return cls(block_ids, counts, prefetch, "blocks", int(block_size), within_prefetch)

    # -- views ----------------------------------------------------------------
    def token_view(self, lengths: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The selection as token positions ``(indices [B,Hkv,K], counts [B,Hkv])``
        (for blocks: every token ``< lengths`` of the first ``counts`` blocks, in the
        blocks' order, moved to the front; an ``"all"`` selection lists no tokens)."""
        if self.kind == "tokens":
            return self.indices, self.counts
        if self.kind == "all":
            raise ValueError("an 'all' selection lists no tokens: it attends [0, lengths)")
        bs = self.block_size
        b, hkv, n = self.indices.shape
        tokens = (self.indices[..., None] * bs + jnp.arange(bs, dtype=jnp.int32)).reshape(b, hkv, n * bs)
        counted = jnp.repeat(jnp.arange(n) < self.counts[..., None], bs, axis=-1)  # [B, Hkv, n*bs]
        valid = counted & (tokens < lengths[:, None, None])
        # any block may be the partial newest one (a reused or carried list need not end
        # with it): a stable sort moves the valid tokens to the front, in order
        order = jnp.argsort(~valid, axis=-1, stable=True)
        tokens = jnp.take_along_axis(tokens, order, axis=-1)
        return tokens.astype(jnp.int32), jnp.sum(valid, axis=-1, dtype=jnp.int32)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, sel: Selection, *,
           impl: str = "auto") -> jax.Array:
    """Decode attention of ``q [B,Hq,D]`` over the tokens ``sel`` names in ``k, v
    [B,Hkv,S,D]`` whose first ``lengths int32[B]`` positions are valid (a local
    layer's ring: the first ``min(lengths, S)`` slots) -> ``[B,Hq,D]``."""
    if sel.kind == "all":  # the Pallas kernel on a GPU (cuDNN speed), the masked einsum elsewhere
        return ops.dense_decode_attention(q, k, v, jnp.minimum(lengths, k.shape[2]), impl=impl)
    if sel.kind == "tokens":
        return ops.sparse_decode_attention(q, k, v, sel.indices, sel.counts, impl=impl)
    return ops.block_sparse_decode_attention(q, k, v, sel.indices, sel.counts, lengths, block_size=sel.block_size,
                                         impl=impl)
