"""host_gather_into: listed host blocks into slots of device K/V buffers.

Kernel (Pallas interpret mode on CPU) and reference against a NumPy oracle,
with ``src`` committed to ``pinned_host`` memory as in the real use.
"""

from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import host_gather as hg_k
from sparse_jax.ops import transfer
from sparse_jax.ops.transfer import host_gather_into
from tests.test_host_gather import pinned

RNG = np.random.default_rng(11)


def rand(shape, dtype):
    """Fresh nonzero data: a missed copy cannot pass by matching zeros."""
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.integer):
        info = jnp.iinfo(dtype)
        x = RNG.integers(info.min, info.max, size=shape, endpoint=True)
        return np.where(x == 0, 1, x).astype(dtype)
    x = RNG.standard_normal(shape) * 1000
    return np.asarray(np.where(x == 0, 1.0, x), np.float32).astype(dtype)


def oracle(src_k, src_v, dst_k, dst_v, ids, slots, count):
    dk, dv = np.array(dst_k), np.array(dst_v)
    nb, ns = src_k.shape[0], dk.shape[0]
    for i in range(min(int(np.asarray(count).reshape(-1)[0]), len(ids))):
        b, s = np.clip(ids[i], 0, nb - 1), np.clip(slots[i], 0, ns - 1)
        dk[s], dv[s] = src_k[b], src_v[b]
    return dk, dv


def make_case(block_shape, dtype, nb, ns, m, count):
    """Live entries get distinct slots; dead ones (i >= count) name live and
    free slots and wild values alike, so any write by them would show."""
    sk, sv = rand((nb, *block_shape), dtype), rand((nb, *block_shape), dtype)
    dk, dv = rand((ns, *block_shape), dtype), rand((ns, *block_shape), dtype)
    ids = RNG.integers(0, nb, size=m).astype(np.int32)
    slots = np.empty(m, np.int32)
    live = min(count, m)
    assert live <= ns
    slots[:live] = RNG.permutation(ns)[:live]
    slots[live:] = RNG.integers(-3, ns + 3, size=m - live)
    ids[live:] = RNG.integers(-3, nb + 3, size=m - live)
    return sk, sv, dk, dv, ids, slots


def check(out, expected, dtype):
    for o, e in zip(out, expected):
        assert o.dtype == jnp.dtype(dtype) and o.shape == e.shape
        assert o.sharding.memory_kind == "device"
        np.testing.assert_array_equal(np.asarray(o), e)


CASES = [
    # block_shape, dtype, NB, NS, M, count, tuning
    ((16, 64), jnp.bfloat16, 12, 9, 7, 7, {}),  # count == M
    ((16, 64), jnp.bfloat16, 12, 9, 7, 3, {}),  # count < M
    ((5, 24), jnp.float32, 11, 6, 5, 0, {}),  # count == 0: nothing moves
    ((5, 24), jnp.float32, 11, 6, 5, 4, dict(tile_bytes=64)),  # partial row tiles
    ((2, 3, 40), jnp.float16, 7, 5, 3, 2, dict(tile_bytes=32)),  # masked column tiles
    ((3, 7), jnp.int8, 9, 4, 6, 4, dict(tile_bytes=16)),
    ((), jnp.int32, 10, 6, 5, 3, {}),  # scalar blocks
]


@pytest.mark.parametrize("block_shape,dtype,nb,ns,m,count,tuning", CASES)
def test_matches_oracle_pinned_src(block_shape, dtype, nb, ns, m, count, tuning):
    sk, sv, dk, dv, ids, slots = make_case(block_shape, dtype, nb, ns, m, count)
    expected = oracle(sk, sv, dk, dv, ids, slots, count)
    c = jnp.asarray([count], jnp.int32)
    for impl, kw in (("pallas", tuning), ("reference", {})):
        out = host_gather_into(
            pinned(sk), pinned(sv), jnp.asarray(dk), jnp.asarray(dv), jnp.asarray(ids), jnp.asarray(slots), c,
            impl=impl, **kw,
        )
        check(out, expected, dtype)


