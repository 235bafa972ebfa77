"""Where the resident engine's KV lives, and the jitted pieces every engine runs on its slots.

* :class:`ResidentSlots`: one decode cache of ``slots`` rows on the device; a request's
  prefilled one-row cache is written into its slot (:func:`insert_slot`; every leaf has
  the batch as its leading axis, :func:`check_slot_axis`).
* The engine's step (:func:`engine_step`: the model's decode step, free slots held back, per-row
  sampling (:func:`models.sampling.sample_step`): one program, the cache donated), its inputs
  placed on a mesh (:func:`step_inputs`), and the first-token merge (:func:`merge_tokens`),
  which the offloaded slots (:mod:`models.serving.offloaded_slots`) and the paged ones
  (:mod:`models.serving.paged`) share.

Every slot back-end gives the engine the same calls: ``prefill(ids)``, ``insert(row, slot)``,
``step(tokens, active, sampling)``, ``wait``, ``settle`` and ``blocks_loaded``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from models import programs
from models.runtime.tiered import TieredRunner
from models.serving.buckets import longest_bucket, padded_prompt, prefill_bucket, segmented_prompt_tokens
from models.sampling import RowSampling, SampleOut, sample_step
from sparse_jax.cache import KVCache
from sparse_jax.offload import capacity
from sparse_jax.offload.capacity import device_budget



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
def sum_counters(counters: tuple) -> tuple[jax.Array, jax.Array]:
    """``((hits, misses), ...)`` per offloaded layer -> their sums over the layers, one program."""
    return functools.reduce(jnp.add, [h for h, _ in counters]), functools.reduce(jnp.add, [m for _, m in counters])


def engine_step(decode):
    """The engine's step around ``decode(params, tokens, cache) -> (logits, cache)``, not
    jitted: ``step(params, tokens [B], cache, active bool[B], sampling) -> (SampleOut,
    cache)``, the decode with free slots held back, then the sampling."""

    def step(params, tokens, cache, active, sampling: RowSampling):
        logits, new = decode(params, tokens, cache)
        # free slots do not advance: they never run past their capacity
        new = dataclasses.replace(new, lengths=jnp.where(active, new.lengths, cache.lengths))
        return sample_step(logits, tokens, active, sampling), new

    return step


class WarmupSteps:
    """Per slot, the decode steps it ran since its prompt went in: a step in which no
    active row is within its first ``warmup`` steps (the method's
    :attr:`~sparse_jax.methods.base.AttentionMethod.warmup_steps`: AsyncSpade's
    ``dense_steps``) runs the method's steady program, which gives such rows the same
    logits and cache without the warm-up's per-layer branch."""

    def __init__(self, slots: int, warmup: int):
        self.warmup = int(warmup)
        self.since = np.zeros(slots, np.int64)
        #: steps that ran the warm-up's program and the steady one (where the method has a warm-up)
        self.warm_steps = self.steady_steps = 0

    def inserted(self, slot: int) -> None:
        self.since[slot] = 0

    def warming(self, active) -> bool:
        """Whether a row of ``active`` (bool[B]) is within its warm-up at the next step (the
        caller then runs that program: counted in ``warm_steps`` / ``steady_steps``)."""
        if self.warmup == 0:
            return False
        warm = bool((np.asarray(active, bool) & (self.since < self.warmup)).any())
        if warm:
            self.warm_steps += 1
        else:
            self.steady_steps += 1
        return warm

    def stepped(self, active) -> None:
        self.since += np.asarray(active, bool)


def _engine_programs(decode):
    """The engine's jitted programs around ``decode(params, tokens, cache) -> (logits,
    cache)``: the step (:func:`engine_step`; cache donated; one compilation per
    :class:`~models.sampling.RowSampling` structure, so options no row asks for cost
    nothing) and the slot insertion."""
    return jax.jit(engine_step(decode), donate_argnums=(2,)), jax.jit(insert_slot, donate_argnums=(0,))


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


def replicated(mesh) -> NamedSharding | None:
    """Where an engine over ``mesh`` (tensor parallelism) places what its step takes from the
    host: every device holds it whole (``NamedSharding(mesh, P())``, the sharding the paged
    engine's ``shard_map`` step gives its own sampled tokens and penalty counts, which the next
    step takes); None on one device."""
    return None if mesh is None else NamedSharding(mesh, PartitionSpec())


def step_inputs(sharding: NamedSharding | None, tokens, active, sampling: RowSampling):
    """``(tokens, active, sampling)`` as the engine's step takes them: on one device
    ``jnp.asarray`` (uncommitted, as ever); on a mesh each array placed on ``sharding``
    (:func:`replicated`), a no-op for one already there. Left as they came, the tokens were a
    host array (uncommitted, on device 0) at a batch's first step and the last step's output
    (on the mesh) after it, and the penalty counts likewise: the jitted step, keyed on its
    arguments' shardings, compiled a program for each mix it met, during serving."""
    if sharding is None:
        return jnp.asarray(tokens), jnp.asarray(active), sampling
    return jax.device_put((tokens, active, sampling), sharding)


