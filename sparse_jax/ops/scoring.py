"""Public scoring ops: Quest/ArkVale block metadata and scores, Double-Sparsity labels.

Each op checks its arguments on shapes and dtypes (so bad input fails before
any compilation) and dispatches between the Pallas-Triton kernel and the
pure-jnp reference through ``impl`` ("auto" | "pallas" | "reference", see
``sparse_jax.ops._dispatch``). Layouts (head-major cache, ragged batch):

* ``block_minmax(k, lengths, *, block_size)`` -> ``(k_max, k_min)``
  ``[B, Hkv, NB, D]`` in k's dtype, ``NB = ceil(S / block_size)``. Tokens at or
  past ``lengths[b]`` are excluded; a block without a valid token is all
  zeros, so callers must mask blocks ``>= ceil(lengths[b] / block_size)``.
* ``update_block_minmax(k_max, k_min, k_new, positions, *, block_size)``:
  Quest's per-append update (``k_new [B, Hkv, D]`` written at ``positions[b]``).
* ``block_cuboid(k, lengths, *, block_size)`` -> ``(upper, lower)``: ArkVale's
  box, centre ``(max+min)/2`` +- mean ``|centre - k|``; score it with
  ``quest_block_scores``.
* ``quest_block_scores(q [B, Hq, D], k_max, k_min, group_reduce="sum"|"max")`` -> ``float32[B, Hkv, NB]``.
* ``quantize_block_boxes(k_max, k_min, lengths, *, block_size)`` -> ``QuantizedBoxes`` (8-bit
  codes over each channel's range, half bf16's bytes; still a bound);
  ``update_quantized_block_boxes(boxes, k_new, positions, *, block_size)``;
  ``quest_block_scores_quantized(q, boxes, group_reduce=...)`` -> ``float32[B, Hkv, NB]``.
* ``build_label_cache(k, channels [Hkv, r], *, bits=4)`` -> ``LabelCache``;
  ``update_label_cache(cache, k_new, channels, positions, *, bits=4)``;
  ``dequantize_labels(cache, *, bits=4)`` -> ``float32[B, Hkv, S, r]``.
* ``label_scores(q, labels, channels, candidates=None, counts=None, *, lengths=None, scale=None, bits=4)``
  -> ``float32[B, Hkv, C]``: softmax over the candidate set of the label
  logits of each query head, averaged over the GQA group; masked entries are 0.
* ``block_label_scores(q, labels, channels, block_ids, block_counts, lengths, *, block_size)``
  -> ``float32[B, Hkv, NBsel * block_size]``: the same over the tokens of
  selected blocks (in block-slot order), without a candidate array.
* ``block_label_topk(q, labels, channels, block_ids, block_counts, lengths, *, block_size, k)``
  -> ``(positions int32[B, Hkv, k], counts int32[B, Hkv])``: the k best of those tokens
  (AsyncTLS's second level; ``fused=True``: normalization, selection and token map in one kernel).

The kernels and their contracts are documented in ``pallas_kernels.block_scores``
and ``pallas_kernels.labels``. The kernels need power-of-two ``block_size``,
``D`` and packed label width ``r * bits // 8``; "auto" falls back to the
reference otherwise (and on CPU), "pallas" raises.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import block_scores as _bs
from pallas_kernels import group_softmax as _gs
from pallas_kernels import label_topk as _ltk
from pallas_kernels import labels as _lb
from pallas_kernels import quantized_boxes as _qb
from pallas_kernels.labels import SUPPORTED_BITS, LabelCache, LabelRecords, dequantize_labels, interleave_labels
from pallas_kernels.quantized_boxes import QuantizedBoxes
from pallas_kernels.tuning import with_tuned
from sparse_jax.ops._checks import check_float, check_gqa, check_int, check_int_array, check_rank, check_shape
from sparse_jax.ops._dispatch import resolve_impl
from sparse_jax.ops.selection import topk_indices  # selection does not import scoring

__all__ = [
    "LabelCache",
    "LabelRecords",
    "interleave_labels",
    "block_minmax",
    "update_block_minmax",
    "block_cuboid",
    "quest_block_scores",
    "QuantizedBoxes",
    "quantize_block_boxes",
    "update_quantized_block_boxes",
    "quest_block_scores_quantized",
    "build_label_cache",
    "update_label_cache",
    "dequantize_labels",
    "label_scores",
    "block_label_scores",
    "block_label_topk",
]


# ----------------------------------------------------------------------------
# Checks
# ----------------------------------------------------------------------------


def _check_block_size(block_size) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")


def _check_cache(k, lengths) -> None:
    check_rank("k", k, 4, "[B, Hkv, S, D]")
    check_float("k", k)
    check_int_array("lengths", lengths, (k.shape[0],), "[B]")
    if k.shape[2] == 0:
        raise ValueError("k must have at least one position (S >= 1)")


def _concrete(x):
    """x as a NumPy array, or None when it is traced (its values are unknown)."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def _check_channels(channels, num_kv_heads: int, head_dim: int, bits: int) -> None:
    check_rank("channels", channels, 2, "[Hkv, r]")
    check_int("channels", channels)
    hkv, r = channels.shape
    if hkv != num_kv_heads:
        raise ValueError(f"channels must have shape [Hkv={num_kv_heads}, r], got {tuple(channels.shape)}")
    if r <= 0 or r % 2:
        raise ValueError(f"the number of label channels r must be even and positive, got r={r}")
    if (r * bits) % 8:
        raise ValueError(f"r={r} channels of {bits} bits do not fill whole bytes (r * bits % 8 != 0)")
    values = _concrete(channels)
    if values is not None and values.size and (values.min() < 0 or values.max() >= head_dim):
        raise ValueError(
            f"channels must lie in [0, D={head_dim}), got values in [{values.min()}, {values.max()}]")