def test_out_of_range_ids_and_slots_are_clamped():
    sk, sv = rand((6, 5, 24), jnp.float32), rand((6, 5, 24), jnp.float32)
    dk, dv = rand((4, 5, 24), jnp.float32), rand((4, 5, 24), jnp.float32)
    ids = np.array([-3, 6, 100, 2], np.int32)
    slots = np.array([-1, 4, 1, 2], np.int32)  # -> 0, 3, 1, 2
    expected = oracle(sk, sv, dk, dv, ids, slots, [4])
    np.testing.assert_array_equal(expected[0][[0, 3, 1, 2]], sk[[0, 5, 5, 2]])
    for impl in ("pallas", "reference", "auto"):
        out = host_gather_into(pinned(sk), pinned(sv), jnp.asarray(dk), jnp.asarray(dv),
                               jnp.asarray(ids), jnp.asarray(slots), jnp.asarray([4], jnp.int32), impl=impl)
        check(out, expected, jnp.float32)


@pytest.mark.parametrize("count", [np.int32(2), np.array([2], np.int64), 2, 100, -1, 1 << 40, np.array(0, np.uint8)])
def test_count_forms(count):
    # int[1], int[], Python int; above M acts as M, <= 0 copies nothing
    sk, sv, dk, dv, ids, slots = make_case((4, 8), jnp.float32, 8, 6, 3, 3)
    expected = oracle(sk, sv, dk, dv, ids, slots, np.clip(np.asarray(count), 0, None))
    for impl in ("pallas", "reference"):
        c = count if isinstance(count, int) else jnp.asarray(count)
        out = host_gather_into(pinned(sk), pinned(sv), jnp.asarray(dk), jnp.asarray(dv),
                               jnp.asarray(ids), jnp.asarray(slots), c, impl=impl)
        check(out, expected, jnp.float32)


