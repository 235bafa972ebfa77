"""8-bit Quest block boxes: half the bytes of bf16 boxes, and still an upper bound.

The Quest filter of AsyncTLS reads every block's key box (channel-wise max and min,
``[B, Hkv, NB, D]`` each) on every decode step: at B=8, 128K tokens, 8 KV heads and
D=128 that is 67 MB of bf16, the largest read of the selection. Here each box edge is
an 8-bit code over its (batch, KV head, channel)'s range:

* ``base, step  float32[B, Hkv, D]``: the range's low end and its step, from the
  prompt's blocks (``step = (max - min) / 255``);
* ``upper, lower  int8[B, Hkv, NB, D]``: the codes ``c = ceil((max - base) / step)`` and
  ``floor((min - base) / step)``, clipped to ``[0, 255]`` and stored as ``c - 128`` (signed
  bytes: the integer tensor cores take them as they are): the dequantized box
  ``base + c * step`` contains the exact one;
* ``upper_slack, lower_slack  float32[B, Hkv, NB]``: how far the exact box still
  reaches past the dequantized one in any channel (0 unless a key left the range
  after it was fixed, or f32 rounding put an edge an ulp inside).

Quest's bound per query head ``q`` (``q+ = max(q, 0)``, ``q- = min(q, 0)``) on these:

    s_n = q+ . (base + step * c(upper_n)) + |q+|_1 * upper_slack_n
        + q- . (base + step * c(lower_n)) + |q-|_1 * lower_slack_n

which is at least ``q+ . max_n + q- . min_n`` (the exact boxes' bound) for every
block: the filter ranks by a looser bound, never by a wrong one. The kernel folds the
step into the query (``q * step``: one multiply per channel, not per block) and the
base into one scalar, so a block costs its 2 * D bytes of codes and two floats.

Appends stay in the integer domain: the codes of a key are monotone in it, so a
block's code is the max (upper) or min (lower) of its tokens' codes and an append is
``max(code, code(k_new))``, exactly what quantizing the exact box would give. A key
past the range clips to the end code and its excess goes to the slack. The range
itself is fixed when the boxes are built (the prompt); it is not widened.

``quest_block_scores_quantized_reference`` is the f32 oracle; the Pallas-Triton
kernel runs one program per ``(b, kv head, block_n blocks)`` like
``block_scores.quest_block_scores_kernel``, in one of three modes: "fma" (CUDA cores),
"dot" (bf16 tensor cores) or "imma" (int8 tensor cores, the stored bytes unconverted;
the default). On the H200 at B=8, 128K, group max, "fma" was slower than the bf16 boxes'
kernel, "dot" and "imma" faster, "imma" the fastest (docs/kernels.md, '8-bit block boxes');
"imma" with its query side made once per (batch, KV head) by a small kernel
(``prep="kernel"``) is faster again at B=8 (docs/kernels.md, 'Kept on 2026-11-28 (v11-v13)').
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.block_scores import is_pow2

__all__ = [
    "BOX_BITS",
    "QuantizedBoxes",
    "quantize_boxes_reference",
    "update_quantized_boxes_reference",
    "dequantize_boxes",
    "quest_block_scores_quantized_reference",
    "quest_block_scores_quantized_kernel",
]

BOX_BITS = 8
LEVELS = (1 << BOX_BITS) - 1
OFFSET = 1 << (BOX_BITS - 1)  # codes are stored as code - 128: signed bytes


def code_values(stored):
    """The codes ``c`` in ``[0, 255]`` (float32) of stored signed bytes ``c - 128``."""
    return stored.astype(jnp.float32) + OFFSET


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedBoxes:
    """Per-block key boxes as 8-bit codes (module docstring). Shapes:
    ``upper, lower int8[B, Hkv, NB, D]`` (code - 128), ``base, step float32[B, Hkv, D]``,
    ``upper_slack, lower_slack float32[B, Hkv, NB]``."""

    upper: jax.Array
    lower: jax.Array
    base: jax.Array
    step: jax.Array
    upper_slack: jax.Array
    lower_slack: jax.Array

    @property
    def shape(self) -> tuple:
        """``(B, Hkv, NB, D)``, the shape of the boxes these codes stand for."""
        return tuple(self.upper.shape)

    @classmethod
    def zeros(cls, batch: int, num_kv_heads: int, num_blocks: int, head_dim: int) -> "QuantizedBoxes":
        # one buffer per field: a donated state must not hold the same array twice
        def codes():
            return jnp.zeros((batch, num_kv_heads, num_blocks, head_dim), jnp.int8)

        def slack():
            return jnp.zeros((batch, num_kv_heads, num_blocks), jnp.float32)

        return cls(codes(), codes(), jnp.zeros((batch, num_kv_heads, head_dim), jnp.float32),
                   jnp.ones((batch, num_kv_heads, head_dim), jnp.float32), slack(), slack())


# ----------------------------------------------------------------------------
# Codes (pure jnp): monotone in the key, so block codes are max / min of token codes
# ----------------------------------------------------------------------------


def _codes_up(x, base, step):
    """``(int8 codes - 128, slack)`` of upper edges ``x [..., D]`` (f32) over ``base, step`` broadcast
    to it: the smallest code whose edge is at or above ``x`` (the end code if none) and how far
    ``x`` still exceeds that edge in the worst channel (``[...]``)."""
    code = jnp.clip(jnp.ceil((x - base) / step), 0, LEVELS)
    slack = jnp.max(jnp.maximum(x - (base + code * step), 0.0), axis=-1)
    return (code - OFFSET).astype(jnp.int8), slack


def _codes_lo(x, base, step):
    """As :func:`_codes_up` for lower edges: the largest code at or below ``x``."""
    code = jnp.clip(jnp.floor((x - base) / step), 0, LEVELS)
    slack = jnp.max(jnp.maximum((base + code * step) - x, 0.0), axis=-1)
    return (code - OFFSET).astype(jnp.int8), slack


@functools.partial(jax.jit, static_argnames=("block_size",))
def quantize_boxes_reference(k_max, k_min, lengths, *, block_size):
    """:class:`QuantizedBoxes` of exact boxes ``k_max, k_min [B, Hkv, NB, D]`` (e.g.
    ``block_minmax``'s) whose rows hold ``lengths int32[B]`` tokens: each (b, kv head,
    channel)'s range is taken over the row's non-empty blocks (``ceil(length / block_size)``),
    so the zero boxes past the length do not stretch it. A row with no token gets
    ``base 0, step 1``."""
    b, hkv, nb, d = k_max.shape
    up, lo = k_max.astype(jnp.float32), k_min.astype(jnp.float32)
    nvalid = (jnp.clip(lengths.astype(jnp.int32), 0, nb * block_size) + block_size - 1) // block_size
    live = (jnp.arange(nb, dtype=jnp.int32)[None] < nvalid[:, None])[:, None, :, None]  # [B, 1, NB, 1]
    base = jnp.min(jnp.where(live, lo, jnp.inf), axis=2)  # [B, Hkv, D]
    top = jnp.max(jnp.where(live, up, -jnp.inf), axis=2)
    empty = (nvalid == 0)[:, None, None]
    base = jnp.where(empty, 0.0, base)
    step = jnp.where(empty, 1.0, (top - base) / LEVELS)
    step = jnp.where(step > 0, step, 1.0)  # a constant channel: any positive step
    cu, su = _codes_up(up, base[:, :, None], step[:, :, None])
    cl, sl = _codes_lo(lo, base[:, :, None], step[:, :, None])
    return QuantizedBoxes(cu, cl, base, step, su, sl)


@functools.partial(jax.jit, static_argnames=("block_size",))
def update_quantized_boxes_reference(boxes, k_new, positions, *, block_size):
    """Fold one appended key per row into the codes: ``k_new [B, Hkv, D]`` was written at
    ``positions[b]`` (the row's length before the append). A position that opens a block
    sets the block's codes and slack to the key's own; otherwise they take the max (upper)
    or min (lower) with it. Positions outside ``[0, NB * block_size)`` change nothing."""
    b, _, nb, _ = boxes.upper.shape
    positions = positions.astype(jnp.int32)
    blk = positions // block_size
    opens = (positions % block_size == 0)[:, None]  # [B, 1]
    in_range = ((positions >= 0) & (blk < nb))[:, None]
    blk_c = jnp.clip(blk, 0, nb - 1)
    rows = jnp.arange(b)
    x = k_new.astype(jnp.float32)
    cu_new, su_new = _codes_up(x, boxes.base, boxes.step)  # [B, Hkv, D], [B, Hkv]
    cl_new, sl_new = _codes_lo(x, boxes.base, boxes.step)
    cu_old, cl_old = boxes.upper[rows, :, blk_c], boxes.lower[rows, :, blk_c]
    su_old, sl_old = boxes.upper_slack[rows, :, blk_c], boxes.lower_slack[rows, :, blk_c]
    cu = jnp.where(opens[..., None], cu_new, jnp.maximum(cu_old, cu_new))
    cl = jnp.where(opens[..., None], cl_new, jnp.minimum(cl_old, cl_new))
    # the key's excess over its own code's edge bounds its excess over the block's edge
    su = jnp.where(opens, su_new, jnp.maximum(su_old, su_new))
    sl = jnp.where(opens, sl_new, jnp.maximum(sl_old, sl_new))
    keep = in_range[..., None]
    return dataclasses.replace(
        boxes,
        upper=boxes.upper.at[rows, :, blk_c].set(jnp.where(keep, cu, cu_old)),
        lower=boxes.lower.at[rows, :, blk_c].set(jnp.where(keep, cl, cl_old)),
        upper_slack=boxes.upper_slack.at[rows, :, blk_c].set(jnp.where(in_range, su, su_old)),
        lower_slack=boxes.lower_slack.at[rows, :, blk_c].set(jnp.where(in_range, sl, sl_old)),
    )


def dequantize_boxes(boxes):
    """``(upper, lower) float32[B, Hkv, NB, D]``: the boxes the codes stand for, each edge
    widened by its block's slack in every channel (so they contain the exact boxes)."""
    base, step = boxes.base[:, :, None], boxes.step[:, :, None]
    up = base + code_values(boxes.upper) * step + boxes.upper_slack[..., None]
    lo = base + code_values(boxes.lower) * step - boxes.lower_slack[..., None]
    return up, lo


@functools.partial(jax.jit, static_argnames=("reduce",))
def quest_block_scores_quantized_reference(q, boxes, *, reduce="sum"):
    """``float32[B, Hkv, NB]``: each query head's bound on the codes (module docstring),
    summed over the GQA group (``reduce="sum"``) or its max (``"max"``)."""
    b, hq, d = q.shape
    hkv = boxes.upper.shape[1]
    g = hq // hkv
    hi = jax.lax.Precision.HIGHEST
    qf = q.astype(jnp.float32).reshape(b, hkv, g, d)
    qpos, qneg = jnp.maximum(qf, 0.0), jnp.minimum(qf, 0.0)
    base, step = boxes.base[:, :, None], boxes.step[:, :, None]  # [B, Hkv, 1, D]
    const = jnp.sum(qf * base, axis=-1)  # [B, Hkv, G]: q+ . base + q- . base
    s = jnp.einsum("bhgd,bhnd->bhgn", qpos * step, code_values(boxes.upper), precision=hi)
    s = s + jnp.einsum("bhgd,bhnd->bhgn", qneg * step, code_values(boxes.lower), precision=hi)
    s = s + const[..., None]
    s = s + jnp.sum(qpos, -1)[..., None] * boxes.upper_slack[:, :, None] - jnp.sum(qneg, -1)[..., None] * boxes.lower_slack[:, :, None]
    return s.max(2) if reduce == "max" else s.sum(2)


# ----------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------


def _load_tile(up_ref, lo_ref, su_ref, sl_ref, t, *, block_n, num_blocks):
    """Tile ``t``'s ``block_n`` blocks: ``(rmask [block_n], upper, lower int8 [block_n, D] as
    stored, upper_slack, lower_slack [block_n])``; rows past ``num_blocks`` read as zeros."""
    rmask = t * block_n + jnp.arange(block_n, dtype=jnp.int32) < num_blocks
    tile = pl.ds(t * block_n, block_n)
    up = plgpu.load(up_ref.at[tile, :], mask=rmask[:, None], other=0)
    lo = plgpu.load(lo_ref.at[tile, :], mask=rmask[:, None], other=0)
    su = plgpu.load(su_ref.at[tile], mask=rmask, other=0.0)
    sl = plgpu.load(sl_ref.at[tile], mask=rmask, other=0.0)
    return rmask, up, lo, su, sl


def _over_tiles(tile_fn, tiles: int):
    """``tile_fn(t)`` for this program's ``tiles`` consecutive tiles: one (``tiles=1``, the
    program's own), or a loop, whose loads Triton's pipeliner (``num_stages``) can issue ahead
    of the tensor-core work on the tile before, with the query side made or loaded once."""
    if tiles == 1:
        tile_fn(pl.program_id(2))
        return
    first = pl.program_id(2) * tiles

    def body(i, carry):
        tile_fn(first + i)
        return carry

    jax.lax.fori_loop(0, tiles, body, 0)


def _quest_q8_body(q_ref, up_ref, lo_ref, base_ref, step_ref, su_ref, sl_ref, o_ref, *, group, group_pad,
                   block_n, num_blocks, reduce, tiles=1):
    # q_ref: [G, D]; up_ref/lo_ref: int8 [NB, D] (code - 128); base_ref/step_ref: [D]; su_ref/sl_ref/o_ref: [NB].
    _over_tiles(lambda t: _quest_q8_tile(q_ref, up_ref, lo_ref, base_ref, step_ref, su_ref, sl_ref, o_ref, t,
                                         group=group, group_pad=group_pad, block_n=block_n, num_blocks=num_blocks,
                                         reduce=reduce), tiles)


def _quest_q8_tile(q_ref, up_ref, lo_ref, base_ref, step_ref, su_ref, sl_ref, o_ref, t, *, group, group_pad,
                   block_n, num_blocks, reduce):
    rmask, up, lo, su, sl = _load_tile(up_ref, lo_ref, su_ref, sl_ref, t, block_n=block_n, num_blocks=num_blocks)
    cu, cl = code_values(up), code_values(lo)
    base = base_ref[...]
    step = step_ref[...]

    def bound(qpos, qneg):
        # the step folded into the query row, the base into one scalar: per block, a
        # 2-row GEMV on the codes (FMA + row reduction)
        wpos, wneg = qpos * step, qneg * step
        const = jnp.sum((qpos + qneg) * base)
        s = jnp.sum(cu * wpos[None, :] + cl * wneg[None, :], axis=1)
        return s + const + jnp.sum(qpos) * su - jnp.sum(qneg) * sl

    if reduce == "max":
        s = None
        for g in range(group):  # the real heads only (a zero pad row's bound must not win)
            qg = q_ref[g, :].astype(jnp.float32)
            sg = bound(jnp.maximum(qg, 0.0), jnp.minimum(qg, 0.0))
            s = sg if s is None else jnp.maximum(s, sg)
    else:
        if group_pad == group:
            q = q_ref[...].astype(jnp.float32)
        else:  # pad the group to a power of two with zero rows (they add nothing to a sum)
            gmask = (jnp.arange(group_pad) < group)[:, None]
            q = plgpu.load(q_ref.at[pl.ds(0, group_pad), :], mask=gmask, other=0.0).astype(jnp.float32)
        # linear in q (the slack terms too: |.|_1 of same-signed parts adds): fold the group
        s = bound(jnp.sum(jnp.maximum(q, 0.0), axis=0), jnp.sum(jnp.minimum(q, 0.0), axis=0))
    plgpu.store(o_ref.at[pl.ds(t * block_n, block_n)], s, mask=rmask)


DOT_COLS = 16  # a tensor-core dot needs N >= 16: the group's heads (or the folded sum), zero-padded
_ROWS_BY_ROWS = (((1,), (1,)), ((), ()))  # [M, D] . [N, D]^T


def _codes_as_bf16(stored):
    """Stored codes (``c - 128``) as exact bf16 ``c`` (a code has at most 8 significant bits): the
    f32 ``2^23 + c`` made from its bits and ``2^23`` taken off, integer and add ops instead of
    int-to-float conversions."""
    f = jax.lax.bitcast_convert_type((stored.astype(jnp.int32) + OFFSET) | 0x4B000000, jnp.float32) - 8388608.0
    return f.astype(jnp.bfloat16)


def _bf16_at_least(w):
    """f32 ``w`` rounded up to a bf16 value (returned as f32, exactly representable): the top
    16 bits kept, plus one unit of the last when a positive ``w`` had more (a negative
    one truncated moves up)."""
    bits = jax.lax.bitcast_convert_type(w, jnp.int32)
    bits = jnp.where(w > 0, bits + 0xFFFF, bits) & jnp.int32(-65536)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _split_up(w):
    """``(hi, lo)`` bf16 with ``hi + lo >= w`` within 2^-16 of it: ``hi`` the truncation, ``lo``
    the rest rounded up. Codes are >= 0, so a dot with them is at least the f32 one."""
    hi = jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(w, jnp.int32) & jnp.int32(-65536), jnp.float32)
    return hi.astype(jnp.bfloat16), _bf16_at_least(w - hi).astype(jnp.bfloat16)


