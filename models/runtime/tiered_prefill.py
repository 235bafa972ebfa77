"""Layer-by-layer prefill into a :class:`~models.runtime.tiered_state.TieredState`
(SparseServe's layer-segmented prefill, §3.4) for :class:`models.runtime.tiered.TieredRunner`:
:class:`StateBuilder` turns each layer's K/V into its device tier and, offloaded, its host tier
(contiguous or paged) as the layer is done; :class:`PrefillJob` runs the layers a few at a time,
or a layer in chunks, so a serving engine decodes between segments.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np

from models import transformer as tfm
from models.api import round_up
from models.runtime.tiered_programs import (chunked_layer_kv, empty_offloaded_layer, finish_layer, prefill_chunk_fn,
                                            prefill_layer_fn)
from models.runtime.tiered_state import HostPages, TieredState, host_view
from sparse_jax.cache import NULL_PAGE, KVCache
from sparse_jax.offload import capacity
from sparse_jax.offload import pool as off
from sparse_jax.offload.tiers import HostLayer, device_sharding, pinned_host_sharding

#: threads that store a prefilled layer's blocks into their host pages while the next layers
#: run (SparseServe's CPU-assisted saving). 0 stores every layer in :meth:`StateBuilder.finish`,
#: on the caller's thread, after the last layer (the order before 2026-12-06: the A/B baseline
#: of ``benchmarks.probes.offload_prefill``). One thread copies ~5-10 GB/s; a 64K prompt of
#: Qwen3-8B stores 9.1 GB of blocks (34 offloaded layers).
PAGE_STORE_THREADS = min(8, os.cpu_count() or 1)
_store_pool: tuple[int, concurrent.futures.ThreadPoolExecutor] | None = None  # (its threads, it)


def staging_buffer_count(offloaded_layers: int) -> int:
    """Pinned host buffers a paged prefill stages at once (one layer's K or V each): two per
    store thread (:data:`PAGE_STORE_THREADS`) in flight, and the layer's two staged before the
    oldest are waited for; with no store threads every offloaded layer's two until the
    prefill's end."""
    every = 2 * int(offloaded_layers)
    return every if PAGE_STORE_THREADS <= 0 else min(2 * PAGE_STORE_THREADS + 2, every)


def _page_store_pool() -> concurrent.futures.ThreadPoolExecutor:
    """The store threads, made again when :data:`PAGE_STORE_THREADS` changed (a probe's A/B)."""
    global _store_pool
    if _store_pool is None or _store_pool[0] != PAGE_STORE_THREADS:
        if _store_pool is not None:  # its queued stores still run; its idle threads then end
            _store_pool[1].shutdown(wait=False)
        _store_pool = (PAGE_STORE_THREADS, concurrent.futures.ThreadPoolExecutor(
            max(1, PAGE_STORE_THREADS), thread_name_prefix="page-store"))
    return _store_pool[1]


def _store_pages(pool: jax.Array, pages: np.ndarray, staged: jax.Array) -> None:
    """Write ``staged [n + pad, Hkv, bs, D]``, a layer's blocks on their way to pinned host
    memory, into the pinned page ``pool [N, Hkv, bs, D]`` at ``pages int[n]``: pinned to pinned,
    a NumPy copy that releases the GIL (``host_view`` waits for the blocks to land)."""
    host_view(pool)[pages] = host_view(staged)[:pages.size]


class StateBuilder:
    """A :class:`TieredState` made one layer at a time: each layer's device K/V becomes
    its device tier (pool, ring, method state) and, for an offloaded layer, a host tier
    (asynchronous copies to pinned memory), and is then dropped. ``runner``: the
    :class:`~models.runtime.tiered.TieredRunner` (not imported: it imports this module)."""

    def __init__(self, runner, lengths, max_len: int, pages: HostPages | None = None,
                 into: tuple | None = None, empty: bool = False):
        """``empty``: the rows are one-token rows of zeros built by :meth:`add_empty` (no batch
        of K/V prefilled: the capacity check counts one row's prefill, the engine's)."""
        lengths_np = np.asarray(lengths, np.int32).copy()
        lengths = jnp.asarray(lengths_np)
        batch = int(lengths.shape[0])
        self.runner, self.max_len = runner, max_len
        self.pool = runner._pool(max_len, batch)
        runner.check_capacity(batch, max_len, prefill_rows=1 if empty else None)
        self.layout = runner._layout(batch, max_len) if runner.mesh is not None else None
        if self.layout is None:
            self.dev, self.pinned = device_sharding(runner.sharding), pinned_host_sharding(runner.sharding)
        else:
            self.dev, self.pinned = self.layout.rows, self.layout.host_tier
            lengths = jax.device_put(lengths, self.dev)
        self.lengths = lengths
        self.layers, self.host = [], []
        self.pages, self._page_saves, self.into = None, [], None
        self._stores: list[concurrent.futures.Future] = []  # page stores in flight (PAGE_STORE_THREADS)
        if into is not None and runner.host_pages is None:
            raise ValueError("into= is a paged host tier's: the runner has no host_pages")
        if runner.host_pages is not None:
            bs = runner.method.offload_block_size
            if pages is None:
                pages = HostPages(runner.host_pages, batch, max_len // bs, own=True)
                for row in range(batch):  # the prompt's blocks and the first step's position
                    pages.ensure(row, int(lengths_np[row]) // bs + 1)
            if pages.table.shape != (batch, max_len // bs) or pages.num_pages != runner.host_pages:
                raise ValueError(f"a host page table of {pages.table.shape} over {pages.num_pages} pages for a batch "
                                 f"of {batch} x {max_len // bs} blocks over {runner.host_pages}")
            self.pages = pages
            if into is not None and (pages.own or len(into) != runner.num_layers):
                raise ValueError("into= writes a caller's page pools: pass the caller's table (pages, own=False) "
                                 "and one host tier per layer")
            self.into = into
            # the (row, block, page) of every block the prompts filled that has a page
            filled = -(-lengths_np // bs)
            rows, blocks = np.nonzero(np.arange(max_len // bs)[None] < filled[:, None])
            at = pages.table[rows, blocks]
            keep = at != NULL_PAGE
            self._filled = rows[keep], blocks[keep], at[keep]

    def add(self, i: int, k, v, q_last) -> None:
        r = self.runner
        assert i == len(self.layers), (i, len(self.layers))
        spec = r.plan.specs[i]
        m = r.method if spec.sparse else None
        finish = (finish_layer(m, spec, r.offloaded[i], self.pool, r.shared) if self.layout is None
                  else self.layout.finish[i])
        entry, hk, hv = finish(k, v, self.lengths, q_last, r.layer_data(i))
        del k, v
        # committed to the device, as the decode program's outputs are (the host tier is):
        # an uncommitted first state would compile the decode program a second time
        # (a shard_map's outputs are committed to the mesh already)
        self.layers.append(jax.device_put(entry, self.dev) if self.layout is None else entry)
        if r.offloaded[i] and self.pages is not None:
            self.host.append(self._paged_host(i, hk, hv))
        else:
            self.host.append(HostLayer(jax.device_put(hk, self.pinned), jax.device_put(hv, self.pinned))  # async D2H
                             if r.offloaded[i] else None)

    def add_empty(self, i: int) -> None:
        """Layer ``i`` of one-token rows of zeros, as :meth:`add` of zero K/V and queries makes
        it, without the batch's K/V on the device for an offloaded layer (its tiers come from
        zeros made inside one program; paged host tier only: its pools are zeros from the host)."""
        r = self.runner
        assert i == len(self.layers), (i, len(self.layers))
        cfg, dt = r.local_cfg, r.model.dtype
        b = int(self.lengths.shape[0])
        kv_shape = (b, cfg.num_kv_heads, self.max_len, cfg.head_dim)
        if not r.offloaded[i] or self.pages is None or self.layout is not None:
            self.add(i, jnp.zeros(kv_shape, dt), jnp.zeros(kv_shape, dt), jnp.zeros((b, cfg.num_heads, cfg.head_dim), dt))
            return
        spec = r.plan.specs[i]
        run = empty_offloaded_layer(r.method, spec, self.pool, r.shared, batch=b, num_kv_heads=cfg.num_kv_heads,
                                    max_len=self.max_len, head_dim=cfg.head_dim, num_q_heads=cfg.num_heads,
                                    dtype=jnp.dtype(dt))
        self.layers.append(jax.device_put(run(self.lengths, r.layer_data(i)), self.dev))
        bs = r.method.offload_block_size
        self.host.append(self._paged_host(i, None, None, like=(cfg.num_kv_heads, bs, cfg.head_dim, jnp.dtype(dt))))

    def _paged_host(self, i: int, hk, hv, like: tuple | None = None) -> HostLayer:
        """Layer ``i``'s page pools ``[N, Hkv, bs, D]`` in pinned host memory (zeros put from the
        host: nothing of the pool's size on the device; or ``into``'s), and its prompt blocks
        gathered on the device and copied asynchronously into pinned staging buffers, stored into
        their pages by the store threads while the next layers run (by :meth:`finish` where
        :data:`PAGE_STORE_THREADS` is 0)."""
        # like: (Hkv, bs, D, dtype) where no block layout was made (add_empty: nothing to store)
        hkv, bs, d, dtype = like if hk is None else (hk.shape[1], hk.shape[3], hk.shape[4], hk.dtype)
        shape = (self.pages.num_pages, hkv, bs, d)
        if self.into is not None:
            pk, pv = self.into[i].k, self.into[i].v
            if pk.shape != shape or pk.dtype != dtype:
                raise ValueError(f"layer {i}: page pools {pk.shape} {pk.dtype}, the prompt's pages are {shape} "
                                 f"{dtype}")
        else:
            # zeros from the host, one layer's pool at a time (waited for: at most one layer's NumPy
            # zeros alive beside the pinned pools; nothing of the pool's size on the device)
            pk, pv = (jax.block_until_ready(jax.device_put(np.zeros(shape, dtype), self.pinned))
                      for _ in range(2))
        rows, blocks, pages = self._filled
        if rows.size and hk is None:
            raise ValueError(f"layer {i}: blocks with pages to store and no K/V (add_empty builds rows of zeros)")
        if rows.size:
            # the lists padded (their last entry repeated): few compilations of the gather, and
            # staging buffers the capacity check counts (capacity.staged_rows)
            pad = capacity.staged_rows(rows.size) - rows.size
            rows, blocks = (jnp.asarray(np.pad(a, (0, pad), mode="edge").astype(np.int32)) for a in (rows, blocks))
            # [n + pad, Hkv, bs, D] copied asynchronously into pinned staging buffers (XLA's pinned
            # pool, reused prefill to prefill): the device copies go once the transfers land, and
            # the host side is a DMA into locked memory. Until 2026-12-06 they went to NumPy
            # (`np.asarray` at the prefill's end): fresh pageable buffers, whose first touch costs
            # page faults on 9.1 GB for a 64K prompt, and 9.1 GB of blocks held on the device until
            # then (likely benchmark C's 10-row OOM, docs/serving.md)
            ks, vs = (jax.device_put(h[rows, :, blocks], self.pinned) for h in (hk, hv))
            if PAGE_STORE_THREADS > 0:  # stored while the next layers run, not after the last
                run = _page_store_pool()
                # a few layers' staging buffers at a time (each freed once its store ran)
                live = [f for f in self._stores if not f.done()]
                excess = len(live) + 2 - 2 * PAGE_STORE_THREADS
                if excess > 0:  # the oldest first: they were submitted first
                    concurrent.futures.wait(live[:excess])
                self._stores += [run.submit(_store_pages, pk, pages, ks), run.submit(_store_pages, pv, pages, vs)]
            else:
                self._page_saves.append((pk, pv, pages, ks, vs))
        return HostLayer(pk, pv)

    def drain(self) -> list[concurrent.futures.Future]:
        """Wait for the page stores in flight and return them, their errors not raised: a prefill
        given up (failed or cancelled mid-way) calls it before its request's pages go back to the
        pool, so no store lands in a page another request holds by then; :meth:`finish` raises
        their errors."""
        stores, self._stores = self._stores, []
        concurrent.futures.wait(stores)
        return stores

    def finish(self) -> TieredState:
        r = self.runner
        assert len(self.layers) == r.num_layers
        cache = KVCache(tuple(self.layers), jax.device_put(self.lengths, self.dev), self.max_len)
        r._compile_save(cache, int(self.lengths.shape[0]))
        host = tuple(self.host)
        if self.pages is not None:
            for f in self.drain():  # all landed before one's error is raised
                f.result()
            for pk, pv, pages, ks, vs in self._page_saves:
                _store_pages(pk, pages, ks)
                _store_pages(pv, pages, vs)
            self._page_saves = []
            table = jax.device_put(jnp.asarray(self.pages.table.copy()), self.dev)
            host = tuple(None if h is None else dataclasses.replace(h, table=table) for h in host)
            self.pages.dirty = False
        return TieredState(cache, host, np.asarray(self.lengths).copy(), self.max_len, pages=self.pages)


class PrefillJob:
    """A layer-by-layer prefill that can stop between layers (SparseServe's
    layer-segmented prefill, §3.4): :meth:`advance` runs the next layers, each
    layer's K/V goes to its tiers (the host, for an offloaded layer) and is freed
    before the next, so the device holds one layer of the prompt's KV at a time; a
    serving engine runs a decode step between segments. The programs, and so the
    numbers, are those of :meth:`TieredRunner.prefill`."""

    def __init__(self, runner, tokens, lengths, max_len: int | None = None,
                 pages: HostPages | None = None, into: tuple | None = None):
        max_len = round_up(int(max_len or runner.model.max_len), runner.method.cache_multiple)
        tokens = jnp.asarray(tokens, jnp.int32)
        lengths = jnp.asarray(lengths, jnp.int32)
        b, t = tokens.shape
        if t >= max_len:
            raise ValueError(f"prompt of {t} tokens leaves no room in a cache of {max_len}")
        self.runner, self.max_len, self.lengths, self.batch = runner, max_len, lengths, b
        if runner.shared:  # every row of this batch decodes: one step of all of them must fit the pool
            off.check_shared_fits(runner.method, runner._pool(max_len, b), max_len, b)
        self.tokens = t
        self.x = runner._embed(runner.model.params, tokens)
        self.carry = runner.method.init_prefill_carry(batch=b, num_kv_heads=runner.local_cfg.num_kv_heads, length=t)
        if self.carry is not None and runner.mesh is not None:
            raise ValueError(f"{runner.method.name}: a prefill carry across layers (Kascade's tiled prefill) is not "
                             f"supported by the layer-by-layer prefill on a mesh yet")
        self.build = StateBuilder(runner, lengths, max_len, pages, into)
        self.layers_done = 0
        self._result = None
        #: chunked prefill of a layer over budget: the chunk size (fixed at the first
        #: over-budget call), the tokens of the current layer done, its K/V so far
        self.chunk: int | None = None
        self.chunk_pos = 0
        self._partial = None  # (kbuf, vbuf, q_last) of the layer in progress
        self.chunks_run = 0

    @property
    def done(self) -> bool:
        return self.layers_done == self.runner.num_layers

    def advance_budget(self, tokens: int) -> bool:
        """Run the next segment within ``tokens`` (prompt tokens x layers; SparseServe's
        ``max_inject_tokens``): ``tokens // T`` whole layers when one layer fits, else
        chunks of the current layer (``tokens`` rounded down to a multiple of 64, at least
        64, fixed by the first such call), each chunk's queries attending the keys of the
        chunks before it. A layer whose prompt attention cannot be chunked (Token Sparse
        Attention, a method's prefill hook, a mesh) runs whole. Returns :attr:`done`."""
        tokens = max(1, int(tokens))
        if self.tokens <= tokens and self._partial is None:
            return self.advance(tokens // self.tokens)
        r = self.runner
        i = self.layers_done
        if r.mesh is not None or not r.driver.chunkable(r.plan.specs[i]):
            return self.advance(1)
        if self.chunk is None:
            self.chunk = max(64, tokens // 64 * 64)
        spent = 0  # at least one chunk; then chunks while the budget lasts, into chunkable layers
        while not self.done and r.driver.chunkable(r.plan.specs[self.layers_done]):
            c = min(self.chunk, self.tokens - self.chunk_pos)
            if spent and spent + c > tokens:
                break
            self._run_chunk(self.chunk_pos, c)
            spent += c
        return self.done

    def _run_chunk(self, start: int, size: int) -> None:
        """Prompt positions ``start .. start + size - 1`` of the current layer; after the
        layer's last chunk its K/V go to the tiers as a whole layer's do."""
        r, params = self.runner, self.runner.model.params
        i = self.layers_done
        spec = r.plan.specs[i]
        if self._partial is None:
            b, t = self.batch, self.tokens
            kv_shape = (b, t, r.local_cfg.num_kv_heads, r.local_cfg.head_dim)
            self._partial = (jnp.zeros(kv_shape, self.x.dtype), jnp.zeros(kv_shape, self.x.dtype),
                             jnp.zeros((b, r.local_cfg.num_heads, r.local_cfg.head_dim), self.x.dtype))
        kbuf, vbuf, q_last = self._partial
        fn = prefill_chunk_fn(r.driver, spec, size)
        with self._drained_on_error():
            self.x, kbuf, vbuf, q_last = fn(params["layers"], self.x, jnp.int32(start), kbuf, vbuf, q_last,
                                            self.lengths, r.layer_data(i))
            self.chunks_run += 1
            self.chunk_pos = start + size
            if self.chunk_pos < self.tokens:
                self._partial = (kbuf, vbuf, q_last)
                return
            k, v = chunked_layer_kv(spec, self.max_len)(kbuf, vbuf, self.lengths)
            del kbuf, vbuf
            self._partial, self.chunk_pos = None, 0
            self.build.add(i, k, v, q_last)
            self.layers_done = i + 1

    def advance(self, layers: int) -> bool:
        """Run up to ``layers`` more layers (at least one); returns :attr:`done`."""
        if self._partial is not None:
            raise RuntimeError("a layer is half done in chunks: continue it with advance_budget")
        with self._drained_on_error():
            return self._advance(layers)

    def _advance(self, layers: int) -> bool:
        r, params = self.runner, self.runner.model.params
        stop = min(r.num_layers, self.layers_done + max(1, int(layers)))
        for i in range(self.layers_done, stop):
            if r.mesh is None:
                fn = prefill_layer_fn(r.driver, r.plan.specs[i], self.max_len)
                self.x, k, v, q_last, self.carry = fn(params["layers"], self.x, self.lengths, r.layer_data(i),
                                                      self.carry)
            else:
                fn = r._layout(self.batch, self.max_len).prompt[i]
                self.x, k, v, q_last = fn(params["layers"], self.x, self.lengths, r.layer_data(i))
            self.build.add(i, k, v, q_last)
            del k, v
            self.layers_done = i + 1
        return self.done

    @contextlib.contextmanager
    def _drained_on_error(self):
        """A layer that fails leaves no page store in flight behind it (its caller frees the pages)."""
        try:
            yield
        except BaseException:
            self.build.drain()
            raise

    def drain(self) -> None:
        """Wait for this prefill's page stores in flight: call it before giving up a prefill
        mid-way (cancelled, preempted) whose request's pages go back to the pool."""
        self.build.drain()

    def result(self):
        """``(logits f32[B, V], TieredState)`` once :attr:`done`."""
        if not self.done:
            raise RuntimeError(f"the prefill ran {self.layers_done} of {self.runner.num_layers} layers")
        if self._result is None:
            r = self.runner
            self._result = (r._head(r.model.params, tfm.last_valid(self.x, self.lengths)), self.build.finish())
            self.x = None
        return self._result