def _check_bits(bits) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits!r}")


def _check_labels(labels) -> tuple:
    """``(B, Hkv, S, W)`` of a label cache (``W`` None for records: it depends on ``r``
    and ``bits``, checked by ``pallas_kernels.labels.label_dims``)."""
    if isinstance(labels, LabelRecords):
        check_rank("labels.words", labels.words, 4, "[B, Hkv, S, Wr]")
        if labels.words.dtype != np.int32:
            raise TypeError(f"labels.words must be int32, got {labels.words.dtype}")
        return labels.words.shape[:3] + (None,)
    if not isinstance(labels, LabelCache):
        raise TypeError(f"labels must be a LabelCache or LabelRecords, got {type(labels).__name__}")
    check_rank("labels.packed", labels.packed, 4, "[B, Hkv, S, r*bits//8]")
    if labels.packed.dtype != np.uint8:
        raise TypeError(f"labels.packed must be uint8, got {labels.packed.dtype}")
    lb, lh, s, _ = labels.packed.shape
    for name in ("scale", "offset"):
        x = getattr(labels, name)
        check_rank(f"labels.{name}", x, 3, "[B, Hkv, S]")
        check_shape(f"labels.{name}", x, (lb, lh, s), "[B, Hkv, S]")
        if x.dtype != np.float32:
            raise TypeError(f"labels.{name} must be float32, got {x.dtype}")
    return labels.packed.shape


def _pow2_reason(**dims) -> str | None:
    bad = [f"{k}={v}" for k, v in dims.items() if not _bs.is_pow2(int(v))]
    return None if not bad else "the Triton kernel needs powers of two: " + ", ".join(bad)


# ----------------------------------------------------------------------------
# Block metadata and Quest scores
# ----------------------------------------------------------------------------


def block_minmax(k, lengths, *, block_size, impl="auto", blocks_per_program=None, num_warps=4,
                 num_stages=2):
    """Per-block channel-wise ``(k_max, k_min)`` over valid tokens, ``[B, Hkv, NB, D]``.

    Empty blocks (no token below ``lengths[b]``) are zeros: mask blocks
    ``>= ceil(lengths[b] / block_size)`` before selecting. Tuning (kernel only):
    ``blocks_per_program`` (power of two; default ~128 tokens per program),
    ``num_warps``, ``num_stages``.
    """
    return _block_summary(k, lengths, block_size, "minmax", impl, blocks_per_program, num_warps, num_stages)


def _block_summary(k, lengths, block_size, mode, impl, blocks_per_program, num_warps, num_stages):
    """Checks and dispatch shared by ``block_minmax`` and ``block_cuboid`` (one kernel, two modes)."""
    _check_cache(k, lengths)
    _check_block_size(block_size)
    choice, interpret = resolve_impl(
        impl, kernel_unsupported=_pow2_reason(block_size=block_size, head_dim=k.shape[-1]))
    if choice == "reference":
        reference = _bs.block_minmax_reference if mode == "minmax" else _bs.block_cuboid_reference
        return reference(k, lengths, block_size=block_size)
    return _bs.block_summary_kernel(
        k, lengths, block_size=block_size, mode=mode, blocks_per_program=blocks_per_program,
        num_warps=num_warps, num_stages=num_stages, interpret=interpret)


def update_block_minmax(k_max, k_min, k_new, positions, *, block_size):
    """Quest's per-append update of the block metadata (pure jnp).

    ``k_new [B, Hkv, D]`` is the key just written at ``positions[b]`` (the row's
    length before the append). A position that opens a block resets that
    block to ``k_new``; otherwise the block's max/min absorb it. Positions
    outside ``[0, NB * block_size)`` change nothing.
    """
    check_rank("k_max", k_max, 4, "[B, Hkv, NB, D]")
    check_float("k_max", k_max)
    check_shape("k_min", k_min, k_max.shape, "[B, Hkv, NB, D]")
    check_float("k_min", k_min)
    b, hkv, _, d = k_max.shape
    check_rank("k_new", k_new, 3, "[B, Hkv, D]")
    check_float("k_new", k_new)
    check_shape("k_new", k_new, (b, hkv, d), "[B, Hkv, D]")
    check_int_array("positions", positions, (b,), "[B]")
    _check_block_size(block_size)
    return _bs.update_block_minmax_reference(k_max, k_min, k_new, positions, block_size=block_size)


def block_cuboid(k, lengths, *, block_size, impl="auto", blocks_per_program=None, num_warps=4,
                 num_stages=2):
    """ArkVale's block box ``(upper, lower) = centre +- radius``, ``[B, Hkv, NB, D]``.

    ``centre = (max + min) / 2`` and ``radius = mean |centre - k|`` per channel
    over the block's valid tokens; empty blocks are zeros. Scored with
    ``quest_block_scores`` (an estimate, not a bound). The kernel is the
    ``block_minmax`` kernel with a second reduction over the tile it already
    holds, so it reads ``k`` once; same tuning knobs.
    """
    return _block_summary(k, lengths, block_size, "cuboid", impl, blocks_per_program, num_warps, num_stages)


