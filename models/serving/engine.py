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
  Offloaded, with ``max_inject_tokens``, it is layer-segmented (SparseServe
  §3.4): each iteration runs a segment of the prompt's layers
  (:class:`models.runtime.tiered.PrefillJob`) beside the decode step, the finished
  layers' KV going to the host tier.
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

The scheduler (:class:`Scheduler`) is FCFS under R_max requests, T_max tokens
per iteration and M_avl device bytes, with SparseServe's first-fit admission
on a working-set estimate (Alg. 1): the reservation when resident, the blocks
used over the last 12 steps (measured on the device) when offloaded.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import itertools
import math
import os
import queue
import threading
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import programs
from models.api import round_up
from models.runtime.cache_rank import CacheRankModel
from models.runtime.tiered import TieredRunner
from models.sampling import sample_rows
from sparse_jax.cache import KVCache
from sparse_jax.offload import capacity
from sparse_jax.offload import pool as off
from sparse_jax.offload.capacity import autotune_scratch_bytes, device_budget
from sparse_jax.offload.pool import insert_shared_row
from sparse_jax.offload.tiers import OffloadedLayer

# -----------------------------------------------------------------------------
# Requests and events
# -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it ends.

    ``temperature`` 0 is greedy; otherwise temperature / nucleus (``top_p``)
    sampling from ``seed`` (the same seed gives the same tokens whatever else
    is in the batch). ``stop``: strings that end the output (not included).
    ``ignore_eos``: run to ``max_tokens`` (load benchmarks on random weights)."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def check(self) -> None:
        if int(self.max_tokens) < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= int(self.seed) < 2**32:
            raise ValueError(f"seed must be in [0, 2**32), got {self.seed}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty strings, got {list(self.stop)}")


@dataclasses.dataclass
class Event:
    """What the engine reports to a request: ``kind`` "token" (``text`` the new
    text, ``token_ids`` the new ids; text may lag ids while an incomplete UTF-8
    sequence or a possible stop string is held back) or "done" (with
    ``finish_reason``: "stop", "length", "cancelled" or "error", when the request's
    ``error`` says what failed; ``text`` any text left)."""

    kind: str
    text: str = ""
    token_ids: tuple[int, ...] = ()
    finish_reason: str | None = None


class Request:
    """One generation: the prompt's ids, its sampling parameters, and what the
    engine recorded about it (times are ``time.perf_counter()`` seconds)."""

    _ids = itertools.count()

    def __init__(self, prompt_ids: Sequence[int], params: SamplingParams,
                 on_event: Callable[[Event], Any] | None = None):
        self.id = next(Request._ids)
        self.prompt_ids = [int(i) for i in prompt_ids]
        self.params = params
        self.on_event = on_event
        self.output_ids: list[int] = []
        self.text = ""            # the output text sent so far
        self.finish_reason: str | None = None
        self.error: str | None = None  # finish_reason "error": what failed (its prefill, or the engine)
        self.cancelled = False    # set from any thread; the engine acts on it next iteration
        self.slot: int | None = None
        self.t_arrival = time.perf_counter()
        self.t_scheduled: float | None = None   # prefill started
        self.t_first: float | None = None       # first token produced
        self.token_times: list[float] = []      # one per output token
        self.done = threading.Event()

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def reserved_tokens(self) -> int:
        """Cache positions the request can occupy: its prompt and every token it may generate."""
        return self.prompt_len + int(self.params.max_tokens)

    def __repr__(self) -> str:
        return (f"Request(id={self.id}, prompt={self.prompt_len} tokens, out={len(self.output_ids)}, "
                f"slot={self.slot}, finish={self.finish_reason})")


# -----------------------------------------------------------------------------
# The scheduler
# -----------------------------------------------------------------------------


@dataclasses.dataclass
class SchedulerCounters:
    """Running totals (read by ``/health`` and the tests: empty means nothing leaked)."""

    admitted: int = 0
    deferred_for_tokens: int = 0   # an iteration left a waiting request out for T_max
    deferred_for_memory: int = 0   # ... for M_avl (Alg. 1's "reset")
    working_set_bytes: int = 0     # the running requests' estimated working sets, summed


