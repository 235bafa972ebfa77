"""Kascade's tiled prefill (sparse_jax.methods.kascade.prefill, Kascade(tiled_prefill=True)):
the per-tile counts and top-k against NumPy, the attention against a brute force
over each query's allowed keys, exact when the budget covers the prompt (in the
model too, scanned and unrolled), the layer-by-layer prefill equal to the model's,
and a run from the CLI; the composed fast path (gather kernel + diagonal tile + LSE
merge) against the masked reference; the chunked anchor selection equal to the
[T, T] reference, and no [T, T] array on the composed anchor path."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.driver_modes import driver_mode

from sparse_jax.methods.kascade import prefill as kp
from sparse_jax.methods import get_method
from sparse_jax.methods.kascade import Kascade
from tests.test_kascade import _run, _tiny_model, _tokens


def _data(seed, b=2, t=150, hq=4, hkv=2, d=16):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(b, t, hq, d)).astype(np.float32)
    k = rng.normal(size=(b, t, hkv, d)).astype(np.float32)
    v = rng.normal(size=(b, t, hkv, d)).astype(np.float32)
    return q, k, v, np.array([t, t - 37], np.int32)


def _np_probs(q, k, length):
    """f64 causal softmax of one row: ``[Hq, T, T]`` (keys <= query and < length)."""
    t, hq, d = q.shape
    kk = np.repeat(k, hq // k.shape[1], axis=1)
    s = np.einsum("thd,shd->hts", q.astype(np.float64), kk.astype(np.float64)) / np.sqrt(d)
    i, j = np.arange(t)[:, None], np.arange(t)[None, :]
    s = np.where((j <= i) & (j < length), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return p / p.sum(-1, keepdims=True)


@pytest.mark.parametrize("budget", [0, 40])
def test_tile_counts_follow_the_rule(budget):
    t, tile = 700, 32
    lengths = np.array([700, 301, 40], np.int32)
    got = np.asarray(kp.tile_counts(jnp.asarray(lengths), t, tile, budget=budget, fraction=0.1, min_keys=64))
    for r, n in enumerate(lengths):
        for i in range(kp.num_tiles(t, tile)):
            start = i * tile
            if budget:
                want = min(budget, start)
            else:
                row_k = max(min(max(int(np.floor(0.1 * n)), 64), n) - tile, 0)
                want = min(row_k, max(int(np.floor(0.1 * start)), 64), start)
            assert got[r, i] == want, (r, i)


def test_tile_topk_matches_numpy():
    q, k, _, lengths = _data(0)
    tile, hkv = 16, k.shape[2]
    sel = kp.anchor_selection(jnp.asarray(q), jnp.asarray(k), jnp.asarray(lengths), tile=tile, budget=24,
                              fraction=0.1, min_keys=8)
    idx, cnt = np.asarray(sel["indices"]), np.asarray(sel["counts"])
    for b, n in enumerate(lengths):
        p = _np_probs(q[b], k[b], n)  # [Hq, T, T]
        g = p.reshape(hkv, -1, *p.shape[1:]).sum(1)  # [Hkv, T, T]
        for i in range(kp.num_tiles(q.shape[1], tile)):
            lo, hi = i * tile, min((i + 1) * tile, n)
            for h in range(hkv):
                score = g[h, lo:hi, :lo].sum(0) if hi > lo else np.zeros(lo)
                want = set(np.argsort(-score, kind="stable")[: cnt[b, i]].tolist())
                assert set(idx[b, h, i, : cnt[b, i]].tolist()) == want, (b, h, i)


def test_tiled_attention_matches_a_brute_force():
    q, k, v, lengths = _data(1)
    tile, hq, hkv = 16, q.shape[2], k.shape[2]
    rng = np.random.default_rng(2)
    nt, width = kp.num_tiles(q.shape[1], tile), 20
    idx = rng.integers(0, q.shape[1], (2, hkv, nt, width)).astype(np.int32)
    cnt = rng.integers(0, width + 1, (2, nt)).astype(np.int32)
    got = np.asarray(kp.tiled_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(idx),
                                        jnp.asarray(cnt), tile))
    for b, n in enumerate(lengths):
        for t in range(n):
            i = t // tile
            for h in range(hq):
                g = h // (hq // hkv)
                keys = sorted({j for j in idx[b, g, i, : cnt[b, i]].tolist()} | set(range(i * tile, t + 1)))
                s = q[b, t, h].astype(np.float64) @ k[b, keys, g].T.astype(np.float64) / np.sqrt(q.shape[-1])
                s[np.asarray(keys) > t] = -np.inf  # a selected key past the query: causal
                w = np.exp(s - s.max())
                want = (w / w.sum()) @ v[b, keys, g].astype(np.float64)
                np.testing.assert_allclose(got[b, t, h], want, atol=2e-5, rtol=0)


def _selection(rng, b, hkv, t, tile, width):
    """Each tile's list: distinct keys before the tile (what an anchor selects), garbage
    past the count; counts up to the tile start, one over the width (clamped to it)."""
    nt = kp.num_tiles(t, tile)
    idx = rng.integers(-3 * t, 3 * t, (b, hkv, nt, width))
    cnt = np.zeros((b, nt), np.int32)
    for r in range(b):
        for n in range(1, nt):
            cnt[r, n] = rng.integers(0, min(width, n * tile) + 1)
            for h in range(hkv):
                idx[r, h, n, : cnt[r, n]] = rng.permutation(n * tile)[: cnt[r, n]]
    if nt * tile - tile > width:
        cnt[0, -1] = width + 3
        idx[0, :, -1] = [rng.permutation((nt - 1) * tile)[:width] for _ in range(hkv)]
    return jnp.asarray(idx, jnp.int32), jnp.asarray(cnt)


# (T, Hq, Hkv, D, dtype, max_rows, tuning): T off the tile grid, G = 1, 4, 8, D = 64, 128
COMPOSED_CASES = [
    (150, 2, 2, 64, jnp.float32, None, {}),
    (100, 8, 2, 128, jnp.float32, None, {"block_k": 16, "num_splits": 2}),
    (130, 8, 2, 64, jnp.bfloat16, None, {}),
    (70, 8, 1, 64, jnp.float32, 128, {}),  # a tile of 32 x G=8 = 256 rows: two calls of 16 queries
]


@pytest.mark.parametrize("t,hq,hkv,d,dtype,max_rows,tuning", COMPOSED_CASES)
def test_composed_equals_the_masked_reference(t, hq, hkv, d, dtype, max_rows, tuning):
    """The fast path (the gather kernel in interpret mode over each tile's keys, the
    diagonal tile, the LSE merge) against the [T, T]-mask reference, every query row
    (padded ones too: neither reads the lengths). The first tile (count 0) and the
    random empty lists are the diagonal alone. (The kernel's jnp reference, what the
    composed path runs on a CPU, is checked in the model below.)"""
    rng = np.random.default_rng(t + hq + d)
    b, tile, width = 2, 32, 40
    q, k, v = (jnp.asarray(rng.normal(size=(b, t, h, d)), dtype) for h in (hq, hkv, hkv))
    idx, cnt = _selection(rng, b, hkv, t, tile, width)
    want = jax.jit(kp.tiled_attention, static_argnums=5)(q, k, v, idx, cnt, tile)
    composed = functools.partial(kp.tiled_attention_composed, tile=tile, impl="pallas", max_rows=max_rows, **tuning)
    got = jax.jit(composed)(q, k, v, idx, cnt)
    assert got.dtype == dtype and got.shape == q.shape
    # bf16: both round the f32 result once; the composed path also rounds the gathered part
    tol = 2e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol, rtol=tol)


@pytest.mark.parametrize("unroll", [False, True])
def test_budget_covering_the_prompt_is_dense_prefill(unroll, monkeypatch):
    """Every key before each tile selected: anchors and reuse layers attend the whole
    causal prefix (the traced role of a scanned segment takes lax.switch)."""

    driver_mode(monkeypatch, unroll)
    tokens, lengths = _tokens()
    dense = _run(_tiny_model(Kascade(anchors=(0, 2), budget=512)), tokens, lengths, 3, 512)
    tiled = _run(_tiny_model(Kascade(anchors=(0, 2), budget=512, tiled_prefill=True)), tokens, lengths, 3, 512)
    np.testing.assert_allclose(tiled, dense, atol=3e-5, rtol=0)
    # the paper's rule (k = 128 - 32 keys per tile of a 300-token prompt): it selects
    # (anchors select in chunks of one 32-query tile: prefill_chunk_bytes=1)
    rule = _run(_tiny_model(Kascade(anchors=(0, 2), tiled_prefill=True, prefill_chunk_bytes=1)), tokens, lengths,
                3, 512)
    plain = _run(_tiny_model(Kascade(anchors=(0, 2))), tokens, lengths, 3, 512)
    assert np.all(np.isfinite(rule)) and np.abs(rule - plain).max() > 1e-4
    # the composed attention (the default) against the masked reference, anchors and reuse layers
    masked = _run(_tiny_model(Kascade(anchors=(0, 2), tiled_prefill=True, prefill_impl="masked")),
                  tokens, lengths, 3, 512)
    np.testing.assert_allclose(rule, masked, atol=3e-5, rtol=0)


def test_layer_by_layer_prefill_equals_the_model():
    """The tiered runner's prefill (one program per layer, the carry handed along) gives
    the model's own prefill logits."""
    from models.runtime.tiered import TieredRunner

    tokens, lengths = _tokens(3, t=200)
    model = _tiny_model(Kascade(anchors=(0, 2), budget=48, tiled_prefill=True))
    want = _run(model, tokens, lengths, 1, 512)[:, 0]
    got, _ = TieredRunner(model, "resident").prefill(tokens, lengths, 512)
    np.testing.assert_allclose(np.asarray(got), want, atol=3e-5, rtol=0)


