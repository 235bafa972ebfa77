"""Double-Sparsity label cache and label (approximate attention) scores.

Label cache (built once at prefill, one token appended per decode step):

* ``k``: ``[B, Hkv, S, D]``; ``channels``: ``int32[Hkv, r]``, per KV head the
  ``r`` calibrated channels (r even; 16 or 32 of D=128 typically).
* per token, the ``r`` values ``x = k[b, h, s, channels[h]]`` are quantized
  asymmetrically: ``offset = min(x)``, ``scale = (max(x) - min(x)) / (2**bits - 1)``,
  ``code = floor((x - offset) / scale + 0.5)`` clipped to ``[0, 2**bits - 1]``
  (round half up: Triton has no round-to-nearest-even op, and half-up keeps the
  error bound ``|x - dequant| <= scale / 2``). A constant row has scale 0 and
  codes 0, so it dequantizes exactly to ``offset``.
* ``LabelCache.packed``: ``uint8[B, Hkv, S, r * bits // 8]``; channel
  ``c = j * (8 // bits) + i`` sits in byte ``j`` at bits ``[i*bits, (i+1)*bits)``
  (for INT4: even channel in the low nibble, odd channel in the high nibble).
* ``LabelCache.scale`` / ``.offset``: ``float32[B, Hkv, S]``. f32 rather than
  bf16: the labels are 16 B/token at r=16 against 256 B/token for bf16 keys at
  D=128, so bf16 metadata would save only 4 of those 16 bytes, and an f32
  offset keeps the ``scale / 2`` error bound exact.
* Positions at or past a row's length are quantized too (whatever the cache
  holds there); scoring masks them.
* ``bits`` (2, 4 or 8; default 4) is not stored in the cache (a pytree of
  arrays only): every function that reads the cache takes it as a keyword and
  checks it against the packed width and ``r``.

Label scores (AsyncTLS's fine-grained token scorer over a candidate set):

* ``q``: ``[B, Hq, D]`` (query head i belongs to KV head ``i // G``).
* ``candidates``: ``int32[B, Hkv, C]`` token positions (e.g. the tokens of the
  blocks kept by the Quest filter), ``counts``: ``int32[B, Hkv]`` (entries at or
  past the count are ignored, whatever they hold). ``candidates=None`` scores
  all S positions and then ``lengths`` is required.
* for every query head h of the group, ``logit_hj = scale * q_h[channels] . dequant(label_j)``
  (``scale`` defaults to ``1/sqrt(D)``), softmax over the candidate set, then the
  mean over the G heads: ``float32[B, Hkv, C]``. Masked entries (past the
  count, at or past ``lengths[b]``, negative or ``>= S``) get logit ``-inf`` and
  score exactly 0; a row with no valid entry is all zeros.
* the query is not quantized (Double Sparsity quantizes its query label too):
  this is more accurate at no cost, since the query is one vector per step.

Kernel design (``label_scores_kernel``): grid ``(B, Hkv, ceil(C / block_c))``.
Each program gathers the packed rows, scales and offsets of ``block_c``
candidates (one pointer gather per row), unpacks the codes and computes the
logits of all G heads. Dequantization is folded into the dot product:
``sum_c q_c (offset + scale * code_c) = offset * sum_c q_c + scale * (q . code)``,
so the codes are used as small integers and never scaled per element. Softmax
needs the max and sum over the whole candidate set, so the kernel writes raw
logits ``[B, Hkv, G, C]`` plus per-tile max and sum-of-exp, and a jnp epilogue
(one fused XLA elementwise + reduce over G) rescales. Why two phases rather
than one program per (b, kv-head): that grid would give only B*Hkv programs
(64 at B=8, Hkv=8, fewer than the 132 SMs of an H100), each walking C=8192
candidates serially; the raw-logit round trip costs ``B * Hq * C * 4`` bytes
(8 MiB at B=8, Hq=32, C=8192: a few microseconds at HBM speed).
Tuning: ``block_c`` (candidates per program, default 64; the per-program
product tensor is ``Gp x block_c x W`` floats, so lower it for MQA-sized
groups), ``num_warps``, ``num_stages``.

``build_label_cache_kernel``: grid ``(B, Hkv, ceil(S / block_s))``; for each of
the ``8 // bits`` code slots of a byte one 2-D pointer gather
``k[tokens, channels_of_slot]`` (``block_s x W``), then min/max, quantize and
pack in registers; masked stores for the tail tile. Tuning: ``block_s``
(default 128), ``num_warps``, ``num_stages``.

Triton constraints: in-kernel tensors need power-of-two sizes, so the packed
width ``r * bits // 8`` and the tiles must be powers of two (the public op
falls back to the reference otherwise); G is padded to a power of two with
zero query rows whose outputs are never stored.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

__all__ = [
    "LabelCache",
    "SUPPORTED_BITS",
    "build_label_cache_reference",
    "update_label_cache_reference",
    "dequantize_labels",
    "label_scores_reference",
    "build_label_cache_kernel",
    "label_scores_kernel",
    "label_scores_epilogue",
    "check_packed_width",
]

SUPPORTED_BITS = (2, 4, 8)


class LabelCache(NamedTuple):
    """Double-Sparsity label cache (a pytree). See the module docstring."""

    packed: jax.Array  # uint8[B, Hkv, S, r * bits // 8]
    scale: jax.Array  # float32[B, Hkv, S]
    offset: jax.Array  # float32[B, Hkv, S]


def _is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def _gather_channels(k, channels):
    """k [B, Hkv, ..., D], channels [Hkv, r] -> [B, Hkv, ..., r] in f32."""
    extra = k.ndim - 3  # leading axes after Hkv and before D (S, or none)
    idx = channels.astype(jnp.int32).reshape((1, channels.shape[0]) + (1,) * extra + (channels.shape[1],))
    return jnp.take_along_axis(k.astype(jnp.float32), idx, axis=-1)


def _quantize(x, bits):
    """x f32 [..., r] -> (packed uint8 [..., r*bits//8], scale f32 [...], offset f32 [...])."""
    levels = (1 << bits) - 1
    vpb = 8 // bits
    lo = jnp.min(x, axis=-1)
    hi = jnp.max(x, axis=-1)
    scale = (hi - lo) * (1.0 / levels)  # a multiply: bitwise equal in XLA and Triton
    safe = jnp.where(scale > 0, scale, 1.0)
    code = jnp.floor((x - lo[..., None]) / safe[..., None] + 0.5)
    code = jnp.clip(code, 0, levels).astype(jnp.uint32)
    code = code.reshape(x.shape[:-1] + (x.shape[-1] // vpb, vpb))
    shifts = (jnp.arange(vpb, dtype=jnp.uint32) * bits)
    packed = jnp.sum(code << shifts, axis=-1).astype(jnp.uint8)  # disjoint bits: sum == or
    return packed, scale, lo


def _dequantize(packed, scale, offset, bits):
    """Inverse of ``_quantize`` (any leading shape) -> f32 [..., r]."""
    levels = (1 << bits) - 1
    vpb = 8 // bits
    shifts = jnp.arange(vpb, dtype=jnp.uint32) * bits
    code = (packed.astype(jnp.uint32)[..., None] >> shifts) & levels  # [..., W, vpb]
    code = code.reshape(packed.shape[:-1] + (packed.shape[-1] * vpb,)).astype(jnp.float32)
    return offset[..., None] + scale[..., None] * code


def check_packed_width(packed_width: int, r: int, bits: int) -> None:
    """Raise unless ``packed_width`` bytes hold exactly ``r`` codes of ``bits`` bits."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits!r}")
    if r * bits != 8 * packed_width:
        raise ValueError(f"the label cache packs {packed_width} bytes per token, but r={r} channels "
                         f"of {bits} bits need {r * bits / 8:g}: wrong channels or bits?")


# ----------------------------------------------------------------------------
# References
# ----------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("bits",))
def build_label_cache_reference(k, channels, *, bits=4):
    """``LabelCache`` of every position of ``k`` (see module docstring)."""
    packed, scale, offset = _quantize(_gather_channels(k, channels), bits)
    return LabelCache(packed, scale, offset)


@functools.partial(jax.jit, static_argnames=("bits",))
def update_label_cache_reference(cache, k_new, channels, positions, *, bits=4):
    """Write the labels of ``k_new [B, Hkv, D]`` at ``positions[b]`` (one token per row).

    Positions outside ``[0, S)`` leave the row unchanged.
    """
    check_packed_width(cache.packed.shape[-1], channels.shape[-1], bits)
    packed, scale, offset = _quantize(_gather_channels(k_new, channels), bits)
    s = cache.packed.shape[2]
    positions = positions.astype(jnp.int32)
    # Negative indices would wrap in .at[]; send them out of range to be dropped.
    pos = jnp.where((positions >= 0) & (positions < s), positions, s)
    rows = jnp.arange(cache.packed.shape[0])
    return LabelCache(
        cache.packed.at[rows, :, pos].set(packed, mode="drop"),
        cache.scale.at[rows, :, pos].set(scale, mode="drop"),
        cache.offset.at[rows, :, pos].set(offset, mode="drop"),
    )


@functools.partial(jax.jit, static_argnames=("bits",))
def dequantize_labels(cache, *, bits=4):
    """``float32[B, Hkv, S, r]``: the labels as the scorer sees them (reference helper)."""
    return _dequantize(cache.packed, cache.scale, cache.offset, bits)


def _valid_positions(pos, idx, counts, lengths, seq_len):
    """Mask shared by the reference and the kernel's wrapper semantics."""
    b = pos.shape[0]
    length = jnp.clip(lengths.astype(jnp.int32), 0, seq_len).reshape(b, 1, 1)
    valid = (pos >= 0) & (pos < length)
    if counts is not None:
        valid &= idx < counts.astype(jnp.int32)[:, :, None]
    return valid


@functools.partial(jax.jit, static_argnames=("scale", "bits"))
def label_scores_reference(q, labels, channels, candidates=None, counts=None, *, lengths=None,
                           scale=None, bits=4):
    """``float32[B, Hkv, C]`` (C = S when ``candidates`` is None). See module docstring."""
    b, hq, d = q.shape
    _, hkv, s, w = labels.packed.shape
    g = hq // hkv
    check_packed_width(w, channels.shape[-1], bits)
    sm_scale = (1.0 / math.sqrt(d)) if scale is None else scale
    if lengths is None:
        lengths = jnp.full((b,), s, jnp.int32)
    if candidates is None:
        pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, hkv, s))
        counts = None
    else:
        pos = candidates.astype(jnp.int32)
    c = pos.shape[-1]
    idx = jnp.arange(c, dtype=jnp.int32)[None, None, :]
    valid = _valid_positions(pos, idx, counts, lengths, s)
    posc = jnp.clip(pos, 0, s - 1)
    # Gather the candidates' labels first, then dequantize only those.
    packed = jnp.take_along_axis(labels.packed, posc[..., None], axis=2)
    lscale = jnp.take_along_axis(labels.scale, posc, axis=2)
    loffset = jnp.take_along_axis(labels.offset, posc, axis=2)
    x = _dequantize(packed, lscale, loffset, bits)  # [B, Hkv, C, r]
    qc = _gather_channels(q.reshape(b, hkv, g, d), channels)  # [B, Hkv, G, r]
    logits = jnp.einsum("bhgr,bhcr->bhgc", qc, x, precision=jax.lax.Precision.HIGHEST) * sm_scale
    logits = jnp.where(valid[:, :, None, :], logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.exp(logits - m)
    denom = jnp.sum(e, axis=-1, keepdims=True)
    p = e / jnp.where(denom > 0, denom, 1.0)
    return jnp.mean(p, axis=2)


# ----------------------------------------------------------------------------
# Kernel: build the label cache
# ----------------------------------------------------------------------------


def _build_body(chan_ref, k_ref, packed_ref, scale_ref, offset_ref, *, seq_len, block_s, vpb, bits):
    # chan_ref: [vpb, W] int32 (this head's channels in packing order);
    # k_ref: [S, D]; packed_ref: [S, W] uint8; scale_ref/offset_ref: [S] f32.
    t = pl.program_id(2)
    levels = (1 << bits) - 1
    tok = t * block_s + jnp.arange(block_s, dtype=jnp.int32)
    valid = tok < seq_len
    tokc = jnp.minimum(tok, seq_len - 1)  # tail rows read a valid row, never stored
    # One pointer gather per code slot: xs[i][s, w] = k[tok s, channel w*vpb + i].
    xs = [k_ref[tokc[:, None], chan_ref[i, :][None, :]].astype(jnp.float32) for i in range(vpb)]
    lo = functools.reduce(jnp.minimum, [jnp.min(x, axis=1) for x in xs])
    hi = functools.reduce(jnp.maximum, [jnp.max(x, axis=1) for x in xs])
    scale = (hi - lo) * (1.0 / levels)  # a multiply: bitwise equal in XLA and Triton
    safe = jnp.where(scale > 0, scale, 1.0)
    packed = None
    for i, x in enumerate(xs):
        # Triton lowers f32 `/` to div.full.f32 (<= 2 ulp), so on a GPU a code
        # can differ from the reference's by one at a near-exact .5 tie.
        code = jnp.floor((x - lo[:, None]) / safe[:, None] + 0.5)
        code = jnp.clip(code, 0.0, float(levels)).astype(jnp.int32)
        part = code << (bits * i) if i else code
        packed = part if packed is None else packed | part
    plgpu.store(packed_ref.at[pl.ds(t * block_s, block_s), :], packed.astype(jnp.uint8),
                mask=valid[:, None])
    plgpu.store(scale_ref.at[pl.ds(t * block_s, block_s)], scale, mask=valid)
    plgpu.store(offset_ref.at[pl.ds(t * block_s, block_s)], lo, mask=valid)


@functools.partial(
    jax.jit, static_argnames=("bits", "block_s", "num_warps", "num_stages", "interpret"))
def build_label_cache_kernel(k, channels, *, bits=4, block_s=128, num_warps=4, num_stages=2,
                             interpret=False):
    """Pallas kernel for ``build_label_cache``: grid ``(B, Hkv, ceil(S / block_s))``.

    Needs a power-of-two packed width ``r * bits // 8`` and ``block_s``.
    """
    b, hkv, s, d = k.shape
    r = channels.shape[-1]
    vpb = 8 // bits
    w = r // vpb
    if not (_is_pow2(w) and _is_pow2(block_s)):
        raise ValueError("build_label_cache_kernel needs power-of-two r*bits//8 and block_s")
    # channel w*vpb + i goes to slot i of byte w.
    chan = channels.astype(jnp.int32).reshape(hkv, w, vpb).transpose(0, 2, 1)
    body = functools.partial(_build_body, seq_len=s, block_s=block_s, vpb=vpb, bits=bits)
    meta = jax.ShapeDtypeStruct((b, hkv, s), jnp.float32)
    meta_spec = pl.BlockSpec((None, None, s), lambda i, j, t: (i, j, 0))
    packed, scale, offset = pl.pallas_call(
        body,
        grid=(b, hkv, pl.cdiv(s, block_s)),
        in_specs=[
            pl.BlockSpec((None, vpb, w), lambda i, j, t: (j, 0, 0)),
            pl.BlockSpec((None, None, s, d), lambda i, j, t: (i, j, 0, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, s, w), lambda i, j, t: (i, j, 0, 0)),
            meta_spec,
            meta_spec,
        ],
        out_shape=[jax.ShapeDtypeStruct((b, hkv, s, w), jnp.uint8), meta, meta],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="build_label_cache",
    )(chan, k)
    return LabelCache(packed, scale, offset)


# ----------------------------------------------------------------------------
# Kernel: label scores (raw logits + per-tile softmax statistics) + epilogue
# ----------------------------------------------------------------------------


def _scores_body(len_ref, cnt_ref, cand_ref, q_ref, qsum_ref, packed_ref, scale_ref, offset_ref,
                 logit_ref, m_ref, l_ref, *, seq_len, num_cand, block_c, group, group_pad, vpb,
                 bits, dense):
    # len_ref, cnt_ref: []; cand_ref: [C] int32; q_ref: [vpb, Gp, W] f32 (channel-
    # gathered query, pre-scaled, in packing order, zero rows past G); qsum_ref:
    # [Gp]; packed_ref: [S, W] uint8; scale_ref/offset_ref: [S] f32.
    # logit_ref: [G, C]; m_ref/l_ref: [NT, G].
    t = pl.program_id(2)
    levels = (1 << bits) - 1
    idx = t * block_c + jnp.arange(block_c, dtype=jnp.int32)
    in_c = idx < num_cand
    if dense:
        pos = idx
    else:
        pos = plgpu.load(cand_ref.at[pl.ds(t * block_c, block_c)], mask=in_c, other=0)
    length = jnp.clip(len_ref[()], 0, seq_len)
    valid = in_c & (idx < cnt_ref[()]) & (pos >= 0) & (pos < length)
    # Entries past the count may hold anything: clamp so every gather address
    # is inside this (b, kv-head)'s cache, then mask the results.
    posc = jnp.clip(pos, 0, seq_len - 1)
    packed = packed_ref[posc, :].astype(jnp.int32)  # [TC, W] row gather
    lscale = scale_ref[posc]  # [TC]
    loffset = offset_ref[posc]

    dots = None  # [Gp, TC]: sum_c q_hc * code_c
    for i in range(vpb):
        code = packed >> (bits * i) if i else packed
        code = (code & levels).astype(jnp.float32)  # [TC, W]
        qi = q_ref[i]  # [Gp, W]
        # G x W is too small for tensor cores (M, K >= 16); broadcast FMA + reduce.
        part = jnp.sum(qi[:, None, :] * code[None, :, :], axis=2)
        dots = part if dots is None else dots + part
    logits = dots * lscale[None, :] + qsum_ref[...][:, None] * loffset[None, :]
    logits = jnp.where(valid[None, :], logits, -jnp.inf)

    m = jnp.max(logits, axis=1)  # [Gp]
    m_safe = jnp.where(m == -jnp.inf, 0.0, m)  # all-masked tile: avoid inf - inf
    e = jnp.where(valid[None, :], jnp.exp(logits - m_safe[:, None]), 0.0)
    l = jnp.sum(e, axis=1)

    gmask = jnp.arange(group_pad, dtype=jnp.int32) < group
    plgpu.store(logit_ref.at[pl.ds(0, group_pad), pl.ds(t * block_c, block_c)], logits,
                mask=gmask[:, None] & in_c[None, :])
    plgpu.store(m_ref.at[t, pl.ds(0, group_pad)], m, mask=gmask)
    plgpu.store(l_ref.at[t, pl.ds(0, group_pad)], l, mask=gmask)


def label_scores_epilogue(logits, tile_max, tile_sum):
    """Softmax over C from raw logits + per-tile stats, then mean over G.

    logits ``[B, Hkv, G, C]``, tile_max/tile_sum ``[B, Hkv, NT, G]`` -> ``[B, Hkv, C]``.
    """
    m = jnp.max(tile_max, axis=2)  # [B, Hkv, G]
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    total = jnp.sum(tile_sum * jnp.exp(tile_max - m[:, :, None, :]), axis=2)
    inv = jnp.where(total > 0, 1.0 / jnp.where(total > 0, total, 1.0), 0.0)
    p = jnp.exp(logits - m[..., None]) * inv[..., None]
    return jnp.mean(p, axis=2)


@functools.partial(
    jax.jit,
    static_argnames=("scale", "bits", "block_c", "num_warps", "num_stages", "interpret",
                     "return_raw"),
)
def label_scores_kernel(q, labels, channels, candidates=None, counts=None, *, lengths=None,
                        scale=None, bits=4, block_c=64, num_warps=4, num_stages=2, interpret=False,
                        return_raw=False):
    """Pallas path of ``label_scores`` (kernel + jnp epilogue).

    ``block_c`` (power of two) candidates per program; the packed width
    ``r * bits // 8`` must be a power of two. ``return_raw=True`` returns the
    kernel's ``(logits [B, Hkv, G, C], tile_max, tile_sum)`` instead.
    """
    b, hq, d = q.shape
    _, hkv, s, w = labels.packed.shape
    g = hq // hkv
    r = channels.shape[-1]
    check_packed_width(w, r, bits)
    vpb = 8 // bits
    if not (_is_pow2(w) and _is_pow2(block_c)):
        raise ValueError("label_scores_kernel needs power-of-two r*bits//8 and block_c")
    sm_scale = (1.0 / math.sqrt(d)) if scale is None else scale
    gp = pl.next_power_of_2(g)

    # The query side is tiny (B*Hq*r floats): prepare it in jnp. Pre-scaled,
    # in packing order [vpb, W], padded to Gp heads with zeros.
    qc = _gather_channels(q.reshape(b, hkv, g, d), channels) * sm_scale  # [B, Hkv, G, r]
    qsum = jnp.sum(qc, axis=-1)
    qc = qc.reshape(b, hkv, g, w, vpb).transpose(0, 1, 4, 2, 3)  # [B, Hkv, vpb, G, W]
    if gp != g:
        qc = jnp.pad(qc, ((0, 0), (0, 0), (0, 0), (0, gp - g), (0, 0)))
        qsum = jnp.pad(qsum, ((0, 0), (0, 0), (0, gp - g)))

    dense = candidates is None
    if dense:
        c = s
        cand = jnp.zeros((b, hkv, 1), jnp.int32)  # unused placeholder
    else:
        c = candidates.shape[-1]
        cand = candidates.astype(jnp.int32)
    if counts is None or dense:
        counts = jnp.full((b, hkv), c, jnp.int32)
    if lengths is None:
        lengths = jnp.full((b,), s, jnp.int32)
    nt = pl.cdiv(c, block_c)

    body = functools.partial(
        _scores_body, seq_len=s, num_cand=c, block_c=block_c, group=g, group_pad=gp, vpb=vpb,
        bits=bits, dense=dense)
    meta_spec = pl.BlockSpec((None, None, s), lambda i, j, t: (i, j, 0))
    stat_spec = pl.BlockSpec((None, None, nt, g), lambda i, j, t: (i, j, 0, 0))
    stat = jax.ShapeDtypeStruct((b, hkv, nt, g), jnp.float32)
    logits, tmax, tsum = pl.pallas_call(
        body,
        grid=(b, hkv, nt),
        in_specs=[
            pl.BlockSpec((None,), lambda i, j, t: (i,)),
            pl.BlockSpec((None, None), lambda i, j, t: (i, j)),
            pl.BlockSpec((None, None, cand.shape[-1]), lambda i, j, t: (i, j, 0)),
            pl.BlockSpec((None, None, vpb, gp, w), lambda i, j, t: (i, j, 0, 0, 0)),
            pl.BlockSpec((None, None, gp), lambda i, j, t: (i, j, 0)),
            pl.BlockSpec((None, None, s, w), lambda i, j, t: (i, j, 0, 0)),
            meta_spec,
            meta_spec,
        ],
        out_specs=[
            pl.BlockSpec((None, None, g, c), lambda i, j, t: (i, j, 0, 0)),
            stat_spec,
            stat_spec,
        ],
        out_shape=[jax.ShapeDtypeStruct((b, hkv, g, c), jnp.float32), stat, stat],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="label_scores",
    )(lengths.astype(jnp.int32), counts.astype(jnp.int32), cand, qc, qsum, labels.packed,
      labels.scale, labels.offset)
    if return_raw:
        return logits, tmax, tsum
    return label_scores_epilogue(logits, tmax, tsum)
