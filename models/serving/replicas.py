"""Data-parallel serving: one :class:`models.serving.engine.Engine` per device group.

An engine serves one replica of the model (its slots' caches and every request's
prefill on the replica's devices; ``shard(model, model=n)`` makes a replica span
``n`` devices by KV heads). :class:`EngineReplicas` runs several, one per group of
devices, behind the engine's client interface (``make_request``, ``submit``,
``cancel``, ``stats``, ``start``, ``stop``, ``generate``), so the OpenAI server
(``python -m models.serve --data-parallel N``) serves them as one model:

* each request goes to the replica with the fewest unfinished requests (ties to the
  replica that was given fewest), and stays there: a request is never split or moved;
* every replica runs its own engine thread and decode step; replicas share
  nothing per step (no collective), so throughput adds up over replicas;
* ``stats()`` sums the counters and lists each replica's.

Weights are copied to every group (``replicate``); the copy the replicas came
from is dropped by the caller.
"""

from __future__ import annotations

import collections
import threading
from typing import Any, Callable, Sequence

import jax

from models.api import Model
from models.runtime.sharding import shard
from models.serving.engine import Engine
from models.serving.requests import Event, Request, SamplingParams


def device_groups(replicas: int, per_replica: int, devices=None) -> list[list]:
    """``replicas`` groups of ``per_replica`` consecutive devices (ValueError when there are too few)."""
    devices = list(jax.devices() if devices is None else devices)
    need = int(replicas) * int(per_replica)
    if replicas < 1 or per_replica < 1:
        raise ValueError(f"replicas and devices per replica must be >= 1, got {replicas} and {per_replica}")
    if len(devices) < need:
        raise ValueError(f"{replicas} replica(s) x {per_replica} device(s) need {need} devices; {len(devices)} "
                         f"visible ({devices[0].platform}). On CPU, set "
                         f"XLA_FLAGS=--xla_force_host_platform_device_count={need} before jax starts")
    return [devices[i * per_replica:(i + 1) * per_replica] for i in range(replicas)]


def place(model, device):
    """``model`` with its params copied to ``device`` (an unsharded model: the paged engine's
    replica, which runs there, :attr:`models.serving.engine.Engine.device`)."""
    return Model(model.config, model.graphdef, jax.device_put(model.params, device), model.tokenizer, model.method,
                 model.dtype, model.max_len, model.unroll)


def replicate(model, replicas: int, *, tensor_parallel: int = 1, devices=None, **engine_options) -> "EngineReplicas":
    """``replicas`` engines, each on its own group of ``tensor_parallel`` devices (the
    model sharded over the group by KV heads, ``shard(model, model=tensor_parallel,
    devices=group)``; one device: the model placed on it), with the same
    ``engine_options`` (:class:`models.serving.engine.Engine`'s keywords). A paged engine
    (``paged=True``) of one device gets the model's params copied there (:func:`place`), its
    pool and programs on it; over a group, its pools are split by KV head like the params."""
    groups = device_groups(replicas, tensor_parallel, devices)
    if engine_options.get("paged") and engine_options.get("offload"):
        raise ValueError("the paged offloaded engine runs one device (its host tier is placed on the first): "
                         "no replicas of it yet")
    if engine_options.get("paged") and tensor_parallel == 1:
        engines = [Engine(place(model, g[0]), **engine_options) for g in groups]
    else:
        engines = [Engine(shard(model, model=tensor_parallel, devices=g), **engine_options) for g in groups]
    return EngineReplicas(engines)