GROUP_REDUCTIONS = ("sum", "max")


def quest_block_scores(q, k_max, k_min, *, group_reduce="sum", impl="auto", block_n=None, num_warps=None,
                       num_stages=None):
    """Quest upper bound per block, reduced over the GQA group: ``float32[B, Hkv, NB]``.

    Each query head's bound is ``max(q_g, 0) . k_max + min(q_g, 0) . k_min``;
    ``group_reduce="sum"`` (default) adds the group's (one kernel: the group's positive
    and negative parts are summed first), ``"max"`` keeps the largest, so a block any
    one head wants ranks high (on Gemma 3, four query heads per KV head, the sum let
    three heads outvote the one reading a retrieval needle: ``docs/methods.md``); the
    kernel forms each head's bound over the tiles it reads once. Tuning (kernel
    only; None = the tuned table's entry for this shape class on the GPU, else
    64 / 4 / 2): ``block_n`` (blocks per program, power of two), ``num_warps``,
    ``num_stages``.
    """
    check_rank("k_max", k_max, 4, "[B, Hkv, NB, D]")
    check_float("k_max", k_max)
    check_shape("k_min", k_min, k_max.shape, "[B, Hkv, NB, D]")
    check_float("k_min", k_min)
    b, hkv, _, d = k_max.shape
    reduce, choice, interpret = _check_quest_args(q, k_max.shape, group_reduce, impl, block_n, num_warps, num_stages)
    g = q.shape[1] // hkv
    if choice == "reference":
        if reduce == "max":  # every query head its own group, then the max
            per_head = _bs.quest_block_scores_reference(q, jnp.repeat(k_max, g, axis=1), jnp.repeat(k_min, g, axis=1))
            return per_head.reshape(b, hkv, g, -1).max(2)
        return _bs.quest_block_scores_reference(q, k_max, k_min)
    tuning = _quest_tuning("quest_block_scores", q, k_max.shape, interpret, block_n, num_warps, num_stages)
    return _bs.quest_block_scores_kernel(q, k_max, k_min, interpret=interpret, reduce=reduce, **tuning)


