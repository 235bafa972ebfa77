"""Record SmolLM2's outputs under every registered method, for the layer-driver refactor.

    python scripts/make_driver_fixture.py            # writes tests/fixtures/driver_logits.npz

The redesign replaced the hand-written per-layer loops of ``models/transformer.py``
with one scanned layer driver. This script ran on the old loops (commit recorded in
the file) and stored what they produced, so ``tests/test_driver_fixture.py`` can
check that the driver gives the same numbers: SmolLM2-135M in float32, a ragged
batch of two prompts (300 and 237 tokens), prefill then 6 decode steps fed with
fixed tokens, for every method with options small enough that each one really
selects (no dense fallback): budgets of 64-128 tokens against ~300 of context.

Stored per method: the logits at ``COLUMNS`` (1,024 fixed vocabulary ids: the
dense run's top tokens plus random ones) for the prefill and every decode step,
each step's argmax over the whole vocabulary, and its log-sum-exp.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: method name -> options: every method selects for real at ~300 tokens of context
CASES = {
    "dense": {},
    "oracle_topk": {"budget": 64},
    "streaming": {"budget": 64},
    "quest": {"budget": 64},
    "arkvale": {"budget": 128},
    "double_sparsity": {"budget": 64},
    "asynctls": {"budget": 64, "block_size": 16, "kb": 6},
    "asynctls_lag": {"budget": 64, "block_size": 16, "kb": 6, "lag": True},
}
LENGTHS = (300, 237)
T_PAD = 320
CACHE = 384
STEPS = 6
NUM_COLUMNS = 1024


def prompt_tokens(tokenizer) -> np.ndarray:
    from models.cli.demo_prompt import build_demo_prompt

    ids = tokenizer.encode(build_demo_prompt().text)
    toks = np.full((len(LENGTHS), T_PAD), 2, np.int32)
    toks[0, :LENGTHS[0]] = ids[:LENGTHS[0]]
    toks[1, :LENGTHS[1]] = ids[1000:1000 + LENGTHS[1]]
    return toks


def run_case(model, tokens, fed, columns):
    cache = model.init_cache(len(LENGTHS), CACHE)
    logits, cache = model.prefill(tokens, np.asarray(LENGTHS, np.int32), cache)
    outs = [logits]
    for t in range(STEPS):
        logits, cache = model.decode_step(fed[t], cache)
        outs.append(logits)
    full = np.stack([np.asarray(o, np.float32) for o in outs])  # [STEPS+1, B, V]
    lse = np.asarray(jax.nn.logsumexp(jnp.asarray(full), axis=-1))
    return full[..., columns], full.argmax(-1).astype(np.int32), lse


def main() -> int:
    import models

    base = models.load_model("smollm2-135m", dtype=jnp.float32, max_len=CACHE)
    tokens = prompt_tokens(base.tokenizer)
    rng = np.random.default_rng(0)
    fed = rng.integers(100, 40000, size=(STEPS, len(LENGTHS))).astype(np.int32)
    dense_full = None
    out = {"tokens": tokens, "lengths": np.asarray(LENGTHS, np.int32), "fed": fed, "cache": np.int32(CACHE)}
    for name, opts in CASES.items():
        method = name.removesuffix("_lag")
        model = base.with_method(method, **opts)
        if dense_full is None:
            cache = model.init_cache(len(LENGTHS), CACHE)
            lg, _ = model.prefill(tokens, np.asarray(LENGTHS, np.int32), cache)
            top = np.argsort(-np.asarray(lg), axis=-1)[:, :256].reshape(-1)
            cols = np.unique(np.concatenate([top, rng.choice(base.config.vocab_size, NUM_COLUMNS, replace=False)]))
            columns = np.sort(cols[:NUM_COLUMNS]).astype(np.int32)
            out["columns"] = columns
            dense_full = True
        sel, argmax, lse = run_case(model, tokens, fed, out["columns"])
        out[f"{name}/logits"] = sel
        out[f"{name}/argmax"] = argmax
        out[f"{name}/lse"] = lse
        print(f"{name:16s} argmax {argmax[:, 0].tolist()} ... lse {lse[0, 0]:.4f}", flush=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    out["commit"] = np.asarray(commit)
    out["options"] = np.asarray(repr(CASES))
    path = ROOT / "tests" / "fixtures" / "driver_logits.npz"
    np.savez_compressed(path, **out)
    print(f"wrote {path} ({path.stat().st_size / 1e6:.2f} MB) from commit {commit}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
