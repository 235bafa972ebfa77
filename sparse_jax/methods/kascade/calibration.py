"""Kascade's calibration: anchor layers and the head map, and how they are chosen.

A calibration is, for one model, the list of **anchor layers** (model layer
indices; the first one is the dense anchor, layer 0 on a model whose layers
are all global) and the **head map** ``int32[L, Hkv]``: KV head ``h`` of a
reuse layer ``l`` reads the top-k of KV head ``head_map[l, h]`` of the most
recent anchor before it (anchor rows are the identity).

The statistics are Kascade's (Deshmukh et al., 2025, Sec. 3.3-3.5, and the
public ``stats_runner.py``): for a prompt and a top-k ``k``, the similarity of
(anchor ``a``, head ``h_a``) for (reuse layer ``b``, head ``h_b``) is the share
of ``b``'s oracle top-k attention mass that ``a``'s top-k recovers,
``sum P_b[I_a] / sum P_b[I_b]``, with ``P`` the post-softmax probabilities
summed over the GQA group; it is the **minimum over the prompt's query tiles**
(conservative: the worst tile decides), then the **mean over prompts**. A layer
pair's score is ``max_{h_a} mean_{h_b}`` of it, weighted by the importance of
the reuse layer, ``1 - cos(h_in, h_in + attn_out)`` on the residual stream.
The anchors come from the paper's dynamic programme (:func:`choose_anchors`,
the first layer forced), the head map from the argmax over anchor heads.

The numbers are computed by ``python -m models.cli.kascade_calibrate`` (it runs a
model) and stored as JSON under ``CALIBRATION_ROOT/<model>/kascade.json``;
this module never imports ``models``.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np

from sparse_jax.calibration import CALIBRATION_ROOT

FILE_NAME = "kascade.json"


def calibration_path(model_name: str, root: Path | str | None = None) -> Path:
    return Path(root or CALIBRATION_ROOT) / model_name / FILE_NAME


@functools.cache
def load_kascade_calibration(model_name: str, root: str | None = None) -> dict | None:
    """``{"anchors": [...], "head_map": [[...]] (L x Hkv), ...}`` or None when the
    model has no shipped calibration."""
    path = calibration_path(model_name, root)
    if not path.exists():
        return None
    return json.loads(path.read_text())


def save_kascade_calibration(model_name: str, data: dict, root=None) -> Path:
    path = calibration_path(model_name, root)
    path.parent.mkdir(parents=True, exist_ok=True)
    # one line per key: the matrices stay compact, the keys readable in a diff
    path.write_text("{\n" + ",\n".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in data.items()) + "\n}\n")
    load_kascade_calibration.cache_clear()
    return path


def fallback_anchors(num_layers: int, num_anchors: int = 5) -> tuple[int, ...]:
    """Anchors without a calibration: ``num_anchors`` (the paper uses 5 of 32 and
    of 36) spread evenly from layer 0, denser at the start as the paper's
    calibrated lists are (Llama-3.1-8B [0,2,8,13,14], Qwen3-8B [0,2,7,14,23]):
    layer 0, layer 2, then even steps over the rest."""
    if num_layers <= num_anchors:
        return tuple(range(num_layers))
    rest = np.linspace(2, num_layers, num_anchors - 1, endpoint=False).round().astype(int)
    return tuple(sorted({0, *map(int, rest)}))


# -----------------------------------------------------------------------------
# Statistics (NumPy, float64): fed per prompt by the calibration CLI
# -----------------------------------------------------------------------------


def group_probs_per_query(q: np.ndarray, k: np.ndarray, scale: float) -> np.ndarray:
    """Causal post-softmax probabilities summed over each GQA group.

    ``q [T, Hq, D]``, ``k [T, Hkv, D]`` (one prompt, post-RoPE) -> ``[Hkv, T, T]``
    (query row t, key column s, zero for s > t)."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    qg = q.reshape(t, hkv, hq // hkv, d).astype(np.float64)
    logits = np.einsum("thgd,shd->hgts", qg, k.astype(np.float64)) * scale
    mask = np.tril(np.ones((t, t), bool))
    logits = np.where(mask, logits, -np.inf)
    logits -= logits.max(-1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(-1, keepdims=True)
    return p.sum(axis=1)


def topk_masks(p: np.ndarray, k: int) -> np.ndarray:
    """``bool[Hkv, T, T]``: each query row's top-``k`` keys (all of them where
    the row has at most ``k``)."""
    hkv, t, _ = p.shape
    kk = min(k, t)
    idx = np.argpartition(-p, kk - 1, axis=-1)[..., :kk]
    m = np.zeros(p.shape, bool)
    np.put_along_axis(m, idx, True, axis=-1)
    return m & np.tril(np.ones((t, t), bool))


def prompt_similarity(probs: list[np.ndarray], k: int, tile: int, first_query: int) -> np.ndarray:
    """One prompt's head-level similarity ``[L, L, Hkv_b, Hkv_a]`` (``a`` anchor,
    ``b`` reuse; entries for ``a >= b`` are 1): per query tile the mean over its
    queries of ``sum P_b[I_a] / sum P_b[I_b]``, then the minimum over tiles.
    Queries before ``first_query`` (rows whose whole context fits in ``k``:
    trivially 1) are skipped."""
    nl = len(probs)
    hkv, t, _ = probs[0].shape
    masks = [topk_masks(p, k) for p in probs]
    rows = np.arange(first_query, t)
    tiles = [rows[i:i + tile] for i in range(0, len(rows), tile)]
    sim = np.ones((nl, nl, hkv, hkv))
    for b in range(nl):
        own = (probs[b] * masks[b]).sum(-1)  # [Hkv_b, T]
        own = np.where(own > 0, own, 1.0)
        for a in range(b):
            # mass of (b, h_b) on (a, h_a)'s top-k: [Hkv_b, Hkv_a, T]
            got = np.einsum("bts,ats->bat", probs[b], masks[a].astype(np.float64))
            ratio = got / own[:, None, :]
            per_tile = np.stack([ratio[..., tl].mean(-1) for tl in tiles], -1)
            sim[b, a] = per_tile.min(-1)
    return sim.transpose(1, 0, 2, 3)  # [a, b, h_b, h_a]


def importance(x_in: np.ndarray, x_out: np.ndarray) -> float:
    """``1 - cos(x_in, x_in + attn_out)`` averaged over tokens: ``x_* [T, H]``."""
    a, b = x_in.astype(np.float64), x_out.astype(np.float64)
    cos = (a * b).sum(-1) / np.maximum(np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1), 1e-30)
    return float(np.mean(1.0 - cos))


