"""The KV cache: an explicit pytree passed into and returned from pure jitted
functions (and donated), never hidden module state.

Layout (head-major, DESIGN.md): one entry per model layer, each its own
buffers: a :class:`LayerCache` (``k, v [B, Hkv, S_layer, D]`` resident on the
device, plus the method's per-layer state), a :class:`PagedLayer` (one pool of
pages shared by the batch, read through ``KVCache.block_table``), or an offloaded
layer's device tier (:class:`sparse_jax.offload.tiers.OffloadedLayer`), plus one
``lengths int32[B]`` for the whole batch so rows can hold different lengths.
``S_layer`` is the layer's capacity: ``max_len`` on global layers, a ring of
``window`` slots on sliding-window layers (token ``p`` in slot ``p % window``).
Head-major avoids the full-cache transpose that ``[B, S, Hkv, D]`` forces on
every decode step and matches per-KV-head selection.

Why one buffer per layer and not the layers stacked on a leading axis: a layer
reading its slice of a stacked cache makes XLA copy the slice before any
kernel that is not fused with it (our Pallas kernels, the attention GEMMs),
a whole layer's KV per layer per step. On the H100 (Qwen3-8B shape) a stacked
cache, scanned or unrolled, was about twice as slow as per-layer buffers, the
difference being those copies (docs/architecture.md, 'Measured', its table).

Positions ``>= lengths[b]`` hold garbage (padding of a ragged prefill, or
nothing yet); every reader masks them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerCache:
    """One resident layer: ``k, v [B, Hkv, S, D]`` and the method's state for it."""

    k: jax.Array
    v: jax.Array
    state: Any = None


NULL_PAGE = 0  # page 0 of every pool: where free rows and unheld pages point, never read as data


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedLayer:
    """One paged layer: ``pool_k, pool_v [1, Hkv, P * page, D]``, one pool of pages shared by
    the batch (row ``b``'s position ``p`` at pool row ``block_table[b, p // page] * page +
    p % page``, :attr:`KVCache.block_table`), and the method's per-row state."""

    pool_k: jax.Array
    pool_v: jax.Array
    state: Any = None
    page: int = dataclasses.field(default=64, metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Every layer's entry plus the number of valid tokens per batch row ``int32[B]``.

    ``max_len`` (static): the context capacity (global layers hold that many tokens).
    ``block_table`` (``int32[B, max_len / page]``): where the rows' pages are in the
    :class:`PagedLayer` pools (one table for every paged layer); None without paged layers.
    """

    layers: tuple
    lengths: jax.Array
    max_len: int = dataclasses.field(default=0, metadata=dict(static=True))
    block_table: Any = None

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def layer(self, i: int):
        """Model layer ``i``'s entry."""
        return self.layers[i]

    def nbytes(self) -> int:
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(self))


def write_rows(k: jax.Array, v: jax.Array, k_new: jax.Array, v_new: jax.Array, rows: jax.Array):
    """``k, v [B, Hkv, R, D]`` with ``k_new, v_new [B, Hkv, D]`` written at row
    ``rows[b]`` of each batch row, in place (the arrays are donated by callers)."""

    def one(cache_row, new_row, r):
        # cache_row [Hkv, R, D], new_row [Hkv, D]
        return jax.lax.dynamic_update_slice(cache_row, new_row[:, None, :].astype(cache_row.dtype), (0, r, 0))

    k = jax.vmap(one)(k, k_new, rows)
    v = jax.vmap(one)(v, v_new, rows)
    # The barrier keeps the update a single in-place op. Without it XLA:CPU
    # duplicates the update into the fusion of each consumer (the attention dot
    # reading the cache) and copies the whole donated cache ~4 times per layer
    # per decode step (docs/models.md, 'CPU performance', item 2); on the GPU it
    # fused the offloaded ring write into a select over the whole slot pool
    # (docs/architecture.md, 'Measured reasons for runtime and benchmark choices').
    return jax.lax.optimization_barrier((k, v))


def write_paged(pool_k: jax.Array, pool_v: jax.Array, k_new: jax.Array, v_new: jax.Array, rows: jax.Array):
    """``pool_k, pool_v [1, Hkv, N, D]`` with ``k_new, v_new [B, Hkv, D]`` written at pool row
    ``rows[b]`` (distinct rows: each request owns its pages), in place (donated by callers)."""
    # one advanced index (the rows) after two slices: the update is [1, Hkv, B, D] in place
    pool_k = pool_k.at[:, :, rows].set(jnp.swapaxes(k_new, 0, 1)[None].astype(pool_k.dtype))
    pool_v = pool_v.at[:, :, rows].set(jnp.swapaxes(v_new, 0, 1)[None].astype(pool_v.dtype))
    return jax.lax.optimization_barrier((pool_k, pool_v))  # as write_rows: one in-place update


