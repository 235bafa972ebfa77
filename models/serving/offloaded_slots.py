"""The offloaded engine's slots: every KV block in pinned host memory, the device keeping
each slot's ring, method state and a pool of resident blocks (per slot or shared by all:
:class:`models.runtime.tiered.TieredRunner` with an active-row mask), with SparseServe's
working-set estimate (:func:`offloaded_working_set`) and its layer-segmented prefill.
``paged=True``: the host tier is a pool of pages that the requests hold through a
:class:`~models.serving.blocks.BlockManager` (as the paged resident engine's device pool), not
``slots x max_len``.

:class:`OffloadedSlots` gives the engine the calls :class:`models.serving.slots.ResidentSlots`
gives (``prefill``, ``insert``, ``step``, ``wait``, ``settle``, ``blocks_loaded``); its step is
the runner's decode step, then the sampling on the step's inputs placed as the resident step's
(:func:`models.serving.slots.step_inputs`), and its insertion writes each leaf's row as
:func:`models.serving.slots.insert_slot` does.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from models.runtime.tiered import HostPages, TieredRunner
from models.runtime.tiered_prefill import staging_buffer_count
from models.serving.blocks import NULL_BLOCK, BlockManager, PagedRequests, pool_plan
from models.serving.buckets import last_bucket_end, longest_bucket, padded_prompt, segmented_prompt_tokens
from models.serving.precompile import AheadOfTime
from models.serving.requests import Request
from models.serving.slots import check_engine_mesh, insert_slot, replicated, step_inputs, sum_counters
from models.sampling import RowSampling, SampleOut, sample_step_program
from sparse_jax.cache import KVCache
from sparse_jax.offload import capacity
from sparse_jax.offload import pool as off
from sparse_jax.offload.capacity import autotune_scratch_bytes, device_budget
from sparse_jax.offload.pool import insert_shared_row
from sparse_jax.offload.tiers import OffloadedLayer


def insert_tiered_slot(cache: KVCache, row: KVCache, slot: jax.Array) -> KVCache:
    """:func:`insert_slot` for a cache whose entries may be offloaded layers' device
    tiers: every leaf but the per-step block counters (``hits, misses [B, Hkv]``, rewritten
    by every step) takes row ``slot`` from ``row``."""
    layers = []
    for big, one in zip(cache.layers, row.layers):
        if isinstance(big, OffloadedLayer):
            strip = lambda e: dataclasses.replace(e, hits=None, misses=None)  # noqa: E731
            new = insert_slot(strip(big), strip(one), slot)
            layers.append(dataclasses.replace(new, hits=big.hits, misses=big.misses))
        else:
            layers.append(insert_slot(big, one, slot))
    lengths = jax.lax.dynamic_update_index_in_dim(cache.lengths, row.lengths[0], slot, 0)
    return KVCache(tuple(layers), lengths, cache.max_len)


#: a paged host tier's request grows by at least this many positions at a time while the pool has
#: them (PagedRequests.grow_tokens, as models.serving.paged.GROW_TOKENS): each change of the table is
#: a new device buffer for the step, and a new buffer makes XLA update the step's CUDA graph on the
#: host (docs/offload.md)
HOST_GROW_TOKENS = 64

WORKING_SET_WINDOW = 12  # SparseServe's w: decode steps whose selected blocks form a request's working set


def offloaded_working_set(cache: KVCache, window: int = WORKING_SET_WINDOW) -> jax.Array:
    """``int32[B]``: per row, the KV blocks (over the offloaded layers and KV heads) it
    used in the last ``window`` decode steps: the pool slots whose LRU clock (the row's
    length when the slot was last needed) lies within the window, plus the two ring
    blocks per layer and head. SparseServe's decode working set (§3.3, the union of
    the blocks selected over the last w steps), read from the pool's own record: a
    block evicted within the window is not counted."""
    total = jnp.zeros(cache.lengths.shape, jnp.int32)
    for e in cache.layers:
        if isinstance(e, OffloadedLayer) and e.shared:
            # a shared pool: the slots holding the row's blocks (slot_block = row * NB + block) used in the
            # pool's last `window` ticks; the rings are each row's own, outside the pool, not counted
            nb = e.block_slot.shape[2]
            recent = (e.slot_block[0] >= 0) & (e.slot_used[0] > e.tick[0][:, None] - window)  # [Hkv, N]
            owner = jnp.where(recent, e.slot_block[0] // nb, total.shape[0])
            total = total + jnp.zeros_like(total).at[owner.reshape(-1)].add(1, mode="drop")
        elif isinstance(e, OffloadedLayer):
            recent = (e.slot_block >= 0) & (e.slot_used > cache.lengths[:, None, None] - window)
            total = total + recent.sum((1, 2)).astype(jnp.int32) + 2 * e.slot_block.shape[1]
    return total


def insert_shared_slot(cache: KVCache, row: KVCache, slot: jax.Array, host: tuple) -> KVCache:
    """:func:`insert_tiered_slot` for a cache whose offloaded layers share one pool per
    KV head (:func:`sparse_jax.offload.pool.insert_shared_row`: the slot's previous
    blocks leave the pool, the prefilled row's blocks are placed in it from the host
    tier ``host``, which already holds the row's blocks)."""
    layers = []
    for big, one, h in zip(cache.layers, row.layers, host):
        if isinstance(big, OffloadedLayer):
            layers.append(insert_shared_row(big, one, slot, h))
        else:
            layers.append(insert_slot(big, one, slot))
    lengths = jax.lax.dynamic_update_index_in_dim(cache.lengths, row.lengths[0], slot, 0)
    return KVCache(tuple(layers), lengths, cache.max_len)


class OffloadedSlots(PagedRequests):
    """Every slot's KV blocks in pinned host memory (:class:`models.runtime.tiered.TieredRunner`,
    ``mode="offload"``): the device keeps each slot's ring and method state, and the
    resident blocks in a pool per slot (``pool="per_row"``) or in one pool shared by
    the slots (``pool="shared"``, LRU across them). A request is prefilled layer by
    layer into a one-row tiered state; insertion writes its device tier into the slot
    (one jitted program) and copies its host blocks into the slot's rows of the host
    tier on the CPU (shared pool: first, and the insertion places the row's primed
    blocks in the shared pool from there).

    Shared pool: at most ``max_rows = pool_slots // blocks_per_step`` rows decode at
    once (the engine caps R_max to it), so one step's blocks always fit the pool; the
    scheduler's M_avl defaults to the pool's bytes, and the working sets it adds up are
    each request's blocks in the pool used over the last 12 steps.

    On a device with a memory limit (a GPU) the capacity check adds the longest prompt's
    prefill temporaries, measured from its layer programs compiled ahead of time
    (:meth:`models.runtime.tiered.TieredRunner.prefill_temp_bytes`), before anything is allocated.

    Paged (``paged=True``): the host tier is ``host_pages`` pages of one block per offloaded
    layer (:class:`models.runtime.tiered.HostPages`, ``TieredRunner(host_pages=N)``), held by
    requests through a :class:`~models.serving.blocks.BlockManager`: the engine reserves a
    request's prompt and first position when it admits it and one position before each step
    (:meth:`reserve`), frees them on every end and on preemption (:meth:`release`); M_avl is the
    pool, a request's working set the pages it holds. A prompt is prefilled layer by layer
    straight into its pages (the runner's :class:`~models.runtime.tiered.PrefillJob` with the
    request's table and this state's pools: no host tier of ``max_len`` for a prompt); insertion
    writes its device tier into the slot and its table row. A free slot's table row is the null
    page."""

    pages_name = "host pages"  # paged: the host tier's (PagedRequests' messages)
    grow_tokens = HOST_GROW_TOKENS

    offloaded = True

    def __init__(self, model, slots: int, max_len: int, pool_slots: int | None = None, pool: str = "per_row",
                 paged: bool = False, host_pages: int | None = None, inject_tokens: int | None = None):
        check_engine_mesh(model)
        self.model, self.slots, self.max_len = model, slots, max_len
        #: the layer-segmented prefill's budget (Engine.max_inject_tokens; None: whole prefills):
        #: prompt buckets past it run in chunks of a layer, not the whole-layer programs
        #: :meth:`precompile` compiles
        self.inject_tokens = inject_tokens
        self.aot = AheadOfTime()
        self._inputs = replicated(getattr(model, "mesh", None))  # the sampling's host inputs (step_inputs)
        self.shared = off.check_pool(pool) == "shared"
        self.paged = bool(paged)
        if host_pages is not None and not self.paged:
            raise ValueError("host_pages sizes the paged host tier: pass paged=True")
        if self.paged and getattr(model, "mesh", None) is not None:
            raise ValueError("the paged offloaded engine runs an unsharded model (the paged host tier does not run "
                             "on a mesh yet)")
        cfg, dt = model.config, model.dtype
        probe = TieredRunner(model, "offload", pool_slots=pool_slots, pool=pool)  # the method's offload variant
        self.block_size = probe.method.offload_block_size
        self.num_offloaded_layers = len(probe.offloaded_layers)
        self.layer_heads = self.num_offloaded_layers * cfg.num_kv_heads
        self.block_bytes = 2 * self.block_size * cfg.head_dim * jnp.dtype(dt).itemsize  # K and V of one head
        #: paged: bytes of one host page (a block of every offloaded layer and KV head)
        self.page_bytes = self.layer_heads * self.block_bytes
        if self.paged and not self.layer_heads:
            raise ValueError(f"the method {model.method.name!r} offloads no layer of this {cfg.num_layers}-layer model "
                             f"(its dense layers cover them): a paged host tier would hold nothing; serve it resident")
        if self.paged:
            host_pages = self._host_pages(host_pages)
            self.runner = TieredRunner(model, "offload", pool_slots=pool_slots, pool=pool, host_pages=host_pages)
        else:
            self.runner = probe
        method = self.runner.method
        self.blocks_per_step = method.offload_blocks_per_step(max_len)
        self.pool_slots = self.runner._pool(max_len, slots)
        self.max_rows = min(slots, self.pool_slots // self.blocks_per_step) if self.shared else slots
        # a shared pool's requests are prefilled into one-row tiers with the smallest per-row pool (paged:
        # their blocks straight into their pages of this state's pools)
        self.prefill_runner = (TieredRunner(model, "offload", pool_slots=self.blocks_per_step,
                                            host_pages=self.runner.host_pages) if self.shared else self.runner)


        if device_budget() is not None:  # a GPU: the longest prompt's prefill runs beside the batch
            # paged: the empty batch is built without its layers' K/V (TieredRunner.empty_state) and prompts
            # prefill one at a time, so one row's layer is what a prefill holds
            self.runner.check_capacity(slots, max_len, prefill_temp_bytes=self.prefill_runner.prefill_temp_bytes(
                longest_bucket(max_len), max_len), autotune_scratch=autotune_scratch_bytes(model.params),
                prefill_rows=1 if self.paged else None)

        def empty(i):  # every slot starts as a one-token row of zeros (free slots never advance)
            shape = (slots, cfg.num_kv_heads, max_len, cfg.head_dim)
            return jnp.zeros(shape, dt), jnp.zeros(shape, dt), jnp.zeros((slots, cfg.num_heads, cfg.head_dim), dt)

        pages = None
        if self.paged:
            nb = max_len // self.block_size
            self.blocks = BlockManager(host_pages, self.block_size, nb)
            pages = HostPages(host_pages, slots, nb, own=False)  # every slot: the null page
            self._owner: list[int | None] = [None] * slots  # request id per slot
        self.state = (self.runner.empty_state(slots, max_len, pages) if self.paged
                      else self.runner.state_from_kv(empty, np.ones(slots, np.int32), max_len, pages=pages))
        bad = []
        for i, e in enumerate(self.state.cache.layers):
            if isinstance(e, OffloadedLayer) and e.shared:  # the pool is the slots' together: its row leaves
                e = (e.block_slot, e.state)
            elif isinstance(e, OffloadedLayer):
                e = dataclasses.replace(e, hits=None, misses=None)
            bad += [f"layer {i}: {a.shape}" for a in jax.tree.leaves(e) if a.ndim < 1 or a.shape[0] != slots]
        bad += [f"host tier {i}: {h.k.shape}" for i, h in enumerate(self.state.host)
                if h is not None and not h.paged and h.k.shape[0] != slots]
        if bad:
            raise ValueError("every tier leaf must have the slots as its leading axis: " + "; ".join(bad))
        self._insert = jax.jit(insert_shared_slot if self.shared else insert_tiered_slot, donate_argnums=(0,))
        self._working_set = jax.jit(offloaded_working_set)
        self._copiers = concurrent.futures.ThreadPoolExecutor(min(8, os.cpu_count() or 1),
                                                              thread_name_prefix="sparse-jax-insert")
        self.device_bytes = self.state.cache.nbytes()
        #: shared pool: the bytes of its blocks (the default M_avl)
        self.pool_bytes = self.pool_slots * self.layer_heads * self.block_bytes
        self.ws_blocks = np.zeros(slots, np.int64)  # per slot, as of the last step read back
        #: the blocks the collected steps found in the device pool (active rows, every offloaded
        #: layer and KV head): with the engine's ``blocks_loaded``, the pool's hit rate
        self.blocks_hit = 0
        self._ws_pending = None  # (int32[slots] on the device, the step it measured)
        self._steps = 0
        self._inserted_at = np.full(slots, -1)  # the step count when each slot was last filled

    @property
    def segmented(self) -> bool:
        """Whether prompts prefill a few layers per iteration (:attr:`inject_tokens` given)."""
        return self.inject_tokens is not None

    # -- compiling ahead ------------------------------------------------------------------------
    def prefill_buckets(self, shortest_prompt: int = 1) -> list[int]:
        """Every prompt bucket (:meth:`prompt_tokens`) a prompt of ``shortest_prompt`` tokens or
        more runs at, smallest first: up to the last multiple of 64 in the cache (the few prompts
        past it run at their own lengths, each its own program)."""
        top = last_bucket_end(self.max_len)
        lo = max(1, min(int(shortest_prompt), top))
        return sorted({self.prompt_tokens(n) for n in range(lo, top + 1)})

    def program_shapes(self, shortest_prompt: int = 1) -> list[tuple[str, Any, tuple, dict]]:
        """The batch's decode step, then the prefill programs of every bucket a prompt runs whole
        layers at (all of them; with a segmented prefill, those within its budget), smallest
        first: the embedding and each layer kind's layer program; as
        :meth:`AheadOfTime.compile`'s jobs. Not in it: the small programs around the step
        (sampling, insertion, the working set), a segmented prefill's chunk programs, and a
        mesh's programs."""
        runner = self.prefill_runner
        buckets = [t for t in self.prefill_buckets(shortest_prompt)
                   if self.inject_tokens is None or t <= self.inject_tokens]
        step = self.runner.decode_step_job(self.state)  # first: every request's first step needs it
        return [step] * (step is not None) + [job for t in buckets for job in runner.prefill_layer_jobs(t, self.max_len)]

    def precompile(self, *, workers: int | None = None, shortest_prompt: int = 1, progress: bool = False,
                   background: bool = False) -> dict:
        """Compile :meth:`program_shapes` now, in ``workers`` threads (``background``: return at
        once, the smallest first; :attr:`programs_compiling` counts what is left). A prefill of a
        bucket then runs its compiled programs (jit's cache holds them) instead of compiling in
        front of every running request: at a 128K context a cold offloaded engine's warm-up took
        87-170 s on the H100 (2026-12-06), and the quarter-octave buckets multiplied the prompt
        programs by four. Returns :meth:`AheadOfTime.compile`'s counts."""
        return self.aot.compile(self.program_shapes(shortest_prompt), workers=workers, progress=progress,
                                background=background)

    def cancel_precompile(self) -> None:
        """Drop the background compiles not yet started (:meth:`AheadOfTime.cancel`)."""
        self.aot.cancel()

    @property
    def programs_compiling(self) -> int:
        """Programs :meth:`precompile` is still compiling in the background."""
        return self.aot.compiling

    # -- the paged host tier's pages (paged=True; the engine's calls, as PagedSlots') ---------------
    def _host_pages(self, host_pages: int | None) -> int:
        """The host pool's pages, the null page included: ``host_pages``, or as many as the host
        budget holds beside a prefill's pinned staging buffers (the capacity check counts both),
        at most every slot full;
        :class:`~sparse_jax.offload.capacity.CapacityError` (before anything is allocated) when
        that cannot hold one request of ``max_len``."""
        nb = self.max_len // self.block_size
        full = self.slots * nb + 1
        if host_pages is not None and (isinstance(host_pages, bool) or not isinstance(host_pages, (int, np.integer))
                                       or host_pages < 2):
            raise ValueError(f"host_pages must be an int >= 2 (page 0 is the null page), got {host_pages!r}")
        limit = capacity.host_budget()
        cfg = self.model.config
        buffers = staging_buffer_count(self.num_offloaded_layers)
        one_buffer = capacity.staging_bytes(1, max_len=self.max_len, block_size=self.block_size,
                                            num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                                            dtype_bytes=jnp.dtype(self.model.dtype).itemsize)
        if limit is not None:  # the pages took the whole budget, and the check then refused them by the staging
            limit -= buffers * one_buffer  # (H100, 2026-12-06: 6 and 7 rows at 128K, 9 GiB over 106)
        fit = None if limit is None else max(limit, 0) // self.page_bytes
        pool = capacity.pinned_pool_limit()
        if fit is not None and pool is not None:  # and as XLA's pinned pool places them: each layer's K and V
            # page array whole in one of its regions (H100, 2026-12-07: the budget passed 68 arrays of
            # 1.50 GiB by 0.01 GiB, and the 68th did not allocate; capacity.bfc_fits)
            fit = capacity.pages_the_pool_places(min(fit, full), limit=pool, page_bytes=self.page_bytes,
                                                 arrays=2 * self.num_offloaded_layers, staging=one_buffer,
                                                 staging_buffers=buffers)
        asked = host_pages is not None
        if host_pages is None:
            host_pages = full if fit is None else min(full, fit)
        elif fit is not None and host_pages > fit:
            raise capacity.CapacityError(
                f"host_pages={host_pages} pages of {self.page_bytes / 2**20:.2f} MiB do not fit the pinned host "
                f"memory: {max(fit, 0)} fit ({limit / 2**30:.2f} GiB usable beside the prefill's staging buffers)")
        host_pages = int(host_pages)
        if host_pages - 1 < nb:
            raise capacity.CapacityError(
                f"a paged offloaded engine of {self.slots} slots x {self.max_len} tokens needs at least {nb + 1} host "
                f"pages of {self.block_size} tokens (one request of max_len, and the null page); {host_pages} "
                + ("were asked for" if fit is None or host_pages < fit else "fit the host") + ": lower max_len")
        #: what bounds the batch ("slots", "host memory" or "asked"), and the line saying so
        self.kv_bound, self.kv_plan = pool_plan(
            host_pages, self.block_size, self.slots, self.max_len, asked=asked, memory="host memory",
            detail="" if limit is None else f" ({capacity.host_budget_note()})")
        return host_pages

    @property
    def _lengths(self) -> np.ndarray:
        """Each slot's length as the steps issued so far leave it (the engine grows requests by it)."""
        return self.state.lengths_host

    def check_request(self, r: Request) -> None:
        """ValueError when ``r`` could not finish even alone in the host pool."""
        need = self.blocks.blocks_for(r.reserved_tokens)
        if need > self.blocks.total:
            raise ValueError(f"the request needs {need} host KV pages of {self.block_size} tokens "
                             f"({r.reserved_tokens} tokens: prompt + max_tokens), more than this engine's "
                             f"{self.blocks.total}")

    def _table_row_changed(self, slot: int, table) -> None:
        self.state.pages.set_row(slot, table)

    def release(self, r: Request) -> None:
        """Free ``r``'s pages; its slot (if it had one) gets the null page. A save of its blocks
        still pending then stores nothing (the runner reads the table when it stores)."""
        self.blocks.free(r.id)
        slot = r.slot
        if slot is not None and self._owner[slot] == r.id:
            self._owner[slot] = None
            self.state.pages.set_row(slot, NULL_BLOCK)

    def check(self) -> None:
        """AssertionError unless the pages are consistent and every slot's table row is its
        request's (tests)."""
        self.blocks.check()
        for slot, rid in enumerate(self._owner):
            want = self.blocks.table(rid) if rid is not None else np.zeros(self.state.pages.table.shape[1], np.int32)
            assert (self.state.pages.table[slot] == want).all(), f"slot {slot}: its table row is not its request's"

    # -- the engine's calls ----------------------------------------------------------------------
    def prefill(self, ids: Sequence[int], slot: int | None = None, r: Request | None = None):
        """``(logits f32[1, V], one-row state)`` of a prompt (paged: of ``r``, which holds its
        prompt's pages; its blocks go straight to them)."""
        job = self.start_prefill(ids, slot, r)
        job.advance(job.runner.num_layers)
        return job.result()

    def start_prefill(self, ids: Sequence[int], slot: int | None = None, r: Request | None = None):
        """A :class:`models.runtime.tiered.PrefillJob` of one prompt (bucketed as every prefill):
        the engine's layer-segmented prefill advances it between decode steps. Paged: the prompt's
        blocks go to ``r``'s pages of this state's pools when its last layer is done (the row's
        host tier is those pools, read through ``r``'s table)."""
        n = len(ids)
        tokens = padded_prompt(ids, self.prompt_tokens(n), self.model._pad_id())
        if not self.paged:
            return self.prefill_runner.start_prefill(tokens, np.asarray([n], np.int32), self.max_len)
        if r is None:
            raise ValueError("a paged offloaded prefill needs its request (its pages)")
        self.check_holds(r, n)
        pages = HostPages(self.runner.host_pages, 1, self.state.pages.table.shape[1], own=False)
        pages.set_row(0, self.blocks.table(r.id))
        return self.prefill_runner.start_prefill(tokens, np.asarray([n], np.int32), self.max_len, pages=pages,
                                                 into=self.state.host)

    def prompt_tokens(self, n: int) -> int:
        """:func:`segmented_prompt_tokens` of this engine's ``max_len``."""
        return segmented_prompt_tokens(n, self.max_len)

    def layer_kv_bytes(self, n: int) -> int:
        """Device bytes of one layer's K/V of a prompt of ``n`` tokens (its bucket), the
        working set of a prompt under layer-segmented prefill (SparseServe §3.3)."""
        cfg = self.model.config
        return 2 * cfg.num_kv_heads * self.prompt_tokens(n) * cfg.head_dim * jnp.dtype(self.model.dtype).itemsize

    def insert(self, row, slot: int, r: Request | None = None) -> None:
        st = self.state
        self.runner.finish(st)  # saves still pending for the slot's last occupant land first
        if self.paged:
            self._insert_pages(row, slot, r)
            return
        if not self.shared:
            st.cache = self._insert(st.cache, row.cache, jnp.int32(slot))

        def copy(i):  # one CPU copy per layer and K/V, view to view (NumPy releases the GIL)
            # views per shard (one on one device): (row range, head range, k, v)
            for rows, heads, kview, vview in self.runner._views(st, i):
                if slot not in rows:
                    continue
                for _, row_heads, row_k, row_v in self.runner._views(row, i):
                    lo, hi = max(heads.start, row_heads.start), min(heads.stop, row_heads.stop)
                    if lo < hi:
                        dst = (slot - rows.start, slice(lo - heads.start, hi - heads.start))
                        src = (0, slice(lo - row_heads.start, hi - row_heads.start))
                        kview[dst] = row_k[src]
                        vview[dst] = row_v[src]

        # several threads, as SparseServe's CPU-assisted saving: one thread copies ~5-10 GB/s, and a
        # 16K-token row of Qwen3-8B is 2.4 GB, copied while the engine waits
        list(self._copiers.map(copy, self.runner.offloaded_layers))
        if self.shared:  # after the host copy: the insertion fetches the row's primed blocks from there
            st.cache = self._insert(st.cache, row.cache, jnp.int32(slot), st.host)
        st.lengths_host[slot] = row.lengths_host[0]
        self.ws_blocks[slot] = 0  # measured again after its first step
        self._inserted_at[slot] = self._steps

    def _insert_pages(self, row, slot: int, r: Request) -> None:
        """:meth:`insert` on a paged host tier: the prompt's blocks are in ``r``'s pages already
        (:meth:`start_prefill`); the slot's table row goes to them, then the row's device tier into
        the slot (a shared pool places its primed blocks from the pages: the table is sent first)."""
        st = self.state
        n = int(row.lengths_host[0])
        self.check_holds(r, n)
        table = self.blocks.table(r.id)
        filled = -(-n // self.block_size)
        if row.pages is None or (row.pages.table[0, :filled] != table[:filled]).any():
            raise RuntimeError(f"request {r.id}'s prompt was not prefilled into its pages")
        self._owner[slot] = r.id
        st.pages.set_row(slot, table)
        if self.shared:
            self.runner._sync_pages(st, np.zeros(self.slots, bool))  # the table to the device, nothing stepped
            st.cache = self._insert(st.cache, row.cache, jnp.int32(slot), st.host)
        else:
            st.cache = self._insert(st.cache, row.cache, jnp.int32(slot))
        st.lengths_host[slot] = n
        self.ws_blocks[slot] = 0
        self._inserted_at[slot] = self._steps

    def step(self, tokens, active, sampling: RowSampling) -> SampleOut:
        logits = self.runner.decode_step(tokens, self.state, active=active)
        if self.state.counters:
            # the counters are leaves of the cache the next step donates: keep their sums over the
            # offloaded layers, one small program (a copy per layer was a dispatch per layer and step)
            self.state.counters[-1] = [sum_counters(tuple(self.state.counters[-1]))]
        self._steps += 1
        self._take_working_sets()  # last step's, copied meanwhile: one step stale
        ws = self._working_set(self.state.cache)
        ws.copy_to_host_async()
        self._ws_pending = (ws, self._steps)
        return sample_step_program(logits, *step_inputs(self._inputs, tokens, active, sampling))

    def working_set(self, r: Request) -> int:
        """Device bytes of ``r``'s working set: measured (:func:`offloaded_working_set`)
        once it decodes; for a prompt, the blocks its first step reads (its selection,
        at most the prompt's blocks, plus the ring) in every offloaded layer and head."""
        if self.paged:  # M_avl is the host pool: the pages a request holds (or its prompt and first step)
            return self.blocks_needed(r) * self.page_bytes
        if r.slot is not None and r.output_ids and self.ws_blocks[r.slot] > 0:
            return int(self.ws_blocks[r.slot]) * self.block_bytes
        if self.segmented and not r.output_ids:  # waiting or prefilling: one layer of its KV at a time
            return self.layer_kv_bytes(r.prompt_len)
        # shared pool: the ring is the row's own, not the pool's
        first = min(-(-r.prompt_len // self.block_size), self.blocks_per_step) + (0 if self.shared else 2)
        return first * self.layer_heads * self.block_bytes

    def settle(self) -> None:
        """Read back what the last step left in flight: its working-set copy, and the blocks
        it completed (stored into the host tier, as the next step would have)."""
        self._take_working_sets()
        self.runner.finish(self.state)

    def _take_working_sets(self) -> None:
        """Read the working sets the last step measured (``_ws_pending``) into ``ws_blocks``."""
        if self._ws_pending is not None:
            ws, step = self._ws_pending
            self._ws_pending = None
            ws = np.asarray(ws).astype(np.int64)
            fresh = self._inserted_at < step  # a slot filled since then holds another request now
            self.ws_blocks[fresh] = ws[fresh]

    @staticmethod
    def wait(logits, row) -> None:
        """Block until a prefill's outputs exist, its host tier's copies included (see
        :meth:`ResidentSlots.wait`)."""
        jax.block_until_ready((logits, row.cache, row.host))

    def blocks_loaded(self, active) -> int:
        """Blocks the step being collected copied from the host for its ``active`` rows
        (all layers, KV heads); drains the runner's per-step counters so they do not grow."""
        st = self.state
        if len(st.counters) < 2:
            return 0
        # the newest entry is the step just issued (still running): counted at the next collection
        done, st.counters[:] = st.counters[:-1], st.counters[-1:]
        hkv = self.model.config.num_kv_heads
        rows = np.asarray(active, bool)
        # one transfer of every pair's hits and misses: [steps, 2, slots * Hkv]
        counts = np.asarray(jax.device_get(done)).reshape(len(done), -1, 2, self.slots, hkv)[:, :, :, rows].sum(
            axis=(0, 1, 3, 4))
        self.blocks_hit += int(counts[0])
        return int(counts[1])
