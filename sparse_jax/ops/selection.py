"""Top-k index selection: ``topk_indices``.

Shapes: ``scores: float[R..., N]`` (any number of leading dims, e.g.
``[B, Hkv, N]``), ``counts: int32[R...] | None`` -> ``int32[R..., k]``. ``counts``
may also have its last axis 1 (``[B, 1]``: one count for every KV head of a row),
which the kernel reads in place (no broadcast is written).

Contract (both implementations):

* The result holds, per row, the positions of the ``k`` largest *valid*
  scores, each position at most once, in unspecified order (the Pallas kernel
  returns ascending positions; the reference returns descending scores).
  Ties are broken arbitrarily.
* Position ``j`` of a row is valid iff ``j < counts[row]`` (``counts`` is
  clipped to ``[0, N]``; ``None`` means all ``N`` are valid).
* If a row has fewer than ``k`` valid positions, the result holds all of them
  and the remaining slots hold distinct *invalid* positions in ``[count, N)``:
  callers must use ``min(k, count)`` as the number of selected entries (the
  Pallas kernel returns exactly ``arange(k)`` for such rows).
* ``-inf`` is a valid score (the smallest; a valid ``-inf`` is still preferred
  to any invalid position). NaN is treated as ``-inf`` (it ties with it); it
  never raises, as that is impossible under ``jit``.
* bfloat16 / float16 scores are upcast to float32 (exact, order-preserving).

Implementations (``impl``):

* ``"reference"``: ``lax.top_k`` on an order-preserving int32 key of the
  scores (invalid positions -> INT32_MIN); exact, a full sort on GPU.
* ``"pallas"``: the radix-select kernel of ``pallas_kernels/topk.py``
  (interpret mode without a GPU).
* ``"auto"``: on GPU, the first matching row of ``TOPK_AUTO_TABLE``, with the
  knobs measured best for the shape class (rows, N, k) in the tuned table
  (``pallas_kernels.tuning``, written by ``benchmarks/tune.py --only topk``;
  ``"pallas"`` on GPU reads it too when no knob is given); the reference
  elsewhere.

Tuning keywords (``**tuning``) go to the Pallas kernel: ``max_single``,
``chunk``, ``block_rows``, ``num_warps``, ``num_stages``, ``radix_bits``,
``early_exit``, ``search`` (see ``pallas_kernels.topk.topk_pallas``). With ``impl="auto"``
they override the table's entries for the kernel rows.
"""

from __future__ import annotations

import functools
import math
import operator

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import topk as _topk
from pallas_kernels.tuning import tuned
from sparse_jax.ops import _checks
from sparse_jax.ops._dispatch import on_gpu, resolve_impl

__all__ = ["topk_indices", "TOPK_AUTO_TABLE", "topk_auto_choice", "TUNING_KEYS"]

TUNING_KEYS = frozenset(
    {"max_single", "chunk", "block_rows", "num_warps", "num_stages", "radix_bits", "early_exit", "search"}
)

# The "auto" choice on GPU, in one place so it can be re-tuned after measuring
# on the H100. Rows are (max_n, max_k, impl, tuning): the first row with
# N <= max_n and k <= max_k (None = no limit) wins. impl "pallas" falls back to
# the reference when the kernel has no plan for the shape (plan_topk -> None,
# e.g. k > 16384 on long rows). The kernel against lax.top_k, measured:
# docs/kernels.md, v6, 'The top-k kernel, tuned for the first time'.
TOPK_AUTO_TABLE: list[tuple[int | None, int | None, str, dict]] = [
    (2048, None, "pallas", {}),  # (a) 64 x 2048 block scores, k = 128
    (16384, None, "pallas", {}),  # (b) 64 x 8192 candidate tokens, k 512..2048
    (None, None, "pallas", {}),  # (c) full contexts: multi-level
]


