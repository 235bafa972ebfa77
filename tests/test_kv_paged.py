"""The paged KV view (sparse_jax.kv.PagedKV) answers every question the contiguous view
(ResidentKV) answers, with the same numbers: each row's pages scattered through one pool by a
random block table (a short row padded with the null page), ragged lengths, and selections of
every kind (all, blocks of the page's size and smaller, tokens), reference and Pallas
(interpret mode)."""

import jax.numpy as jnp
import numpy as np
import pytest

from sparse_jax.kv import PagedKV, ResidentKV
from sparse_jax.selection import Selection

B, HQ, HKV, D, PAGE, W = 3, 8, 2, 32, 16, 6
S = W * PAGE


@pytest.fixture(scope="module")
def views():
    rng = np.random.default_rng(0)
    k = rng.standard_normal((B, HKV, S, D)).astype(np.float32)
    v = rng.standard_normal((B, HKV, S, D)).astype(np.float32)
    pages = B * W + 3
    table = rng.permutation(np.arange(1, pages))[:B * W].reshape(B, W).astype(np.int32)
    lengths = np.array([S, S - 5, 2 * PAGE + 1], np.int32)
    table[2, 3:] = 0  # row 2 holds 3 pages (its 33 tokens); the rest of its table is the null page
    pool_k = rng.standard_normal((1, HKV, pages * PAGE, D)).astype(np.float32)  # garbage where no row lives
    pool_v = rng.standard_normal((1, HKV, pages * PAGE, D)).astype(np.float32)
    for b in range(B):
        for j in range(W):
            if table[b, j]:
                rows = slice(table[b, j] * PAGE, (table[b, j] + 1) * PAGE)
                pool_k[0, :, rows], pool_v[0, :, rows] = k[b, :, j * PAGE:(j + 1) * PAGE], v[b, :, j * PAGE:(j + 1) * PAGE]
    q = jnp.asarray(rng.standard_normal((B, HQ, D)).astype(np.float32))
    return (q, jnp.asarray(lengths), ResidentKV(jnp.asarray(k), jnp.asarray(v)),
            PagedKV(jnp.asarray(pool_k), jnp.asarray(pool_v), jnp.asarray(table), PAGE), rng)


def _selections(rng, lengths):
    nb = -(-np.asarray(lengths) // PAGE)
    pick = np.stack([np.stack([rng.permutation(W)[:4] for _ in range(HKV)]) for _ in range(B)]).astype(np.int32)
    counts = np.minimum(rng.integers(1, 5, (B, HKV)), nb[:, None]).astype(np.int32)
    small = np.stack([np.stack([rng.permutation(2 * W)[:5] for _ in range(HKV)]) for _ in range(B)]).astype(np.int32)
    toks = np.stack([np.stack([rng.permutation(int(n))[:20] if n >= 20 else np.r_[np.arange(n), np.zeros(20 - n)]
                               for _ in range(HKV)]) for n in np.asarray(lengths)]).astype(np.int32)
    return {"all": Selection.all_tokens(),
            "blocks of a page": Selection.blocks(jnp.asarray(pick), jnp.asarray(counts), PAGE),
            "blocks of half a page": Selection.blocks(jnp.asarray(small), jnp.asarray(counts + 1), PAGE // 2),
            "tokens": Selection.tokens(jnp.asarray(toks), jnp.asarray(np.minimum(20, np.asarray(lengths))[:, None]
                                                                      .repeat(HKV, 1).astype(np.int32)))}


@pytest.mark.parametrize("impl", ["reference", "pallas"])
def test_paged_view_attends_as_the_contiguous_view(views, impl):
    q, lengths, flat, paged, rng = views
    assert paged.capacity == flat.capacity and paged.num_kv_heads == flat.num_kv_heads
    for name, sel in _selections(rng, lengths).items():
        want = flat.attend(q, lengths, sel, impl=impl)
        got = paged.attend(q, lengths, sel, impl=impl)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5, err_msg=name)


def test_paged_view_reads_keys_as_the_contiguous_view(views):
    _, lengths, flat, paged, _ = views
    newest = lengths - 1
    np.testing.assert_array_equal(np.asarray(paged.newest_keys(newest)), np.asarray(flat.newest_keys(newest)))
    for bs in (PAGE, PAGE // 4, 2 * PAGE, 3):  # within a page, across two, and not aligned to pages
        blocks = newest // bs
        # positions past a row's length differ (the contiguous cache holds noise there, a paged
        # row's unused table entries the null page): every reader masks them
        pos = np.asarray(blocks)[:, None] * bs + np.arange(bs)
        valid = (pos < np.asarray(lengths)[:, None])[:, None, :, None]
        np.testing.assert_array_equal(np.where(valid, np.asarray(paged.block_keys(blocks, bs)), 0),
                                      np.where(valid, np.asarray(flat.block_keys(blocks, bs)), 0))
