"""The one sampler: the next token from f32 logits, and what a client asked for around it.

Two entry points over one filter rule (:func:`filter_sorted`):

* :func:`sample_next`: one temperature and top-p for the batch and one key
  (``Model.generate`` and the generate CLI);
* :func:`sample`: per row, everything a serving request may ask (the engine: a
  request's tokens do not depend on its slot or its neighbours), described by a
  :class:`RowSampling`.

:class:`RowSampling`'s optional parts (``filters``, ``penalties``, ``bias``,
``min_tokens``, the logprobs width) are ``None`` / off unless some row in the batch
uses them, and a jitted program specialises on which are present: a batch that asks for
none of them runs the same program as plain temperature / top-p sampling.

The order is vLLM's: logit bias and the ``min_tokens`` ban, then the penalties
(repetition, then frequency and presence), then greedy argmax, or temperature, min-p,
top-k and top-p. Log-probabilities are of the model's own distribution
(``log_softmax`` of the raw f32 logits, vLLM's default ``raw_logprobs``).

Everything runs on the device, inside or outside a jitted program.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

#: the widths the device computes top log-probabilities at (the smallest that holds the
#: widest row's request): a few programs, not one per width
TOP_LOGPROB_WIDTHS = (0, 1, 5, 20)


def logprob_width(wanted: int) -> int:
    """The :data:`TOP_LOGPROB_WIDTHS` bucket that holds ``wanted`` top tokens (-1: none)."""
    if wanted < 0:
        return -1
    return next(w for w in TOP_LOGPROB_WIDTHS if w >= wanted)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["top_k", "min_p"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Filters:
    """Per-row ``top_k int32[B]`` (0: off) and ``min_p f32[B]`` (0: off)."""

    top_k: jax.Array
    min_p: jax.Array


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["presence", "frequency", "repetition", "counts", "prompt"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Penalties:
    """OpenAI's ``presence`` and ``frequency`` penalties ``f32[B]`` (0: off) over the output
    tokens' ``counts int32[B, V]``, and the ``repetition`` penalty ``f32[B]`` (1: off) over
    every token seen, output or ``prompt bool[B, V]`` (vLLM's definitions)."""

    presence: jax.Array
    frequency: jax.Array
    repetition: jax.Array
    counts: jax.Array
    prompt: jax.Array


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["seeds", "counters", "temperature", "top_p", "filters", "penalties", "bias_ids",
                                "bias_values", "min_tokens", "stop_ids"],
                   meta_fields=["top_logprobs", "sampled"])
