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

Block-structured candidates (``block_label_scores_*``): ``block_ids
int32[B, Hkv, NBsel]`` + ``block_counts`` + ``lengths`` + static ``block_size``
stand for the candidates ``block_ids[..., j] * block_size + arange(block_size)``
(output in that order, ``[B, Hkv, NBsel * block_size]``); masked: slots at or
past the count, ids outside ``[0, ceil(S / block_size))``, tokens at or past
``min(lengths[b], S)`` (see ``expand_blocks``). Same numbers as
``label_scores`` on the expanded positions, without a candidate array.

Kernel design (``label_scores_kernel`` / ``block_label_scores_kernel``, modes
"two_pass" and "logits"). The earlier design (mode "per_tile": one program per
64-candidate tile, a 3-D broadcast product reduced across lanes) compiled to a
warp-shuffle reduction per product (~2300 instructions per candidate) and ran
several times slower (docs/kernels.md, 'Measured reasons for kernel choices'). Now:

* grid ``(B, Hkv, P)``: ``P = splits`` programs per (b, kv-head) row, by
  default as many as the GPU holds at once (``choose_splits`` with
  ``programs_per_sm``, a register estimate: 2 programs of 4 warps per SM with
  the query in registers, 3 without), so one wave; each program loops over
  its contiguous share of tiles of ``block_c = 32 * num_warps`` candidates:
  one candidate per thread.
* a thread loads its candidate's packed row with one vector load, reassembled
  as little-endian 32-bit words (LLVM folds that back into the loaded
  registers), unpacks each code with a shift, a mask and an int-to-float
  conversion, and accumulates ``q . code`` for each head in FMA chains inside
  the thread: no cross-thread reduction, no shared memory in the loop. The query
  (``G * r`` floats, prepared by one small XLA fusion: channel gather, scale,
  field order) stays in registers across the loop when ``G * (r + 16) <= 192``
  (``hoist_q``; G=4, r=32 fits), else it is reloaded from L1 every tile. Dequantization is
  folded into the dot: ``sum_c q_c (offset + scale * code_c) = offset *
  sum_c q_c + scale * (q . code)``.
* software pipeline (``prefetch`` = D, default 2): at step t the rows of tile
  t+D and the candidate ids of tile t+2D are loaded; the loop body is unrolled
  D times with fixed register slots, and each tile's work sits in a branch
  (``lax.cond``, which also skips tiles past the count) so the scheduler keeps
  the loads ahead of it. The block path makes positions in registers from the
  block ids (a tile's rows are then consecutive).
* softmax statistics are online per lane (running max and sum of exp, one exp
  per candidate and head), reduced across lanes once per program into
  ``(max, sum) [B, Hkv, P, G]``.
* "two_pass": kernel 1 writes only those statistics; kernel 2 combines the P
  partials of its row and recomputes the logits (their label rows are L2-warm)
  to write ``mean_g exp(logit - M_g) / L_g`` directly: no logits round trip,
  no XLA epilogue. "logits": one kernel writes raw logits ``[B, Hkv, G, C]``
  (-inf where masked) and the statistics, and a memory-bound Pallas kernel
  normalizes. Per tile of 128 candidates at G=4, r=32 the compute is ~350 SASS
  instructions a thread (128 FFMA) with ~230 registers (2 programs of 4 warps
  per SM), spill-free (offline sm_90 compile).

Measured with ``benchmarks/probes/label_scores_probe.py`` (the times: docs/kernels.md,
'Measured reasons for kernel choices'): "logits" is the fastest mode, "two_pass" next, the
old "per_tile" far behind, at B=8 and B=1. Block ids or a candidate array cost the same;
random (non-block) candidates are bound by scattered 32-byte sectors (row, scale and offset
are three arrays). The prefetch depth made no difference, so the kernel is issue-bound
(~370 instructions per candidate at ~0.5 IPC per scheduler with 2 warps each): ``hoist_q=False`` (query reloaded from L1, ~130
registers, 3 programs per SM, ~10% more instructions) may trade better.

Tuning (all static): ``mode`` (default "logits"), ``block_c`` (power of two;
keep it ``32 * num_warps``: other values need layout conversions), ``num_warps``
(default 4), ``num_stages`` (default 1: the pipelining is explicit),
``splits``, ``prefetch`` (0-3), ``hoist_q`` (None = auto), ``q_prep`` ("xla" or "kernel":
where the channel-gathered query is made), ``head_split`` (default 1; "logits" only): the
G heads split over that many programs per tile range, each holding G / head_split heads'
query in registers (half the registers at 2, so more warps an SM to hide the gathers), the
labels of a tile read by each of them (adjacent programs: mostly from the L2).

``build_label_cache_kernel``: grid ``(B, Hkv, ceil(S / block_s))``; for each of
the ``8 // bits`` code slots of a byte one 2-D pointer gather
``k[tokens, channels_of_slot]`` (``block_s x W``), then min/max, quantize and
pack in registers; masked stores for the tail tile. Tuning: ``block_s``
(default 128), ``num_warps``, ``num_stages``.

Triton constraints: in-kernel tensors need power-of-two sizes, so the packed
width ``r * bits // 8`` and the tiles must be powers of two (the public op
falls back to the reference otherwise); G and the block size may be anything
(heads are a static loop; "per_tile" pads G to a power of two with zero query
rows whose outputs are never stored).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._util import exp_fast, fma_f32, next_pow2

__all__ = [
    "LabelCache",
    "LabelRecords",
    "record_layout",
    "interleave_labels",
    "deinterleave_labels",
    "SUPPORTED_BITS",
    "build_label_cache_reference",
    "update_label_cache_reference",
    "dequantize_labels",
    "label_scores_reference",
    "build_label_cache_kernel",
    "label_scores_kernel",
    "label_scores_epilogue",
    "check_packed_width",
    "expand_blocks",
    "block_label_scores_reference",
    "block_label_scores_kernel",
    "choose_splits",
    "MODES",
    "TUNING_KEYS",
]

SUPPORTED_BITS = (2, 4, 8)


