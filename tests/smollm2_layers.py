"""SmolLM2-135M cut to some of its layers, for tests that need its real weights and
tokenizer but not its 30 layers' run time: every decode step runs each layer, so a model of
a few layers serves in a fraction of the time. Shared by the pytest modules
(``tests/test_serve.py``) and ``tests/multi_device_check.py`` (a process of its own)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence

import jax
import numpy as np


@contextlib.contextmanager
def smollm2_layers(layers: int | Sequence[int]):
    """SmolLM2-135M with only ``layers`` (an int ``n``: its first ``n``; or the layer indices
    to keep, in order) for the models loaded inside: ``models.load_model("smollm2-135m", ...)``
    there gives a model of those layers, its config's ``num_layers`` their count, the other
    weights (embedding, final norm, head) and the tokenizer whole, read through the process's
    ``models.api.read_real_weights`` (cached or not).

    The first ``n`` alone make a model whose greedy text barely depends on the prompt (``" ,
    and, and, and"`` from each of tests/test_serve.py's prompts on 4-12 layers; with 4, no token
    of 12 changed from "The capital of France is" to "... of Spain is"): right where a check is
    about the shapes and paths (tests/multi_device_check.py), too blind where a check compares
    the texts of requests to catch one served with the wrong cache. Keeping the last layers too
    (those that feed the head) keeps the text (word salad) as prompt-dependent as the whole
    model's: ``(0, 1, 28, 29)`` changed 10-14 of 12 tokens there, the 30 layers 7-11."""
    from models import api

    read = api.read_real_weights
    keep = np.arange(layers) if isinstance(layers, int) else np.asarray(layers)

    def some_layers(name, dtype):
        cfg, params, tok = read(name, dtype)
        params = jax.tree_util.tree_map_with_path(
            lambda path, a: a[keep] if getattr(path[0], "key", None) == "layers" else a, params)
        return dataclasses.replace(cfg, num_layers=len(keep)), params, tok

    api.read_real_weights = some_layers
    try:
        yield
    finally:
        api.read_real_weights = read
