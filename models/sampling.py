"""The one sampler: the next token from f32 logits, greedy or temperature + nucleus.

Two entry points over one nucleus rule (:func:`nucleus`):

* :func:`sample_next`: one temperature and top-p for the batch and one key
  (``Model.generate`` and the generate CLI);
* :func:`sample_rows`: per-row temperature, top-p and key (the serving engine: a
  request's tokens do not depend on its slot or its neighbours).

Both run on the device, inside or outside a jitted program (:func:`sample_next` is
one jitted program per temperature and top-p).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def nucleus(z: jax.Array, top_p) -> tuple[jax.Array, jax.Array]:
    """Top-p of scaled logits ``z f32[B, V]``: ``(order int[B, V], zs f32[B, V])``, the
    logits sorted descending with every token past the smallest top set whose mass
    reaches ``top_p`` (a scalar, or ``[B, 1]``) set to ``-inf``; the top token is always
    kept. A draw ``i`` from ``zs`` is the token ``order[:, i]``."""
    order = jnp.argsort(-z, axis=-1)
    zs = jnp.take_along_axis(z, order, axis=-1)
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
    order, zs = nucleus(z, top_p)
    pick = jax.random.categorical(key, zs, axis=-1)
    return jnp.take_along_axis(order, pick[:, None], axis=-1)[:, 0].astype(jnp.int32)


def sample_rows(logits: jax.Array, seeds: jax.Array, counters: jax.Array, temperature: jax.Array,
                top_p: jax.Array) -> jax.Array:
    """One token per row from f32 ``logits [B, V]``: argmax where ``temperature[b] == 0``,
    else a draw from ``softmax(logits / temperature)`` restricted to the smallest set of
    top tokens whose mass reaches ``top_p[b]``. Row ``b`` draws with the key
    ``fold_in(key(seeds[b]), counters[b])`` (``counters``: the output token's index),
    so a request's tokens do not depend on its slot or its neighbours. -> ``int32[B]``."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def sampled():
        keys = jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(seeds.astype(jnp.uint32), counters)
        z = logits.astype(jnp.float32) / jnp.maximum(temperature, 1e-6)[:, None]
        order, zs = nucleus(z, top_p[:, None])
        pick = jax.vmap(lambda k, row: jax.random.categorical(k, row))(keys, zs)
        tok = jnp.take_along_axis(order, pick[:, None], axis=-1)[:, 0].astype(jnp.int32)
        return jnp.where(temperature > 0, tok, greedy)

    # the sort over the vocabulary only when some row samples
    return jax.lax.cond(jnp.any(temperature > 0), sampled, lambda: greedy)
