"""The paged-decode probe's own numerics (CPU, Pallas interpret mode): its pool holds each
row's pages where the block table says, and jax's paged kernel as the probe calls it equals
the f32 dense reference over ragged lengths, so a GPU run's timings compare the same result."""

import jax.numpy as jnp
import numpy as np

from benchmarks.probes import paged_decode as probe


def test_pool_layout_and_paged_kernel_match_the_reference():
    q, k, v, kp, vp, table = probe._inputs(2, 256, 8, 2, 64, 64, seed=3)
    for r in range(2):
        for j in range(4):
            np.testing.assert_array_equal(np.asarray(kp[:, int(table[r, j])]), np.asarray(k[r, :, 64 * j:64 * j + 64]))
    q, k, v, kp, vp = (x.astype(jnp.float32) for x in (q, k, v, kp, vp))
    lengths = jnp.asarray([256, 130], jnp.int32)  # one row ends inside a page
    ref = np.asarray(probe._reference(q, k, v, lengths))
    out = np.asarray(probe.jax_paged(q, kp, vp, table, lengths, 2, 2, interpret=True))
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)


def test_our_kernel_reads_the_probe_pool_through_its_table():
    """The probe's ``ours paged`` layout: jax's pages ``[Hkv, P, page, D]`` are our kernel's pool
    ``[1, Hkv, P * page, D]``; every valid page selected, it equals the f32 reference."""
    from sparse_jax.ops.attention import dense_decode_attention

    q, k, v, kp, vp, table = probe._inputs(2, 256, 8, 2, 64, 64, seed=4)
    q, k, v, kp, vp = (x.astype(jnp.float32) for x in (q, k, v, kp, vp))
    lengths = jnp.asarray([256, 130], jnp.int32)
    pool_k, pool_v = (x.reshape(1, 2, -1, 64) for x in (kp, vp))
    for impl in ("pallas", "reference"):
        out = dense_decode_attention(q, pool_k, pool_v, lengths, block_size=64, impl=impl, block_table=table)
        np.testing.assert_allclose(np.asarray(out), np.asarray(probe._reference(q, k, v, lengths)), atol=1e-5,
                                   rtol=1e-5, err_msg=impl)