def test_options_and_errors():
    m = get_method("kascade", anchors=(0,), tiled_prefill=True, prefill_tile=16)
    assert m.tiled_prefill and m.prefill_tile == 16
    assert m.prefill_impl == "composed" and m.prefill_chunk_bytes == 2 << 30
    with pytest.raises(ValueError, match="prefill_chunk_bytes"):
        Kascade(anchors=(0,), prefill_chunk_bytes=0).check(num_q_heads=4, num_kv_heads=2, head_dim=16, max_len=64)
    with pytest.raises(ValueError, match="prefill_impl"):
        Kascade(anchors=(0,), prefill_impl="dense").check(num_q_heads=4, num_kv_heads=2, head_dim=16, max_len=64)
    with pytest.raises(ValueError, match="impl must be one of"):
        kp.tiled_attention_impl(None, None, None, None, None, 32, impl="fast")
    with pytest.raises(ValueError, match="prefill_tile"):
        Kascade(anchors=(0,), prefill_tile=0).check(num_q_heads=4, num_kv_heads=2, head_dim=16, max_len=64)
    assert Kascade(anchors=(0,)).init_prefill_carry(batch=1, num_kv_heads=2, length=64) is None
    carry = Kascade(anchors=(0,), tiled_prefill=True).init_prefill_carry(batch=3, num_kv_heads=2, length=100)
    # width: min(max(128, 10), 100) - 32 = 68 keys; 4 tiles of 32 over 100 tokens
    assert carry["indices"].shape == (3, 2, 4, 68) and carry["counts"].shape == (3, 4)