class Scheduler:
    """FCFS admission under three limits (SparseServe §3.3, Alg. 1):

    * ``max_requests`` (R_max): requests in the batch (at most the slots);
    * ``max_tokens_per_iter`` (T_max): tokens one iteration runs, the running
      requests' decode tokens plus the prompts prefilled in it. A prompt longer
      than what is left runs alone in an iteration without other prefills (it
      would otherwise never fit: there is no chunked prefill yet);
    * ``kv_bytes`` (M_avl): device bytes for the KV of the batch.

    ``base`` order is FCFS and stops at the first request that does not fit
    R_max / T_max (vLLM's ``get_batch``); over those candidates, Alg. 1
    admits first-fit while the working sets fit M_avl, leaving the others
    waiting.

    The working set (``working_set(request)``, a hook). Resident: the KV a
    request reserves, ``(prompt + max_tokens) x kv_bytes_per_token`` (what a
    paged allocator would hold). Offloaded (:meth:`OffloadedSlots.working_set`):
    SparseServe's estimate for a decoding request, the blocks it used over the
    last w = 12 steps, counted on the device and read back one step late; for
    a prompt, the blocks its first step reads, or under layer-segmented prefill
    (``Engine(max_inject_tokens=...)``) one layer of its KV. With per-slot pools
    this admission changes nothing a slot's pool holds; with the shared pool
    (``Engine(pool="shared")``: M_avl defaults to the pool's bytes) it keeps the
    running requests' working sets within the pool (``docs/serving.md``).
    """

    def __init__(self, *, max_requests: int, max_tokens_per_iter: int, kv_bytes: int,
                 kv_bytes_per_token: float, working_set: Callable[[Request], int] | None = None):
        if max_requests < 1:
            raise ValueError(f"max_requests (R_max) must be >= 1, got {max_requests}")
        if max_tokens_per_iter < 1:
            raise ValueError(f"max_tokens_per_iter (T_max) must be >= 1, got {max_tokens_per_iter}")
        if kv_bytes < 1:
            raise ValueError(f"kv_bytes (M_avl) must be >= 1, got {kv_bytes}")
        self.max_requests = int(max_requests)
        self.max_tokens_per_iter = int(max_tokens_per_iter)
        self.kv_bytes = int(kv_bytes)
        self.kv_bytes_per_token = float(kv_bytes_per_token)
        self.working_set = working_set or self.reserved_bytes
        self.counters = SchedulerCounters()

    def reserved_bytes(self, r: Request) -> int:
        return int(math.ceil(r.reserved_tokens * self.kv_bytes_per_token))

    def check_admissible(self, r: Request) -> None:
        """ValueError when ``r`` could never be admitted, even into an empty engine."""
        ws = self.working_set(r)
        if ws > self.kv_bytes:
            raise ValueError(f"the request needs {ws} bytes of KV ({r.reserved_tokens} tokens), more than the "
                             f"engine's KV budget M_avl of {self.kv_bytes} bytes")

    def admit(self, waiting: Sequence[Request], running: Sequence[Request], free_slots: int) -> list[Request]:
        """The waiting requests to prefill this iteration (FCFS candidates, then first-fit on M_avl)."""
        room = min(free_slots, self.max_requests - len(running))
        tokens = len(running)  # each running request decodes one token this iteration
        candidates: list[Request] = []
        for r in waiting:
            if len(candidates) >= room:
                break
            if tokens + r.prompt_len > self.max_tokens_per_iter and candidates:
                self.counters.deferred_for_tokens += 1
                break
            candidates.append(r)
            tokens += r.prompt_len
        used = sum(self.working_set(r) for r in running)
        batch = []
        for r in candidates:
            m = self.working_set(r)
            if used + m <= self.kv_bytes:
                batch.append(r)
                used += m
            else:
                self.counters.deferred_for_memory += 1
        self.counters.admitted += len(batch)
        self.counters.working_set_bytes = used
        return batch


# -----------------------------------------------------------------------------
# Pure pieces (jitted by the engine)
# -----------------------------------------------------------------------------


def check_slot_axis(model, max_len: int) -> None:
    """Raise ValueError unless every leaf of the model's cache has the batch as its
    leading axis (checked on shapes: a cache of 1 row against one of 2 rows, nothing
    allocated). The engine inserts a request by writing index ``slot`` of every
    leaf, so a leaf without the batch axis would be silently shared by all slots."""
    one = jax.eval_shape(lambda: model.init_cache(1, max_len))
    two = jax.eval_shape(lambda: model.init_cache(2, max_len))
    bad = []
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(one), jax.tree.leaves(two)):
        if not (a.ndim >= 1 and a.shape[0] == 1 and b.shape[0] == 2 and a.shape[1:] == b.shape[1:]):
            bad.append(f"{jax.tree_util.keystr(path)}: {a.shape} at batch 1, {b.shape} at batch 2")
    if bad:
        raise ValueError("the engine needs every cache leaf (the method's state included) to have the batch as "
                         "its leading axis; these do not: " + "; ".join(bad))


def insert_slot(cache: KVCache, row: KVCache, slot: jax.Array) -> KVCache:
    """``cache`` (``B`` rows, donated) with row ``slot`` of every leaf replaced by the
    one-row ``row`` (a prefilled request), lengths included."""
    return jax.tree.map(lambda big, one: jax.lax.dynamic_update_index_in_dim(big, one[0].astype(big.dtype), slot, 0),
                        cache, row)


@jax.jit
def _sum_arrays(arrays: tuple) -> jax.Array:
    """The elementwise sum of same-shaped arrays (per-layer block counters -> one per step)."""
    return functools.reduce(jnp.add, arrays)


def _engine_programs(decode):
    """The engine's jitted programs around ``decode(params, tokens, cache) -> (logits,
    cache)``: the step (decode, free slots held back, sampling; cache donated), the
    slot insertion and the sampling alone."""

    def step(params, tokens, cache, active, seeds, counters, temperature, top_p):
        logits, new = decode(params, tokens, cache)
        # free slots do not advance: they never run past their capacity
        new = dataclasses.replace(new, lengths=jnp.where(active, new.lengths, cache.lengths))
        return sample_rows(logits, seeds, counters, temperature, top_p), new

    return (jax.jit(step, donate_argnums=(2,)), jax.jit(insert_slot, donate_argnums=(0,)), jax.jit(sample_rows))


@functools.lru_cache(maxsize=16)
def _programs(graphdef, cfg, method, unroll: bool):
    """The engine's jitted programs for one model structure and method."""
    return _engine_programs(lambda params, tokens, cache: programs.decode_step(
        nnx.merge(graphdef, params), cfg, method, tokens, cache, unroll=unroll))


