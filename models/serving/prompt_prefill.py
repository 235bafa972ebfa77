"""How the engine prefills prompts and inserts them into slots (:class:`PromptPrefill`,
mixed into :class:`models.serving.engine.Engine`).

One iteration's prompt work (:meth:`PromptPrefill._admit_and_prefill`), after the scheduler
admits what fits:

* **whole prefills** (the default of the contiguous engines): each admitted prompt runs its
  prefill program and is inserted into its slot now (JetStream's prefill / insert); the ``n``
  choices of a prompt admitted together share one prefill;
* **layer-segmented** (``max_inject_tokens``, SparseServe §3.4): one prompt in flight runs a
  segment of its layers per iteration, beside the decode step;
* **chunked** (``prefill_chunk``, the paged engine): the prompts in flight, in arrival order,
  run their next chunk while the chunks fit the iteration's budget; short prompts of one chunk
  run together in one program (:meth:`models.serving.paged.PagedSlots.run_prompt_group`); a
  prompt's other ``n`` choices wait and take its pages and row.

After a prompt's last segment or chunk its first token is sampled from its logits with its
slot's options and it is inserted (:meth:`PromptPrefill._insert_prefilled`). A prompt whose
prefill fails ends alone (``finish_reason="error"``) and the engine serves on, except where the
failure lost the shared pool (:class:`models.serving.paged.PoolLost`).

Requests with ``prompt_logprobs`` are scored first (:meth:`PromptPrefill._score_prompt`: one
forward over the prompt).

The mixin reads and writes the engine's state (``kv``, ``scheduler``, ``_slots``, ``_waiting``,
``_prefilling``, ``_active``, the counters under ``_lock``) and calls its ``_emit``,
``_finish`` and ``_collect``; it holds none of its own.
"""

from __future__ import annotations

import time
from typing import Any

import jax.numpy as jnp
import numpy as np

from models import programs
from models.api import round_up
from models.detokenize import TextStream
from models.sampling import logprob_width, sample_program
from models.serving.buckets import padded_prompt, prefill_bucket
from models.serving.paged import PoolLost, chunk_tokens, group_rows
from models.serving.requests import Request, TokenLogprob
from models.serving.slot_sampling import token_logprob


class Occupant:
    """Host-side bookkeeping of one occupied slot: its request and the text stream that
    turns its tokens into text (stop strings held back)."""

    def __init__(self, request: Request, tokenizer=None):
        self.request = request
        p = request.params
        self.text = None if tokenizer is None else TextStream(tokenizer.decode, p.stop, p.min_tokens)