# The tiled prefill from the generate CLI on SmolLM2's real weights: tests/test_methods_in_model.py's
# kascade-tiled case (``--attention-opt tiled_prefill=True``, budget 96 below its 211-token prompt:
# the tiled prefill selects, beside Token Sparse Attention). A test here ran it again on the
# 64-token parity prompt, where the budget covers every tile's keys and the tokens are Hugging
# Face's (21 s of CI compiling SmolLM2): that exactness is test_budget_covering_the_prompt_is_dense_prefill's,
# scanned and unrolled, and the dense model's tokens against Hugging Face's tests/test_generate_cli.py's.


def test_anchor_renormalises_its_probabilities_over_its_selection():
    """An anchor's output (its exact probabilities, computed once, renormalised over each
    tile's top-k and the diagonal tile) equals a softmax over the same keys."""
    q, k, v, lengths = (jnp.asarray(a) for a in _data(6))
    args = dict(tile=16, budget=0, fraction=0.1, min_keys=40)  # 40 - 16 = 24 keys per tile
    out, sel = kp.anchor_attention(q, k, v, lengths, **args)
    want = kp.tiled_attention(q, k, v, sel["indices"], sel["counts"], 16)
    composed = functools.partial(kp.anchor_attention_impl, impl="composed", kernel_impl="reference",
                                 max_chunk_bytes=3 * 2 * 4 * 16 * 150 * 4, **args)  # chunks of 3 of 10 tiles
    fast, fast_sel = jax.jit(composed)(q, k, v, lengths)  # (the kernel itself: the tests above)
    for r, n in enumerate(np.asarray(lengths)):
        np.testing.assert_allclose(np.asarray(out)[r, :n], np.asarray(want)[r, :n], atol=2e-5, rtol=0)
        np.testing.assert_allclose(np.asarray(fast)[r, :n], np.asarray(out)[r, :n], atol=2e-5, rtol=0)
    np.testing.assert_array_equal(np.asarray(fast_sel["indices"]), np.asarray(sel["indices"]))
    assert int(sel["counts"].max()) > 0  # it selects
    # what the composed path needs of a selection: distinct keys before the tile
    idx, cnt = np.asarray(sel["indices"]), np.asarray(sel["counts"])
    for r in range(idx.shape[0]):
        for h in range(idx.shape[1]):
            for n in range(idx.shape[2]):
                listed = idx[r, h, n, : cnt[r, n]]
                assert len(set(listed.tolist())) == len(listed) and np.all(listed < n * 16)


