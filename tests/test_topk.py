"""topk_indices: Pallas radix select (interpret mode on CPU) vs. a sort oracle.

Distinct random values make the selected *set* unique, so it is compared
exactly; tie tests compare the multiset of selected values instead. Sizes stay
small: every distinct (shape, k, tuning) is one interpret-mode compile.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import topk as topk_k
from sparse_jax.ops.selection import TOPK_AUTO_TABLE, topk_auto_choice, topk_indices

RNG = np.random.default_rng(1234)


def distinct_scores(shape):
    """Distinct float32 values (a shuffled grid, both signs), one row per leading index."""
    n = shape[-1]
    rows = int(np.prod(shape[:-1], dtype=np.int64))
    base = (np.arange(n, dtype=np.float32) - n / 3) * np.float32(0.37)
    x = np.stack([RNG.permutation(base) for _ in range(rows)]) if rows else np.zeros((0, n), np.float32)
    return x.reshape(shape).astype(np.float32)


def oracle_sets(x, k, counts=None):
    """Per row: the set of positions of the k largest valid entries (numpy sort)."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    c2 = np.full(x2.shape[0], n) if counts is None else np.clip(np.asarray(counts).reshape(-1), 0, n)
    out = []
    for row, cnt in zip(x2, c2):
        order = np.argsort(-row[:cnt], kind="stable")
        out.append(set(order[: min(k, cnt)].tolist()))
    return out, c2


def check_contract(idx, x, k, counts=None, exact=True):
    """The documented contract; exact=True also demands the oracle's set."""
    idx = np.asarray(idx)
    n = x.shape[-1]
    assert idx.shape == x.shape[:-1] + (k,)
    assert idx.dtype == np.int32
    sets, c2 = oracle_sets(x, k, counts)
    for r, (row, cnt) in enumerate(zip(idx.reshape(-1, k), c2)):
        assert len(set(row.tolist())) == k, f"row {r}: repeated index {row}"
        assert row.min() >= 0 and row.max() < n, f"row {r}: index out of [0, N): {row}"
        if cnt >= k:
            assert (row < cnt).all(), f"row {r}: invalid position selected"
            if exact:
                assert set(row.tolist()) == sets[r], f"row {r}: wrong set"
        else:
            got = set(row.tolist())
            assert set(range(cnt)) <= got, f"row {r}: a valid position is missing"
            assert all(cnt <= v < n for v in got - set(range(cnt)))


def run(x, k, counts=None, impl="pallas", **tuning):
    c = None if counts is None else jnp.asarray(counts, jnp.int32)
    return topk_indices(jnp.asarray(x), k, c, impl=impl, **tuning)


# ---------------------------------------------------------------------------
# exact sets, distinct values
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape,k",
    [
        ((3, 100), 7),  # N not a power of two
        ((2, 1), 1),  # N = k = 1
        ((2, 64), 64),  # k = N
        ((2, 3, 50), 1),  # k = 1, two leading dims
        ((5, 300), 37),
        ((2, 2048), 128),  # shape (a), two rows
    ],
)
def test_pallas_matches_sort(shape, k):
    x = distinct_scores(shape)
    out = run(x, k)
    check_contract(out, x, k)
    # the kernel returns ascending positions
    o = np.asarray(out).reshape(-1, k)
    assert (np.diff(o, axis=1) > 0).all()


@pytest.mark.parametrize("shape,k", [((3, 100), 7), ((2, 64), 64), ((2, 3, 50), 1)])
def test_reference_matches_sort(shape, k):
    x = distinct_scores(shape)
    check_contract(run(x, k, impl="reference"), x, k)


@pytest.mark.parametrize("search", topk_k.SEARCHES)
def test_counts_below_k_zero_and_beyond(search):
    n, k = 100, 10
    counts = np.array([0, 1, 5, 9, 10, 11, 57, 100, 150, -3], np.int32)
    x = distinct_scores((len(counts), n))
    for impl in ("pallas", "reference"):
        check_contract(run(x, k, counts, impl=impl, **({"search": search} if impl == "pallas" else {})),
                       x, k, counts)
    # the kernel fills short rows with exactly arange(k)
    out = np.asarray(run(x, k, counts, search=search))
    for r, c in enumerate(counts):
        if c < k:
            np.testing.assert_array_equal(out[r], np.arange(k))


