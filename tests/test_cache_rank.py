"""AsyncSpade's cache rank on a second device (models.runtime.cache_rank).

The two-device cases (``tests/cache_rank_check.py``: against one device, the CLI with
--cache-rank, the two-device benchmarks) run in ``tests/test_multi_device.py``'s one
4-device process; the errors are checked here."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from models.api import Model
from models.runtime.cache_rank import CacheRankModel, packs_of
from models.config import ModelConfig
from models.transformer import init_params
from sparse_jax.methods.registry import get_method
from models.runtime.cache_rank import with_cache_rank

def _tiny(method):
    cfg = ModelConfig(name="tiny", arch="qwen3", num_layers=3, hidden_size=32, num_heads=4, num_kv_heads=2,
                      head_dim=8, intermediate_size=48, vocab_size=31, max_position=256, rope_theta=1e4,
                      rms_eps=1e-6)
    graphdef, params = init_params(cfg, jnp.float32)
    return Model(cfg, graphdef, params, None, method, jnp.float32, 128)


def test_clear_errors():
    with pytest.raises(ValueError, match="the cache rank is AsyncSpade's"):
        with_cache_rank(_tiny(get_method("quest", budget=16)))
    spade = _tiny(get_method("asyncspade", budget=16, window=2))
    with pytest.raises(ValueError, match="pack_layers must be >= 1"):
        with_cache_rank(spade, pack_layers=0)
    if len(jax.devices()) == 1:
        with pytest.raises(ValueError, match="needs a second device: jax sees 1"):
            with_cache_rank(spade)
    with pytest.raises(ValueError, match="transfer must be one of"):
        with_cache_rank(spade, transfer="nccl")
    with pytest.raises(ValueError, match="two different devices"):
        with_cache_rank(spade, devices=[jax.devices()[0]] * 2)
    from models.serving.engine import Engine

    with pytest.raises(ValueError, match="does not run AsyncSpade's cache rank"):
        Engine(CacheRankModel.__new__(CacheRankModel))  # refused before anything of it is read
    # ArkVale re-summarises the new token's whole page: the keys stay on the inference rank
    ark = _tiny(get_method("asyncspade", budget=128, window=2, selector="arkvale"))
    with pytest.raises(ValueError, match="reads `block_keys` of the key cache"):
        with_cache_rank(ark, devices=[jax.devices()[0]] * 2)


def test_packs():
    assert packs_of(5, 2) == (range(0, 2), range(2, 4), range(4, 5))
    assert packs_of(36, 6)[-1] == range(30, 36) and len(packs_of(36, 6)) == 6
    assert packs_of(3, 8) == (range(0, 3),)
