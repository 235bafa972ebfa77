"""``double_sparsity`` (Yang et al., 2024): token selection from an INT4 "label cache" of
calibrated key channels (AsyncTLS builds on it: :mod:`sparse_jax.methods.asynctls`).

State per layer: the label cache (``LabelCache``: packed INT4 keys of the
layer's ``r`` calibrated channels with per-token scale and offset; or, with
``label_layout="records"``, the same numbers interleaved into one record per
token, ``LabelRecords``).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from sparse_jax.calibration import select_channels
from sparse_jax.methods.registry import register
from sparse_jax.methods.sparse_base import SparseMethod
from sparse_jax.ops.scoring import (
    build_label_cache,
    interleave_labels,
    label_scores,
    update_label_cache,
)
from sparse_jax.selection import Selection


@register("double_sparsity")
@dataclasses.dataclass(frozen=True)
class DoubleSparsity(SparseMethod):
    """Top-``budget`` tokens by label scores over the whole context.

    Defaults from Double Sparsity / its SGLang backend: ``channels =
    head_dim // 4`` when 0 (16 of 64 for SmolLM2; DS uses 16-32 of 128), INT4
    labels, layers 0-1 dense, no sink or window. One measured departure: the
    channels are ranked by AsyncTLS's ``max|q| * max|k|`` rule
    (``ranking="maxabs"``), not SGLang's mean ``|q*k|`` (``ranking="qk"``).
    On SmolLM2 at 4K context and budget 1024, ``qk`` channels scored well
    below dense and ``maxabs`` channels close to it (README.md, 'Accuracy on
    SmolLM2-135M-Instruct'); ``ranking="qk"``
    reproduces the paper's setting. ``calibration_root`` overrides where
    calibrations live. ``channels_per_layer`` is filled by ``for_model`` from
    the calibration.
    """

    channels: int = 0
    ranking: str = "maxabs"
    dense_layers: tuple[int, ...] = (0, 1)
    calibration_root: str | None = None
    channels_per_layer: tuple | None = dataclasses.field(default=None, repr=False)
    #: "cache" (codes, scales and offsets in three arrays) or "records" (one interleaved
    #: record per token, ``pallas_kernels.labels.LabelRecords``: a scattered candidate
    #: costs one memory sector instead of three); the same selections
    label_layout: str = "cache"

    def for_model(self, model_name, *, num_layers, head_dim, sparse_layers=None):
        if self.channels_per_layer is not None:
            return self
        cpl = select_channels(model_name, num_layers, self.num_channels(head_dim), self.ranking, self.calibration_root)
        return dataclasses.replace(self, channels_per_layer=cpl)

    def check(self, *, num_q_heads, num_kv_heads, head_dim, max_len):
        super().check(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, max_len=max_len)
        r = self.num_channels(head_dim)
        if r % 2:
            raise ValueError(f"{self.name}: channels must be even (two INT4 labels per byte), got {r}")
        if self.label_layout not in ("cache", "records"):
            raise ValueError(f"{self.name}: label_layout must be 'cache' or 'records', got {self.label_layout!r}")
        if self.label_layout == "records" and r % 8:
            raise ValueError(f"{self.name}: label_layout='records' needs whole 32-bit words of INT4 codes "
                             f"(channels a multiple of 8), got {r}")
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

    def layer_data(self, index):
        return {"channels": np.asarray(self.channels_per_layer[index], np.int32)}

    # -- state ----------------------------------------------------------------
    def init_state(self, spec, *, batch, num_kv_heads, max_len, head_dim, dtype, num_q_heads=None):
        r = self.num_channels(head_dim)
        k = jnp.zeros((batch, num_kv_heads, max_len, head_dim), dtype)
        return self._laid_out(build_label_cache(k, jnp.zeros((num_kv_heads, r), jnp.int32), impl="reference"))

    def _laid_out(self, labels):
        """``labels`` in this method's ``label_layout``."""
        return interleave_labels(labels) if self.label_layout == "records" else labels

    def prefill_state(self, state, k, v, lengths, layer):
        return self._laid_out(build_label_cache(k, layer.data["channels"], impl=self.impl))

    def append_state(self, state, kv, positions, layer):
        return update_label_cache(state, kv.newest_keys(positions), layer.data["channels"], positions)

    def select(self, q, kv, lengths, state, carry, layer):
        scores = label_scores(q, state, layer.data["channels"], lengths=lengths, impl=self.impl)
        indices, counts = self.select_from_scores(scores, lengths)
        return Selection.tokens(indices, counts), state, carry
