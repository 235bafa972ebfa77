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
straight into the pool (:func:`~models.serving.pool_programs.prefill_paged_slot`: the model's prefill on a one-row view
whose global layers are the pools read through the request's table, its state and length
written into the slot in the same program), so no one-row cache of ``max_len`` exists (at
128K on the Qwen3-8B shape that row was 18.9 GB) and nothing is copied afterwards. A
prompt's ``n`` choices copy its pages and row (:func:`~models.serving.pool_programs.copy_paged_slot`). A layer-segmented
prompt still goes through a one-row contiguous cache, scattered into its pages on insertion.

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

from models.driver import Driver, init_cache, make_plan
from models.runtime.sharding import paged_cache_specs
from models.runtime.tiered import TieredRunner
from models.sampling import RowSampling, SampleOut
from models.serving.blocks import NULL_BLOCK, BlockManager, PagedRequests, pool_plan
from models.serving.buckets import longest_bucket, padded_prompt, prefill_bucket
from models.serving.pool_programs import decode_rows, paged_programs, sharded_paged_programs
from models.serving.precompile import AheadOfTime
from models.serving.requests import Request
from models.serving.slots import ResidentSlots, WarmupSteps, check_engine_mesh, check_slot_axis, replicated, step_inputs
from sparse_jax.cache import PagedLayer, paged_like
from sparse_jax.offload import capacity

DEFAULT_PAGE = 64  # tokens per page for a method without blocks of its own (dense); the kernels' block
# a request grows by at least this many positions at a time (pages of 16 would change the table every 16 steps)
GROW_TOKENS = 64


def page_size(method) -> int:
    """The page of a paged cache for ``method``: its block (``cache_multiple``) where it
    selects blocks, so a selected block is one page read in place; else 64 tokens."""
    m = int(method.cache_multiple)
    return m if m > 1 else DEFAULT_PAGE


#: The server's chunk for chunked prefill (``--prefill-chunk``), vLLM's token budget for a long-context
#: server. Under the 32K load on the H200 (benchmarks/results/serve_load_chunk_sweep_h200.md) chunks of
#: 1,024 / 2,048 / 4,096 gave mean TTFT 6.1 / 5.7 / 5.5 s; one chunk costs ~61 / 110 / 201 ms late in a
#: 32K prompt (chunk_prefill_h200.md), what a running request's token waits for it.
DEFAULT_PREFILL_CHUNK = 2048


def chunk_tokens(n: int, chunk: int) -> int:
    """The compiled size of each chunk of an ``n``-token prompt prefilled ``chunk`` tokens at a
    time: ``chunk`` (the last one padded), or for a prompt of at most ``chunk`` tokens one chunk of
    the smallest power of two >= 64 that holds it (few compiled programs; at most ``chunk``)."""
    return chunk if n > chunk else min(chunk, max(64, 1 << (n - 1).bit_length()))


def group_rows(prompts: int) -> int:
    """The rows of the program that prefills ``prompts`` short prompts together: the next power
    of two (padding rows write nothing)."""
    return 1 << (prompts - 1).bit_length()


def chunk_kv_len(end: int, page: int, cap: int | None = None) -> int:
    """The keys a chunk ending at position ``end`` gathers from its pages: a power of two (few
    compilations), at least one page, at most ``cap`` (the request's capacity: the last bucket of a
    132,096-token context is that, not 262,144, whose gather and attention would double the
    largest chunk's work and temporaries)."""
    n = max(page, 1 << (end - 1).bit_length())
    return n if cap is None else min(n, cap)


