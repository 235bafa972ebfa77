"""What every dynamic sparse decode method shares: the budget, sink and window
tokens, the dense fallback, and turning scores into a selection.

Budget accounting (the same for every method, so "equal budget" means equal
attention cost): ``budget`` is the number of tokens each KV head attends per
decode step, **sink and window tokens included**. A block method attends
``budget // block_size`` whole blocks, the block holding the newest token
included. When a row's context is not longer than the budget, the method
attends the whole context exactly (a dense fallback, not an error).

Selection contract (DESIGN.md): ``indices int32[B, Hkv, K]``,
``counts int32[B, Hkv]``; entries past the count are ignored.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from sparse_jax.kv import newest_token  # noqa: F401  (re-exported)
from sparse_jax.methods.base import AttentionMethod
from sparse_jax.ops.selection import topk_indices
from sparse_jax.selection import Selection


@dataclasses.dataclass(frozen=True)
class SparseMethod(AttentionMethod):
    """Base of the token-selecting methods.

    Attributes:
      budget: tokens attended per KV head and step, sink and window included.
      sink: first tokens always attended (attention sinks).
      window: most recent tokens always attended (the newest token included).
      impl: kernel implementation for the ops ("auto", "pallas", "reference").
    """

    budget: int = 1024
    sink: int = 0
    window: int = 0
    impl: str = "auto"

    def check(self, *, num_q_heads, num_kv_heads, head_dim, max_len):
        if self.budget < 1:
            raise ValueError(f"{self.name}: budget must be >= 1, got {self.budget}")
        if self.sink < 0 or self.window < 0:
            raise ValueError(f"{self.name}: sink and window must be >= 0")
        if self.sink + self.window > self.budget:
            raise ValueError(
                f"{self.name}: sink ({self.sink}) + window ({self.window}) exceed the budget ({self.budget})"
            )

    @property
    def num_selected(self) -> int:
        """Tokens chosen by score (the budget less sink and window)."""
        return self.budget - self.sink - self.window

    # -- to override ----------------------------------------------------------
    def select(self, q, kv, lengths, state, carry, layer) -> tuple[Selection, Any, Any]:
        """``(Selection.tokens(indices [B,Hkv,K], counts [B,Hkv]), state, carry)``."""
        raise NotImplementedError

    # -- helpers --------------------------------------------------------------
    def select_from_scores(
        self, scores: jax.Array, lengths: jax.Array, positions: jax.Array | None = None,
        num_valid: jax.Array | None = None, capacity: int | None = None,
    ) -> tuple[jax.Array, jax.Array]:
        """Sink + window + top-(budget - sink - window) of ``scores``.

        ``scores [B,Hkv,C]`` rate the tokens at ``positions int32[B,Hkv,C]``
        (default: C = S and position = column), of which the first
        ``num_valid int32[B,Hkv]`` are real (default: ``lengths``). Positions at
        or past ``lengths`` never count; sink and window tokens are excluded
        from the scored top-k so that nothing is chosen twice. Rows whose
        context fits in the budget attend all of it.
        """
        b, hkv, c = scores.shape
        s = capacity if capacity is not None else c
        budget = min(self.budget, s)
        pos = jnp.arange(c, dtype=jnp.int32) if positions is None else positions
        length = lengths[:, None, None]
        forced = (pos < self.sink) | (pos >= length - self.window)
        scores = jnp.where(forced | (pos >= length), -jnp.inf, scores.astype(jnp.float32))
        counts = jnp.broadcast_to(lengths[:, None], (b, hkv)) if num_valid is None else num_valid
        # candidates the top-k may take: real, not forced, inside the context
        scorable = (jnp.arange(c) < counts[..., None]) & ~forced & (pos < length)
        n_scorable = jnp.sum(scorable, axis=-1, dtype=jnp.int32)
        parts = []
        if self.sink:
            parts.append(jnp.broadcast_to(jnp.arange(self.sink, dtype=jnp.int32), (b, hkv, self.sink)))
        if self.window:
            win = lengths[:, None, None] - self.window + jnp.arange(self.window, dtype=jnp.int32)
            parts.append(jnp.broadcast_to(win, (b, hkv, self.window)))
        k_sel = min(budget - self.sink - self.window, c)
        if k_sel > 0:
            top = topk_indices(scores, k_sel, counts, impl=self.impl)
            parts.append(top if positions is None else jnp.take_along_axis(positions, top, axis=-1))
        indices = jnp.concatenate(parts, axis=-1).astype(jnp.int32)
        indices, sel_counts = fallback_to_dense(indices, lengths, budget)
        # fewer scorable candidates than k_sel (a small candidate set): the tail of
        # the top-k holds filler positions, which must not count
        taken = self.sink + self.window + jnp.minimum(max(k_sel, 0), n_scorable)
        long = (lengths > budget)[:, None]
        return indices, jnp.where(long, jnp.minimum(sel_counts, taken), sel_counts).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class BlockSparseMethod(SparseMethod):
    """Base of the block-selecting methods (Quest, ArkVale).

    ``budget // block_size`` blocks are attended: ``sink_blocks`` first blocks,
    the ``window_blocks`` newest blocks (the partially filled last block is
    always one of them, since it cannot be summarised yet) and the best-scored
    rest. ``sink`` and ``window`` (token counts) are unused.
    """

    block_size: int = 16
    sink_blocks: int = 0
    window_blocks: int = 1

    def check(self, *, num_q_heads, num_kv_heads, head_dim, max_len):
        if self.block_size < 1:
            raise ValueError(f"{self.name}: block_size must be >= 1")
        if max_len % self.block_size:
            raise ValueError(f"{self.name}: the cache length ({max_len}) must be a multiple of block_size ({self.block_size})")
        if self.window_blocks < 1:
            raise ValueError(f"{self.name}: window_blocks must be >= 1 (the last, partial block is always attended)")
        if self.num_blocks < self.sink_blocks + self.window_blocks:
            raise ValueError(
                f"{self.name}: budget {self.budget} gives {self.num_blocks} blocks of {self.block_size}, fewer than "
                f"sink_blocks + window_blocks = {self.sink_blocks + self.window_blocks}"
            )

    @property
    def cache_multiple(self) -> int:
        return self.block_size

    @property
    def num_blocks(self) -> int:
        return self.budget // self.block_size

    def block_scores(self, q, state) -> jax.Array:
        """``float32[B, Hkv, NB]``; to override."""
        raise NotImplementedError

    def select_blocks(self, q, lengths, state) -> tuple[jax.Array, jax.Array]:
        """``(blocks int32[B,Hkv,n], block_counts int32[B,Hkv])``, the newest block last."""
        scores = self.block_scores(q, state)
        b, hkv, nb = scores.shape
        n = min(self.num_blocks, nb)
        last = (lengths - 1) // self.block_size  # [B], block of the newest token
        blk = jnp.arange(nb, dtype=jnp.int32)
        lo = last[:, None, None] - self.window_blocks + 1
        scores = jnp.where((blk < self.sink_blocks) | (blk >= lo), -jnp.inf, scores)
        parts = [jnp.broadcast_to(jnp.arange(self.sink_blocks, dtype=jnp.int32), (b, hkv, self.sink_blocks))]
        k_sel = n - self.sink_blocks - self.window_blocks
        if k_sel > 0:
            parts.append(topk_indices(scores, k_sel, (last + 1)[:, None], impl=self.impl))
        parts.append(jnp.broadcast_to(lo + jnp.arange(self.window_blocks, dtype=jnp.int32), (b, hkv, self.window_blocks)))
        blocks = jnp.concatenate(parts, axis=-1).astype(jnp.int32)
        return fallback_to_dense(blocks, last + 1, n)

    def select(self, q, kv, lengths, state, carry, layer):
        blocks, block_counts = self.select_blocks(q, lengths, state)
        return Selection.blocks(blocks, block_counts, self.block_size), state, carry

    @property
    def offload_block_size(self) -> int:
        return self.block_size

    def offload_blocks_per_step(self, max_len: int) -> int:
        return min(self.num_blocks, max_len // self.block_size)


def fallback_to_dense(indices: jax.Array, lengths: jax.Array, budget: int) -> tuple[jax.Array, jax.Array]:
    """Rows with ``lengths <= budget`` attend ``[0, length)``; others keep ``indices``.

    ``indices [B,Hkv,K]`` with K >= budget; returns ``(indices, counts)``.
    """
    b, hkv, kk = indices.shape
    short = (lengths <= budget)[:, None, None]
    all_tokens = jnp.broadcast_to(jnp.arange(kk, dtype=jnp.int32), indices.shape)
    indices = jnp.where(short, all_tokens, indices)
    counts = jnp.where(short[..., 0], lengths[:, None], budget)
    return indices, jnp.broadcast_to(counts, (b, hkv)).astype(jnp.int32)


def decode_probabilities(q: jax.Array, k: jax.Array, lengths: jax.Array) -> jax.Array:
    """Exact decode softmax per query head ``[B, Hkv, G, S]`` f32 (0 at and past ``lengths``).

    ``q [B,Hq,D]``, ``k [B,Hkv,S,D]``.
    """
    b, hq, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    qg = q.reshape(b, hkv, hq // hkv, d)
    logits = jnp.einsum("bhgd,bhsd->bhgs", qg, k, preferred_element_type=jnp.float32) * (d**-0.5)
    valid = (jnp.arange(s)[None, :] < lengths[:, None])[:, None, None, :]
    logits = jnp.where(valid, logits, -jnp.inf)
    return jnp.where(valid, jax.nn.softmax(logits, axis=-1), 0.0)


def group_probabilities(q: jax.Array, k: jax.Array, lengths: jax.Array) -> jax.Array:
    """Exact softmax probabilities summed over each GQA group: ``[B, Hkv, S]`` f32.

    Kascade pools post-softmax over the group, which ranks tokens for the whole
    group better than pre-softmax sums (one head's sharp peak is not drowned out).
    """
    return jnp.sum(decode_probabilities(q, k, lengths), axis=2)