@jax.jit
def merge_tokens(fresh: jax.Array, host: jax.Array, device: jax.Array) -> jax.Array:
    """``int32[B]``: the host's token where ``fresh`` (a request inserted since the last
    step), else the token the last step sampled, still on the device."""
    return jnp.where(fresh, host, device)


class RowPrefillJob:
    """A resident prompt's layer-by-layer prefill (:class:`models.runtime.tiered.PrefillJob`
    of a ``"resident"`` runner): the same ``advance_budget`` / ``done`` as the offloaded
    engine's, and ``result()`` gives ``(logits f32[1, V], one-row KVCache)``, what
    :meth:`ResidentSlots.prefill` gives, for :meth:`ResidentSlots.insert`."""

    def __init__(self, job):
        self.job = job

    @property
    def done(self) -> bool:
        return self.job.done

    def advance_budget(self, tokens: int) -> bool:
        return self.job.advance_budget(tokens)

    def result(self):
        logits, state = self.job.result()
        return logits, state.cache


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

    def __init__(self, model, slots: int, max_len: int, unroll: bool, segmented: bool = False):
        check_engine_mesh(model)
        check_slot_axis(model, max_len)
        self.model, self.slots, self.max_len = model, slots, max_len
        self._compiled_prefill: dict[int, Any] = {}  # bucket -> program compiled ahead of time
        self._runner = None  # the layer-by-layer prefill's (start_prefill), made at its first use
        self.warmup = WarmupSteps(slots, model.method.warmup_steps)
        self._inputs = replicated(getattr(model, "mesh", None))  # the step's host inputs (step_inputs)
        if getattr(model, "mesh", None) is not None:
            self._step, self._insert = _sharded_programs(model.fns.decode_step)
            steady = model.fns.steady_decode_step
            self._steady_step = self._step if steady is None else _sharded_programs(steady)[0]
        else:
            self._step, self._insert = _programs(model.graphdef, model.config, model.method, unroll)
            self._steady_step = _programs(model.graphdef, model.config, model.method.steady_state(), unroll)[0]

            temps = 0
            if device_budget() is not None and segmented:
                # prompts prefill a layer at a time (start_prefill): one layer's program holds the
                # temporaries, not the whole prompt's (the longest's layer programs compiled here)
                self._runner = TieredRunner(model, "resident")
                temps = self._runner.prefill_temp_bytes(longest_bucket(max_len), max_len)
            elif device_budget() is not None and hasattr(model.fns.prefill, "lower"):  # one jitted program
                bucket, compiled, temps = compile_longest_prefill(model, max_len)
                self._compiled_prefill[bucket] = compiled
            check_resident_fits(model, slots, max_len, prefill_temp_bytes=temps)
        self.cache = model.init_cache(slots, max_len)
        self.device_bytes = self.cache.nbytes()

    def prefill(self, ids: Sequence[int]):
        """``(logits f32[1, V], one-row cache)`` of a prompt."""
        m, n = self.model, len(ids)
        bucket = prefill_bucket(n, self.max_len)
        tokens = padded_prompt(ids, bucket, m._pad_id())
        prefill = self._compiled_prefill.get(bucket, m.fns.prefill)
        return prefill(m.params, jnp.asarray(tokens), jnp.asarray([n], jnp.int32), m.init_cache(1, self.max_len))

    def start_prefill(self, ids: Sequence[int]) -> RowPrefillJob:
        """A layer-by-layer prefill of one prompt (:class:`RowPrefillJob`) that the engine
        advances a segment per iteration beside the decode step (``Engine(max_inject_tokens=N)``):
        each layer's K/V and method state are finished into the one-row cache as the layer
        ends, so the row is what :meth:`prefill` makes (the same programs as
        :class:`models.runtime.tiered.TieredRunner` ``"resident"``)."""
        if self._runner is None:
            self._runner = TieredRunner(self.model, "resident")
        n = len(ids)
        tokens = padded_prompt(ids, segmented_prompt_tokens(n, self.max_len), self.model._pad_id())
        return RowPrefillJob(self._runner.start_prefill(tokens, np.asarray([n], np.int32), self.max_len))

    def insert(self, row, slot: int) -> None:
        self.cache = self._insert(self.cache, row, jnp.int32(slot))
        self.warmup.inserted(slot)

    def step(self, tokens, active, sampling: RowSampling) -> SampleOut:
        """One decode step of every slot (``active bool[B]``: the rows that advance) and its
        sampling; the cache is donated and replaced. The method's steady program when no
        active row is within its warm-up (:class:`WarmupSteps`)."""
        step = self._step if self.warmup.warming(active) else self._steady_step
        tokens, active_, sampling = step_inputs(self._inputs, tokens, active, sampling)
        out, self.cache = step(self.model.params, tokens, self.cache, active_, sampling)
        self.warmup.stepped(active)
        return out

    def blocks_loaded(self, active) -> int:
        return 0

    @staticmethod
    def wait(logits, row) -> None:
        """Block until a prefill's outputs exist: the device reports a failure of the
        prefill (out of memory) when its outputs are waited for."""
        jax.block_until_ready((logits, row))

    def settle(self) -> None:
        """Nothing of its own in flight (see :meth:`models.serving.offloaded_slots.OffloadedSlots.settle`)."""

    working_set = None  # the scheduler's reservation estimate
