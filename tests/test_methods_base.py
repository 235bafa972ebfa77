"""The attention-method interface: dense attention, layer routing, registry."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from sparse_jax.kv import ResidentKV
import pytest

from sparse_jax.methods.base import single_layer
from sparse_jax.methods import AttentionMethod, DenseAttention, available_methods, get_method
from sparse_jax.ops.dense import dense_prefill_attention, masked_decode_attention


def _oracle_decode(q, k, v, keep):
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, hq, d = q.shape
    hkv = k.shape[1]
    out = np.zeros((b, hq, d))
    for bi in range(b):
        for h in range(hq):
            kh = h // (hq // hkv)
            idx = np.nonzero(keep[bi, kh])[0]
            if idx.size == 0:
                continue
            s = k[bi, kh, idx] @ q[bi, h] / np.sqrt(d)
            p = np.exp(s - s.max())
            out[bi, h] = (p / p.sum()) @ v[bi, kh, idx]
    return out


@pytest.mark.parametrize("hq,hkv,d", [(4, 4, 64), (8, 2, 64), (16, 2, 128)])
def test_dense_decode_matches_oracle(hq, hkv, d):
    kq, kk, kv = jax.random.split(jax.random.key(hq * d), 3)
    b, s = 3, 77
    q = jax.random.normal(kq, (b, hq, d), jnp.float32)
    k = jax.random.normal(kk, (b, hkv, s, d), jnp.float32)
    v = jax.random.normal(kv, (b, hkv, s, d), jnp.float32)
    lengths = jnp.array([77, 1, 40], jnp.int32)
    out, state, carry = DenseAttention().decode(q, ResidentKV(k, v), lengths, None, None, single_layer())
    assert state is None and carry is None
    keep = np.arange(s)[None, None, :] < np.asarray(lengths)[:, None, None]
    keep = np.broadcast_to(keep, (b, hkv, s))
    np.testing.assert_allclose(out, _oracle_decode(q, k, v, keep), rtol=1e-5, atol=1e-5)


def test_masked_decode_empty_rows_are_zero():
    q = jax.random.normal(jax.random.key(0), (2, 4, 64))
    k = jax.random.normal(jax.random.key(1), (2, 2, 10, 64))
    keep = jnp.zeros((2, 2, 10), bool).at[0, 0, 3].set(True)
    out = masked_decode_attention(q, k, k, keep)
    assert np.all(np.isfinite(out))
    np.testing.assert_array_equal(out[1], 0.0)
    np.testing.assert_array_equal(out[0, 2:], 0.0)  # KV head 1 of row 0 keeps nothing
    np.testing.assert_allclose(out[0, :2], np.broadcast_to(k[0, 0, 3], (2, 64)), rtol=1e-6)


def test_dense_prefill_is_causal_gqa():
    b, t, hq, hkv, d = 2, 9, 8, 2, 64
    q = jax.random.normal(jax.random.key(0), (b, t, hq, d))
    k = jax.random.normal(jax.random.key(1), (b, t, hkv, d))
    v = jax.random.normal(jax.random.key(2), (b, t, hkv, d))
    out = dense_prefill_attention(q, k, v)
    for pos in (0, 4, 8):
        keep = np.broadcast_to(np.arange(t) <= pos, (b, hkv, t))
        ref = _oracle_decode(q[:, pos], k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), keep)
        np.testing.assert_allclose(out[:, pos], ref, rtol=1e-5, atol=1e-5)


def test_dense_layer_rule_counts_global_layers():
    @dataclasses.dataclass(frozen=True)
    class Sparse(AttentionMethod):
        dense_layers: tuple[int, ...] = (0, 1, -1)

    m = Sparse()
    assert [m.is_sparse_layer(i, 6) for i in range(6)] == [False, False, True, True, True, False]
    assert not any(DenseAttention().is_sparse_layer(i, 6) for i in range(6))


def test_registry_errors_list_valid_names():
    assert "dense" in available_methods()
    with pytest.raises(ValueError, match="available: .*dense"):
        get_method("no_such_method")
    with pytest.raises(ValueError, match="bad options"):
        get_method("dense", budget=3)
