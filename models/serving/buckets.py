"""The padded lengths prompts are prefilled at: few compiled programs for many prompt lengths.

* :func:`prefill_bucket`: a whole prompt's (multiples of 64 up to 1,024 tokens, then powers of
  two), as ``Model.generate`` pads;
* :func:`segmented_bucket` / :func:`segmented_prompt_tokens`: a layer-by-layer prefill's (the
  offloaded and layer-segmented engines'), four buckets an octave past 8,192 tokens;
* :func:`longest_bucket`: the bucket the capacity check measures a prefill's temporaries at.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from sparse_jax.offload.capacity import round_up_in_octave


def padded_prompt(ids: Sequence[int], width: int, pad_id: int) -> np.ndarray:
    """``int32[1, width]``: a prompt's ids, then ``pad_id`` (a prefill bucket's padding)."""
    tokens = np.full((1, width), pad_id, np.int32)
    tokens[0, :len(ids)] = ids
    return tokens


def prefill_bucket(n: int, max_len: int) -> int:
    """The padded prompt length a prompt of ``n`` tokens is prefilled at: a multiple of
    64 up to 1024 tokens (as ``Model.generate``), then powers of two, capped at
    ``max_len``: few compilations for long prompts."""
    b = -(-n // 64) * 64 if n <= 1024 else 1 << (n - 1).bit_length()
    return min(b, max_len)


#: Prompts longer than this run a layer-by-layer prefill at a finer bucket than a power of two:
#: :data:`FINE_BUCKETS_PER_OCTAVE` of them per octave (:func:`segmented_bucket`).
FINE_BUCKETS_FROM = 8192
FINE_BUCKETS_PER_OCTAVE = 4


def segmented_bucket(n: int, max_len: int) -> int:
    """The padded length of a layer-by-layer prefill of ``n`` tokens: :func:`prefill_bucket`
    up to :data:`FINE_BUCKETS_FROM` tokens, then the next of :data:`FINE_BUCKETS_PER_OCTAVE`
    steps per octave (64K-128K: 80K, 96K, 112K, 128K; multiples of 2,048, so of any method's
    tile), capped at ``max_len``.
    Power-of-two buckets ran every prompt of 64K-128K at 131,072 tokens, whose causal
    attention is ~1.7x a uniform mix's mean prompt: benchmark C's offloaded engine prefilled
    1.6x slower than dense's chunks of the same prompts (H100, 2026-12-06, docs/serving.md).
    Each bucket compiles its layer programs once; four an octave cap the padding at a quarter."""
    if n <= FINE_BUCKETS_FROM:
        return prefill_bucket(n, max_len)
    return min(round_up_in_octave(n, FINE_BUCKETS_PER_OCTAVE, 64), max_len)


def last_bucket_end(max_len: int) -> int:
    """The last multiple of 64 below ``max_len``: the longest bucket a layer-by-layer prefill
    pads to (the tiered prefill keeps a position for the first decode token); a prompt past it
    runs at its own length."""
    return (max_len - 1) // 64 * 64


def longest_bucket(max_len: int) -> int:
    """The longest layer-by-layer prefill bucket of a cache of ``max_len`` (the last multiple of
    64 in it): the capacity check measures one layer's temporaries at it, a program prompts of
    that bucket then reuse. Measured at ``max_len - 1`` before, a length only a prompt of exactly
    that many tokens runs, it compiled a whole 128K layer program set at every build for
    nothing. A prompt past it (at most 63 tokens longer) holds no more than a rounding more."""
    top = last_bucket_end(max_len)
    return segmented_prompt_tokens(top, max_len) if top else max_len - 1  # a cache under 65: every prompt its own


def segmented_prompt_tokens(n: int, max_len: int) -> int:
    """Tokens a prompt of ``n`` runs through each layer of a layer-by-layer prefill
    (:class:`models.runtime.tiered.PrefillJob`): its :func:`segmented_bucket`, where the bucket
    would fill the cache (the tiered prefill needs room for one decode token) the last multiple
    of 64 below ``max_len``, and ``n`` only for a prompt past that. Every prompt between the last
    bucket and the cache used to run at its own length, each compiling its own layer
    programs: on the H100 a 98K slot's prompts over 64K took 14 s to prefill, with 3.5 s
    stalls of the running requests."""
    t = segmented_bucket(n, max_len)
    if t < max_len:
        return t
    top = last_bucket_end(max_len)
    return top if n <= top else n
