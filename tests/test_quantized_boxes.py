"""8-bit Quest block boxes (``pallas_kernels.quantized_boxes`` through ``sparse_jax.ops.scoring``).

What must hold, checked against float64 NumPy on awkward sizes (NB not a multiple of the
kernel's tile, ragged rows with an empty one, G = 1 / 3 / 4 / 8, D = 64 / 128 / 256):

* the dequantized boxes contain the exact ones, within one code step (plus the slack);
* the kernel (interpret mode) and the reference equal the float64 bound on the codes;
* that bound is at least ``q . k_j`` for every valid token of the block, also after appends
  that leave the range fixed at the prompt (the slack takes the excess);
* appends in range give exactly the codes of the rebuilt exact boxes over the same range.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import quantized_boxes as qbx
from sparse_jax.ops import scoring

IMPLS = ["reference", "pallas"]


def _randn(seed, shape, dtype, scale=1.0, shift=0.0):
    x = np.random.default_rng(seed).standard_normal(shape) * scale + shift
    return jnp.asarray(x.astype(np.float32), dtype=dtype)


def _boxes(seed, b, hkv, s, d, bs, lengths, dtype=jnp.bfloat16):
    k = _randn(seed, (b, hkv, s, d), dtype, 2.0, 0.3)
    lengths = jnp.asarray(lengths, jnp.int32)
    kmax, kmin = scoring.block_minmax(k, lengths, block_size=bs, impl="reference")
    return k, lengths, kmax, kmin, scoring.quantize_block_boxes(kmax, kmin, lengths, block_size=bs)


def _dequantized64(boxes):
    """float64 ``(upper, lower)`` the codes stand for, slack included."""
    base = np.asarray(boxes.base, np.float64)[:, :, None]
    step = np.asarray(boxes.step, np.float64)[:, :, None]
    up = base + (np.asarray(boxes.upper, np.float64) + 128) * step + np.asarray(boxes.upper_slack, np.float64)[..., None]
    lo = base + (np.asarray(boxes.lower, np.float64) + 128) * step - np.asarray(boxes.lower_slack, np.float64)[..., None]
    return up, lo


def _oracle(q, up, lo, reduce):
    """float64 Quest bound of each query head on boxes ``up, lo``, summed or maxed over the group."""
    q = np.asarray(q.astype(jnp.float32), np.float64)
    b, hq, d = q.shape
    hkv = up.shape[1]
    g = hq // hkv
    qg = q.reshape(b, hkv, g, d)
    s = np.einsum("bhgd,bhnd->bhgn", np.maximum(qg, 0), up) + np.einsum("bhgd,bhnd->bhgn", np.minimum(qg, 0), lo)
    return s.max(2) if reduce == "max" else s.sum(2)


# (Hq, Hkv, D, cache dtype)
CASES = [
    (4, 4, 64, jnp.float32),  # G = 1
    (9, 3, 64, jnp.bfloat16),  # G = 3 (SmolLM2): the kernel pads the group
    (16, 2, 128, jnp.bfloat16),  # G = 8
    (4, 1, 256, jnp.bfloat16),  # Gemma 3 270M: one KV head, D = 256
]


def test_codes_contain_the_exact_boxes_within_a_step():
    _, lengths, kmax, kmin, boxes = _boxes(1, 3, 2, 150, 64, 16, [150, 70, 0])
    assert boxes.upper.dtype == jnp.int8 and boxes.base.dtype == jnp.float32
    up, lo = _dequantized64(boxes)
    step = np.asarray(boxes.step, np.float64)[:, :, None]
    ex_up, ex_lo = (np.asarray(x.astype(jnp.float32), np.float64) for x in (kmax, kmin))
    for b, n in enumerate(np.asarray(lengths)):
        nb = -(-int(n) // 16)
        ulp = 2e-7 * np.abs(ex_up[b]).max()  # the codes' edges are f32 sums: contained up to their rounding
        assert (up[b, :, :nb] >= ex_up[b, :, :nb] - ulp).all() and (lo[b, :, :nb] <= ex_lo[b, :, :nb] + ulp).all()
        assert (up[b, :, :nb] - ex_up[b, :, :nb] <= step[b] * (1 + 1e-5)).all()  # no looser than a code
        assert (ex_lo[b, :, :nb] - lo[b, :, :nb] <= step[b] * (1 + 1e-5)).all()
        if nb:  # the range is the row's: its end codes are used, and nothing slips past them
            assert int(np.asarray(boxes.upper[b, :, :nb]).max()) == 127 and int(np.asarray(boxes.lower[b, :, :nb]).min()) == -128
            assert float(np.asarray(boxes.upper_slack[b, :, :nb]).max()) < 1e-4 * float(step[b].max())
    # the empty row: no range to take, a neutral one
    np.testing.assert_array_equal(np.asarray(boxes.base[2]), 0.0)
    np.testing.assert_array_equal(np.asarray(boxes.step[2]), 1.0)


# (impl, kernel mode, block_n, prep): the reference; the FMA kernel on a tile that leaves NB = 10
# ragged; the tensor-core kernels at their smallest tile (16: one partial tile), their query side
# made in each program and made by XLA before the kernel
VARIANTS = [("reference", None, None, None), ("pallas", "fma", 4, None), ("pallas", "dot", 16, "program"),
            ("pallas", "imma", 16, "program"), ("pallas", "dot", 16, "kernel"), ("pallas", "imma", 16, "kernel")]


@pytest.mark.parametrize("impl,mode,block_n,prep", VARIANTS)
@pytest.mark.parametrize("reduce", ["sum", "max"])
@pytest.mark.parametrize("hq,hkv,d,dtype", CASES)
def test_scores_match_the_float64_bound_on_the_codes(impl, mode, block_n, prep, reduce, hq, hkv, d, dtype):
    b, s, bs = 2, 150, 16  # NB = 10
    _, _, _, _, boxes = _boxes(hq * d, b, hkv, s, d, bs, [150, 61], dtype)
    q = _randn(hq + d, (b, hq, d), dtype)
    got = scoring.quest_block_scores_quantized(q, boxes, group_reduce=reduce, impl=impl, block_n=block_n, mode=mode,
                                               prep=prep)
    assert got.shape == (b, hkv, -(-s // bs)) and got.dtype == jnp.float32
    want = _oracle(q, *_dequantized64(boxes), reduce if hq > hkv else "sum")
    scale = np.abs(want).max()
    # imma's weights are 127ths of the row's largest (the others' within 2^-16 of each weight)
    rtol = 5e-4 if mode == "imma" else 1e-5
    np.testing.assert_allclose(np.asarray(got), want, rtol=rtol, atol=2 * rtol * scale)
    if mode in ("dot", "imma"):  # their weights are rounded up: never below the bound (but f32 rounding)
        assert (np.asarray(got, np.float64) >= want - 1e-6 * scale).all()


@pytest.mark.parametrize("impl,mode,prep", [("reference", None, None), ("pallas", "fma", None), ("pallas", "dot", None),
                                            ("pallas", "imma", None), ("pallas", "imma", "kernel")])
def test_the_bound_holds_for_every_token_after_appends_past_the_range(impl, mode, prep):
    """The range is the prompt's; keys appended three times larger clip to the end codes and
    their excess goes to the slack: every block's score still bounds q_g . k_j (each head's,
    for the max; their sum, for the sum) for each valid token."""
    rng = np.random.default_rng(0)
    b, hq, hkv, s, d, bs = 2, 8, 2, 96, 64, 16
    k = rng.standard_normal((b, hkv, s, d)).astype(np.float32)
    start = np.array([50, 33])
    for bi, n in enumerate(start):
        k[bi, :, n:] *= 3.0  # everything after the prompt leaves its range
    k = jnp.asarray(k).astype(jnp.bfloat16)
    lengths = jnp.asarray(start, jnp.int32)
    kmax, kmin = scoring.block_minmax(k, lengths, block_size=bs, impl="reference")
    boxes = scoring.quantize_block_boxes(kmax, kmin, lengths, block_size=bs)
    for step in range(30):
        pos = lengths + step
        boxes = scoring.update_quantized_block_boxes(boxes, k[jnp.arange(b), :, pos], pos, block_size=bs)
    final = np.asarray(lengths) + 30
    assert float(np.asarray(boxes.upper_slack).max()) > 0 and float(np.asarray(boxes.lower_slack).max()) > 0
    q = jnp.asarray(rng.standard_normal((b, hq, d)) * 2, jnp.bfloat16)
    kf = np.asarray(k.astype(jnp.float32), np.float64)
    qf = np.asarray(q.astype(jnp.float32), np.float64).reshape(b, hkv, hq // hkv, d)
    for reduce in ("sum", "max"):
        score = np.asarray(scoring.quest_block_scores_quantized(q, boxes, group_reduce=reduce, impl=impl, mode=mode,
                                                                prep=prep), np.float64)
        per_head = np.einsum("bhgd,bhsd->bhgs", qf, kf)
        true = per_head.max(2) if reduce == "max" else per_head.sum(2)
        for bi in range(b):
            n = int(final[bi])
            blk = np.arange(n) // bs
            tol = 1e-5 * np.abs(score[bi]).max()
            assert np.all(score[bi][:, blk] >= true[bi, :, :n] - tol), (reduce, bi)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_appends_in_range_equal_quantizing_the_rebuilt_boxes(dtype):
    """Tokens appended one by one across block boundaries (inside the prompt's range) give the
    codes that quantizing the longer cache's exact boxes over the same base and step gives."""
    b, hkv, s, d, bs = 2, 2, 100, 64, 16
    k = _randn(7, (b, hkv, s, d), dtype)
    start = jnp.asarray([40, 63], jnp.int32)
    kmax, kmin = scoring.block_minmax(k * 2.0, jnp.asarray([s, s], jnp.int32), block_size=bs, impl="reference")
    # a range wide enough for every later key: built from twice the keys, then refilled
    wide = scoring.quantize_block_boxes(kmax, kmin, jnp.asarray([s, s], jnp.int32), block_size=bs)
    e_max, e_min = scoring.block_minmax(k, start, block_size=bs, impl="reference")
    cu, su = qbx._codes_up(e_max.astype(jnp.float32), wide.base[:, :, None], wide.step[:, :, None])
    cl, sl = qbx._codes_lo(e_min.astype(jnp.float32), wide.base[:, :, None], wide.step[:, :, None])
    boxes = qbx.QuantizedBoxes(cu, cl, wide.base, wide.step, su, sl)
    for step in range(30):
        pos = start + step
        boxes = scoring.update_quantized_block_boxes(boxes, k[jnp.arange(b), :, pos], pos, block_size=bs)
    r_max, r_min = scoring.block_minmax(k, start + 30, block_size=bs, impl="reference")
    ru, rsu = qbx._codes_up(r_max.astype(jnp.float32), wide.base[:, :, None], wide.step[:, :, None])
    rl, rsl = qbx._codes_lo(r_min.astype(jnp.float32), wide.base[:, :, None], wide.step[:, :, None])
    for bi, n in enumerate([70, 93]):
        nb = -(-n // bs)
        np.testing.assert_array_equal(np.asarray(boxes.upper[bi, :, :nb]), np.asarray(ru[bi, :, :nb]))
        np.testing.assert_array_equal(np.asarray(boxes.lower[bi, :, :nb]), np.asarray(rl[bi, :, :nb]))
        # slack: rounding-sized, an append's no smaller than the rebuild's
        step = float(np.asarray(wide.step).max())
        assert float(np.asarray(boxes.upper_slack[bi, :, :nb]).max()) < 1e-4 * step
        assert (np.asarray(boxes.upper_slack[bi, :, :nb]) >= np.asarray(rsu[bi, :, :nb])).all()
    # a position past the capacity changes nothing
    same = scoring.update_quantized_block_boxes(boxes, k[:, :, 0], jnp.asarray([s + 12, -1], jnp.int32), block_size=bs)
    for a, r in zip(jax.tree.leaves(same), jax.tree.leaves(boxes)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(r))


def test_bad_inputs_fail_before_compilation():
    _, lengths, kmax, kmin, boxes = _boxes(2, 2, 2, 64, 64, 16, [64, 7])
    q = jnp.ones((2, 4, 64), jnp.float32)
    import dataclasses

    bad = [
        (TypeError, lambda: scoring.quest_block_scores_quantized(q, (kmax, kmin))),  # exact boxes
        (TypeError, lambda: scoring.quest_block_scores_quantized(
            q, dataclasses.replace(boxes, upper=boxes.upper.astype(jnp.uint8)))),
        (ValueError, lambda: scoring.quest_block_scores_quantized(q, dataclasses.replace(boxes, step=boxes.step[:, :1]))),
        (ValueError, lambda: scoring.quest_block_scores_quantized(
            q, dataclasses.replace(boxes, lower_slack=boxes.lower_slack[..., :2]))),
        (ValueError, lambda: scoring.quest_block_scores_quantized(jnp.ones((2, 3, 64)), boxes)),  # GQA
        (ValueError, lambda: scoring.quest_block_scores_quantized(jnp.ones((2, 4, 32)), boxes)),  # D
        (ValueError, lambda: scoring.quest_block_scores_quantized(q, boxes, group_reduce="mean")),
        (ValueError, lambda: scoring.quest_block_scores_quantized(q, boxes, block_n=0)),
        (ValueError, lambda: scoring.quest_block_scores_quantized(q, boxes, mode="wgmma")),
        (ValueError, lambda: scoring.quest_block_scores_quantized(q, boxes, prep="host")),
        (ValueError, lambda: scoring.quest_block_scores_quantized(q, boxes, tiles=0)),
        (ValueError, lambda: scoring.quest_block_scores_quantized(q, boxes, tiles=True)),
        (ValueError, lambda: qbx.quest_block_scores_quantized_kernel(q, boxes, tiles=1.5)),
        (ValueError, lambda: scoring.quantize_block_boxes(kmax, kmin[:, :1], lengths, block_size=16)),
        (ValueError, lambda: scoring.quantize_block_boxes(kmax, kmin, lengths[:1], block_size=16)),
        (ValueError, lambda: scoring.quantize_block_boxes(kmax, kmin, lengths, block_size=0)),
        (ValueError, lambda: scoring.update_quantized_block_boxes(boxes, q[:, :2, :32], lengths, block_size=16)),
        (TypeError, lambda: scoring.update_quantized_block_boxes(boxes, q[:, :2], lengths * 1.0, block_size=16)),
    ]
    for err, fn in bad:
        with pytest.raises(err):
            fn()


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
def test_kernel_lowers_to_triton(abstract_h100):
    sd = jax.ShapeDtypeStruct

    def boxes(hkv, nb, d):
        codes, row, blk = sd((2, hkv, nb, d), jnp.int8), sd((2, hkv, d), jnp.float32), sd((2, hkv, nb), jnp.float32)
        return qbx.QuantizedBoxes(codes, codes, row, row, blk, blk)

    for mode, prep in (("fma", "program"), ("dot", "program"), ("imma", "program"), ("dot", "kernel"), ("imma", "kernel")):
        for q, bx, reduce in ((sd((2, 9, 128), jnp.bfloat16), boxes(3, 5, 128), "sum"),  # G = 3
                              (sd((2, 9, 128), jnp.bfloat16), boxes(3, 5, 128), "max"),
                              (sd((2, 4, 256), jnp.bfloat16), boxes(1, 2048, 256), "max")):
            fn = jax.jit(lambda q, b, r=reduce, m=mode, p=prep: qbx.quest_block_scores_quantized_kernel(
                q, b, reduce=r, mode=m, prep=p))
            assert "__gpu$xla.gpu.triton" in fn.trace(q, bx).lower(lowering_platforms=("cuda",)).as_text()


def test_the_gpu_path_reads_its_tuned_table_class():
    """On the GPU the op looks its knobs up under ``quest_block_scores_q8`` (a class the
    table knows), the caller's knobs first."""
    q = jnp.ones((8, 32, 128), jnp.bfloat16)
    def tuning(block_n=None, mode=None, prep=None):
        return scoring._quest_tuning("quest_block_scores_q8", q, (8, 8, 2048, 128), False, block_n, None, None,
                                     mode=mode, default_mode="dot", prep=prep, default_prep="program")

    from pallas_kernels.tuning import set_device_kind, tuned

    set_device_kind("NVIDIA H200")  # the class was measured there (the CPU reads no entries)
    try:
        entry = tuned("quest_block_scores_q8", rows=64, nb=2048, d=128, g=4)  # the table's B=8, 128K class
        assert entry and tuning() == entry  # every knob the table names, nothing else
        assert {"block_n", "num_warps", "num_stages", "mode", "prep"} <= set(tuning())
        assert tuning(block_n=32)["block_n"] == 32 and tuning(mode="fma")["mode"] == "fma"
        assert tuning(prep="kernel")["prep"] == "kernel"
    finally:
        set_device_kind(None)


@pytest.mark.parametrize("mode", ["dot", "imma"])
@pytest.mark.parametrize("reduce", ["sum", "max"])
def test_the_query_side_made_by_kernel_matches_the_one_made_per_program(mode, reduce):
    """prep="kernel" makes :func:`mma_operands` once per (batch, KV head) in its own kernel: the
    same operations as each program's, so the scores agree to float rounding (the sums over D
    may add in another order), G = 3 padded to 16 columns, slacks nonzero."""
    import dataclasses

    b, hq, hkv, s, d, bs = 2, 9, 3, 150, 64, 16
    _, _, _, _, boxes = _boxes(7, b, hkv, s, d, bs, [150, 61], jnp.float32)
    boxes = dataclasses.replace(boxes, upper_slack=jnp.abs(_randn(9, boxes.upper_slack.shape, jnp.float32)),
                                lower_slack=2 * jnp.abs(_randn(10, boxes.lower_slack.shape, jnp.float32)))
    q = _randn(8, (b, hq, d), jnp.bfloat16)
    run = functools.partial(qbx.quest_block_scores_quantized_kernel, q, boxes, block_n=16, reduce=reduce, mode=mode,
                            interpret=True)
    per_program, by_kernel = np.asarray(run(prep="program")), np.asarray(run(prep="kernel"))
    np.testing.assert_allclose(by_kernel, per_program, rtol=1e-6, atol=1e-6 * np.abs(per_program).max())


@pytest.mark.parametrize("mode,prep", [("fma", "program"), ("dot", "program"), ("imma", "program"), ("imma", "kernel")])
@pytest.mark.parametrize("tiles", [2, 4])
def test_programs_looping_over_tiles_give_the_one_tile_scores(mode, prep, tiles):
    """``tiles``: each program loops over that many tiles (the query side made or loaded once);
    NB = 149 in tiles of 16 leaves a partial tenth tile, and a program whose last tiles lie past
    NB: the same scores as one tile a program, to the bit (the same operations on each tile)."""
    import dataclasses

    b, hq, hkv, s, d, bs = 2, 8, 2, 16 * 149, 64, 16
    _, _, _, _, boxes = _boxes(11, b, hkv, s, d, bs, [s, 300], jnp.float32)
    boxes = dataclasses.replace(boxes, upper_slack=jnp.abs(_randn(12, boxes.upper_slack.shape, jnp.float32)))
    q = _randn(13, (b, hq, d), jnp.bfloat16)
    run = functools.partial(qbx.quest_block_scores_quantized_kernel, q, boxes, block_n=16, reduce="max", mode=mode,
                            prep=prep, interpret=True)
    one = np.asarray(run())
    assert one.shape == (b, hkv, 149)
    np.testing.assert_array_equal(np.asarray(run(tiles=tiles)), one)
    # through the op, as the tuned table would pass it: to the bit against the op's one-tile
    # programs (on a GPU the op compiles, and compiled sums round unlike interpret mode's)
    op = functools.partial(scoring.quest_block_scores_quantized, q, boxes, group_reduce="max", impl="pallas",
                           block_n=16, mode=mode, prep=prep)
    got, one_op = np.asarray(op(tiles=tiles)), np.asarray(op(tiles=1))
    np.testing.assert_array_equal(got, one_op)
    np.testing.assert_allclose(one_op, one, rtol=1e-5, atol=1e-5 * np.abs(one).max())


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
def test_looping_programs_lower_to_triton(abstract_h100):
    """The B=8, 128K class's tensor-core form with 4 tiles a program (the tune's candidates)."""
    sd = jax.ShapeDtypeStruct
    codes, row, blk = sd((8, 8, 2048, 128), jnp.int8), sd((8, 8, 128), jnp.float32), sd((8, 8, 2048), jnp.float32)
    bx = qbx.QuantizedBoxes(codes, codes, row, row, blk, blk)
    for prep in ("program", "kernel"):
        fn = jax.jit(lambda q, b, p=prep: qbx.quest_block_scores_quantized_kernel(
            q, b, block_n=128, num_warps=8, num_stages=3, reduce="max", mode="imma", prep=p, tiles=4))
        assert "__gpu$xla.gpu.triton" in fn.trace(sd((8, 32, 128), jnp.bfloat16), bx).lower(
            lowering_platforms=("cuda",)).as_text()