class EngineReplicas:
    """Several engines (replicas of one model) behind one engine interface (module docstring)."""

    def __init__(self, engines: Sequence[Engine]):
        engines = list(engines)
        if not engines:
            raise ValueError("EngineReplicas needs at least one engine")
        first = engines[0]
        for e in engines[1:]:
            if (e.model.config != first.model.config or e.max_len != first.max_len or e.context != first.context
                    or type(e.model.method) is not type(first.model.method)):
                raise ValueError("the replicas must serve the same model, method and context")
        self.engines = engines
        self.model = first.model
        self.tokenizer = first.tokenizer
        self.context = first.context
        self.max_len = first.max_len
        self.slots = sum(e.slots for e in engines)
        self._given = collections.Counter()  # requests given to each replica
        self._owner: dict[int, tuple[int, Request]] = {}  # request id -> (replica, request); done ones pruned
        self._lock = threading.Lock()

    @property
    def error(self) -> BaseException | None:
        return next((e.error for e in self.engines if e.error is not None), None)

    # -- the client side ---------------------------------------------------------------
    def make_request(self, prompt_ids: Sequence[int], params: SamplingParams,
                     on_event: Callable[[Event], Any] | None = None, prefill_group: Any = None) -> Request:
        """A checked request (the replicas are alike: the first one checks it)."""
        return self.engines[0].make_request(prompt_ids, params, on_event, prefill_group=prefill_group)

    def _load(self, i: int) -> tuple:
        # the requests given to replica i and not finished, counted here: the engine's own
        # counters miss a request between its queues (e.g. while its prefill runs)
        busy = sum(1 for j, r in self._owner.values() if j == i and not r.done.is_set())
        return (busy, self._given[i], i)

    def submit(self, request: Request) -> Request:
        """Queue ``request`` on the least-loaded replica; returns it."""
        return self.submit_all([request])[0]

    def submit_all(self, requests: Sequence[Request]) -> list[Request]:
        """Queue ``requests`` together on the least-loaded replica (a prompt's ``n`` choices
        share its prefill there); returns them."""
        if self.error is not None:
            raise RuntimeError(f"a replica stopped after an error: {self.error!r}")
        with self._lock:
            i = min(range(len(self.engines)), key=self._load)
            self._given[i] += len(requests)
            if len(self._owner) > 1024:
                self._owner = {k: v for k, v in self._owner.items() if not v[1].done.is_set()}
            for r in requests:
                self._owner[r.id] = (i, r)
        return self.engines[i].submit_all(requests)

    def replica_of(self, request: Request) -> int | None:
        """The replica a submitted request went to (None when unknown or long finished)."""
        got = self._owner.get(request.id)
        return None if got is None else got[0]

    def cancel(self, request: Request) -> None:
        i = self.replica_of(request)
        if i is None:
            request.cancelled = True
            return
        self.engines[i].cancel(request)

    def stats(self) -> dict:
        """The replicas' counters summed (``finished`` merged, ``alive`` when all run),
        and each replica's under ``replicas``."""
        per = [e.stats() for e in self.engines]
        out: dict = {}
        for key, value in per[0].items():
            if key == "finished":
                total = collections.Counter()
                for s in per:
                    total.update(s["finished"])
                out[key] = dict(total)
            elif key == "alive":
                out[key] = all(s["alive"] for s in per)
            elif key == "max_len":  # every replica's slots hold the same context
                out[key] = value
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                out[key] = sum(s[key] for s in per)
            else:
                out[key] = value
        out["replicas"] = per
        out["requests_given"] = [self._given[i] for i in range(len(self.engines))]
        return out

    def idle(self) -> bool:
        return all(e.idle() for e in self.engines)

    def start(self) -> "EngineReplicas":
        for e in self.engines:
            e.start()
        return self

    def precompile(self, **options) -> dict:
        """Each replica's :meth:`Engine.precompile` (one after another; each compiles in
        parallel threads): the programs counted and the seconds summed, failures listed."""
        runs = [e.precompile(**options) for e in self.engines]
        return {"programs": sum(r["programs"] for r in runs), "seconds": sum(r["seconds"] for r in runs),
                "failed": [f for r in runs for f in r.get("failed", [])],
                "background": bool(options.get("background"))}

    def stop(self, timeout: float | None = 30.0) -> None:
        for e in self.engines:
            e.stop(timeout)

    #: submit and wait (the engine threads must be running): the engine's own, on the replicas
    generate = Engine.generate