# (B, T, Hq, Hkv, tile, lengths): T off the tile grid, ragged rows (a tile wholly past a
# row's length scores 0 everywhere: all ties), G = 4 and G = 1
CHUNK_CASES = [(2, 150, 4, 1, 16, (150, 113)), (2, 97, 2, 2, 32, (97, 30))]


@pytest.mark.parametrize("b,t,hq,hkv,tile,lengths", CHUNK_CASES)
@pytest.mark.parametrize("budget", [0, 24])
def test_chunked_selection_equals_the_reference(b, t, hq, hkv, tile, lengths, budget):
    """anchor_selection_chunked (lax.map over chunks of query tiles) gives the reference's
    indices exactly (the same f32 math row by row: order and ties too) and counts, for
    chunks of 1 tile, of a number not dividing the tile count, of all tiles, and one
    picked from a byte budget."""
    rng = np.random.default_rng(t + budget)
    q = jnp.asarray(rng.normal(size=(b, t, hq, 16)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(b, t, hkv, 16)), jnp.float32)
    lengths = jnp.asarray(lengths, jnp.int32)
    args = dict(tile=tile, budget=budget, fraction=0.1, min_keys=40)
    want = kp.anchor_selection(q, k, lengths, **args)
    nt = kp.num_tiles(t, tile)
    per_tile = b * hq * tile * t * 4
    assert kp.chunk_tiles(b, hq, t, tile, 3 * per_tile + 1) == 3 and kp.chunk_tiles(b, hq, t, tile, 1) == 1
    assert kp.chunk_tiles(b, hq, t, tile) == nt  # the 2 GiB default: one chunk here
    for chunk in (1, 3, nt, None):
        fn = functools.partial(kp.anchor_selection_chunked, chunk=chunk, max_chunk_bytes=2 * per_tile, **args)
        got = jax.jit(fn)(q, k, lengths)
        np.testing.assert_array_equal(np.asarray(got["indices"]), np.asarray(want["indices"]), err_msg=str(chunk))
        np.testing.assert_array_equal(np.asarray(got["counts"]), np.asarray(want["counts"]))
    assert int(want["counts"].max()) > 0


def _avals(jaxpr):
    """Every equation's output shape, sub-jaxprs (lax.map's scan, switch branches) too."""
    from jax.extend import core as jcore

    for e in jaxpr.eqns:
        yield from (getattr(v.aval, "shape", ()) for v in e.outvars)
        for p in e.params.values():
            for sub in p if isinstance(p, (list, tuple)) else (p,):
                if isinstance(sub, jcore.ClosedJaxpr):
                    yield from _avals(sub.jaxpr)
                elif isinstance(sub, jcore.Jaxpr):
                    yield from _avals(sub)