def _int8_at_least(w):
    """``(scale [..., 16], hi, lo)`` for weight rows ``w [..., 16, D]`` (f32): int8 ``hi, lo``
    with ``scale * (hi + lo / 127) >= w`` elementwise, within ``scale / 127`` (``scale`` = the
    row's max |w| / 127): ``hi`` the floor in units of ``scale``, ``lo`` the rest rounded up in
    127ths. The dot of nonnegative codes with them is then at least the one with ``w``."""
    scale = jnp.max(jnp.abs(w), axis=-1) / 127.0
    scale = jnp.where(scale > 0, scale, 1.0)
    x = w / scale[..., None]
    hi = jnp.clip(jnp.floor(x), -127.0, 127.0)
    lo = jnp.clip(jnp.ceil((x - hi) * 127.0), 0.0, 127.0)
    return scale, hi.astype(jnp.int8), lo.astype(jnp.int8)


#: rows of the per-column constants ``mma_operands`` returns (a power of two, for the kernel's load)
CONST_ROWS = 16
_SCALE_POS, _SCALE_NEG, _BASE_TERM, _L1_POS, _L1_NEG, _CORR = 0, 1, 2, 3, 4, 5  # _CORR.._CORR+3: hi+, lo+, hi-, lo-


def mma_operands(q, base, step, *, group, reduce, mode):
    """The tensor-core forms' query side, for query rows ``q [..., 16, D]`` f32 (rows past the
    group zero) and the boxes' ``base, step [..., D]``: ``(weights, consts)``.

    * ``weights``: four ``[..., 16, D]`` in the dot's input type: the step-scaled positive
      query parts ``q+ * step`` as two terms rounded up (``hi+, lo+``), then the negative
      parts' (``hi-, lo-``); "imma": int8 in units of a per-row scale (:func:`_int8_at_least`),
      "dot": bf16 (:func:`_split_up`).
    * ``consts``: ``CONST_ROWS`` rows of ``[..., 16]`` f32, one column a head: the scales of
      the + and - terms (1 for "dot"), the base term ``(q+ + q-) . base``, ``|q+|_1`` and
      ``|q-|_1`` (the slacks' factors), then for "imma" the stored bytes' offset corrections
      ``128 * sum_d`` of each weight term (integers below 2**24: exact in f32), zero rows after.

    ``reduce="sum"`` folds the group into row 0 first (the bound is linear in q). Plain jnp
    on the trailing axes: every program of the bound runs it (``prep="program"``), or a small
    kernel runs it once for every (batch, KV head) before the bound's (``prep="kernel"``)."""
    col = jnp.arange(DOT_COLS, dtype=jnp.int32)[:, None]
    qpos, qneg = jnp.maximum(q, 0.0), jnp.minimum(q, 0.0)
    if reduce == "sum":  # linear in q: the group folded into row 0
        qpos = jnp.where(col == 0, jnp.sum(qpos, axis=-2, keepdims=True), 0.0)
        qneg = jnp.where(col == 0, jnp.sum(qneg, axis=-2, keepdims=True), 0.0)
    base_term = jnp.sum((qpos + qneg) * base[..., None, :], axis=-1)
    wpos, wneg = qpos * step[..., None, :], qneg * step[..., None, :]
    if mode == "imma":
        scale_pos, hi_pos, lo_pos = _int8_at_least(wpos)
        scale_neg, hi_neg, lo_neg = _int8_at_least(wneg)
        weights = (hi_pos, lo_pos, hi_neg, lo_neg)
        corr = [OFFSET * jnp.sum(t.astype(jnp.int32), axis=-1).astype(jnp.float32) for t in weights]
    else:
        weights = (*_split_up(wpos), *_split_up(wneg))
        scale_pos = scale_neg = jnp.ones_like(base_term)
        corr = [jnp.zeros_like(base_term)] * 4
    consts = [scale_pos, scale_neg, base_term, jnp.sum(qpos, axis=-1), jnp.sum(qneg, axis=-1), *corr]
    return weights, consts