def test_neg_inf_valid_beats_invalid():
    # 3 finite values, 7 valid -inf, then invalid positions holding large values
    n, k, cnt = 20, 8, 10
    row = np.full(n, 1e30, np.float32)
    row[:cnt] = -np.inf
    row[[1, 4, 7]] = [3.0, -2.0, 5.0]
    x = np.stack([row, np.roll(row, 0)])
    counts = np.array([cnt, cnt], np.int32)
    for impl in ("pallas", "reference"):
        out = np.asarray(run(x, k, counts, impl=impl))
        for r in range(2):
            got = set(out[r].tolist())
            assert {1, 4, 7} <= got and len(got) == k
            assert all(v < cnt for v in got), f"{impl}: picked an invalid position over a valid -inf"


@pytest.mark.parametrize("search", topk_k.SEARCHES)
def test_all_neg_inf_row_and_nan_as_neg_inf(search):
    n, k = 40, 6
    x = distinct_scores((3, n))
    x[0] = -np.inf  # every entry -inf: any k distinct valid positions
    x[1, ::2] = np.nan  # NaN ranks with -inf: below every finite value
    x[2, :] = np.nan
    x[2, [3, 9]] = [-1e30, 0.0]
    for impl in ("pallas", "reference"):
        out = np.asarray(run(x, k, impl=impl, **({"search": search} if impl == "pallas" else {})))
        assert len(set(out[0].tolist())) == k
        finite1 = np.where(~np.isnan(x[1]))[0]
        best1 = set(finite1[np.argsort(-x[1, finite1])][:k].tolist())
        assert set(out[1].tolist()) == best1
        assert {3, 9} <= set(out[2].tolist()) and len(set(out[2].tolist())) == k


@pytest.mark.parametrize("search", topk_k.SEARCHES)
def test_ties_value_multiset(search):
    # values from a 4-element set: many ties at the threshold
    n, k = 200, 50
    x = RNG.integers(0, 4, size=(4, n)).astype(np.float32)
    x[3] = 1.0  # a row that is one big tie
    for impl in ("pallas", "reference"):
        out = np.asarray(run(x, k, impl=impl, **({"search": search} if impl == "pallas" else {})))
        for r in range(4):
            assert len(set(out[r].tolist())) == k
            want = np.sort(x[r])[::-1][:k]
            np.testing.assert_array_equal(np.sort(x[r, out[r]])[::-1], want)


@pytest.mark.parametrize("search", topk_k.SEARCHES)
def test_signed_zero_and_extremes(search):
    fmax = np.finfo(np.float32).max
    tiny = np.finfo(np.float32).tiny
    row = np.array([0.0, -0.0, fmax, -fmax, np.inf, -np.inf, tiny, -tiny, 1.0, -1.0], np.float32)
    x = row[None]
    for k in (1, 6, 9):
        out = np.asarray(run(x, k, search=search))[0]
        want = np.sort(row)[::-1][:k]
        np.testing.assert_array_equal(np.sort(row[out])[::-1], want)


def _softmax_sums(rng, rows, n, sigma, heads=4):
    """Label-like scores: each row the sum over ``heads`` of a softmax of normal logits."""
    lg = rng.normal(0, sigma, (rows, heads, n))
    e = np.exp(lg - lg.max(-1, keepdims=True))
    return (e / e.sum(-1, keepdims=True)).sum(1).astype(np.float32)