@pytest.mark.parametrize("impl", ["pallas", "reference"])
def test_segment_counts(impl):
    """count int[G]: G equal segments, each with its own live prefix (one per
    block-table row); dead entries name live slots and wild ids, so a write by
    one of them would show."""
    g, seg, ns = 3, 4, 12
    sk, sv = rand((10, 3, 16), jnp.float32), rand((10, 3, 16), jnp.float32)
    dk, dv = rand((ns, 3, 16), jnp.float32), rand((ns, 3, 16), jnp.float32)
    counts = np.array([2, 0, 4], np.int32)
    ids = RNG.integers(-2, 12, size=g * seg).astype(np.int32)
    slots = RNG.permutation(ns).astype(np.int32)  # distinct: any dead write would overwrite a live one's data
    ek, ev = np.array(dk), np.array(dv)
    for i in range(g * seg):
        if i % seg < counts[i // seg]:
            b = np.clip(ids[i], 0, 9)
            ek[slots[i]], ev[slots[i]] = sk[b], sv[b]
    out = host_gather_into(pinned(sk), pinned(sv), jnp.asarray(dk), jnp.asarray(dv), jnp.asarray(ids),
                           jnp.asarray(slots), jnp.asarray(counts), impl=impl)
    check(out, (ek, ev), jnp.float32)


@pytest.mark.parametrize("programs,unroll,tile_bytes,extra_segments",
                         [(1, 1, 64, 0), (3, 2, 64, 0), (5, 3, 1024, 0), (64, 2, 96, 0), (2, 2, 64, 4)])
def test_strided_programs_match_oracle(programs, unroll, tile_bytes, extra_segments):
    """``programs``: a fixed grid over the segments' live entries, ``unroll``
    in flight; per-segment counts (0, partial, full, above the segment),
    wild ids and slots on dead entries; fewer programs than segments, and
    more (several programs per segment)."""
    g, seg = 3 + extra_segments, 5
    ns = g * seg + 1
    sk, sv = rand((10, 3, 20), jnp.float32), rand((10, 3, 20), jnp.float32)
    dk, dv = rand((ns, 3, 20), jnp.float32), rand((ns, 3, 20), jnp.float32)
    counts = np.array([2, 0, 5, 9, 1, 3, 0][:g], np.int32)
    ids = RNG.integers(-2, 12, size=g * seg).astype(np.int32)
    slots = RNG.permutation(ns)[: g * seg].astype(np.int32)
    # dead entries (all of segment 1, entries 2-4 of segment 0) name wild slots or live entries' slots
    slots[[3, 5, 7, 9]] = [slots[0], -40, 99, slots[10]]
    ek, ev = np.array(dk), np.array(dv)
    for i in range(g * seg):
        if i % seg < counts[i // seg]:  # a count above the segment acts as the segment
            b, s = np.clip(ids[i], 0, 9), np.clip(slots[i], 0, ns - 1)
            ek[s], ev[s] = sk[b], sv[b]
    out = host_gather_into(pinned(sk), pinned(sv), jnp.asarray(dk), jnp.asarray(dv), jnp.asarray(ids),
                           jnp.asarray(slots), jnp.asarray(counts), impl="pallas", programs=programs, unroll=unroll,
                           tile_bytes=tile_bytes)
    check(out, (ek, ev), jnp.float32)


@pytest.mark.parametrize("impl,tuning", [("pallas", {}), ("pallas", {"programs": 3}), ("reference", {})])
def test_several_id_axes(impl, tuning):
    """``id_dims=3``: src keeps its (row, head, block) axes, ``[B, Hkv, NB, bs, D]`` (an
    offloaded layer's host tier); a block id is the flat index over them."""
    b, h, nb, bs, d = 2, 3, 5, 4, 8
    sk, sv = rand((b, h, nb, bs, d), jnp.float32), rand((b, h, nb, bs, d), jnp.float32)
    dk, dv = rand((7, bs, d), jnp.float32), rand((7, bs, d), jnp.float32)
    ids = np.array([29, 0, 17, 13, 6, 22], np.int32)  # flat ids over (2, 3, 5)
    slots = np.array([6, 0, 3, 1, 5, 2], np.int32)
    counts = np.array([2, 3], np.int32)  # two segments of 3: entries 0-1 and 3-5 live
    ek, ev = oracle(sk.reshape(-1, bs, d), sv.reshape(-1, bs, d), dk, dv, ids[[0, 1, 3, 4, 5]],
                    slots[[0, 1, 3, 4, 5]], 5)
    out = host_gather_into(pinned(sk), pinned(sv), jnp.asarray(dk), jnp.asarray(dv), jnp.asarray(ids),
                           jnp.asarray(slots), jnp.asarray(counts), impl=impl, id_dims=3, **tuning)
    check(out, (ek, ev), jnp.float32)
    assert np.array_equal(np.asarray(out[0])[6], sk[1, 2, 4])  # id 29 = (1, 2, 4)
    with pytest.raises(ValueError, match="id_dims must be an int"):
        host_gather_into(pinned(sk), pinned(sv), jnp.asarray(dk), jnp.asarray(dv), jnp.asarray(ids),
                         jnp.asarray(slots), 3, impl=impl, id_dims=6)
    with pytest.raises(ValueError, match="dst_k must have shape"):
        host_gather_into(pinned(sk), pinned(sv), jnp.asarray(dk), jnp.asarray(dv), jnp.asarray(ids),
                         jnp.asarray(slots), 3, impl=impl, id_dims=2)


def test_duplicate_slots_get_one_writer():
    sk, sv = rand((5, 2, 16), jnp.float32), rand((5, 2, 16), jnp.float32)
    dk, dv = rand((3, 2, 16), jnp.float32), rand((3, 2, 16), jnp.float32)
    ids, slots = np.array([1, 4, 2], np.int32), np.array([0, 0, 2], np.int32)
    for impl in ("pallas", "reference"):
        ok, ov = host_gather_into(pinned(sk), pinned(sv), jnp.asarray(dk), jnp.asarray(dv),
                                  jnp.asarray(ids), jnp.asarray(slots), 3, impl=impl)
        ok, ov = np.asarray(ok), np.asarray(ov)
        for got, src in ((ok, sk), (ov, sv)):
            assert any(np.array_equal(got[0], src[b]) for b in (1, 4))
            np.testing.assert_array_equal(got[2], src[2])
        np.testing.assert_array_equal(ok[1], dk[1])


def test_empty_m_returns_dst():
    dk, dv = jnp.asarray(rand((3, 8), jnp.float32)), jnp.asarray(rand((3, 8), jnp.float32))
    src = pinned(rand((4, 8), jnp.float32))
    e = jnp.zeros((0,), jnp.int32)
    out = host_gather_into(src, src, dk, dv, e, e, jnp.asarray([0], jnp.int32), impl="pallas")
    np.testing.assert_array_equal(np.asarray(out[0]), np.asarray(dk))
    np.testing.assert_array_equal(np.asarray(out[1]), np.asarray(dv))


@pytest.mark.parametrize("impl", ["pallas", "reference"])
def test_inside_user_jit_with_donated_dst(impl):
    # the offload engine's use: src are pinned_host jit parameters, dst are
    # donated device buffers carried from step to step
    nb, ns, m = 10, 6, 4
    sk, sv = rand((nb, 16, 64), jnp.bfloat16), rand((nb, 16, 64), jnp.bfloat16)
    psk, psv = pinned(sk), pinned(sv)

    def _step(src_k, src_v, dst_k, dst_v, ids, slots, count):
        dst_k, dst_v = host_gather_into(src_k, src_v, dst_k, dst_v, ids, slots, count, impl=impl)
        return dst_k, dst_v, (dst_k.astype(jnp.float32).sum() + dst_v.astype(jnp.float32).sum())

    step = jax.jit(_step, donate_argnums=(2, 3))
    dk, dv = rand((ns, 16, 64), jnp.bfloat16), rand((ns, 16, 64), jnp.bfloat16)
    cur_k, cur_v = jnp.asarray(dk), jnp.asarray(dv)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "Some donated buffers were not usable"
        # jax 0.11 warns at every Triton lowering that the backend is deprecated; not this test's concern
        warnings.filterwarnings("ignore", "The Pallas Triton backend is deprecated", DeprecationWarning)
        for ids, slots, count in (([9, 0, 3, 7], [5, 1, 0, 1], 3), ([2, 2, 8, 1], [1, 3, 0, 4], 4), ([4, 4, 4, 4], [2, 2, 2, 2], 0)):
            ids, slots = np.array(ids, np.int32), np.array(slots, np.int32)
            prev_k, prev_v = cur_k, cur_v
            cur_k, cur_v, total = step(psk, psv, cur_k, cur_v, jnp.asarray(ids), jnp.asarray(slots), jnp.asarray([count], jnp.int32))
            assert prev_k.is_deleted() and prev_v.is_deleted()  # donated: the step reused them
            dk, dv = oracle(sk, sv, dk, dv, ids, slots, count)
            # check copies: np.asarray(cur_k) would leave a cached zero-copy
            # view on cur_k, and the CPU client then silently skips donating it
            check((cur_k.copy(), cur_v.copy()), (dk, dv), jnp.bfloat16)
            np.testing.assert_allclose(float(total), dk.astype(np.float32).sum() + dv.astype(np.float32).sum(), rtol=1e-5)


def test_auto_on_cpu_and_complex_falls_back():
    sk, sv, dk, dv, ids, slots = make_case((4, 6), jnp.complex64, 5, 4, 3, 2)
    args = (pinned(sk), pinned(sv), jnp.asarray(dk), jnp.asarray(dv), jnp.asarray(ids), jnp.asarray(slots), 2)
    check(host_gather_into(*args), oracle(sk, sv, dk, dv, ids, slots, 2), jnp.complex64)
    with pytest.raises(ValueError, match="cannot run"):
        host_gather_into(*args, impl="pallas")


# ---------------------------------------------------------------------------
# argument checks: raised before anything is traced or compiled
# ---------------------------------------------------------------------------

F = np.float32


def _args(**over):
    a = dict(
        src_k=np.ones((6, 4, 8), F), src_v=np.ones((6, 4, 8), F),
        dst_k=np.ones((3, 4, 8), F), dst_v=np.ones((3, 4, 8), F),
        block_ids=np.zeros((2,), np.int32), slots=np.zeros((2,), np.int32), count=np.array([2], np.int32),
    )
    a.update(over)
    return a


@pytest.mark.parametrize(
    "over,kwargs,exc,match",
    [
        (dict(src_k=np.float32(1)), {}, ValueError, r"src_k must have shape \[NB, \*block_shape\] \(rank >= 1\)"),
        (dict(src_k=np.ones((0, 4, 8), F), src_v=np.ones((0, 4, 8), F)), {}, ValueError, r"NB >= 1"),
        (dict(src_v=np.ones((6, 4, 9), F)), {}, ValueError, r"src_v must match src_k .*\(6, 4, 8\) float32.*got \(6, 4, 9\)"),
        (dict(src_v=np.ones((6, 4, 8), np.float16)), {}, ValueError, r"src_v must match src_k .*got \(6, 4, 8\) float16"),
        (dict(dst_k=np.ones((3, 8, 4), F)), {}, ValueError, r"dst_k must have shape \[NS, \*block_shape\] with src's block_shape \(4, 8\)"),
        (dict(dst_k=np.ones((3, 32), F)), {}, ValueError, r"block_shape \(4, 8\), got shape \(3, 32\)"),
        (dict(dst_k=np.ones((0, 4, 8), F), dst_v=np.ones((0, 4, 8), F)), {}, ValueError, r"NS >= 1"),
        (dict(dst_k=np.ones((3, 4, 8), np.float16), dst_v=np.ones((3, 4, 8), np.float16)), {}, TypeError, r"dst_k must have src's dtype float32"),
        (dict(dst_v=np.ones((4, 4, 8), F)), {}, ValueError, r"dst_v must match dst_k .*\(3, 4, 8\).*got \(4, 4, 8\)"),
        (dict(block_ids=np.zeros((2, 1), np.int32)), {}, ValueError, r"block_ids must have shape \[M\] \(rank 1\)"),
        (dict(block_ids=np.zeros((2,), F)), {}, TypeError, r"block_ids must be an integer array"),
        (dict(slots=np.zeros((3,), np.int32)), {}, ValueError, r"slots must have shape \[M\].* = \(2,\), got \(3,\)"),
        (dict(slots=np.zeros((2,), F)), {}, TypeError, r"slots must be an integer array"),
        (dict(count=np.array([2.0], F)), {}, TypeError, r"count must be an integer array"),
        (dict(count=np.array([2, 2, 2], np.int32)), {}, ValueError,
         r"count must have shape \[\] or \[G\] with G dividing the 2 listed blocks .*got shape \(3,\)"),
        (dict(count=np.array([[2]], np.int32)), {}, ValueError, r"count must have shape \[\] or \[G\].*got shape \(1, 1\)"),
        (dict(count=2.0), {}, TypeError, r"count must be an int or an integer array of shape \[\] or \[G\], got float"),
        (dict(count=True), {}, TypeError, r"count must be an int or an integer array"),
        (dict(dst_v=[1, 2]), {}, TypeError, r"dst_v must be an array, got list"),
        ({}, {"impl": "triton"}, ValueError, r"impl must be one of \('auto', 'pallas', 'reference'\)"),
        ({}, {"tile": 4}, TypeError, r"unknown tuning keyword\(s\) \['tile'\]; allowed"),
        ({}, {"tile_bytes": 0}, ValueError, r"tile_bytes must be a positive int"),
        ({}, {"num_warps": 3}, ValueError, r"num_warps must be a power of two in \[1, 32\]"),
        ({}, {"programs": 0}, ValueError, r"programs must be a positive int or None, got 0"),
        ({}, {"programs": 2.0}, ValueError, r"programs must be a positive int or None"),
        ({}, {"unroll": 0}, ValueError, r"unroll must be a positive int, got 0"),
        (dict(src_k=np.ones((2, 1 << 20), F), src_v=np.ones((2, 1 << 20), F), dst_k=np.ones((1, 1 << 20), F),
              dst_v=np.ones((1, 1 << 20), F)), {"impl": "pallas", "tile_bytes": 4}, ValueError, r"raise tile_bytes"),
    ],
)
def test_bad_input(monkeypatch, over, kwargs, exc, match):
    def _no_compile(*a, **k):
        raise AssertionError("argument error must be raised before _run_into")

    monkeypatch.setattr(transfer, "_run_into", _no_compile)
    a = _args(**over)
    a = {k: (jnp.asarray(v) if isinstance(v, np.ndarray | np.generic) else v) for k, v in a.items()}
    with pytest.raises(exc, match=match):
        host_gather_into(**a, **kwargs)


# ---------------------------------------------------------------------------
# lowering for an H100 (no GPU needed): inside a user jit with donated dst,
# the Triton custom call takes the pinned_host parameters as they are and
# writes dst through output/operand aliases
# ---------------------------------------------------------------------------


def test_lowers_in_place_reading_pinned_host_params():
    pytest.importorskip("jax._src.lib.triton")
    from jax import export

    dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="cuda")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), (jax.sharding.AxisType.Auto,), abstract_device=dev)
    host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    src = jax.ShapeDtypeStruct((512, 16, 8, 64), jnp.bfloat16, sharding=host)
    dst = jax.ShapeDtypeStruct((64, 16, 8, 64), jnp.bfloat16)
    i32 = jax.ShapeDtypeStruct((64,), jnp.int32)

    def step(sk, sv, dk, dv, ids, slots, count):
        # what host_gather_into runs on a GPU (choice/interpret fixed: no GPU here)
        return transfer._run_into(sk, sv, dk, dv, ids, slots, count, choice="pallas", interpret=False, tuning=())

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with jax.sharding.use_abstract_mesh(mesh):
            exp = export.export(
                jax.jit(step, donate_argnums=(2, 3)),
                platforms=["cuda"],
                disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
            )(src, src, dst, dst, i32, i32, jax.ShapeDtypeStruct((1,), jnp.int32))
    txt = exp.mlir_module()
    assert re.search(r'%arg0: tensor<[^>]*> \{mhlo.memory_kind = "pinned_host"', txt)
    assert re.search(r"%arg2: tensor<[^>]*> \{tf.aliasing_output = 0", txt)
    assert re.search(r"%arg3: tensor<[^>]*> \{tf.aliasing_output = 1", txt)
    # the user jit hands its parameters to the op's jit unchanged ...
    call = re.search(r"call @_run_into\(([^)]*)\)", txt)
    assert call and call.group(1).split(", ") == [f"%arg{j}" for j in range(7)]
    # ... and that jit hands them to the kernel unchanged
    kern = re.search(r"stablehlo.custom_call @__gpu\$xla.gpu.triton\(([^)]*)\)", txt)
    assert kern and kern.group(1).split(", ") == ["%arg4", "%arg5", "%arg6", "%arg0", "%arg1", "%arg2", "%arg3"]
    tail = txt[kern.end():].split("\n", 1)[0]
    assert 'name = "host_gather_into"' in tail
    for out, operand in ((0, 5), (1, 6)):
        assert f"output_tuple_indices = [{out}], operand_index = {operand}," in tail
    assert "annotate_device_placement" not in txt


def test_reference_is_exported():
    assert "host_gather_into" in transfer.__all__
    assert {"host_gather_into_reference", "host_gather_into_pallas"} <= set(hg_k.__all__)