def _codes_bound(up, lo, weights, consts, su, sl, *, mode):
    """Each head's bound ``[block_n, 16]`` from stored codes ``up, lo [block_n, D]``,
    :func:`mma_operands`' weights and constants and the slacks ``su, sl [block_n]``: four
    dots on the tensor cores, each at least its f32 product.

    "imma": the stored bytes ``s = c - 128`` go in unconverted; with ``c = s + 128 >= 0``,
    ``sum_d c.w <= scale * (sum_d s.hi + 128 sum hi + (sum_d s.lo + 128 sum lo) / 127)``, every
    sum exact in int32 (and in f32, below 2**24). "dot": the codes as exact bf16 (at most 8
    significant bits) times the two bf16 terms."""
    hi_pos, lo_pos, hi_neg, lo_neg = weights
    if mode == "imma":
        def part(codes, hi, lo, scale, c_hi, c_lo):
            ih = jax.lax.dot_general(codes, hi, _ROWS_BY_ROWS, preferred_element_type=jnp.int32)
            il = jax.lax.dot_general(codes, lo, _ROWS_BY_ROWS, preferred_element_type=jnp.int32)
            return scale[None, :] * ((ih.astype(jnp.float32) + c_hi[None, :])
                                     + (il.astype(jnp.float32) + c_lo[None, :]) / 127.0)
    else:
        def part(codes, hi, lo, scale, c_hi, c_lo):
            cb = _codes_as_bf16(codes)
            return (jax.lax.dot_general(cb, hi, _ROWS_BY_ROWS, preferred_element_type=jnp.float32)
                    + jax.lax.dot_general(cb, lo, _ROWS_BY_ROWS, preferred_element_type=jnp.float32))
    c = consts
    s = (part(up, hi_pos, lo_pos, c[_SCALE_POS], c[_CORR], c[_CORR + 1])
         + part(lo, hi_neg, lo_neg, c[_SCALE_NEG], c[_CORR + 2], c[_CORR + 3]) + c[_BASE_TERM][None, :])
    return s + su[:, None] * c[_L1_POS][None, :] - sl[:, None] * c[_L1_NEG][None, :]