@pytest.mark.parametrize("early_exit", [True, False])
def test_bracket_search_threshold_contract(early_exit):
    """The bracketing search's threshold, run as plain jnp (it is the kernel's code) on rows
    whose keys span the whole int32 range (the wrap-around arithmetic), heavy ties, and rows
    with fewer than, exactly and more than k valid keys."""
    rng = np.random.default_rng(7)
    n, k = 512, 100
    fmax = np.finfo(np.float32).max
    x = np.concatenate([
        rng.normal(0, 1, (2, n)),
        np.exp(np.clip(rng.normal(0, 30, (2, n)), -85, 85)) * rng.choice([-1, 1], (2, n)),  # most of the exponent range
        rng.integers(0, 4, (2, n)).astype(float),  # ties at the threshold
        rng.choice([fmax, -fmax, np.inf, -np.inf, 0.0, -0.0, 1e-45], (2, n)),
        rng.normal(0, 1, (2, n)) * 1e-40,  # subnormals
        _softmax_sums(rng, 2, n, 2.0),
    ]).astype(np.float32)
    key = np.array(topk_k.float_to_key(jnp.asarray(x)))
    key[-1, k // 2:] = topk_k.INT32_MIN  # fewer than k valid keys
    key[-2, k:] = topk_k.INT32_MIN  # exactly k
    rows = key.shape[0]
    t, rounds = jax.jit(lambda kk: topk_k._bracket_search(kk, k, early_exit, jnp.ones((rows, 1), bool)))(key)
    t = np.asarray(t)[:, 0]
    ge, gt = (key >= t[:, None]).sum(1), (key > t[:, None]).sum(1)
    assert (ge >= k).all() and (gt <= k).all(), (ge, gt)
    if not early_exit:  # exactly the k-th largest key (INT32_MIN where fewer than k are valid)
        np.testing.assert_array_equal(t, np.sort(key, axis=1)[:, ::-1][:, k - 1])
    assert int(rounds) <= 33  # bisection alone ends by then


def test_bracket_search_needs_few_rounds_on_label_scores():
    """The point of the bracketing search: on label-like scores (8,192 candidates, k = 2048 and
    512) it ends in about 7 rounds where the radix search needs about 20 (one packed count a
    round each); without the interpolated candidate it would need about 20 too."""
    rng = np.random.default_rng(3)
    for k, sigma in ((2048, 1.0), (512, 3.0)):
        key = topk_k.float_to_key(jnp.asarray(_softmax_sums(rng, 8, 8192, sigma)))
        rounds = [int(topk_k._bracket_search(key[r:r + 1], k, True, jnp.ones((1, 1), bool))[1]) for r in range(8)]
        assert np.mean(rounds) <= 10, rounds


def test_bf16_input():
    x = distinct_scores((2, 64)).astype(jnp.bfloat16)
    x32 = np.asarray(jnp.asarray(x, jnp.float32))
    out = np.asarray(run(x, 9))
    for r in range(2):
        np.testing.assert_array_equal(np.sort(x32[r, out[r]])[::-1], np.sort(x32[r])[::-1][:9])


# ---------------------------------------------------------------------------
# tuning knobs and the multi-level path
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tuning",
    [
        dict(early_exit=False),
        dict(radix_bits=2),
        dict(radix_bits=4, early_exit=False),
        dict(block_rows=4),  # 5 rows: a partial row block
        dict(num_warps=8, num_stages=2),  # accepted, no effect in interpret mode
        dict(search="bracket"),
        dict(search="bracket", early_exit=False),
        dict(search="bracket", block_rows=4),
    ],
)
def test_tuning_variants(tuning):
    n, k = 100, 10
    counts = np.array([100, 3, 0, 64, 10], np.int32)
    x = distinct_scores((5, n))
    check_contract(run(x, k, counts, **tuning), x, k, counts)


