"""``oracle_topk``: exact attention scores, top-K tokens. The accuracy ceiling
for a token budget (it reads every key, so it saves no memory traffic)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from sparse_jax.methods.registry import register
from sparse_jax.methods.sparse_base import SparseMethod, group_probabilities
from sparse_jax.selection import Selection


@register("oracle_topk")
@dataclasses.dataclass(frozen=True)
class OracleTopK(SparseMethod):
    """Top-``budget`` tokens by exact softmax probability summed over the GQA group.

    Defaults: no sink, no window (the exact scores find them when they
    matter), every layer sparse.
    """

    reads_all_keys: ClassVar[bool] = True
    budget: int = 1024

    def select(self, q, kv, lengths, state, carry, layer):
        scores = group_probabilities(q, kv.k, lengths)
        indices, counts = self.select_from_scores(scores, lengths)
        return Selection.tokens(indices, counts), state, carry
