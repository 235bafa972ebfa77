"""What a client asks the engine for and what it hears back: :class:`SamplingParams`
(checked before anything runs), :class:`Request` (the prompt, its parameters, and the
engine's record of it) and :class:`Event` (a token's text, or the end)."""

from __future__ import annotations

import dataclasses
import itertools
import math
import threading
import time
from typing import Any, Callable, Sequence

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
        self.preemptions = 0      # times its pages were taken back and it was requeued
        self.t_arrival = time.perf_counter()
        self.t_scheduled: float | None = None   # prefill started
        self.t_first: float | None = None       # first token produced
        self.token_times: list[float] = []      # one per output token
        self.done = threading.Event()

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def prefill_ids(self) -> list[int]:
        """What a prefill puts in the cache: the prompt, and the output so far of a request
        that was preempted (its pages freed: vLLM's recompute preemption)."""
        return self.prompt_ids + self.output_ids

    @property
    def prefill_len(self) -> int:
        return self.prompt_len + len(self.output_ids)

    @property
    def reserved_tokens(self) -> int:
        """Cache positions the request can occupy: its prompt and every token it may generate."""
        return self.prompt_len + int(self.params.max_tokens)

    def __repr__(self) -> str:
        return (f"Request(id={self.id}, prompt={self.prompt_len} tokens, out={len(self.output_ids)}, "
                f"slot={self.slot}, finish={self.finish_reason})")