class PromptPrefill:
    """The engine's prompt side (module docstring): admission into prefills, whole, segmented
    and chunked prefills, prompt groups, shared prefills of a prompt's ``n`` choices, insertion."""

    _prefilling: list[tuple[Request, int, Any]]

    def _admit_and_prefill(self) -> bool:
        """This iteration's admissions and prefills: whole prefills (each admitted prompt
        prefilled and inserted now), or segmented or chunked ones (admitted prompts start, then
        the prompts in flight run their next segment or chunk, in arrival order, within the
        chunk budget; short ones together). Returns whether it did any work."""
        worked = False
        running = [s.request for s in self._slots if s is not None]
        free = [i for i, s in enumerate(self._slots) if s is None]
        if self.max_inject_tokens is None and self.prefill_chunk is None:
            shared: dict = {}  # this iteration's prefills by prefill group (one prompt's n choices)
            for r in self.scheduler.admit(list(self._waiting), running, len(free)):
                if not self._reserve_prompt(r):
                    break
                self._waiting.remove(r)
                self._prefill_insert(r, free.pop(0), shared)
                worked = True
        else:
            # a prompt in flight holds a slot, inactive until its last segment or chunk
            for r in self.scheduler.admit(list(self._waiting), running, len(free) if self._room() else 0):
                if self._sibling_in_flight(r):
                    continue  # one of its prompt's n choices: it takes that prefill's pages and row
                if not self._room(r) or not self._reserve_prompt(r):
                    break
                self._waiting.remove(r)
                self._start_segmented(r, free.pop(0))
            used = 0
            pending = list(self._prefilling)
            while pending:  # in arrival order, while their chunks fit the budget
                entry = pending.pop(0)
                t = self._next_tokens(entry[2])
                if used and used + t > self.prefill_chunk:
                    break
                group = ([entry] if not self.paged or self.prefill_chunk is None
                         else self._prompt_group(entry, pending, self.prefill_chunk - used))
                if len(group) > 1:
                    used += self._prefill_group(group)
                else:
                    self._prefill_segment(entry)
                    used += t
                worked = True
        return worked

    def _score_prompt(self, r: Request) -> bool:
        """``r.prompt_logprobs`` from one forward over its prompt (:func:`models.programs.prompt_logprobs`,
        on this thread between steps); a request with ``max_tokens`` 0 ends here ("length"). False
        (the request failed, the engine serves on) when the forward failed."""
        ids, want = r.prompt_ids, r.params.prompt_logprobs
        n = len(ids)
        bucket = round_up(prefill_bucket(n, self.max_len), 64)  # the LM head runs 64 positions at a time
        tokens = padded_prompt(ids, bucket, self.model._pad_id())
        width = max(logprob_width(want), 0)
        r.t_scheduled = time.perf_counter()
        self._in_hand = r
        try:
            fn = programs.prompt_logprobs_fn(self.model.graphdef, self.model.config, self.model.method, width)
            nxt, top_ids, top = (np.asarray(a)[0] for a in fn(self.model.params, jnp.asarray(tokens)))
        except Exception as e:  # noqa: BLE001 - this request fails, the engine serves on
            self._in_hand = None
            r.error = f"scoring this {n}-token prompt failed: {describe(e)}"
            with self._lock:
                self.request_errors += 1
            self._finish(r, "error")
            return False
        self._in_hand = None
        r.prompt_logprobs = [None] + [
            TokenLogprob(ids[i], float(nxt[i - 1]),
                         tuple((int(t), float(v)) for t, v in zip(top_ids[i - 1][:want], top[i - 1][:want])))
            for i in range(1, n)]
        if r.params.max_tokens == 0:
            r.t_first = time.perf_counter()
            self._finish(r, "length")
        return True

    def _reserve_prompt(self, r: Request) -> bool:
        """Paged: give an admitted ``r`` the pages of its prefill and its first step; False
        (it stays waiting) when the pool lacks them (the scheduler's count and the pool's can
        differ by the pages of a request ended this iteration)."""
        return not self.paged or self.kv.reserve(r, r.prefill_len + 1)

    def _prefill_insert(self, r: Request, slot: int, shared: dict | None = None) -> None:
        """Prefill ``r`` and insert it into ``slot``. Requests of one ``prefill_group`` (the
        ``n`` choices of a prompt) admitted in the same iteration share one prefill: its row
        is inserted into each one's slot (resident and paged engines; the insertion does not
        consume the row), and each samples its first token from the same logits with its own
        seed."""
        r.t_scheduled = time.perf_counter()
        key = r.prefill_key if not self.kv.offloaded else None
        if shared is not None and key in shared:
            with self._lock:
                self.prefills_shared += 1
            self._insert_prefilled(r, slot, *shared[key])
            return
        self._in_hand = r
        try:
            if self.paged:  # straight into the request's pages (resident: and the slot, waited for there)
                logits, row = self.kv.prefill(r.prefill_ids, slot, r)
                if self.kv.offloaded:
                    self.kv.wait(logits, row)
            else:
                logits, row = self.kv.prefill(r.prefill_ids)
                # its execution errors surface here, not in the insertion (whose failure is fatal): on
                # the H100 a 98K prompt's prefill ran out of memory, reported at the insertion's copy
                self.kv.wait(logits, row)
        except PoolLost:  # the whole cache was donated to it: the engine stops, every request told
            raise
        except Exception as e:  # noqa: BLE001 - this request fails, the engine serves on
            self._fail(r, e)
            return
        with self._lock:
            self.prefills += 1
        if shared is not None and key is not None:
            shared[key] = (logits, row)
        self._insert_prefilled(r, slot, logits, row)

    def _fail(self, r: Request, e: Exception) -> None:
        """End ``r`` with ``finish_reason="error"`` after its own prefill failed (e.g. the
        device ran out of memory for its bucket). The prefill wrote nothing the running
        slots use (its row cache is its own; insertion, which donates the batch's cache,
        comes after), so the engine goes on with the others."""
        r.error = f"the prefill of this {r.prompt_len}-token prompt failed: {describe(e)}"
        if "RESOURCE_EXHAUSTED" in str(e):  # what would make it fit
            if self.max_inject_tokens is not None:
                hint = "a smaller max_inject_tokens, or fewer slots" + ("" if self.kv.offloaded else ", or offload=True")
            elif self.kv.offloaded:
                hint = "a layer-segmented prefill (max_inject_tokens) bounds a long prompt's activations"
            else:
                hint = "fewer slots or a shorter context, a layer-segmented prefill (max_inject_tokens), or offload=True"
            r.error += f" (out of device memory: {hint})"
        with self._lock:
            self.request_errors += 1
        self._in_hand = None
        self._finish(r, "error")

    def _insert_prefilled(self, r: Request, slot: int, logits, row) -> None:
        self._in_hand = r
        p = r.params
        done = len(r.output_ids)  # a preempted request resumes: its next token's index
        self._sampling.assign(slot, r)  # before the first token: it samples with the row's options
        first = sample_program(logits, self._sampling.build(np.asarray([done]), slot=slot))
        if self.paged:
            self.kv.insert(row, slot, r)
        else:
            self.kv.insert(row, slot)
        with self._lock:
            self._slots[slot] = self._parked.pop(r.id, None) or Occupant(r, self.tokenizer)
            r.slot = slot
            self._active[slot] = True
            self._fresh[slot] = True
            self._counters[slot] = done
        self._in_hand = None  # in its slot now
        self._emit(slot, int(np.asarray(first.tokens)[0]), time.perf_counter(), token_logprob(first, 0, p.logprobs))

    def _start_segmented(self, r: Request, slot: int) -> None:
        r.t_scheduled = time.perf_counter()
        try:
            job = self.kv.start_prefill(r.prefill_ids, slot, r) if self.paged else \
                self.kv.start_prefill(r.prefill_ids)
        except Exception as e:  # noqa: BLE001 - this request fails, the engine serves on
            self._fail(r, e)
            return
        with self._lock:
            # reserved; the slot stays inactive until insertion
            self._slots[slot] = self._parked.pop(r.id, None) or Occupant(r, self.tokenizer)
            r.slot = slot
        self._prefilling.append((r, slot, job))

    def _room(self, r: Request | None = None) -> bool:
        """Whether another prompt (``r``, or any) starts prefilling this iteration: layer-segmented,
        only when none is in flight; chunked, while the in-flight prompts' next chunks and ``r``'s
        first fit the iteration's budget (``prefill_chunk`` tokens)."""
        if not self._prefilling:
            return True
        if self.prefill_chunk is None:
            return False
        planned = sum(self._next_tokens(job) for _, _, job in self._prefilling)
        want = 64 if r is None else self._first_chunk_tokens(r)
        return planned + want <= self.prefill_chunk

    def _first_chunk_tokens(self, r: Request) -> int:
        """The prompt tokens ``r``'s first chunk runs (its compiled size): what it costs the
        iteration that starts it, for the budget here and the scheduler's T_max."""
        return chunk_tokens(r.prefill_len, self.kv.prefill_chunk)

    def _next_tokens(self, job) -> int:
        """The prompt tokens ``job``'s next chunk carries (its compiled size); a layer segment: 0."""
        return job.next_tokens if self.prefill_chunk is not None else 0

    def _drop_prefilling(self, r: Request) -> None:
        for _, _, job in [e for e in self._prefilling if e[0] is r]:
            drain = getattr(job, "drain", None)  # an offloaded prefill's page stores land before its pages go back
            if drain is not None:
                drain()
        self._prefilling = [e for e in self._prefilling if e[0] is not r]

    def _prompt_group(self, entry, pending: list, budget: int) -> list:
        """``entry`` and the short prompts after it in ``pending`` (taken out of it) that one
        program prefills together (:meth:`models.serving.paged.PagedSlots.run_prompt_group`): in
        arrival order, while the group's rows (a power of two) times its longest chunk fit
        ``budget`` tokens. Just ``entry`` where it is not a short prompt."""
        if not self.kv.groupable(entry[2]):
            return [entry]
        group, size = [entry], entry[2].next_tokens
        for other in [e for e in pending if self.kv.groupable(e[2])]:
            bigger = max(size, other[2].next_tokens)
            if group_rows(len(group) + 1) * bigger > budget:
                break
            group.append(other)
            pending.remove(other)
            size = bigger
        return group

    def _prefill_group(self, group: list) -> int:
        """Prefill the short prompts of ``group`` in one program, then sample each one's first
        token and insert it; returns the prompt tokens it ran (its rows x its chunk)."""
        tokens = self.kv.run_prompt_group([job for _, _, job in group])  # PoolLost if it fails: the engine stops
        self.prefill_segments += 1
        for entry in group:
            self._prefill_segment(entry, advance=False)
        return tokens

    def _prefill_segment(self, entry, advance: bool = True) -> None:
        """Run the next segment of the prompt ``entry`` (its layers within ``max_inject_tokens``, or
        its next chunk; ``advance=False``: it already ran, in a group); after its last, sample
        its first token and insert it."""
        r, slot, job = entry
        try:
            if advance:
                job.advance_budget(self.max_inject_tokens)
                self.prefill_segments += 1
            if not job.done:
                return
            logits, row = job.result()
            if self._inflight is not None:
                # the step queued before this prompt's last program ran before it: its tokens go out
                # now, not after the wait below (which put two chunks in one token gap: P99 TBT was
                # twice a chunk, benchmarks/results/serve_load_chunk_sweep_h200.md)
                inflight, self._inflight = self._inflight, None
                self._collect(inflight)
            self.kv.wait(logits, row)
        except PoolLost:  # a chunk into the pool donated the whole cache: the engine stops
            raise
        except Exception as e:  # noqa: BLE001 - this request fails (its reserved slot freed), the engine serves on
            self._fail(r, e)
            return
        self._drop_prefilling(r)
        key = r.prefill_key  # before its first token joins its prefill_ids
        self._insert_prefilled(r, slot, logits, row)
        self._share_prefill(key, logits, row)

    def _sibling_in_flight(self, r: Request) -> bool:
        """Whether another of ``r``'s prompt's ``n`` choices is being prefilled (chunked)."""
        key = r.prefill_key
        return key is not None and self.prefill_chunk is not None and \
            any(e[0].prefill_key == key for e in self._prefilling)

    def _share_prefill(self, key, logits, row) -> None:
        """Chunked prefill: the waiting requests of the prompt ``key`` (:attr:`Request.prefill_key`:
        the ``n`` choices of a request) take its prefill (pages and row copied, the first token sampled from
        the same logits with their own seeds), as many as have a free slot and pages; the others
        prefill on their own later."""
        if key is None or self.prefill_chunk is None:
            return
        for w in [w for w in self._waiting if w.prefill_key == key and not w.cancelled]:
            free = [i for i, s in enumerate(self._slots) if s is None]
            if not free or not self._reserve_prompt(w):
                return
            self._waiting.remove(w)
            w.t_scheduled = time.perf_counter()
            with self._lock:
                self.prefills_shared += 1
            self._insert_prefilled(w, free[0], logits, row)


def describe(e: BaseException) -> str:
    """``Type: message`` of an exception, its message cut to its first 400 characters
    (XLA's out-of-memory errors run to pages of HLO)."""
    msg = str(e).strip()
    return f"{type(e).__name__}: {msg[:400]}{' ...' if len(msg) > 400 else ''}"
