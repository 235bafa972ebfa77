"""The label scores' normalization, the token top-k and the block-to-token map in one kernel.

AsyncTLS's second level scores the tokens of the filter's blocks by their INT4 labels,
keeps the best ``k`` and attends them. Unfused that is four steps after the label
logits kernel: a normalization kernel (softmax statistics -> mean probability over
the group's query heads), the top-k kernel, and an XLA fusion mapping each chosen slot
to its token (``block_ids[slot // bs] * bs + slot % bs``); the scores round-trip
through HBM in between. Here one program per (row, KV head) reads the raw logits and
the per-program softmax statistics of ``labels.block_label_scores_kernel(...,
mode="logits", return_raw=True)``, forms the scores in registers (the normalization
kernel's arithmetic and its ``_combine_stats``, so the same numbers), selects with the radix search of
:mod:`pallas_kernels.topk`, and writes token positions.

Shapes (R = B * Hkv rows, G query heads per KV head, C = NBsel * block_size candidates,
P statistic partitions):

* ``logits f32[R, G, C]``: raw logits, ``-inf`` where a candidate is masked (the same
  mask for every head);
* ``m, l f32[R, P, G]``: per-partition max and sum of ``exp(logit - max)``;
* ``block_ids int32[R, NBsel]``: slot ``j`` stands for tokens ``block_ids[j] * bs + i``;
* result ``(positions int32[R, k], counts int32[R])``: the tokens of the ``k`` best
  unmasked candidates, ``counts = min(k, #unmasked)``; entries past the count are other
  candidates' images (never read by a caller that honours ``counts``).

Ties are taken in slot order; the reference (``lax.top_k``) may break them otherwise,
so tests compare selected scores, not positions, where ties are possible.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._util import next_pow2
from pallas_kernels.labels import _combine_stats, label_scores_epilogue
from pallas_kernels.topk import (
    DEFAULT_MAX_SINGLE,
    INT32_MIN,
    _compaction,
    _default_warps,
    _search_threshold,
    float_to_key,
    topk_reference,
)

__all__ = ["label_topk_reference", "label_topk_pallas", "MAX_CANDIDATES"]

MAX_CANDIDATES = DEFAULT_MAX_SINGLE  # one program holds a row's candidates in registers


def _token_of_slot(block_ids, slots, block_size: int):
    return jnp.take_along_axis(block_ids, slots // block_size, axis=-1) * block_size + slots % block_size


def label_topk_reference(logits, m, l, block_ids, k: int, *, block_size: int):
    """Pure-jnp path: the label scores' normalization (``labels.label_scores_epilogue``),
    ``lax.top_k`` on order keys (masked candidates below every unmasked one), the
    block-to-token map."""
    scores = label_scores_epilogue(logits[:, None], m[:, None], l[:, None])[:, 0]
    valid = logits[:, 0] > -jnp.inf
    idx = topk_reference(jnp.where(valid, scores, -jnp.inf), k)
    counts = jnp.minimum(jnp.sum(valid, axis=-1, dtype=jnp.int32), k)
    return _token_of_slot(block_ids.astype(jnp.int32), idx, block_size).astype(jnp.int32), counts


def _label_topk_kernel(logit_ref, m_ref, l_ref, blk_ref, pos_ref, cnt_ref, *, group: int, n_cand: int,
                       lanes: int, n_blocks: int, block_size: int, k: int, n_rows: int,
                       radix_bits: int, early_exit: bool):
    """One row: the row's statistics as ``[P, G]`` blocks, the rest flat refs addressed with
    computed offsets (as the top-k kernel)."""
    row = pl.program_id(0)
    rows = row + lax.broadcasted_iota(jnp.int32, (1, 1), 0)  # [1, 1]
    lane = lax.broadcasted_iota(jnp.int32, (1, lanes), 1)  # [1, C']
    live = lane < n_cand
    maxes, weights = _combine_stats(m_ref, l_ref, group)  # the normalization kernel's own
    acc, first = None, None
    for g in range(group):
        x = plgpu.load(logit_ref.at[(row * group + g) * n_cand + lane], mask=live, other=-jnp.inf)
        e = jnp.exp(x - maxes[g]) * weights[g]  # exactly 0 where the logit is -inf
        acc = e if acc is None else acc + e
        first = x if first is None else first
    valid = live & (first > -jnp.inf)
    # masked candidates and padding lanes share the invalid key: a short row's fill is
    # taken from them in lane order, so real masked slots (lanes < C) come first
    key = jnp.where(valid, float_to_key(acc), np.int32(INT32_MIN))
    t = _search_threshold(key, k, radix_bits, early_exit, rows < n_rows)
    # a short row's threshold is the invalid key: its unmasked slots (above it) come first
    take, slot = _compaction(key, t, k, greater_first=True)
    blk = plgpu.load(blk_ref.at[row * n_blocks + lane // block_size], mask=live, other=0)
    token = blk * block_size + lane % block_size
    oob = n_rows * k  # masked lanes: see pallas_kernels.topk's module docstring
    dst = jnp.where(take, row * k + slot, oob)
    plgpu.store(pos_ref.at[dst], token, mask=take)
    n_valid = jnp.sum(valid.astype(jnp.int32), axis=1, keepdims=True)  # [1, 1]
    plgpu.store(cnt_ref.at[rows], jnp.minimum(n_valid, k))


@functools.partial(jax.jit, static_argnames=("k", "block_size", "num_warps", "radix_bits", "early_exit",
                                             "interpret"))
def label_topk_pallas(logits, m, l, block_ids, k: int, *, block_size: int, num_warps=None, radix_bits: int = 1,
                      early_exit: bool = True, interpret: bool = False):
    """Kernel path (shapes in the module docstring); ``C <= MAX_CANDIDATES``."""
    r, g, c = logits.shape
    p = m.shape[1]
    nb = block_ids.shape[-1]
    if c > MAX_CANDIDATES:
        raise ValueError(f"label_topk_pallas holds a row in one program: C={c} > {MAX_CANDIDATES}")
    if not 1 <= k <= c:
        raise ValueError(f"k must satisfy 1 <= k <= C = {c}, got {k}")
    if nb * block_size != c:
        raise ValueError(f"block_ids [R, {nb}] x block_size {block_size} != C = {c}")
    if radix_bits not in (1, 2, 4):
        raise ValueError(f"radix_bits must be 1, 2 or 4, got {radix_bits}")
    lanes = next_pow2(c)
    kern = functools.partial(
        _label_topk_kernel, group=g, n_cand=c, lanes=lanes, n_blocks=nb, block_size=block_size,
        k=k, n_rows=r, radix_bits=radix_bits, early_exit=early_exit)
    whole = lambda n: pl.BlockSpec((n,), lambda i: (0,))  # noqa: E731 - a flat array, every program
    stat = pl.BlockSpec((None, p, g), lambda i: (i, 0, 0))
    pos, cnt = pl.pallas_call(
        kern,
        in_specs=[whole(r * g * c), stat, stat, whole(r * nb)],
        out_specs=[whole(r * k), whole(r)],
        out_shape=(jax.ShapeDtypeStruct((r * k,), jnp.int32), jax.ShapeDtypeStruct((r,), jnp.int32)),
        grid=(r,),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps or _default_warps(lanes), num_stages=1),
        interpret=interpret,
        name=f"label_topk_c{lanes}",
    )(logits.astype(jnp.float32).reshape(-1), m.astype(jnp.float32), l.astype(jnp.float32),
      block_ids.astype(jnp.int32).reshape(-1))
    return pos.reshape(r, k), cnt
