"""AsyncSpade's cache rank (``models.runtime.cache_rank``) against one-device AsyncSpade, run in its
own process with two CPU devices (``tests/test_cache_rank.py`` runs it; the device count
must be set before jax starts).

``XLA_FLAGS=--xla_force_host_platform_device_count=2 python -m tests.cache_rank_check``
prints one JSON line per case: a ragged prefill and ``STEPS`` greedy steps, every step's
logits against ``decode_step`` on one device, whether the greedy tokens agree, and where
the two ranks' state lives. Cases: a tiny random config (8 KV heads, 5 layers, budgets
below the prompts so every sparse layer selects) with the Quest, Double Sparsity and
AsyncTLS selectors, packs of 2, 3 and 6 layers (three packs, the last shorter; two; one),
both transfers (``device_put``, a ``ppermute`` program), issued from one host thread or two;
a control (the one-device reference
with the lag, ``window=1``: a different selection must show as a logit difference);
with ``--smollm2``, SmolLM2-135M on its real weights through ``generate`` (the test
runs SmolLM2 through the CLI instead).
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
from models.runtime.cache_rank import with_cache_rank
from tests.cli_runs import run_generate, texts_with_and_without

STEPS = 4


def _greedy(prefill, decode, tokens, lengths, cache):
    logits, cache = prefill(tokens, lengths, cache)
    out = [np.asarray(logits, np.float32)]
    nxt = jnp.argmax(logits, -1).astype(jnp.int32)
    for _ in range(STEPS):
        logits, cache = decode(nxt, cache)
        out.append(np.asarray(logits, np.float32))
        nxt = jnp.argmax(logits, -1).astype(jnp.int32)
    return out, cache


def _report(case, ref, got, **extra):
    err = max(float(np.max(np.abs(a - b))) for a, b in zip(ref, got))
    agree = all(np.array_equal(a.argmax(-1), b.argmax(-1)) for a, b in zip(ref, got))
    print(json.dumps(dict(case=case, max_dlogit=err, tokens_agree=agree, **extra)), flush=True)


def tiny_cases():
    from models.api import Model
    from models.config import ModelConfig
    from models.transformer import init_params
    from sparse_jax.methods.registry import get_method

    cfg = ModelConfig(name="tiny-kv8", arch="qwen3", num_layers=5, hidden_size=64, num_heads=16, num_kv_heads=8,
                      head_dim=16, intermediate_size=96, vocab_size=97, max_position=512, rope_theta=1e4,
                      rms_eps=1e-6)
    channels = (tuple(tuple(range(h % 4, 16, 4)) for h in range(8)),) * cfg.num_layers
    selectors = {
        "quest": {},
        "double_sparsity": dict(selector_options=(("channels_per_layer", channels),)),
        "asynctls": dict(selector_options=(("channels_per_layer", channels), ("block_size", 16), ("kb", 6))),
    }
    graphdef, params = init_params(cfg, jnp.float32, seed=1)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (3, 150)), jnp.int32)
    lengths = jnp.asarray([150, 120, 97], jnp.int32)
    for sel, opts in selectors.items():
        # θ_t: the cache rank holds no keys on the attending device, so its AsyncSpade decodes sparsely
        # from the first step (dense_steps=0); the default (the window) resolves to that there, which
        # the quest cases check by building the rank from a default model
        method = get_method("asyncspade", budget=48, window=4, dense_layers=(0,), selector=sel, dense_steps=0, **opts)
        ref_model = Model(cfg, graphdef, params, None, method, jnp.float32, 256)
        ref, _ = _greedy(ref_model.prefill, ref_model.decode_step, tokens, lengths, ref_model.init_cache(3, 256))
        base = ref_model if sel != "quest" else ref_model.with_method("asyncspade", budget=48, window=4,
                                                                      dense_layers=(0,))
        # packs of 2 (three, the last shorter) and 6 (one) layers, each transfer and dispatch once
        # (packs of 1 compiled five packs' programs for what packs of 2 check)
        runs = [(2, "collective", "threads"), (6, "device_put", "one")] \
            if sel == "quest" else [(3, "device_put", "threads-wait")]
        for pack, transfer, dispatch in runs:
            threads = dispatch != "one"
            cr = with_cache_rank(base, pack_layers=pack, transfer=transfer, threads=threads,
                                      wait_copies=dispatch == "threads-wait")
            got, split = _greedy(cr.prefill, cr.decode_step, tokens, lengths, cr.init_cache(3, 256))
            rank_devs = {str(d) for st in split.rank if st is not None for x in jax.tree.leaves(st) for d in x.devices()}
            inf_devs = {str(d) for x in jax.tree.leaves(split.inference) for d in x.devices()}
            _report(f"tiny/asyncspade[{sel}]/pack={pack}/{transfer}/{dispatch}", ref, got, rank_devices=sorted(rank_devs),
                    inference_devices=sorted(inf_devs), packs=len(cr.fns.packs),
                    base_dense_steps=base.method.dense_steps, rank_dense_steps=cr.method.dense_steps)
        if sel == "quest":  # control: the lag (W=1) selects differently, and the comparison sees it
            lag = Model(cfg, graphdef, params, None, get_method("asyncspade", budget=48, window=1, dense_layers=(0,),
                                                                  dense_steps=0), jnp.float32, 256)
            ctl, _ = _greedy(lag.prefill, lag.decode_step, tokens, lengths, lag.init_cache(3, 256))
            _report("control/asyncspade[quest]/window=1-vs-window=4", ctl, got)


def cli_case():
    """``python -m models.generate --attention asyncspade --cache-rank`` (the CLI's ``main``):
    SmolLM2's text with and without the cache rank, and the flag refused for another method."""
    prompt = "The capital of France is Paris. The capital of Italy is Rome. " * 5 + "The capital of Germany is"
    # dense_steps=0: the cache rank's θ_t (the default, the window, resolves to it there)
    args = ["--model", "smollm2-135m", "--attention", "asyncspade", "--attention-opt", "budget=48",
            "--attention-opt", "dense_steps=0", "--prompt", prompt,
            "--max-new-tokens", "8"]
    texts, heads = texts_with_and_without(args, ["--cache-rank"])
    refused = run_generate(["--model", "smollm2-135m", "--prompt", "hi", "--cache-rank"])
    print(json.dumps(dict(case="cli/cache-rank", texts=texts, heads=heads, refused_rc=refused.rc,
                          refused=refused.err[-500:])), flush=True)


if __name__ == "__main__":
    if len(jax.devices()) < 2:
        raise SystemExit("needs 2 devices: XLA_FLAGS=--xla_force_host_platform_device_count=2")
    tiny_cases()
    cli_case()
