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
    assert summary == [{"index": 0, "layer": 2, "steps": 2, "mean_mass": pytest.approx(np.mean([r["mass"] for r in rows])),
                        "worst_block_rank": max(r["block_rank"] for r in rows),
                        "worst_rank_max_heads": max(r["block_rank_max_heads"] for r in rows), "steps_outside_filter": 0,
                        "mean_in_selection": 1.0}]


def test_needle_positions_follow_the_offsets():
    enc = types.SimpleNamespace(ids=[10, 11, 12, 13], offsets=[(0, 3), (3, 5), (5, 7), (7, 9)])
    tok = types.SimpleNamespace(backend=types.SimpleNamespace(encode=lambda s: enc))
    assert npb.needle_positions(tok, "abc1234xy", [10, 11, 12, 13], "1234") == (1, 2)
    assert npb.needle_positions(tok, "abc1234xy", [2, 10, 11, 12, 13], "1234") == (2, 3)  # a BOS first
    with pytest.raises(ValueError, match="differs"):
        npb.needle_positions(tok, "abc1234xy", [10, 11, 99, 13], "1234")
    with pytest.raises(ValueError, match="not in the prompt"):
        npb.needle_positions(tok, "abc1234xy", [10, 11, 12, 13], "777")
