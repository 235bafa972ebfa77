"""Flax NNX transformers (Llama family incl. SmolLM2, Qwen3, Gemma 3), their weight
loaders (GGUF, HF safetensors directories, orbax) and tokenizer.

Entry point: :func:`load_model` (see :mod:`models.api` and docs/models.md).
"""

from models.api import Model, load_model
from models.checkpoint import restore_params, save_params
from models.config import PRESETS, ModelConfig, RopeScaling, available_models, get_config
from models.gguf_loader import WeightsNotFoundError
from models.hf_loader import load_hf_directory, save_hf_directory
from models.tokenizer import Tokenizer

__all__ = [
    "PRESETS",
    "Model",
    "ModelConfig",
    "RopeScaling",
    "Tokenizer",
    "WeightsNotFoundError",
    "available_models",
    "get_config",
    "load_hf_directory",
    "load_model",
    "restore_params",
    "save_hf_directory",
    "save_params",
]
