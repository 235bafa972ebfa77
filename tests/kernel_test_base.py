"""A shared, parameterised test base for the decode-attention kernels (in the
style of tokamax's per-op test bases): one class states what every decode
kernel must satisfy, and each kernel's test module subclasses it with the one
thing that differs, how its selection is drawn.

Every subclass gets, for the Pallas kernel (interpret mode on CPU) and its jnp
reference alike, over float32 / bfloat16 / float16 and awkward shapes (S not a
multiple of any tile, G = 1 / 3 / 4 / 8, D = 64 / 128 / 256, ragged rows, empty
selections):

* ``test_matches_oracle``: the output equals a float64 NumPy oracle over the
  positions the selection names, within a dtype-aware tolerance;
* ``test_empty_selection_is_zero``: a row with nothing selected returns zeros,
  never NaN;
* ``test_is_deterministic_and_finite``.

A subclass sets ``op`` (the public op, called with ``impl=``) and implements
``draw(rng, B, Hkv, S)`` -> ``(args, token_lists)``: the op's selection
arguments (a dict) and, per batch row and KV head, the positions they attend.
Fresh random data for every case (seeded by the case, so failures reproduce).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from attention_oracle import oracle

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2, jnp.float16: 5e-3}

# (B, Hq, Hkv, S, D): awkward on purpose
SHAPES = [
    pytest.param(2, 4, 4, 257, 64, id="mha-s257-d64"),
    pytest.param(3, 12, 4, 300, 128, id="gqa3-s300-d128"),
    pytest.param(1, 16, 2, 333, 64, id="gqa8-s333-d64"),
    pytest.param(2, 8, 2, 130, 128, id="gqa4-s130-d128"),
    pytest.param(2, 4, 1, 200, 256, id="mqa4-s200-d256"),  # Gemma 3 270M: 4 q heads, 1 KV head, D=256
]
DTYPES = [pytest.param(jnp.float32, id="f32"), pytest.param(jnp.bfloat16, id="bf16"),
          pytest.param(jnp.float16, id="f16")]
IMPLS = ["pallas", "reference"]


def make_qkv(rng, B, Hq, Hkv, S, D, dtype):
    """Rounded to the test dtype first, so the oracle sees exactly the kernel's inputs."""
    q = jnp.asarray(1.5 * rng.standard_normal((B, Hq, D)), dtype)
    k = jnp.asarray(rng.standard_normal((B, Hkv, S, D)), dtype)
    v = jnp.asarray(rng.standard_normal((B, Hkv, S, D)), dtype)
    return q, k, v


class DecodeKernelTestBase:
    op = None  # the public op: op(q, k, v, **selection_args, impl=...)

    def draw(self, rng, B, Hkv, S):
        """``(args, token_lists)``; ``token_lists[b][h]``: the attended positions."""
        raise NotImplementedError

    def empty_args(self, B, Hkv, S):
        """Selection arguments under which row 0, KV head 0 attends nothing."""
        raise NotImplementedError

    def _case(self, B, Hq, Hkv, S, D, dtype):
        rng = np.random.default_rng(abs(hash((type(self).__name__, B, Hq, Hkv, S, D, str(dtype)))) % 2**32)
        q, k, v = make_qkv(rng, B, Hq, Hkv, S, D, dtype)
        args, lists = self.draw(rng, B, Hkv, S)
        return q, k, v, args, lists

    @pytest.mark.parametrize("impl", IMPLS)
    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("B,Hq,Hkv,S,D", SHAPES)
    def test_matches_oracle(self, B, Hq, Hkv, S, D, dtype, impl):
        q, k, v, args, lists = self._case(B, Hq, Hkv, S, D, dtype)
        got = type(self).op(q, k, v, **args, impl=impl)
        assert got.shape == q.shape and got.dtype == q.dtype
        want, _, _ = oracle(q, k, v, lists, D**-0.5)
        tol = TOL[dtype]
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=tol, atol=tol,
                                   err_msg=f"{type(self).__name__} {impl}")

    @pytest.mark.parametrize("impl", IMPLS)
    def test_empty_selection_is_zero(self, impl):
        B, Hq, Hkv, S, D = 2, 8, 2, 97, 64
        q, k, v, _, _ = self._case(B, Hq, Hkv, S, D, jnp.float32)
        got = np.asarray(type(self).op(q, k, v, **self.empty_args(B, Hkv, S), impl=impl))
        assert np.isfinite(got).all()
        np.testing.assert_array_equal(got[0, : Hq // Hkv], 0.0)  # row 0, KV head 0's group

    @pytest.mark.parametrize("impl", IMPLS)
    def test_is_deterministic_and_finite(self, impl):
        q, k, v, args, _ = self._case(2, 8, 2, 200, 64, jnp.bfloat16)
        a = np.asarray(type(self).op(q, k, v, **args, impl=impl), np.float32)
        b = np.asarray(type(self).op(q, k, v, **args, impl=impl), np.float32)
        assert np.isfinite(a).all()
        np.testing.assert_array_equal(a, b)
