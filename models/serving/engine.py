"""A serving engine: requests prefilled, inserted into decode slots, decoded together.

JetStream's structure (prefill / insert / generate over a fixed number of
slots) on this project's pure functions, with SparseServe's scheduler limits
(``docs/serving.md``):

* **Slots.** One decode cache of ``slots`` rows (``model.init_cache(slots,
  max_len)``). Every leaf of it, the method's per-layer state included, has the
  batch as its leading axis: :func:`check_slot_axis` proves it on the cache's
  shapes before anything compiles, because :func:`insert_slot` writes a
  request's row into every leaf at index ``slot``.
* **Prefill** runs one request at a time, ``tokens int32[1, T_bucket]`` into a
  fresh one-row cache of the same ``max_len`` (``model.fns.prefill``, one
  program per prompt bucket), and samples the first token from its logits.
  With ``max_inject_tokens`` it is layer-segmented (SparseServe §3.4): each
  iteration runs a segment of the prompt's layers, or a chunk of one layer
  (:class:`models.runtime.tiered.PrefillJob`), beside the decode step, the finished
  layers' KV going to the prompt's row (resident) or to the host tier (offloaded).
* **Insert** writes that one-row cache into the free slot (one jitted program,
  the decode cache donated).
* **Generate**: one jitted program per step over all slots (the cache
  donated): the model's decode step, then per-row sampling (greedy, or
  temperature / top-p from each request's own seed). Rows whose slot is free
  are masked: their ``lengths`` do not advance, so a free row never runs past
  its capacity; whatever it writes is overwritten by the next insert.
* **One step ahead**: step t+1 is issued before step t's tokens are read, so
  the device runs while the host reports tokens (:meth:`Engine._decode`).
* **Ends.** A slot is freed on an end-of-sequence token, ``max_tokens``, a
  stop string, or cancellation (:meth:`Engine.cancel`, e.g. a client that
  disconnected).

Threading: :meth:`Engine.start` runs :meth:`Engine.iterate` in a thread of
its own; :meth:`Engine.submit` and :meth:`Engine.cancel` may be called from any
thread. Each request reports through its ``on_event`` callback, called on the
engine's thread (the server forwards to its asyncio loop).

Where the KV lives: :class:`ResidentSlots` (every slot on the device, the
engine's own step program) or, with ``offload=True``, :class:`OffloadedSlots`
(every KV block in pinned host memory, a device pool per slot:
:class:`models.runtime.tiered.TieredRunner` with an active-row mask).

The pieces live beside this loop: the request types in :mod:`models.serving.requests`,
the slot back-ends and their jitted programs in :mod:`models.serving.slots` (paged:
:mod:`models.serving.paged`), the prompt side (admission into prefills, whole, segmented and
chunked prefills, insertion) in :mod:`models.serving.prompt_prefill`, and the
scheduler in :mod:`models.serving.scheduler`. The scheduler (:class:`Scheduler`) is FCFS under R_max requests, T_max tokens
per iteration and M_avl device bytes, with SparseServe's first-fit admission
on a working-set estimate (Alg. 1): the reservation when resident, the blocks
used over the last 12 steps (measured on the device) when offloaded.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from models import programs
from models.api import round_up
from models.runtime.cache_rank import CacheRankModel
from models.serving.requests import Event, Request, SamplingParams, TokenLogprob
from models.serving.scheduler import Scheduler
from models.serving.paged import PagedSlots, page_size
from models.serving.prompt_prefill import Occupant, PromptPrefill, describe
from models.serving.slot_sampling import SlotSampling, token_logprob
from models.serving.offloaded_slots import OffloadedSlots
from models.serving.slots import ResidentSlots, merge_tokens, replicated
from models.serving.warmup import warm_up



def placed_device(model):
    """The device an unsharded model's params all live on, when that is not jax's default
    device (a replica placed with :func:`models.serving.replicas.place`); None otherwise (the
    default device, or a sharded model, whose mesh places its arrays)."""
    if getattr(model, "mesh", None) is not None:
        return None
    devices = {d for x in jax.tree.leaves(model.params) if isinstance(x, jax.Array) for d in x.devices()}
    if len(devices) != 1:
        return None
    (device,) = devices
    return None if device == jax.devices()[0] else device


def device_scope(device):
    """``jax.default_device(device)`` (arrays the engine makes from nothing land there), or a
    no-op for None."""
    import contextlib

    return contextlib.nullcontext() if device is None else jax.default_device(device)


class Engine(PromptPrefill):
    """Continuous batching over ``slots`` decode rows (module docstring).

    Args:
      model: a :class:`models.api.Model` (resident KV; any registered method).
      slots: decode rows, the most requests decoding at once.
      max_len: cache capacity per slot (prompt + output); default the model's ``max_len``.
      max_requests: R_max (default ``slots``).
      max_tokens_per_iter: T_max (default ``max_len + slots``: one full prompt per iteration;
        with ``prefill_chunk``, ``prefill_chunk + slots``, a prompt counting its first chunk).
      kv_bytes: M_avl in bytes (default the decode cache's bytes: every slot full).
      stop_ids: token ids that end a request (default the model's end-of-sequence ids).
      offload: KV blocks in pinned host memory (:class:`OffloadedSlots`; a method whose
        selection names blocks), else every slot resident (:class:`ResidentSlots`).
      pool_slots: offloaded: resident block slots per (row, KV head), or with ``pool="shared"``
        per KV head for all slots (default: the runner's; shared: slots x the per-row default).
      pool: offloaded: "per_row" (default: a pool per slot) or "shared" (one pool per layer and KV
        head for every slot, LRU across slots: SparseServe's pool, where one request's working set
        can evict another's). With a shared pool the working-set admission keeps the running
        requests' working sets within M_avl (default: the pool's bytes), and R_max is capped at
        ``pool_slots // blocks per step`` so one step's blocks always fit the pool.
      paged: resident KV in one pool of pages shared by every request, a block table per slot
        (:class:`models.serving.paged.PagedSlots`): a request holds the pages its tokens fill,
        not ``max_len``; admission goes by free pages (M_avl = the pool), and when a running
        request cannot grow the newest one is preempted (its pages freed, requeued at the
        front, recomputed from its prompt and output when readmitted: vLLM's recompute
        preemption). ``max_len`` is rounded up to the page. With ``offload=True`` the pages
        are the host tier's (:class:`OffloadedSlots` ``paged=True``: a page is a block of
        every offloaded layer in pinned host memory; the device tier per slot is as without
        paging), with the same admission, growth, preemption and ``kv_blocks_*`` counts.
      kv_blocks: paged, resident: pages in the pool, the null page included (default: as many as
        fit the device, at most every slot full).
      host_pages: paged and offloaded: host pages, the null page included (default: as many as
        fit the pinned host memory beside one prompt's prefill, at most every slot full; refused
        before anything is allocated when they cannot hold one request of ``max_len``).
      prefill_chunk: paged: chunked prefill (vLLM's, SARATHI's): a prompt runs this many tokens
        per iteration through every layer, straight into its pages, beside the decode step
        (:class:`models.serving.paged.PagedChunkJob`), so a running request waits at most one
        chunk for it. Needs global layers only and exact prompt attention
        (:func:`models.serving.paged.check_chunked_prefill`). ``prefill_chunk`` is also the
        iteration's prompt-token budget: prompts shorter than it prefill several per iteration
        (in arrival order, while their chunks, each a power of two >= 64 tokens, fit the
        budget), those starting together as the rows of one program (``group_prompts``); a
        longer one takes the whole budget, one chunk at a time.
      group_prompts: with ``prefill_chunk``, the short prompts starting in an iteration prefill
        as the rows of one program, which reads the weights once for all of them
        (:meth:`models.serving.paged.PagedSlots.run_prompt_group`); False: one program each
        (the comparison's baseline).
      chunk_parts: with ``prefill_chunk``, each chunk of a prompt longer than a chunk runs its
        layers in this many parts, one an iteration, each beside a decode step: the longest
        stall a chunk puts on the running requests shrinks by this factor with no more weight
        reads (each layer is read once per chunk either way); the prompt waits behind more
        decode steps. 1 (default): whole chunks.
      max_inject_tokens: layer-segmented prefill (SparseServe §3.4), resident or offloaded. A prompt is
        prefilled a segment of layers per iteration, ``max_inject_tokens // T`` layers for
        a prompt of T (bucketed) tokens, or, when one layer exceeds the budget, chunks of
        one layer (chunked prefill: ``max_inject_tokens`` rounded down to a multiple of 64
        tokens, the chunk's queries attending the keys before them), beside that
        iteration's decode step, so
        a long prompt no longer stalls the running requests for its whole prefill. Offloaded,
        each finished layer's KV goes to the host tier and is freed, and the prompt's working
        set is one layer of its KV; resident, it is finished into the prompt's one-row cache
        (:meth:`ResidentSlots.start_prefill`). One prompt prefills at a time. None (default):
        each prompt's whole prefill runs in the iteration that admits it.
    """

    def __init__(self, model, *, slots: int = 4, max_len: int | None = None, max_requests: int | None = None,
                 max_tokens_per_iter: int | None = None, kv_bytes: int | None = None,
                 stop_ids: Sequence[int] | None = None, unroll: bool | None = None, offload: bool = False,
                 pool_slots: int | None = None, max_inject_tokens: int | None = None, pool: str = "per_row",
                 paged: bool = False, kv_blocks: int | None = None, prefill_chunk: int | None = None,
                 host_pages: int | None = None, group_prompts: bool = True, chunk_parts: int = 1):
        if int(slots) < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        if kv_blocks is not None and not paged:
            raise ValueError("kv_blocks sizes a paged engine's pool: pass paged=True")
        if kv_blocks is not None and offload:
            raise ValueError("kv_blocks sizes the paged resident engine's device pool; an offloaded paged engine's "
                             "pages are on the host: pass host_pages")
        if host_pages is not None and not (paged and offload):
            raise ValueError("host_pages sizes the paged offloaded engine's host tier: pass paged=True, offload=True")
        if prefill_chunk is not None and offload:
            raise ValueError("prefill_chunk prefills into the paged resident engine's device pages; offloaded, split "
                             "a prompt with max_inject_tokens")
        if prefill_chunk is not None:
            if isinstance(prefill_chunk, bool) or int(prefill_chunk) < 1:
                raise ValueError(f"prefill_chunk must be a positive int (tokens), got {prefill_chunk!r}")
            if not paged:
                raise ValueError("prefill_chunk prefills into a paged engine's pages: pass paged=True "
                                 "(the contiguous engine chunks with max_inject_tokens)")
            if max_inject_tokens is not None:
                raise ValueError("prefill_chunk and max_inject_tokens are two ways to split a prompt: pass one")
        if not isinstance(group_prompts, bool):
            raise ValueError(f"group_prompts must be a bool, got {group_prompts!r}")
        if chunk_parts != 1 and (prefill_chunk is None or offload):
            raise ValueError("chunk_parts cuts the chunks of a chunked prefill (the paged resident engine's) by "
                             "layers: pass paged=True and prefill_chunk")
        if not group_prompts and prefill_chunk is None:
            raise ValueError("group_prompts=False turns off grouping short prompts of a chunked prefill: "
                             "pass prefill_chunk (whole prefills run one prompt each)")

        if isinstance(model, CacheRankModel):
            raise ValueError("the serving engine does not run AsyncSpade's cache rank (several programs per step): "
                             "serve the model it came from, or use model.generate")
        if pool != "per_row" and not offload:
            raise ValueError(f"pool={pool!r} needs offload=True: the pool is the offloaded tier's")
        if max_inject_tokens is not None:
            if isinstance(max_inject_tokens, bool) or int(max_inject_tokens) < 1:
                raise ValueError(f"max_inject_tokens must be a positive int (tokens x layers), got {max_inject_tokens!r}")

        self.model = model
        self.slots = int(slots)
        limit = min(model.max_len, model.config.max_position)
        max_len = limit if max_len is None else int(max_len)
        if not 1 <= max_len <= limit:
            raise ValueError(f"max_len must be in [1, {limit}] (the model's context), got {max_len}")
        self.max_len = round_up(max_len, page_size(model.method) if paged and not offload
                                else model.method.cache_multiple)
        # the context a request may use: the capacity rounded up for block methods is not the model's;
        # offloaded, the tiered prefill keeps one position free
        self.context = min(max_len, limit, self.max_len - 1 if offload else self.max_len)
        self.tokenizer = model.tokenizer
        self.stop_ids = frozenset(int(i) for i in (model._stop_ids() if stop_ids is None else stop_ids))
        if unroll is None:
            unroll = programs.default_unroll()
        self.max_inject_tokens = None if max_inject_tokens is None else int(max_inject_tokens)
        self.prefill_chunk = None if prefill_chunk is None else int(prefill_chunk)
        segmented = self.max_inject_tokens is not None
        #: the one device an unsharded model's params live on, when it is not the default one (a
        #: data-parallel replica): the engine's arrays are made there, and its thread runs there
        self.device = placed_device(model)
        with device_scope(self.device):
            if offload:
                self.kv = OffloadedSlots(model, self.slots, self.max_len, pool_slots, pool=pool, paged=paged,
                                         host_pages=host_pages, inject_tokens=self.max_inject_tokens)
            elif paged:
                self.kv = PagedSlots(model, self.slots, self.max_len, bool(unroll), segmented=segmented,
                                     num_blocks=kv_blocks, prefill_chunk=self.prefill_chunk,
                                     group_prompts=group_prompts, chunk_parts=chunk_parts)
            else:
                self.kv = ResidentSlots(model, self.slots, self.max_len, bool(unroll), segmented=segmented)
        self.paged = bool(paged)
        # [(request, slot, job)]: the prompts being prefilled in segments or chunks, in arrival order
        # (layer-segmented: at most one; chunked: as many as this iteration's chunk budget holds)
        self._prefilling: list[tuple[Request, int, Any]] = []
        self.prefill_segments = 0  # segments run (layer-segmented prefill), all prompts
        self.prefills = 0  # whole prefills run
        self.prefills_shared = 0  # requests inserted from another's prefill (a prompt's n choices)
        cache_bytes = self.kv.device_bytes
        # resident: bytes per cached token; offloaded the device holds a fixed tier per slot, so this
        # spreads it over the slot's positions (the working-set estimate is not built: Scheduler)
        self.kv_bytes_per_token = cache_bytes / (self.slots * self.max_len)
        # a shared pool holds one step of at most max_rows rows (OffloadedSlots)
        rows = getattr(self.kv, "max_rows", self.slots)
        shared = getattr(self.kv, "shared", False)
        if paged:  # M_avl is the pool: the scheduler counts pages (as bytes), the running requests' held
            # (offloaded: the host pages; a shared device pool keeps its own cap, max_rows)
            page_bytes = self.kv.page_bytes if offload else self.kv.block_bytes
            pool_bytes = self.kv.kv_blocks_total * page_bytes
            default_kv = pool_bytes
            # vLLM's watermark, for the running requests to grow into; none where the pool holds every
            # slot full (it would only refuse a request that fits: the last slot stayed empty when the
            # others' prompts neared max_len)
            headroom = 0 if self.kv.holds_every_slot_full else max(1, self.kv.kv_blocks_total // 100) * page_bytes
        else:
            default_kv = self.kv.pool_bytes if shared else cache_bytes
            headroom = 0
        self.scheduler = Scheduler(
            max_requests=rows if max_requests is None else min(int(max_requests), rows),
            max_tokens_per_iter=int(max_tokens_per_iter) if max_tokens_per_iter is not None else
            # chunked, an iteration runs a chunk budget of prompt tokens (vLLM's max_num_batched_tokens):
            # a whole prompt counted against max_len + slots let one short prompt in per iteration
            # where a context of 640 and chunks of 2,048 fit four
            (self.prefill_chunk if self.prefill_chunk is not None else self.max_len) + self.slots,
            kv_bytes=default_kv if kv_bytes is None else int(kv_bytes),
            kv_bytes_per_token=self.kv_bytes_per_token,
            working_set=self.kv.working_set, headroom_bytes=headroom,
            prompt_tokens=None if self.prefill_chunk is None else self._first_chunk_tokens)

        # host-side per-slot arrays, sent with each step (a few ints per row)
        self._tokens = np.zeros(self.slots, np.int32)
        self._active = np.zeros(self.slots, bool)
        self._counters = np.zeros(self.slots, np.int32)
        # every slot's sampling options (host) and the penalties' state (device)
        self._sampling = SlotSampling(self.slots, model.config.vocab_size, self.stop_ids,
                                      sharding=replicated(getattr(model, "mesh", None)))
        self._slots: list[Occupant | None] = [None] * self.slots
        self._fresh = np.zeros(self.slots, bool)  # inserted since the last step: its token is on the host
        self._inflight = None  # (tokens int32[B] on the device, the request per slot, issue time): not yet read

        self._inbox: queue.Queue[Request] = queue.Queue()
        self._inbox_lock = threading.Lock()  # submit_all's requests are taken in one iteration
        self._waiting: collections.deque[Request] = collections.deque()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # guards the counters read by stats()
        self.steps = 0
        self.submitted = 0  # requests taken by submit(), all time
        self.blocks_loaded = 0  # offloaded: KV blocks copied from the host, all steps
        self.step_times: list[float] = []  # seconds per decode iteration (dispatch to tokens on the host)
        self.step_end_times: list[float] = []  # when each ended (perf_counter)
        self.finished = collections.Counter()
        self.error: BaseException | None = None  # what stopped the engine thread (every request then failed)
        self.request_errors = 0  # requests failed on their own (their prefill), the engine serving on
        self._in_hand: Request | None = None  # admitted, being prefilled or inserted: in no list
        self.preempted = 0  # paged: requests whose pages were taken back to let older ones grow
        self._parked: dict[int, Occupant] = {}  # paged: a preempted request's detokenizer and held text
        self._finish_listeners: list[Callable[[Request], Any]] = []

    # -- the client side (any thread) ------------------------------------------------
    def make_request(self, prompt_ids: Sequence[int], params: SamplingParams,
                     on_event: Callable[[Event], Any] | None = None, prefill_group: Any = None) -> Request:
        """A checked request (ValueError, before any device work, if it cannot run).
        ``prefill_group``: requests of one group with the same prompt, admitted together,
        share one prefill (:meth:`_prefill_insert`)."""
        params.check()
        ids = list(prompt_ids)
        if not ids:
            raise ValueError("the prompt is empty (no tokens)")
        vocab = self.model.config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"token ids must be in [0, {vocab}), got values in [{min(ids)}, {max(ids)}]")
        n = len(ids)
        if n >= self.context:
            raise ValueError(f"the prompt is {n} tokens; this server's context is {self.context} tokens "
                             f"(prompt + max_tokens), which leaves no room to generate")
        if n + params.max_tokens > self.context:
            raise ValueError(f"the prompt ({n} tokens) + max_tokens ({params.max_tokens}) = {n + params.max_tokens} "
                             f"tokens exceeds this server's context of {self.context} tokens; "
                             f"lower max_tokens to at most {self.context - n}")
        if any(t >= vocab for t, _ in params.logit_bias):
            raise ValueError(f"logit_bias token ids must be in [0, {vocab}), got {max(t for t, _ in params.logit_bias)}")
        if params.prompt_logprobs is not None and getattr(self.model, "mesh", None) is not None:
            raise ValueError("prompt logprobs (echo) are not computed on a sharded model yet")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model has none")
        r = Request(ids, params, on_event, prefill_group=prefill_group)
        if self.paged:
            self.kv.check_request(r)
        self.scheduler.check_admissible(r)
        return r

    def submit(self, request: Request) -> Request:
        """Queue a request made by :meth:`make_request`; returns it."""
        return self.submit_all([request])[0]

    def submit_all(self, requests: Sequence[Request]) -> list[Request]:
        """Queue requests made by :meth:`make_request` at once: the engine takes them in
        one iteration (a prompt's ``n`` choices then share a prefill); returns them."""
        if self.error is not None:
            raise RuntimeError(f"the engine stopped after an error: {self.error!r}")
        now = time.perf_counter()
        with self._lock:  # counted before they can be taken, so submitted - finished never undercounts
            self.submitted += len(requests)
        with self._inbox_lock:
            for r in requests:
                r.t_arrival = now
                self._inbox.put(r)
        self._wake.set()
        return list(requests)

    def add_finish_listener(self, fn: Callable[[Request], Any]) -> None:
        """Call ``fn(request)`` on the engine's thread as each request ends (the server's
        metrics); an exception it raises is swallowed, never the engine's."""
        self._finish_listeners.append(fn)

    def cancel(self, request: Request) -> None:
        """Ask the engine to drop ``request`` (frees its slot at the next iteration)."""
        request.cancelled = True
        self._wake.set()

    def stats(self) -> dict:
        """Counters (``/health`` reports them): ``running``, the requests the engine has taken
        and not ended (decoding, being prefilled or scored: in no queue, they may hold KV
        pages); ``waiting``, those queued; slots in use (and each slot's context
        ``max_len``), reserved KV bytes, totals; ``alive``, whether the engine thread runs."""
        with self._lock:
            active = int(self._active.sum())
            prefilling = len(self._prefilling)
            waiting = len(self._waiting) + self._inbox.qsize()
            # every submitted request ends exactly once (_finish): what is neither ended nor queued
            # runs, including one between the queue and its slot (an earlier count of active slots
            # missed it, and a caller saw an idle engine whose prefill still held pages)
            running = max(self.submitted - sum(self.finished.values()) - waiting, active + prefilling)
            return {"running": running, "waiting": waiting,
                    "slots": self.slots, "max_len": self.max_len, "active_slots": active,
                    "free_slots": self.slots - active,
                    "prefilling": prefilling, "prefill_segments": self.prefill_segments,
                    "prefills": self.prefills, "prefills_shared": self.prefills_shared,
                    "blocks_loaded": self.blocks_loaded, "blocks_hit": getattr(self.kv, "blocks_hit", 0),
                    "working_set_bytes": sum(self.scheduler.working_set(s.request) for s in self._slots
                                             if s is not None),
                    "kv_bytes_budget": self.scheduler.kv_bytes, "steps": self.steps,
                    "submitted": self.submitted, "admitted": self.scheduler.counters.admitted,
                    "deferred_for_tokens": self.scheduler.counters.deferred_for_tokens,
                    "deferred_for_memory": self.scheduler.counters.deferred_for_memory,
                    "finished": dict(self.finished), "request_errors": self.request_errors,
                    "kv_blocks_total": self.kv.kv_blocks_total if self.paged else None,
                    "kv_blocks_free": self.kv.kv_blocks_free if self.paged else None,
                    "preempted": self.preempted,
                    "kv_bound": getattr(self.kv, "kv_bound", "slots"),
                    "programs_compiling": getattr(self.kv, "programs_compiling", 0),
                    "alive": self._thread is not None and self._thread.is_alive()}

    def idle(self) -> bool:
        s = self.stats()
        return s["running"] == 0 and s["waiting"] == 0

    def precompile(self, **options) -> dict:
        """Compile the programs this engine's requests will run before serving them (the paged
        resident engine: :meth:`PagedSlots.precompile`; the offloaded one: its prompt buckets'
        prefill programs, :meth:`OffloadedSlots.precompile`; in parallel threads;
        ``background=True`` returns at once and serving starts while they compile,
        ``stats()["programs_compiling"]`` counting what is left); ``{"programs": 0, "seconds":
        0.0, "failed": []}`` for the others, which compile as requests arrive."""
        if not hasattr(self.kv, "precompile"):
            return {"programs": 0, "seconds": 0.0, "failed": []}
        return self.kv.precompile(**options)

    def warm_up(self, **options) -> dict:
        """Run the short programs once, as requests, before users meet their first execution
        (:func:`models.serving.warmup.warm_up`; the engine thread must be running)."""
        return warm_up(self, **options)

    # -- the engine thread -------------------------------------------------------------
    def start(self) -> "Engine":
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="sparse-jax-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float | None = 30.0) -> None:
        if hasattr(self.kv, "cancel_precompile"):  # background compiles not yet started
            self.kv.cancel_precompile()
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._thread is None or not self._thread.is_alive():  # driven by iterate(), or stopped
            self._settle()

    def _run(self) -> None:
        try:
            with device_scope(self.device):  # jax's default device is per thread
                while not self._stop.is_set():
                    if not self.iterate():
                        self._wake.wait(0.05)
                        self._wake.clear()
                self._settle()
        except BaseException as e:  # noqa: BLE001  (reported to every request, then re-raised in the thread)
            self.error = e
            for r in self._all_requests():
                if r.finish_reason is None:
                    r.error = r.error or f"the engine stopped: {describe(e)}"
                    self._finish(r, "error")
            raise

    def _all_requests(self) -> list[Request]:
        # the request being prefilled is in no slot and no longer waiting: without it, a failure
        # there left its client waiting forever
        out = [self._in_hand] if self._in_hand is not None else []
        out += [s.request for s in self._slots if s is not None and s.request is not self._in_hand]
        out += list(self._waiting)
        while True:
            try:
                out.append(self._inbox.get_nowait())
            except queue.Empty:
                return out

    def iterate(self) -> bool:
        """One scheduling iteration: take new requests, drop cancelled ones, prefill
        and insert what the scheduler admits, run one decode step over the slots.
        Returns whether it did any work."""
        worked = False
        taken = []
        with self._inbox_lock:
            while True:
                try:
                    taken.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
        for r in taken:
            if r.params.prompt_logprobs is not None and not r.cancelled:
                worked = True
                if not self._score_prompt(r) or r.params.max_tokens == 0:
                    continue  # failed, or scored and done (nothing to generate)
            self._waiting.append(r)
        for r in [r for r in self._waiting if r.cancelled]:
            self._waiting.remove(r)
            self._finish(r, "cancelled")
            worked = True
        for s in self._slots:
            if s is not None and s.request.cancelled:
                self._finish(s.request, "cancelled")
                worked = True
        if self._admit_and_prefill():
            worked = True
        if self._active.any():
            self._decode()
            worked = True
        elif self._inflight is not None:  # the batch emptied: the last step's tokens are all dropped
            self._settle()
        return worked

    def _settle(self) -> None:
        """Wait for the step in flight and read its tokens back (emitting any still wanted).
        Its device-to-host copy was started (``copy_to_host_async``); left pending, jax's
        CPU client aborts the process at exit ("terminate called without an active
        exception", jax 0.11.2), so an engine that empties or stops reads it."""
        if self._inflight is not None:
            inflight, self._inflight = self._inflight, None
            self._collect(inflight)
        self.kv.settle()



    def _grow(self) -> None:
        """Paged: before a step, give every decoding request the page its next position needs;
        when the pool has none, preempt the newest request (its pages freed, requeued first)
        until the older ones fit. The oldest always fits alone (:meth:`PagedSlots.check_request`)."""
        kv = self.kv
        order = sorted((s.request for i, s in enumerate(self._slots) if s is not None and self._active[i]),
                       key=lambda r: r.t_scheduled)
        for r in order:
            if r.slot is None:  # preempted below, for an older one
                continue
            while not kv.reserve(r, int(kv._lengths[r.slot]) + 1):
                holders = [s.request for s in self._slots if s is not None]
                victim = max(holders, key=lambda q: q.t_scheduled)
                if victim is r and len(holders) == 1:
                    raise RuntimeError(f"request {r.id} alone does not fit the KV pool (a missed admission check)")
                self._preempt(victim)
                if victim is r:
                    break

    def _preempt(self, r: Request) -> None:
        """Take ``r``'s pages and slot back; it waits first in line, to be prefilled again from
        its prompt and output (its detokenizer and held text kept for it)."""
        slot = r.slot
        self._drop_prefilling(r)
        self.kv.release(r)
        with self._lock:
            self._parked[r.id] = self._slots[slot]
            self._slots[slot] = None
            self._active[slot] = False
            self._fresh[slot] = False
            r.slot = None
            r.preemptions += 1
            self.preempted += 1
            self._waiting.appendleft(r)














    def _decode(self) -> None:
        """Issue one step, then collect the step before it: the device runs step t+1
        while the host reads step t's tokens, reports them and decides the ends
        (JetStream's ``copy_to_host_async`` overlap). A row fed from the device takes
        the token its last step sampled; a row inserted since takes its first token
        from the host. A request that ends at step t has one more step issued for it,
        whose token is dropped (its slot's capacity allows it: prompt + max_tokens <=
        max_len)."""
        t0 = time.perf_counter()
        if self.paged:
            self._grow()
            if not self._active.any():  # cannot happen (the oldest always fits), but never step nothing
                return
        prev = self._inflight
        self._counters += self._active  # index of the token this step samples
        # copies: on the CPU a device array may alias the NumPy buffer it came from, and these
        # host arrays change while the step is still queued
        tokens = jnp.asarray(np.array(self._tokens))
        if prev is not None:
            tokens = merge_tokens(jnp.asarray(np.array(self._fresh)), tokens, prev[0].tokens)
        out = self.kv.step(tokens, np.array(self._active), self._sampling.build(self._counters, self._active))
        out = self._sampling.take_counts(out)  # the penalties' counts with this step's tokens, for the next
        for a in (out.tokens, out.logprob, out.top_ids, out.top_logprobs):
            if a is not None and hasattr(a, "copy_to_host_async"):
                a.copy_to_host_async()
        self._fresh[:] = False
        snapshot = [s.request if s is not None and self._active[i] else None for i, s in enumerate(self._slots)]
        self._inflight = (out, snapshot, t0)
        if prev is not None:
            self._collect(prev)

    def _collect(self, inflight) -> None:
        out, snapshot, t0 = inflight
        toks = np.asarray(out.tokens)  # waits for that step only; the next one is already queued
        if out.logprob is not None:
            out = jax.tree.map(np.asarray, out)
        now = time.perf_counter()
        last = self.step_end_times[-1] if self.step_end_times else t0
        self.steps += 1
        self.blocks_loaded += self.kv.blocks_loaded([r is not None for r in snapshot])
        # a step's time in the pipeline: from the previous collection (or its issue) to its own
        self.step_times.append(now - max(t0, last))
        self.step_end_times.append(now)
        for slot, r in enumerate(snapshot):
            s = self._slots[slot]
            if r is not None and r.finish_reason is None and s is not None and s.request is r:
                self._emit(slot, int(toks[slot]), now, token_logprob(out, slot, r.params.logprobs))

    def _emit(self, slot: int, tok: int, now: float, logprob: TokenLogprob | None = None) -> None:
        """Record token ``tok`` (and its ``logprob``, when asked for) of the request in
        ``slot``: end it or report new text."""
        s = self._slots[slot]
        r = s.request
        p = r.params
        lps = () if logprob is None else (logprob,)
        if r.t_first is None:
            r.t_first = now
        r.token_times.append(now)
        if tok in self.stop_ids and not p.ignore_eos:
            self._finish(r, "stop")
            return
        r.output_ids.append(tok)
        r.logprobs.extend(lps)
        self._tokens[slot] = tok
        if s.text is None:
            self._send(r, Event("token", "", (tok,), logprobs=lps))
        else:
            delta, stopped = s.text.push(r.output_ids)
            if stopped:  # a stop string: the text before it goes with "done"
                self._finish(r, "stop", (tok,), lps)
                return
            r.text += delta
            self._send(r, Event("token", delta, (tok,), logprobs=lps))
        if len(r.output_ids) >= p.max_tokens:
            self._finish(r, "length")

    def _finish(self, r: Request, reason: str, last_ids: tuple[int, ...] = (),
                last_logprobs: tuple[TokenLogprob, ...] = ()) -> None:
        """End ``r`` (free its slot), flush held text, report "done"."""
        rest = ""
        self._drop_prefilling(r)  # cancelled mid-prefill: its layers or chunks done so far are dropped
        if self.paged:  # its pages back to the pool (its slot's table row to null pages)
            self.kv.release(r)
            self._parked.pop(r.id, None)
        if r.slot is not None:
            s = self._slots[r.slot]
            if reason in ("length", "stop") and s is not None and s.text is not None:
                # what was held back, and an incomplete character's bytes at the very end
                rest = s.text.finish(r.output_ids)
            with self._lock:
                self._slots[r.slot] = None
                self._active[r.slot] = False
            r.slot = None
        r.text += rest
        r.finish_reason = reason
        with self._lock:
            self.finished[reason] += 1
        for fn in self._finish_listeners:  # before the client hears the end: its metrics are there
            try:
                fn(r)
            except Exception:  # noqa: BLE001 - a listener's failure is not the request's or the engine's
                pass
        self._send(r, Event("done", rest, last_ids, reason, logprobs=last_logprobs))
        r.done.set()

    def _send(self, r: Request, ev: Event) -> None:
        if r.on_event is not None:
            r.on_event(ev)

    # -- convenience (tests, benchmarks) -----------------------------------------------------
    def generate(self, prompt_ids: Sequence[int], params: SamplingParams, timeout: float = 600.0) -> Request:
        """Submit and wait (the engine thread must be running)."""
        r = self.submit(self.make_request(prompt_ids, params))
        if not r.done.wait(timeout):
            raise TimeoutError(f"request {r.id} did not finish in {timeout} s")
        return r
