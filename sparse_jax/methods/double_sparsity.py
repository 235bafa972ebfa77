"""``double_sparsity`` (Yang et al., 2024) and ``asynctls`` (two-level): token
selection from an INT4 "label cache" of calibrated key channels.

State per layer: the label cache (``LabelCache``: packed INT4 keys of the
layer's ``r`` calibrated channels with per-token scale and offset), plus for
AsyncTLS the per-block key boxes of its Quest filter.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from sparse_jax.calibration import select_channels
from sparse_jax.methods.quest import BlockBoxes
from sparse_jax.methods.registry import register
from sparse_jax.methods.sparse_base import SparseMethod, fallback_to_dense, newest_token
from sparse_jax.ops.scoring import (
    block_minmax,
    build_label_cache,
    label_scores,
    quest_block_scores,
    update_block_minmax,
    update_label_cache,
)
from sparse_jax.ops.selection import topk_indices


@register("double_sparsity")
@dataclasses.dataclass(frozen=True)
class DoubleSparsity(SparseMethod):
    """Top-``budget`` tokens by label scores over the whole context.

    Defaults from Double Sparsity / its SGLang backend: channels ranked by
    ``|q*k|`` (``ranking="qk"``), ``channels = head_dim // 4`` when 0 (16 of
    64 for SmolLM2; DS uses 16-32 of 128), INT4 labels, layers 0-1 dense, no
    sink or window. ``calibration_root`` overrides where calibrations live.
    ``channels_per_layer`` is filled by ``for_model`` from the calibration.
    """

    channels: int = 0
    ranking: str = "qk"
    dense_layers: tuple[int, ...] = (0, 1)
    calibration_root: str | None = None
    channels_per_layer: tuple | None = None
    layer: int = -1

    def for_model(self, model_name, *, num_layers, head_dim):
        if self.channels_per_layer is not None:
            return self
        cpl = select_channels(model_name, num_layers, self.num_channels(head_dim), self.ranking, self.calibration_root)
        return dataclasses.replace(self, channels_per_layer=cpl)

    def check(self, *, num_q_heads, num_kv_heads, head_dim, max_len):
        super().check(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, max_len=max_len)
        r = self.num_channels(head_dim)
        if r % 2:
            raise ValueError(f"{self.name}: channels must be even (two INT4 labels per byte), got {r}")
        if self.channels_per_layer is None:
            raise ValueError(
                f"{self.name} needs calibrated channels: load the model with models.load_model(..., "
                f"attention={self.name!r}), which reads them for that model"
            )
        got = len(self.channels_per_layer[0][0])
        if got != r:
            raise ValueError(f"{self.name}: channels_per_layer holds {got} channels per head, expected {r}")

    def num_channels(self, head_dim: int) -> int:
        return self.channels or head_dim // 4

    def layer_method(self, layer, num_layers):
        m = super().layer_method(layer, num_layers)
        return dataclasses.replace(m, layer=layer) if m is self else m

    def layer_channels(self) -> jax.Array:
        """``int32[Hkv, r]`` for this layer (a constant in the jitted code)."""
        return jnp.asarray(self.channels_per_layer[self.layer], jnp.int32)

    # -- state ----------------------------------------------------------------
    def init_state(self, *, batch, num_kv_heads, max_len, head_dim, dtype):
        r = self.num_channels(head_dim)
        k = jnp.zeros((batch, num_kv_heads, max_len, head_dim), dtype)
        return build_label_cache(k, jnp.zeros((num_kv_heads, r), jnp.int32), impl="reference")

    def prefill_state(self, state, k, v, lengths):
        return build_label_cache(k, self.layer_channels(), impl=self.impl)

    def append_state(self, state, k, v, positions):
        return update_label_cache(state, newest_token(k, positions), self.layer_channels(), positions)

    def labels(self, state):
        return state

    def select(self, q, k, v, lengths, state):
        channels = self.layer_channels()
        scores = label_scores(q, self.labels(state), channels, lengths=lengths, impl=self.impl)
        indices, counts = self.select_from_scores(scores, lengths)
        return indices, counts, state


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TwoLevelState:
    boxes: BlockBoxes
    labels: object


@register("asynctls")
@dataclasses.dataclass(frozen=True)
class AsyncTLS(DoubleSparsity):
    """Two-level selection: a Quest GEMM block filter keeps ``kb`` blocks, then
    Double-Sparsity token selection runs inside them.

    Defaults from AsyncTLS (Sec. 5): 64-token blocks, ``kb = 128`` blocks (8,192
    candidate tokens; at contexts up to that the filter keeps everything),
    ``head_dim // 4`` label channels (32 of 128 for GQA) ranked by AsyncTLS's
    max|q|*max|k| rule, INT4 labels, budgets 512/1024/2048 tokens. The paper
    names no dense layers, sink or window; we keep layers 0-1 dense as Quest
    and DS do. The newest block is always among the candidates.
    """

    block_size: int = 64
    kb: int = 128
    ranking: str = "maxabs"

    @property
    def cache_multiple(self) -> int:
        return self.block_size

    def check(self, *, num_q_heads, num_kv_heads, head_dim, max_len):
        super().check(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, max_len=max_len)
        if max_len % self.block_size:
            raise ValueError(f"asynctls: the cache length ({max_len}) must be a multiple of block_size ({self.block_size})")
        if self.kb < 1:
            raise ValueError("asynctls: kb must be >= 1")

    def init_state(self, *, batch, num_kv_heads, max_len, head_dim, dtype):
        shape = (batch, num_kv_heads, max_len // self.block_size, head_dim)
        labels = super().init_state(batch=batch, num_kv_heads=num_kv_heads, max_len=max_len, head_dim=head_dim, dtype=dtype)
        return TwoLevelState(BlockBoxes(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)), labels)

    def prefill_state(self, state, k, v, lengths):
        upper, lower = block_minmax(k, lengths, block_size=self.block_size, impl=self.impl)
        return TwoLevelState(BlockBoxes(upper, lower), super().prefill_state(state.labels, k, v, lengths))

    def append_state(self, state, k, v, positions):
        upper, lower = update_block_minmax(
            state.boxes.upper, state.boxes.lower, newest_token(k, positions), positions, block_size=self.block_size
        )
        labels = super().append_state(state.labels, k, v, positions)
        return TwoLevelState(BlockBoxes(upper, lower), labels)

    def candidate_tokens(self, q, lengths, state):
        """Token positions of the kept blocks ``[B, Hkv, n*block]``, the newest
        (partial) block last, and how many of them are real ``[B, Hkv]``."""
        bs = self.block_size
        scores = quest_block_scores(q, state.boxes.upper, state.boxes.lower, impl=self.impl)
        b, hkv, nb = scores.shape
        n = min(self.kb, nb)
        last = (lengths - 1) // bs
        blk = jnp.arange(nb, dtype=jnp.int32)
        scores = jnp.where(blk >= last[:, None, None], -jnp.inf, scores)
        parts = []
        if n > 1:
            parts.append(topk_indices(scores, n - 1, jnp.broadcast_to(last[:, None] + 1, (b, hkv)), impl=self.impl))
        parts.append(jnp.broadcast_to(last[:, None, None], (b, hkv, 1)))
        blocks, block_counts = fallback_to_dense(jnp.concatenate(parts, -1).astype(jnp.int32), last + 1, n)
        tokens = (blocks[..., None] * bs + jnp.arange(bs, dtype=jnp.int32)).reshape(b, hkv, -1)
        counts = (block_counts - 1) * bs + (lengths - last * bs)[:, None]
        return tokens, counts.astype(jnp.int32)

    def labels(self, state):
        return state.labels

    def select(self, q, k, v, lengths, state):
        cand, cand_counts = self.candidate_tokens(q, lengths, state)
        channels = self.layer_channels()
        scores = label_scores(q, state.labels, channels, cand, cand_counts, impl=self.impl)
        indices, counts = self.select_from_scores(scores, lengths, cand, cand_counts, capacity=k.shape[2])
        return indices, counts, state
