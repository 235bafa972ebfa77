"""Public sparse decode-attention ops (argument checks + implementation dispatch).

Layouts (one new query token per sequence, head-major KV cache):

* ``q``    ``[B, Hq, D]``
* ``k, v`` ``[B, Hkv, S, D]``; query head ``i`` uses KV head ``i // (Hq // Hkv)``

Ops:

* ``sparse_decode_attention``: each GQA group attends to a per-(b, h) list of
  token positions (``indices[b, h, :counts[b, h]]``).
* ``block_sparse_decode_attention``: each GQA group attends to a per-(b, h)
  list of fixed-size token blocks, masked by the sequence length.
* ``dense_decode_attention``: exact attention over ``[0, lengths[b])``; its
  kernel path is the block kernel over every block up to each row's length
  (a split-K flash decode whose work scales with the lengths, not with S).
* ``merge_attention``: exact log-sum-exp merge of two partial results over
  disjoint token sets (e.g. a dense local window + a sparse selection).

All return ``[B, Hq, D]`` in q's dtype (float32 math inside). With
``return_residuals=True`` they return ``(out, (m, l))``, ``m, l`` float32
``[B, Hq]``: ``m`` the max scaled logit over the attended tokens (the finite
``MASK_VALUE`` for an empty set) and ``l = sum exp(logit - m)`` (0 for an
empty set). An empty token set gives a zero output.

``impl``: "auto" (Pallas-Triton kernel on GPU, jnp reference elsewhere),
"pallas" (the kernel; Pallas interpret mode on a machine without a GPU),
"reference". Tuning keyword arguments only affect the kernel (they are still
validated when the reference runs): see ``SPARSE_TUNING_KEYS`` /
``BLOCK_SPARSE_TUNING_KEYS``.

All argument checks run on shapes/dtypes only, before anything is traced.
"""

from __future__ import annotations

import math
import numbers

import jax.numpy as jnp

from pallas_kernels import block_sparse_decode as _bsd
from pallas_kernels import sparse_decode as _sd
from pallas_kernels.merge import MASK_VALUE, merge_normalized
from pallas_kernels.split_merge import MERGES
from pallas_kernels.tuning import with_tuned
from sparse_jax.ops._checks import (
    check_float,
    check_gqa,
    check_int_array,
    check_rank,
    check_shape,
)
from sparse_jax.ops._dispatch import on_gpu, resolve_impl
from sparse_jax.ops.dense import dense_decode_reference

__all__ = [
    "MASK_VALUE",
    "SPARSE_TUNING_KEYS",
    "BLOCK_SPARSE_TUNING_KEYS",
    "sparse_decode_attention",
    "block_sparse_decode_attention",
    "dense_decode_attention",
    "merge_attention",
]

#: ``block_k`` (gathered tokens per tile, power of two >= 16; default 64, 32
#: for D > 128, capped by K), ``num_splits`` (flash-decoding splits per
#: (b, h); default: enough for ~264 programs, >= 256 slots per split),
#: ``num_warps`` (4), ``num_stages`` (2).
SPARSE_TUNING_KEYS = _sd.TUNING_KEYS
#: ``block_k`` (max tokens per inner iteration; default 64, 32 for D > 128),
#: ``blocks_per_iter`` (blocks gathered per iteration; default
#: ``block_k // block_size`` for power-of-two block sizes below block_k, else
#: 1 = one contiguous slice per iteration), ``num_splits``, ``num_warps`` (4),
#: ``num_stages`` (2).
BLOCK_SPARSE_TUNING_KEYS = _bsd.TUNING_KEYS


# --------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------

