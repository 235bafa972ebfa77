"""KV blocks for a paged engine: one pool of fixed-size blocks shared by every request,
a block table per request (vLLM's block manager, on the host).

The pool holds ``num_blocks`` blocks of ``block_size`` token positions (per layer and KV
head on the device; here only their ids). Block 0 is the *null block*: never given to a
request, it pads every block table past the request's blocks, so a device program can
index a table of fixed width ``max_blocks_per_request`` everywhere (what it reads there is
masked by the request's length). A request's table names its blocks in token order: token
``p`` lives in block ``table[p // block_size]`` at offset ``p % block_size``.

Blocks are allocated as a request grows (:meth:`BlockManager.reserve` before the step
that writes position ``n - 1``) and all freed when it ends (:meth:`BlockManager.free`), so
the pool holds the tokens that exist, not ``slots x max_len``. Admission asks
:meth:`BlockManager.can_reserve` (the scheduler's M_avl, in blocks); when a running
request cannot grow, the engine preempts or waits; nothing here fails on the device.

Host-side and O(blocks) per call: a free list (LIFO, so a freed block is reused first
while it is warm in the L2) and a dict of tables.
"""

from __future__ import annotations

from typing import Hashable

import numpy as np

from sparse_jax.cache import NULL_PAGE

NULL_BLOCK = NULL_PAGE  # the pools' null page: unheld table entries and free rows point there


class OutOfBlocks(RuntimeError):
    """Raised by :meth:`BlockManager.reserve` when the pool has too few free blocks."""