@pytest.mark.parametrize(
    "n,k,tuning,levels",
    [
        (1000, 16, dict(max_single=128, chunk=64), 3),
        (700, 5, dict(max_single=256, chunk=64), 2),
        (300, 30, dict(max_single=128, chunk=64, radix_bits=2), 3),
        (300, 30, dict(max_single=128, chunk=64, search="bracket"), 3),
    ],
)
def test_multilevel(n, k, tuning, levels):
    plan = topk_k.plan_topk(n, k, max_single=tuning["max_single"], chunk=tuning["chunk"])
    assert plan is not None and len(plan.levels) == levels
    counts = np.array([n, 3, 0, n // 2 + 1, k, k - 1], np.int32)
    x = distinct_scores((len(counts), n))
    out = run(x, k, counts, **tuning)
    check_contract(out, x, k, counts)
    o = np.asarray(out)
    assert (np.diff(o, axis=1) > 0).all()  # ascending at every level
    for r, c in enumerate(counts):
        if c < k:
            np.testing.assert_array_equal(o[r], np.arange(k))


@pytest.mark.parametrize("search", topk_k.SEARCHES)
def test_multilevel_ties(search):
    n, k = 500, 40
    x = RNG.integers(0, 3, size=(3, n)).astype(np.float32)
    out = np.asarray(run(x, k, max_single=128, chunk=64, search=search))
    for r in range(3):
        assert len(set(out[r].tolist())) == k
        np.testing.assert_array_equal(np.sort(x[r, out[r]])[::-1], np.sort(x[r])[::-1][:k])


def test_plan_defaults():
    # the shapes that matter: (a), (b) single level; (c) multi-level
    assert len(topk_k.plan_topk(2048, 128).levels) == 1
    assert len(topk_k.plan_topk(8192, 2048).levels) == 1
    for n, k in [(32768, 512), (131072, 512), (131072, 2048)]:
        plan = topk_k.plan_topk(n, k)
        assert plan is not None and 2 <= len(plan.levels) <= 3
        assert plan.levels[-1].final and plan.levels[-1].n_in <= topk_k.DEFAULT_MAX_SINGLE
    assert topk_k.plan_topk(10, 11) is None
    assert topk_k.plan_topk(100000, 30000) is None  # too wide to chunk: reference


def test_auto_table():
    assert TOPK_AUTO_TABLE  # one place for the lead to edit
    assert topk_auto_choice(2048, 128)[0] == "pallas"
    assert topk_auto_choice(131072, 2048)[0] == "pallas"
    assert topk_auto_choice(100000, 30000)[0] == "reference"


def test_auto_is_the_reference_on_cpu_and_the_kernel_on_gpu():
    """``auto`` picks the reference off the GPU and the compiled kernel on it (what it picks is
    read off the backend, so the test holds under `make test` and `make test-gpu` alike)."""
    x = distinct_scores((2, 30))
    want = "pallas" if jax.default_backend() == "gpu" else "reference"
    np.testing.assert_array_equal(run(x, 4, impl="auto"), run(x, 4, impl=want))


def test_jit_and_empty_rows():
    x = distinct_scores((3, 40))
    f = jax.jit(lambda s, c: topk_indices(s, 5, c, impl="pallas"))
    counts = np.array([40, 2, 7], np.int32)
    check_contract(f(jnp.asarray(x), jnp.asarray(counts)), x, 5, counts)
    empty = topk_indices(jnp.zeros((0, 4, 10)), 3, impl="pallas")
    assert empty.shape == (0, 4, 3) and empty.dtype == jnp.int32


# ---------------------------------------------------------------------------
# bad input: clear errors before any compilation
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args,kwargs,exc,match",
    [
        ((np.zeros((2, 5), np.float32), 6), {}, ValueError, "1 <= k <= N"),
        ((np.zeros((2, 5), np.float32), 0), {}, ValueError, "1 <= k <= N"),
        ((np.zeros((2, 5), np.float32), -1), {}, ValueError, "1 <= k <= N"),
        ((np.zeros((2, 5), np.int32), 2), {}, TypeError, "float"),
        ((np.zeros((2, 5), np.float32), 2.0), {}, TypeError, "static Python int"),
        ((np.zeros((2, 5), np.float32), True), {}, TypeError, "static Python int"),
        ((np.zeros((2, 5), np.float32), 2, np.zeros((3,), np.int32)), {}, ValueError, "counts must have shape"),
        ((np.zeros((2, 5), np.float32), 2, np.zeros((2,), np.float32)), {}, TypeError, "counts must be an integer"),
        ((np.zeros((2, 0), np.float32), 1), {}, ValueError, "N >= 1"),
        ((np.float32(1.0), 1), {}, ValueError, "rank >= 1"),
        ((np.zeros((2, 5), np.float32), 2), {"impl": "bogus"}, ValueError, "impl must be"),
        ((np.zeros((2, 5), np.float32), 2), {"bogus_knob": 1}, TypeError, "unknown tuning"),
        ((np.zeros((2, 5), np.float32), 2), {"radix_bits": 3}, ValueError, "radix_bits"),
        ((np.zeros((2, 5), np.float32), 2), {"search": "sort"}, ValueError, "search must be one of"),
        ((np.zeros((2, 5), np.float32), 2), {"block_rows": 3}, ValueError, "block_rows"),
        ((np.zeros((2, 50), np.float32), 10), {"impl": "pallas", "max_single": 16, "chunk": 8}, ValueError, "cannot run"),
    ],
)
def test_bad_input(args, kwargs, exc, match):
    args = tuple(jnp.asarray(a) if isinstance(a, np.ndarray) else a for a in args)
    with pytest.raises(exc, match=match):
        topk_indices(*args, **kwargs)


def test_k_must_be_static_under_jit():
    with pytest.raises(TypeError, match="static Python int"):
        jax.jit(lambda s, k: topk_indices(s, k))(jnp.zeros((2, 5)), 2)


# ---------------------------------------------------------------------------
# the kernels lower to Triton IR for an H100 (no GPU needed)
# ---------------------------------------------------------------------------


def _lower_for_h100(fn, *specs):
    from jax import export

    dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="cuda")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), (jax.sharding.AxisType.Auto,), abstract_device=dev)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the Triton backend's deprecation notice
        with jax.sharding.use_abstract_mesh(mesh):
            exp = export.export(
                jax.jit(fn),
                platforms=["cuda"],
                disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
            )(*specs)
    return exp.mlir_module()