def topk_auto_choice(n: int, k: int, rows: int | None = None) -> tuple[str, dict]:
    """``(impl, tuning)`` that "auto" uses on GPU for ``rows`` rows of ``n``, top ``k``.

    The kernel's knobs come from the tuned table when ``rows`` is given and its
    class was measured (a tuned plan the kernel cannot run is ignored), else from
    ``TOPK_AUTO_TABLE``."""
    for max_n, max_k, impl, tuning in TOPK_AUTO_TABLE:
        if (max_n is None or n <= max_n) and (max_k is None or k <= max_k):
            if impl == "pallas":
                tuning = {**tuning, **_measured(n, k, rows)}
                if _plan(n, k, tuning) is None:
                    return "reference", {}
            return impl, dict(tuning)
    return "reference", {}


def _measured(n: int, k: int, rows: int | None) -> dict:
    """The tuned table's knobs for ``rows`` rows of ``n``, top ``k`` (``{}`` when the class
    was never measured, or its plan is one the kernel cannot run)."""
    measured = tuned("topk", rows=rows, n=n, k=k) if rows else {}
    return measured if measured and _plan(n, k, measured) is not None else {}


def _plan(n, k, tuning):
    keys = ("max_single", "chunk", "block_rows", "num_warps")
    return _topk.plan_topk(n, k, **{a: tuning[a] for a in keys if a in tuning})


def _check_args(scores, k, counts, tuning):
    if not hasattr(scores, "shape") or not hasattr(scores, "dtype"):
        raise TypeError(f"scores must be an array, got {type(scores).__name__}")
    if scores.ndim < 1:
        raise ValueError(f"scores must have shape [..., N] (rank >= 1), got shape {scores.shape}")
    if not jnp.issubdtype(scores.dtype, jnp.floating):
        raise TypeError(f"scores must be a float array (float32, bfloat16 or float16), got {scores.dtype}")
    _checks.check_float("scores", scores)
    n = scores.shape[-1]
    if isinstance(k, bool):
        raise TypeError("k must be a static Python int, got bool")
    try:
        k = operator.index(k)  # accepts int / numpy ints; floats and tracers raise
    except TypeError:
        raise TypeError(f"k must be a static Python int, got {type(k).__name__}") from None
    if n < 1:
        raise ValueError(f"scores must have at least one entry per row (N >= 1), got shape {scores.shape}")
    if not 1 <= k <= n:
        raise ValueError(f"k must satisfy 1 <= k <= N = {n}, got k={k}")
    if counts is not None:
        if not hasattr(counts, "dtype"):
            raise TypeError(f"counts must be an int32 array or None, got {type(counts).__name__}")
        _checks.check_int("counts", counts)
        _check_per_row("counts", counts, tuple(scores.shape[:-1]))
    unknown = set(tuning) - TUNING_KEYS
    if unknown:
        raise TypeError(f"unknown tuning keyword(s) {sorted(unknown)}; allowed: {sorted(TUNING_KEYS)}")
    if "radix_bits" in tuning and tuning["radix_bits"] not in (1, 2, 4):
        raise ValueError(f"radix_bits must be 1, 2 or 4, got {tuning['radix_bits']}")
    if "search" in tuning and tuning["search"] not in _topk.SEARCHES:
        raise ValueError(f"search must be one of {_topk.SEARCHES}, got {tuning['search']!r}")
    br = tuning.get("block_rows", 1)
    if not isinstance(br, int) or br < 1 or br & (br - 1):
        raise ValueError(f"block_rows must be a power-of-two int, got {br!r}")
    return k


def _check_per_row(name, arr, lead):
    """``arr`` holds one value per row (``lead``), or one per group of ``lead[-1]`` rows (its last
    axis 1, read in place by the kernel)."""
    if not (tuple(arr.shape) == lead or (len(lead) >= 1 and tuple(arr.shape) == lead[:-1] + (1,))):
        raise ValueError(f"{name} must have shape scores.shape[:-1] = {lead}, or that with its last axis 1 "
                         f"({lead[:-1] + (1,)}: one value for the rows of that axis), got {tuple(arr.shape)}")


def _int_or_none(v):
    return None if v is None else int(v)