def layer_scores(sim: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``S[a, b] = mean_{h_b} max_{h_a} sim[a, b, h_b, h_a] * w_b`` and the head map
    argmax ``[a, b, h_b] -> h_a``. ``sim [L, L, Hkv, Hkv]``, ``weights [L]``.

    Each reuse head is scored by the anchor head the map gives it, then the heads are averaged,
    as ``microsoft/kascade``'s ``StatsRunner._process_select_layers`` does (``amax`` over the
    anchor's heads, then ``mean`` over the reuse layer's). Before 2026-12-06 the order was the
    other one (the mean over reuse heads of one anchor head's similarity, the best such head):
    the score of a single shared anchor head, below the mapped one wherever a layer's heads
    prefer different anchor heads."""
    score = sim.max(axis=-1).mean(axis=2) * weights[None, :]
    head = sim.argmax(axis=-1)
    return score, head


def choose_anchors(score: np.ndarray, num_anchors: int, layers: list[int] | None = None) -> list[int]:
    """The paper's DP (Alg. 1): ``num_anchors`` anchors among ``layers`` (default
    all) maximising the sum over every layer of the score of its most recent
    anchor, the first layer forced. ``score [L, L]`` (``score[a, b]``, a <= b)."""
    layers = list(range(score.shape[0])) if layers is None else list(layers)
    n = len(layers)
    m = min(num_anchors, n)
    # seg[i][j]: layers i..j-1 (positions in ``layers``) all reuse anchor i
    seg = np.zeros((n + 1, n + 1))
    for i in range(n):
        acc = 0.0
        for j in range(i + 1, n + 1):
            acc += score[layers[i], layers[j - 1]]
            seg[i, j] = acc
    neg = -np.inf
    dp = np.full((m + 1, n + 1), neg)  # dp[c][j]: c anchors cover layers 0..j-1, the last segment ends at j
    arg = np.zeros((m + 1, n + 1), int)
    for j in range(1, n + 1):
        dp[1, j] = seg[0, j]
    for c in range(2, m + 1):
        for j in range(c, n + 1):
            cand = [dp[c - 1, i] + seg[i, j] for i in range(c - 1, j)]
            best = int(np.argmax(cand))
            dp[c, j], arg[c, j] = cand[best], best + c - 1
    # backtrack from all n layers covered with m anchors
    out, c, j = [], m, n
    while c > 1:
        i = arg[c, j]
        out.append(i)
        j, c = i, c - 1
    out.append(0)
    return sorted(layers[i] for i in out)


def head_map_for(anchors: list[int], heads: np.ndarray, num_layers: int, num_kv_heads: int,
                 layers: list[int] | None = None) -> np.ndarray:
    """``int32[L, Hkv]``: identity on anchors and on layers outside ``layers``;
    reuse layer ``b`` reads ``heads[a, b]`` of its most recent anchor ``a``."""
    hm = np.tile(np.arange(num_kv_heads, dtype=np.int32), (num_layers, 1))
    layers = list(range(num_layers)) if layers is None else list(layers)
    for b in layers:
        prev = [a for a in anchors if a <= b]
        if prev and prev[-1] != b:
            hm[b] = heads[prev[-1], b]
    return hm


def anchors_from_calibration(cal: dict, num_anchors: int) -> tuple[tuple[int, ...], np.ndarray]:
    """Anchors and head map ``int32[L, Hkv]`` for ``num_anchors`` anchors from a stored
    calibration (its layer scores and best heads: the DP rerun, no model needed)."""
    if "layer_score" not in cal or "heads" not in cal:
        raise ValueError("this Kascade calibration stores no layer scores and heads: rerun "
                         "python -m models.cli.kascade_calibrate to choose another number of anchors")
    layers = list(cal["layers"])
    pos = choose_anchors(np.asarray(cal["layer_score"], np.float64), num_anchors)
    anchors = [layers[i] for i in pos]
    heads = np.asarray(cal["heads"], np.int64)
    nl, _, hkv = heads.shape
    return tuple(anchors), head_map_for(anchors, heads, nl, hkv, layers)
