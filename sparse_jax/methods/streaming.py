"""``streaming`` (StreamingLLM): attention sinks plus a recent window. The floor
any query-aware method must beat."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from sparse_jax.methods.registry import register
from sparse_jax.methods.sparse_base import SparseMethod, fallback_to_dense
from sparse_jax.selection import Selection


@register("streaming")
@dataclasses.dataclass(frozen=True)
class StreamingLLM(SparseMethod):
    """``sink`` first tokens + the last ``budget - sink`` tokens.

    Defaults from StreamingLLM: 4 sink tokens; the window is the rest of the
    budget (``window`` is ignored).
    """

    sink: int = 4

    def check(self, **kw):
        if self.budget <= self.sink:
            raise ValueError(f"streaming: budget ({self.budget}) must exceed sink ({self.sink})")

    def select(self, q, kv, lengths, state, carry, layer):
        b, hkv = q.shape[0], kv.num_kv_heads
        budget = min(self.budget, kv.capacity)
        win = budget - self.sink
        recent = lengths[:, None] - win + jnp.arange(win, dtype=jnp.int32)  # [B, win]
        idx = jnp.concatenate([jnp.broadcast_to(jnp.arange(self.sink, dtype=jnp.int32), (b, self.sink)), recent], -1)
        idx = jnp.broadcast_to(idx[:, None, :], (b, hkv, budget)).astype(jnp.int32)
        indices, counts = fallback_to_dense(idx, lengths, budget)
        return Selection.tokens(indices, counts), state, carry
