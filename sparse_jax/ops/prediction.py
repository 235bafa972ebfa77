"""AsyncSpade's query predictor as a public op (``pallas_kernels.query_predictor``)."""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels import query_predictor as _qp
from sparse_jax.ops._checks import check_float, check_int_array, check_rank
from sparse_jax.ops._dispatch import resolve_impl

REFERENCES = ("lu", "cholesky")


def predict_query(hist, count, *, window: int, ridge: float, impl: str = "auto", reference: str = "lu",
                  **tuning):
    """``q̂_{t+1}`` from the query history: ``float32[B, Hq, D]``.

    ``hist [B, Hq, >= W+1, D]`` (the last ``W+1`` entries are used, oldest first,
    the newest query last), ``count int32[B]``: how many of those are real
    queries (1..W+1). ``window = 1`` is the lag (``hist[:, :, -1]``, no kernel).
    ``reference`` picks the jnp path that ``impl="reference"`` (and ``"auto"``
    off the GPU or for shapes the kernel refuses) runs: ``"lu"`` (``W - 1``
    batched solves, the oracle) or ``"cholesky"`` (one factorization for all
    windows). Tuning (kernel only): ``num_warps``, ``num_stages``.
    """
    check_rank("hist", hist, 4, "[B, Hq, W+1, D]")
    check_float("hist", hist)
    b = hist.shape[0]
    check_int_array("count", count, (b,), "[B]")
    window = int(window)
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if hist.shape[2] < window + 1:
        raise ValueError(f"hist must hold at least window + 1 = {window + 1} queries, got {hist.shape[2]}")
    if not ridge > 0:
        raise ValueError(f"ridge must be > 0, got {ridge}")
    if reference not in REFERENCES:
        raise ValueError(f"reference must be one of {REFERENCES}, got {reference!r}")
    bad = set(tuning) - {"num_warps", "num_stages"}
    if bad:
        raise ValueError(f"unknown tuning keys for predict_query: {sorted(bad)}")
    if window == 1:  # one weight, softmax 1: the lag, exactly
        return hist[:, :, -1].astype(jnp.float32)
    choice, interpret = resolve_impl(impl, kernel_unsupported=_qp.unsupported_reason(window, hist.shape[3]))
    if choice == "reference":
        ref = _qp.predict_lu_reference if reference == "lu" else _qp.predict_cholesky_reference
        return ref(hist, count, window=window, ridge=float(ridge))
    return _qp.predict_pallas(hist, count, window=window, ridge=float(ridge), interpret=interpret, **tuning)
