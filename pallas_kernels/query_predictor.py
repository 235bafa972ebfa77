"""AsyncSpade's query predictor: ``q̂_{t+1}`` from a layer's query history, ``[B, Hq, D]``
f32 (Pallas-Triton kernel + two jnp references).

Shapes: ``hist [B, Hq, >= W+1, D]`` (the last ``W+1`` entries are used, oldest
first, the newest query ``q_t`` last), ``count int32[B]``: how many of those
``W+1`` are real queries (the older ``W+1-count`` are not). For each window
size ``k = 1..W``: ridge regression of ``q_t`` on the ``k`` queries before it,
``w_k = (X_k X_kᵀ + ε I)⁻¹ X_k q_t`` (``ε = ridge * |q_t|²``), softmax over
``w_k``, applied to the window shifted by one (``Q_{t-k+1..t}``); the
candidates of the windows the history supports (``k = 1`` always, ``k >= 2``
when ``count > k``) are averaged. ``k = 1`` gives ``q_t``: AsyncTLS's lag.
The method's side (why this predictor) is ``sparse_jax.methods.asyncspade``'s
docstring.

**One factorization serves every window.** Order the ``W`` past queries newest
first (``r_0 = q_{t-1}, r_1 = q_{t-2}, ...``): window ``k``'s Gram matrix
``G_k`` is the *leading* ``k x k`` block of ``G = R Rᵀ + ε I``. With ``G = L Lᵀ``
(Cholesky), ``G_k = L_k L_kᵀ`` for ``L_k = L[:k, :k]``; forward substitution is
prefix-consistent (``y = L⁻¹ b`` has ``y[:k] = L_k⁻¹ b[:k]``) and
``(L⁻¹)[:k, :k] = L_k⁻¹``. So ``w_k = L_k⁻ᵀ y[:k]``, i.e.
``w_k[i] = Σ_{i <= j < k} Linv[j, i] y[j]``: one Cholesky and one triangular
inverse per (row, query head) instead of ``W - 1`` LU solves, and all windows'
weights are one masked product ``[W, W] x [W, W]``.

Three implementations, equal in exact arithmetic (``tests/test_query_predictor.py``):

* :func:`predict_lu_reference`: ``W - 1`` padded systems through
  ``jnp.linalg.solve`` (batched LU: cuSolver getrf + pivots on the GPU, milliseconds
  per Qwen3-8B decode step: docs/methods.md, 'AsyncSpade'); the oracle.
* :func:`predict_cholesky_reference`: the factorization above in jnp
  (``jnp.linalg.cholesky`` + a triangular solve for the inverse).
* :func:`predict_pallas`: one Pallas-Triton launch per layer (below).

**GPU kernel design.** Grid ``(B * Hq,)``, a program per (row, query head).
No reversal is needed: the kernel keeps the history's order (oldest first) and
factors ``G = U Uᵀ`` with ``U`` upper triangular, eliminating from the *last*
index down: window ``k`` is then the *trailing* ``k x k`` block and the same
three facts hold for trailing blocks (the newest-first order above read
backwards). The program loads the past window ``Q_{t-W..t-1}`` and the
shifted one ``Q_{t-W+1..t}`` as two ``[Wp, D]`` tiles of one ``[Wp+1, D]``
block (rows 0.. and 1..; ``Wp``: ``W`` rounded up to a power of two >= 16,
the smallest tile a Triton dot takes; rows past ``W`` are zeroed: a zero row
only adds a decoupled ``ε`` pivot, and the loop skips it), the Gram matrix is
one IEEE-f32 dot, and the ``W`` elimination steps run unrolled on the
``[Wp, Wp]`` register tile: step ``j`` extracts column and row ``j`` with
``where(iota == j)`` + sum (no dynamic indexing), takes the pivot
``U[j, j] = sqrt(max(A[j, j], ε))`` (every pivot of ``X Xᵀ + ε I`` is
``>= ε`` in exact arithmetic; the clamp only keeps rounding from a negative
square root), and in the same step advances the back substitution
``y = U⁻¹ b``, the inverse ``U⁻¹`` (``U X = I``, one row per step) and the
all-window weights (a rank-1 update per step: row ``s`` of the weights, the
window starting at ``s``, gains ``y_j U⁻¹[j, :]`` for ``j >= s``). A masked
softmax per row, the windows' average as one coefficient per shifted row,
and one multiply-and-reduce with the shifted tile give ``q̂``. The ``2 Wp D``
floats of history per program are the only memory read; everything else
stays in registers.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._util import next_pow2

HI = lax.Precision.HIGHEST
MAX_WINDOW = 64  # the unrolled elimination: W steps on a [Wp, Wp] tile


def tile_width(window: int) -> int:
    """``Wp``: the window rounded up to a power of two, at least 16 (a Triton dot's minimum)."""
    return max(16, next_pow2(window))


def unsupported_reason(window: int, head_dim: int) -> str | None:
    if head_dim < 16 or head_dim & (head_dim - 1):
        return f"head_dim must be a power of two >= 16 for the Triton kernel, got {head_dim}"
    if not 2 <= window <= MAX_WINDOW:
        return f"the kernel takes windows 2..{MAX_WINDOW} (window 1 is the lag, no kernel), got {window}"
    return None


def _count_mask(count, window):
    """``[B, W]``: window ``k = 1..W`` is used (``k = 1`` always; ``k >= 2`` with ``k`` past queries)."""
    ks = jnp.arange(1, window + 1)
    return (ks[None, :] == 1) | (count[:, None] > ks[None, :])


@functools.partial(jax.jit, static_argnames=("window", "ridge"))
def predict_lu_reference(hist, count, *, window: int, ridge: float):
    """Pure-jnp reference: ``W - 1`` padded systems solved with ``jnp.linalg.solve``.

    Window ``k``'s Gram matrix is the trailing ``k x k`` block of the last ``W``
    past queries' Gram matrix, so one ``[W, W]`` Gram and one batched solve of
    ``W - 1`` padded systems (padding rows: identity, right-hand side 0, weight
    masked out of the softmax) serve every window."""
    h = hist.astype(jnp.float32)
    q_t = h[:, :, -1]
    total = q_t  # k = 1: one weight, softmax 1: the lag
    if window == 1:
        return total
    past = h[:, :, -1 - window:-1]  # Q_{t-W..t-1}: [B, Hq, W, D]
    eps = ridge * jnp.maximum(jnp.sum(q_t * q_t, -1), 1e-12)  # [B, Hq]
    gram = jnp.einsum("bhid,bhjd->bhij", past, past, precision=HI)  # [B, Hq, W, W]
    rhs = jnp.einsum("bhid,bhd->bhi", past, q_t, precision=HI)  # [B, Hq, W]
    ks = jnp.arange(2, window + 1)  # window sizes: [W-1]
    idx = jnp.arange(window)
    real = idx[None, :] >= window - ks[:, None]  # [W-1, W]: row i is in window k (the last k rows)
    both = real[:, :, None] & real[:, None, :]
    eye = jnp.eye(window, dtype=jnp.float32)
    g = jnp.where(both, gram[:, :, None], 0.0) + eye * jnp.where(real, eps[:, :, None, None], 1.0)[..., None]
    b = jnp.where(real, rhs[:, :, None], 0.0)
    w = jnp.linalg.solve(g, b[..., None])[..., 0]  # [B, Hq, W-1, W]
    w = jax.nn.softmax(jnp.where(real, w, -jnp.inf), axis=-1)
    # applied to the window shifted by one: row i of Q_{t-W..t-1} -> Q_{t-W+1..t}
    cand = jnp.einsum("bhki,bhid->bhkd", w, h[:, :, -window:], precision=HI)  # [B, Hq, W-1, D]
    ok = (count[:, None] > ks[None, :])[:, None, :, None]  # [B, 1, W-1, 1]: k past queries known
    total = total + jnp.sum(jnp.where(ok, cand, 0.0), axis=2)
    used = 1.0 + jnp.sum(count[:, None] > ks[None, :], axis=-1).astype(jnp.float32)
    return total / used[:, None, None]


@functools.partial(jax.jit, static_argnames=("window", "ridge"))
def predict_cholesky_reference(hist, count, *, window: int, ridge: float):
    """Pure-jnp, one Cholesky per (row, head): the module docstring's prefix form
    (newest first, window ``k`` = the leading ``k x k`` block)."""
    h = hist.astype(jnp.float32)
    q_t = h[:, :, -1]
    if window == 1:
        return q_t
    rev = h[:, :, -1 - window:][:, :, ::-1]  # [B, Hq, W+1, D]: q_t, q_{t-1}, ..., q_{t-W}
    past, cur = rev[:, :, 1:], rev[:, :, :-1]  # window k regresses on past[:k], applies to cur[:k]
    eps = ridge * jnp.maximum(jnp.sum(q_t * q_t, -1), 1e-12)
    eye = jnp.eye(window, dtype=jnp.float32)
    g = jnp.einsum("bhid,bhjd->bhij", past, past, precision=HI) + eps[..., None, None] * eye
    rhs = jnp.einsum("bhid,bhd->bhi", past, q_t, precision=HI)
    chol = jnp.linalg.cholesky(g)
    linv = jax.scipy.linalg.solve_triangular(chol, jnp.broadcast_to(eye, g.shape), lower=True)
    y = jnp.einsum("bhji,bhi->bhj", linv, rhs, precision=HI)
    idx = jnp.arange(window)
    upto = idx[None, :] <= idx[:, None]  # [k-1, j]: j < k (row k-1 is window k)
    w = jnp.einsum("bhkj,bhji->bhki", jnp.where(upto, y[:, :, None, :], 0.0), linv, precision=HI)
    p = jax.nn.softmax(jnp.where(upto, w, -jnp.inf), axis=-1)  # [B, Hq, W, W]
    ok = _count_mask(count, window).astype(jnp.float32)  # [B, W]
    coef = jnp.einsum("bk,bhki->bhi", ok, p, precision=HI)
    return jnp.einsum("bhi,bhid->bhd", coef, cur, precision=HI) / jnp.sum(ok, -1)[:, None, None]


def _kernel(cnt_ref, h_ref, o_ref, *, window: int, wp: int, ridge: float):
    # cnt_ref []: the row's count; h_ref [Wp+1, D]: the history (oldest first, rows past
    # W+1 zero padding; row W is q_t); o_ref [D]
    count = cnt_ref[()]
    io = lax.broadcasted_iota(jnp.int32, (wp,), 0)
    rows = lax.broadcasted_iota(jnp.int32, (wp, wp), 0)
    cols = lax.broadcasted_iota(jnp.int32, (wp, wp), 1)
    real = (io < window)[:, None]
    past = jnp.where(real, h_ref[pl.ds(0, wp), :], 0.0)  # Q_{t-W..t-1}
    shifted = jnp.where(real, h_ref[pl.ds(1, wp), :], 0.0)  # Q_{t-W+1..t}
    q_t = h_ref[window, :]
    eps = ridge * jnp.maximum(jnp.sum(q_t * q_t), 1e-12)
    diag = rows == cols
    a = lax.dot_general(past, past, (((1,), (1,)), ((), ())), precision=(HI, HI),
                        preferred_element_type=jnp.float32) + jnp.where(diag, eps, 0.0)
    r = jnp.sum(past * q_t[None, :], axis=1)  # b = X q_t, then the back substitution's residual
    inv_res = jnp.where(diag, 1.0, 0.0)  # U X = I's residual (X = U⁻¹ row by row)
    wts = jnp.zeros((wp, wp), jnp.float32)  # row s: window {s..W-1}'s ridge weights
    for j in range(window - 1, -1, -1):
        col = jnp.sum(jnp.where(cols == j, a, 0.0), axis=1)  # A[:, j]
        row = jnp.sum(jnp.where(rows == j, a, 0.0), axis=0)  # A[j, :] (symmetric: the same numbers)
        piv = jnp.sqrt(jnp.maximum(jnp.sum(jnp.where(io == j, col, 0.0)), eps))
        keep = io <= j
        u_c = jnp.where(keep, col, 0.0) / piv  # U[:, j]
        u_r = jnp.where(keep, row, 0.0) / piv
        y_j = jnp.sum(jnp.where(io == j, r, 0.0)) / piv
        x_r = jnp.sum(jnp.where(rows == j, inv_res, 0.0), axis=0) / piv  # U⁻¹[j, :]
        r = r - u_c * y_j
        inv_res = inv_res - u_c[:, None] * x_r[None, :]
        a = a - u_c[:, None] * u_r[None, :]
        wts = wts + jnp.where(keep, y_j, 0.0)[:, None] * x_r[None, :]
    inside = (cols >= rows) & (cols < window)
    logits = jnp.where(inside, wts, -1e30)
    e = jnp.where(inside, jnp.exp(logits - jnp.max(logits, axis=1)[:, None]), 0.0)
    p = e / jnp.maximum(jnp.sum(e, axis=1), 1e-30)[:, None]
    k = window - io  # row s's window size
    ok = (io < window) & ((k == 1) | (count > k))
    coef = jnp.sum(jnp.where(ok[:, None], p, 0.0), axis=0)  # [Wp]: weight of shifted row i
    used = jnp.sum(ok.astype(jnp.float32))
    o_ref[...] = jnp.sum(coef[:, None] * shifted, axis=0) / used


@functools.partial(jax.jit, static_argnames=("window", "ridge", "num_warps", "num_stages", "interpret"))
def predict_pallas(hist, count, *, window: int, ridge: float, num_warps=None, num_stages=None,
                   interpret=False):
    """The kernel (module docstring); ``window >= 2``. Tuning: ``num_warps`` (default 2),
    ``num_stages`` (1)."""
    b, hq, _, d = hist.shape
    wp = tile_width(window)
    h = hist[:, :, -1 - window:].astype(jnp.float32)  # no copy when hist is f32 with W+1 entries
    if wp > window:  # rows 0..Wp: the shifted tile reads rows 1..Wp
        h = jnp.pad(h, ((0, 0), (0, 0), (0, wp - window), (0, 0)))
    kernel = functools.partial(_kernel, window=window, wp=wp, ridge=float(ridge))
    out = pl.pallas_call(
        kernel,
        grid=(b * hq,),
        in_specs=[pl.BlockSpec((None,), lambda i: (i // hq,)),
                  pl.BlockSpec((None, wp + 1, d), lambda i: (i, 0, 0))],
        out_specs=pl.BlockSpec((None, d), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((b * hq, d), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=2 if num_warps is None else int(num_warps),
                                             num_stages=1 if num_stages is None else int(num_stages)),
        interpret=interpret,
        name=f"query_predictor_w{window}",
    )(count.astype(jnp.int32), h.reshape(b * hq, wp + 1, d))
    return out.reshape(b, hq, d)