@functools.lru_cache(maxsize=16)
def _sharded_programs(decode):
    """:func:`_programs` for a model on a mesh (:class:`models.runtime.sharding.ShardedModel`):
    its own sharded decode step (one ``shard_map``); the insertion and the sampling are
    plain jits over the mesh-laid arrays."""
    return _engine_programs(decode)


def check_engine_mesh(model) -> None:
    """An engine runs one replica: a sharded model must have ``data == 1`` (its slots
    and each request's one-row prefill live on every device of the replica)."""
    par = getattr(model, "parallelism", None)
    if par is not None and par.data != 1:
        raise ValueError(f"an engine serves one replica: the model is sharded with data={par.data}; shard it "
                         f"with data=1 (tensor parallelism) and run one engine per device group")


@jax.jit
def _merge_tokens(fresh: jax.Array, host: jax.Array, device: jax.Array) -> jax.Array:
    """``int32[B]``: the host's token where ``fresh`` (a request inserted since the last
    step), else the token the last step sampled, still on the device."""
    return jnp.where(fresh, host, device)


def prefill_bucket(n: int, max_len: int) -> int:
    """The padded prompt length a prompt of ``n`` tokens is prefilled at: a multiple of
    64 up to 1024 tokens (as ``Model.generate``), then powers of two, capped at
    ``max_len``: few compilations for long prompts."""
    b = -(-n // 64) * 64 if n <= 1024 else 1 << (n - 1).bit_length()
    return min(b, max_len)


# -----------------------------------------------------------------------------
# Where the slots' KV lives
# -----------------------------------------------------------------------------


def check_resident_fits(model, slots: int, max_len: int, device_limit: int | None = None,
                        prefill_temp_bytes: int = 0) -> None:
    """:class:`~sparse_jax.offload.capacity.CapacityError` before anything is allocated when
    the weights, ``slots`` rows of ``max_len`` tokens and the row a prompt is prefilled into
    (:meth:`ResidentSlots.prefill`: one more row) do not fit the device (``device_limit``:
    default :func:`~sparse_jax.offload.capacity.device_budget`, which keeps 2 GiB for XLA's
    temporaries; CPU: no limit, no check). Without it, a batch that filled the device
    failed later, compiling a long prompt's prefill (H100, Qwen3-8B, 3 x 98K slots: XLA's
    GEMM autotuner could not allocate). The bytes are the cache's own shapes (a hybrid
    model's sliding-window rings counted as rings), plus ``prefill_temp_bytes``: the
    temporaries of the longest prompt's prefill as XLA's buffer assignment reports them
    (:func:`compile_longest_prefill`). Without them the check passed 11 slots of 33,280
    tokens that then ran out of memory compiling a 32K prefill (H100, Qwen3-8B). And the
    GEMM autotuner's scratch when it compiles a program after the cache exists
    (:func:`~sparse_jax.offload.capacity.autotune_scratch_bytes`: the largest weight)."""
    limit = capacity.device_budget() if device_limit is None else device_limit
    if limit is None:
        return
    row = jax.eval_shape(lambda: model.init_cache(1, max_len)).nbytes()  # shapes only: nothing allocated
    weights = sum(x.nbytes for x in jax.tree.leaves(model.params))

    scratch = capacity.autotune_scratch_bytes(model.params)

    def fp(rows):
        return capacity.Footprint({"weights": weights, "kv": rows * row,
                                   "prefill_temporaries": int(prefill_temp_bytes),
                                   "autotune_scratch": scratch}, {})

    try:
        capacity.check_fits(fp(slots + 1), device_limit=limit, host_limit=None,
                            what=f"a resident engine of {slots} slots x {max_len} tokens (and one prefill row)")
    except capacity.CapacityError as e:
        fits = max((k for k in range(1, slots) if fp(k + 1).device_bytes <= limit), default=0)
        hint = f" {fits} slots fit." if fits else " Not even one slot fits: lower max_len."
        raise capacity.CapacityError(f"{e}{hint}") from None


def compile_longest_prefill(model, max_len: int):
    """``(bucket, compiled, temp_bytes)``: the prefill program of the longest prompt an engine
    of ``max_len`` tokens admits (``max_len - 1`` tokens, leaving one to generate), compiled
    ahead of time from shapes alone (nothing allocated), and its temporaries from XLA's buffer
    assignment (``memory_analysis``; 0 where the backend reports none). A longer prompt's
    prefill holds more, so this bounds every bucket's. Compiled before the slots' cache exists,
    the GEMM autotuner also finds the device free."""
    bucket = prefill_bucket(max_len - 1, max_len)
    shapes = jax.ShapeDtypeStruct((1, bucket), jnp.int32), jax.ShapeDtypeStruct((1,), jnp.int32)
    row = jax.eval_shape(lambda: model.init_cache(1, max_len))
    compiled = model.fns.prefill.lower(model.params, *shapes, row).compile()
    stats = compiled.memory_analysis()
    return bucket, compiled, int(getattr(stats, "temp_size_in_bytes", 0) or 0)


class ResidentSlots:
    """Every slot's KV on the device: ``model.init_cache(slots, max_len)``, decoded by the
    engine's own step program (the model's decode step + sampling, cache donated).

    On a device with a memory limit (a GPU) the longest prompt's prefill is compiled before
    the cache is allocated, and its measured temporaries join the capacity check
    (:func:`compile_longest_prefill`); that bucket then runs the compiled program. The CPU
    backend has no limit to check against and skips it."""

    offloaded = False

    def __init__(self, model, slots: int, max_len: int, unroll: bool):
        check_engine_mesh(model)
        check_slot_axis(model, max_len)
        self.model, self.slots, self.max_len = model, slots, max_len
        self._compiled_prefill: dict[int, Any] = {}  # bucket -> program compiled ahead of time
        if getattr(model, "mesh", None) is not None:
            self._step, self._insert, self._sample = _sharded_programs(model.fns.decode_step)
        else:
            self._step, self._insert, self._sample = _programs(model.graphdef, model.config, model.method, unroll)

            temps = 0
            if device_budget() is not None and hasattr(model.fns.prefill, "lower"):  # one jitted program
                bucket, compiled, temps = compile_longest_prefill(model, max_len)
                self._compiled_prefill[bucket] = compiled
            check_resident_fits(model, slots, max_len, prefill_temp_bytes=temps)
        self.cache = model.init_cache(slots, max_len)
        self.device_bytes = self.cache.nbytes()

    def prefill(self, ids: Sequence[int]):
        """``(logits f32[1, V], one-row cache)`` of a prompt."""
        m, n = self.model, len(ids)
        bucket = prefill_bucket(n, self.max_len)
        tokens = np.full((1, bucket), m._pad_id(), np.int32)
        tokens[0, :n] = ids
        prefill = self._compiled_prefill.get(bucket, m.fns.prefill)
        return prefill(m.params, jnp.asarray(tokens), jnp.asarray([n], jnp.int32), m.init_cache(1, self.max_len))

    def insert(self, row, slot: int) -> None:
        self.cache = self._insert(self.cache, row, jnp.int32(slot))

    def step(self, tokens, active, seeds, counters, temperature, top_p) -> jax.Array:
        toks, self.cache = self._step(self.model.params, jnp.asarray(tokens), self.cache, jnp.asarray(active),
                                      jnp.asarray(seeds), jnp.asarray(counters), jnp.asarray(temperature),
                                      jnp.asarray(top_p))
        return toks

    def blocks_loaded(self, active) -> int:
        return 0

    @staticmethod
    def wait(logits, row) -> None:
        """Block until a prefill's outputs exist: the device reports a failure of the
        prefill (out of memory) when its outputs are waited for."""
        jax.block_until_ready((logits, row))

    def settle(self) -> None:
        """Nothing of its own in flight (see :meth:`OffloadedSlots.settle`)."""

    working_set = None  # the scheduler's reservation estimate


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


class OffloadedSlots:
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
    (:meth:`models.runtime.tiered.TieredRunner.prefill_temp_bytes`), before anything is allocated."""

    offloaded = True

    def __init__(self, model, slots: int, max_len: int, pool_slots: int | None = None, segmented: bool = False,
                 pool: str = "per_row"):
        check_engine_mesh(model)
        self.model, self.slots, self.max_len = model, slots, max_len
        self.shared = off.check_pool(pool) == "shared"
        self.runner = TieredRunner(model, "offload", pool_slots=pool_slots, pool=pool)
        cfg, dt = model.config, model.dtype
        method = self.runner.method
        self.blocks_per_step = method.offload_blocks_per_step(max_len)
        self.pool_slots = self.runner._pool(max_len, slots)
        self.max_rows = min(slots, self.pool_slots // self.blocks_per_step) if self.shared else slots
        # a shared pool's requests are prefilled into one-row tiers with the smallest per-row pool
        self.prefill_runner = (TieredRunner(model, "offload", pool_slots=self.blocks_per_step) if self.shared
                               else self.runner)


        if device_budget() is not None:  # a GPU: the longest prompt's prefill runs beside the batch
            self.runner.check_capacity(slots, max_len, prefill_temp_bytes=self.prefill_runner.prefill_temp_bytes(
                self.prompt_tokens(max_len - 1), max_len), autotune_scratch=autotune_scratch_bytes(model.params))

        def empty(i):  # every slot starts as a one-token row of zeros (free slots never advance)
            shape = (slots, cfg.num_kv_heads, max_len, cfg.head_dim)
            return jnp.zeros(shape, dt), jnp.zeros(shape, dt), jnp.zeros((slots, cfg.num_heads, cfg.head_dim), dt)

        self.state = self.runner.state_from_kv(empty, np.ones(slots, np.int32), max_len)
        bad = []
        for i, e in enumerate(self.state.cache.layers):
            if isinstance(e, OffloadedLayer) and e.shared:  # the pool is the slots' together: its row leaves
                e = (e.block_slot, e.state)
            elif isinstance(e, OffloadedLayer):
                e = dataclasses.replace(e, hits=None, misses=None)
            bad += [f"layer {i}: {a.shape}" for a in jax.tree.leaves(e) if a.ndim < 1 or a.shape[0] != slots]
        bad += [f"host tier {i}: {h.k.shape}" for i, h in enumerate(self.state.host)
                if h is not None and h.k.shape[0] != slots]
        if bad:
            raise ValueError("every tier leaf must have the slots as its leading axis: " + "; ".join(bad))
        self._insert = jax.jit(insert_shared_slot if self.shared else insert_tiered_slot, donate_argnums=(0,))
        self._sample = jax.jit(sample_rows)
        self._working_set = jax.jit(offloaded_working_set)
        self._copiers = concurrent.futures.ThreadPoolExecutor(min(8, os.cpu_count() or 1),
                                                              thread_name_prefix="sparse-jax-insert")
        self.device_bytes = self.state.cache.nbytes()
        self.block_size = method.offload_block_size
        self.block_bytes = 2 * self.block_size * cfg.head_dim * jnp.dtype(dt).itemsize  # K and V of one head
        self.layer_heads = len(self.runner.offloaded_layers) * cfg.num_kv_heads
        #: shared pool: the bytes of its blocks (the default M_avl)
        self.pool_bytes = self.pool_slots * self.layer_heads * self.block_bytes
        self.ws_blocks = np.zeros(slots, np.int64)  # per slot, as of the last step read back
        self._ws_pending = None  # (int32[slots] on the device, the step it measured)
        self._steps = 0
        self._inserted_at = np.full(slots, -1)  # the step count when each slot was last filled
        self.segmented = segmented  # prompts prefill a few layers per iteration (Engine.max_inject_tokens)

    def prefill(self, ids: Sequence[int]):
        job = self.start_prefill(ids)
        job.advance(job.runner.num_layers)
        return job.result()

    def start_prefill(self, ids: Sequence[int]):
        """A :class:`models.runtime.tiered.PrefillJob` of one prompt (bucketed as every prefill):
        the engine's layer-segmented prefill advances it between decode steps."""
        n = len(ids)
        tokens = np.full((1, self.prompt_tokens(n)), self.model._pad_id(), np.int32)
        tokens[0, :n] = ids
        return self.prefill_runner.start_prefill(tokens, np.asarray([n], np.int32), self.max_len)

    def prompt_tokens(self, n: int) -> int:
        """Tokens a prompt of ``n`` runs through each layer: its prefill bucket, where the
        bucket would fill the cache (the tiered prefill needs room for one decode token)
        the last multiple of 64 below ``max_len``, and ``n`` only for a prompt past that.
        Every prompt between the last power of two and the cache used to run at its own
        length, each compiling its own layer programs: on the H100 a 98K slot's prompts
        over 64K took 14 s to prefill, with 3.5 s stalls of the running requests."""
        t = prefill_bucket(n, self.max_len)
        if t < self.max_len:
            return t
        top = (self.max_len - 1) // 64 * 64
        return top if n <= top else n

    def layer_kv_bytes(self, n: int) -> int:
        """Device bytes of one layer's K/V of a prompt of ``n`` tokens (its bucket), the
        working set of a prompt under layer-segmented prefill (SparseServe §3.3)."""
        cfg = self.model.config
        return 2 * cfg.num_kv_heads * self.prompt_tokens(n) * cfg.head_dim * jnp.dtype(self.model.dtype).itemsize

    def insert(self, row, slot: int) -> None:
        st = self.state
        self.runner.finish(st)  # saves still pending for the slot's last occupant land first
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

    def step(self, tokens, active, seeds, counters, temperature, top_p) -> jax.Array:
        logits = self.runner.decode_step(tokens, self.state, active=active)
        if self.state.counters:
            # the counters are leaves of the cache the next step donates: keep their sum over the
            # offloaded layers, one small program (a copy per layer was a dispatch per layer and step)
            self.state.counters[-1] = [(None, _sum_arrays(tuple(m for _, m in self.state.counters[-1])))]
        self._steps += 1
        self._take_working_sets()  # last step's, copied meanwhile: one step stale
        ws = self._working_set(self.state.cache)
        ws.copy_to_host_async()
        self._ws_pending = (ws, self._steps)
        return self._sample(logits, jnp.asarray(seeds), jnp.asarray(counters), jnp.asarray(temperature),
                            jnp.asarray(top_p))

    def working_set(self, r: Request) -> int:
        """Device bytes of ``r``'s working set: measured (:func:`offloaded_working_set`)
        once it decodes; for a prompt, the blocks its first step reads (its selection,
        at most the prompt's blocks, plus the ring) in every offloaded layer and head."""
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
        return int(sum(np.asarray(m).reshape(self.slots, hkv)[rows].sum() for step in done for _, m in step))


# -----------------------------------------------------------------------------
# The engine
# -----------------------------------------------------------------------------


class _Slot:
    """Host-side bookkeeping of one occupied slot."""

    def __init__(self, request: Request):
        self.request = request
        self.held_text = ""  # decoded but not yet sent (incomplete UTF-8, a possible stop string)


class Engine:
    """Continuous batching over ``slots`` decode rows (module docstring).

    Args:
      model: a :class:`models.api.Model` (resident KV; any registered method).
      slots: decode rows, the most requests decoding at once.
      max_len: cache capacity per slot (prompt + output); default the model's ``max_len``.
      max_requests: R_max (default ``slots``).
      max_tokens_per_iter: T_max (default ``max_len + slots``: one full prompt per iteration).
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
      max_inject_tokens: offloaded: layer-segmented prefill (SparseServe §3.4). A prompt is
        prefilled a segment of layers per iteration, ``max_inject_tokens // T`` layers for
        a prompt of T (bucketed) tokens, or, when one layer exceeds the budget, chunks of
        one layer (chunked prefill: ``max_inject_tokens`` rounded down to a multiple of 64
        tokens, the chunk's queries attending the keys before them), beside that
        iteration's decode step, so
        a long prompt no longer stalls the running requests for its whole prefill; each
        finished layer's KV goes to the host tier and is freed, and the prompt's working
        set is one layer of its KV. One prompt prefills at a time. None (default): each
        prompt's whole prefill runs in the iteration that admits it.
    """

    def __init__(self, model, *, slots: int = 4, max_len: int | None = None, max_requests: int | None = None,
                 max_tokens_per_iter: int | None = None, kv_bytes: int | None = None,
                 stop_ids: Sequence[int] | None = None, unroll: bool | None = None, offload: bool = False,
                 pool_slots: int | None = None, max_inject_tokens: int | None = None, pool: str = "per_row"):
        if int(slots) < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")

        if isinstance(model, CacheRankModel):
            raise ValueError("the serving engine does not run AsyncSpade's cache rank (several programs per step): "
                             "serve the model it came from, or use model.generate")
        if pool != "per_row" and not offload:
            raise ValueError(f"pool={pool!r} needs offload=True: the pool is the offloaded tier's")
        if max_inject_tokens is not None:
            if not offload:
                raise ValueError("max_inject_tokens (layer-segmented prefill) needs offload=True: the segments are "
                                 "the tiered runner's layer-by-layer prefill, whose finished layers go to the host")
            if isinstance(max_inject_tokens, bool) or int(max_inject_tokens) < 1:
                raise ValueError(f"max_inject_tokens must be a positive int (tokens x layers), got {max_inject_tokens!r}")

        self.model = model
        self.slots = int(slots)
        limit = min(model.max_len, model.config.max_position)
        max_len = limit if max_len is None else int(max_len)
        if not 1 <= max_len <= limit:
            raise ValueError(f"max_len must be in [1, {limit}] (the model's context), got {max_len}")
        self.max_len = round_up(max_len, model.method.cache_multiple)
        # the context a request may use: the capacity rounded up for block methods is not the model's;
        # offloaded, the tiered prefill keeps one position free
        self.context = min(max_len, limit, self.max_len - 1 if offload else self.max_len)
        self.tokenizer = model.tokenizer
        self.stop_ids = frozenset(int(i) for i in (model._stop_ids() if stop_ids is None else stop_ids))
        if unroll is None:
            unroll = programs.default_unroll()
        self.max_inject_tokens = None if max_inject_tokens is None else int(max_inject_tokens)
        self.kv = (OffloadedSlots(model, self.slots, self.max_len, pool_slots,
                                  segmented=self.max_inject_tokens is not None, pool=pool) if offload
                   else ResidentSlots(model, self.slots, self.max_len, bool(unroll)))
        self._prefilling = None  # (request, slot, PrefillJob): the prompt being prefilled in segments
        self.prefill_segments = 0  # segments run (layer-segmented prefill), all prompts
        cache_bytes = self.kv.device_bytes
        # resident: bytes per cached token; offloaded the device holds a fixed tier per slot, so this
        # spreads it over the slot's positions (the working-set estimate is not built: Scheduler)
        self.kv_bytes_per_token = cache_bytes / (self.slots * self.max_len)
        # a shared pool holds one step of at most max_rows rows (OffloadedSlots)
        rows = getattr(self.kv, "max_rows", self.slots)
        shared = getattr(self.kv, "shared", False)
        self.scheduler = Scheduler(
            max_requests=rows if max_requests is None else min(int(max_requests), rows),
            max_tokens_per_iter=(self.max_len + self.slots) if max_tokens_per_iter is None else int(max_tokens_per_iter),
            kv_bytes=(self.kv.pool_bytes if shared else cache_bytes) if kv_bytes is None else int(kv_bytes),
            kv_bytes_per_token=self.kv_bytes_per_token,
            working_set=self.kv.working_set)

        # host-side per-slot arrays, sent with each step (a few ints per row)
        self._tokens = np.zeros(self.slots, np.int32)
        self._active = np.zeros(self.slots, bool)
        self._seeds = np.zeros(self.slots, np.uint32)
        self._counters = np.zeros(self.slots, np.int32)
        self._temperature = np.zeros(self.slots, np.float32)
        self._top_p = np.ones(self.slots, np.float32)
        self._slots: list[_Slot | None] = [None] * self.slots
        self._fresh = np.zeros(self.slots, bool)  # inserted since the last step: its token is on the host
        self._inflight = None  # (tokens int32[B] on the device, the request per slot, issue time): not yet read

        self._inbox: queue.Queue[Request] = queue.Queue()
        self._waiting: collections.deque[Request] = collections.deque()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # guards the counters read by stats()
        self.steps = 0
        self.blocks_loaded = 0  # offloaded: KV blocks copied from the host, all steps
        self.step_times: list[float] = []  # seconds per decode iteration (dispatch to tokens on the host)
        self.step_end_times: list[float] = []  # when each ended (perf_counter)
        self.finished = collections.Counter()
        self.error: BaseException | None = None  # what stopped the engine thread (every request then failed)
        self.request_errors = 0  # requests failed on their own (their prefill), the engine serving on
        self._in_hand: Request | None = None  # admitted, being prefilled or inserted: in no list

    # -- the client side (any thread) ------------------------------------------------
    def make_request(self, prompt_ids: Sequence[int], params: SamplingParams,
                     on_event: Callable[[Event], Any] | None = None) -> Request:
        """A checked request (ValueError, before any device work, if it cannot run)."""
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
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model has none")
        r = Request(ids, params, on_event)
        self.scheduler.check_admissible(r)
        return r

    def submit(self, request: Request) -> Request:
        """Queue a request made by :meth:`make_request`; returns it."""
        if self.error is not None:
            raise RuntimeError(f"the engine stopped after an error: {self.error!r}")
        request.t_arrival = time.perf_counter()
        self._inbox.put(request)
        self._wake.set()
        return request

    def cancel(self, request: Request) -> None:
        """Ask the engine to drop ``request`` (frees its slot at the next iteration)."""
        request.cancelled = True
        self._wake.set()

    def stats(self) -> dict:
        """Counters: slots in use (and each slot's context ``max_len``), requests waiting,
        reserved KV bytes, totals."""
        with self._lock:
            active = int(self._active.sum())
            return {"slots": self.slots, "max_len": self.max_len, "active_slots": active,
                    "free_slots": self.slots - active,
                    "waiting": len(self._waiting) + self._inbox.qsize(),
                    "prefilling": int(self._prefilling is not None), "prefill_segments": self.prefill_segments,
                    "blocks_loaded": self.blocks_loaded, "working_set_bytes": sum(self.scheduler.working_set(s.request) for s in self._slots
                                             if s is not None),
                    "kv_bytes_budget": self.scheduler.kv_bytes, "steps": self.steps,
                    "admitted": self.scheduler.counters.admitted,
                    "deferred_for_tokens": self.scheduler.counters.deferred_for_tokens,
                    "deferred_for_memory": self.scheduler.counters.deferred_for_memory,
                    "finished": dict(self.finished), "request_errors": self.request_errors,
                    "running": self._thread is not None and self._thread.is_alive()}

    def idle(self) -> bool:
        s = self.stats()
        return s["active_slots"] == 0 and s["waiting"] == 0 and s["prefilling"] == 0

    # -- the engine thread -------------------------------------------------------------
    def start(self) -> "Engine":
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="sparse-jax-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float | None = 30.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._thread is None or not self._thread.is_alive():  # driven by iterate(), or stopped
            self._settle()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if not self.iterate():
                    self._wake.wait(0.05)
                    self._wake.clear()
            self._settle()
        except BaseException as e:  # noqa: BLE001  (reported to every request, then re-raised in the thread)
            self.error = e
            for r in self._all_requests():
                if r.finish_reason is None:
                    r.error = r.error or f"the engine stopped: {_describe(e)}"
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
        while True:
            try:
                self._waiting.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        worked = False
        for r in [r for r in self._waiting if r.cancelled]:
            self._waiting.remove(r)
            self._finish(r, "cancelled")
            worked = True
        for s in self._slots:
            if s is not None and s.request.cancelled:
                self._finish(s.request, "cancelled")
                worked = True
        running = [s.request for s in self._slots if s is not None]
        free = [i for i, s in enumerate(self._slots) if s is None]
        if self.max_inject_tokens is None:
            for r in self.scheduler.admit(list(self._waiting), running, len(free)):
                self._waiting.remove(r)
                self._prefill_insert(r, free.pop(0))
                worked = True
        else:
            if self._prefilling is None and free:  # one prompt in flight: it holds a slot, inactive
                for r in self.scheduler.admit(list(self._waiting), running, 1):
                    self._waiting.remove(r)
                    self._start_segmented(r, free.pop(0))
            if self._prefilling is not None:
                self._prefill_segment()
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

    def _prefill_insert(self, r: Request, slot: int) -> None:
        r.t_scheduled = time.perf_counter()
        self._in_hand = r
        try:
            logits, row = self.kv.prefill(r.prompt_ids)
            # its execution errors surface here, not in the insertion (whose failure is fatal): on
            # the H100 a 98K prompt's prefill ran out of memory, reported at the insertion's copy
            self.kv.wait(logits, row)
        except Exception as e:  # noqa: BLE001 - this request fails, the engine serves on
            self._fail(r, e)
            return
        self._insert_prefilled(r, slot, logits, row)

    def _fail(self, r: Request, e: Exception) -> None:
        """End ``r`` with ``finish_reason="error"`` after its own prefill failed (e.g. the
        device ran out of memory for its bucket). The prefill wrote nothing the running
        slots use (its row cache is its own; insertion, which donates the batch's cache,
        comes after), so the engine goes on with the others."""
        r.error = f"the prefill of this {r.prompt_len}-token prompt failed: {_describe(e)}"
        if "RESOURCE_EXHAUSTED" in str(e):  # what would make it fit
            hint = ("fewer slots or a shorter context, or offload=True" if not self.kv.offloaded else
                    "a layer-segmented prefill (max_inject_tokens) bounds a long prompt's activations"
                    if self.max_inject_tokens is None else "a smaller max_inject_tokens, or fewer slots")
            r.error += f" (out of device memory: {hint})"
        with self._lock:
            self.request_errors += 1
        self._in_hand = None
        self._finish(r, "error")

    def _insert_prefilled(self, r: Request, slot: int, logits, row) -> None:
        self._in_hand = r
        p = r.params
        first = self.kv._sample(logits, jnp.asarray([p.seed], jnp.uint32), jnp.zeros((1,), jnp.int32),
                                jnp.asarray([p.temperature], jnp.float32), jnp.asarray([p.top_p], jnp.float32))
        self.kv.insert(row, slot)
        with self._lock:
            self._slots[slot] = _Slot(r)
            r.slot = slot
            self._active[slot] = True
            self._fresh[slot] = True
            self._seeds[slot] = p.seed
            self._counters[slot] = 0
            self._temperature[slot] = p.temperature
            self._top_p[slot] = p.top_p
        self._in_hand = None  # in its slot now
        self._emit(slot, int(np.asarray(first)[0]), time.perf_counter())

    def _start_segmented(self, r: Request, slot: int) -> None:
        r.t_scheduled = time.perf_counter()
        try:
            job = self.kv.start_prefill(r.prompt_ids)
        except Exception as e:  # noqa: BLE001 - this request fails, the engine serves on
            self._fail(r, e)
            return
        with self._lock:
            self._slots[slot] = _Slot(r)  # reserved; the slot stays inactive until insertion
            r.slot = slot
        self._prefilling = (r, slot, job)

    def _prefill_segment(self) -> None:
        """Run the next segment of the prompt in flight (its layers within
        ``max_inject_tokens``); after its last layer, sample its first token and insert it."""
        r, slot, job = self._prefilling
        try:
            job.advance_budget(self.max_inject_tokens)
            self.prefill_segments += 1
            if not job.done:
                return
            logits, row = job.result()
            self.kv.wait(logits, row)
        except Exception as e:  # noqa: BLE001 - this request fails (its reserved slot freed), the engine serves on
            self._fail(r, e)
            return
        self._prefilling = None
        self._insert_prefilled(r, slot, logits, row)

    def _decode(self) -> None:
        """Issue one step, then collect the step before it: the device runs step t+1
        while the host reads step t's tokens, reports them and decides the ends
        (JetStream's ``copy_to_host_async`` overlap). A row fed from the device takes
        the token its last step sampled; a row inserted since takes its first token
        from the host. A request that ends at step t has one more step issued for it,
        whose token is dropped (its slot's capacity allows it: prompt + max_tokens <=
        max_len)."""
        t0 = time.perf_counter()
        prev = self._inflight
        self._counters += self._active  # index of the token this step samples
        # copies: on the CPU a device array may alias the NumPy buffer it came from, and these
        # host arrays change while the step is still queued
        host = [np.array(a) for a in (self._tokens, self._active, self._seeds, self._counters,
                                      self._temperature, self._top_p, self._fresh)]
        tokens = jnp.asarray(host[0])
        if prev is not None:
            tokens = _merge_tokens(jnp.asarray(host[6]), tokens, prev[0])
        toks = self.kv.step(tokens, *host[1:6])
        if hasattr(toks, "copy_to_host_async"):
            toks.copy_to_host_async()
        self._fresh[:] = False
        snapshot = [s.request if s is not None and self._active[i] else None for i, s in enumerate(self._slots)]
        self._inflight = (toks, snapshot, t0)
        if prev is not None:
            self._collect(prev)

    def _collect(self, inflight) -> None:
        toks, snapshot, t0 = inflight
        toks = np.asarray(toks)  # waits for that step only; the next one is already queued
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
                self._emit(slot, int(toks[slot]), now)

    def _emit(self, slot: int, tok: int, now: float) -> None:
        """Record token ``tok`` of the request in ``slot``: end it or report new text."""
        s = self._slots[slot]
        r = s.request
        p = r.params
        if r.t_first is None:
            r.t_first = now
        r.token_times.append(now)
        if tok in self.stop_ids and not p.ignore_eos:
            self._finish(r, "stop")
            return
        r.output_ids.append(tok)
        self._tokens[slot] = tok
        if self.tokenizer is None:
            self._send(r, Event("token", "", (tok,)))
        else:
            full = self.tokenizer.decode(r.output_ids)
            hit = min((i for i in (full.find(x, max(0, len(r.text) - len(x))) for x in p.stop) if i >= 0),
                      default=-1)
            if hit >= 0:  # a stop string: the text ends before it
                s.held_text = full[len(r.text):hit]
                self._finish(r, "stop", (tok,))
                return
            ready = full
            if ready.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for its next bytes
                ready = ready.rstrip("\ufffd")
            ready = ready[:len(ready) - _held_for_stop(ready, p.stop)]
            if not ready.startswith(r.text):  # decoding changed earlier text (rare): send from where it differs
                ready = r.text + ready[len(_common_prefix(ready, r.text)):]
            delta = ready[len(r.text):]
            s.held_text = full[len(ready):] if full.startswith(ready) else ""
            r.text = ready
            self._send(r, Event("token", delta, (tok,)))
        if len(r.output_ids) >= p.max_tokens:
            self._finish(r, "length")

    def _finish(self, r: Request, reason: str, last_ids: tuple[int, ...] = ()) -> None:
        """End ``r`` (free its slot), flush held text, report "done"."""
        rest = ""
        if self._prefilling is not None and self._prefilling[0] is r:
            self._prefilling = None  # cancelled mid-prefill: its layers done so far are dropped
        if r.slot is not None:
            s = self._slots[r.slot]
            if reason in ("length", "stop") and s is not None:
                rest = s.held_text
            with self._lock:
                self._slots[r.slot] = None
                self._active[r.slot] = False
            r.slot = None
        r.text += rest
        r.finish_reason = reason
        with self._lock:
            self.finished[reason] += 1
        self._send(r, Event("done", rest, last_ids, reason))
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


def _describe(e: BaseException) -> str:
    """``Type: message`` of an exception, its message cut to its first 400 characters
    (XLA's out-of-memory errors run to pages of HLO)."""
    msg = str(e).strip()
    return f"{type(e).__name__}: {msg[:400]}{' ...' if len(msg) > 400 else ''}"


def _held_for_stop(text: str, stops: Sequence[str]) -> int:
    """Characters at the end of ``text`` that could begin a stop string (held back)."""
    held = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), held, -1):
            if text.endswith(s[:k]):
                held = k
                break
    return held


def _common_prefix(a: str, b: str) -> str:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return a[:n]