def _store_group_bound(o_ref, s, rmask, t, *, group, block_n, reduce):
    col = jnp.arange(DOT_COLS, dtype=jnp.int32)
    if reduce == "max":  # the real heads only (a zero pad column's bound must not win)
        s = jnp.max(jnp.where(col[None, :] < group, s, -jnp.inf), axis=1)
    else:
        s = jnp.sum(jnp.where(col[None, :] == 0, s, 0.0), axis=1)
    plgpu.store(o_ref.at[pl.ds(t * block_n, block_n)], s, mask=rmask)


def _quest_q8_mma_body(q_ref, up_ref, lo_ref, base_ref, step_ref, su_ref, sl_ref, o_ref, *, group, block_n,
                       num_blocks, reduce, mode, tiles=1):
    # As _quest_q8_body, the reductions over D on the tensor cores (``mode``: "dot" bf16, "imma"
    # int8): the codes [block_n, D] times the query rows scaled by the step [16, D] (one row per
    # head, or the folded group's sum in row 0), rounded up. The query side is made here, in
    # every program (prep="program"), once for its tiles.
    col = jnp.arange(DOT_COLS, dtype=jnp.int32)
    q = plgpu.load(q_ref.at[pl.ds(0, DOT_COLS), :], mask=(col < group)[:, None], other=0.0).astype(jnp.float32)
    weights, consts = mma_operands(q, base_ref[...], step_ref[...], group=group, reduce=reduce, mode=mode)
    _over_tiles(lambda t: _mma_tile(up_ref, lo_ref, su_ref, sl_ref, o_ref, t, weights, consts, group=group,
                                    block_n=block_n, num_blocks=num_blocks, reduce=reduce, mode=mode), tiles)