def pool_plan(pages: int, block_size: int, slots: int, max_len: int, *, asked: bool, memory: str,
              detail: str = "") -> tuple[str, str]:
    """What bounds a paged engine's batch, and a line saying so: ``(bound, line)``.

    ``pages``: the pool's blocks, the null block included; ``asked``: the caller chose the
    count (``--kv-blocks`` / ``--host-pages``), else memory did, at most every slot full;
    ``memory``: the memory the pool lives in ("device memory", "host memory"). ``bound`` is
    "slots" when every slot can hold a request of ``max_len`` at once (the pool never makes a
    full batch wait), else ``memory`` (or "asked"): fewer than ``slots`` requests of
    ``max_len`` fit, shorter ones more, up to ``slots``."""
    per_request = -(-max_len // block_size)
    contexts = (pages - 1) // per_request
    if contexts >= slots:
        bound = "slots"
    else:
        bound = "asked" if asked else memory
    pool = f"KV pool: {pages - 1:,} pages of {block_size} tokens in {memory}"
    if bound == "slots":
        line = f"{pool}: every slot can hold a request of {max_len:,} tokens; the batch is bound by the slots ({slots})"
    else:
        why = "the pages asked for" if bound == "asked" else f"{memory}{detail}"
        line = (f"{pool}: {contexts} request{'s' * (contexts != 1)} of {max_len:,} tokens at once, shorter ones more, "
                f"up to {slots} slots; the batch is bound by {why}")
    return bound, line


class BlockManager:
    """``num_blocks`` blocks of ``block_size`` positions (block 0 the null block, so
    ``num_blocks - 1`` usable), tables of at most ``max_blocks_per_request`` blocks."""

    def __init__(self, num_blocks: int, block_size: int, max_blocks_per_request: int):
        for name, v in (("num_blocks", num_blocks), ("block_size", block_size),
                        ("max_blocks_per_request", max_blocks_per_request)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
        self.num_blocks, self.block_size = int(num_blocks), int(block_size)
        self.max_blocks_per_request = int(max_blocks_per_request)
        self._free = list(range(self.num_blocks - 1, 0, -1))  # pop() gives 1, 2, ... first
        self._tables: dict[Hashable, list[int]] = {}

    # -- counts ----------------------------------------------------------------------
    @property
    def total(self) -> int:
        """Blocks a request can get (the null block excluded)."""
        return self.num_blocks - 1

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, tokens: int) -> int:
        """Blocks that hold ``tokens`` positions."""
        return -(-int(tokens) // self.block_size)

    def held(self, rid: Hashable) -> int:
        """Blocks request ``rid`` holds (0 for one it does not know)."""
        return len(self._tables.get(rid, ()))

    @property
    def requests(self) -> list:
        return list(self._tables)

    # -- allocation ----------------------------------------------------------------------
    def can_reserve(self, rid: Hashable, tokens: int) -> bool:
        """Whether :meth:`reserve` of ``tokens`` positions for ``rid`` would succeed."""
        need = self.blocks_for(tokens)
        return need <= self.max_blocks_per_request and need - self.held(rid) <= len(self._free)

    def reserve(self, rid: Hashable, tokens: int) -> list[int]:
        """Make request ``rid`` (new or known) hold blocks for its first ``tokens``
        positions; returns the blocks added (none when it already has them). Raises
        :class:`OutOfBlocks` (nothing changed) when the pool lacks them, ValueError past
        the table's width."""
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {tokens}")
        need = self.blocks_for(tokens)
        if need > self.max_blocks_per_request:
            raise ValueError(f"{tokens} positions need {need} blocks of {self.block_size}; a request holds at most "
                             f"{self.max_blocks_per_request}")
        more = need - self.held(rid)
        if more <= 0:
            return []
        if more > len(self._free):
            raise OutOfBlocks(f"request {rid!r} needs {more} more blocks, {len(self._free)} of {self.total} are free")
        added = [self._free.pop() for _ in range(more)]
        self._tables.setdefault(rid, []).extend(added)
        return added

    def free(self, rid: Hashable) -> int:
        """Return every block of ``rid`` to the pool (it is forgotten); returns how many."""
        table = self._tables.pop(rid, [])
        self._free.extend(reversed(table))  # its first block is reused first
        return len(table)

    # -- tables ----------------------------------------------------------------------------
    def table(self, rid: Hashable) -> np.ndarray:
        """``int32[max_blocks_per_request]``: ``rid``'s blocks in token order, then the null block."""
        out = np.full(self.max_blocks_per_request, NULL_BLOCK, np.int32)
        blocks = self._tables.get(rid, ())
        out[:len(blocks)] = blocks
        return out

    def tables(self, rids) -> np.ndarray:
        """``int32[len(rids), max_blocks_per_request]``: a batch's tables (None: a row of the null block)."""
        out = np.full((len(rids), self.max_blocks_per_request), NULL_BLOCK, np.int32)
        for i, rid in enumerate(rids):
            if rid is not None:
                blocks = self._tables.get(rid, ())
                out[i, :len(blocks)] = blocks
        return out

    def check(self) -> None:
        """AssertionError unless every usable block is free or held by exactly one request."""
        held = [b for t in self._tables.values() for b in t]
        every = sorted(held + self._free)
        assert every == list(range(1, self.num_blocks)), "a block is lost or given twice"


class PagedRequests:
    """What the two paged slot back-ends (``PagedSlots``: device pages; the paged
    ``OffloadedSlots``: host pages) answer the engine alike, from their ``self.blocks``
    (a :class:`BlockManager`). ``pages_name``: how their messages call a page."""

    pages_name = "pages"
    #: a request grows by at least this many positions at a time while the pool has them: each
    #: change of a table row is a new buffer for the step (set by each back-end)
    grow_tokens = 1

    def reserve(self, r, tokens: int) -> bool:
        """Give ``r`` pages for its first ``tokens`` positions; False (nothing changed) when the
        pool lacks them. Its slot's table row follows (:meth:`_table_row_changed`, sent with the
        next step). While the pool has them, :attr:`grow_tokens` positions at a time (at most
        what ``r`` may use), so the table changes once per ``grow_tokens`` steps of a row, not
        once per page."""
        if self.blocks.blocks_for(tokens) > self.blocks.held(r.id):
            ahead = min(-(-tokens // self.grow_tokens) * self.grow_tokens, self.max_len,
                        max(r.reserved_tokens, tokens))
            if ahead > tokens and self.blocks.can_reserve(r.id, ahead):
                tokens = ahead
        try:
            added = self.blocks.reserve(r.id, tokens)
        except OutOfBlocks:
            return False
        if added and r.slot is not None and self._owner[r.slot] == r.id:
            self._table_row_changed(r.slot, self.blocks.table(r.id))
        return True

    def _table_row_changed(self, slot: int, table) -> None:
        """Write a slot's new table row where the back-end's step reads it."""
        raise NotImplementedError

    @property
    def kv_blocks_total(self) -> int:
        return self.blocks.total

    @property
    def kv_blocks_free(self) -> int:
        return self.blocks.free_blocks

    @property
    def holds_every_slot_full(self) -> bool:
        """Whether the pool holds every slot's ``max_len`` at once: no request can then run out
        of pages (nor be preempted)."""
        return self.blocks.total >= self.slots * self.blocks.max_blocks_per_request

    def blocks_needed(self, r) -> int:
        """Pages ``r`` holds, or (waiting) the pages of its prefill and its first step."""
        held = self.blocks.held(r.id)
        return held if held else self.blocks.blocks_for(r.prefill_len + 1)

    def check_holds(self, r, tokens: int) -> None:
        """RuntimeError unless ``r`` holds the pages of its first ``tokens`` positions (the
        engine reserves a prompt's pages before it is prefilled or inserted)."""
        if self.blocks.held(r.id) < self.blocks.blocks_for(tokens):
            raise RuntimeError(f"request {r.id} holds {self.blocks.held(r.id)} {self.pages_name}, its {tokens} "
                               f"tokens need more")