@pytest.mark.parametrize(
    "r,n,k,tuning,calls",
    [
        (64, 2048, 128, {}, 1),
        (64, 8192, 1024, dict(radix_bits=2), 1),
        (64, 8192, 512, dict(early_exit=False, radix_bits=4), 1),
        (64, 2048, 128, dict(block_rows=4), 1),
        (64, 131072, 2048, {}, 3),
        (64, 32768, 512, {}, 2),
        (64, 8192, 2048, dict(rows_per_count=8, greater_first=True), 1),
        (64, 32768, 512, dict(rows_per_count=8), 2),
        (8, 8192, 2048, dict(num_warps=32), 1),  # 1,024 threads a row: the tune's B=1 candidate
        (64, 8192, 2048, dict(search="bracket", rows_per_count=8, greater_first=True), 1),
        (64, 2048, 128, dict(search="bracket", block_rows=4, early_exit=False), 1),
    ],
)
def test_lowers_to_triton_for_h100(r, n, k, tuning, calls):
    pytest.importorskip("jax._src.lib.triton")

    def fn(x, c):
        return topk_k.topk_pallas(x, k, c, **tuning)

    nc = r // tuning.get("rows_per_count", 1)
    txt = _lower_for_h100(fn, jax.ShapeDtypeStruct((r, n), jnp.float32), jax.ShapeDtypeStruct((nc,), jnp.int32))
    assert txt.count("__gpu$xla.gpu.triton") == calls


