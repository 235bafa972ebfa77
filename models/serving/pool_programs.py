"""The paged engine's programs over its page pool (:class:`models.serving.paged.PagedSlots`
runs them): the pure functions that write a prefilled prompt, a group of prompts or a copied row
into the pool and the slots (:func:`prefill_paged_slot`, :func:`prefill_paged_rows`,
:func:`insert_paged_slot`, :func:`copy_paged_slot`), the decode step on a batch bucket
(:func:`bucketed_step`, :func:`decode_rows`), and their jitted forms, on one device
(:func:`paged_programs`) or split by KV head over a mesh (:func:`sharded_paged_programs`).
Every program donates the cache.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from models import programs
from models.driver import init_cache
from models.runtime.sharding import MODEL, local_config, paged_cache_specs, param_specs
from models.sampling import RowSampling
from models.serving.blocks import NULL_BLOCK
from models.serving.slots import engine_step
from models.transformer import abstract_model
from sparse_jax.cache import KVCache, PagedLayer, paged_like, write_prompt_pages


def _into_slots(big, rows, slots: jax.Array, pools=None):
    """Cache entry ``big`` (every slot) with row ``i`` of ``rows`` in slot ``slots[i]``
    (``int32[P]``; a slot out of range, a padding row's, is dropped): for a :class:`PagedLayer`
    its method state (its pools then ``pools``, ``(pool_k, pool_v)``), for any other entry every
    leaf."""
    def put(b, r):
        return b.at[slots].set(r.astype(b.dtype), mode="drop")

    if isinstance(big, PagedLayer):
        state = None if big.state is None else jax.tree.map(put, big.state, rows.state)
        return PagedLayer(*pools, state, big.page)
    return jax.tree.map(put, big, rows)


def _copy_row(a: jax.Array, src: jax.Array, dst: jax.Array) -> jax.Array:
    """``a`` with row ``dst`` (axis 0) replaced by row ``src``."""
    return jax.lax.dynamic_update_index_in_dim(a, jax.lax.dynamic_index_in_dim(a, src, 0), dst, 0)


def insert_paged_slot(cache: KVCache, row: KVCache, slot: jax.Array, pages: jax.Array) -> KVCache:
    """``cache`` (donated) with the one-row contiguous ``row`` (a prefilled request) written
    in: every :class:`PagedLayer`'s row pages to pool pages ``pages int32[max_len / page]``
    (entries that are the null page are skipped: the request holds no page there), its
    method state and every other entry into row ``slot``, and its length. The block table
    is the host's (:meth:`PagedSlots.step` sends it)."""
    layers = []
    for big, one in zip(cache.layers, row.layers):
        pools = None
        if isinstance(big, PagedLayer):
            pools = tuple(write_prompt_pages(pool, x, pages[None], big.page, cache.max_len)
                          for pool, x in ((big.pool_k, one.k), (big.pool_v, one.v)))
        layers.append(_into_slots(big, one, slot[None], pools))
    lengths = jax.lax.dynamic_update_index_in_dim(cache.lengths, row.lengths[0], slot, 0)
    return KVCache(tuple(layers), lengths, cache.max_len, cache.block_table)


def prefill_paged_slot(prefill, row: KVCache, tokens: jax.Array, lengths: jax.Array, cache: KVCache,
                       slot: jax.Array, pages: jax.Array):
    """A prompt prefilled straight into the pool: ``(logits f32[1, V], cache)``. ``prefill``
    is the model's (:func:`models.programs.prefill` of the params, tokens, lengths and a
    cache); ``row`` an empty one-row cache whose global layers are :class:`PagedLayer`
    entries without pages (their state the method's empty one); ``pages int32[max_len /
    page]`` the request's block table row. The prompt's K/V go to its pages of the batch's
    pools, and its method state, sliding-window rings and length into row ``slot``: no
    one-row cache of ``max_len`` exists, and nothing is scattered afterwards. (One row of
    :func:`prefill_paged_rows`.)"""
    return prefill_paged_rows(prefill, row, tokens, lengths, cache, jnp.asarray(slot, jnp.int32)[None], pages[None])


def prefill_paged_rows(prefill, rows: KVCache, tokens: jax.Array, lengths: jax.Array, cache: KVCache,
                       slots: jax.Array, pages: jax.Array):
    """Several prompts prefilled at once straight into the pool (:func:`prefill_paged_slot` for
    ``P`` rows): ``tokens int32[P, S]`` right-padded to ``lengths int32[P]``, ``rows`` an empty
    ``P``-row cache (as :func:`prefill_paged_slot`'s ``row``), ``slots int32[P]`` and ``pages
    int32[P, max_len / page]`` each prompt's slot and block table row. A padding row (its slot
    ``>=`` the cache's rows, its pages null) writes nothing. Returns ``(logits f32[P, V], cache)``."""
    view = []
    for big, one in zip(cache.layers, rows.layers):
        view.append(PagedLayer(big.pool_k, big.pool_v, one.state, big.page) if isinstance(big, PagedLayer) else one)
    logits, out = prefill(tokens, lengths, KVCache(tuple(view), rows.lengths, cache.max_len, pages))
    layers = tuple(_into_slots(big, one, slots, (one.pool_k, one.pool_v) if isinstance(big, PagedLayer) else None)
                   for big, one in zip(cache.layers, out.layers))
    lengths = cache.lengths.at[slots].set(out.lengths, mode="drop")
    return logits, KVCache(layers, lengths, cache.max_len, cache.block_table)


def copy_paged_slot(cache: KVCache, src: jax.Array, dst: jax.Array, src_pages: jax.Array,
                    dst_pages: jax.Array) -> KVCache:
    """``cache`` (donated) with row ``src``'s prompt copied to row ``dst``: the pool pages
    ``src_pages`` to ``dst_pages`` (``int32[W]``, null entries in ``dst_pages`` dropped), every
    per-row leaf (method state, rings) and the length (a prompt's ``n`` choices: one prefill)."""
    layers = []
    for e in cache.layers:
        if isinstance(e, PagedLayer):
            def copy(pool):
                _, hkv, n, d = pool.shape
                p = e.page
                pages = pool.reshape(hkv, n // p, p, d)
                to = jnp.where(dst_pages == NULL_BLOCK, n // p, dst_pages)
                return pages.at[:, to].set(pages[:, src_pages], mode="drop").reshape(1, hkv, n, d)

            state = None if e.state is None else jax.tree.map(lambda a: _copy_row(a, src, dst), e.state)
            layers.append(PagedLayer(copy(e.pool_k), copy(e.pool_v), state, e.page))
        else:
            layers.append(jax.tree.map(lambda a: _copy_row(a, src, dst), e))
    lengths = _copy_row(cache.lengths, src, dst)
    return KVCache(tuple(layers), lengths, cache.max_len, cache.block_table)


def paged_bodies(graphdef, cfg, method, unroll: bool, tp: tuple[str, int] | None = None):
    """The paged engine's programs as functions, not jitted: ``(step, insert, prefill, copy,
    chunk, prefill_group)`` (:func:`paged_programs`). ``graphdef`` and ``cfg`` are one device's under
    tensor parallelism (``tp``: the mesh axis and its size), where the functions run inside
    ``shard_map`` on that device's KV heads (:func:`sharded_paged_programs`)."""

    def decode(params, tokens, cache):
        return programs.decode_step(nnx.merge(graphdef, params), cfg, method, tokens, cache, unroll=unroll, tp=tp)

    def empty_row(cache: KVCache, rows: int = 1) -> KVCache:
        """The empty ``rows``-row cache: method state and rings only (the K/V it would hold is dropped)."""
        paged = next(e for e in cache.layers if isinstance(e, PagedLayer))
        return paged_like(init_cache(cfg, method, rows, cache.max_len, paged.pool_k.dtype), 0, paged.page)

    def prefill(params, tokens, lengths, cache, slot, pages):
        def run(tokens, lengths, view):
            return programs.prefill(nnx.merge(graphdef, params), cfg, method, tokens, lengths, view, unroll=unroll,
                                    tp=tp)

        return prefill_paged_slot(run, empty_row(cache), tokens, lengths, cache, slot, pages)

    def prefill_group(params, tokens, lengths, cache, slots, pages):
        def run(tokens, lengths, view):
            return programs.prefill(nnx.merge(graphdef, params), cfg, method, tokens, lengths, view, unroll=unroll,
                                    tp=tp)

        return prefill_paged_rows(run, empty_row(cache, tokens.shape[0]), tokens, lengths, cache, slots, pages)

    def chunk(params, tokens, start, lengths, cache, slot, pages, kv_len, last, layers=None):
        # the one-row view (every layer paged): the pools, and (last chunk) the row's empty state.
        # ``layers`` (lo, hi): a part of a chunk cut by layers (PagedChunkJob); ``tokens`` is then
        # the hidden state where lo > 0, and the first output the hidden state where hi is not
        # the last layer; only those layers' states go to the slot, the length with the last part
        lo, hi = (0, cfg.num_layers) if layers is None else layers
        states = [e.state for e in empty_row(cache).layers] if last else [None] * len(cache.layers)
        view = tuple(PagedLayer(big.pool_k, big.pool_v, st, big.page) for big, st in zip(cache.layers, states))
        row = KVCache(view, lengths, cache.max_len, pages[None])
        logits, out = programs.prefill_chunk(nnx.merge(graphdef, params), cfg, method, tokens, start, lengths, row,
                                             kv_len=kv_len, last=last, layers=layers, unroll=unroll, tp=tp)
        if not last:  # the pages only
            layers = tuple(dataclasses.replace(big, pool_k=o.pool_k, pool_v=o.pool_v)
                           for big, o in zip(cache.layers, out.layers))
            return logits, dataclasses.replace(cache, layers=layers)
        layers = tuple(_into_slots(big, o, slot[None], (o.pool_k, o.pool_v)) if lo <= i < hi
                       else dataclasses.replace(big, pool_k=o.pool_k, pool_v=o.pool_v)
                       for i, (big, o) in enumerate(zip(cache.layers, out.layers)))
        new_lengths = cache.lengths if hi < cfg.num_layers else jax.lax.dynamic_update_index_in_dim(
            cache.lengths, lengths[0], slot, 0)
        return logits, KVCache(layers, new_lengths, cache.max_len, cache.block_table)

    return bucketed_step(engine_step(decode)), insert_paged_slot, prefill, copy_paged_slot, chunk, prefill_group


@functools.lru_cache(maxsize=16)
def paged_programs(graphdef, cfg, method, unroll: bool):
    """The paged engine's programs: the step on a decode batch bucket (:func:`bucketed_step`
    of the model's decode step, which reads paged layers through the table, and the
    sampling; one compilation per bucket), the page scatter of a
    contiguous row's insertion (a layer-segmented prefill's row), the prefill straight into
    the pool, a prompt's copy to another slot, and a chunk of a prompt into its pages (every
    program donates the cache), and several short prompts prefilled together into the pool
    (:meth:`PagedSlots.run_prompt_group`)."""
    step, insert, prefill, copy, chunk, group = paged_bodies(graphdef, cfg, method, unroll)
    return (jax.jit(step, donate_argnums=(2,), static_argnames=("rows",)), jax.jit(insert, donate_argnums=(0,)),
            jax.jit(prefill, donate_argnums=(3,)), jax.jit(copy, donate_argnums=(0,)),
            jax.jit(chunk, donate_argnums=(4,), static_argnames=("kv_len", "last", "layers")),
            jax.jit(group, donate_argnums=(3,)))


def _refuse_row_insert(*args, **kwargs):
    raise NotImplementedError("a paged engine on a mesh prefills into its pages (whole or in chunks): a "
                              "layer-segmented prefill's contiguous row is not inserted there")


def sharded_paged_programs(model, method, unroll: bool):
    """:func:`paged_programs` for a model under tensor parallelism (a
    :class:`models.runtime.sharding.ShardedModel` with ``data == 1``): each program is one
    ``shard_map`` over the model's mesh, every device running its KV heads' share of the
    layers (:func:`paged_bodies` on one device's config, the attention output and MLP
    summed over the mesh) on its share of the page pools (the pools split by KV head, the
    block table, lengths and per-row leaves as :func:`models.runtime.sharding.paged_cache_specs`
    lays them out, read off each call's cache); tokens, slots, page lists and the sampled
    outputs are the same on every device. No contiguous row insertion (``insert`` refuses:
    the engine prefills into the pool)."""
    par, mesh = model.parallelism, model.mesh
    local = local_config(model.config, par.model)
    step, _, prefill, copy, chunk, _ = paged_bodies(abstract_model(local, model.dtype)[0], local, method, unroll,
                                                  tp=(MODEL, par.model))
    pspecs = param_specs(abstract_model(model.config, model.dtype)[1])
    same = P()

    def specs_of(cache: KVCache):  # the layout of the model's cache (the steady step's method shares it)
        pool = next(e for e in cache.layers if isinstance(e, PagedLayer))
        return paged_cache_specs(model.config, model.method, cache.batch, cache.max_len, pool.pool_k.shape[2] // pool.page,
                                 pool.page, jnp.dtype(pool.pool_k.dtype), par)

    def smap(fn, in_specs, out_specs):
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)

    def step_on_mesh(params, tokens, cache, active, sampling, rows):
        body, cache_specs = functools.partial(step, rows=rows), specs_of(cache)
        return smap(body, (pspecs, same, cache_specs, same, same), (same, cache_specs))(
            params, tokens, cache, active, sampling)

    def prefill_on_mesh(params, tokens, lengths, cache, slot, pages):
        cache_specs = specs_of(cache)
        return smap(prefill, (pspecs, same, same, cache_specs, same, same), (same, cache_specs))(
            params, tokens, lengths, cache, slot, pages)

    def copy_on_mesh(cache, src, dst, src_pages, dst_pages):
        cache_specs = specs_of(cache)
        return smap(copy, (cache_specs, same, same, same, same), cache_specs)(cache, src, dst, src_pages, dst_pages)

    def chunk_on_mesh(params, tokens, start, lengths, cache, slot, pages, kv_len, last):
        body, cache_specs = functools.partial(chunk, kv_len=kv_len, last=last), specs_of(cache)
        return smap(body, (pspecs, same, same, same, cache_specs, same, same), (same, cache_specs))(
            params, tokens, start, lengths, cache, slot, pages)

    return (jax.jit(step_on_mesh, donate_argnums=(2,), static_argnames=("rows",)), _refuse_row_insert,
            jax.jit(prefill_on_mesh, donate_argnums=(3,)), jax.jit(copy_on_mesh, donate_argnums=(0,)),
            jax.jit(chunk_on_mesh, donate_argnums=(4,), static_argnames=("kv_len", "last")))


def decode_rows(slots: int, used: int) -> int:
    """The rows a decode step runs when the slots below ``used`` hold every active request:
    the smallest power of two >= ``used`` (at least 1), at most ``slots`` (few compiled steps)."""
    return min(slots, 1 << max(used - 1, 0).bit_length())


def _first_rows(tree, n: int):
    return jax.tree.map(lambda a: a[:n], tree)


def _put_rows(big, small):
    return jax.tree.map(lambda b, s: jax.lax.dynamic_update_slice_in_dim(b, s.astype(b.dtype), 0, 0), big, small)


def bucketed_step(step):
    """``step(params, tokens, cache, active, sampling, rows)`` (``rows`` static): the engine's
    ``step`` on the first ``rows`` slots only (the decode batch bucket), the others untouched.
    Every per-slot leaf (tokens, lengths, block table, the methods' state, sliding-window
    rings, the rows' sampling) is cut to its first ``rows`` rows; the page pools are shared, so
    they go in whole and come back written; the outputs are padded back to every slot (the
    rows past ``rows`` sample token 0, inactive)."""

    def run(params, tokens, cache: KVCache, active, sampling: RowSampling, rows: int):
        slots = tokens.shape[0]
        if rows == slots:
            return step(params, tokens, cache, active, sampling)

        def cut(e):
            if isinstance(e, PagedLayer):
                return dataclasses.replace(e, state=_first_rows(e.state, rows))
            return _first_rows(e, rows)

        small = KVCache(tuple(cut(e) for e in cache.layers), cache.lengths[:rows], cache.max_len,
                        cache.block_table[:rows])
        stop = sampling.stop_ids  # the banned stop tokens: one list for every row
        rows_sampling = dataclasses.replace(_first_rows(dataclasses.replace(sampling, stop_ids=None), rows),
                                            stop_ids=stop)
        out, new = step(params, tokens[:rows], small, active[:rows], rows_sampling)

        def put(big, e):
            if isinstance(big, PagedLayer):
                return dataclasses.replace(e, state=_put_rows(big.state, e.state))
            return _put_rows(big, e)

        cache = KVCache(tuple(put(b, e) for b, e in zip(cache.layers, new.layers)),
                        _put_rows(cache.lengths, new.lengths), cache.max_len, cache.block_table)
        pad = lambda a: jnp.pad(a, [(0, slots - rows)] + [(0, 0)] * (a.ndim - 1))  # noqa: E731
        return jax.tree.map(pad, out), cache

    return run