class PagedChunkJob:
    """A prompt prefilled ``chunk`` tokens per iteration through every layer, straight into its
    pages (:meth:`models.driver.Driver.prefill_chunk`), beside the decode steps: the engine's
    ``advance_budget`` / ``done`` / ``result()`` of a segmented prefill. ``r`` holds the
    prompt's pages (reserved at admission); the last chunk writes the method state and the
    length into ``slot``, and ``result()`` is ``(logits f32[1, V], PrefilledRow)``. Every chunk
    is ``chunk`` tokens (the last one padded: past the prompt its positions go to the null
    page), except a prompt of at most ``chunk`` tokens, which is one chunk of the smallest power
    of two >= 64 that holds it: few compiled programs (chunk size x a power-of-two key bucket
    x last or not)."""

    def __init__(self, kv: "PagedSlots", ids, slot: int, r: Request, chunk: int):
        self.kv, self.ids, self.slot, self.chunk = kv, list(ids), slot, chunk
        self.n = len(self.ids)
        kv.check_holds(r, self.n)
        self.table = kv.blocks.table(r.id)  # its pages for the prompt, fixed while it prefills
        self.start = 0
        self.chunks = 0
        #: a prompt longer than a chunk, with the engine's chunks cut by layers
        #: (``PagedSlots.chunk_layer_ranges``): each iteration runs one part of a chunk, the
        #: hidden state carried to the next part
        self.parts = kv.chunk_layer_ranges if self.n > chunk else None
        self.part, self._hidden = 0, None
        self._result = None

    @property
    def done(self) -> bool:
        return self._result is not None

    @property
    def next_tokens(self) -> int:
        """The prompt tokens its next chunk carries, padding included (the engine's budget)."""
        return chunk_tokens(self.n, self.chunk)

    def advance_budget(self, tokens: int | None = None) -> bool:
        """Run the next chunk (``tokens`` is the engine's budget; the chunk size is fixed)."""
        kv, m = self.kv, self.kv.model
        rest = self.n - self.start
        c = self.next_tokens
        last = rest <= c
        lo, hi = self.parts[self.part] if self.parts is not None else (0, None)
        inputs = jnp.asarray(padded_prompt(self.ids[self.start:self.start + c], c, m._pad_id())) if lo == 0 \
            else self._hidden
        what = f"a chunk of the prefill of a {self.n}-token prompt"
        static = dict(kv_len=chunk_kv_len(self.start + c, kv.page, kv.max_len), last=last)
        if self.parts is not None:  # one part of the chunk's layers
            what, static["layers"] = f"layers {lo}-{hi - 1} of {what}", (lo, hi)
        # the logits (last chunk), or a part's hidden state before the chunk's last layers
        out = kv.run_on_pool(kv._chunk, what, (inputs, jnp.int32(self.start), jnp.asarray([self.n], jnp.int32)),
                             self.slot, self.table, wait=False, **static)  # the engine waits: PagedSlots.wait
        if self.parts is not None and self.part + 1 < len(self.parts):  # the next layers, next iteration
            self.part, self._hidden = self.part + 1, out
            return True
        self.part, self._hidden = 0, None
        self.start += c
        self.chunks += 1
        if last:
            self._result = (out, PrefilledRow(self.slot, self.table, self.n))
        return True

    def grouped(self, logits) -> None:
        """Its whole prompt ran in a group of short prompts (:meth:`PagedSlots.run_prompt_group`):
        ``logits f32[1, V]`` are its last token's."""
        self.start, self.chunks = self.n, self.chunks + 1
        self._result = (logits, PrefilledRow(self.slot, self.table, self.n))

    def result(self):
        return self._result


def check_chunked_prefill(model) -> None:
    """ValueError unless every layer of ``model`` can take its prompt in chunks straight into
    pages (:meth:`models.driver.Driver.prefill_chunk`): global layers only (a sliding window's
    ring is not paged), exact prompt attention or Token Sparse Attention's chunk form on each
    (no method prefill hook such as Kascade's tiled prefill)."""
    drv = Driver(model.config, model.method, None)
    for i, spec in enumerate(make_plan(model.config, model.method).specs):
        if spec.kind != "global":
            raise ValueError(f"chunked prefill into pages needs global layers only; layer {i} is {spec.kind!r} "
                             f"(a sliding window): use max_inject_tokens (layer-segmented prefill)")
        if not drv.chunkable(spec, sparse_chunks=True):
            raise ValueError(f"the prompt attention of layer {i} cannot run in chunks (the method "
                             f"{model.method.name!r}'s own prefill): use max_inject_tokens "
                             f"(layer-segmented prefill) or no prefill_chunk")


class PoolLost(RuntimeError):
    """A program that donated the paged engine's whole cache failed: every request's KV is
    gone, so the engine cannot serve on (it stops, and every request gets the error)."""


@dataclasses.dataclass(frozen=True)
class PrefilledRow:
    """A prompt of ``tokens`` tokens prefilled straight into the pool: its pages
    ``table int32[max_len / page]`` (a copy, taken when it ran) and row ``slot``'s state."""

    slot: int
    table: np.ndarray
    tokens: int


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


