"""host_gather: exact block copies (Pallas interpret mode on CPU) vs. numpy.

The CPU backend has a ``pinned_host`` memory too, so these tests pass ``src``
the way the real use does: committed to pinned host memory.
"""

from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import host_gather as hg_k
from sparse_jax.ops.transfer import host_gather

RNG = np.random.default_rng(7)


def pinned(x):
    dev = jax.devices()[0]
    return jax.device_put(jnp.asarray(x), jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host"))


def random_blocks(shape, dtype):
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.integer):
        info = jnp.iinfo(dtype)
        return RNG.integers(info.min, info.max, size=shape, endpoint=True).astype(dtype)
    if dtype == jnp.bool_:
        return RNG.integers(0, 2, size=shape).astype(bool)
    return np.asarray(RNG.standard_normal(shape) * 1000, dtype=np.float32).astype(dtype)


def expect(x, ids):
    x = np.asarray(x)
    return x[np.clip(np.asarray(ids), 0, x.shape[0] - 1)]


@pytest.mark.parametrize(
    "shape,dtype,ids,tuning",
    [
        ((16, 256), jnp.float32, [3, 1, 3, 15, 0], {}),  # repeated ids
        ((9, 4, 8, 16), jnp.bfloat16, [8, 0, 4, 4, 7, 1], {}),  # KV-style block
        ((7, 3, 5), jnp.float32, [6, 0, 2], {}),  # nothing a power of two
        ((7, 3, 5), jnp.int8, [6, 0, 2, 2], dict(tile_bytes=16)),  # several row tiles, partial
        ((5, 2, 3, 100), jnp.float16, [4, 4, 1], dict(tile_bytes=256)),  # masked columns
        ((5, 1000), jnp.int32, [1, 2, 3, 4, 0, 1], dict(tile_bytes=512)),  # column tiles
        ((6,), jnp.uint32, [5, 2, 0], {}),  # scalar blocks
        ((4, 33), jnp.bool_, [3, 3, 0], {}),
        ((3, 64), jnp.float32, [2], dict(num_warps=8, tile_bytes=64)),
    ],
)
def test_exact_copy_from_pinned_host(shape, dtype, ids, tuning):
    x = random_blocks(shape, dtype)
    ids = jnp.asarray(ids, jnp.int32)
    out = host_gather(pinned(x), ids, impl="pallas", **tuning)
    assert out.shape == (len(ids), *shape[1:]) and out.dtype == jnp.dtype(dtype)
    assert out.sharding.memory_kind == "device"
    np.testing.assert_array_equal(np.asarray(out), expect(x, ids))


def test_reference_and_auto():
    x = random_blocks((10, 3, 32), jnp.float32)
    ids = jnp.asarray([9, 0, 5, 5], jnp.int32)
    for impl in ("reference", "auto"):
        out = host_gather(pinned(x), ids, impl=impl)
        assert out.sharding.memory_kind == "device"
        np.testing.assert_array_equal(np.asarray(out), expect(x, ids))


def test_device_src_and_out_of_range_ids_are_clamped():
    x = random_blocks((6, 40), jnp.float32)
    ids = jnp.asarray([-5, 0, 6, 100, 2], jnp.int32)
    for impl in ("pallas", "reference"):
        out = host_gather(jnp.asarray(x), ids, impl=impl)  # plain device array works too
        np.testing.assert_array_equal(np.asarray(out), expect(x, ids))


def test_random_ids_many_blocks():
    nb, m = 64, 200
    x = random_blocks((nb, 8, 16), jnp.bfloat16)
    ids = RNG.integers(0, nb, size=m).astype(np.int32)
    out = host_gather(pinned(x), jnp.asarray(ids), impl="pallas")
    np.testing.assert_array_equal(np.asarray(out), expect(x, ids))


def test_inside_user_jit_and_int64_ids():
    x = random_blocks((12, 2, 64), jnp.float32)
    src = pinned(x)
    f = jax.jit(lambda s, i: host_gather(s, i, impl="pallas") * 2)
    ids = np.array([11, 3, 3], np.int64)
    np.testing.assert_array_equal(np.asarray(f(src, jnp.asarray(ids))), expect(x, ids) * 2)
    out = host_gather(src, jnp.asarray([1, 2], jnp.uint8), impl="pallas")
    np.testing.assert_array_equal(np.asarray(out), x[[1, 2]])


