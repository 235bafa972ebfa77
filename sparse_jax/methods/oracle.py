"""``oracle_topk``: exact attention scores, top-K tokens. The accuracy ceiling
for a token budget (it reads every key, so it saves no memory traffic)."""

from __future__ import annotations

import dataclasses

from sparse_jax.methods.registry import register
from sparse_jax.methods.sparse_base import SparseMethod, group_probabilities


@register("oracle_topk")
@dataclasses.dataclass(frozen=True)
class OracleTopK(SparseMethod):
    """Top-``budget`` tokens by exact softmax probability summed over the GQA group.

    Defaults: no sink, no window (the exact scores find them when they
    matter), every layer sparse.
    """

    budget: int = 1024

    def select(self, q, k, v, lengths, state):
        scores = group_probabilities(q, k, lengths)
        indices, counts = self.select_from_scores(scores, lengths)
        return indices, counts, state