def _check_map_args(scores, block_table, block_size, dense_lengths, dense_limit):
    lead, n = tuple(scores.shape[:-1]), scores.shape[-1]
    if (block_table is None) != (block_size is None):
        raise ValueError("block_table and block_size come together")
    if block_table is not None:
        _checks.check_int("block_table", block_table)
        if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)) or block_size < 1:
            raise ValueError(f"block_size must be a positive static int, got {block_size!r}")
        if tuple(block_table.shape[:-1]) != lead or block_table.ndim != len(lead) + 1 \
                or block_table.shape[-1] * int(block_size) < n:
            raise ValueError(f"block_table must have shape {lead} + (W,) with W * block_size >= N = {n}, got "
                             f"{tuple(block_table.shape)} with block_size {block_size}")
    if (dense_lengths is None) != (dense_limit is None):
        raise ValueError("dense_lengths and dense_limit come together")
    if dense_lengths is not None:
        _checks.check_int("dense_lengths", dense_lengths)
        if isinstance(dense_limit, bool) or not isinstance(dense_limit, (int, np.integer)):
            raise ValueError(f"dense_limit must be a static int, got {dense_limit!r}")
        _check_per_row("dense_lengths", dense_lengths, lead)


def _each_row(arr, lead):
    """``int32[R]``: a per-row argument's value for every row (``arr`` as ``lead``, or one
    value for each group of ``lead[-1]`` rows with its last axis 1), or None."""
    return None if arr is None else jnp.broadcast_to(arr, lead).reshape(-1).astype(jnp.int32)


def _kernel_rows(arr, lead):
    """``(int32[R] or int32[R / lead[-1]], rows sharing each value)`` of a per-row argument, as
    the kernel reads it in place (no broadcast), or ``(None, 1)``."""
    if arr is None:
        return None, 1
    return arr.reshape(-1).astype(jnp.int32), 1 if arr.size == math.prod(lead) else lead[-1]


@functools.partial(jax.jit, static_argnames=("k", "choice", "interpret", "tuning", "count_above", "block_size",
                                             "dense_limit"))
