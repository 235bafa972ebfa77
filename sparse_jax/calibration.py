"""Calibrated channel orders for label-based selection (Double Sparsity, AsyncTLS).

A calibration is, per layer and KV head, the head-dim channels ordered from
most to least important for approximating ``q . k``; a method keeps the first
``r``. Two rankings are stored, both aggregated over every calibration token
(Double Sparsity's reference script ranks by its last batch only, a bug we do
not copy):

* ``qk``: mean over tokens and the GQA group of ``|q_h[i] * k[i]|`` (post-RoPE),
  Double Sparsity's (and SGLang's) default.
* ``maxabs``: ``mean_h max|q_h[i]| * max|k[i]|``, AsyncTLS's rule (Sec. 4.1).

They are saved with orbax under ``CALIBRATION_ROOT/<model>/channels`` by
``python -m models.cli.calibrate --model <model> --method double_sparsity``.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np

CALIBRATION_ROOT = Path(__file__).resolve().parent / "calibration_data"
RANKINGS = ("qk", "maxabs")


class ChannelStats:
    """Running per-layer channel statistics over calibration batches."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int):
        self.qk_sum = np.zeros((num_layers, num_kv_heads, head_dim), np.float64)
        self.q_max = None
        self.k_max = np.zeros((num_layers, num_kv_heads, head_dim), np.float64)
        self.tokens = 0

    def add(self, layer: int, q: np.ndarray, k: np.ndarray) -> None:
        """``q [N, Hq, D]``, ``k [N, Hkv, D]`` post-RoPE for N valid tokens."""
        n, hq, d = q.shape
        hkv = k.shape[1]
        qg = np.abs(q.astype(np.float64)).reshape(n, hkv, hq // hkv, d)
        ka = np.abs(k.astype(np.float64))
        self.qk_sum[layer] += np.einsum("nhgd,nhd->hd", qg, ka)
        if self.q_max is None:
            self.q_max = np.zeros((self.qk_sum.shape[0], hkv, hq // hkv, d))
        self.q_max[layer] = np.maximum(self.q_max[layer], qg.max(axis=0))
        self.k_max[layer] = np.maximum(self.k_max[layer], ka.max(axis=0))
        if layer == 0:
            self.tokens += n

    def orders(self) -> dict[str, np.ndarray]:
        """Channel orders ``int32[L, Hkv, D]``, most important first."""
        maxabs = self.q_max.mean(axis=2) * self.k_max
        return {
            "qk": np.argsort(-self.qk_sum, axis=-1, kind="stable").astype(np.int32),
            "maxabs": np.argsort(-maxabs, axis=-1, kind="stable").astype(np.int32),
        }


def calibration_dir(model_name: str, root: Path | str | None = None) -> Path:
    return Path(root or CALIBRATION_ROOT) / model_name / "channels"


def save_channel_orders(model_name: str, orders: dict[str, np.ndarray], meta: dict, root=None) -> Path:
    import orbax.checkpoint as ocp

    path = calibration_dir(model_name, root).absolute()
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(path, {name: np.asarray(orders[name], np.int32) for name in RANKINGS}, force=True)
    (path.parent / "channels.json").write_text(json.dumps(meta, indent=1))
    load_channel_orders.cache_clear()
    return path


@functools.cache
def load_channel_orders(model_name: str, root: str | None = None) -> dict[str, np.ndarray]:
    path = calibration_dir(model_name, root).absolute()
    if not path.exists():
        raise FileNotFoundError(
            f"no channel calibration for model {model_name!r} at {path}; create it with:\n"
            f"  python -m models.cli.calibrate --model {model_name} --method double_sparsity"
        )
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as ckpt:
        restored = ckpt.restore(path)
    return {name: np.asarray(restored[name], np.int32) for name in RANKINGS}


def select_channels(model_name: str, num_layers: int, r: int, ranking: str, root=None) -> tuple:
    """The first ``r`` channels per layer and KV head, sorted, as nested tuples
    ``[L][Hkv][r]`` (hashable, so a frozen method can hold them as static data)."""
    if ranking not in RANKINGS:
        raise ValueError(f"ranking must be one of {RANKINGS}, got {ranking!r}")
    order = load_channel_orders(model_name, None if root is None else str(root))[ranking]
    if order.shape[0] != num_layers:
        raise ValueError(f"calibration for {model_name!r} has {order.shape[0]} layers, the model {num_layers}")
    if not 0 < r <= order.shape[-1]:
        raise ValueError(f"channels ({r}) must be in [1, {order.shape[-1]}]")
    chosen = np.sort(order[..., :r], axis=-1)
    return tuple(tuple(tuple(int(c) for c in head) for head in layer) for layer in chosen)
