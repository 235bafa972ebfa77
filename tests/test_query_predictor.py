"""AsyncSpade's query predictor (pallas_kernels.query_predictor through
sparse_jax.ops.prediction.predict_query): the one-Cholesky kernel (Pallas
interpret mode on CPU) and the jnp Cholesky-prefix form against the W - 1 LU
solves (the reference) and a float64 window-by-window oracle, over awkward
sizes and short histories; W = 1 is the lag with no kernel; bad input fails
before compilation; AsyncSpade with the kernel chooses what it chooses with
the reference.

Tolerance: every implementation solves ``(X Xᵀ + ε I) w = X q_t`` in float32
with ``ε = 1e-2 |q_t|²``, so the system's condition number is at most
``1 + λ_max / ε``, about ``1 + 100 W`` for queries of similar norms (~1.6e3
at W = 16): a backward-stable f32 solve (LU with pivoting, Cholesky) moves
``w`` by up to ``cond * 6e-8``, ~1e-4 relative. The softmax is 1-Lipschitz
and the candidates are convex combinations of the history, so ``q̂`` moves by
~1e-4 of the history's scale: ``|got - want| <= 1e-4 * max |hist|`` (the
measured differences are ~1e-7; the LU reference is no closer to the float64
oracle than the Cholesky forms)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from sparse_jax.methods.asyncspade import AsyncSpade, predict_next_query
from sparse_jax.ops.prediction import predict_query
from tests.test_asyncspade import _decode_steps, _np_predict

RTOL = 1e-4
RIDGE = 1e-2
IMPLS = [pytest.param(dict(impl="pallas"), id="pallas"),
         pytest.param(dict(impl="reference", reference="cholesky"), id="cholesky-jnp")]


def _history(rng, b, hq, w, d):
    """Queries with the temporal correlation of real ones (each step leans on the last)."""
    h = rng.normal(size=(b, hq, w + 1, d))
    for t in range(1, w + 1):
        h[:, :, t] = 0.8 * h[:, :, t - 1] + 0.6 * h[:, :, t]
    return h.astype(np.float32)


def _check(got, hist, count, window, ridge=RIDGE):
    hist = np.asarray(hist, np.float64)
    want = predict_next_query(jnp.asarray(hist, jnp.float32), jnp.asarray(count), window, ridge)
    scale = RTOL * np.abs(hist).max()
    assert got.shape == want.shape and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=scale)
    oracle = np.array([[_np_predict(hist[b, h], int(count[b]), window, ridge) for h in range(hist.shape[1])]
                       for b in range(hist.shape[0])])
    np.testing.assert_allclose(np.asarray(got), oracle, rtol=0, atol=scale)
    np.testing.assert_allclose(np.asarray(want), oracle, rtol=0, atol=scale)


# (B, Hq, W, D, counts, extra): W padded to the tile (2, 5), exactly the tile (16), past it
# (20); counts: full history, short ones, and 1 (after prefill: the lag); extra: history
# entries before the last W + 1 (ignored). The W = 16 shape is test_degenerate_histories'
# too (one compilation of the interpreted kernel for both).
CASES = [
    pytest.param(3, 4, 2, 256, [3, 2, 1], 0, id="b3-h4-w2-d256"),
    pytest.param(1, 12, 5, 128, [3], 0, id="b1-h12-w5-d128"),
    pytest.param(3, 4, 16, 64, [17, 6, 1], 0, id="b3-h4-w16-d64"),
    pytest.param(1, 4, 20, 64, [21], 3, id="b1-h4-w20-d64-longer-history"),
]


@pytest.mark.parametrize("kw", IMPLS)
@pytest.mark.parametrize("b,hq,w,d,counts,extra", CASES)
def test_matches_the_lu_reference_and_the_float64_oracle(b, hq, w, d, counts, extra, kw):
    rng = np.random.default_rng(w * 1000 + d + b)
    hist = _history(rng, b, hq, w + extra, d)
    count = np.asarray(counts, np.int32)
    got = predict_query(jnp.asarray(hist), jnp.asarray(count), window=w, ridge=RIDGE, **kw)
    _check(got, hist[:, :, extra:], count, w)


@pytest.mark.parametrize("kw", IMPLS)
def test_degenerate_histories(kw):
    """Repeated queries (a rank-1 Gram matrix: the worst conditioning ε allows), a zero
    newest query (ε = 1e-14 |.|: the ridge is gone, the right-hand side is 0), and zeros
    before a lone real query (the state after prefill)."""
    rng = np.random.default_rng(7)
    w, d = 16, 64
    hist = _history(rng, 3, 4, w, d)
    hist[0] = hist[0, :, -1:]  # row 0: one query repeated
    hist[1, :, -1] = 0.0  # row 1: q_t = 0
    hist[2, :, :-1] = 0.0  # row 2: only q_t is real (count 1), zeros before it
    count = np.asarray([17, 17, 1], np.int32)
    got = predict_query(jnp.asarray(hist), jnp.asarray(count), window=w, ridge=RIDGE, **kw)
    assert np.isfinite(np.asarray(got)).all()
    _check(got, hist, count, w)
    np.testing.assert_allclose(np.asarray(got)[2], hist[2, :, -1], rtol=1e-6)


def test_window_one_is_the_lag_without_a_kernel(monkeypatch):
    from pallas_kernels import query_predictor as qp

    def boom(*a, **k):
        raise AssertionError("window 1 must not run the kernel")

    monkeypatch.setattr(qp, "predict_pallas", boom)
    hist = jnp.asarray(np.random.default_rng(0).normal(size=(2, 3, 4, 64)), jnp.float32)
    got = predict_query(hist, jnp.asarray([1, 4], jnp.int32), window=1, ridge=RIDGE, impl="pallas")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(hist[:, :, -1]))


def test_bad_input_fails_before_compiling():
    h = jnp.zeros((2, 4, 6, 64), jnp.float32)
    c = jnp.ones((2,), jnp.int32)
    with pytest.raises(ValueError, match="rank 4"):
        predict_query(h[0], c, window=5, ridge=RIDGE)
    with pytest.raises(TypeError, match="float32"):
        predict_query(h.astype(jnp.int32), c, window=5, ridge=RIDGE)
    with pytest.raises(ValueError, match="count"):
        predict_query(h, jnp.ones((3,), jnp.int32), window=5, ridge=RIDGE)
    with pytest.raises(TypeError, match="count"):
        predict_query(h, jnp.ones((2,), jnp.float32), window=5, ridge=RIDGE)
    with pytest.raises(ValueError, match="at least window"):
        predict_query(h, c, window=6, ridge=RIDGE)
    with pytest.raises(ValueError, match="ridge"):
        predict_query(h, c, window=5, ridge=0.0)
    with pytest.raises(ValueError, match="reference"):
        predict_query(h, c, window=5, ridge=RIDGE, reference="qr")
    with pytest.raises(ValueError, match="tuning"):
        predict_query(h, c, window=5, ridge=RIDGE, impl="pallas", block=4)
    with pytest.raises(ValueError, match="power of two"):
        predict_query(jnp.zeros((2, 4, 6, 48)), c, window=5, ridge=RIDGE, impl="pallas")
    with pytest.raises(ValueError, match="impl"):
        AsyncSpade(impl="triton").check(num_q_heads=4, num_kv_heads=2, head_dim=16, max_len=256)


def test_asyncspade_with_the_kernel_chooses_what_the_reference_chooses():
    ref, _ = _decode_steps(AsyncSpade(selector="quest", budget=64, window=4, impl="reference"), 3)
    ker, _ = _decode_steps(AsyncSpade(selector="quest", budget=64, window=4, impl="pallas"), 3)
    for (_, _, sel_r, _, st_r), (_, _, sel_k, _, st_k) in zip(ref, ker):
        np.testing.assert_array_equal(np.asarray(sel_k.indices), np.asarray(sel_r.indices))
        np.testing.assert_array_equal(np.asarray(st_k["next"]), np.asarray(st_r["next"]))
        np.testing.assert_array_equal(np.asarray(st_k["next_counts"]), np.asarray(st_r["next_counts"]))