def test_composed_anchor_builds_no_t_by_t_array():
    """At T = 4096 (tiny heads, 8-tile chunks) the composed anchor (chunked selection +
    the composed attention) and the dense anchor's selection hold no array with two
    dims >= T (the masked reference does: the check sees one), and the compiled
    selection's temporaries are a few chunks, not [B, Hq, T, T]."""
    b, t, hq, hkv, d, tile = 1, 4096, 4, 1, 8, 32
    q = jnp.zeros((b, t, hq, d), jnp.float32)
    k = v = jnp.zeros((b, t, hkv, d), jnp.float32)
    lengths = jnp.asarray([t - 5], jnp.int32)
    chunk_bytes = 8 * b * hq * tile * t * 4  # 8 tiles of 32 queries: 16 MiB
    args = dict(tile=tile, budget=0, fraction=0.1, min_keys=128, max_chunk_bytes=chunk_bytes)

    def big(fn, *xs):
        return [s for s in _avals(jax.make_jaxpr(fn)(*xs).jaxpr) if sum(n >= t for n in s) >= 2]

    anchor = functools.partial(kp.anchor_attention_impl, impl="composed", **args)
    assert big(anchor, q, k, v, lengths) == []
    selection = functools.partial(kp.anchor_selection_impl, impl="composed", **args)
    assert big(selection, q, k, lengths) == []
    assert big(functools.partial(kp.anchor_attention_impl, impl="masked", **args), q, k, v, lengths)
    mem = jax.jit(selection).lower(q, k, lengths).compile().memory_analysis()
    if mem is not None:
        assert mem.temp_size_in_bytes < 4 * chunk_bytes < b * hq * t * t * 4 // 2, mem.temp_size_in_bytes


# (B, T, Hq, Hkv, D, tile, lengths, chunk): T off the tile grid, ragged rows (one shorter than a
# tile, one empty), G = 4, 1 and 3, D = 64, 128 and 256 (Gemma 3's MQA), chunks not dividing the tile count
KERNEL_CASES = [(2, 150, 4, 1, 64, 16, (150, 113), 3), (2, 97, 2, 2, 128, 32, (97, 11), None),
                (1, 70, 3, 1, 64, 16, (0,), 2), (1, 70, 4, 1, 256, 16, (61,), None)]


