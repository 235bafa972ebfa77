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

#: the most top log-probabilities a request may ask for per token (vLLM's default ``max_logprobs``)
MAX_LOGPROBS = 20
#: the most ``logit_bias`` entries of one request
MAX_LOGIT_BIAS = 1024


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it ends (:mod:`models.sampling` applies it, on the
    device, per row).

    ``temperature`` 0 is greedy; otherwise temperature sampling from ``seed`` (the same
    seed gives the same tokens whatever else is in the batch), restricted by ``min_p``
    (tokens below ``min_p`` times the top token's probability; 0: off), ``top_k`` (0: off)
    and ``top_p`` (nucleus). Before either: ``logit_bias`` (``(token id, bias)`` pairs
    added to the logits, OpenAI's [-100, 100]), ``min_tokens`` (the stop tokens banned, and
    stop strings not looked for, until that many tokens exist), and the penalties:
    ``presence_penalty`` / ``frequency_penalty`` ([-2, 2]) subtract per output occurrence of
    a token (once / per count), ``repetition_penalty`` (> 0; 1: off) divides a positive logit
    (multiplies a negative one) of every token in the prompt or the output.
    ``logprobs``: None, no log-probabilities; else each generated token's and its top
    ``logprobs`` tokens' (0 to :data:`MAX_LOGPROBS`); ``prompt_logprobs`` the same for every
    prompt token after the first (the prompt scored by one forward; with it ``max_tokens`` may
    be 0: scored, nothing generated). ``stop``: strings that end the output
    (not included). ``ignore_eos``: run to ``max_tokens`` (load benchmarks on random weights)."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def check(self) -> None:
        if int(self.max_tokens) < (0 if self.prompt_logprobs is not None else 1):
            raise ValueError(f"max_tokens must be >= 1 (0 only to score the prompt), got {self.max_tokens}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= int(self.seed) < 2**32:
            raise ValueError(f"seed must be in [0, 2**32), got {self.seed}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty strings, got {list(self.stop)}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or not 0 <= self.top_k < 2**31:
            raise ValueError(f"top_k must be an int in [0, 2**31) (0: off), got {self.top_k!r}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not (0 < self.repetition_penalty and math.isfinite(self.repetition_penalty)):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        if not 0 <= int(self.min_tokens) <= int(self.max_tokens):
            raise ValueError(f"min_tokens must be in [0, max_tokens = {self.max_tokens}], got {self.min_tokens}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias has {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS}")
        for t, b in self.logit_bias:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"logit_bias keys must be token ids (ints >= 0), got {t!r}")
            if not -100 <= b <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {b} for token {t}")
        if len({t for t, _ in self.logit_bias}) != len(self.logit_bias):
            raise ValueError("logit_bias names a token twice")
        if self.logprobs is not None and not (isinstance(self.logprobs, int) and not isinstance(self.logprobs, bool)
                                              and 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be None or an int in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.prompt_logprobs is not None and not (
                isinstance(self.prompt_logprobs, int) and not isinstance(self.prompt_logprobs, bool)
                and 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise ValueError(f"prompt_logprobs must be None or an int in [0, {MAX_LOGPROBS}], "
                             f"got {self.prompt_logprobs!r}")

    @property
    def penalized(self) -> bool:
        """Whether a penalty is on (the sampler then keeps the row's token counts)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the model, and the top tokens' (``(id, logprob)``
    pairs, most likely first) at its position."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclasses.dataclass
class Event:
    """What the engine reports to a request: ``kind`` "token" (``text`` the new
    text, ``token_ids`` the new ids; text may lag ids while an incomplete UTF-8
    sequence or a possible stop string is held back; ``logprobs`` one per id when the request
    asked) or "done" (with
    ``finish_reason``: "stop", "length", "cancelled" or "error", when the request's
    ``error`` says what failed; ``text`` any text left)."""

    kind: str
    text: str = ""
    token_ids: tuple[int, ...] = ()
    finish_reason: str | None = None
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token of token_ids, when the request asked


class Request:
    """One generation: the prompt's ids, its sampling parameters, and what the
    engine recorded about it (times are ``time.perf_counter()`` seconds)."""

    _ids = itertools.count()

    def __init__(self, prompt_ids: Sequence[int], params: SamplingParams,
                 on_event: Callable[[Event], Any] | None = None, prefill_group: Any = None):
        self.id = next(Request._ids)
        # requests of one group with the same prompt may share one prefill (the n choices of a prompt)
        self.prefill_group = prefill_group
        self.prompt_ids = [int(i) for i in prompt_ids]
        self.params = params
        self.on_event = on_event
        self.output_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []  # one per output id, when params.logprobs is set
        # params.prompt_logprobs: one per prompt id, None for the first (nothing predicts it)
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
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
    def prefill_key(self):
        """The key of the prefill this request may share with the other ``n`` choices of its
        request (the same ``prefill_group`` and prefill ids); None: its prefill is its own."""
        return (self.prefill_group, tuple(self.prefill_ids)) if self.prefill_group is not None else None

    @property
    def reserved_tokens(self) -> int:
        """Cache positions the request can occupy: its prompt and every token it may generate."""
        return self.prompt_len + int(self.params.max_tokens)

    def __repr__(self) -> str:
        return (f"Request(id={self.id}, prompt={self.prompt_len} tokens, out={len(self.output_ids)}, "
                f"slot={self.slot}, finish={self.finish_reason})")
