"""Hugging Face-style model directories: ``config.json`` + ``*.safetensors``
(+ ``tokenizer.json`` / ``tokenizer_config.json`` when a tokenizer is saved).

Tensor names and layouts are the ``transformers`` ones (``model.embed_tokens.weight``,
``model.layers.N.self_attn.q_proj.weight [out, in]``, ``lm_head.weight``, ...), so
a directory written here loads in ``transformers`` and a Llama / Qwen3
checkpoint directory loads here. This module also holds the name mapping
between those tensors and the NNX params, which the GGUF loader reuses.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Mapping, NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx, traverse_util

from models.config import ModelConfig, RopeScaling
from models.tokenizer import Tokenizer
from models.transformer import abstract_model

_HF_ARCH = {"llama": ("LlamaForCausalLM", "llama"), "qwen3": ("Qwen3ForCausalLM", "qwen3")}
_DTYPE_NAMES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


# -----------------------------------------------------------------------------
# Names: NNX param path <-> HF tensor name
# -----------------------------------------------------------------------------


def hf_name(path: tuple, layer: int | None = None) -> tuple[str, bool]:
    """HF tensor name for an NNX param path, and whether the array is transposed
    (NNX ``kernel [in, out]`` vs HF ``weight [out, in]``). The decoder layers are
    stacked (``layers.self_attn.q_proj.kernel [L, in, out]``): give ``layer`` to
    name one row (``model.layers.{layer}.self_attn.q_proj.weight``)."""
    parts = [str(p) for p in path]
    transpose = parts[-1] == "kernel"
    if transpose:
        parts[-1] = "weight"
    if parts[0] == "layers":
        if layer is None:
            raise ValueError(f"param {'.'.join(parts)} is stacked over layers: give the layer index")
        parts.insert(1, str(layer))
    prefix = [] if parts[0] == "lm_head" else ["model"]
    return ".".join(prefix + parts), transpose


def _is_stacked(path: tuple) -> bool:
    return str(path[0]) == "layers"


def _np_dtype(dtype) -> np.dtype:
    dtype = jnp.dtype(dtype)
    return np.dtype(ml_dtypes.bfloat16) if dtype == jnp.bfloat16 else np.dtype(dtype)


def hf_tensors_to_params(tensors: Mapping[str, np.ndarray], cfg: ModelConfig, dtype=jnp.bfloat16) -> nnx.State:
    """NNX params (placed on the default device in ``dtype``) from HF-named arrays.

    Raises ValueError naming the first missing tensor or wrong shape. Extra
    tensors (``rotary_emb.inv_freq``; ``lm_head.weight`` of a tied model) are ignored.
    """
    _, abstract = abstract_model(cfg, dtype)
    flat = traverse_util.flatten_dict(nnx.to_pure_dict(abstract))
    np_dtype = _np_dtype(dtype)
    out = {}
    for path, spec in flat.items():
        if _is_stacked(path):  # one HF tensor per layer, stacked on a leading axis
            rows = [_hf_tensor(tensors, path, i, spec.shape[1:], cfg) for i in range(spec.shape[0])]
            arr = np.stack([r.astype(np_dtype, copy=False) for r in rows])
        else:
            arr = _hf_tensor(tensors, path, None, spec.shape, cfg).astype(np_dtype, copy=False)
        out[path] = jax.device_put(np.ascontiguousarray(arr))
    nnx.replace_by_pure_dict(abstract, traverse_util.unflatten_dict(out))
    return abstract


def _hf_tensor(tensors: Mapping[str, np.ndarray], path: tuple, layer: int | None, shape: tuple,
               cfg: ModelConfig) -> np.ndarray:
    name, transpose = hf_name(path, layer)
    if name not in tensors:
        raise ValueError(f"tensor {name!r} missing from the weights (model {cfg.name!r}, "
                         f"{cfg.num_layers} layers)")
    arr = np.asarray(tensors[name])
    if transpose:
        arr = arr.T
    if tuple(arr.shape) != tuple(shape):
        raise ValueError(f"tensor {name!r} has shape {tuple(np.asarray(tensors[name]).shape)}, "
                         f"the config needs {tuple(shape)[::-1] if transpose else tuple(shape)}")
    return arr


def params_to_hf_tensors(params: nnx.State) -> dict[str, np.ndarray]:
    """HF-named host arrays (``[out, in]`` weights) from NNX params."""
    pure = nnx.to_pure_dict(params) if isinstance(params, nnx.State) else params
    out = {}
    for path, arr in traverse_util.flatten_dict(pure).items():
        a = np.asarray(jax.device_get(arr))
        rows = [(i, a[i]) for i in range(a.shape[0])] if _is_stacked(path) else [(None, a)]
        for i, r in rows:
            name, transpose = hf_name(path, i)
            out[name] = np.ascontiguousarray(r.T if transpose else r)
    return out


# -----------------------------------------------------------------------------
# config.json
# -----------------------------------------------------------------------------


def config_to_hf(cfg: ModelConfig, dtype=None) -> dict:
    if cfg.arch not in _HF_ARCH:
        # Gemma 3: our norm weights are HF's 1 + w, and the config needs its layer
        # pattern and scalars; no exporter yet
        raise NotImplementedError(f"writing an HF directory for arch {cfg.arch!r} is not supported "
                                  f"(supported: {', '.join(_HF_ARCH)})")
    arch, model_type = _HF_ARCH[cfg.arch]
    d = {
        "architectures": [arch],
        "model_type": model_type,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_heads,
        "num_hidden_layers": cfg.num_layers,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position,
        "rms_norm_eps": cfg.rms_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": cfg.tie_embeddings,
        "vocab_size": cfg.vocab_size,
        "attention_bias": False,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id,
        "sparse_jax_name": cfg.name,
    }
    if cfg.arch == "llama":
        d["mlp_bias"] = False
    if cfg.rope_scaling is not None:
        rs = cfg.rope_scaling
        d["rope_scaling"] = {"rope_type": rs.rope_type, "factor": rs.factor, "low_freq_factor": rs.low_freq_factor,
                             "high_freq_factor": rs.high_freq_factor,
                             "original_max_position_embeddings": rs.original_max_position}
    if dtype is not None:
        d["torch_dtype"] = jnp.dtype(dtype).name
    return d


def config_from_hf(d: dict, name: str | None = None) -> ModelConfig:
    mt = d.get("model_type")
    arch = {"llama": "llama", "qwen3": "qwen3", "mistral": "llama"}.get(mt)
    if arch is None:
        raise ValueError(f"unsupported model_type {mt!r} in config.json (supported: llama, qwen3)")
    if d.get("attention_bias") or d.get("mlp_bias"):
        raise ValueError("attention/MLP biases are not supported")
    heads = d["num_attention_heads"]
    rs = d.get("rope_scaling")
    scaling = None
    if rs:
        kind = rs.get("rope_type", rs.get("type"))
        if kind not in ("llama3", "default"):
            raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: llama3)")
        if kind == "llama3":
            scaling = RopeScaling(factor=float(rs["factor"]), low_freq_factor=float(rs["low_freq_factor"]),
                                  high_freq_factor=float(rs["high_freq_factor"]),
                                  original_max_position=int(rs["original_max_position_embeddings"]))

    def first(v):
        return v[0] if isinstance(v, (list, tuple)) else v

    return ModelConfig(
        name=name or d.get("sparse_jax_name") or d.get("_name_or_path") or mt,
        arch=arch,
        num_layers=d["num_hidden_layers"],
        hidden_size=d["hidden_size"],
        num_heads=heads,
        num_kv_heads=d.get("num_key_value_heads", heads),
        head_dim=d.get("head_dim") or d["hidden_size"] // heads,
        intermediate_size=d["intermediate_size"],
        vocab_size=d["vocab_size"],
        max_position=d.get("max_position_embeddings", 4096),
        rope_theta=float(d.get("rope_theta", 10000.0)),
        rms_eps=float(d.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(d.get("tie_word_embeddings", False)),
        rope_scaling=scaling,
        bos_token_id=first(d.get("bos_token_id")),
        eos_token_id=first(d.get("eos_token_id")),
        pad_token_id=first(d.get("pad_token_id")),
    )


# -----------------------------------------------------------------------------
# Directories
# -----------------------------------------------------------------------------


class HFModel(NamedTuple):
    config: ModelConfig
    params: nnx.State
    tokenizer: Tokenizer | None


def is_hf_directory(path) -> bool:
    return (os.path.isdir(path) and os.path.exists(os.path.join(path, "config.json"))
            and bool(glob.glob(os.path.join(path, "*.safetensors"))))


def save_hf_directory(params: nnx.State, config: ModelConfig, path: str | os.PathLike,
                      tokenizer: Tokenizer | None = None) -> None:
    """Write ``config.json`` + ``model.safetensors`` (and the tokenizer files when given)."""
    from safetensors.numpy import save_file

    os.makedirs(path, exist_ok=True)
    tensors = params_to_hf_tensors(params)
    dtype = next(iter(tensors.values())).dtype
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config_to_hf(config, dtype), f, indent=2)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save_hf(path)


def load_hf_directory(path: str | os.PathLike, dtype=None, name: str | None = None) -> HFModel:
    """Read an HF-style directory: its config, params (in ``dtype``; default the
    stored ``torch_dtype``, else float32) and tokenizer (None if absent)."""
    from safetensors import safe_open

    if not os.path.isdir(path):
        raise FileNotFoundError(f"no such model directory: {path}")
    cfg_path = os.path.join(path, "config.json")
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not os.path.exists(cfg_path) or not files:
        raise FileNotFoundError(f"{path} is not an HF-style model directory (needs config.json and *.safetensors)")
    with open(cfg_path) as f:
        hf = json.load(f)
    cfg = config_from_hf(hf, name=name)
    if dtype is None:
        dtype = _DTYPE_NAMES.get(hf.get("torch_dtype") or hf.get("dtype"), jnp.float32)
    tensors = {}
    for fn in files:
        with safe_open(fn, framework="np") as f:
            for k in f.keys():
                tensors[k] = f.get_tensor(k)
    params = hf_tensors_to_params(tensors, cfg, dtype)
    return HFModel(cfg, params, Tokenizer.from_hf_directory(path))