@pytest.mark.parametrize("n,k,tuning", [(40, 12, {}), (3000, 700, {"max_single": 1024})])
def test_greater_first_puts_the_ties_at_the_threshold_last(n, k, tuning):
    """Fewer than k finite scores among -inf ones: with greater_first the finite ones come
    first (what block_label_topk's counts rely on); without it the kernel's order is by
    position, which mixes them. Also through the multi-level plan."""
    rng = np.random.default_rng(n)
    x = np.full((3, n), -np.inf, np.float32)
    finite = [rng.choice(n, size=m, replace=False) for m in (k // 2, k - 1, k + 5)]
    for r, idx in enumerate(finite):
        x[r, idx] = rng.normal(size=len(idx))
    for impl in ("pallas", "reference"):
        out = np.asarray(topk_indices(jnp.asarray(x), k, impl=impl, greater_first=True,
                                      **(tuning if impl == "pallas" else {})))
        for r, idx in enumerate(finite):
            m = min(len(idx), k)
            head = out[r, :m]
            assert np.isfinite(x[r, head]).all(), (impl, r)
            assert len(set(out[r].tolist())) == k
    mixed = np.asarray(topk_indices(jnp.asarray(x), k, impl="pallas", **tuning))
    assert not np.isfinite(x[0, mixed[0, : k // 2]]).all()  # the default order is by position


@pytest.mark.parametrize("impl", ["pallas", "reference"])
@pytest.mark.parametrize("n,k,tuning", [(300, 20, {}), (5000, 64, {"max_single": 1024})])
def test_counts_shared_by_the_last_leading_axis(impl, n, k, tuning):
    """counts [B, 1] for scores [B, H, N]: every head of a row uses the row's count (the
    kernel reads it by row // H; nothing is broadcast in memory); the same result as the
    broadcast counts, through one and several levels."""
    b, h = 3, 5
    x = jnp.asarray(distinct_scores((b * h, n)).reshape(b, h, n))
    per_row = jnp.asarray([n, k - 3, n // 2], jnp.int32)
    kw = tuning if impl == "pallas" else {}
    got = np.asarray(topk_indices(x, k, per_row[:, None], impl=impl, **kw))
    want = np.asarray(topk_indices(x, k, jnp.broadcast_to(per_row[:, None], (b, h)), impl=impl, **kw))
    np.testing.assert_array_equal(np.sort(got, -1), np.sort(want, -1))
    with pytest.raises(ValueError, match="last axis 1"):
        topk_indices(x, k, per_row[:2, None], impl=impl)
    with pytest.raises(ValueError, match="last axis 1"):
        topk_indices(x, k, jnp.ones((1, h), jnp.int32), impl=impl)


def test_auto_reads_the_tuned_table(monkeypatch):
    """A measured class's knobs reach "auto" (rows, N, k rounded as the table keys them);
    a tuned plan the kernel cannot run is ignored, and an unmeasured class keeps the defaults."""
    from pallas_kernels import tuning

    key = tuning.shape_class("topk", rows=8, n=8192, k=2048)
    assert key == "topk|rows=8|n=8192|k=2048"
    entries = {key: {"config": {"num_warps": 16, "radix_bits": 2, "early_exit": False}},
               tuning.shape_class("topk", rows=64, n=8192, k=2048): {"config": {"max_single": 1024}}}
    monkeypatch.setattr(tuning, "_table", lambda: entries)
    assert topk_auto_choice(8192, 2048, rows=8) == ("pallas", {"num_warps": 16, "radix_bits": 2, "early_exit": False})
    assert topk_auto_choice(8192, 2048, rows=7)[1]["radix_bits"] == 2  # 7 rows: the class of 8
    assert topk_auto_choice(8192, 2048, rows=64) == ("pallas", {})  # max_single 1024 < k: no plan
    assert topk_auto_choice(8192, 2048, rows=256) == ("pallas", {})
    assert topk_auto_choice(8192, 2048) == ("pallas", {})


@pytest.mark.parametrize("impl", ["pallas", "reference"])
@pytest.mark.parametrize("n,k,tuning", [(300, 20, {}), (100, 64, dict(block_rows=2)),
                                        (300, 20, {"search": "bracket"}),  # the search reads n_valid
                                        (300, 20, {"early_exit": False}),  # the search needs no count
                                        (5000, 64, {"max_single": 1024})])  # two levels: counted in XLA
def test_count_above_counts_the_valid_entries_over_the_floor(impl, n, k, tuning):
    """``count_above``: ``min(k, #(valid > floor))`` beside the positions (the same positions
    as without it), rows of -inf marks, NaN, counts cutting rows short, counts shared by the
    heads of a row, and floors that are not -inf: 0.25, both zeros (with +-0.0 scores, which
    are not above either; -0.0 first: the jit cache takes 0.0 for it), +inf and NaN (nothing
    is above them)."""
    b, h = 3, 2
    x = distinct_scores((b * h, n)).reshape(b, h, n)
    rng = np.random.default_rng(n)
    x[rng.random(x.shape) < 0.3] = -np.inf  # masked slots, as block_label_topk marks them
    x[0, 0, 5] = np.nan
    x[1, 1] = -np.inf  # nothing above the floor
    x[2, 0, : n - 3] = -np.inf  # 3 above it: fewer than k
    x[2, 0, 1:4] = [0.0, -0.0, np.inf]  # +-0 and +inf in that row: a count below k, so min(k, .) hides nothing
    kw = tuning if impl == "pallas" else {}
    xj = jnp.asarray(x, jnp.float32)
    for counts in (None, jnp.asarray([[n], [k - 3], [n // 2]], jnp.int32)):
        # the special floors once, on the default kernel (each floor compiles its own program)
        every = counts is None and (impl == "reference" or not tuning)
        floors = (-np.inf, 0.25, -0.0, 0.0, np.inf, np.nan) if every else (-np.inf, 0.25)
        for floor in floors:
            pos, cnt = topk_indices(xj, k, counts, impl=impl, count_above=floor, **kw)
            valid = np.arange(n) < (n if counts is None else np.asarray(counts)[:, :, None])
            want = np.minimum(((x > floor) & valid).sum(-1), k)
            np.testing.assert_array_equal(np.asarray(cnt), want)
            assert cnt.dtype == jnp.int32 and cnt.shape == (b, h)
            plain = topk_indices(xj, k, counts, impl=impl, **kw)
            np.testing.assert_array_equal(np.sort(np.asarray(pos), -1), np.sort(np.asarray(plain), -1))
    with pytest.raises(TypeError, match="count_above"):
        topk_indices(xj, k, impl=impl, count_above="-inf")
    with pytest.raises(ValueError, match="single-level"):
        topk_k.topk_pallas(jnp.zeros((2, 300)), 20, count_above=0.0, max_single=64, interpret=True)


def test_count_above_lowers_to_triton_for_h100():
    pytest.importorskip("jax._src.lib.triton")

    def fn(x, c):
        return topk_k.topk_pallas(x, 2048, c, rows_per_count=8, greater_first=True, count_above=-np.inf)

    txt = _lower_for_h100(fn, jax.ShapeDtypeStruct((64, 8192), jnp.float32), jax.ShapeDtypeStruct((8,), jnp.int32))
    assert txt.count("__gpu$xla.gpu.triton") == 1


@pytest.mark.parametrize("n,k,tuning", [(300, 20, {}), (100, 64, dict(block_rows=2, greater_first=True)),
                                        (5000, 64, {"max_single": 1024})])  # the table on a second level
def test_block_table_and_dense_rows(n, k, tuning):
    """``block_table``: the kernel writes ``table[row, p // bs] * bs + p % bs`` for each position
    ``p`` it would have written (the same positions, a short row's ``arange`` included);
    ``dense_lengths``/``dense_limit``: a row whose length is at most the limit gets
    ``arange(k)`` unmapped and, with ``count_above``, its length as the count."""
    b, h, bs = 3, 2, 7
    r = b * h
    x = distinct_scores((r, n))
    rng = np.random.default_rng(k)
    x[rng.random(x.shape) < 0.2] = -np.inf
    width = -(-n // bs) + 2
    table = np.stack([rng.permutation(10 * width)[:width] for _ in range(r)]).astype(np.int32)
    counts = np.array([n, k - 5, n, n, n // 2, n], np.int32)  # row 1 short: fewer than k valid
    xj, cj, tj = jnp.asarray(x, jnp.float32), jnp.asarray(counts), jnp.asarray(table)
    run = functools.partial(topk_k.topk_pallas, xj, k, cj, interpret=True, **tuning)
    plain = np.asarray(run())
    mapped = np.asarray(run(block_table=tj, block_size=bs))
    np.testing.assert_array_equal(mapped, np.take_along_axis(table, plain // bs, 1) * bs + plain % bs)
    np.testing.assert_array_equal(plain[1], np.arange(k))  # the short row's fill, mapped above
    lengths = np.array([5, 900, 40], np.int32)  # per batch row, shared by its h heads
    dense = np.repeat(lengths <= 64, h)
    kw = dict(block_table=tj, block_size=bs, dense_lengths=jnp.asarray(lengths), dense_limit=64, rows_per_dense=h)
    if "max_single" not in tuning:  # count_above: single-level plans only
        pos, cnt = run(count_above=-np.inf, **kw)
        _, plain_cnt = run(count_above=-np.inf)
        np.testing.assert_array_equal(np.asarray(cnt), np.where(dense, np.repeat(lengths, h), np.asarray(plain_cnt)))
    else:
        pos = run(**kw)
    pos = np.asarray(pos)
    np.testing.assert_array_equal(pos[dense], np.broadcast_to(np.arange(k), (dense.sum(), k)))
    np.testing.assert_array_equal(pos[~dense], mapped[~dense])
    bad = [dict(block_table=tj), dict(block_table=tj[:, :2], block_size=bs), dict(block_table=tj[:3], block_size=bs),
           dict(dense_lengths=jnp.asarray(lengths)), dict(dense_lengths=jnp.asarray(lengths), dense_limit=64)]
    for kw in bad:
        with pytest.raises(ValueError):
            run(**kw)


def test_block_table_and_dense_rows_lower_to_triton_for_h100():
    pytest.importorskip("jax._src.lib.triton")

    def fn(x, t, d):
        return topk_k.topk_pallas(x, 2048, greater_first=True, count_above=-np.inf, block_table=t, block_size=64,
                                  dense_lengths=d, dense_limit=2048, rows_per_dense=8)

    sd = jax.ShapeDtypeStruct
    txt = _lower_for_h100(fn, sd((64, 8192), jnp.float32), sd((64, 128), jnp.int32), sd((8,), jnp.int32))
    assert txt.count("__gpu$xla.gpu.triton") == 1


@pytest.mark.parametrize("impl", ["pallas", "reference"])
def test_topk_indices_maps_through_a_block_table_with_dense_rows(impl):
    """The op's ``block_table``/``dense_lengths``: both implementations give the same mapped
    sets (and counts), dense rows ``arange(k)`` with their length as the count; bad
    arguments fail before any work."""
    b, h, n, k, bs = 3, 2, 200, 24, 8
    x = distinct_scores((b * h, n)).reshape(b, h, n)
    x[0, 1, :50] = -np.inf
    rng = np.random.default_rng(1)
    table = np.stack([np.stack([rng.permutation(100)[:n // bs] for _ in range(h)]) for _ in range(b)]).astype(np.int32)
    lengths = np.array([[500], [30], [24]], np.int32)
    xj, tj, lj = jnp.asarray(x, jnp.float32), jnp.asarray(table), jnp.asarray(lengths)
    pos, cnt = topk_indices(xj, k, impl=impl, count_above=-np.inf, block_table=tj, block_size=bs,
                            dense_lengths=lj, dense_limit=k)
    plain, plain_cnt = topk_indices(xj, k, impl="reference", count_above=-np.inf)
    want = np.take_along_axis(table, np.asarray(plain) // bs, -1) * bs + np.asarray(plain) % bs
    dense = np.broadcast_to(lengths <= k, (b, h))
    pos = np.asarray(pos)
    np.testing.assert_array_equal(np.sort(pos[~dense], -1), np.sort(want[~dense], -1))
    np.testing.assert_array_equal(pos[dense], np.broadcast_to(np.arange(k), (dense.sum(), k)))
    np.testing.assert_array_equal(np.asarray(cnt), np.where(dense, np.broadcast_to(lengths, (b, h)), plain_cnt))
    bad = [dict(block_table=tj), dict(block_size=bs), dict(block_table=tj[..., :3], block_size=bs),
           dict(block_table=tj, block_size=0), dict(block_table=tj.astype(jnp.float32), block_size=bs),
           dict(dense_lengths=lj), dict(dense_limit=4), dict(dense_lengths=lj[:2], dense_limit=4)]
    for kw in bad:
        with pytest.raises((ValueError, TypeError)):
            topk_indices(xj, k, impl=impl, **kw)


@pytest.mark.parametrize("n,k,tuning", [(300, 20, {}), (100, 64, dict(block_rows=2)),
                                        (5000, 64, {"max_single": 1024})])  # appended by a second level
def test_append_writes_one_more_column(n, k, tuning):
    """``append``: ``[R, k + 1]``, the first k columns exactly the plain result (table, dense
    rows, short rows and counts unchanged) and each row's value (shared by its heads with
    ``rows_per_append``) in the last."""
    b, h = 3, 2
    r = b * h
    x = distinct_scores((r, n))
    rng = np.random.default_rng(k + 1)
    x[rng.random(x.shape) < 0.2] = -np.inf
    counts = jnp.asarray(np.array([n, k - 5, n, n, n // 2, n], np.int32))
    lengths = jnp.asarray(np.array([5, 900, 40], np.int32))
    extra = np.array([70, -3, 2**31 - 1], np.int32)
    run = functools.partial(topk_k.topk_pallas, jnp.asarray(x, jnp.float32), k, counts, interpret=True,
                            dense_lengths=lengths, dense_limit=64, rows_per_dense=h, **tuning)
    kw = {} if "max_single" in tuning else dict(count_above=-np.inf)
    plain = run(**kw)
    got = run(append=jnp.asarray(extra), rows_per_append=h, **kw)
    if kw:
        (plain, plain_cnt), (got, cnt) = plain, got
        np.testing.assert_array_equal(np.asarray(cnt), np.asarray(plain_cnt))
    got = np.asarray(got)
    assert got.shape == (r, k + 1)
    np.testing.assert_array_equal(got[:, :k], np.asarray(plain))
    np.testing.assert_array_equal(got[:, k], np.repeat(extra, h))
    per_row = np.arange(r, dtype=np.int32) * 11  # one value a row
    got = np.asarray(run(append=jnp.asarray(per_row), **kw)[0] if kw else run(append=jnp.asarray(per_row)))
    np.testing.assert_array_equal(got[:, k], per_row)
    with pytest.raises(ValueError, match="append"):
        run(append=jnp.asarray(extra))  # 3 values for 6 rows, rows_per_append 1


@pytest.mark.parametrize("impl", ["pallas", "reference"])
def test_topk_indices_append_as_the_filter_uses_it(impl):
    """The op's ``append`` with the filter's arguments (counts, dense rows and the appended
    value all one per batch row, ``[B, 1]``): the plain result with the value as the last
    column, in both implementations; a bad ``append`` fails before any work."""
    b, h, n, k = 3, 4, 128, 15
    x = jnp.asarray(distinct_scores((b * h, n)).reshape(b, h, n), jnp.float32)
    newest = jnp.asarray([[100], [9], [15]], jnp.int32)  # row 1 dense (9 <= k), row 2 at the limit
    kw = dict(impl=impl, dense_lengths=newest, dense_limit=k)
    plain = np.asarray(topk_indices(x, k, newest, **kw))
    got = np.asarray(topk_indices(x, k, newest, append=newest, **kw))
    assert got.shape == (b, h, k + 1)
    np.testing.assert_array_equal(got[..., :k], plain)
    np.testing.assert_array_equal(got[..., k], np.broadcast_to(np.asarray(newest), (b, h)))
    np.testing.assert_array_equal(got[1:, :, :k], np.broadcast_to(np.arange(k), (2, h, k)))  # dense: all blocks
    empty = topk_indices(x[:0], k, append=newest[:0], impl=impl)
    assert empty.shape == (0, h, k + 1)
    for bad in (newest[:2], newest.astype(jnp.float32), jnp.zeros((b, h, 1), jnp.int32)):
        with pytest.raises((ValueError, TypeError), match="append"):
            topk_indices(x, k, newest, append=bad, **kw)


def test_append_lowers_to_triton_for_h100():
    """The filter's call at 128K: 2,048 block scores a row, k = 127, the newest block appended."""
    pytest.importorskip("jax._src.lib.triton")

    def fn(x, c):
        return topk_k.topk_pallas(x, 127, c, rows_per_count=8, dense_lengths=c, dense_limit=127, rows_per_dense=8,
                                  append=c, rows_per_append=8)

    sd = jax.ShapeDtypeStruct
    txt = _lower_for_h100(fn, sd((64, 2048), jnp.float32), sd((8,), jnp.int32))
    assert txt.count("__gpu$xla.gpu.triton") == 1