@pytest.mark.parametrize("b,t,hq,hkv,d,tile,lengths,chunk", KERNEL_CASES)
def test_tile_scores_kernel_matches_the_reference(b, t, hq, hkv, d, tile, lengths, chunk):
    """pallas_kernels.tile_scores (Pallas interpret mode, f32) against the materialised
    reference (tile_scores of the exact causal softmax): the same scores per chunk of
    tiles (-inf from each tile's start on, 0 for keys past a row's length), and
    anchor_selection_chunked with scores_impl="pallas" selects keys of the same total
    reference score as the reference selection (ties may order differently)."""
    from pallas_kernels.tile_scores import tile_scores_pallas, unsupported_reason

    rng = np.random.default_rng(t + tile)
    q = jnp.asarray(rng.normal(size=(b, t, hq, d)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(b, t, hkv, d)) * 1.5, jnp.float32)
    lengths = jnp.asarray(lengths, jnp.int32)
    want = np.asarray(kp.tile_scores(kp.causal_probabilities(q, k, lengths), lengths, tile, hkv))  # [B,Hkv,nt,T]
    nt = kp.num_tiles(t, tile)
    c = 4 if chunk is None else chunk
    for first in range(0, nt, c):
        got = np.asarray(tile_scores_pallas(q, k, lengths, first, tile=tile, chunk=c, interpret=True))
        n = min(c, nt - first)
        np.testing.assert_array_equal(np.isinf(got[:, :, :n]), np.isinf(want[:, :, first:first + n]))
        np.testing.assert_allclose(np.where(np.isinf(got), 0, got)[:, :, :n],
                                   np.where(np.isinf(want), 0, want)[:, :, first:first + n], rtol=2e-5, atol=2e-6)
    args = dict(tile=tile, budget=0, fraction=0.2, min_keys=24)
    ref = kp.anchor_selection_chunked(q, k, lengths, scores_impl="reference", **args)
    ker = kp.anchor_selection_chunked(q, k, lengths, scores_impl="pallas", chunk=chunk, **args)
    np.testing.assert_array_equal(np.asarray(ker["counts"]), np.asarray(ref["counts"]))
    cnt = np.asarray(ref["counts"])
    for name, sel in (("kernel", ker), ("reference", ref)):
        idx = np.asarray(sel["indices"])
        picked = np.take_along_axis(np.where(np.isinf(want), 0, want), idx, axis=-1)
        valid = np.arange(idx.shape[-1])[None, None, None, :] < cnt[:, None, :, None]
        total = np.where(valid, picked, 0).sum()
        if name == "reference":
            np.testing.assert_allclose(total_kernel, total, rtol=1e-5)
        total_kernel = total
    assert unsupported_reason(16, 32) and unsupported_reason(64, 24) and unsupported_reason(64, 32) is None
    with pytest.raises(ValueError, match="head_dim"):
        kp.anchor_selection_chunked(q[..., :16], k[..., :16], lengths, scores_impl="pallas", **args)


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
@pytest.mark.parametrize("d,g,out_len", [(128, 4, None), (128, 4, 1024), (256, 4, 512), (64, 1, 2048)])
def test_tile_scores_kernel_lowers_to_triton(abstract_h100, d, g, out_len):
    """The kernel lowers for CUDA (an abstract H100, no GPU): the inline ex2.approx, the
    transposed pass-2 dot and a truncated output row (``out_len``) are accepted by the
    Triton lowering, and the PTX instruction is in the program."""
    from pallas_kernels.tile_scores import tile_scores_pallas

    sd = jax.ShapeDtypeStruct
    q, k, lengths = sd((1, 2048, 2 * g, d), jnp.bfloat16), sd((1, 2048, 2, d), jnp.bfloat16), sd((1,), jnp.int32)
    fn = functools.partial(tile_scores_pallas, tile=32, chunk=8, out_len=out_len)
    lowered = jax.jit(fn).trace(q, k, lengths, 3).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert "__gpu$xla.gpu.triton" in text and "ex2.approx.ftz.f32" in text
    out = jax.eval_shape(fn, q, k, lengths, 3)
    assert out.shape == (1, 2, 8, 2048 if out_len is None else out_len)


@pytest.mark.parametrize("unroll", [False, True])
def test_tiled_prefill_layers_choose_the_sparse_layers(unroll, monkeypatch):
    """``tiled_prefill_layers`` (4 layers): none listed is Kascade with a dense prefill, all listed is the
    default tiled prefill, and a subset is neither (its anchors outside the set still select
    for the reuse layers after them); scanned (traced roles) and unrolled alike."""

    driver_mode(monkeypatch, unroll)
    tokens, lengths = _tokens()
    args = dict(anchors=(0, 2), tiled_prefill=True, prefill_chunk_bytes=1)  # the paper's rule: it selects
    plain = _run(_tiny_model(Kascade(anchors=(0, 2))), tokens, lengths, 3, 512)
    tiled = _run(_tiny_model(Kascade(**args)), tokens, lengths, 3, 512)
    none = _run(_tiny_model(Kascade(**args, tiled_prefill_layers=())), tokens, lengths, 3, 512)
    every = _run(_tiny_model(Kascade(**args, tiled_prefill_layers=(0, 1, 2, 3))), tokens, lengths, 3, 512)
    last = _run(_tiny_model(Kascade(**args, tiled_prefill_layers=(2,))), tokens, lengths, 3, 512)
    np.testing.assert_allclose(none, plain, atol=3e-5, rtol=0)
    np.testing.assert_allclose(every, tiled, atol=3e-5, rtol=0)
    assert np.abs(last - plain).max() > 1e-4 and np.abs(last - tiled).max() > 1e-4
    with pytest.raises(ValueError, match="tiled_prefill_layers"):
        Kascade(anchors=(0,), tiled_prefill=True, tiled_prefill_layers=(-1,)).check(
            num_q_heads=4, num_kv_heads=2, head_dim=16, max_len=64)


