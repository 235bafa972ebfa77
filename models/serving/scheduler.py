"""The engine's admission: FCFS under R_max requests, T_max tokens per iteration and
M_avl bytes, with SparseServe's first-fit admission on a working-set estimate (Alg. 1)."""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

from models.serving.requests import Request



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
      requests' decode tokens plus the prompt tokens prefilled in it
      (``prompt_tokens(request)``: a whole prompt by default; its first chunk
      under chunked prefill). A prompt longer than what is left runs alone in an
      iteration without other prefills (it would otherwise never fit);
    * ``kv_bytes`` (M_avl): device bytes for the KV of the batch (beside running
      requests, less ``headroom_bytes``).

    ``base`` order is FCFS and stops at the first request that does not fit
    R_max / T_max (vLLM's ``get_batch``); over those candidates, Alg. 1
    admits first-fit while the working sets fit M_avl, leaving the others
    waiting.

    The working set (``working_set(request)``, a hook). Paged
    (:meth:`models.serving.paged.PagedSlots.working_set`): the pages a request holds, or
    for a waiting one the pages of its prefill and first step. Resident: the KV a
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
                 kv_bytes_per_token: float, working_set: Callable[[Request], int] | None = None,
                 headroom_bytes: int = 0, prompt_tokens: Callable[[Request], int] | None = None):
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
        #: the tokens a waiting request's prompt runs in the iteration that admits it
        self.prompt_tokens = prompt_tokens or (lambda r: r.prefill_len)
        # paged: M_avl kept free for the running requests to grow into when admitting beside them
        # (vLLM's watermark), so a request admitted into the last pages is not preempted at once
        self.headroom_bytes = int(headroom_bytes)
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
        groups = set()  # a prompt's n choices are prefilled once: their tokens count once (T_max)
        for r in waiting:
            if len(candidates) >= room:
                break
            key = r.prefill_key
            cost = 0 if key in groups else self.prompt_tokens(r)
            if tokens + cost > self.max_tokens_per_iter and candidates:
                self.counters.deferred_for_tokens += 1
                break
            candidates.append(r)
            tokens += cost
            if key is not None:
                groups.add(key)
        used = sum(self.working_set(r) for r in running)
        batch = []
        for r in candidates:
            m = self.working_set(r)
            headroom = self.headroom_bytes if (running or batch) else 0
            if used + m + headroom <= self.kv_bytes:
                batch.append(r)
                used += m
            else:
                self.counters.deferred_for_memory += 1
        self.counters.admitted += len(batch)
        self.counters.working_set_bytes = used
        return batch