def _check_qkv(q, k, v, kv_batch_share: int = 1) -> tuple[int, int, int, int, int]:
    """Check q/k/v (k, v with q's batch / ``kv_batch_share`` rows); return (B, Hq, Hkv, S, D)."""
    check_rank("q", q, 3, "[B, Hq, D]")
    check_rank("k", k, 4, "[B, Hkv, S, D]")
    check_rank("v", v, 4, "[B, Hkv, S, D]")
    check_float("q", q)
    check_float("k", k)
    check_float("v", v)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"q, k and v must share one dtype, got q={q.dtype}, k={k.dtype}, v={v.dtype}")
    B, Hq, D = q.shape
    _, Hkv, S, _ = k.shape
    if B % kv_batch_share:
        raise ValueError(f"q's batch ({B}) must be a multiple of kv_batch_share ({kv_batch_share})")
    if kv_batch_share == 1:
        check_shape("k", k, (B, Hkv, S, D), "[B, Hkv, S, D] (B and D from q)")
    else:
        check_shape("k", k, (B // kv_batch_share, Hkv, S, D),
                    "[B / kv_batch_share, Hkv, S, D] (B and D from q)")
    check_shape("v", v, k.shape, "[B, Hkv, S, D] (same as k)")
    check_gqa(Hq, Hkv)
    if S < 1:
        raise ValueError(f"the KV cache must hold at least one position (S >= 1), got S={S}")
    if D < 1:
        raise ValueError(f"head_dim must be >= 1, got {D}")
    return B, Hq, Hkv, S, D


def _check_scale(scale) -> None:
    if scale is None:
        return
    if (isinstance(scale, bool) or not isinstance(scale, numbers.Real)
            or not math.isfinite(float(scale))):
        raise TypeError(f"scale must be None or a finite Python number, got {scale!r}")


#: tuning knobs that take a name, not a number, and the names they take
_NAMED_KNOBS = {"merge": MERGES, "split_schedule": _bsd.SPLIT_SCHEDULES}


def _check_tuning(tuning: dict, allowed: tuple[str, ...], op: str) -> None:
    unknown = sorted(set(tuning) - set(allowed))
    if unknown:
        raise TypeError(f"{op}: unknown tuning argument(s) {unknown}; allowed: {list(allowed)}")
    for key, val in tuning.items():
        if val is None:
            continue
        if key in _NAMED_KNOBS:
            if val not in _NAMED_KNOBS[key]:
                raise ValueError(f"{op}: tuning argument {key} must be one of {_NAMED_KNOBS[key]}, got {val!r}")
            continue
        if isinstance(val, bool) or not isinstance(val, numbers.Integral):
            raise TypeError(f"{op}: tuning argument {key} must be an int or None, got {val!r}")
        if val < (0 if key == "prefetch" else 1):
            raise ValueError(f"{op}: tuning argument {key} must be >= {0 if key == 'prefetch' else 1}, got {val}")


# --------------------------------------------------------------------------
# Ops
# --------------------------------------------------------------------------

def sparse_decode_attention(q, k, v, indices, counts, *, scale=None,
                            return_residuals=False, impl="auto", kv_batch_share=None, **tuning):
    """Decode attention over a per-(batch, KV head) list of token positions.

    Args:
      q: ``[B, Hq, D]`` query for the current token.
      k, v: ``[B, Hkv, S, D]`` head-major KV cache (same dtype as q), or
        ``[1, Hkv, S, D]``: one buffer every row reads (the offloaded tier's shared
        pool; each row's ``indices`` name its own rows of it).
      indices: ``int32[B, Hkv, K]`` token positions. The query heads of KV head
        h attend to ``indices[b, h, :counts[b, h]]``. Entries past the count
        are ignored whatever they hold. Entries inside the count should lie in
        ``[0, S)`` (out-of-range ones are clamped into range). A position
        listed twice is attended twice (no deduplication).
      counts: ``int32[B, Hkv]``; values > K are clamped to K, values <= 0 give
        an empty set (zero output).
      scale: logit scale (a Python number); default ``1 / sqrt(D)``.
      return_residuals: also return ``(m, l)``, float32 ``[B, Hq]``.
      impl: "auto" | "pallas" | "reference".
      kv_batch_share: ``r`` (a Python int >= 1): k and v hold ``B / r`` rows and
        q's row ``b`` (with its own ``indices[b]``, ``counts[b]``) reads k/v row
        ``b // r``. Many query rows over one cache without copying it: Kascade's
        tiled prefill runs one row per (batch, KV head, query tile). Default
        (None): 1, or ``B`` when k and v hold one row (the shared pool).
      **tuning: kernel knobs, see ``SPARSE_TUNING_KEYS``.

    Returns:
      ``[B, Hq, D]`` in q's dtype, or ``(out, (m, l))``.
    """
    if kv_batch_share is None:  # k, v of one row: read by every row (the offloaded tier's shared pool)
        kv_batch_share = q.shape[0] if getattr(k, "ndim", 0) == 4 and k.shape[0] == 1 and q.ndim == 3 else 1
    if isinstance(kv_batch_share, bool) or not isinstance(kv_batch_share, numbers.Integral) or kv_batch_share < 1:
        raise ValueError(f"kv_batch_share must be a Python int >= 1, got {kv_batch_share!r}")
    B, Hq, Hkv, S, D = _check_qkv(q, k, v, int(kv_batch_share))
    check_int_array("indices", indices, (B, Hkv, indices.shape[-1]), "[B, Hkv, K]")
    check_int_array("counts", counts, (B, Hkv), "[B, Hkv]")
    _check_scale(scale)
    _check_tuning(tuning, SPARSE_TUNING_KEYS, "sparse_decode_attention")
    scale = None if scale is None else float(scale)
    return_residuals = bool(return_residuals)

    choice, interpret = resolve_impl(impl, kernel_unsupported=_sd.unsupported_reason(D))
    if choice == "reference":
        return _sd.sparse_decode_attention_reference(
            q, k, v, indices, counts, scale=scale, return_residuals=return_residuals)
    if not interpret:  # the measured best for this shape class, unless the caller tuned
        tuning = with_tuned(tuning, "sparse_decode", rows=B * Hkv, k=indices.shape[-1], d=D, g=Hq // Hkv)
    # Resolve the static tiling now so that bad knobs fail before tracing.
    _sd.resolve_sparse_tuning(B, Hkv, indices.shape[-1], D,
                              block_k=tuning.get("block_k"),
                              num_splits=tuning.get("num_splits"))
    return _sd.sparse_decode_attention_pallas(
        q, k, v, indices, counts, scale=scale, return_residuals=return_residuals,
        interpret=interpret, **tuning)


def block_sparse_decode_attention(q, k, v, block_indices, block_counts, lengths, *,
                                  block_size, scale=None, return_residuals=False,
                                  impl="auto", block_table=None, **tuning):
    """Decode attention over a per-(batch, KV head) list of token blocks.

    Args:
      q: ``[B, Hq, D]``.
      k, v: ``[B, Hkv, S, D]`` head-major KV cache (same dtype as q).
      block_indices: ``int32[B, Hkv, NBsel]`` block ids; block j covers tokens
        ``[j * block_size, (j + 1) * block_size)``. The query heads of KV head
        h attend to the blocks ``block_indices[b, h, :block_counts[b, h]]``;
        entries past the count are ignored whatever they hold; ids outside
        ``[0, ceil(S / block_size))`` contribute nothing; a repeated id is
        attended twice.
      block_counts: ``int32[B, Hkv]`` (clamped to ``[0, NBsel]``).
      lengths: ``int32[B]``: tokens at or beyond ``lengths[b]`` (and beyond S)
        are masked, so a partial last block is fine.
      block_size: tokens per block (a positive Python int).
      scale, return_residuals, impl: as ``sparse_decode_attention``.
      block_table: paged KV (``int32[B, W]``): ``k, v`` are one pool of pages
        ``[1, Hkv, P * block_size, D]`` shared by the rows, and row b's block j (a
        logical block, as ``block_indices`` name them; ``S`` is then ``W * block_size``)
        is page ``block_table[b, j]`` of it. An entry outside ``[0, P)`` reads page 0.
      **tuning: kernel knobs, see ``BLOCK_SPARSE_TUNING_KEYS``.

    Returns:
      ``[B, Hq, D]`` in q's dtype, or ``(out, (m, l))``.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, numbers.Integral):
        raise TypeError(f"block_size must be a Python int, got {block_size!r}")
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    block_size = int(block_size)
    if block_table is None:
        B, Hq, Hkv, S, D = _check_qkv(q, k, v)
    else:
        check_rank("q", q, 3, "[B, Hq, D]")
        B = q.shape[0]
        _, Hq, Hkv, _, D = _check_qkv(q, k, v, kv_batch_share=B)
        check_rank("block_table", block_table, 2, "[B, W]")
        check_int_array("block_table", block_table, (B, block_table.shape[1]), "[B, W]")
        if k.shape[2] % block_size:
            raise ValueError(f"a paged pool holds whole pages: k's {k.shape[2]} rows are not a multiple of "
                             f"block_size {block_size}")
    check_int_array("block_indices", block_indices, (B, Hkv, block_indices.shape[-1]), "[B, Hkv, NBsel]")
    check_int_array("block_counts", block_counts, (B, Hkv), "[B, Hkv]")
    check_int_array("lengths", lengths, (B,), "[B]")
    _check_scale(scale)
    _check_tuning(tuning, BLOCK_SPARSE_TUNING_KEYS, "block_sparse_decode_attention")
    scale = None if scale is None else float(scale)
    return_residuals = bool(return_residuals)

    choice, interpret = resolve_impl(impl, kernel_unsupported=_bsd.unsupported_reason(D))
    if choice == "reference":
        if block_table is not None:  # the reference reads the rows' pages as a contiguous copy
            k, v = _bsd.paged_rows(k, block_table, block_size), _bsd.paged_rows(v, block_table, block_size)
        return _bsd.block_sparse_decode_attention_reference(
            q, k, v, block_indices, block_counts, lengths, block_size=block_size,
            scale=scale, return_residuals=return_residuals)
    if not interpret:
        tuning = with_tuned(tuning, "block_sparse_decode", rows=B * Hkv, k=block_indices.shape[-1] * block_size,
                            d=D, g=Hq // Hkv, block=block_size)
    _bsd.resolve_block_tuning(B, Hkv, block_indices.shape[-1], D, block_size,
                              block_k=tuning.get("block_k"),
                              blocks_per_iter=tuning.get("blocks_per_iter"),
                              num_splits=tuning.get("num_splits"))
    return _bsd.block_sparse_decode_attention_pallas(
        q, k, v, block_indices, block_counts, lengths, block_table, block_size=block_size,
        scale=scale, return_residuals=return_residuals, interpret=interpret, **tuning)


def dense_decode_attention(q, k, v, lengths, *, block_size: int = 64, scale=None, impl="auto", block_table=None,
                           **tuning):
    """Exact decode attention over the first ``lengths[b]`` positions of ``k, v``.

    ``q [B, Hq, D]``, ``k, v [B, Hkv, S, D]``, ``lengths int[B]`` (clipped to
    ``[0, S]``; 0 gives zeros). ``impl``: "pallas" runs the block kernel over
    blocks ``0 .. ceil(lengths / block_size) - 1`` of every row (loads past a row's
    length are skipped, and its valid blocks are shared evenly by the kernel's splits:
    ``split_schedule="valid"``), "reference" the masked einsum
    (:func:`sparse_jax.ops.dense.dense_decode_reference`), "auto" the kernel on a
    GPU (for a head_dim it supports) and the reference elsewhere. On the H100
    (128K, 32/8 heads, D=128) the kernel ties cuDNN on its own [B, S, H, D]
    layout at B=8 and is faster than the einsum at B=8 and B=1
    (docs/kernels.md, 'Measured reasons for kernel choices'). cuDNN itself would
    need the token-major layout, a transposed copy of the cache.
    Tuning as :func:`block_sparse_decode_attention`. ``block_table`` (``int32[B, W]``):
    paged KV, ``k, v`` one pool of pages of ``block_size`` tokens (as
    :func:`block_sparse_decode_attention`'s), ``S = W * block_size``.
    """
    check_rank("q", q, 3, "[B, Hq, D]")
    check_rank("k", k, 4, "[B, Hkv, S, D]")
    B, _, _ = q.shape
    check_int_array("lengths", lengths, (B,), "[B]")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if block_table is not None:
        check_rank("block_table", block_table, 2, "[B, W]")
    S = k.shape[2] if block_table is None else block_table.shape[1] * block_size
    if impl == "auto":
        impl = "pallas" if on_gpu() and _bsd.unsupported_reason(q.shape[-1]) is None else "reference"
    if impl == "reference":
        _check_scale(scale)
        _check_tuning(tuning, BLOCK_SPARSE_TUNING_KEYS, "dense_decode_attention")
        if scale is not None:
            raise ValueError("dense_decode_attention: scale is only supported by impl='pallas' (the reference "
                             "uses 1/sqrt(D))")
        if block_table is not None:  # the reference reads the rows' pages as a contiguous copy
            k, v = _bsd.paged_rows(k, block_table, block_size), _bsd.paged_rows(v, block_table, block_size)
        return dense_decode_reference(q, k, v, jnp.clip(lengths, 0, S))
    nb = -(-S // block_size)
    lengths = jnp.clip(jnp.asarray(lengths, jnp.int32), 0, S)
    blocks = jnp.broadcast_to(jnp.arange(nb, dtype=jnp.int32), (B, k.shape[1], nb))
    counts = jnp.broadcast_to((-(-lengths // block_size))[:, None], (B, k.shape[1]))
    return block_sparse_decode_attention(q, k, v, blocks, counts, lengths, block_size=block_size, scale=scale,
                                         impl=impl, block_table=block_table, **tuning)


def merge_attention(o1, res1, o2, res2, *, return_residuals=False):
    """Merge two partial decode-attention results over disjoint token sets.

    ``o1, o2``: ``[B, Hq, D]`` normalised outputs; ``res1, res2``: their
    ``(m, l)`` residuals, float32 ``[B, Hq]`` (from ``return_residuals=True``).
    Returns the attention over the union of the two token sets, in
    ``o1``'s dtype (float32 math), or ``(out, (m, l))`` with
    ``return_residuals=True`` so more partials can be merged in. Merging
    with an empty partial (``l == 0``) returns the other one; two empty
    partials give zeros.
    """
    check_rank("o1", o1, 3, "[B, Hq, D]")
    check_float("o1", o1)
    check_float("o2", o2)
    check_shape("o2", o2, o1.shape, "[B, Hq, D] (same as o1)")
    for name, res in (("res1", res1), ("res2", res2)):
        if not isinstance(res, (tuple, list)) or len(res) != 2:
            raise TypeError(f"{name} must be the (m, l) pair returned with return_residuals=True")
        for part, x in zip(("m", "l"), res):
            check_shape(f"{name}.{part}", x, o1.shape[:-1], "[B, Hq]")
            check_float(f"{name}.{part}", x)
    (m1, l1), (m2, l2) = res1, res2
    o, m, l = merge_normalized(o1, m1, l1, o2, m2, l2)
    o = o.astype(o1.dtype)
    if return_residuals:
        return o, (m, l)
    return o