def test_empty_ids():
    out = host_gather(pinned(np.zeros((4, 8), np.float32)), jnp.zeros((0,), jnp.int32), impl="pallas")
    assert out.shape == (0, 8)


def test_plan_16k_blocks():
    # the sizes the H100 probe times: one or two 8 KiB programs per block
    for shape, itemsize, tiles in [((4096,), 4, 2), ((16, 8, 64), 2, 2), ((64, 128), 2, 2), ((1024,), 4, 1)]:
        p = hg_k.plan_host_gather(shape, itemsize)
        assert p.n_row_tiles * p.n_col_tiles == tiles
        assert p.th * p.tw * itemsize <= hg_k.DEFAULT_TILE_BYTES


@pytest.mark.parametrize(
    "src,ids,kwargs,exc,match",
    [
        (np.zeros((4, 8), np.float32), np.zeros((2,), np.float32), {}, TypeError, "integer"),
        (np.zeros((4, 8), np.float32), np.zeros((2, 1), np.int32), {}, ValueError, "block_ids"),
        (np.zeros((0, 8), np.float32), np.zeros((2,), np.int32), {}, ValueError, "NB >= 1"),
        (np.float32(1), np.zeros((2,), np.int32), {}, ValueError, "rank >= 1"),
        (np.zeros((4, 8), np.float32), np.zeros((2,), np.int32), {"impl": "nope"}, ValueError, "impl must be"),
        (np.zeros((4, 8), np.float32), np.zeros((2,), np.int32), {"tile": 4}, TypeError, "unknown tuning"),
        (np.zeros((4, 8), np.float32), np.zeros((2,), np.int32), {"tile_bytes": 0}, ValueError, "tile_bytes"),
        (np.zeros((4, 8), np.float32), np.zeros((2,), np.int32), {"num_warps": 3}, ValueError, "num_warps"),
        (np.zeros((4, 8), np.complex64), np.zeros((2,), np.int32), {"impl": "pallas"}, ValueError, "cannot run"),
        (np.zeros((2, 1 << 20), np.float32), np.zeros((2,), np.int32), {"impl": "pallas", "tile_bytes": 4}, ValueError, "raise tile_bytes"),
    ],
)
def test_bad_input(src, ids, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        host_gather(jnp.asarray(src), jnp.asarray(ids), **kwargs)


def test_bad_input_not_arrays():
    with pytest.raises(TypeError, match="src must be an array"):
        host_gather([1, 2, 3], jnp.zeros((1,), jnp.int32))


# ---------------------------------------------------------------------------
# lowering for an H100 (no GPU needed): the Triton custom call must consume
# the pinned_host parameter itself (no reshape, copy or transfer before it)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("shape,dtype", [((1024, 4096), jnp.float32), ((512, 16, 8, 64), jnp.bfloat16), ((33, 3, 5), jnp.int8)])
def test_lowers_reading_pinned_host_param_directly(shape, dtype):
    pytest.importorskip("jax._src.lib.triton")
    from jax import export

    dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="cuda")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), (jax.sharding.AxisType.Auto,), abstract_device=dev)
    host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    spec = jax.ShapeDtypeStruct(shape, dtype, sharding=host)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with jax.sharding.use_abstract_mesh(mesh):
            exp = export.export(
                jax.jit(lambda s, i: hg_k.host_gather_pallas(s, i)),
                platforms=["cuda"],
                disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
            )(spec, jax.ShapeDtypeStruct((2048,), jnp.int32))
    txt = exp.mlir_module()
    assert re.search(r'%arg0: tensor<[^>]*> \{mhlo.memory_kind = "pinned_host"', txt)
    call = re.search(r"stablehlo.custom_call @__gpu\$xla.gpu.triton\(([^)]*)\)", txt)
    assert call is not None
    assert "%arg0" in call.group(1).split(", "), f"src reaches the kernel through another op: {call.group(0)[:200]}"
    assert "annotate_device_placement" not in txt