# unrolled only (the GPU's driver): both driver modes thread the prefill carry, traced roles
# included, in test_tiled_prefill_layers_choose_the_sparse_layers and
# test_budget_covering_the_prompt_is_dense_prefill; this one adds TSA's layers to it
@pytest.mark.parametrize("unroll", [True])
def test_tiled_prefill_composes_with_token_sparse(unroll, monkeypatch):
    """``prefill="token_sparse"`` beside the tiled prefill: Token Sparse Attention attends
    its layers (reuse layer 1 and anchor layer 2 of 4 here) and Kascade's anchor there
    still selects for the reuse layer after it (layer 3). With tau = 0 (TSA keeps every
    token: dense) it equals the tiled prefill with layers 1 and 2 outside
    ``tiled_prefill_layers``; had the TSA anchor not selected, layer 3 would reuse
    layer 0's selection and differ. Keeping half of each prefix differs from both."""
    from models import programs

    driver_mode(monkeypatch, unroll)
    tokens, lengths = _tokens()
    args = dict(anchors=(0, 2), tiled_prefill=True, prefill_chunk_bytes=1)  # the paper's rule: it selects
    tsa = (("min_tokens", 8), ("window", 16), ("layers", (1, 2)))
    exact = _run(_tiny_model(Kascade(**args, prefill="token_sparse", prefill_options=(("tau", 0.0),) + tsa)),
                 tokens, lengths, 3, 512)
    layered = _run(_tiny_model(Kascade(**args, tiled_prefill_layers=(0, 3))), tokens, lengths, 3, 512)
    np.testing.assert_allclose(exact, layered, atol=3e-5, rtol=0)
    with monkeypatch.context() as m:  # the TSA anchor passing layer 0's selection on instead
        m.setattr(Kascade, "prefill_carry", lambda self, q, k, lengths, layer, carry: carry)
        programs.build_functions.cache_clear()  # the same method's functions are cached: trace anew
        stale = _run(_tiny_model(Kascade(**args, prefill="token_sparse", prefill_options=(("tau", 0.0),) + tsa)),
                     tokens, lengths, 3, 512)
    programs.build_functions.cache_clear()
    assert np.abs(stale - layered).max() > 1e-4
    half = _run(_tiny_model(Kascade(**args, prefill="token_sparse", prefill_options=(("keep_fraction", 0.5),) + tsa)),
                tokens, lengths, 3, 512)
    assert np.all(np.isfinite(half)) and np.abs(half - layered).max() > 1e-4
    tiled = _run(_tiny_model(Kascade(**args)), tokens, lengths, 3, 512)
    assert np.abs(half - tiled).max() > 1e-4


def test_tiled_prefill_on_a_hybrid_model_runs_on_global_layers():
    """Gemma 3's layout (a tiny hybrid: local layers 0, 1, 3, 4 with a ring of 16, global
    layers 2 and 5): the tiled prefill is sparse on the global layers only. A budget covering
    the prompt equals Kascade with a dense prefill; the paper's rule selects (differs from
    it). (The composed path against the masked reference: the tests above, layer kinds apart.)"""
    import dataclasses

    import models
    from tests.test_driver import hybrid_config

    cfg = dataclasses.replace(hybrid_config(window=16), max_position=512)
    rng = np.random.default_rng(3)
    tokens = rng.integers(3, cfg.vocab_size, (2, 300)).astype(np.int32)
    lengths = np.array([300, 271], np.int32)

    def run(**opts):
        model = models.load_model(config=cfg, dtype=jnp.float32, max_len=512, attention=Kascade(anchors=(2,), **opts))
        return _run(model, tokens, lengths, 3, 512)

    plain = run(budget=512)
    np.testing.assert_allclose(run(budget=512, tiled_prefill=True), plain, atol=3e-5, rtol=0)
    rule, dense_prefill = run(tiled_prefill=True, prefill_chunk_bytes=1), run()
    assert np.all(np.isfinite(rule)) and np.abs(rule - dense_prefill).max() > 1e-4
    # the first global layer is the dense anchor (exact attention, tiled or not): listing only the
    # reuse layer is the whole tiled prefill, listing only the anchor is none of it
    np.testing.assert_allclose(run(tiled_prefill=True, prefill_chunk_bytes=1, tiled_prefill_layers=(5,)), rule,
                               atol=3e-5, rtol=0)
    np.testing.assert_allclose(run(tiled_prefill=True, prefill_chunk_bytes=1, tiled_prefill_layers=(2,)), dense_prefill,
                               atol=3e-5, rtol=0)
