"""Log-sum-exp merging of partial attention results (pure jnp, runs anywhere).

A *partial* attention result over a token set T, for one query row, is
``(o, m, l)`` with

* ``m = max_{t in T} s_t``                (the max scaled logit, float32),
* ``l = sum_{t in T} exp(s_t - m)``       (float32),
* ``o = sum_{t in T} exp(s_t - m) v_t / l``  (the normalised output).

For an empty set we use ``m = MASK_VALUE`` (a large negative *finite* number,
so that ``m1 - m2`` never produces ``inf - inf = NaN``), ``l = 0`` and
``o = 0``. Two partials over disjoint sets merge exactly into the partial over
the union (``merge_normalized``). The kernels also use ``combine_splits`` to
merge the *unnormalised* per-split accumulators of flash-decoding.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

# Logit value used for masked-out tokens and as the running max of an empty
# set. Finite on purpose: see the module docstring. Same value as JAX's own
# GPU paged-attention kernel.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


def _safe_div(num, den):
    """num / den with den == 0 giving 0 (empty token set -> zero output)."""
    return num / jnp.where(den > 0, den, 1.0)


def combine_splits(o, m, l, axis: int):
    """Merge flash-decoding partials along ``axis``.

    Args:
      o: float32 ``[..., NS, ..., D]`` *unnormalised* accumulators
        ``sum exp(s - m_split) v`` (``axis`` indexes the splits).
      m, l: float32 ``[..., NS, ...]``: ``o.shape[:-1]``.
    Returns:
      ``(out, m, l)``: the normalised float32 output (``axis`` removed) and its
      residuals.
    """
    m_all = jnp.max(m, axis=axis)
    # m <= m_all elementwise, so the exponent is <= 0: no overflow. Empty
    # splits have m = MASK_VALUE and l = 0, o = 0: weight ~0 and no NaN.
    w = jnp.exp(m - jnp.expand_dims(m_all, axis))
    l_all = jnp.sum(w * l, axis=axis)
    o_all = jnp.sum(w[..., None] * o, axis=axis)
    return _safe_div(o_all, l_all[..., None]), m_all, l_all


def merge_normalized(o1, m1, l1, o2, m2, l2):
    """Merge two *normalised* partials over disjoint token sets.

    Shapes: ``o1, o2`` ``[..., D]`` (any float dtype), ``m*, l*`` float32
    ``[...]``. Returns ``(o, m, l)`` with ``o`` in float32.
    """
    m1 = m1.astype(jnp.float32)
    m2 = m2.astype(jnp.float32)
    m = jnp.maximum(m1, m2)
    w1 = l1.astype(jnp.float32) * jnp.exp(m1 - m)
    w2 = l2.astype(jnp.float32) * jnp.exp(m2 - m)
    l = w1 + w2
    o = w1[..., None] * o1.astype(jnp.float32) + w2[..., None] * o2.astype(jnp.float32)
    return _safe_div(o, l[..., None]), m, l
