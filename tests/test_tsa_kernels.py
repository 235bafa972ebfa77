"""Token Sparse Attention's kernels: the window-scores kernel (Pallas interpret mode on
CPU) and its jnp reference against a float64 NumPy oracle on awkward sizes (T not a
multiple of any tile, W not a power of two or above a row chunk, ragged rows, L <= W,
GQA groups 1 and 4, D 64 / 128 / 256, f32 and bf16), the argument checks, the
kernel inside token_sparse_attention, and the one-sort kept_tokens against the two
argsorts it replaced (exact, ties included)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import window_scores as ws_kernel
from sparse_jax import prefill as tsa

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 5e-4}  # relative to the row's largest score


def _inputs(seed, b, t, hq, hkv, d, dtype):
    """Rounded to the test dtype first, so the oracle sees exactly the kernel's inputs."""
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(b, t, hq, d)).astype(np.float32)
    k = rng.normal(size=(b, t, hkv, d)).astype(np.float32)
    k[:, ::13] *= 2.5  # a few strong keys: scores far from uniform
    return jnp.asarray(q, dtype), jnp.asarray(k, dtype)


def oracle(q, k, lengths, w):
    """float64: the mean over the last ``w`` queries of their causal softmax, on the prefix."""
    q = np.asarray(q.astype(jnp.float32), np.float64)
    k = np.asarray(k.astype(jnp.float32), np.float64)
    b, t, hq, d = q.shape
    g = hq // k.shape[2]
    out = np.zeros((b, hq, t))
    for r in range(b):
        n = int(lengths[r])
        if n <= w:
            continue
        pos = np.arange(n - w, n)
        for h in range(hq):
            s = q[r, pos, h] @ k[r, :n, h // g].T / np.sqrt(d)  # [w, n]
            s = np.where(np.arange(n)[None, :] <= pos[:, None], s, -np.inf)
            e = np.exp(s - s.max(-1, keepdims=True))
            out[r, h, : n - w] = (e / e.sum(-1, keepdims=True)).mean(0)[: n - w]
    return out


# (B, T, Hq, Hkv, D, W, lengths, tuning): awkward on purpose
CASES = [
    pytest.param(2, 150, 4, 4, 64, 16, [150, 77], {}, id="mha-t150-d64-w16"),
    pytest.param(2, 200, 8, 2, 128, 20, [200, 131], {"num_splits": 3}, id="gqa4-t200-d128-w20-splits"),
    pytest.param(3, 90, 4, 1, 256, 16, [90, 16, 10], {}, id="gqa4-t90-d256-L<=W"),
    pytest.param(1, 300, 2, 2, 64, 70, [300], {"block_k": 32}, id="mha-t300-w70-two-chunks"),
    pytest.param(2, 100, 4, 1, 128, 8, [61, 100], {"block_q": 16, "block_k": 16, "num_splits": 4},
                 id="gqa4-t100-w8-small-tiles"),
    # 3 row chunks per head, 2 heads: pass 1 in 6 row groups (f32) / 2 (bf16) (test_row_groups)
    pytest.param(2, 260, 4, 2, 256, 130, [260, 200], {}, id="gqa2-t260-d256-w130-row-groups"),
]


def test_row_groups():
    """Pass 1's rows are cut into groups that fit the shared memory: D = 128 with 4 heads
    and W = 128 (Qwen3-8B: what compiles on the H100) stays one group; D = 256 (Gemma 3,
    4 heads: 320 KiB as one group failed on the H100) splits; the count divides the chunks."""
    assert ws_kernel.num_row_groups(8, 64, 128, 128, 2, 2) == 1
    assert ws_kernel.num_row_groups(8, 64, 64, 256, 2, 2) == 2
    assert ws_kernel.num_row_groups(6, 64, 64, 256, 4, 2) == 6  # the f32 case above
    assert ws_kernel.num_row_groups(6, 64, 64, 256, 2, 2) == 2  # 4 chunks fit; 3 is the largest divisor

DTYPES = [pytest.param(jnp.float32, id="f32"), pytest.param(jnp.bfloat16, id="bf16")]


@pytest.mark.parametrize("impl", ["pallas", "reference"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b, t, hq, hkv, d, w, lengths, tuning", CASES)
def test_window_scores_match_oracle(b, t, hq, hkv, d, w, lengths, tuning, dtype, impl):
    q, k = _inputs(hash((b, t, hq, d, w)) % 2**31, b, t, hq, hkv, d, dtype)
    lengths = np.asarray(lengths, np.int32)
    got = tsa.window_scores(q, k, jnp.asarray(lengths), w, impl=impl, **(tuning if impl == "pallas" else {}))
    assert got.shape == (b, hq, t) and got.dtype == jnp.float32
    got = np.asarray(got, np.float64)
    want = oracle(q, k, lengths, w)
    for r, n in enumerate(lengths):
        scale = max(want[r].max(), 1e-30)
        np.testing.assert_allclose(got[r], want[r], rtol=0, atol=TOL[dtype] * scale, err_msg=f"row {r}")
        assert (got[r][:, max(n - w, 0):] == 0).all()  # exactly 0 outside the prefix
    # each prefix row of probabilities sums to at most 1 (what the window queries give the prefix)
    assert (got.sum(-1) <= 1 + 1e-4).all()


def test_window_scores_kernel_under_jit_is_deterministic():
    q, k = _inputs(7, 2, 130, 4, 2, 64, jnp.bfloat16)
    lengths = jnp.asarray([130, 120], jnp.int32)
    f = jax.jit(lambda q, k, n: tsa.window_scores(q, k, n, 16, impl="pallas"))
    a, b = np.asarray(f(q, k, lengths)), np.asarray(f(q, k, lengths))
    np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(a, oracle(q, k, np.asarray(lengths), 16), rtol=0, atol=2e-3 * a.max())


def test_window_scores_argument_checks():
    q, k = _inputs(0, 2, 40, 4, 2, 64, jnp.float32)
    n = jnp.asarray([40, 30], jnp.int32)
    ws = tsa.window_scores
    with pytest.raises(ValueError, match="rank 4"):
        ws(q[0], k, n, 8)
    with pytest.raises(ValueError, match="k must have shape"):
        ws(q, k[:, :30], n, 8)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        ws(q[:, :, :3], k, n, 8)
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        ws(q.astype(jnp.int32), k, n, 8)
    with pytest.raises(TypeError, match="integer"):
        ws(q, k, n.astype(jnp.float32), 8)
    with pytest.raises(ValueError, match="lengths must have shape"):
        ws(q, k, n[:1], 8)
    for bad in (0, -1, True, 8.0):
        with pytest.raises(ValueError, match="window must be a positive int"):
            ws(q, k, n, bad)
    with pytest.raises(ValueError, match="impl must be one of"):
        ws(q, k, n, 8, impl="triton")
    with pytest.raises(ValueError, match="unknown tuning keys"):
        ws(q, k, n, 8, impl="pallas", block_n=64)
    with pytest.raises(ValueError, match="block_q must be a power of two"):
        ws(q, k, n, 8, impl="pallas", block_q=24)


@pytest.mark.parametrize("d", [16, 32, 96, 512])
def test_unsupported_head_dim_refused_or_falls_back(d, monkeypatch):
    q, k = _inputs(1, 1, 40, 2, 1, d, jnp.float32)
    n = jnp.asarray([40], jnp.int32)
    with pytest.raises(ValueError, match="head_dim"):
        tsa.window_scores(q, k, n, 8, impl="pallas")
    # "auto" on a GPU falls back to the reference (never reaches the kernel)
    monkeypatch.setattr("sparse_jax.ops._dispatch.on_gpu", lambda: True)
    monkeypatch.setattr(ws_kernel, "window_scores_pallas", lambda *a, **kw: pytest.fail("kernel called"))
    got = tsa.window_scores(q, k, n, 8, impl="auto")
    np.testing.assert_allclose(np.asarray(got), oracle(q, k, [40], 8), rtol=1e-4, atol=1e-7)


def test_mixed_dtypes_refused_by_the_kernel_only():
    q, k = _inputs(2, 1, 40, 2, 1, 64, jnp.float32)
    n = jnp.asarray([40], jnp.int32)
    with pytest.raises(ValueError, match="one dtype"):
        tsa.window_scores(q, k.astype(jnp.bfloat16), n, 8, impl="pallas")
    got = tsa.window_scores(q, k.astype(jnp.bfloat16), n, 8, impl="auto")
    assert got.shape == (1, 2, 40)


def test_token_sparse_attention_unchanged_with_the_kernel():
    """The whole TSA prefill (f32, D=64, ragged rows): the kernel's scores select the
    same tokens as the reference's, so the output is the same."""
    rng = np.random.default_rng(3)
    b, t, hq, hkv, d = 2, 150, 4, 2, 64
    q, k = _inputs(3, b, t, hq, hkv, d, jnp.float32)
    v = jnp.asarray(rng.normal(size=(b, t, hkv, d)), jnp.float32)
    lengths = jnp.asarray([150, 131], jnp.int32)
    opts = dict(tau=0.2, min_tokens=20, window=16, pool=7)
    outs, kepts = [], []
    for si in ("reference", "pallas"):
        s = tsa.smooth(tsa.window_scores(q, k, lengths, 16, impl=si), 7)
        keep = tsa.keep_counts(s, lengths, tau=0.2, min_tokens=20, window=16)
        kepts.append(np.asarray(tsa.kept_tokens(s, keep, lengths, 16)))
        outs.append(np.asarray(tsa.token_sparse_attention(q, k, v, lengths, scores_impl=si, **opts)))
    np.testing.assert_array_equal(kepts[0], kepts[1])
    assert 0.1 < 1 - kepts[0][0].mean() < 0.9  # it does drop tokens
    np.testing.assert_allclose(outs[1], outs[0], rtol=0, atol=1e-6)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kept_tokens_one_sort_equals_the_argsorts(seed):
    """Exact, ties included (lower position first): scores drawn from few values, keep
    from 0 to past the prefix, rows with L <= W."""
    rng = np.random.default_rng(seed)
    b, hq, t, w = 5, 3, 64, 8
    scores = rng.integers(0, 4, size=(b, hq, t)).astype(np.float32) / 4  # many ties
    scores[1] = rng.random((hq, t))  # no ties
    lengths = np.asarray([64, 50, 8, 3, 33], np.int32)
    prefix = np.maximum(lengths - w, 0)
    for keep in (np.zeros(b), prefix, np.minimum(prefix, 1), prefix // 2, prefix + 5,
                 rng.integers(0, 60, b)):
        args = (jnp.asarray(scores), jnp.asarray(keep, jnp.int32), jnp.asarray(lengths), w)
        got = np.asarray(tsa.kept_tokens(*args))
        np.testing.assert_array_equal(got, np.asarray(tsa.kept_tokens_argsort(*args)))
        # per head: min(keep, prefix) prefix tokens and the whole window
        np.testing.assert_array_equal(got[:, :, :].sum(-1),
                                      (np.minimum(keep, prefix) + lengths - prefix)[:, None].repeat(hq, 1))


def test_compress_order_equals_the_stable_argsort():
    rng = np.random.default_rng(4)
    kept = rng.random((3, 4, 77)) < np.asarray([0.0, 0.3, 1.0])[:, None, None]  # none, some, all kept
    kept[1, 2, -1] = True
    got = np.asarray(tsa.compress_order(jnp.asarray(kept)))
    np.testing.assert_array_equal(got, np.argsort(~kept, axis=-1, kind="stable"))


def chunk_oracle(q, k, start, length, w, prefix):
    """float64: the mean over the chunk's window rows that have a query (positions >= start)
    of their causal softmax, on keys ``[0, prefix)``; ``q`` holds positions start.. only."""
    q = np.asarray(q.astype(jnp.float32), np.float64)
    k = np.asarray(k.astype(jnp.float32), np.float64)
    b, _, hq, d = q.shape
    g = hq // k.shape[2]
    out = np.zeros((b, hq, k.shape[1]))
    live = [p for p in range(length - w, length) if p >= start]
    for h in range(hq):
        for p in live:
            s = k[0, :p + 1, h // g] @ q[0, p - start, h] / np.sqrt(d)
            e = np.exp(s - s.max())
            out[0, h, :p + 1] += e / e.sum() / len(live)
    out[:, :, prefix:] = 0
    return out


# (T keys, chunk C, start, the prompt's length, W, D): a full chunk, a short last chunk whose
# window reaches before it (rows without a query), a first chunk (nothing scored), T not a
# multiple of any tile
CHUNK_CASES = [
    pytest.param(700, 96, 300, 700, 32, 64, id="full-chunk"),
    pytest.param(530, 64, 448, 470, 32, 128, id="short-last-chunk"),
    pytest.param(300, 64, 0, 50, 16, 64, id="first-chunk"),
]


@pytest.mark.parametrize("impl", ["pallas", "reference"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t, c, start, length, w, d", CHUNK_CASES)
def test_window_scores_of_a_chunk_match_oracle(t, c, start, length, w, d, dtype, impl):
    """The op with ``q_start`` / ``prefix`` (a chunk's queries only, its prefix's keys scored),
    kernel in interpret mode and reference, against float64; and chunk_window_scores through the
    kernel equal to its jnp form (what the engine's chunked TSA runs on a GPU)."""
    rng = np.random.default_rng(t + c)
    q = jnp.asarray(rng.standard_normal((1, c, 8, d)), dtype)
    k = np.asarray(rng.standard_normal((1, t, 2, d)), np.float32)
    k[:, ::11] *= 2.5
    k = jnp.asarray(k, dtype)
    end = min(start + c, length)
    got = tsa.window_scores(q, k, jnp.asarray([end], jnp.int32), w, q_start=jnp.int32(start),
                            prefix=jnp.asarray([start], jnp.int32), impl=impl)
    want = chunk_oracle(q, k, start, end, w, start)
    scale = max(want.max(), 1e-30)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=0, atol=TOL[dtype] * scale)
    assert (np.asarray(got)[:, :, start:] == 0).all()
    chunk = tsa.chunk_window_scores(q, k, jnp.int32(start), jnp.asarray([length], jnp.int32), w, tile=128,
                                    impl=impl)
    np.testing.assert_allclose(np.asarray(chunk, np.float64), want, rtol=0, atol=TOL[dtype] * scale)


def test_window_scores_chunk_argument_checks():
    q, k = _inputs(0, 1, 64, 4, 2, 64, jnp.float32)
    n = jnp.asarray([64], jnp.int32)
    with pytest.raises(ValueError, match="T >= 64"):
        tsa.window_scores(q, k[:, :32], n, 8, q_start=0)
    with pytest.raises(ValueError, match="prefix"):
        tsa.window_scores(q, k, n, 8, q_start=0, prefix=jnp.asarray([1, 2], jnp.int32))
    with pytest.raises(ValueError, match="k must have shape \\[B=1, T=32"):  # without q_start, q holds every position
        tsa.window_scores(q[:, :32], k, n, 8)