def paged_footprint(model, slots: int, max_len: int, page: int, prefill_temp_bytes: int = 0,
                    prefill_row: bool = True) -> PagedFootprint:
    """:class:`PagedFootprint` from the caches' shapes (nothing allocated); ``prefill_row``:
    prompts are prefilled into a one-row contiguous cache (a layer-segmented prefill; a whole
    prefill writes the pool)."""
    empty = jax.eval_shape(lambda: paged_like(model.init_cache(slots, max_len), 0, page))
    one = jax.eval_shape(lambda: paged_like(model.init_cache(1, max_len), 1, page))
    block = sum(_nbytes(e.pool_k) + _nbytes(e.pool_v) for e in one.layers if isinstance(e, PagedLayer))
    return PagedFootprint(
        weights=sum(x.nbytes for x in jax.tree.leaves(model.params)),
        per_slot=sum(_nbytes(x) for x in jax.tree.leaves(empty)),
        prefill_row=sum(_nbytes(x) for x in jax.tree.leaves(jax.eval_shape(lambda: model.init_cache(1, max_len))))
        if prefill_row else 0,
        prefill_temporaries=int(prefill_temp_bytes),
        autotune_scratch=capacity.autotune_scratch_bytes(model.params),
        block_bytes=block)


class PagedSlots(PagedRequests):
    """Every slot's KV in one page pool per global layer (module docstring).

    ``num_blocks`` (pages, the null page included): default, on a device with a memory
    limit (a GPU), as many as fit beside the weights, the slots' state and the longest
    prompt's prefill (its temporaries measured by compiling it first), at most what
    ``slots`` full rows use; on the CPU exactly that (no limit to fill). A pool that cannot
    hold one request of ``max_len`` tokens is refused (:class:`CapacityError`)."""

    grow_tokens = GROW_TOKENS

    offloaded = False
    paged = True

    def __init__(self, model, slots: int, max_len: int, unroll: bool, segmented: bool = False,
                 num_blocks: int | None = None, prefill_chunk: int | None = None, group_prompts: bool = True,
                 chunk_parts: int = 1):
        check_engine_mesh(model)
        self.mesh = getattr(model, "mesh", None)  # tensor parallelism: pools split by KV head
        self._inputs = replicated(self.mesh)  # the step's host inputs, on every device (step_inputs)
        layers = model.config.num_layers
        if isinstance(chunk_parts, bool) or not isinstance(chunk_parts, int) or not 1 <= chunk_parts <= layers:
            raise ValueError(f"chunk_parts must be an int in [1, {layers}] (the model's layers), got {chunk_parts!r}")
        if chunk_parts > 1 and prefill_chunk is None:
            raise ValueError("chunk_parts cuts each chunk of a chunked prefill by layers: pass prefill_chunk")
        if chunk_parts > 1 and self.mesh is not None:
            raise ValueError("chunk_parts runs on one device; on a mesh each chunk runs whole")
        #: the model layers of each part of a chunk (prompts longer than a chunk), one part an
        #: iteration: the stall a chunk puts on the decoding rows shrinks by the part count with
        #: no more weight reads; None: whole chunks
        self.chunk_layer_ranges = None if chunk_parts == 1 else tuple(
            (i * layers // chunk_parts, (i + 1) * layers // chunk_parts) for i in range(chunk_parts))
        if self.mesh is not None and segmented and prefill_chunk is None:
            raise ValueError("a paged engine on a mesh prefills prompts into its pages, whole or in chunks "
                             "(prefill_chunk): a layer-segmented prefill (max_inject_tokens alone) runs on one device")
        if prefill_chunk is not None:
            check_chunked_prefill(model)
            segmented = True  # prompts span iterations; their chunks' temporaries are measured below
        # a chunk never exceeds the context: every prompt fits one chunk of max_len tokens, and a
        # larger one (the server's default 2,048 beside --max-len 640) would slice past the pages'
        # gather on a GPU (the engine's budget stays prefill_chunk tokens)
        self.prefill_chunk = None if prefill_chunk is None else min(int(prefill_chunk), max_len)
        #: the iteration's prompt tokens (the engine's budget, which groups of short prompts fill)
        self.prefill_budget = None if prefill_chunk is None else int(prefill_chunk)
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
        #: the programs compiled ahead of time (:meth:`precompile`): the call sites run these
        #: before falling back to the jitted program (which would compile)
        self.aot = AheadOfTime()
        #: short prompts prefilled together (:meth:`run_prompt_group`), and the programs that ran them
        self.grouped_prompts = self.prompt_groups = 0
        self._runner = None
        if self.mesh is None:
            self._step, self._insert, self._prefill, self._copy, self._chunk, self._group = paged_programs(
                model.graphdef, model.config, model.method, unroll)
            # the step of batches with no row in the method's warm-up (WarmupSteps; the same program
            # where the method has none)
            self._steady_step = paged_programs(model.graphdef, model.config, model.method.steady_state(), unroll)[0]
            if not group_prompts:  # short prompts one program each (Engine(group_prompts=False))
                self._group = None
        else:
            self._step, self._insert, self._prefill, self._copy, self._chunk = sharded_paged_programs(
                model, model.method, unroll)
            self._group = None  # over a mesh, short prompts are prefilled one at a time
            steady = model.method.steady_state()
            self._steady_step = self._step if steady is model.method else sharded_paged_programs(
                model, steady, unroll)[0]
        self.warmup = WarmupSteps(slots, model.method.warmup_steps)
        self.last_rows = slots  # the rows the last decode step ran (its batch bucket, decode_rows)

        temps = 0
        limit = capacity.device_budget()
        if limit is not None and self.prefill_chunk is not None:
            temps = self._chunk_temp_bytes()
        elif limit is not None and segmented:
            self._runner = TieredRunner(model, "resident")
            temps = self._runner.prefill_temp_bytes(longest_bucket(max_len), max_len)
        elif limit is not None:
            temps = self._prefill_temp_bytes()
        self.footprint = fp = paged_footprint(model, slots, max_len, self.page, temps,
                                              prefill_row=segmented and self.prefill_chunk is None)
        if limit is None:
            fit = full if num_blocks is None else int(num_blocks)
        else:
            fit = (limit - fp.fixed()) // max(fp.block_bytes, 1)
        asked = num_blocks is not None
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
        #: what bounds the batch ("slots", "device memory" or "asked"), and the line saying so
        self.kv_bound, self.kv_plan = pool_plan(
            num_blocks, self.page, slots, max_len, asked=asked, memory="device memory",
            detail="" if limit is None else f" ({limit / 2**30:.1f} GiB usable, {fp.fixed() / 2**30:.2f} GiB of it "
                                            f"weights, slot state and a prefill's temporaries)")
        if self.mesh is None:
            self.cache = jax.jit(lambda: paged_like(model.init_cache(slots, max_len), num_blocks, self.page))()
        else:  # each device allocates its KV heads' share of the pools
            specs = paged_cache_specs(model.config, model.method, slots, max_len, num_blocks, self.page,
                                      jnp.dtype(model.dtype), model.parallelism)
            self.cache = jax.jit(
                lambda: paged_like(init_cache(model.config, model.method, slots, max_len, model.dtype), num_blocks,
                                   self.page),
                out_shardings=jax.tree.map(lambda sp: jax.sharding.NamedSharding(self.mesh, sp), specs))()
        self.device_bytes = self.cache.nbytes()
        self.block_bytes = fp.block_bytes
        self._table = np.zeros((slots, self.pages_per_request), np.int32)  # the host's block table
        self._lengths = np.zeros(slots, np.int32)  # the host's view of the device lengths
        self._owner: list[int | None] = [None] * slots  # request id per slot
        self._dirty = False  # the table or a length changed outside a step: send both with the next

    # -- blocks ----------------------------------------------------------------------------
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

    def _table_row_changed(self, slot: int, table) -> None:
        self._table[slot] = table
        self._dirty = True

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
    # a layer-segmented prompt is prefilled into a one-row contiguous cache, as the resident
    # engine does (its methods, on this class's model, max_len and runner), then scattered
    blocks_loaded = ResidentSlots.blocks_loaded
    settle = ResidentSlots.settle

    @staticmethod
    def wait(logits, row) -> None:
        """Block until a prefill's outputs exist. A prefill into the pool (``row`` a
        :class:`PrefilledRow`: its last chunk is not waited for when it is issued) that failed
        lost the pool: :class:`PoolLost`."""
        if not isinstance(row, PrefilledRow):
            jax.block_until_ready((logits, row))
            return
        try:
            jax.block_until_ready(logits)
        except Exception as e:  # the cache was donated: nothing can go on
            raise PoolLost(f"the prefill of a {row.tokens}-token prompt into the KV pool failed, and the pool "
                           f"with it: {type(e).__name__}: {str(e)[:400]}") from e

    def start_prefill(self, ids, slot: int | None = None, r: Request | None = None):
        """A prompt prefilled over several iterations: with ``prefill_chunk``, chunks through
        every layer into ``r``'s pages (:class:`PagedChunkJob`, ``slot`` and ``r`` given); else
        layer-segmented into a one-row cache (:meth:`ResidentSlots.start_prefill`)."""
        if self.prefill_chunk is not None:
            return PagedChunkJob(self, ids, slot, r, self.prefill_chunk)
        return ResidentSlots.start_prefill(self, ids)

    def _temp_bytes(self, program, *head, **static) -> int:
        """The temporaries of ``program(params, *head, cache, slot, pages, **static)`` (the
        prefill into the pool or a chunk of it: ``head`` the shapes before the cache), from
        XLA's buffer assignment, compiled from shapes with a pool of one request's pages (the
        pool is donated and aliased, so its size does not change them)."""
        m, i32 = self.model, jnp.int32
        cache = jax.eval_shape(lambda: paged_like(m.init_cache(self.slots, self.max_len),
                                                  self.pages_per_request + 1, self.page))
        tail = (jax.ShapeDtypeStruct((), i32), jax.ShapeDtypeStruct((self.pages_per_request,), i32))
        stats = program.lower(m.params, *head, cache, *tail, **static).compile().memory_analysis()
        return int(getattr(stats, "temp_size_in_bytes", 0) or 0)

    def _prefill_temp_bytes(self) -> int:
        """The temporaries of the longest prompt's prefill into the pool."""
        i32 = jnp.int32
        bucket = prefill_bucket(self.max_len - 1, self.max_len)
        return self._temp_bytes(self._prefill, jax.ShapeDtypeStruct((1, bucket), i32), jax.ShapeDtypeStruct((1,), i32))

    def _chunk_temp_bytes(self) -> int:
        """The temporaries of the largest chunk program: a full chunk ending at ``max_len``, the
        last one (it also computes the method state from the whole prompt's pages)."""
        i32 = jnp.int32
        return self._temp_bytes(self._chunk, jax.ShapeDtypeStruct((1, self.prefill_chunk), i32),
                                jax.ShapeDtypeStruct((), i32), jax.ShapeDtypeStruct((1,), i32),
                                kv_len=chunk_kv_len(self.max_len, self.page, self.max_len), last=True)

    def program_shapes(self, sampled=(False, True), shortest_prompt: int = 1) -> list[tuple[str, Any, tuple, dict]]:
        """Every program this engine can run on its own calls, as ``(what, program, args,
        static)`` with ``args`` abstract where they vary (the params and the cache are the
        engine's own): the decode step on each batch bucket (:func:`decode_rows`) for greedy
        and sampled batches without filters, penalties, bias or log-probabilities (the
        common request; another option compiles when first used), and the prompt programs
        (each chunk size x key bucket x last or not, :class:`PagedChunkJob`, and each group of
        short prompts' rows x size, :meth:`run_prompt_group`; or each whole prefill bucket);
        ``shortest_prompt``: leave out the programs only shorter prompts run
        (a one-chunk prompt's chunk sizes, the last chunks of shorter prompts, the
        whole-prefill buckets below its own)."""
        if isinstance(shortest_prompt, bool) or not isinstance(shortest_prompt, int) or shortest_prompt < 1:
            raise ValueError(f"shortest_prompt must be an int >= 1, got {shortest_prompt!r}")
        i32, sds = jnp.int32, jax.ShapeDtypeStruct
        params, cache = self.model.params, self.cache
        slot, pages = sds((), i32), sds((self.pages_per_request,), i32)
        out = []
        # the warm-up's step (AsyncSpade's dense_steps) and the steady one, where they differ; its
        # host inputs as step() places them (step_inputs: on a mesh, on every device)
        steps = [("", self._step)] + ([(", past the warm-up", self._steady_step)]
                                      if self._steady_step is not self._step else [])
        row = functools.partial(sds, (self.slots,), sharding=self._inputs)
        for rows in sorted({decode_rows(self.slots, u) for u in range(1, self.slots + 1)}):
            for s in sampled:
                f32 = row(jnp.float32)
                sampling = RowSampling(row(jnp.uint32), row(i32), f32, f32, sampled=bool(s))
                for which, step in steps:
                    out.append((f"decode step, {rows} rows, {'sampled' if s else 'greedy'}{which}", step,
                                (params, row(i32), cache, row(bool), sampling), {"rows": rows}))
        prompt = sds((1,), i32)
        if self.prefill_chunk is None:
            for bucket in sorted({prefill_bucket(n, self.max_len) for n in range(min(shortest_prompt, self.max_len - 1),
                                                                                  self.max_len)}):
                out.append((f"prefill of {bucket} tokens", self._prefill,
                            (params, sds((1, bucket), i32), prompt, cache, slot, pages), {}))
            return out
        c, longest = self.prefill_chunk, self.max_len - 1
        cap = self.max_len  # a multiple of the page: a request's pages
        sizes = self.one_chunk_sizes(shortest_prompt)
        ones = {(size, chunk_kv_len(size, self.page, cap), True) for size in sizes}
        many = set()
        for start in range(c, longest, c) if longest > c else ():  # the chunks of longer prompts
            many.add((c, chunk_kv_len(start, self.page, cap), False))  # the one ending at `start`, continued
            if start + c >= shortest_prompt:  # the last one, of a prompt of start+1 .. start+c tokens
                many.add((c, chunk_kv_len(start + c, self.page, cap), True))
        parts = self.chunk_layer_ranges
        whole = ones | (many if parts is None else set())
        for size, kv_len, last in sorted(whole):
            out.append((f"chunk of {size} tokens, keys {kv_len}{', last' if last else ''}", self._chunk,
                        (params, sds((1, size), i32), sds((), i32), prompt, cache, slot, pages),
                        {"kv_len": kv_len, "last": last}))
        hidden = sds((1, c, self.model.config.hidden_size), jnp.dtype(self.model.dtype))
        for size, kv_len, last in sorted(many) if parts is not None else ():  # a longer prompt's chunks, by part
            for lo, hi in parts:
                out.append((f"chunk of {size} tokens, keys {kv_len}{', last' if last else ''}, layers {lo}-{hi - 1}",
                            self._chunk, (params, sds((1, size), i32) if lo == 0 else hidden, sds((), i32), prompt,
                                          cache, slot, pages), {"kv_len": kv_len, "last": last, "layers": (lo, hi)}))
        for rows, size in self.prompt_group_shapes(sizes):  # short prompts prefilled together
            out.append((f"prefill of {rows} prompts of {size} tokens", self._group,
                        (params, sds((rows, size), i32), sds((rows,), i32), cache, sds((rows,), i32),
                         sds((rows, self.pages_per_request), i32)), {}))
        return out

    def one_chunk_sizes(self, shortest_prompt: int = 1) -> list[int]:
        """The compiled sizes (:func:`chunk_tokens`) of the one-chunk prompts of at least
        ``shortest_prompt`` tokens, ascending (a chunked engine; none otherwise)."""
        c, longest = self.prefill_chunk, self.max_len - 1
        if c is None:
            return []
        # the bucket of prompts of at most n tokens, for each n: none comes below shortest_prompt
        top = min(c, longest)
        return sorted({chunk_tokens(n, c) for n in {top} | {1 << k for k in range(top.bit_length())}
                       if n >= shortest_prompt})

    def prompt_group_shapes(self, sizes) -> list[tuple[int, int]]:
        """``(rows, size)`` of each program that prefills short prompts together
        (:meth:`run_prompt_group`), for one-chunk prompts of the chunk ``sizes``: rows 2, 4, ... up
        to the slots' power of two, within the chunk budget; none where prompts are not grouped."""
        out = []
        grouping = self._group is not None and self.prefill_budget is not None  # chunked prompts only
        for size in sorted(set(sizes)) if grouping else ():
            rows = 2
            while rows <= group_rows(self.slots) and rows * size <= self.prefill_budget:
                out.append((rows, size))
                rows *= 2
        return out

    def cancel_precompile(self) -> None:
        """Drop the background compiles not yet started (:meth:`AheadOfTime.cancel`)."""
        self.aot.cancel()

    @property
    def programs_compiling(self) -> int:
        """Programs :meth:`precompile` is still compiling in the background."""
        return self.aot.compiling

    def precompile(self, *, workers: int | None = None, sampled=(False, True), shortest_prompt: int = 1,
                   progress: bool = False, background: bool = False) -> dict:
        """Compile every program of :meth:`program_shapes` now, in ``workers`` threads, and run
        them ahead of the jitted ones (:class:`~models.serving.precompile.AheadOfTime`): the
        first requests of each size then wait for no compiler. Returns ``{"programs": n,
        "seconds": s, "failed": [...], "from_cache": k}`` (``k`` loaded from the compile cache,
        :func:`~models.serving.precompile.use_compile_cache`): a program that fails to compile here (say, the
        device's memory for autotuning beside the pool) is left to compile when first used, as
        without this, and named in ``failed``; ``sampled`` and ``shortest_prompt``: as
        :meth:`program_shapes` (what the requests will ask); ``progress``: a bar on stderr.

        ``background``: return at once, the programs compiling in the threads, smallest first
        (the decode steps, then the chunks by key bucket), so serving starts while the long
        buckets compile (at a 128K context they took minutes each on the H200): a call whose
        program is still compiling waits for that compile instead of compiling it again
        (``aot.waited_calls``); :attr:`programs_compiling` counts what is left, failures go
        to ``aot.failed``. Returns ``{"programs": n submitted, "seconds": 0.0, "failed":
        [], "background": True}``."""
        return self.aot.compile(self.program_shapes(sampled, shortest_prompt), workers=workers, progress=progress,
                                background=background)

    def groupable(self, job) -> bool:
        """Whether ``job`` may be prefilled in a group of short prompts (:meth:`run_prompt_group`):
        a chunked prompt of one chunk that has not started, on one device, and short enough that
        a sparse prefill (TSA) leaves it whole: the group runs the whole prefill, where TSA drops
        tokens of a prompt longer than ``min_tokens + window``, while its one-chunk program keeps
        them all (nothing precedes the chunk), so such a prompt runs alone, as it would."""
        if self._group is None or not isinstance(job, PagedChunkJob) or job.chunks or job.n > job.chunk:
            return False
        tsa = self.model.method.sparse_prefill()
        return tsa is None or job.n <= tsa.min_tokens + tsa.window

    def run_prompt_group(self, jobs: list[PagedChunkJob]) -> int:
        """Prefill several short prompts (each :meth:`groupable`) in one program: ``P`` =
        :func:`group_rows` rows of the longest one's chunk size ``S``, each prompt straight into
        its pages and its slot (:func:`prefill_paged_rows`), so one weight read serves them all
        where one chunk program each read the weights once per prompt. Each job then holds its
        result (not waited for: :meth:`wait`). Returns the prompt tokens the program ran
        (``P x S``, padding included: the engine's budget). Its failure loses the pool:
        :class:`PoolLost`."""
        if not jobs or not all(self.groupable(j) for j in jobs):
            raise ValueError("run_prompt_group takes short chunked prompts that have not started")
        rows, size = group_rows(len(jobs)), max(j.next_tokens for j in jobs)
        pad = self.model._pad_id()
        tokens = np.full((rows, size), pad, np.int32)
        lengths = np.ones(rows, np.int32)  # padding rows: one token, written to the null page
        slots = np.full(rows, self.slots, np.int32)  # padding rows: out of range, dropped
        tables = np.zeros((rows, self.pages_per_request), np.int32)
        for i, j in enumerate(jobs):
            tokens[i, :j.n], lengths[i], slots[i], tables[i] = j.ids, j.n, j.slot, j.table
        logits = self.run_on_pool(self._group, f"the prefill of {len(jobs)} prompts of up to {size} tokens",
                                  (jnp.asarray(tokens), jnp.asarray(lengths)), slots, tables, wait=False)
        for i, j in enumerate(jobs):
            j.grouped(logits[i:i + 1])
        self.grouped_prompts += len(jobs)
        self.prompt_groups += 1
        return rows * size

    def prefill(self, ids, slot: int | None = None, r: Request | None = None):
        """``(logits f32[1, V], row)`` of prompt ``ids``. Given the ``slot`` and the request
        ``r`` (which holds the prompt's pages), the prompt goes straight into the pool
        (:func:`~models.serving.pool_programs.prefill_paged_slot`) and ``row`` is a :class:`PrefilledRow` for :meth:`insert`;
        the prefill is waited for here. It donates the whole cache, so its failure loses
        every request's KV: :class:`PoolLost`. Without them, a one-row contiguous cache (as
        the resident engine's)."""
        if slot is None:
            return ResidentSlots.prefill(self, ids)
        m, n = self.model, len(ids)
        self.check_holds(r, n)
        tokens = padded_prompt(ids, prefill_bucket(n, self.max_len), m._pad_id())
        table = self.blocks.table(r.id)
        logits = self.run_on_pool(self._prefill, f"the prefill of a {n}-token prompt",
                                  (jnp.asarray(tokens), jnp.asarray([n], jnp.int32)), slot, table, wait=True)
        return logits, PrefilledRow(slot, table, n)

    def run_on_pool(self, program, what: str, head: tuple, slot, table: np.ndarray, *, wait: bool,
                    **static):
        """The logits of ``program(params, *head, cache, slot, table, **static)`` (``slot`` an int,
        or ``int32[P]`` with ``table [P, W]`` for a group of prompts), a program that
        writes a prompt into the pool (the prefill, or a chunk of it), the whole cache donated
        and replaced; ``wait``: block until it ran (the prompt's last program). Its failure
        loses every request's KV: :class:`PoolLost`, saying ``what`` failed."""
        try:
            args = (self.model.params, *head, self.cache, jnp.asarray(slot, jnp.int32), jnp.asarray(table))
            logits, self.cache = self.aot.run(program, args, static)
            if wait:
                jax.block_until_ready(logits)
        except Exception as e:  # the cache was donated: nothing can go on
            raise PoolLost(f"{what} into the KV pool failed, and the pool with it: "
                           f"{type(e).__name__}: {str(e)[:400]}") from e
        return logits

    def insert(self, row, slot: int, r: Request) -> None:
        """Put the prefilled ``row`` of ``r`` (which holds its prompt's pages) in ``slot``: a
        :class:`PrefilledRow` already there is only recorded, one of another slot (a prompt's
        ``n`` choices) is copied, pages and state; a contiguous row is scattered into the pages."""
        n = r.prefill_len
        self.check_holds(r, n)
        table = self.blocks.table(r.id)
        if isinstance(row, PrefilledRow):
            if row.tokens != n:
                raise RuntimeError(f"request {r.id}'s {n} tokens were prefilled as {row.tokens}")
            if row.slot != slot:
                self.cache = self._copy(self.cache, jnp.int32(row.slot), jnp.int32(slot), jnp.asarray(row.table),
                                        jnp.asarray(table))
        else:
            self.cache = self._insert(self.cache, row, jnp.int32(slot), jnp.asarray(table))
        self._owner[slot] = r.id
        self._table[slot] = table
        self._lengths[slot] = n
        self._dirty = True
        self.warmup.inserted(slot)

    def step(self, tokens, active, sampling: RowSampling) -> SampleOut:
        if self._dirty:  # copies: the host arrays change while the step is queued
            table, lengths = self._table.copy(), self._lengths.copy()
            if self.mesh is None:
                table, lengths = jnp.asarray(table), jnp.asarray(lengths)
            else:  # as the step leaves them (their specs'), not on one device: see step_inputs
                table, lengths = jax.device_put((table, lengths), (self.cache.block_table.sharding,
                                                                   self.cache.lengths.sharding))
            self.cache = dataclasses.replace(self.cache, block_table=table, lengths=lengths)
            self._dirty = False
        active = np.asarray(active, bool)
        # the decode batch bucket: the rows up to the last active one (the engine fills the lowest free
        # slot first), rounded up to a power of two
        used = int(np.flatnonzero(active)[-1]) + 1 if active.any() else 1
        self.last_rows = decode_rows(self.slots, used)
        step = self._step if self.warmup.warming(active) else self._steady_step
        tokens, active_, sampling = step_inputs(self._inputs, tokens, active, sampling)
        args = (self.model.params, tokens, self.cache, active_, sampling)
        out, self.cache = self.aot.run(step, args, {"rows": self.last_rows})
        self._lengths += active  # the step advances the active rows only
        self.warmup.stepped(active)
        return out

    def check(self) -> None:
        """AssertionError unless the blocks are consistent and every slot's table row is its
        request's (tests, the soak)."""
        self.blocks.check()
        for slot, rid in enumerate(self._owner):
            want = self.blocks.table(rid) if rid is not None else np.zeros(self.pages_per_request, np.int32)
            assert (self._table[slot] == want).all(), f"slot {slot}: its table row is not its request's"