def _mma_tile(up_ref, lo_ref, su_ref, sl_ref, o_ref, t, weights, consts, *, group, block_n, num_blocks, reduce,
              mode):
    rmask, up, lo, su, sl = _load_tile(up_ref, lo_ref, su_ref, sl_ref, t, block_n=block_n, num_blocks=num_blocks)
    s = _codes_bound(up, lo, weights, consts, su, sl, mode=mode)
    _store_group_bound(o_ref, s, rmask, t, group=group, block_n=block_n, reduce=reduce)


def _quest_q8_mma_prepared_body(w_ref, c_ref, up_ref, lo_ref, su_ref, sl_ref, o_ref, *, group, block_n,
                                num_blocks, reduce, mode, tiles=1):
    # prep="kernel": the query side (mma_operands) comes in made, w_ref [4, 16, D], c_ref
    # [CONST_ROWS, 16]: at B=8, 128K making it in every program cost the kernel about a
    # quarter of its time (docs/kernels.md, 'Kept on 2026-11-28 (v11-v13)')
    weights = tuple(w_ref[i, :, :] for i in range(4))
    consts = [c_ref[i, :] for i in range(_CORR + 4)]
    _over_tiles(lambda t: _mma_tile(up_ref, lo_ref, su_ref, sl_ref, o_ref, t, weights, consts, group=group,
                                    block_n=block_n, num_blocks=num_blocks, reduce=reduce, mode=mode), tiles)


