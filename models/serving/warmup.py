"""Running an engine's short programs once before users meet them.

Compiling a program (``Engine.precompile``) is not the whole of its first use: CUDA loads a
program's kernels when it first runs. Under a chat-like load on the H100 (docs/serving.md,
'Grouped short prompts under load') the first timed rate of an engine whose prompt-group
programs had been compiled but not run had one 282 ms gap between tokens and twice the TTFT of
the same rate once they had run. vLLM runs its batch sizes before it serves for the same reason.

:func:`warm_up` sends bursts of short requests through the engine, as a client would: each
one-chunk prompt size alone and in every group the engine prefills together
(``PagedSlots.prompt_group_shapes``), then every decode batch bucket, greedy and (optionally)
sampled. Long prompts' chunk programs are left to their first request: one such prompt takes
seconds, and its first execution is a small part of that.
"""

from __future__ import annotations

import time

import numpy as np

from models.serving.requests import SamplingParams

#: the shortest one-chunk prompt program (``models.serving.paged.chunk_tokens``): an
#: engine without chunks warms its decode steps with prompts of this many tokens
SHORTEST_CHUNK = 64


def prompt_sizes(engine, shortest_prompt: int = 1) -> list[int]:
    """The one-chunk prompt sizes of a chunked paged engine whose programs serve prompts of
    at least ``shortest_prompt`` tokens (``PagedSlots.one_chunk_sizes``: what its precompile
    compiles); ``[64]`` (the smallest prompt, for the decode steps) for any other engine."""
    if getattr(engine.kv, "prefill_chunk", None) is None:
        return [SHORTEST_CHUNK]
    return engine.kv.one_chunk_sizes(shortest_prompt)


def warm_up(engine, *, shortest_prompt: int = 1, sampled: bool = True, timeout: float = 600.0,
            seed: int = 0) -> dict:
    """Run the engine's short programs once (module docstring); the engine thread must be
    running. ``shortest_prompt``: skip prompt programs shorter than this (those
    ``precompile(shortest_prompt=...)`` left out); ``sampled``: also run the sampled decode
    steps. Returns ``{"bursts": n, "requests": m, "seconds": s}``. RuntimeError when a
    warm-up request fails (the engine cannot serve it either)."""
    kv = engine.kv
    vocab = engine.model.config.vocab_size
    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    bursts = requests = 0
    sizes = prompt_sizes(engine, shortest_prompt)

    def burst(n_rows: int, size: int, temperature: float) -> None:
        nonlocal bursts, requests
        params = SamplingParams(max_tokens=2, temperature=temperature, ignore_eos=True, seed=seed)
        n = min(size, engine.max_len - 2)  # the size's program (a chunk of max_len holds no longer prompt)
        reqs = engine.submit_all([engine.make_request(rng.integers(0, vocab, n).tolist(), params)
                                  for _ in range(n_rows)])
        for r in reqs:
            if not r.done.wait(timeout) or r.finish_reason != "length":
                raise RuntimeError(f"warm-up: {n_rows} prompts of {size} tokens at once: one ended "
                                   f"{r.finish_reason!r}: {r.error}")
        bursts, requests = bursts + 1, requests + n_rows

    groups = getattr(kv, "prompt_group_shapes", lambda sizes: [])
    for size in sizes:  # each prompt size alone, then in each group the engine prefills together
        burst(1, size, 0.0)
        for rows, _ in groups([size]):
            burst(min(rows, engine.slots), size, 0.0)
    # every decode bucket (the step runs the slots up to the last active one, rounded up to a
    # power of two), greedy and sampled, with the shortest prompt warmed above (none: the
    # caller's prompts are all longer than a chunk, and their first requests run the steps)
    rows = 1
    while sizes:
        n = min(rows, engine.slots)
        if n > 1:  # one row, greedy: the first burst above
            burst(n, sizes[0], 0.0)
        if sampled:
            burst(n, sizes[0], 0.7)
        if n == engine.slots:
            break
        rows *= 2
    return {"bursts": bursts, "requests": requests, "seconds": time.perf_counter() - t0}