def _check_quest_args(q, box_shape, group_reduce, impl, block_n, num_warps, num_stages, tiles=None):
    """Checks shared by the Quest scores on exact and on 8-bit boxes ``box_shape (B, Hkv, NB, D)``:
    ``(reduce, choice, interpret)``. A group of one reduces by "sum" (the same thing, one kernel)."""
    if group_reduce not in GROUP_REDUCTIONS:
        raise ValueError(f"group_reduce must be one of {GROUP_REDUCTIONS}, got {group_reduce!r}")
    check_rank("q", q, 3, "[B, Hq, D]")
    check_float("q", q)
    b, hkv, _, d = box_shape
    if q.shape[0] != b or q.shape[2] != d:
        raise ValueError(f"q must have shape [B={b}, Hq, D={d}], got {tuple(q.shape)}")
    check_gqa(q.shape[1], hkv)
    for name, v in (("block_n", block_n), ("num_warps", num_warps), ("num_stages", num_stages), ("tiles", tiles)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
            raise ValueError(f"{name} must be a positive int or None, got {v!r}")
    reduce = "max" if group_reduce == "max" and q.shape[1] // hkv > 1 else "sum"
    choice, interpret = resolve_impl(
        impl, kernel_unsupported=_pow2_reason(head_dim=d, **({} if block_n is None else {"block_n": block_n})))
    return reduce, choice, interpret


def _quest_tuning(kernel, q, box_shape, interpret, block_n, num_warps, num_stages, **modes) -> dict:
    """The caller's knobs over the tuned table's entry (GPU only) over the defaults 64 / 4 / 2
    (and, for the 8-bit kernel, ``mode``, ``prep`` and ``tiles`` over their ``default_*``)."""
    b, hkv, nb, d = box_shape
    defaults = {"block_n": 64, "num_warps": 4, "num_stages": 2}
    tuning = dict(block_n=block_n, num_warps=num_warps, num_stages=num_stages)
    for knob in ("mode", "prep", "tiles"):
        if knob in modes:
            defaults[knob] = modes[f"default_{knob}"]
            tuning[knob] = modes[knob]
    if not interpret:
        tuning = with_tuned(tuning, kernel, rows=b * hkv, nb=nb, d=d, g=q.shape[1] // hkv)
    return {**defaults, **{k: v for k, v in tuning.items() if v is not None}}


def _check_quantized_boxes(boxes) -> tuple:
    """``(B, Hkv, NB, D)`` of a :class:`QuantizedBoxes`, or a clear error."""
    if not isinstance(boxes, QuantizedBoxes):
        raise TypeError(f"boxes must be a QuantizedBoxes (quantize_block_boxes), got {type(boxes).__name__}")
    check_rank("boxes.upper", boxes.upper, 4, "[B, Hkv, NB, D]")
    if boxes.upper.dtype != jnp.int8 or boxes.lower.dtype != jnp.int8:
        raise TypeError(f"boxes.upper/lower must be int8 codes (code - 128), got {boxes.upper.dtype}/{boxes.lower.dtype}")
    b, hkv, nb, d = boxes.upper.shape
    check_shape("boxes.lower", boxes.lower, (b, hkv, nb, d), "[B, Hkv, NB, D]")
    for name in ("base", "step"):
        check_shape(f"boxes.{name}", getattr(boxes, name), (b, hkv, d), "[B, Hkv, D]")
    for name in ("upper_slack", "lower_slack"):
        check_shape(f"boxes.{name}", getattr(boxes, name), (b, hkv, nb), "[B, Hkv, NB]")
    return b, hkv, nb, d


def quantize_block_boxes(k_max, k_min, lengths, *, block_size):
    """Exact block boxes ``k_max, k_min [B, Hkv, NB, D]`` (``block_minmax``'s, rows holding
    ``lengths int32[B]`` tokens) as 8-bit :class:`QuantizedBoxes`: codes over each
    (b, kv head, channel)'s range across the row's blocks, the max rounded up and the min
    down, plus a per-block slack, so Quest's bound on them is still a bound (looser by
    about one step a channel). Half the bytes of bf16 boxes for the filter to read.
    The range is fixed here; :func:`update_quantized_block_boxes` clips a key past it
    into the slack. Pure jnp (it runs once per prompt)."""
    check_rank("k_max", k_max, 4, "[B, Hkv, NB, D]")
    check_float("k_max", k_max)
    check_shape("k_min", k_min, k_max.shape, "[B, Hkv, NB, D]")
    check_float("k_min", k_min)
    check_int_array("lengths", lengths, (k_max.shape[0],), "[B]")
    _check_block_size(block_size)
    return _qb.quantize_boxes_reference(k_max, k_min, lengths, block_size=block_size)


def update_quantized_block_boxes(boxes, k_new, positions, *, block_size):
    """Fold one appended key per row (``k_new [B, Hkv, D]`` written at ``positions[b]``)
    into 8-bit boxes: the integer max/min of the codes, so the result is what quantizing
    the updated exact boxes over the same range gives. Pure jnp."""
    b, hkv, _, d = _check_quantized_boxes(boxes)
    check_rank("k_new", k_new, 3, "[B, Hkv, D]")
    check_float("k_new", k_new)
    check_shape("k_new", k_new, (b, hkv, d), "[B, Hkv, D]")
    check_int_array("positions", positions, (b,), "[B]")
    _check_block_size(block_size)
    return _qb.update_quantized_boxes_reference(boxes, k_new, positions, block_size=block_size)


#: the 8-bit Quest kernel's mode where the tuned table names none (the H200's fastest, 2026-11-28)
Q8_DEFAULT_MODE = "imma"


def quest_block_scores_quantized(q, boxes, *, group_reduce="sum", impl="auto", block_n=None, num_warps=None,
                                 num_stages=None, mode=None, prep=None, tiles=None):
    """:func:`quest_block_scores` on 8-bit :class:`QuantizedBoxes`: ``float32[B, Hkv, NB]``,
    each at least the exact boxes' bound (``pallas_kernels.quantized_boxes``). Same
    ``group_reduce`` and tuning knobs (tuned-table class ``quest_block_scores_q8``), and
    ``mode``: "fma", "dot" (bf16 tensor cores) or "imma" (int8 tensor cores; default: the
    table's, else "imma"; a group of more than 16 heads or a tile under 16 runs "fma"), and for
    the tensor-core modes ``prep``: where the query side is made, "program" (in every program)
    or "kernel" (once per batch row and KV head, in a small kernel before; default: the table's, else
    "program"), and ``tiles``: tiles of ``block_n`` blocks each program loops over (default: the
    table's, else 1)."""
    shape = _check_quantized_boxes(boxes)
    if mode not in (None, "fma", "dot", "imma"):
        raise ValueError(f"mode must be 'fma', 'dot', 'imma' or None, got {mode!r}")
    if prep is not None and prep not in _qb.PREPS:
        raise ValueError(f"prep must be one of {_qb.PREPS} or None, got {prep!r}")
    reduce, choice, interpret = _check_quest_args(q, shape, group_reduce, impl, block_n, num_warps, num_stages,
                                                  tiles)
    if choice == "reference":
        return _qb.quest_block_scores_quantized_reference(q, boxes, reduce=reduce)
    tuning = _quest_tuning("quest_block_scores_q8", q, shape, interpret, block_n, num_warps, num_stages,
                           mode=mode, default_mode=Q8_DEFAULT_MODE, prep=prep, default_prep="program",
                           tiles=tiles, default_tiles=1)
    if q.shape[1] // shape[1] > _qb.DOT_COLS or tuning["block_n"] < 16 or shape[3] < 16:
        tuning["mode"] = "fma"  # the tensor-core forms need N = 16 columns and 16-row tiles
    elif tuning["mode"] == "imma" and shape[3] % 32:
        tuning["mode"] = "dot"  # int8 MMA steps D by 32
    return _qb.quest_block_scores_quantized_kernel(q, boxes, interpret=interpret, reduce=reduce, **tuning)



# ----------------------------------------------------------------------------
# Double-Sparsity labels
# ----------------------------------------------------------------------------


def build_label_cache(k, channels, *, bits=4, impl="auto", block_s=128, num_warps=4, num_stages=2):
    """Quantized labels of ``k[..., channels]`` for every position: a ``LabelCache``.

    ``packed uint8[B, Hkv, S, r*bits//8]`` (INT4: even channel in the low
    nibble), ``scale``/``offset`` ``float32[B, Hkv, S]``; asymmetric per-token
    quantization, ``|k - dequant| <= scale / 2``. Tuning (kernel only):
    ``block_s`` tokens per program, ``num_warps``, ``num_stages``.
    """
    check_rank("k", k, 4, "[B, Hkv, S, D]")
    check_float("k", k)
    _check_bits(bits)
    _check_channels(channels, k.shape[1], k.shape[3], bits)
    r = channels.shape[1]
    choice, interpret = resolve_impl(
        impl, kernel_unsupported=_pow2_reason(packed_width=r * bits // 8, block_s=block_s))
    if choice == "reference":
        return _lb.build_label_cache_reference(k, channels, bits=bits)
    return _lb.build_label_cache_kernel(k, channels, bits=bits, block_s=block_s,
                                        num_warps=num_warps, num_stages=num_stages,
                                        interpret=interpret)


def update_label_cache(cache, k_new, channels, positions, *, bits=4):
    """Write the labels of one appended key per row (``k_new [B, Hkv, D]``) at
    ``positions[b]``; positions outside ``[0, S)`` change nothing. Pure jnp.
    ``bits`` must be the width the cache was built with. ``cache``: a ``LabelCache``
    or ``LabelRecords`` (returned in the same layout)."""
    b, hkv, _, w = _check_labels(cache)
    check_rank("k_new", k_new, 3, "[B, Hkv, D]")
    check_float("k_new", k_new)
    if tuple(k_new.shape[:2]) != (b, hkv):
        raise ValueError(f"k_new must have shape [B={b}, Hkv={hkv}, D], got {tuple(k_new.shape)}")
    _check_bits(bits)
    _check_channels(channels, hkv, k_new.shape[2], bits)
    check_int_array("positions", positions, (b,), "[B]")
    if w is None:
        return _lb.update_label_records_reference(cache, k_new, channels, positions, bits=bits)
    _lb.check_packed_width(w, channels.shape[1], bits)
    return _lb.update_label_cache_reference(cache, k_new, channels, positions, bits=bits)


def _check_tuning(block_c, num_warps, num_stages, splits, prefetch, mode, q_prep=None, hoist_q=None,
                  head_split=None, group=None) -> None:
    for name, v in (("block_c", block_c), ("num_warps", num_warps), ("num_stages", num_stages),
                    ("splits", splits)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0):
            raise ValueError(f"{name} must be a positive int or None, got {v!r}")
    if prefetch is not None and (isinstance(prefetch, bool) or not isinstance(prefetch, (int, np.integer))
                                 or prefetch < 0):
        raise ValueError(f"prefetch must be a non-negative int or None, got {prefetch!r}")
    if mode is not None and mode not in _lb.MODES:
        raise ValueError(f"mode must be one of {_lb.MODES} or None, got {mode!r}")
    if q_prep is not None and q_prep not in _lb.Q_PREPS:
        raise ValueError(f"q_prep must be one of {_lb.Q_PREPS} or None, got {q_prep!r}")
    if q_prep == "kernel" and (hoist_q is False or mode == "per_tile"):
        raise ValueError("q_prep='kernel' gathers the query into registers once a program: it needs "
                         "hoist_q (not False) and a looped mode (not 'per_tile')")
    if head_split is not None:
        _lb.check_head_split(head_split, group, mode)


def _check_scores_args(q, labels, channels, lengths, scale, bits):
    check_rank("q", q, 3, "[B, Hq, D]")
    check_float("q", q)
    b, hq, d = q.shape
    lb, hkv, _, w = _check_labels(labels)
    if lb != b:
        raise ValueError(f"labels are for batch {lb}, q for batch {b}")
    check_gqa(hq, hkv)
    _check_bits(bits)
    _check_channels(channels, hkv, d, bits)
    if w is None:  # records: their width follows from r and bits
        w = _lb.label_dims(labels, channels.shape[1], bits)[3]
    _lb.check_packed_width(w, channels.shape[1], bits)
    if lengths is not None:
        check_int_array("lengths", lengths, (b,), "[B]")
    if scale is not None:
        try:
            scale = float(scale)
        except (TypeError, jax.errors.ConcretizationTypeError) as e:
            raise TypeError(f"scale must be a Python float (static), got {scale!r}") from e
    return b, hkv, w, scale


def _kernel_tuning(mode, block_c, num_warps, num_stages, splits, prefetch, hoist_q, q_prep=None,
                   head_split=None) -> dict:
    """Tuning kwargs for the kernel, leaving its defaults where None."""
    kw = dict(mode=mode, block_c=block_c, num_warps=num_warps, num_stages=num_stages,
              splits=splits, prefetch=prefetch, hoist_q=hoist_q, q_prep=q_prep, head_split=head_split)
    return {k: (int(v) if isinstance(v, np.integer) else v) for k, v in kw.items() if v is not None}


def label_scores(q, labels, channels, candidates=None, counts=None, *, lengths=None, scale=None,
                 bits=4, impl="auto", mode=None, block_c=None, num_warps=None, num_stages=None,
                 splits=None, prefetch=None, hoist_q=None, q_prep=None, head_split=None):
    """Approximate attention probabilities from the label cache: ``float32[B, Hkv, C]``.

    For each query head of the group, softmax over the candidates of
    ``scale * q_h[channels] . dequant(label_j)`` (``scale`` defaults to
    ``1/sqrt(D)``), then the mean over the G heads. ``candidates int32[B, Hkv, C]``
    are token positions, ``counts int32[B, Hkv]`` how many are real (None: all
    C); ``candidates=None`` scores all S positions and needs ``lengths``.
    Entries past the count, at or past ``lengths[b]`` (when given), or outside
    ``[0, S)`` get ``-inf`` before the softmax and exactly 0 after; a row with no
    valid entry is all zeros. The query is used unquantized (more accurate than
    Double Sparsity's quantized query label). ``bits`` must be the width the
    cache was built with. Candidates that are whole blocks of consecutive
    tokens are better scored with ``block_label_scores``. ``labels``: a
    ``LabelCache`` or its interleaved ``LabelRecords`` (``interleave_labels``: one
    record per token, so a scattered candidate costs one memory sector, not
    three; the same numbers).

    Tuning (kernel only; None = the kernel's default, see
    ``pallas_kernels.labels``): ``mode`` ("logits", the default: one kernel
    writing raw logits and statistics, then a normalization kernel;
    "two_pass": a statistics kernel, then a scores kernel that recomputes the
    logits; "per_tile": the previous one-tile-per-program kernel), ``block_c``
    candidates per tile (power of two; default ``32 * num_warps``),
    ``num_warps``, ``num_stages``, ``splits`` programs per (b, kv-head),
    ``prefetch`` tiles loaded ahead, ``hoist_q`` (keep the query in registers:
    fewer instructions, half the occupancy; None = when G * (r + 16) <= 192), ``q_prep``
    (where the channel-gathered, scaled query is made: "xla", the default, a fusion before
    the kernel; "kernel", gathered by each program, which needs the hoisted query),
    ``head_split`` (the "logits" mode's G heads split over that many programs a tile range,
    each holding its share of the query: fewer registers, more warps an SM; a divisor of G).
    """
    b, hkv, w, scale = _check_scores_args(q, labels, channels, lengths, scale, bits)
    if candidates is None:
        if lengths is None:
            raise ValueError("label_scores with candidates=None scores every position: pass lengths")
        if counts is not None:
            raise ValueError("counts applies to candidates; with candidates=None pass lengths only")
    else:
        check_rank("candidates", candidates, 3, "[B, Hkv, C]")
        check_int("candidates", candidates)
        if tuple(candidates.shape[:2]) != (b, hkv) or candidates.shape[2] == 0:
            raise ValueError(f"candidates must have shape [B={b}, Hkv={hkv}, C>=1], got "
                             f"{tuple(candidates.shape)}")
        if counts is not None:
            check_int_array("counts", counts, (b, hkv), "[B, Hkv]")
    _check_tuning(block_c, num_warps, num_stages, splits, prefetch, mode, q_prep, hoist_q, head_split,
                  q.shape[1] // hkv)
    choice, interpret = resolve_impl(
        impl, kernel_unsupported=_pow2_reason(packed_width=w, **({} if block_c is None else
                                                                 {"block_c": block_c})))
    if choice == "reference":
        return _lb.label_scores_reference(q, labels, channels, candidates, counts, lengths=lengths,
                                          scale=scale, bits=bits)
    tuning = _kernel_tuning(mode, block_c, num_warps, num_stages, splits, prefetch, hoist_q, q_prep, head_split)
    if not interpret:
        c = _lb.label_dims(labels, channels.shape[1], bits)[2] if candidates is None else candidates.shape[2]
        tuning = with_tuned(tuning, "label_scores", rows=b * hkv, c=c, w=w, g=q.shape[1] // hkv)
    return _lb.label_scores_kernel(
        q, labels, channels, candidates, counts, lengths=lengths, scale=scale, bits=bits,
        interpret=interpret, **tuning)


def _check_block_label_args(q, labels, channels, block_ids, block_counts, lengths, block_size, scale, bits,
                            op: str):
    b, hkv, w, scale = _check_scores_args(q, labels, channels, lengths, scale, bits)
    if lengths is None:
        raise ValueError(f"{op} needs lengths")
    _check_block_size(block_size)
    check_rank("block_ids", block_ids, 3, "[B, Hkv, NBsel]")
    check_int("block_ids", block_ids)
    if tuple(block_ids.shape[:2]) != (b, hkv) or block_ids.shape[2] == 0:
        raise ValueError(f"block_ids must have shape [B={b}, Hkv={hkv}, NBsel>=1], got "
                         f"{tuple(block_ids.shape)}")
    check_rank("block_counts", block_counts, 2, "[B, Hkv]")
    check_int("block_counts", block_counts)
    if tuple(block_counts.shape) not in ((b, hkv), (b, 1)):
        raise ValueError(f"block_counts must have shape [B={b}, Hkv={hkv}] or [B={b}, 1] (one count for a "
                         f"row's KV heads), got {tuple(block_counts.shape)}")
    return b, hkv, w, scale


def block_label_scores(q, labels, channels, block_ids, block_counts, lengths, *, block_size,
                       scale=None, bits=4, impl="auto", mode=None, block_c=None, num_warps=None,
                       num_stages=None, splits=None, prefetch=None, hoist_q=None, q_prep=None, head_split=None):
    """``label_scores`` over the tokens of selected blocks: ``float32[B, Hkv, NBsel * block_size]``.

    Block slot ``j`` of ``block_ids int32[B, Hkv, NBsel]`` stands for the tokens
    ``block_ids[..., j] * block_size + arange(block_size)``, and the output is
    in that order (the same as ``label_scores`` with those positions as
    candidates). Masked (score exactly 0, excluded from the softmax): slots at
    or past ``block_counts int32[B, Hkv]`` (or ``[B, 1]``, one count for a row's
    KV heads, read in place; clamped to ``[0, NBsel]``), block
    ids outside ``[0, ceil(S / block_size))``, and tokens at or past
    ``min(lengths[b], S)`` (so a partial last block is handled). The kernel
    makes the positions in registers (no candidate array) and reads each
    block's labels as consecutive rows. Tuning as ``label_scores`` (modes
    "two_pass" and "logits").
    """
    b, hkv, w, scale = _check_block_label_args(q, labels, channels, block_ids, block_counts, lengths,
                                                block_size, scale, bits, "block_label_scores")
    _check_tuning(block_c, num_warps, num_stages, splits, prefetch, mode, q_prep, hoist_q, head_split,
                  q.shape[1] // hkv)
    if mode == "per_tile":
        raise ValueError("block_label_scores has no 'per_tile' mode")
    choice, interpret = resolve_impl(
        impl, kernel_unsupported=_pow2_reason(packed_width=w, **({} if block_c is None else
                                                                 {"block_c": block_c})))
    if choice == "reference":
        return _lb.block_label_scores_reference(q, labels, channels, block_ids, block_counts,
                                                lengths, block_size=int(block_size), scale=scale,
                                                bits=bits)
    tuning = _kernel_tuning(mode, block_c, num_warps, num_stages, splits, prefetch, hoist_q, q_prep, head_split)
    if not interpret:
        tuning = with_tuned(tuning, "block_label_scores", rows=b * hkv, c=block_ids.shape[2] * int(block_size),
                            w=w, g=q.shape[1] // hkv, block=int(block_size))
    return _lb.block_label_scores_kernel(
        q, labels, channels, block_ids, block_counts, lengths, block_size=int(block_size),
        scale=scale, bits=bits, interpret=interpret, **tuning)


#: Whether block_label_topk's kernel path runs the fused selection kernel by default. On the
#: H100 (128K, K=2048) the fused kernel was slower than normalization + top-k + token map
#: unfused, at B=1 and B=8 (docs/kernels.md, v5, 'Fusing the label normalization, the token
#: top-k and the token map into one kernel lost'). The fused program holds
#: a row's whole load (G x C logits, their exponentials, the block-id gathers) before its
#: latency-bound search, which the unfused normalization spreads over many programs. Off until
#: tuned faster (its warps: ``select_num_warps``).
FUSED_LABEL_TOPK = False


def block_label_topk(q, labels, channels, block_ids, block_counts, lengths, *, block_size, k,
                     scale=None, bits=4, impl="auto", block_c=None, num_warps=None, num_stages=None,
                     splits=None, prefetch=None, hoist_q=None, q_prep=None, head_split=None, select_num_warps=None,
                     radix_bits=None, fused=None, dense_budget=None):
    """The ``k`` best tokens of the selected blocks by label score (AsyncTLS's second level):
    ``(positions int32[B, Hkv, k], counts int32[B, Hkv])``.

    The scores are ``block_label_scores``' (same arguments, same mask); a masked token
    is never chosen while an unmasked one is left. ``counts = min(k, #unmasked)``; the
    entries past it are other slots' tokens, to be ignored. Ties are broken in slot
    order by the kernel, unspecified by the reference. ``1 <= k <= NBsel * block_size``.

    The kernel path runs ``block_label_scores``' kernels, ``topk_indices`` and a gather;
    with ``fused=True`` the label logits kernel, then one kernel that normalizes the
    logits, selects the top ``k`` and maps slots to tokens (``pallas_kernels.label_topk``:
    three steps and two HBM round trips of the scores fewer, but slower as measured: see
    ``FUSED_LABEL_TOPK``, the default for ``fused=None``). Rows longer than
    ``label_topk.MAX_CANDIDATES`` candidates always run unfused. Label tuning as
    ``block_label_scores``; ``select_num_warps`` and ``radix_bits`` tune the selection
    (``topk_indices``' ``num_warps`` and ``radix_bits``). Left at None, the unfused
    selection's knobs come from the tuned table (``topk_indices`` reads it only when the
    caller names no knob: a fixed ``radix_bits=1`` here used to keep it from the table).

    ``dense_budget`` (a static int, optional): a row whose length is at most it attends its
    whole context: positions ``arange(k)`` and its length as the count (``sparse_base.
    fallback_to_dense``'s rule, made by the selecting kernel with the token map).
    """
    b, hkv, w, scale = _check_block_label_args(q, labels, channels, block_ids, block_counts, lengths,
                                                block_size, scale, bits, "block_label_topk")
    _check_tuning(block_c, num_warps, num_stages, splits, prefetch, None, q_prep, hoist_q, head_split,
                  q.shape[1] // hkv)
    if select_num_warps is not None and (isinstance(select_num_warps, bool) or select_num_warps <= 0):
        raise ValueError(f"select_num_warps must be a positive int or None, got {select_num_warps!r}")
    if radix_bits not in (None, 1, 2, 4):
        raise ValueError(f"radix_bits must be 1, 2, 4 or None, got {radix_bits!r}")
    if dense_budget is not None and (isinstance(dense_budget, bool) or not isinstance(dense_budget, (int, np.integer))):
        raise ValueError(f"dense_budget must be a static int or None, got {dense_budget!r}")
    c = block_ids.shape[2] * int(block_size)
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= c:
        raise ValueError(f"k must be a static int with 1 <= k <= NBsel * block_size = {c}, got {k!r}")
    k = int(k)
    choice, interpret = resolve_impl(
        impl, kernel_unsupported=_pow2_reason(packed_width=w, **({} if block_c is None else
                                                                 {"block_c": block_c})))

    bs = int(block_size)
    select = {**({} if radix_bits is None else {"radix_bits": radix_bits}),
              **({} if select_num_warps is None else {"num_warps": int(select_num_warps)})}
    if choice == "reference":
        scores = _lb.block_label_scores_reference(q, labels, channels, block_ids, block_counts, lengths,
                                                  block_size=bs, scale=scale, bits=bits)
        s = _lb.label_dims(labels, channels.shape[1], bits)[2]
        valid = _lb.expand_blocks(block_ids, block_counts, lengths, block_size=bs, seq_len=s) >= 0
        scores = jnp.where(valid, scores, -jnp.inf)
        select = {}
    else:
        fused = FUSED_LABEL_TOPK if fused is None else bool(fused)
        tuning = _kernel_tuning(None, block_c, num_warps, num_stages, splits, prefetch, hoist_q, q_prep, head_split)
        if not interpret:
            tuning = with_tuned(tuning, "block_label_scores", rows=b * hkv, c=c, w=w, g=q.shape[1] // hkv, block=bs)
        if fused and c <= _ltk.MAX_CANDIDATES:
            tuning["mode"] = "logits"  # the fused selection reads the raw logits and statistics
            logits, m, l = _lb.block_label_scores_kernel(q, labels, channels, block_ids, block_counts, lengths,
                                                         block_size=bs, scale=scale, bits=bits, interpret=interpret,
                                                         return_raw=True, **tuning)
            g = logits.shape[2]
            pos, cnt = _ltk.label_topk_pallas(logits.reshape(b * hkv, g, c), m.reshape(b * hkv, -1, g),
                                              l.reshape(b * hkv, -1, g), block_ids.reshape(b * hkv, -1), k,
                                              block_size=bs, interpret=interpret, **select)
            pos, cnt = pos.reshape(b, hkv, k), cnt.reshape(b, hkv)
            if dense_budget is not None:
                dense = (lengths <= dense_budget)[:, None]
                pos = jnp.where(dense[..., None], jnp.arange(k, dtype=jnp.int32), pos)
                cnt = jnp.where(dense, lengths[:, None], cnt).astype(jnp.int32)
            return pos, cnt
        # masked slots come out of the kernel as -inf: no masking pass over the scores
        scores = _lb.block_label_scores_kernel(q, labels, channels, block_ids, block_counts, lengths, block_size=bs,
                                               scale=scale, bits=bits, interpret=interpret,
                                               masked_score=-jnp.inf, **tuning)
    # unfused: masked slots are -inf (a valid score is >= 0); with fewer than k others they
    # are the ties at the threshold, and greater_first puts the unmasked ones first (the
    # "first counts entries")
    # the count of unmasked slots (> -inf) comes from the selecting kernel: no pass over the scores
    # and the slots become tokens through the block ids as the kernel writes them (no XLA pass
    # over the selection), the dense fallback too
    dense = {} if dense_budget is None else {"dense_lengths": lengths[:, None], "dense_limit": int(dense_budget)}
    return topk_indices(scores, k, impl=choice, greater_first=True, count_above=-np.inf,
                        block_table=block_ids.astype(jnp.int32), block_size=bs, **dense, **select)


# ----------------------------------------------------------------------------
# Kascade's anchor step
# ----------------------------------------------------------------------------


def group_softmax_scores(q, k, lengths, *, scale=None, impl="auto", **tuning):
    """Exact decode softmax probabilities summed over each GQA group: ``float32[B, Hkv, S]``.

    ``q [B, Hq, D]``, ``k [B, Hkv, S, D]``, ``lengths int32[B]``; 0 at and past
    ``lengths[b]`` (Kascade's post-softmax pooling; ``pallas_kernels.group_softmax``).
    Tuning (kernel only): ``block_s``, ``num_splits``, ``num_warps``, ``num_stages``.
    """
    check_rank("q", q, 3, "[B, Hq, D]")
    check_float("q", q)
    _check_cache(k, lengths)
    b, hq, d = q.shape
    if k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k must have shape [B={b}, Hkv, S, D={d}], got {tuple(k.shape)}")
    check_gqa(hq, k.shape[1])
    bad = set(tuning) - {"block_s", "num_splits", "num_warps", "num_stages"}
    if bad:
        raise ValueError(f"unknown tuning keys for group_softmax_scores: {sorted(bad)}")
    choice, interpret = resolve_impl(impl, kernel_unsupported=_gs.unsupported_reason(k.shape[2], d))
    if choice == "reference":
        return _gs.group_softmax_reference(q, k, lengths, scale=scale)
    return _gs.group_softmax_pallas(q, k, lengths, scale=scale, interpret=interpret, **tuning)