def _run(scores, counts, block_table=None, dense_lengths=None, append=None, *, k, choice, interpret, tuning,
         count_above=None, block_size=None, dense_limit=None):
    lead = scores.shape[:-1]
    n = scores.shape[-1]
    r = math.prod(lead)
    x = scores.reshape(r, n).astype(jnp.float32)
    per_row = _each_row(counts, lead)
    table = None if block_table is None else block_table.reshape(r, -1).astype(jnp.int32)
    dense = None
    if dense_lengths is not None:
        dense_len = _each_row(dense_lengths, lead)
        dense = dense_len <= dense_limit
    in_kernel = choice == "pallas" and count_above is not None and _plan(n, k, dict(tuning)).levels[1:] == ()
    if choice == "reference":
        out = _topk.topk_reference(x, k, per_row)
        if table is not None:
            out = jnp.take_along_axis(table, out // block_size, axis=-1) * block_size + out % block_size
        if dense is not None:
            out = jnp.where(dense[:, None], jnp.arange(k, dtype=jnp.int32)[None, :], out)
        if append is not None:
            out = jnp.concatenate([out, _each_row(append, lead)[:, None]], axis=-1)
    else:
        c, per_count = _kernel_rows(counts, lead)
        dense_in, per_dense = _kernel_rows(dense_lengths, lead)
        last, per_last = _kernel_rows(append, lead)
        out = _topk.topk_pallas(
            x, k, c, interpret=interpret, rows_per_count=per_count,
            count_above=count_above if in_kernel else None, block_table=table, block_size=block_size,
            dense_lengths=dense_in, dense_limit=dense_limit, rows_per_dense=per_dense,
            append=last, rows_per_append=per_last, **dict(tuning))
    k_cols = k + (append is not None)
    if count_above is None:
        return out.reshape(*lead, k_cols)
    if in_kernel:  # the selecting program counted them (a dense row's count is its length)
        out, n_above = out
    else:
        above = x > np.float32(count_above)
        if per_row is not None:
            above &= jnp.arange(n, dtype=jnp.int32)[None, :] < per_row[:, None]
        n_above = jnp.minimum(jnp.sum(above, axis=-1, dtype=jnp.int32), k)
        if dense is not None:
            n_above = jnp.where(dense, dense_len, n_above)
    return out.reshape(*lead, k_cols), n_above.reshape(lead)


def topk_indices(scores, k: int, counts=None, *, impl: str = "auto", greater_first: bool = False,
                 count_above: float | None = None, block_table=None, block_size: int | None = None,
                 dense_lengths=None, dense_limit: int | None = None, append=None, **tuning):
    """Positions of the ``k`` largest valid scores per row: ``int32[R..., k]``.

    Args:
      scores: ``float32[R..., N]`` (bf16/f16 are upcast).
      k: static int, ``1 <= k <= N``.
      counts: optional ``int32[R...]``, valid leading entries per row.
      impl: "auto" | "pallas" | "reference".
      greater_first: in a row with at least ``k`` valid entries, the entries strictly
        above the k-th largest value come first, then the ties at it (the kernel otherwise
        returns positions in ascending order; the reference's order is by value, so it
        always satisfies this). A caller that marks entries with ``-inf`` and has fewer
        than ``k`` others finds those others first.
      count_above: optional float: also return ``int32[R...]``, ``min(k, #(valid scores >
        count_above))`` (NaN is not above anything), as ``(positions, count)``. The kernel
        counts them in the selecting program (single-level plans; else one XLA reduction):
        a caller that marks entries with ``-inf`` gets its count without another pass.
      block_table, block_size: optional ``int32[R..., W]`` (``W * block_size >= N``) and a
        static int: return ``block_table[..., p // block_size] * block_size + p % block_size``
        for each position ``p`` (the token of slot ``p`` when a row's entries are the tokens
        of whole blocks), made by the kernel as it writes the positions.
      dense_lengths, dense_limit: optional ``int32[R...]`` (or with its last axis 1, as
        ``counts``) and a static int: a row whose length is at most ``dense_limit`` (a context
        short enough to attend whole) gets ``arange(k)``, not mapped, and, with
        ``count_above``, its length as the count.
      append: optional ``int32[R...]`` (or with its last axis 1, as ``counts``): the result is
        ``int32[R..., k + 1]``, each row's value in its last column, stored by the kernel (a
        caller that appends a fixed entry, e.g. the newest block, saves a concatenate).
      **tuning: kernel knobs (see module docstring).

    See the module docstring for the full contract (order, ties, short rows,
    -inf and NaN).
    """
    k = _check_args(scores, k, counts, tuning)
    _check_map_args(scores, block_table, block_size, dense_lengths, dense_limit)
    if append is not None:
        _checks.check_int("append", append)
        _check_per_row("append", append, tuple(scores.shape[:-1]))
    if count_above is not None:
        if isinstance(count_above, bool) or not isinstance(count_above, (int, float, np.floating, np.integer)):
            raise TypeError(f"count_above must be a static float or None, got {count_above!r}")
        count_above = float(count_above)
    n = scores.shape[-1]
    lead = scores.shape[:-1]
    if math.prod(lead) == 0:
        empty = jnp.zeros((*lead, k + (append is not None)), jnp.int32)
        return empty if count_above is None else (empty, jnp.zeros(lead, jnp.int32))
    if impl == "auto" and on_gpu():
        auto_impl, auto_tuning = topk_auto_choice(n, k, math.prod(lead))
        tuning = {**auto_tuning, **tuning}
        if auto_impl == "reference":
            return _run(scores, counts, block_table, dense_lengths, append, k=k, choice="reference", interpret=False,
                        tuning=(), count_above=count_above, block_size=_int_or_none(block_size),
                        dense_limit=_int_or_none(dense_limit))
    elif impl == "pallas" and on_gpu() and not tuning:  # the measured best, unless the caller tuned
        tuning = _measured(n, k, math.prod(lead))
    unsupported = None
    if impl != "reference" and _plan(n, k, tuning) is None:
        unsupported = f"no kernel plan for N={n}, k={k} with tuning {tuning}"
    choice, interpret = resolve_impl(impl, kernel_unsupported=unsupported)
    if greater_first:
        tuning = {**tuning, "greater_first": True}
    tuning_items = tuple(sorted(tuning.items())) if choice == "pallas" else ()
    return _run(scores, counts, block_table, dense_lengths, append, k=k, choice=choice, interpret=interpret,
                tuning=tuning_items, count_above=count_above, block_size=_int_or_none(block_size),
                dense_limit=_int_or_none(dense_limit))
