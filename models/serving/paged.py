"""The engine's KV in one pool of pages shared by every request (vLLM's PagedAttention).

:class:`PagedSlots` gives the engine the calls :class:`~models.serving.slots.ResidentSlots`
gives (``prefill``, ``start_prefill``, ``insert``, ``step``, ``wait``, ``settle``), on a
decode cache whose global layers are :class:`sparse_jax.cache.PagedLayer` pools of
``num_blocks`` pages of ``page`` tokens (:func:`sparse_jax.cache.paged_like`), read and
written through one block table ``int32[slots, max_len / page]``
(:attr:`sparse_jax.cache.KVCache.block_table`). The pages belong to requests, not slots:
:class:`~models.serving.blocks.BlockManager` gives a request the pages its tokens fill, as
it grows, and takes them back when it ends, so a slot costs the KV of the tokens it holds,
not ``max_len``.

What stays per slot: each layer's method state (Quest's boxes, AsyncTLS's labels: a
fraction of the keys' bytes), sliding-window rings, the lengths. A prompt is prefilled
into a contiguous one-row cache (the prefill programs are the resident engine's) and
:meth:`PagedSlots.insert` scatters its pages into the pool at the request's blocks.

The engine drives the blocks (:class:`models.serving.engine.Engine`): it reserves a
request's prompt pages when it admits it, one position more before each step that writes
it (:meth:`PagedSlots.reserve`), frees them when it ends or is preempted
(:meth:`PagedSlots.release`), and :meth:`PagedSlots.step` sends the block table and the
lengths whenever they changed. A slot without a request has a table of null pages and
length 0: what its masked step writes lands in the null page, and its attention reads one
position, not the stale length of its last request.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from models.runtime.tiered import TieredRunner
from models.serving.blocks import NULL_BLOCK, BlockManager, OutOfBlocks
from models.sampling import RowSampling, SampleOut
from models.serving.requests import Request
from models.serving.slots import (ResidentSlots, _programs, check_engine_mesh, check_slot_axis,
                                  compile_longest_prefill, insert_slot, segmented_prompt_tokens)
from sparse_jax.cache import KVCache, PagedLayer, paged_like
from sparse_jax.offload import capacity

DEFAULT_PAGE = 64  # tokens per page for a method without blocks of its own (dense); the kernels' block
# a request grows by at least this many positions at a time (pages of 16 would change the table every 16 steps)
GROW_TOKENS = 64


def page_size(method) -> int:
    """The page of a paged cache for ``method``: its block (``cache_multiple``) where it
    selects blocks, so a selected block is one page read in place; else 64 tokens."""
    m = int(method.cache_multiple)
    return m if m > 1 else DEFAULT_PAGE


def insert_paged_slot(cache: KVCache, row: KVCache, slot: jax.Array, pages: jax.Array) -> KVCache:
    """``cache`` (donated) with the one-row contiguous ``row`` (a prefilled request) written
    in: every :class:`PagedLayer`'s row pages to pool pages ``pages int32[max_len / page]``
    (entries that are the null page are skipped: the request holds no page there), its
    method state and every other entry into row ``slot``, and its length. The block table
    is the host's (:meth:`PagedSlots.step` sends it)."""
    layers = []
    for big, one in zip(cache.layers, row.layers):
        if isinstance(big, PagedLayer):
            _, hkv, n, d = big.pool_k.shape
            p, w = big.page, pages.shape[0]
            dst = jnp.where(pages == NULL_BLOCK, n // p, pages)  # out of range: dropped

            def scatter(pool, x):
                src = x[0].reshape(hkv, w, p, d).astype(pool.dtype)
                return pool.reshape(hkv, n // p, p, d).at[:, dst].set(src, mode="drop").reshape(1, hkv, n, d)

            state = None if big.state is None else insert_slot(big.state, one.state, slot)
            layers.append(PagedLayer(scatter(big.pool_k, one.k), scatter(big.pool_v, one.v), state, big.page))
        else:
            layers.append(insert_slot(big, one, slot))
    lengths = jax.lax.dynamic_update_index_in_dim(cache.lengths, row.lengths[0], slot, 0)
    return KVCache(tuple(layers), lengths, cache.max_len, cache.block_table)


@functools.lru_cache(maxsize=16)
def _paged_programs(graphdef, cfg, method, unroll: bool):
    """The paged engine's programs: the resident engine's step (the model's decode step,
    which reads paged layers through the table, and the sampling) and the page scatter of
    an insertion (cache donated)."""
    step, _ = _programs(graphdef, cfg, method, unroll)
    return step, jax.jit(insert_paged_slot, donate_argnums=(0,))


def _nbytes(x) -> int:
    return int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize


@dataclasses.dataclass(frozen=True)
class PagedFootprint:
    """Device bytes of a paged engine, by part; ``block_bytes`` is one page of every paged
    layer (K and V, all KV heads)."""

    weights: int
    per_slot: int      # method state, rings, lengths and block table of every slot
    prefill_row: int   # the one-row contiguous cache a prompt is prefilled into
    prefill_temporaries: int
    autotune_scratch: int
    block_bytes: int

    def fixed(self) -> int:
        return self.weights + self.per_slot + self.prefill_row + self.prefill_temporaries + self.autotune_scratch


def paged_footprint(model, slots: int, max_len: int, page: int, prefill_temp_bytes: int = 0) -> PagedFootprint:
    """:class:`PagedFootprint` from the caches' shapes (nothing allocated)."""
    empty = jax.eval_shape(lambda: paged_like(model.init_cache(slots, max_len), 0, page))
    one = jax.eval_shape(lambda: paged_like(model.init_cache(1, max_len), 1, page))
    block = sum(_nbytes(e.pool_k) + _nbytes(e.pool_v) for e in one.layers if isinstance(e, PagedLayer))
    return PagedFootprint(
        weights=sum(x.nbytes for x in jax.tree.leaves(model.params)),
        per_slot=sum(_nbytes(x) for x in jax.tree.leaves(empty)),
        prefill_row=sum(_nbytes(x) for x in jax.tree.leaves(jax.eval_shape(lambda: model.init_cache(1, max_len)))),
        prefill_temporaries=int(prefill_temp_bytes),
        autotune_scratch=capacity.autotune_scratch_bytes(model.params),
        block_bytes=block)


class PagedSlots:
    """Every slot's KV in one page pool per global layer (module docstring).

    ``num_blocks`` (pages, the null page included): default, on a device with a memory
    limit (a GPU), as many as fit beside the weights, the slots' state and the longest
    prompt's prefill (its temporaries measured by compiling it first), at most what
    ``slots`` full rows use; on the CPU exactly that (no limit to fill). A pool that cannot
    hold one request of ``max_len`` tokens is refused (:class:`CapacityError`)."""

    offloaded = False
    paged = True

    def __init__(self, model, slots: int, max_len: int, unroll: bool, segmented: bool = False,
                 num_blocks: int | None = None):
        check_engine_mesh(model)
        if getattr(model, "mesh", None) is not None:
            raise ValueError("a paged engine runs an unsharded model; serve a sharded one with paged=False")
        check_slot_axis(model, max_len)
        self.model, self.slots, self.max_len = model, slots, max_len
        self.page = page_size(model.method)
        if max_len % self.page:
            raise ValueError(f"max_len {max_len} must be a multiple of the page size {self.page}")
        self.pages_per_request = max_len // self.page
        full = slots * self.pages_per_request + 1  # every slot full, and the null page
        if num_blocks is not None and (isinstance(num_blocks, bool) or int(num_blocks) < 2):
            raise ValueError(f"kv_blocks must be an int >= 2 (page 0 is the null page), got {num_blocks!r}")
        self._compiled_prefill: dict[int, Any] = {}
        self._runner = None
        self._step, self._insert = _paged_programs(model.graphdef, model.config, model.method, unroll)

        temps = 0
        limit = capacity.device_budget()
        if limit is not None and segmented:
            self._runner = TieredRunner(model, "resident")
            temps = self._runner.prefill_temp_bytes(segmented_prompt_tokens(max_len - 1, max_len), max_len)
        elif limit is not None and hasattr(model.fns.prefill, "lower"):
            bucket, compiled, temps = compile_longest_prefill(model, max_len)
            self._compiled_prefill[bucket] = compiled
        self.footprint = fp = paged_footprint(model, slots, max_len, self.page, temps)
        if limit is None:
            fit = full if num_blocks is None else int(num_blocks)
        else:
            fit = (limit - fp.fixed()) // max(fp.block_bytes, 1)
        if num_blocks is None:
            num_blocks = min(full, fit)
        elif int(num_blocks) > fit:
            raise capacity.CapacityError(
                f"kv_blocks={num_blocks} pages of {fp.block_bytes / 2**20:.1f} MiB do not fit the device: "
                f"{max(fit, 0)} fit beside the weights, the slots' state and a prefill ({fp.fixed() / 2**30:.2f} GiB "
                f"of {limit / 2**30:.2f} GiB)")
        num_blocks = int(num_blocks)
        if num_blocks - 1 < self.pages_per_request:
            raise capacity.CapacityError(
                f"a paged engine of {slots} slots x {max_len} tokens needs at least {self.pages_per_request + 1} pages "
                f"of {self.page} tokens (one request of max_len, and the null page); {num_blocks} "
                + ("were asked for" if limit is None else f"fit the device ({fp.fixed() / 2**30:.2f} GiB is weights, "
                   f"state and prefill, of {limit / 2**30:.2f} GiB)") + ": lower max_len or the slots")
        self.blocks = BlockManager(num_blocks, self.page, self.pages_per_request)
        self.cache = jax.jit(lambda: paged_like(model.init_cache(slots, max_len), num_blocks, self.page))()
        self.device_bytes = self.cache.nbytes()
        self.block_bytes = fp.block_bytes
        self._table = np.zeros((slots, self.pages_per_request), np.int32)  # the host's block table
        self._lengths = np.zeros(slots, np.int32)  # the host's view of the device lengths
        self._owner: list[int | None] = [None] * slots  # request id per slot
        self._dirty = False  # the table or a length changed outside a step: send both with the next

    # -- blocks ----------------------------------------------------------------------------
    @property
    def kv_blocks_total(self) -> int:
        return self.blocks.total

    @property
    def kv_blocks_free(self) -> int:
        return self.blocks.free_blocks

    def blocks_needed(self, r: Request) -> int:
        """Pages ``r`` holds, or (waiting) the pages of its prefill and its first step."""
        held = self.blocks.held(r.id)
        return held if held else self.blocks.blocks_for(r.prefill_len + 1)

    def working_set(self, r: Request) -> int:
        """The scheduler's M_avl measure: device bytes of the pages :meth:`blocks_needed`."""
        return self.blocks_needed(r) * self.block_bytes

    def check_request(self, r: Request) -> None:
        """ValueError when ``r`` could not finish even alone: its prompt and every token it
        may generate need more pages than the pool has."""
        need = self.blocks.blocks_for(r.reserved_tokens)
        if need > self.blocks.total:
            raise ValueError(f"the request needs {need} KV pages of {self.page} tokens ({r.reserved_tokens} tokens: "
                             f"prompt + max_tokens), more than this engine's {self.blocks.total}")

    def reserve(self, r: Request, tokens: int) -> bool:
        """Give ``r`` pages for its first ``tokens`` positions; False (nothing changed) when the
        pool lacks them. Its slot's table row follows (sent with the next step). Pages smaller
        than :data:`GROW_TOKENS` are given that many positions at a time while the pool has
        them, so the table changes (and is sent) once per ``GROW_TOKENS`` steps of a row, not
        once per page."""
        if self.blocks.blocks_for(tokens) > self.blocks.held(r.id):
            ahead = min(-(-tokens // GROW_TOKENS) * GROW_TOKENS, self.max_len, max(r.reserved_tokens, tokens))
            if ahead > tokens and self.blocks.can_reserve(r.id, ahead):
                tokens = ahead
        try:
            added = self.blocks.reserve(r.id, tokens)
        except OutOfBlocks:
            return False
        if added and r.slot is not None and self._owner[r.slot] == r.id:
            self._table[r.slot] = self.blocks.table(r.id)
            self._dirty = True
        return True

    def release(self, r: Request) -> None:
        """Free ``r``'s pages; its slot (if it had one) gets null pages and length 0."""
        self.blocks.free(r.id)
        slot = r.slot
        if slot is not None and self._owner[slot] == r.id:
            self._owner[slot] = None
            self._table[slot] = NULL_BLOCK
            self._lengths[slot] = 0
            self._dirty = True

    # -- the engine's calls ----------------------------------------------------------------
    # a prompt is prefilled (whole or layer-segmented) into a one-row contiguous cache, as the
    # resident engine does: its methods, on this class's model, max_len, compiled prefill and runner
    prefill = ResidentSlots.prefill
    start_prefill = ResidentSlots.start_prefill
    blocks_loaded = ResidentSlots.blocks_loaded
    wait = staticmethod(ResidentSlots.wait)
    settle = ResidentSlots.settle

    def insert(self, row, slot: int, r: Request) -> None:
        """Write the prefilled ``row`` of ``r`` (which holds its prompt's pages) into ``slot``."""
        table = self.blocks.table(r.id)
        n = r.prefill_len
        if self.blocks.held(r.id) < self.blocks.blocks_for(n):
            raise RuntimeError(f"request {r.id} holds {self.blocks.held(r.id)} pages, its {n} tokens need more")
        self.cache = self._insert(self.cache, row, jnp.int32(slot), jnp.asarray(table))
        self._owner[slot] = r.id
        self._table[slot] = table
        self._lengths[slot] = n
        self._dirty = True

    def step(self, tokens, active, sampling: RowSampling) -> SampleOut:
        if self._dirty:  # copies: the host arrays change while the step is queued
            self.cache = dataclasses.replace(self.cache, block_table=jnp.asarray(self._table.copy()),
                                             lengths=jnp.asarray(self._lengths.copy()))
            self._dirty = False
        out = ResidentSlots.step(self, tokens, active, sampling)
        self._lengths += np.asarray(active, bool)  # the step advances the active rows only
        return out

    def check(self) -> None:
        """AssertionError unless the blocks are consistent and every slot's table row is its
        request's (tests, the soak)."""
        self.blocks.check()
        for slot, rid in enumerate(self._owner):
            want = self.blocks.table(rid) if rid is not None else np.zeros(self.pages_per_request, np.int32)
            assert (self._table[slot] == want).all(), f"slot {slot}: its table row is not its request's"


