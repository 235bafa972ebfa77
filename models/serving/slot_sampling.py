"""What each engine slot asks of the sampler, and the penalties' device state.

:class:`SlotSampling` keeps every slot's sampling options on the host (a few numbers per
row) and, once a penalised request arrives, the output-token counts ``int32[slots, V]`` and
prompt-token marks ``bool[slots, V]`` on the device. :meth:`SlotSampling.build` makes the
:class:`models.sampling.RowSampling` of a step (every slot) or of one slot's first token,
with each option only when a row it covers uses it: a batch that asks for none runs the
plain temperature / top-p program.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from models.sampling import Filters, Penalties, RowSampling, SampleOut, logprob_width
from models.serving.requests import Request, TokenLogprob


@functools.partial(jax.jit, donate_argnums=(0, 1))
def _set_rows(counts: jax.Array, seen: jax.Array, slot: jax.Array, row_counts: jax.Array,
              row_seen: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The penalties' state with row ``slot`` replaced (both donated)."""
    return (jax.lax.dynamic_update_index_in_dim(counts, row_counts, slot, 0),
            jax.lax.dynamic_update_index_in_dim(seen, row_seen, slot, 0))


class SlotSampling:
    """Per-slot sampling options of ``slots`` rows over a ``vocab``-token vocabulary;
    ``stop_ids``: the tokens ``min_tokens`` bans. ``sharding``: where the penalties' device state
    is made (an engine over a mesh: :func:`models.serving.slots.replicated`, where its step
    leaves the counts it returns; made on one device, the first penalised request's first token
    compiled its sampler for that placement and the next one's for the mesh's)."""

    def __init__(self, slots: int, vocab: int, stop_ids: Sequence[int], sharding: Any = None):
        self.slots, self.vocab, self.sharding = slots, vocab, sharding
        self.seeds = np.zeros(slots, np.uint32)
        self.temperature = np.zeros(slots, np.float32)
        self.top_p = np.ones(slots, np.float32)
        self.top_k = np.zeros(slots, np.int32)
        self.min_p = np.zeros(slots, np.float32)
        self.presence = np.zeros(slots, np.float32)
        self.frequency = np.zeros(slots, np.float32)
        self.repetition = np.ones(slots, np.float32)
        self.min_tokens = np.zeros(slots, np.int32)
        self.logprobs = np.full(slots, -1, np.int32)  # top log-probs wanted per slot (-1: none)
        self.bias: list[tuple[np.ndarray, np.ndarray] | None] = [None] * slots
        self.stop_ids = jnp.asarray(sorted(stop_ids), jnp.int32) if stop_ids else None
        # penalties' device state, made when the first penalised request arrives: output token counts
        # (a step adds the token each row consumes) and the prompt's tokens
        self.counts: jax.Array | None = None
        self.prompt_seen: jax.Array | None = None

    def assign(self, slot: int, r: Request) -> None:
        """Row ``slot`` takes ``r``'s options; a penalised ``r`` gets its penalties' row: its
        output so far counted (a preempted request resumes with them), its prompt marked."""
        p = r.params
        self.seeds[slot] = p.seed
        self.temperature[slot] = p.temperature
        self.top_p[slot] = p.top_p
        self.top_k[slot] = min(p.top_k, self.vocab)  # past the vocabulary: all kept
        self.min_p[slot] = p.min_p
        self.presence[slot] = p.presence_penalty
        self.frequency[slot] = p.frequency_penalty
        self.repetition[slot] = p.repetition_penalty
        self.min_tokens[slot] = p.min_tokens
        self.logprobs[slot] = -1 if p.logprobs is None else p.logprobs
        self.bias[slot] = (np.asarray([t for t, _ in p.logit_bias], np.int32),
                           np.asarray([b for _, b in p.logit_bias], np.float32)) if p.logit_bias else None
        if p.penalized:
            if self.counts is None:
                self.counts = jnp.zeros((self.slots, self.vocab), jnp.int32, device=self.sharding)
                self.prompt_seen = jnp.zeros((self.slots, self.vocab), bool, device=self.sharding)
            counts = np.bincount(np.asarray(r.output_ids, np.int64), minlength=self.vocab).astype(np.int32)
            seen = np.zeros(self.vocab, bool)
            seen[r.prompt_ids] = True
            self.counts, self.prompt_seen = _set_rows(self.counts, self.prompt_seen, jnp.int32(slot),
                                                      jnp.asarray(counts), jnp.asarray(seen))

    def build(self, counters: np.ndarray, active: np.ndarray | None = None, slot: int | None = None) -> RowSampling:
        """The :class:`RowSampling` of every slot (``slot`` None: a step, ``active`` its rows)
        or of row ``slot`` alone (its first token), ``counters`` the index of the token each
        row samples. Host arrays are copied: they change while the step is queued."""
        rows = slice(None) if slot is None else slice(slot, slot + 1)
        act = np.asarray(active, bool) if slot is None else np.ones(1, bool)

        def f32(a):
            return jnp.asarray(np.array(a[rows], np.float32))

        filters = pen = bias_ids = bias_values = min_tokens = stop_ids = None
        if ((self.top_k[rows] > 0) | (self.min_p[rows] > 0))[act].any():
            filters = Filters(jnp.asarray(self.top_k[rows].copy()), f32(self.min_p))
        if ((self.presence[rows] != 0) | (self.frequency[rows] != 0) | (self.repetition[rows] != 1))[act].any():
            state = (self.counts, self.prompt_seen) if slot is None else \
                (self.counts[rows], self.prompt_seen[rows])
            pen = Penalties(f32(self.presence), f32(self.frequency), f32(self.repetition), *state)
        bias = self.bias[rows]
        biased = [i for i, b in enumerate(bias) if act[i] and b is not None]
        if biased:
            width = 1 << max(3, (max(len(bias[i][0]) for i in biased) - 1).bit_length())
            ids = np.zeros((len(bias), width), np.int32)
            vals = np.zeros((len(bias), width), np.float32)
            for i in biased:
                k = len(bias[i][0])
                ids[i, :k], vals[i, :k] = bias[i]
            bias_ids, bias_values = jnp.asarray(ids), jnp.asarray(vals)
        counters = np.asarray(counters, np.int32)
        if self.stop_ids is not None and (counters < self.min_tokens[rows])[act].any():
            min_tokens, stop_ids = jnp.asarray(self.min_tokens[rows].copy()), self.stop_ids
        wanted = int(self.logprobs[rows][act].max()) if act.any() else -1
        # static: a greedy batch never compiles (or waits on) the sampled branch; an inactive
        # row's temperature is kept, so its (dropped) token is drawn as its own would be
        sampled = bool((self.temperature[rows] > 0)[act].any())
        return RowSampling(jnp.asarray(self.seeds[rows].copy()), jnp.asarray(counters.copy()),
                           f32(self.temperature), f32(self.top_p), filters=filters, penalties=pen,
                           bias_ids=bias_ids, bias_values=bias_values, min_tokens=min_tokens, stop_ids=stop_ids,
                           top_logprobs=logprob_width(wanted), sampled=sampled)

    def take_counts(self, out: SampleOut) -> SampleOut:
        """Keep a step's new penalty counts for the next step; ``out`` without them (an
        insertion before the step is collected donates them)."""
        if out.counts is None:
            return out
        self.counts = out.counts
        return dataclasses.replace(out, counts=None)


def token_logprob(out: SampleOut, row: int, wanted: int | None) -> TokenLogprob | None:
    """Row ``row`` of a sampled step's log-probabilities (read back to the host), its top
    ``wanted``; None when the request asked for none."""
    if wanted is None:
        return None
    top = ()
    if wanted:
        ids, lps = np.asarray(out.top_ids[row]), np.asarray(out.top_logprobs[row])
        top = tuple((int(i), float(v)) for i, v in zip(ids[:wanted], lps[:wanted]))
    return TokenLogprob(int(np.asarray(out.tokens)[row]), float(np.asarray(out.logprob)[row]), top)