def write_prompt_pages(pool: jax.Array, x: jax.Array, block_table: jax.Array, page: int, tokens: int) -> jax.Array:
    """``pool [1, Hkv, P * page, D]`` with a prefill's ``x [B, Hkv, S, D]`` (positions from 0,
    ``S >= tokens``) written to the rows' pages: page ``j < ceil(tokens / page)`` of row ``b`` to
    pool page ``block_table[b, j]`` (``int32[B, >= ceil(tokens / page)]``). Entries that are the
    null page are dropped (a row holds no page there, and several rows may name it); the others
    are distinct (each request owns its pages). In place (donated by callers)."""
    _, hkv, n, d = pool.shape
    b, w = x.shape[0], -(-tokens // page)
    if x.shape[2] < w * page:  # the last page's tail: positions past the prompt, never read
        x = jnp.pad(x, ((0, 0), (0, 0), (0, w * page - x.shape[2]), (0, 0)))
    src = x[:, :, :w * page].reshape(b, hkv, w, page, d).transpose(1, 0, 2, 3, 4).reshape(hkv, b * w, page, d)
    dst = block_table[:, :w].reshape(-1)
    dst = jnp.where(dst == NULL_PAGE, n // page, dst)  # out of range: dropped
    out = pool.reshape(hkv, n // page, page, d).at[:, dst].set(src.astype(pool.dtype), mode="drop")
    return jax.lax.optimization_barrier(out.reshape(1, hkv, n, d))  # as write_rows: one in-place update


def page_cache(cache: KVCache, block_table, num_pages: int, page: int) -> KVCache:
    """``cache`` with every global :class:`LayerCache` (capacity ``max_len``) moved into a
    :class:`PagedLayer` pool of ``num_pages`` pages: row ``b``'s page ``j`` to pool page
    ``block_table[b, j]`` (``int32[B, max_len / page]``; entries 0 are the null page, left
    as zeros: a row's pages past its tokens may name it). Sliding-window rings stay as they
    are. The contiguous cache's paged twin (tests; a paged engine writes pages directly)."""
    table = jnp.asarray(block_table, jnp.int32)
    b, w = table.shape
    if cache.max_len % page or w * page != cache.max_len:
        raise ValueError(f"block_table [B, {w}] of pages of {page} must cover max_len {cache.max_len} exactly")
    layers = []
    for e in cache.layers:
        if isinstance(e, LayerCache) and e.k.shape[2] == cache.max_len:
            hkv, d = e.k.shape[1], e.k.shape[3]

            def pool(x):
                pages = x.reshape(b, hkv, w, page, d).transpose(1, 0, 2, 3, 4).reshape(hkv, b * w, page, d)
                out = jnp.zeros((hkv, num_pages, page, d), x.dtype).at[:, table.reshape(-1)].set(pages)
                return out.at[:, 0].set(0).reshape(1, hkv, num_pages * page, d)

            layers.append(PagedLayer(pool(e.k), pool(e.v), e.state, page))
        else:
            layers.append(e)
    return KVCache(tuple(layers), cache.lengths, cache.max_len, table)


def paged_like(cache: KVCache, num_pages: int, page: int) -> KVCache:
    """An empty paged twin of ``cache``: every global :class:`LayerCache` (capacity
    ``max_len``) replaced by a :class:`PagedLayer` of ``num_pages`` zero pages of ``page``
    positions (its method state kept), a block table ``int32[B, max_len / page]`` of null
    pages, and every other entry as it is. Called inside ``jax.jit`` on a fresh
    ``init_cache``, the contiguous K/V it replaces are never allocated (XLA drops them)."""
    if cache.max_len % page:
        raise ValueError(f"max_len {cache.max_len} is not a multiple of the page size {page}")
    layers = []
    for e in cache.layers:
        if isinstance(e, LayerCache) and e.k.shape[2] == cache.max_len:
            shape = (1, e.k.shape[1], num_pages * page, e.k.shape[3])
            layers.append(PagedLayer(jnp.zeros(shape, e.k.dtype), jnp.zeros(shape, e.v.dtype), e.state, page))
        else:
            layers.append(e)
    table = jnp.zeros((cache.batch, cache.max_len // page), jnp.int32)
    return KVCache(tuple(layers), cache.lengths, cache.max_len, table)
