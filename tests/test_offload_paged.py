"""The offloaded KV on a paged host tier (issue 49): ``TieredRunner(host_pages=N)`` keeps each
offloaded layer's host blocks in a pool of pages shared by the rows through a block table, and
decodes exactly as the contiguous host tier does (greedy tokens equal, logits within 1e-5, on
scattered pages, across block completions); the engine on it (``Engine(paged=True,
offload=True)``) gives every request its tokens alone, frees and reuses pages, and preempts
when the host pages run out. CPU, f32, tiny random models."""

from __future__ import annotations

import numpy as np
import pytest

from models.runtime import tiered
from models.runtime.tiered import HostPages, OutOfHostPages, TieredRunner
from tests.test_offload import _ragged_tokens, _resident_run, _tiny_model

MAX_LEN = 256


def _scattered_pages(monkeypatch, seed=0):
    """The runner's own pages handed out in a random order (not one run per row)."""
    real = HostPages.__init__

    def init(self, *a, **k):
        real(self, *a, **k)
        if self.free is not None:
            np.random.default_rng(seed).shuffle(self.free)

    monkeypatch.setattr(HostPages, "__init__", init)


def _pages_needed(lengths, steps, bs):
    """Pages a batch holds after ``steps`` steps: each row's blocks up to the last position written."""
    return int(sum((int(n) + steps - 1) // bs + 1 for n in lengths))


def _check_paged_equals_contiguous(model, pool, steps, monkeypatch, seed):
    tokens, lengths = _ragged_tokens(seed)
    ref_ids, ref_logits, _ = TieredRunner(model, "offload", pool_slots=pool).generate_ids(tokens, lengths, steps,
                                                                                        MAX_LEN)
    bs = model.method.for_offload().offload_block_size
    need = _pages_needed(lengths, steps, bs)
    _scattered_pages(monkeypatch, seed)
    runner = TieredRunner(model, "offload", pool_slots=pool, host_pages=need + 1)  # exactly enough, and the null page
    ids, lg, state = runner.generate_ids(tokens, lengths, steps, MAX_LEN)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(ref_ids))
    np.testing.assert_allclose(np.asarray(lg), np.asarray(ref_logits), atol=1e-5, rtol=0)
    # the host holds the blocks that exist: every page given out, the table a prefix per row
    assert len(state.pages.free) == 0 and state.pages.held().sum() == need
    hosts = [h for h in state.host if h is not None]
    assert hosts and all(h.paged and h.k.shape[0] == need + 1 and h.k.sharding.memory_kind == "pinned_host"
                         for h in hosts)
    assert sum(runner.transfer_stats(state)["misses_per_step"][1:]) > 0  # blocks came back from the pages
    contiguous = 3 * MAX_LEN // bs  # blocks per layer of the contiguous tier
    assert need + 1 < contiguous
    # dropping the saves of completed blocks breaks it (the test can fail)
    runner = TieredRunner(model, "offload", pool_slots=pool, host_pages=need + 1)
    runner._store_pending = lambda state: state.pending.clear()
    _, lg, _ = runner.generate_ids(tokens, lengths, steps, MAX_LEN)
    assert np.abs(np.asarray(lg) - np.asarray(ref_logits)).max() > 1e-2
    return ref_ids, ref_logits, tokens, lengths


def test_paged_host_tier_equals_contiguous_quest(monkeypatch):
    """Quest (the synchronous fetch path), the smallest pool (evictions every step), a ragged
    batch whose rows complete blocks of 8 while decoding: the paged host tier gives the
    contiguous tier's tokens and logits, and those are the resident model's."""
    from sparse_jax.methods import get_method

    model = _tiny_model(get_method("quest", budget=64, block_size=8, dense_layers=(0,)))
    ids, logits, tokens, lengths = _check_paged_equals_contiguous(model, 8, 20, monkeypatch, seed=5)
    res_ids, res_logits = _resident_run(model, tokens, lengths, 20, MAX_LEN)
    np.testing.assert_array_equal(np.asarray(ids), res_ids)
    np.testing.assert_allclose(np.asarray(logits), res_logits, atol=1e-5, rtol=0)


def test_paged_host_tier_equals_contiguous_asynctls_lag(monkeypatch):
    """AsyncTLS with its one-step lag (the prefetch path) on the smallest pool."""
    from sparse_jax.methods import get_method

    chans = ((tuple(range(0, 16, 4)), tuple(range(1, 16, 4))),) * 3
    model = _tiny_model(get_method("asynctls", channels_per_layer=chans, budget=32, block_size=8, kb=8, lag=True,
                                   dense_layers=(0,)))
    _check_paged_equals_contiguous(model, 7, 20, monkeypatch, seed=7)


def test_paged_host_tier_refuses_on_the_host():
    """Bad options, a pool too small for the prompts, and a caller's table that misses a page a
    step needs: errors on the host, before anything runs on the device."""
    from sparse_jax.methods import get_method

    model = _tiny_model(get_method("quest", budget=64, block_size=8, dense_layers=(0,)))
    for bad in (1, 0, True, 2.5):
        with pytest.raises(ValueError, match="host_pages must be an int >= 2"):
            TieredRunner(model, "offload", host_pages=bad)
    with pytest.raises(ValueError, match='mode="offload"'):
        TieredRunner(model, "resident", host_pages=8)
    tokens, lengths = _ragged_tokens(5)
    with pytest.raises(OutOfHostPages, match="more host pages"):
        TieredRunner(model, "offload", host_pages=20).prefill(tokens, lengths, MAX_LEN)  # 12 + 8 + 10 blocks
    # the caller keeps the table (a serving engine): a row without its pages cannot step
    runner = TieredRunner(model, "offload", host_pages=40)
    bs = runner.method.offload_block_size
    pages = HostPages(40, 3, MAX_LEN // bs, own=False)

    def kv(i):
        import jax.numpy as jnp
        shape = (3, 2, MAX_LEN, 16)
        return jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32), jnp.zeros((3, 4, 16), jnp.float32)

    state = runner.state_from_kv(kv, np.ones(3, np.int32), MAX_LEN, pages=pages)
    assert state.pages is pages and not pages.dirty
    pages.set_row(1, np.r_[[5], np.zeros(MAX_LEN // bs - 1, np.int32)])
    with pytest.raises(ValueError, match=r"rows \[0\] step without the host pages"):
        runner.decode_step(np.zeros(3, np.int32), state, active=np.array([True, True, False]))
    assert pages.dirty  # nothing was sent
    tiered.TieredRunner.finish(runner, state)