class LabelCache(NamedTuple):
    """Double-Sparsity label cache (a pytree). See the module docstring."""

    packed: jax.Array  # uint8[B, Hkv, S, r * bits // 8]
    scale: jax.Array  # float32[B, Hkv, S]
    offset: jax.Array  # float32[B, Hkv, S]


class LabelRecords(NamedTuple):
    """The label cache interleaved, one record per token (a pytree): ``int32[B, Hkv, S, Wr]``.

    A record holds the token's ``nw = r * bits // 32`` little-endian code words (the
    bytes of ``LabelCache.packed``, four to a word), then its f32 scale and offset as
    raw bits, then zero words up to ``Wr = next_pow2(nw + 2)`` (Triton tensors are
    powers of two): 16 B at r=16, 32 B at r=32 (INT4). A scattered candidate then
    costs one 32-byte sector instead of three (row, scale and offset in three
    arrays), at the price of the padding at r=32 (24 B used of 32).
    """

    words: jax.Array  # int32[B, Hkv, S, Wr]


def record_layout(r: int, bits: int) -> tuple[int, int]:
    """``(nw, Wr)``: code words and record words per token (:class:`LabelRecords`);
    ValueError when the codes are not whole 32-bit words (``r * bits % 32``)."""
    if (r * bits) % 32:
        raise ValueError(f"label records need whole 32-bit code words: r * bits = {r} * {bits} is not a "
                         "multiple of 32")
    nw = r * bits // 32
    return nw, next_pow2(nw + 2)


def check_record_width(words: int, r: int, bits: int) -> int:
    """``nw`` (code words a token) of records of ``r`` channels at ``bits``, whose
    ``words`` a token must be :func:`record_layout`'s; ValueError otherwise."""
    nw, wr = record_layout(r, bits)
    if words != wr:
        raise ValueError(f"label records of r={r}, bits={bits} hold {wr} words a token, got {words}")
    return nw


