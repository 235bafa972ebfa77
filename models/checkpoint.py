"""Orbax save / restore of converted params (skips re-reading and dequantising a GGUF).

Layout of a checkpoint directory ``path``::

    path/params/          the orbax (StandardCheckpointer) checkpoint of the params
    path/model_config.json  optional: the ModelConfig, so ``load_model(weights=path)``
                            needs no preset
    path/tokenizer.json, tokenizer_config.json   optional: the tokenizer
"""

from __future__ import annotations

import json
import os

import jax
from flax import nnx

from models.config import ModelConfig
from models.tokenizer import Tokenizer

CONFIG_FILE = "model_config.json"


def _pure(params):
    return nnx.to_pure_dict(params) if isinstance(params, nnx.State) else params


def save_params(params: nnx.State, path: str | os.PathLike, *, config: ModelConfig | None = None,
                tokenizer: Tokenizer | None = None, force: bool = False) -> None:
    """Save ``params`` (an ``nnx.State`` or a pure dict) under ``path``; with
    ``force`` an existing checkpoint there is replaced."""
    import orbax.checkpoint as ocp

    path = os.path.abspath(os.fspath(path))
    os.makedirs(path, exist_ok=True)
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(os.path.join(path, "params"), _pure(params), force=force)
    ckptr.wait_until_finished()
    if config is not None:
        with open(os.path.join(path, CONFIG_FILE), "w") as f:
            f.write(config.to_json())
    if tokenizer is not None:
        tokenizer.save_hf(path)


def is_checkpoint(path) -> bool:
    return os.path.isdir(os.path.join(path, "params"))


def restore_params(path: str | os.PathLike, like: nnx.State) -> nnx.State:
    """Restore params saved by :func:`save_params`; ``like`` (concrete or abstract
    params, e.g. from ``transformer.abstract_model``) gives the tree, shapes, dtypes
    and placement. Returns an ``nnx.State`` shaped like ``like``."""
    import orbax.checkpoint as ocp

    path = os.path.abspath(os.fspath(path))
    if not is_checkpoint(path):
        raise FileNotFoundError(f"no orbax checkpoint at {path} (expected {os.path.join(path, 'params')})")
    pure_like = _pure(like)

    def target(x):
        sharding = getattr(x, "sharding", None)
        if sharding is None:
            sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    restored = ocp.StandardCheckpointer().restore(os.path.join(path, "params"), jax.tree.map(target, pure_like))
    if isinstance(like, nnx.State):
        out = jax.tree.map(lambda x: x, like)  # copy of the structure
        nnx.replace_by_pure_dict(out, restored)
        return out
    return restored


def read_config(path) -> ModelConfig | None:
    p = os.path.join(path, CONFIG_FILE)
    if not os.path.exists(p):
        return None
    with open(p) as f:
        return ModelConfig.from_dict(json.load(f))
