"""Token Sparse Attention's step 1 as an op: the mean attention probability each key gets
from a row's last ``window`` queries (:func:`window_scores`), the Pallas kernel
(``pallas_kernels.window_scores``) or its pure-jnp reference, dispatched like every op here.
:mod:`sparse_jax.prefill` (the prefill policy) calls it (and re-exports ``window_scores``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import window_scores as _ws
from sparse_jax.ops._checks import check_float, check_gqa, check_int_array, check_rank
from sparse_jax.ops._dispatch import resolve_impl

__all__ = ["window_scores", "window_scores_reference"]


def window_scores_reference(q, k, lengths, window: int, *, q_start=None, prefix=None):
    """Step 1, pure jnp (the kernel's oracle): ``[B, Hq, T]`` f32, the mean attention
    probability each key gets from the row's last ``window`` queries (0 outside the
    prefix ``[0, L - W)``). Materialises the ``[B, Hq, W, T]`` f32 probabilities.
    The logits are one grouped einsum over K as stored (no per-query-head copy of K),
    f32 accumulation, full precision (no TF32 rounding of f32 inputs on the GPU).
    ``q_start`` / ``prefix``: a chunk's queries and the keys scored (:func:`window_scores`)."""
    b, tq, hq, d = q.shape
    t, hkv = k.shape[1], k.shape[2]
    lengths = lengths.astype(jnp.int32)
    first = jnp.int32(0) if q_start is None else jnp.asarray(q_start, jnp.int32)
    raw = lengths[:, None] - window + jnp.arange(window)[None, :]  # [B, W]
    live = raw >= first  # a window row before the chunk has no query
    pos = jnp.clip(raw, 0, t - 1)
    qw = jnp.take_along_axis(q, jnp.clip(raw - first, 0, tq - 1)[:, :, None, None], axis=1)  # [B, W, Hq, D]
    qw = qw.reshape(b, window, hkv, hq // hkv, d)
    s = jnp.einsum("bwhgd,bthd->bhgwt", qw, k, precision=jax.lax.Precision.HIGHEST,
                   preferred_element_type=jnp.float32).reshape(b, hq, window, t) * (d ** -0.5)
    j = jnp.arange(t)[None, None, None, :]
    ok = (j <= pos[:, None, :, None]) & (j < lengths[:, None, None, None])
    p = jax.nn.softmax(jnp.where(ok, s, -jnp.inf), axis=-1)
    if q_start is None:
        mean = p.mean(axis=2)  # [B, Hq, T]
    else:  # the mean over the rows that have a query
        weight = live / jnp.maximum(live.sum(-1, keepdims=True), 1)  # [B, W]
        mean = jnp.einsum("bhwt,bw->bht", jnp.where(live[:, None, :, None], p, 0.0), weight)
    end = lengths - window if prefix is None else prefix.astype(jnp.int32)
    return jnp.where(jnp.arange(t)[None, None, :] < end[:, None, None], mean, 0.0)


def _check_window_scores_args(q, k, lengths, window, chunk: bool = False, prefix=None):
    """Shapes and dtypes only (nothing traced): ``q [B,T,Hq,D]`` (a chunk: ``[B,Tq,Hq,D]``,
    ``Tq <= T``), ``k [B,T,Hkv,D]``, ``lengths int[B]``, ``window`` a positive int,
    ``prefix`` None or ``int[B]``."""
    check_rank("q", q, 4, "[B, T, Hq, D]")
    check_float("q", q)
    check_rank("k", k, 4, "[B, T, Hkv, D]")
    check_float("k", k)
    b, t, hq, d = q.shape
    if chunk:
        if (k.shape[0], k.shape[3]) != (b, d) or k.shape[1] < t:
            raise ValueError(f"k must have shape [B={b}, T >= {t} (the chunk's queries), Hkv, D={d}], "
                             f"got {tuple(k.shape)}")
    elif (k.shape[0], k.shape[1], k.shape[3]) != (b, t, d):
        raise ValueError(f"k must have shape [B={b}, T={t}, Hkv, D={d}], got {tuple(k.shape)}")
    if prefix is not None:
        check_int_array("prefix", prefix, (b,), "[B]")
    check_gqa(hq, k.shape[2])
    check_int_array("lengths", lengths, (b,), "[B]")
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 1:
        raise ValueError(f"window must be a positive int (static), got {window!r}")
    if t < 1:
        raise ValueError(f"q must have at least one position (T >= 1), got shape {tuple(q.shape)}")


def window_scores(q, k, lengths, window: int, *, q_start=None, prefix=None, impl: str = "auto", **tuning):
    """Step 1: ``[B, Hq, T]`` f32, the mean attention probability each key gets from
    the row's last ``window`` queries (0 outside the prefix ``[0, L - W)``); ``q
    [B,T,Hq,D]``, ``k [B,T,Hkv,D]``, ``lengths int32[B]`` (each ``<= T``).

    ``impl`` ("auto" | "pallas" | "reference", ``sparse_jax.ops._dispatch``): the
    two-pass Pallas-Triton kernel (``pallas_kernels.window_scores``: never holds the
    ``[B, Hq, W, T]`` probabilities) or :func:`window_scores_reference`. The kernel
    needs ``D`` in {64, 128, 256} and q, k of one dtype; "auto" falls back to the
    reference otherwise (and on CPU), "pallas" raises. Tuning (kernel only):
    ``block_q``, ``block_k``, ``num_splits``, ``num_warps``, ``num_stages``.

    A chunk of a prompt (chunked prefill): ``q [B, Tq, Hq, D]`` holds only positions
    ``q_start .. q_start + Tq - 1`` (``q_start`` an int, may be traced; ``Tq <= T``); a
    window row before ``q_start`` has no query, and each key's score is the mean over the
    rows that have one. ``prefix int32[B]``: the keys scored, ``[0, prefix)`` (default
    ``L - W``); the kernel applies no causal mask to them, so ``prefix`` must not pass the
    first window query that has one (``q_start``, or ``L - W``)."""
    _check_window_scores_args(q, k, lengths, window, chunk=q_start is not None, prefix=prefix)
    bad = set(tuning) - set(_ws.TUNING_KEYS)
    if bad:
        raise ValueError(f"unknown tuning keys for window_scores: {sorted(bad)}; allowed: {_ws.TUNING_KEYS}")
    window = int(window)
    choice, interpret = resolve_impl(impl, kernel_unsupported=_ws.unsupported_reason(q.shape[3], q.dtype, k.dtype))
    if choice == "reference":
        return window_scores_reference(q, k, lengths, window, q_start=q_start, prefix=prefix)
    _ws.resolve_tuning(window, q.shape[3], block_q=tuning.get("block_q"), block_k=tuning.get("block_k"))  # checks
    return _ws.window_scores_pallas(q, k, lengths, window=window, q_start=q_start, prefix=prefix,
                                    interpret=interpret, **tuning)