@functools.partial(jax.jit, static_argnames=("bits",))
def interleave_labels(cache, *, bits=4) -> LabelRecords:
    """:class:`LabelRecords` of a :class:`LabelCache` (the same numbers, one array)."""
    b, hkv, s, w = cache.packed.shape
    nw, wr = record_layout(w * 8 // bits, bits)
    code = lax.bitcast_convert_type(cache.packed.reshape(b, hkv, s, nw, 4), jnp.int32)  # little-endian words
    meta = lax.bitcast_convert_type(jnp.stack([cache.scale, cache.offset], -1).astype(jnp.float32), jnp.int32)
    pad = jnp.zeros((b, hkv, s, wr - nw - 2), jnp.int32)
    return LabelRecords(jnp.concatenate([code, meta, pad], axis=-1))


@functools.partial(jax.jit, static_argnames=("r", "bits"))
def deinterleave_labels(records: LabelRecords, *, r: int, bits=4) -> LabelCache:
    """The :class:`LabelCache` of :class:`LabelRecords` (``r`` channels a token)."""
    words = records.words
    nw = check_record_width(words.shape[-1], r, bits)
    packed = lax.bitcast_convert_type(words[..., :nw], jnp.uint8).reshape(words.shape[:3] + (nw * 4,))
    meta = lax.bitcast_convert_type(words[..., nw:nw + 2], jnp.float32)
    return LabelCache(packed, meta[..., 0], meta[..., 1])


def as_label_cache(labels, r: int, bits: int):
    """``labels`` as a :class:`LabelCache` (records are de-interleaved)."""
    return deinterleave_labels(labels, r=r, bits=bits) if isinstance(labels, LabelRecords) else labels


def label_dims(labels, r: int, bits: int) -> tuple[int, int, int, int]:
    """``(B, Hkv, S, W)`` with ``W`` the packed code bytes a token, of either layout
    (records: their width checked against ``r`` and ``bits``)."""
    if isinstance(labels, LabelRecords):
        b, hkv, s, wr = labels.words.shape
        return b, hkv, s, check_record_width(wr, r, bits) * 4
    return labels.packed.shape


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


def update_label_records_reference(records, k_new, channels, positions, *, bits=4):
    """:func:`update_label_cache_reference` on :class:`LabelRecords`: one whole record
    (codes, scale, offset, padding) written per row; positions outside ``[0, S)``
    leave the row unchanged."""
    b, hkv, s, wr = records.words.shape
    check_record_width(wr, channels.shape[-1], bits)
    packed, scale, offset = _quantize(_gather_channels(k_new, channels), bits)  # [B, Hkv, W], [B, Hkv]
    one = interleave_labels(LabelCache(packed[:, :, None], scale[:, :, None], offset[:, :, None]), bits=bits)
    positions = positions.astype(jnp.int32)
    pos = jnp.where((positions >= 0) & (positions < s), positions, s)
    rows = jnp.arange(b)
    return LabelRecords(records.words.at[rows, :, pos].set(one.words[:, :, 0], mode="drop"))


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
    """``float32[B, Hkv, C]`` (C = S when ``candidates`` is None). See module docstring.
    ``labels``: a :class:`LabelCache` or :class:`LabelRecords`."""
    labels = as_label_cache(labels, channels.shape[-1], bits)
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


def _per_tile_scores(q, labels, channels, candidates=None, counts=None, *, lengths=None,
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


# ----------------------------------------------------------------------------
# Kernel: label scores, looped programs (grid (B, Hkv, splits))
# ----------------------------------------------------------------------------

# Running max of a lane that has seen no valid candidate yet (finite: no inf - inf).
_STAT_FLOOR = -1e30

MODES = ("two_pass", "logits", "per_tile")
#: where the looped kernels' query side is made: "xla" (``_prepare_query``, a fusion before
#: the kernel) or "kernel" (gathered by each program into registers; needs ``hoist_q``)
Q_PREPS = ("xla", "kernel")




@functools.cache
def _num_sms() -> int:
    try:
        dev = jax.devices()[0]
        if dev.platform == "gpu":
            return int(getattr(dev, "core_count", 0) or 0) or 132
    except RuntimeError:
        pass
    return 132  # H100 SXM


def programs_per_sm(group: int, r: int, num_warps: int, hoist_q: bool) -> int:
    """Resident programs per SM, from a register estimate fitted to offline
    sm_90 compiles of the looped kernels (G=4, r=32: ~230 registers with the
    query in registers, ~130 without; G=8, r=32 without: ~190)."""
    regs = 72 + 16 * group + (group * r if hoist_q else 0)
    regs = min(256, -(-regs // 8) * 8)
    return max(1, min(64 // num_warps, 65536 // (regs * 32 * num_warps)))


def choose_splits(rows: int, num_tiles: int, per_sm: int = 2, splits=None) -> int:
    """Programs per (b, kv-head) row, at most the number of tiles.

    Default: as many as the GPU holds at once, ``SMs * per_sm // rows`` (one
    wave; every program loops over its share), at least 1.
    """
    if splits is None:
        splits = max(1, (_num_sms() * per_sm) // max(1, rows))
    splits = int(splits)
    if splits < 1:
        raise ValueError(f"splits must be >= 1, got {splits}")
    return max(1, min(splits, num_tiles))


def check_head_split(head_split, group: int | None = None, mode: str | None = None) -> None:
    """``head_split`` (programs a tile range's heads are split over) must be a positive int
    dividing the group, and above 1 only in the "logits" mode: the other modes sum the heads'
    probabilities inside a program."""
    if isinstance(head_split, bool) or not isinstance(head_split, (int, np.integer)) or head_split < 1:
        raise ValueError(f"head_split must be a positive int or None, got {head_split!r}")
    if head_split > 1 and mode not in (None, "logits"):
        raise ValueError(f"head_split > 1 needs mode 'logits' (mode {mode!r} sums the heads in one program)")
    if group is not None and group % head_split:
        raise ValueError(f"head_split {head_split} must divide the GQA group of {group} query heads")


def _combine_stats(m_in, l_in, group):
    """Per head: the global max (0 when empty) and ``1 / (G * sum)`` (0 when empty)
    from the per-program ``(max, sum-exp)`` refs ``[P, G]``."""
    npart = m_in.shape[0]
    npad = next_pow2(npart)  # in-kernel tensors: power-of-two sizes
    ok = jnp.arange(npad, dtype=jnp.int32) < npart
    maxes, weights = [], []
    for g in range(group):
        mg = plgpu.load(m_in.at[pl.ds(0, npad), jnp.int32(g)], mask=ok, other=-jnp.inf)
        lg = plgpu.load(l_in.at[pl.ds(0, npad), jnp.int32(g)], mask=ok, other=0.0)
        big = jnp.max(mg)
        big = jnp.where(big == -jnp.inf, 0.0, big)
        tot = jnp.sum(lg * jnp.exp(mg - big))
        weights.append(jnp.where(tot > 0, (1.0 / group) / jnp.where(tot > 0, tot, 1.0), 0.0))
        maxes.append(big)
    return maxes, weights


_MAGIC = np.int32(0x4B000000)  # the f32 2**23: OR-ed into 23 low bits v, it reads as 2**23 + v
_MAGIC_SHIFT = 12  # fields ending above bit 23 are read from the word shifted right this much


def _field_exponents(bits: int) -> list[int]:
    """``e_k`` per code field ``k`` of a 32-bit word: ``_scaled_codes`` returns code * 2**e_k."""
    return [bits * k - (0 if bits * k + bits <= 23 else _MAGIC_SHIFT) for k in range(32 // bits)]


def _scaled_codes(x, bits: int):
    """The ``32 // bits`` code fields of int32 words ``x``, as f32 ``code * 2**e_k``
    (``_field_exponents``), without an int-to-float conversion.

    Field k is masked where it lies (shifted right by ``_MAGIC_SHIFT`` first if it ends
    above bit 23), OR-ed into the f32 2**23, and 2**23 is subtracted: one LOP3 and one
    FADD a code, against a shift, a sign extension and a conversion (I2FP) in the SASS
    of the plain unpack. At v13 the label kernel was bound by instruction issue (ncu on
    the H200); this and ``fma_f32`` cut its instructions a candidate by a quarter
    (docs/kernels.md, 'Nsight Compute on the step', label logits).
    """
    levels = (1 << bits) - 1
    high = lax.shift_right_logical(x, np.int32(_MAGIC_SHIFT))
    out = []
    for k, e in enumerate(_field_exponents(bits)):
        src = x if e == bits * k else high
        v = (src & np.int32(levels << e)) | _MAGIC
        out.append(lax.bitcast_convert_type(v, jnp.float32) - np.float32(2.0 ** 23))
    return out


def _looped_body(len_ref, cnt_ref, src_ref, q_ref, *refs, phase, source, seq_len, num_cand, block_c,
                 tiles_per_prog, num_tiles, group, bits, block_size, num_block_slots, words, hoist_q,
                 prefetch, fields, nper, record=False, masked_score=0.0, interpret=False, q_prep="xla",
                 sm_scale=1.0, head_split=1):
    # len_ref: []; cnt_ref: [] (candidate count, or block count for "blocks");
    # src_ref: [C] candidate ids ("array"), [NBsel] block ids ("blocks"), unused
    # ("dense"); q_ref: [F, G, N] f32, the channel-gathered pre-scaled query by
    # field (see _prepare_query), or with q_prep="kernel" the raw query [G, D] and
    # then chan_ref [r] (this KV head's channels); then the labels: packed_ref [S, W] uint8,
    # scale_ref, offset_ref [S] f32; or with ``record`` rec_ref [S, Wr] int32
    # (LabelRecords: N code words, scale and offset bits, padding). rest by phase:
    #   "stats":  m_ref, l_ref [P, G]                  (outputs)
    #   "logits": logit_ref [G, C], m_ref, l_ref [P, G] (outputs)
    #   "scores": m_in, l_in [P, G] (inputs), out_ref [C] (output)
    chan_ref = None
    if q_prep == "kernel":
        chan_ref, refs = refs[0], refs[1:]
    if record:
        rec_ref, rest = refs[0], refs[1:]
        width = nper  # code words a token
    else:
        packed_ref, scale_ref, offset_ref = refs[:3]
        rest = refs[3:]
        width = packed_ref.shape[-1]
    tc = block_c
    fma = functools.partial(fma_f32, interpret=interpret)
    exp = functools.partial(exp_fast, interpret=interpret)  # MUFU ex2 on the GPU, jnp.exp on the CPU
    levels = (1 << bits) - 1
    vpb = 8 // bits
    lanes = jnp.arange(tc, dtype=jnp.int32)
    # with head_split > 1, programs p * head_split + h share tile range p, each with its own
    # ``group`` heads (its blocks of the query, the logits and the statistics)
    p = pl.program_id(2) if head_split == 1 else lax.div(pl.program_id(2), np.int32(head_split))
    t_first = p * tiles_per_prog
    t_last = jnp.minimum(t_first + tiles_per_prog, num_tiles)  # this program's tiles: [t_first, t_last)
    length = jnp.clip(len_ref[()], 0, seq_len)
    if source == "dense":
        limit = length  # pos == index: nothing at or past the length is valid
    elif source == "array":
        limit = jnp.clip(cnt_ref[()], 0, num_cand)
    else:
        limit = jnp.clip(cnt_ref[()], 0, num_block_slots) * block_size
    # Tiles at or past the count hold no valid candidate: never loaded, only filled.
    t_work = jnp.clip(lax.div(limit + (tc - 1), tc), t_first, t_last)
    lim = jnp.minimum(limit, t_work * tc)  # prefetches past this program's work load nothing
    num_blocks_total = -(-seq_len // block_size) if source == "blocks" else 0

    def fetch_pos(t):
        """Cache positions of tile t's candidates, -1 where masked."""
        cidx = t * tc + lanes
        ok = cidx < lim
        if source == "dense":
            pos = cidx
        elif source == "array":
            pos = plgpu.load(src_ref.at[pl.ds(t * tc, tc)], mask=ok, other=0)
        else:
            slot = lax.div(cidx, block_size)
            bid = plgpu.load(src_ref.at[jnp.where(ok, slot, 0)], mask=ok, other=0)
            ok &= (bid >= 0) & (bid < num_blocks_total)  # also keeps bid * block_size from overflowing
            pos = bid * block_size + (cidx - slot * block_size)
        ok &= (pos >= 0) & (pos < length)
        return jnp.where(ok, pos, -1)

    def fetch_rows(pos):
        """Tile rows ``[TC, W]`` uint8 (or ``[TC, W/4]`` int32 words), scales, offsets."""
        ok = pos >= 0
        posc = jnp.maximum(pos, 0)
        cols = jnp.arange(width, dtype=jnp.int32)
        if record:
            # The code words, then scale and offset from the same record (the same
            # 32-byte sector): two vector loads, one memory transaction.
            rows = plgpu.load(rec_ref.at[posc[:, None], cols[None, :]], mask=ok[:, None], other=0)
            two = jnp.arange(2, dtype=jnp.int32)
            meta = plgpu.load(rec_ref.at[posc[:, None], width + two[None, :]], mask=ok[:, None], other=0)
            # an in-thread pick of each column (the row sits in one thread)
            lsc = lax.bitcast_convert_type(jnp.sum(jnp.where(two[None, :] == 0, meta, 0), axis=1), jnp.float32)
            loff = lax.bitcast_convert_type(jnp.sum(jnp.where(two[None, :] == 1, meta, 0), axis=1), jnp.float32)
            return rows, lsc, loff
        # One row per thread, contiguous along W: a single vector load per row.
        rows = plgpu.load(packed_ref.at[posc[:, None], cols[None, :]], mask=ok[:, None], other=0)
        lsc = plgpu.load(scale_ref.at[posc], mask=ok, other=0.0)
        loff = plgpu.load(offset_ref.at[posc], mask=ok, other=0.0)
        if words:
            # Little-endian 32-bit words: LLVM folds this back into the loaded
            # registers, so the prefetch queue holds 4 packed registers, not bytes.
            x = rows.astype(jnp.int32).reshape(tc, width // 4, 4)
            rows = jnp.sum(x << (8 * jnp.arange(4, dtype=jnp.int32))[None, None, :], axis=2)
        return rows, lsc, loff

    query = {}  # "qv" (hoisted: [F][G] of [N]) and "qsum" ([G]), read by logits_of when it is traced

    def hoist_query():
        # The query lives in registers across the loop; its channel sums come
        # from the same registers (in-thread: every thread holds all of it).
        if q_prep == "kernel":
            # _prepare_query's gather made here, once a program, in place of an XLA fusion
            # before the kernel: field f's word a is channel channels[a * F + f]
            lane = jnp.arange(nper, dtype=jnp.int32)
            qv = []
            for f in range(fields):
                chan = plgpu.load(chan_ref.at[lane * fields + f])  # [N]
                qv.append([plgpu.load(q_ref.at[jnp.int32(g), chan]).astype(jnp.float32) * np.float32(sm_scale)
                           for g in range(group)])
        else:
            qv = [[q_ref[jnp.int32(f), jnp.int32(g), :] for g in range(group)]
                  for f in range(fields)]
        # [TC] (every lane the same) rather than a scalar: reduced like the
        # products, inside each thread, with no cross-lane reduction.
        ones = jnp.ones((tc, nper), jnp.float32)
        query["qsum"] = [jnp.sum(functools.reduce(lambda a, b: a + b, [ones * qv[f][g][None, :]
                                                                      for f in range(len(qv))]), axis=1)
                         for g in range(group)]
        if words:
            # Codes unpacked in place (``_scaled_codes``): field f comes out times
            # 2**e_f, so its query weights carry 2**-e_f (exact: powers of two), once.
            qv = [[qv[f][g] * np.float32(2.0 ** -e) for g in range(group)]
                  for f, e in enumerate(_field_exponents(bits))]
        query["qv"] = qv

    # The gathered query (q_prep="kernel") is two dependent loads and a sum: with prefetch, made
    # after the first tiles' loads are issued (below), so that its latency overlaps theirs.
    defer_query = bool(hoist_q and q_prep == "kernel" and prefetch)
    if hoist_q:
        if not defer_query:
            hoist_query()
        load_q = lambda f, g, t: query["qv"][f][g]  # noqa: E731
    else:
        # Reloaded (L1 hits) every tile: the loop-variant mask keeps LLVM from
        # hoisting the loads and keeping them in registers anyway.
        def load_q(f, g, t):
            return plgpu.load(q_ref.at[jnp.int32(f), jnp.int32(g), pl.ds(0, nper)],
                              mask=jnp.full((nper,), t >= 0), other=0.0)

        query["qsum"] = [functools.reduce(lambda a, b: a + b, [jnp.sum(q_ref[jnp.int32(f), jnp.int32(g), :])
                                                              for f in range(fields)])
                         for g in range(group)]

    def logits_of(t, rows, lsc, loff):
        x = rows.astype(jnp.int32)
        if words and hoist_q:  # field k of word a is channel a * (32 // bits) + k
            codes = _scaled_codes(x, bits)
        elif words:
            codes = [((x >> (bits * k)) & levels if k else x & levels).astype(jnp.float32)
                     for k in range(32 // bits)]
        else:  # slot i of byte j is channel j * vpb + i
            codes = [((x >> (bits * i)) & levels if vpb > 1 else x).astype(jnp.float32)
                     for i in range(vpb)]
        out = []
        for g in range(group):
            if words:
                # Many short fields: elementwise FMA chains over the fields (one FFMA a
                # code: fma_f32), then one row sum.
                acc = None
                for f, c in enumerate(codes):
                    qf = load_q(f, g, t)[None, :]
                    acc = c * qf if acc is None else fma(c, qf, acc)
                dot = jnp.sum(acc, axis=1)
            else:
                # Few wide fields: one in-thread row reduction (an FMA chain) per field.
                dot = None
                for f, c in enumerate(codes):
                    part = jnp.sum(c * load_q(f, g, t)[None, :], axis=1)
                    dot = part if dot is None else dot + part
            out.append(fma(dot, lsc, query["qsum"][g] * loff))  # dequantization folded in
        return out

    if phase == "scores":
        m_in, l_in, out_ref = rest
        maxes, weights = _combine_stats(m_in, l_in, group)
        stats0 = ()
    else:
        if phase == "logits":
            logit_ref, m_ref, l_ref = rest
        else:
            m_ref, l_ref = rest
        floor = jnp.full((tc,), _STAT_FLOOR, jnp.float32)
        zero = jnp.zeros((tc,), jnp.float32)
        stats0 = tuple(floor for _ in range(group)) + tuple(zero for _ in range(group))

    def compute(t, pos, rows, lsc, loff, stats):
        valid = pos >= 0
        logits = logits_of(t, rows, lsc, loff)
        in_c = t * tc + lanes < num_cand
        if phase == "scores":
            acc = None
            for g in range(group):
                e = exp(logits[g] - maxes[g]) * weights[g]
                acc = e if acc is None else acc + e
            plgpu.store(out_ref.at[pl.ds(t * tc, tc)], jnp.where(valid, acc, masked_score), mask=in_c)
            return stats
        if phase == "logits":
            for g in range(group):
                plgpu.store(logit_ref.at[jnp.int32(g), pl.ds(t * tc, tc)],
                            jnp.where(valid, logits[g], -jnp.inf), mask=in_c)
        # Per-lane online softmax statistics (combined across lanes once, at
        # the end): one exp per candidate and head, no cross-thread work.
        ms, ls = list(stats[:group]), list(stats[group:])
        for g in range(group):
            d = logits[g] - ms[g]
            e = exp(-jnp.abs(d))
            up = d > 0
            ms[g] = jnp.where(valid & up, logits[g], ms[g])
            ls[g] = jnp.where(valid, jnp.where(up, fma(ls[g], e, 1.0), ls[g] + e), ls[g])
        return tuple(ms) + tuple(ls)

    n_work = t_work - t_first

    def guarded(t, tile, stats):
        # A branch, not just masks: tiles past the work are skipped, and the
        # loads issued before it stay there (the scheduler does not move code
        # across the branch), so prefetches are issued a whole step early.
        return lax.cond(t < t_work, lambda tl, st: compute(t, *tl, st), lambda tl, st: st,
                        tile, stats)

    if prefetch:
        # Software pipeline ``prefetch`` (D) tiles deep: at step t the rows of
        # tile t+D are loaded (with positions loaded at step t-D) and the
        # positions of tile t+2D, then tile t is computed. The body is unrolled
        # D times and step k always uses queue slot k, so a slot's registers
        # are written by its load and read D steps later (a rotating queue
        # would need register moves, which wait for the loads).
        d = prefetch
        rowq, posq = [], []
        for k in range(d):
            pos_k = fetch_pos(t_first + k)
            rowq.append((pos_k, *fetch_rows(pos_k)))
            posq.append(fetch_pos(t_first + d + k))
        if defer_query:
            hoist_query()

        def body(j, carry):
            rowq, posq, stats = carry
            rowq, posq = list(rowq), list(posq)
            for k in range(d):
                t = t_first + j * d + k
                pos_new = fetch_pos(t + 2 * d)
                rows_new = (posq[k], *fetch_rows(posq[k]))
                stats = guarded(t, rowq[k], stats)
                rowq[k], posq[k] = rows_new, pos_new
            return (tuple(rowq), tuple(posq), stats)

        init = (tuple(rowq), tuple(posq), stats0)
        stats = lax.fori_loop(0, lax.div(n_work + (d - 1), d), body, init)[-1]
    else:
        def body(j, stats):
            t = t_first + j
            pos = fetch_pos(t)
            return compute(t, pos, *fetch_rows(pos), stats)

        stats = lax.fori_loop(0, n_work, body, stats0)

    if phase != "stats":
        # Tiles past the count: masked entries only.
        fill = masked_score if phase == "scores" else -jnp.inf

        def fill_body(t, c):
            in_c = t * tc + lanes < num_cand
            vals = jnp.full((tc,), fill, jnp.float32)
            if phase == "scores":
                plgpu.store(out_ref.at[pl.ds(t * tc, tc)], vals, mask=in_c)
            else:
                for g in range(group):
                    plgpu.store(logit_ref.at[jnp.int32(g), pl.ds(t * tc, tc)], vals, mask=in_c)
            return c

        lax.fori_loop(t_work, t_last, fill_body, 0)

    if phase != "scores":
        # The heads side by side ``[TC, Gp]`` (Gp = G rounded up to a power of two, the
        # padding columns neutral): one cross-lane max and one sum for all of them, each a
        # shared-memory round trip and a barrier that 2 G scalar reductions paid once a head.
        # This tail is on every program's critical path: one reduction for all heads made the
        # operator's logits kernel faster at B=1 and B=8 on the H200 (docs/kernels.md, "The
        # label kernels' tail, kept").
        gp = next_pow2(group)
        hcol = jnp.arange(gp, dtype=jnp.int32)[None, :]

        def side_by_side(xs, fill):
            out = jnp.full((tc, gp), fill, jnp.float32)
            for g, x in enumerate(xs):
                out = jnp.where(hcol == g, x[:, None], out)
            return out

        mg, lg = side_by_side(stats[:group], _STAT_FLOOR), side_by_side(stats[group:], 0.0)
        big = jnp.max(mg, axis=0)
        tot = jnp.sum(lg * jnp.exp(mg - big[None, :]), axis=0)
        if gp == group:
            heads, real = pl.ds(0, group), None
        else:  # padding columns: an out-of-bounds index, masked (see the top-k module on interpret mode)
            real = hcol[0] < group
            heads = jnp.where(real, hcol[0], group)
        plgpu.store(m_ref.at[p, heads], jnp.where(tot > 0, big, -jnp.inf), mask=real)
        plgpu.store(l_ref.at[p, heads], tot, mask=real)


def _normalize_body(logit_ref, m_in, l_in, out_ref, *, num_cand, block_c, group, masked_score=0.0):
    # logit_ref: [G, C] raw logits (-inf where masked); m_in, l_in: [P, G]; out_ref: [C].
    maxes, weights = _combine_stats(m_in, l_in, group)
    t = pl.program_id(2)
    in_c = t * block_c + jnp.arange(block_c, dtype=jnp.int32) < num_cand
    acc = first = None
    for g in range(group):
        x = plgpu.load(logit_ref.at[jnp.int32(g), pl.ds(t * block_c, block_c)], mask=in_c,
                       other=-jnp.inf)
        e = jnp.exp(x - maxes[g]) * weights[g]  # exactly 0 where the logit is -inf
        acc, first = (e, x) if acc is None else (acc + e, first)
    if masked_score != 0.0:  # a slot is masked for every head at once: the first head's -inf says so
        acc = jnp.where(first == -jnp.inf, masked_score, acc)
    plgpu.store(out_ref.at[pl.ds(t * block_c, block_c)], acc, mask=in_c)


def _prepare_query(q, channels, hkv, sm_scale, bits, words):
    """The channel-gathered, pre-scaled query by code field: ``[B, Hkv, F, G, N]`` f32.

    ``words``: F = 32 // bits fields of N = W // 4 little-endian 32-bit words
    (field k of word a holds channel ``a * F + k``); else F = 8 // bits slots of
    N = W bytes (slot i of byte j holds channel ``j * F + i``).
    """
    b, hq, d = q.shape
    g = hq // hkv
    r = channels.shape[-1]
    qc = _gather_channels(q.reshape(b, hkv, g, d), channels) * sm_scale  # [B, Hkv, G, r]
    nf = (32 if words else 8) // bits
    return qc.reshape(b, hkv, g, r // nf, nf).transpose(0, 1, 4, 2, 3)


def _looped_scores(q, labels, channels, src, cnt, lengths, *, source, num_cand, block_size,
                   sm_scale, bits, mode, block_c, num_warps, num_stages, splits, prefetch,
                   hoist_q, interpret, return_raw, masked_score=0.0, q_prep=None, head_split=None):
    b, hq, _ = q.shape
    r = channels.shape[-1]
    record = isinstance(labels, LabelRecords)
    _, hkv, s, w = label_dims(labels, r, bits)
    g = hq // hkv
    if not (_is_pow2(w) and _is_pow2(block_c)):
        raise ValueError("label_scores_kernel needs power-of-two r*bits//8 and block_c")
    if prefetch < 0:
        raise ValueError(f"prefetch must be >= 0, got {prefetch}")
    hs = 1 if head_split is None else head_split
    check_head_split(hs, g, mode)
    hs = int(hs)
    gh = g // hs  # heads a program scores
    words = w % 4 == 0  # whole 32-bit words per row (r*bits >= 32)
    q_prep = "xla" if q_prep is None else q_prep
    if q_prep not in Q_PREPS:
        raise ValueError(f"q_prep must be one of {Q_PREPS}, got {q_prep!r}")
    if q_prep == "kernel":
        if hoist_q is False:
            raise ValueError("q_prep='kernel' gathers the query once into registers: it needs hoist_q")
        hoist_q = True
    if hoist_q is None:
        # G*r registers of query + ~16 a head of accumulators and statistics:
        # G=4, r=32 fits (~230 registers), G=8, r=16 would spill (offline sm_90 compile).
        hoist_q = gh * (r + 16) <= 192
    num_tiles = pl.cdiv(num_cand, block_c)
    nsplit = choose_splits(b * hkv * hs, num_tiles, programs_per_sm(gh, r, num_warps, hoist_q), splits)
    tpp = pl.cdiv(num_tiles, nsplit)
    nsplit = pl.cdiv(num_tiles, tpp)  # no program without a tile
    common = dict(
        source=source, seq_len=s, num_cand=num_cand, block_c=block_c, tiles_per_prog=tpp,
        num_tiles=num_tiles, group=gh, bits=bits, block_size=block_size, head_split=hs,
        num_block_slots=src.shape[-1], words=words, hoist_q=hoist_q, prefetch=prefetch, record=record,
        interpret=interpret, q_prep=q_prep, sm_scale=float(sm_scale),
        fields=(32 if words else 8) // bits, nper=r * bits // (32 if words else 8))
    hsel = (lambda t: t % hs) if hs > 1 else (lambda t: 0)  # a program's block of heads
    if q_prep == "kernel":  # the raw query and the channels, gathered in the kernel
        qp = q.reshape(b, hkv, g, q.shape[-1])
        q_specs = [pl.BlockSpec((None, None, gh, qp.shape[3]), lambda i, j, t: (i, j, hsel(t), 0)),
                   pl.BlockSpec((None, r), lambda i, j, t: (j, 0))]
        q_args = (qp, channels.astype(jnp.int32))
    else:
        qp = _prepare_query(q, channels, hkv, sm_scale, bits, words)  # one small XLA fusion
        q_specs = [pl.BlockSpec((None, None, qp.shape[2], gh, qp.shape[4]), lambda i, j, t: (i, j, 0, hsel(t), 0))]
        q_args = (qp,)
    meta_spec = pl.BlockSpec((None, None, s), lambda i, j, t: (i, j, 0))
    shared_cnt = cnt.shape[1] == 1 and hkv > 1  # [B, 1]: one count for a row's KV heads, read in place
    in_specs = [
        pl.BlockSpec((None,), lambda i, j, t: (i,)),
        pl.BlockSpec((None, None), (lambda i, j, t: (i, 0)) if shared_cnt else (lambda i, j, t: (i, j))),
        pl.BlockSpec((None, None, src.shape[-1]), lambda i, j, t: (i, j, 0)),
        *q_specs,
    ]
    args = (lengths.astype(jnp.int32), cnt.astype(jnp.int32), src.astype(jnp.int32), *q_args)
    if record:
        in_specs.append(pl.BlockSpec((None, None, s, labels.words.shape[-1]), lambda i, j, t: (i, j, 0, 0)))
        args += (labels.words,)
    else:
        in_specs += [pl.BlockSpec((None, None, s, w), lambda i, j, t: (i, j, 0, 0)), meta_spec, meta_spec]
        args += (labels.packed, labels.scale, labels.offset)
    stat_spec = pl.BlockSpec((None, None, nsplit, g), lambda i, j, t: (i, j, 0, 0))
    stat_out_spec = pl.BlockSpec((None, None, nsplit, gh), lambda i, j, t: (i, j, 0, hsel(t)))  # stat_spec at hs=1
    stat = jax.ShapeDtypeStruct((b, hkv, nsplit, g), jnp.float32)
    params = plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    grid = (b, hkv, nsplit * hs)
    tag = f"{source}_c{block_c}_p{nsplit}" + (f"_h{hs}" if hs > 1 else "") + ("_rec" if record else "")
    out_spec = pl.BlockSpec((None, None, num_cand), lambda i, j, t: (i, j, 0))
    out_shape = jax.ShapeDtypeStruct((b, hkv, num_cand), jnp.float32)
    if mode == "logits":
        logits, m, l = pl.pallas_call(
            functools.partial(_looped_body, phase="logits", **common),
            grid=grid, in_specs=in_specs,
            out_specs=[pl.BlockSpec((None, None, gh, num_cand), lambda i, j, t: (i, j, hsel(t), 0)),
                       stat_out_spec, stat_out_spec],
            out_shape=[jax.ShapeDtypeStruct((b, hkv, g, num_cand), jnp.float32), stat, stat],
            compiler_params=params, interpret=interpret, name=f"label_logits_{tag}",
        )(*args)
        if return_raw:
            return logits, m, l
        # Memory-bound normalization: one tile per program, 4 candidates a
        # thread (vector loads and stores), few registers, many programs.
        nbc = min(4 * 32 * num_warps, next_pow2(num_cand))
        ntn = pl.cdiv(num_cand, nbc)
        return pl.pallas_call(
            functools.partial(_normalize_body, num_cand=num_cand, block_c=nbc, group=g,
                              masked_score=masked_score),
            grid=(b, hkv, ntn),
            in_specs=[pl.BlockSpec((None, None, g, num_cand), lambda i, j, t: (i, j, 0, 0)),
                      stat_spec, stat_spec],
            out_specs=out_spec, out_shape=out_shape,
            compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
            interpret=interpret, name=f"label_normalize_c{nbc}",
        )(logits, m, l)
    m, l = pl.pallas_call(
        functools.partial(_looped_body, phase="stats", **common),
        grid=grid, in_specs=in_specs, out_specs=[stat_spec, stat_spec], out_shape=[stat, stat],
        compiler_params=params, interpret=interpret, name=f"label_stats_{tag}",
    )(*args)
    out = pl.pallas_call(
        functools.partial(_looped_body, phase="scores", masked_score=masked_score, **common),
        grid=grid, in_specs=in_specs + [stat_spec, stat_spec], out_specs=out_spec,
        out_shape=out_shape, compiler_params=params, interpret=interpret,
        name=f"label_scores_{tag}",
    )(*args, m, l)
    if return_raw:
        return out, m, l
    return out


# ----------------------------------------------------------------------------
# Public kernel entry points
# ----------------------------------------------------------------------------

DEFAULT_MODE = "logits"
DEFAULT_NUM_WARPS = 4
DEFAULT_NUM_STAGES = 1
DEFAULT_PREFETCH = 2

TUNING_KEYS = ("mode", "block_c", "num_warps", "num_stages", "splits", "prefetch", "hoist_q", "q_prep",
               "head_split")
_KERNEL_STATIC = ("scale", "bits", "interpret", "return_raw") + TUNING_KEYS


def _check_mode(mode):
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def _looped_tuning(block_c, num_warps, num_stages, prefetch):
    nw = DEFAULT_NUM_WARPS if num_warps is None else int(num_warps)
    return dict(
        block_c=32 * nw if block_c is None else int(block_c),  # one candidate per thread
        num_warps=nw,
        num_stages=DEFAULT_NUM_STAGES if num_stages is None else int(num_stages),
        prefetch=DEFAULT_PREFETCH if prefetch is None else int(prefetch))


@functools.partial(jax.jit, static_argnames=_KERNEL_STATIC)
def label_scores_kernel(q, labels, channels, candidates=None, counts=None, *, lengths=None,
                        scale=None, bits=4, mode=DEFAULT_MODE, block_c=None, num_warps=None,
                        num_stages=None, splits=None, prefetch=None, hoist_q=None, q_prep=None,
                        head_split=None, interpret=False, return_raw=False):
    """Pallas path of ``label_scores`` (modes and tuning: see the module docstring).

    ``return_raw=True`` returns the kernels' intermediate results:
    ``(logits [B, Hkv, G, C], max, sum)`` with per-tile ``[B, Hkv, NT, G]``
    statistics for "per_tile" and per-program ``[B, Hkv, P, G]`` ones for
    "logits"; ``(scores, max, sum)`` for "two_pass".
    """
    _check_mode(mode)
    b, hq, d = q.shape
    _, hkv, s, w = label_dims(labels, channels.shape[-1], bits)
    check_packed_width(w, channels.shape[-1], bits)
    sm_scale = (1.0 / math.sqrt(d)) if scale is None else scale
    if mode == "per_tile":
        if q_prep not in (None, "xla"):
            raise ValueError("mode 'per_tile' makes its query side in XLA only (q_prep='xla')")
        if head_split is not None:
            check_head_split(head_split, mode=mode)
        return _per_tile_scores(
            q, as_label_cache(labels, channels.shape[-1], bits), channels, candidates, counts, lengths=lengths,
            scale=scale, bits=bits,
            block_c=64 if block_c is None else block_c, num_warps=4 if num_warps is None else num_warps,
            num_stages=2 if num_stages is None else num_stages, interpret=interpret,
            return_raw=return_raw)
    if lengths is None:
        lengths = jnp.full((b,), s, jnp.int32)
    if candidates is None:
        source, num_cand = "dense", s
        src = jnp.zeros((b, hkv, 1), jnp.int32)
        cnt = jnp.full((b, hkv), s, jnp.int32)
    else:
        source, num_cand = "array", candidates.shape[-1]
        src = candidates
        cnt = jnp.full((b, hkv), num_cand, jnp.int32) if counts is None else counts
    return _looped_scores(
        q, labels, channels, src, cnt, lengths, source=source, num_cand=num_cand, block_size=1,
        sm_scale=sm_scale, bits=bits, mode=mode, splits=splits, hoist_q=hoist_q, q_prep=q_prep,
        head_split=head_split, interpret=interpret, return_raw=return_raw,
        **_looped_tuning(block_c, num_warps, num_stages, prefetch))


def expand_blocks(block_ids, block_counts, lengths, *, block_size, seq_len):
    """Token positions ``int32[B, Hkv, NBsel * block_size]`` of the selected blocks, -1 where masked.

    Slot ``j`` expands to ``block_ids[..., j] * block_size + arange(block_size)``;
    masked: slots at or past ``block_counts`` (clamped to ``[0, NBsel]``), block ids
    outside ``[0, ceil(S / block_size))``, positions at or past ``min(lengths[b], S)``.
    """
    b, hkv, nb = block_ids.shape
    bid = block_ids.astype(jnp.int32)
    cnt = jnp.clip(block_counts.astype(jnp.int32), 0, nb)
    ok = (jnp.arange(nb, dtype=jnp.int32)[None, None, :] < cnt[..., None]) & (bid >= 0) & (
        bid < -(-seq_len // block_size))
    pos = jnp.where(ok, bid, 0)[..., None] * block_size + jnp.arange(block_size, dtype=jnp.int32)
    limit = jnp.clip(lengths.astype(jnp.int32), 0, seq_len)[:, None, None, None]
    pos = jnp.where(ok[..., None] & (pos < limit), pos, -1)
    return pos.reshape(b, hkv, nb * block_size)


@functools.partial(jax.jit, static_argnames=("block_size", "scale", "bits"))
def block_label_scores_reference(q, labels, channels, block_ids, block_counts, lengths, *,
                                 block_size, scale=None, bits=4):
    """``float32[B, Hkv, NBsel * block_size]``: ``label_scores`` over the tokens of the
    selected blocks, in block-slot order (``expand_blocks`` says what is masked)."""
    pos = expand_blocks(block_ids, block_counts, lengths, block_size=block_size,
                        seq_len=label_dims(labels, channels.shape[-1], bits)[2])
    return label_scores_reference(q, labels, channels, pos, None, lengths=lengths, scale=scale,
                                  bits=bits)


@functools.partial(jax.jit, static_argnames=("block_size", "masked_score") + _KERNEL_STATIC)
def block_label_scores_kernel(q, labels, channels, block_ids, block_counts, lengths, *, block_size,
                              scale=None, bits=4, mode=DEFAULT_MODE, block_c=None, num_warps=None,
                              num_stages=None, splits=None, prefetch=None, hoist_q=None, q_prep=None,
                              head_split=None, interpret=False, return_raw=False, masked_score=0.0):
    """Pallas path of ``block_label_scores``: candidate positions are made in
    registers from the block ids (no candidate array is read), and a block's
    rows are consecutive. Modes "two_pass" and "logits"; tuning as
    ``label_scores_kernel``. ``masked_score`` (static, default 0): what a masked
    slot scores; ``-inf`` lets a top-k take the scores as they are (no masking pass)."""
    _check_mode(mode)
    if mode == "per_tile":
        raise ValueError("block_label_scores_kernel has no 'per_tile' mode")
    b, hq, d = q.shape
    _, hkv, s, w = label_dims(labels, channels.shape[-1], bits)
    check_packed_width(w, channels.shape[-1], bits)
    sm_scale = (1.0 / math.sqrt(d)) if scale is None else scale
    return _looped_scores(
        q, labels, channels, block_ids, block_counts, lengths, source="blocks",
        num_cand=block_ids.shape[-1] * block_size, block_size=block_size, sm_scale=sm_scale,
        bits=bits, mode=mode, splits=splits, hoist_q=hoist_q, q_prep=q_prep, head_split=head_split,
        interpret=interpret, return_raw=return_raw, masked_score=float(masked_score),
        **_looped_tuning(block_c, num_warps, num_stages, prefetch))
