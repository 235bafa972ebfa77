"""SmolLM2-135M cut to its first layers, for tests that need its real weights and tokenizer
but not its 30 layers' time, in a module of its own so that the pytest modules and
``tests/multi_device_check.py`` (a process of its own) share it."""

from __future__ import annotations

import contextlib
import dataclasses

import jax


@contextlib.contextmanager
def smollm2_layers(n: int):
    """SmolLM2-135M cut to its first ``n`` layers (its real weights and tokenizer, through the
    process's ``models.api.read_real_weights``, cached or not), for the models loaded inside."""
    from models import api

    read = api.read_real_weights

    def first_layers(name, dtype):
        cfg, params, tok = read(name, dtype)
        params = jax.tree_util.tree_map_with_path(
            lambda path, a: a[:n] if getattr(path[0], "key", None) == "layers" else a, params)
        return dataclasses.replace(cfg, num_layers=n), params, tok

    api.read_real_weights = first_layers
    try:
        yield
    finally:
        api.read_real_weights = read