def _mma_prep_body(q_ref, base_ref, step_ref, w_ref, c_ref, *, group, reduce, mode):
    # one program per (batch row, KV head): mma_operands once, for every program of the bound
    col = jnp.arange(DOT_COLS, dtype=jnp.int32)
    q = plgpu.load(q_ref.at[pl.ds(0, DOT_COLS), :], mask=(col < group)[:, None], other=0.0).astype(jnp.float32)
    weights, consts = mma_operands(q, base_ref[...], step_ref[...], group=group, reduce=reduce, mode=mode)
    for i, w in enumerate(weights):
        w_ref[i, :, :] = w
    for i, c in enumerate(consts):
        c_ref[i, :] = c
    for i in range(len(consts), CONST_ROWS):
        c_ref[i, :] = jnp.zeros((DOT_COLS,), jnp.float32)


#: where the tensor-core forms make their query side (``mma_operands``)
PREPS = ("program", "kernel")


@functools.partial(
    jax.jit, static_argnames=("block_n", "num_warps", "num_stages", "interpret", "reduce", "mode", "prep", "tiles"))
def quest_block_scores_quantized_kernel(q, boxes, *, block_n=128, num_warps=4, num_stages=2, interpret=False,
                                        reduce="sum", mode="fma", prep="program", tiles=1):
    """Pallas kernel for Quest's bound on :class:`QuantizedBoxes`: ``float32[B, Hkv, NB]``.

    Grid ``(B, Hkv, ceil(NB / block_n))``: each program reads its G query rows, the
    (b, kv head)'s base and step rows, and ``block_n`` blocks' codes and slacks.
    ``block_n`` and ``D`` must be powers of two; ``reduce`` is "sum" or "max" over the group.
    ``mode``: "fma" (each head's bound as FMAs and a row reduction), "dot" (the codes as bf16
    times the heads' scaled queries on the tensor cores, the weights rounded up so the result
    is still at least the bound) or "imma" (the stored signed bytes as they are, on the integer
    tensor cores, the weights as two int8 terms rounded up); "dot" and "imma" need
    ``block_n >= 16`` (and 32 a multiple of D for "imma") and at most 16 heads a group.
    ``prep`` (tensor-core modes): "program" makes the query side (:func:`mma_operands`) in
    every program; "kernel" makes it once per (batch, KV head) in a small kernel before the
    bound's, whose programs load it (the same operations; the sums over D may add in another
    order). ``tiles``: tiles of ``block_n`` blocks a program, in a loop (default 1, one tile
    a program: the grid's last axis ``ceil(NB / (block_n * tiles))``); the query side is made or
    loaded once for them, and ``num_stages`` lets Triton issue a tile's loads ahead.
    """
    if isinstance(tiles, bool) or not isinstance(tiles, int) or tiles < 1:
        raise ValueError(f"tiles must be a positive int, got {tiles!r}")
    if reduce not in ("sum", "max"):
        raise ValueError(f"reduce must be 'sum' or 'max', got {reduce!r}")
    if mode not in ("fma", "dot", "imma"):
        raise ValueError(f"mode must be 'fma', 'dot' or 'imma', got {mode!r}")
    if prep not in PREPS:
        raise ValueError(f"prep must be one of {PREPS}, got {prep!r}")
    b, hq, d = q.shape
    _, hkv, nb, _ = boxes.upper.shape
    g = hq // hkv
    if not (is_pow2(block_n) and is_pow2(d)):
        raise ValueError("quest_block_scores_quantized_kernel needs power-of-two block_n and D")
    q4 = q.reshape(b, hkv, g, d)
    codes = pl.BlockSpec((None, None, nb, d), lambda i, j, t: (i, j, 0, 0))
    row = pl.BlockSpec((None, None, d), lambda i, j, t: (i, j, 0))
    per_block = pl.BlockSpec((None, None, nb), lambda i, j, t: (i, j, 0))
    mma = mode in ("dot", "imma")
    if mma and (g > DOT_COLS or block_n < 16 or d < 16 or (mode == "imma" and d % 32)):
        raise ValueError(f"mode={mode!r} needs at most {DOT_COLS} heads a group, block_n >= 16 and D >= 16 "
                         "(a multiple of 32 for 'imma')")
    base, step = boxes.base.astype(jnp.float32), boxes.step.astype(jnp.float32)
    if mma and prep == "kernel":
        # the query side in its own small kernel, one program per (batch row, KV head)
        wdt = jnp.int8 if mode == "imma" else jnp.bfloat16
        w, c = pl.pallas_call(
            functools.partial(_mma_prep_body, group=g, reduce=reduce, mode=mode),
            grid=(b, hkv),
            in_specs=[pl.BlockSpec((None, None, g, d), lambda i, j: (i, j, 0, 0)),
                      pl.BlockSpec((None, None, d), lambda i, j: (i, j, 0)),
                      pl.BlockSpec((None, None, d), lambda i, j: (i, j, 0))],
            out_specs=[pl.BlockSpec((None, None, 4, DOT_COLS, d), lambda i, j: (i, j, 0, 0, 0)),
                       pl.BlockSpec((None, None, CONST_ROWS, DOT_COLS), lambda i, j: (i, j, 0, 0))],
            out_shape=[jax.ShapeDtypeStruct((b, hkv, 4, DOT_COLS, d), wdt),
                       jax.ShapeDtypeStruct((b, hkv, CONST_ROWS, DOT_COLS), jnp.float32)],
            compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
            interpret=interpret,
            name="quest_q8_query_prep",
        )(q4, base, step)
        body = functools.partial(_quest_q8_mma_prepared_body, group=g, block_n=block_n, num_blocks=nb,
                                 reduce=reduce, mode=mode, tiles=tiles)
        in_specs = [pl.BlockSpec((None, None, 4, DOT_COLS, d), lambda i, j, t: (i, j, 0, 0, 0)),
                    pl.BlockSpec((None, None, CONST_ROWS, DOT_COLS), lambda i, j, t: (i, j, 0, 0)),
                    codes, codes, per_block, per_block]
        args = (w, c, boxes.upper, boxes.lower, boxes.upper_slack, boxes.lower_slack)
    else:
        if mma:
            body = functools.partial(_quest_q8_mma_body, group=g, block_n=block_n, num_blocks=nb, reduce=reduce,
                                     mode=mode, tiles=tiles)
        else:
            body = functools.partial(_quest_q8_body, group=g, group_pad=pl.next_power_of_2(g), block_n=block_n,
                                     num_blocks=nb, reduce=reduce, tiles=tiles)
        in_specs = [pl.BlockSpec((None, None, g, d), lambda i, j, t: (i, j, 0, 0)), codes, codes, row, row,
                    per_block, per_block]
        args = (q4, boxes.upper, boxes.lower, base, step, boxes.upper_slack, boxes.lower_slack)
    return pl.pallas_call(
        body,
        grid=(b, hkv, pl.cdiv(nb, block_n * tiles)),
        in_specs=in_specs,
        out_specs=per_block,
        out_shape=jax.ShapeDtypeStruct((b, hkv, nb), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="quest_block_scores_q8",
    )(*args)