@dataclasses.dataclass(frozen=True)
class RowSampling:
    """How each of ``B`` rows samples.

    ``seeds uint32[B]``, ``counters int32[B]`` (the output token's index: row ``b`` draws
    with ``fold_in(key(seeds[b]), counters[b])``), ``temperature f32[B]`` (0: greedy),
    ``top_p f32[B]``; optional: ``filters`` (:class:`Filters`), ``penalties``
    (:class:`Penalties`), ``bias_ids int32[B, L]`` / ``bias_values f32[B, L]`` (added to the
    logits; padding ``0 / 0.0``), ``min_tokens int32[B]`` with ``stop_ids int32[S]`` (the
    stop tokens banned while ``counters < min_tokens``). ``top_logprobs`` (static): -1, no
    log-probabilities; else the chosen token's and this many top tokens' (a
    :data:`TOP_LOGPROB_WIDTHS` width). ``sampled`` (static): whether some row has
    ``temperature > 0``, when the caller knows it (the engine does, from its host copy):
    True runs the sort and the draw, False only the argmax; None decides on the device
    (a ``lax.cond`` on ``any(temperature > 0)``, whose predicate a GPU must read back to the
    host before it can launch either branch)."""

    seeds: jax.Array
    counters: jax.Array
    temperature: jax.Array
    top_p: jax.Array
    filters: Filters | None = None
    penalties: Penalties | None = None
    bias_ids: jax.Array | None = None
    bias_values: jax.Array | None = None
    min_tokens: jax.Array | None = None
    stop_ids: jax.Array | None = None
    top_logprobs: int = -1
    sampled: bool | None = None


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["tokens", "logprob", "top_ids", "top_logprobs", "counts"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class SampleOut:
    """``tokens int32[B]``; with log-probabilities, the chosen token's ``logprob f32[B]`` and
    the top ``top_ids int32[B, n]`` / ``top_logprobs f32[B, n]``; with penalties, the
    updated ``counts int32[B, V]``."""

    tokens: jax.Array
    logprob: jax.Array | None = None
    top_ids: jax.Array | None = None
    top_logprobs: jax.Array | None = None
    counts: jax.Array | None = None


def filter_sorted(z: jax.Array, top_p, top_k=None, min_p=None) -> tuple[jax.Array, jax.Array]:
    """Scaled logits ``z f32[B, V]`` sorted descending, filtered: ``(order int[B, V], zs
    f32[B, V])`` with every token set to ``-inf`` that min-p (probability below ``min_p``
    times the top token's), top-k (rank ``>= top_k``; 0 keeps all) or top-p (past the
    smallest top set whose mass, renormalised after the other two, reaches ``top_p``)
    removes. Each of ``top_p``, ``top_k``, ``min_p`` is a scalar or ``[B, 1]``; the top token
    is always kept. A draw ``i`` from ``zs`` is the token ``order[:, i]``."""
    order = jnp.argsort(-z, axis=-1)
    zs = jnp.take_along_axis(z, order, axis=-1)
    if min_p is not None:
        p = jax.nn.softmax(zs, axis=-1)
        zs = jnp.where(p >= min_p * p[:, :1], zs, -jnp.inf)
    if top_k is not None:
        rank = jnp.arange(z.shape[-1])[None, :]
        zs = jnp.where((top_k <= 0) | (rank < top_k), zs, -jnp.inf)
    p = jax.nn.softmax(zs, axis=-1)
    before = jnp.cumsum(p, axis=-1) - p  # mass strictly before each token
    return order, jnp.where(before < top_p, zs, -jnp.inf)


@functools.partial(jax.jit, static_argnames=("temperature", "top_p"))
def sample_next(logits: jax.Array, key: jax.Array, *, temperature: float, top_p: float) -> jax.Array:
    """Next token per row from ``logits [B, V]``: argmax when ``temperature == 0``, else
    a draw from ``softmax(logits / temperature)`` restricted to the smallest set of top
    tokens whose mass reaches ``top_p`` (the top token is always kept). -> ``int32[B]``."""
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    z = logits.astype(jnp.float32) / temperature
    if top_p >= 1.0:
        return jax.random.categorical(key, z, axis=-1).astype(jnp.int32)
    order, zs = filter_sorted(z, top_p)
    pick = jax.random.categorical(key, zs, axis=-1)
    return jnp.take_along_axis(order, pick[:, None], axis=-1)[:, 0].astype(jnp.int32)


def adjust_logits(logits: jax.Array, s: RowSampling) -> jax.Array:
    """``f32[B, V]``: the logits after ``s``'s logit bias, ``min_tokens`` ban and penalties
    (each only where present), what greedy and sampled tokens are both drawn from."""
    z = logits.astype(jnp.float32)
    rows = jnp.arange(z.shape[0])[:, None]
    if s.bias_ids is not None:
        z = z.at[rows, s.bias_ids].add(s.bias_values.astype(jnp.float32))
    if s.min_tokens is not None:
        ban = (s.counters < s.min_tokens)[:, None]
        z = z.at[:, s.stop_ids].set(jnp.where(ban, -jnp.inf, z[:, s.stop_ids]))
    if s.penalties is not None:
        p = s.penalties
        out = p.counts > 0
        rep = p.repetition[:, None]
        z = jnp.where(out | p.prompt, jnp.where(z > 0, z / rep, z * rep), z)
        z = z - p.frequency[:, None] * p.counts.astype(jnp.float32) - p.presence[:, None] * out
    return z


def sample(logits: jax.Array, s: RowSampling) -> SampleOut:
    """One token per row from f32 ``logits [B, V]`` (:func:`adjust_logits` first): argmax
    where ``temperature[b] == 0``, else a draw from ``softmax(z / temperature)`` after
    :func:`filter_sorted`, with the row's own key (module docstring). With
    ``s.top_logprobs >= 0``, the log-probabilities of the model's distribution (raw
    ``logits``) at the chosen token and the top ``s.top_logprobs``."""
    z = adjust_logits(logits, s)
    greedy = jnp.argmax(z, axis=-1).astype(jnp.int32)
    temperature = s.temperature

    def sampled():
        keys = jax.vmap(lambda sd, c: jax.random.fold_in(jax.random.key(sd), c))(s.seeds.astype(jnp.uint32),
                                                                                 s.counters)
        zt = z / jnp.maximum(temperature, 1e-6)[:, None]
        f = s.filters
        order, zs = filter_sorted(zt, s.top_p[:, None], None if f is None else f.top_k[:, None],
                                  None if f is None else f.min_p[:, None])
        pick = jax.vmap(lambda k, row: jax.random.categorical(k, row))(keys, zs)
        tok = jnp.take_along_axis(order, pick[:, None], axis=-1)[:, 0].astype(jnp.int32)
        return jnp.where(temperature > 0, tok, greedy)

    # the sort over the vocabulary only when some row samples: known on the host (static), or
    # decided on the device
    if s.sampled is None:
        tokens = jax.lax.cond(jnp.any(temperature > 0), sampled, lambda: greedy)
    else:
        tokens = sampled() if s.sampled else greedy
    if s.top_logprobs < 0:
        return SampleOut(tokens)
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0]
    if s.top_logprobs == 0:
        return SampleOut(tokens, chosen)
    top_lp, top_ids = jax.lax.top_k(lp, s.top_logprobs)
    return SampleOut(tokens, chosen, top_ids.astype(jnp.int32), top_lp)


def sample_step(logits: jax.Array, fed: jax.Array, active: jax.Array, s: RowSampling) -> SampleOut:
    """:func:`sample` in a decode step: with penalties, first count each active row's
    ``fed int32[B]`` token (the output token the step consumed) into ``counts``; the
    result carries the new counts for the next step."""
    if s.penalties is None:
        return sample(logits, s)
    p = s.penalties
    counts = p.counts.at[jnp.arange(fed.shape[0]), fed].add(active.astype(p.counts.dtype))
    out = sample(logits, dataclasses.replace(s, penalties=dataclasses.replace(p, counts=counts)))
    return dataclasses.replace(out, counts=counts)


#: :func:`sample` as one program (a prefill's first token; an offloaded step's sampling)
sample_program = jax.jit(sample)
#: :func:`sample_step` as one program (the offloaded engine, whose decode step is its runner's)
sample_step_program = jax.jit(sample_step)


def sample_rows(logits: jax.Array, seeds: jax.Array, counters: jax.Array, temperature: jax.Array,
                top_p: jax.Array) -> jax.Array:
    """:func:`sample` with temperature and top-p only: ``int32[B]``."""
    return sample(logits, RowSampling(seeds, counters, temperature, top_p)).tokens
