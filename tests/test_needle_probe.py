"""The needle probe (``benchmarks/needle_probe.py``) on a tiny random model: its records are in
range, a selection that covers the context recalls the whole needle, and the needle is placed by
the tokenizer's offsets (a prepended BOS shifts it)."""

from __future__ import annotations

import types

import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import needle_probe as npb

_CHANNELS = (tuple(tuple(range(h, 16, 4)) for h in range(2)),) * 3


@pytest.fixture(scope="module")
def tiny():
    import models
    from models.config import ModelConfig

    cfg = ModelConfig(name="tiny-needle", arch="llama", num_layers=3, hidden_size=48, num_heads=4, num_kv_heads=2,
                      head_dim=16, intermediate_size=80, vocab_size=97, max_position=256, rope_theta=1e4,
                      rms_eps=1e-6, tie_embeddings=True, eos_token_id=3)
    return models.load_model(config=cfg, dtype=jnp.float32)


def test_probe_records_where_the_needle_stands(tiny):
    from sparse_jax.methods import get_method

    ids = np.random.default_rng(0).integers(5, 97, 150)
    needle = (40, 41, 42)
    small = get_method("asynctls", budget=32, block_size=16, kb=3, channels_per_layer=_CHANNELS)
    rows = npb.probe_prompt(tiny, small, ids, needle, steps=3, index=7)
    assert [(r["step"], r["layer"]) for r in rows] == [(0, 2), (1, 2), (2, 2)]  # layers 0-1 dense
    for r in rows:
        assert r["index"] == 7 and 0 < r["mass"] < 1 and 0 <= r["block_rank"] < 150 // 16
        assert r["in_selection"] in (0.0, 1 / 3, 2 / 3, 1.0) and 0 <= r["block_rank_max_heads"] < 150 // 16
    # the needle's one block (40-42) ranked past the kb - 1 = 2 the filter keeps: none of it is selected
    outside = [r for r in rows if r["block_rank"] >= 2]
    assert outside and all(r["in_selection"] == 0.0 for r in outside)
    whole = get_method("asynctls", budget=256, block_size=16, kb=16, channels_per_layer=_CHANNELS)
    rows = npb.probe_prompt(tiny, whole, ids, needle, steps=2)
    assert all(r["in_selection"] == 1.0 for r in rows)
    summary = npb.summarize(rows, kept_ranks=15)
    # kb=16 keeps every one of the 9 blocks: 8-bit boxes cannot change the filter's set
    assert all(r["filter_overlap_q"] == 1.0 and 0 <= r["block_rank_q"] < 150 // 16 for r in rows)
    assert summary == [{"index": 0, "layer": 2, "steps": 2, "mean_mass": pytest.approx(np.mean([r["mass"] for r in rows])),
                        "worst_block_rank": max(r["block_rank"] for r in rows),
                        "worst_rank_max_heads": max(r["block_rank_max_heads"] for r in rows), "steps_outside_filter": 0,
                        "mean_in_selection": 1.0, "worst_rank_q": max(r["block_rank_q"] for r in rows),
                        "min_filter_overlap_q": 1.0}]
    rows = npb.probe_prompt(tiny, small, ids, needle, steps=1, box_bits=0)
    assert "block_rank_q" not in rows[0] and "worst_rank_q" not in npb.summarize(rows, kept_ranks=2)[0]


def test_quantized_boxes_contain_the_originals_and_keep_the_bound():
    """Codes over each (batch, head, channel)'s range: every dequantized box contains its original
    (max rounded up, min down), so the Quest bound of any query only grows; at 8 bits the boxes
    move by at most one code step; a channel constant over the blocks survives exactly."""
    from sparse_jax.ops.scoring import quest_block_scores

    rng = np.random.default_rng(3)
    lower = (rng.normal(size=(2, 3, 40, 16)) * rng.uniform(0.1, 30, size=(1, 1, 1, 16))).astype(np.float32)
    upper = (lower + rng.uniform(0, 5, size=lower.shape)).astype(np.float32)
    lower[..., 5] = upper[..., 5] = 2.5  # a constant channel
    up_q, lo_q = (np.asarray(x) for x in npb.quantized_boxes(jnp.asarray(upper), jnp.asarray(lower), 8))
    assert (up_q >= upper).all() and (lo_q <= lower).all()
    step = (upper.max(2, keepdims=True) - lower.min(2, keepdims=True)) / 255
    assert (up_q - upper <= step * 1.0001 + 1e-6).all() and (lower - lo_q <= step * 1.0001 + 1e-6).all()
    np.testing.assert_array_equal(up_q[..., 5], upper[..., 5])
    q = jnp.asarray(rng.normal(size=(2, 6, 16)).astype(np.float32))
    exact = np.asarray(quest_block_scores(q, jnp.asarray(upper), jnp.asarray(lower), impl="reference"))
    loose = np.asarray(quest_block_scores(q, jnp.asarray(up_q), jnp.asarray(lo_q), impl="reference"))
    assert (loose >= exact - 1e-4 * np.abs(exact).max()).all()
    # the filter overlap: identical bounds keep every block, a reversed ranking keeps none
    e = jnp.asarray(exact)
    assert (np.asarray(npb.filter_overlap(e, e, 10)) == 1.0).all()
    assert (np.asarray(npb.filter_overlap(e, -e, 10)) == 0.0).all()
    masked = e.at[..., 5:].set(-jnp.inf)  # 5 live blocks, fewer than the filter keeps: all kept
    assert (np.asarray(npb.filter_overlap(masked, -e, 10)) == 1.0).all()


def test_needle_positions_follow_the_offsets():
    enc = types.SimpleNamespace(ids=[10, 11, 12, 13], offsets=[(0, 3), (3, 5), (5, 7), (7, 9)])
    tok = types.SimpleNamespace(backend=types.SimpleNamespace(encode=lambda s: enc))
    assert npb.needle_positions(tok, "abc1234xy", [10, 11, 12, 13], "1234") == (1, 2)
    assert npb.needle_positions(tok, "abc1234xy", [2, 10, 11, 12, 13], "1234") == (2, 3)  # a BOS first
    with pytest.raises(ValueError, match="differs"):
        npb.needle_positions(tok, "abc1234xy", [10, 11, 99, 13], "1234")
    with pytest.raises(ValueError, match="not in the prompt"):
        npb.needle_positions(tok, "abc1234xy", [10, 11, 12, 13], "777")
