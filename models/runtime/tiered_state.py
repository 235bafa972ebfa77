"""The offloaded runner's state between steps, and the host side of a paged host tier.

:class:`HostPages` is the block table of a paged host tier, kept on the host (the CPU's saves
read it); :class:`TieredState` everything one batch carries between the steps of
:class:`models.runtime.tiered.TieredRunner`; :func:`host_view` the writable NumPy view of a
pinned host buffer that the CPU-assisted saving stores into.
"""

from __future__ import annotations

import ctypes
import dataclasses

import jax
import numpy as np

from sparse_jax.cache import NULL_PAGE, KVCache


class OutOfHostPages(RuntimeError):
    """A row needs a host page and the runner's own pool (``host_pages``) has none left."""


class HostPages:
    """The block table of a paged host tier on the host (see the module docstring):
    ``table int32[B, NB]``, row ``b``'s block ``n`` in page ``table[b, n]`` of every
    offloaded layer's pool (:data:`~sparse_jax.cache.NULL_PAGE` where it holds none; a
    row's pages are a prefix of its table). ``own``: the runner gives each row the pages
    its next position needs before every step, from its own free list; else the caller
    writes the rows (:meth:`set_row`) and the runner only checks that every row it steps
    holds them. ``dirty``: the table changed since it was last sent to the device."""

    def __init__(self, num_pages: int, batch: int, blocks_per_row: int, own: bool = True):
        if isinstance(num_pages, bool) or not isinstance(num_pages, (int, np.integer)) or num_pages < 2:
            raise ValueError(f"host_pages must be an int >= 2 (page 0 is the null page), got {num_pages!r}")
        self.num_pages = int(num_pages)
        self.table = np.full((int(batch), int(blocks_per_row)), NULL_PAGE, np.int32)
        self.free = list(range(self.num_pages - 1, 0, -1)) if own else None  # pop() gives 1, 2, ... first
        self.dirty = True

    @property
    def own(self) -> bool:
        return self.free is not None

    def held(self) -> np.ndarray:
        """``int[B]``: pages each row holds."""
        return (self.table != NULL_PAGE).sum(1)

    def ensure(self, row: int, blocks: int) -> None:
        """(``own``) Give ``row`` pages for its first ``blocks`` blocks; :class:`OutOfHostPages`
        (nothing changed) when the free list is short."""
        blocks = min(int(blocks), self.table.shape[1])
        have = int((self.table[row] != NULL_PAGE).sum())
        if blocks <= have:
            return
        if blocks - have > len(self.free):
            raise OutOfHostPages(f"row {row} needs {blocks - have} more host pages, {len(self.free)} of "
                                 f"{self.num_pages - 1} are free")
        self.table[row, have:blocks] = [self.free.pop() for _ in range(blocks - have)]
        self.dirty = True

    def set_row(self, row: int, pages) -> None:
        self.table[row] = pages
        self.dirty = True


@dataclasses.dataclass
class TieredState:
    """Everything one batch carries between steps (host-side object, not a pytree).

    ``cache``: the :class:`KVCache` whose entries are :class:`LayerCache`
    (resident) or :class:`OffloadedLayer` (device tier); ``host[i]``: the
    layer's :class:`HostLayer` (offloaded layers) or None; ``lengths_host``:
    the NumPy mirror of ``cache.lengths``.
    """

    cache: KVCache
    host: tuple
    lengths_host: np.ndarray
    max_len: int
    pending: list = dataclasses.field(default_factory=list)  # saves not yet stored on the host
    counters: list = dataclasses.field(default_factory=list)  # per step: [(hits, misses) per offloaded layer]
    #: keep each step's block counters in ``counters`` (``transfer_stats``). Keeping them
    #: holds two small device buffers per layer and step alive, so the next step's outputs
    #: land at new addresses and XLA updates the step's whole CUDA graph on the host
    #: (``command_buffer::update``, milliseconds a step: docs/offload.md, 'Where the host time
    #: goes'): a timed loop
    #: turns it off.
    record_transfers: bool = True
    host_views: dict = dataclasses.field(default_factory=dict)  # layer -> (K, V) NumPy views of its host tier
    #: a paged host tier's block table (``TieredRunner(host_pages=N)``); None: contiguous
    pages: HostPages | None = None


def host_view(x: jax.Array) -> np.ndarray:
    """A writable NumPy view of a ``pinned_host`` jax Array's buffer (its own memory).

    JAX arrays are immutable; the host tier is the one place we write behind
    JAX's back (the CPU half of SparseServe's saving), always to blocks no
    kernel reads until a later step."""
    if x.sharding.memory_kind != "pinned_host":
        raise ValueError(f"expected a pinned_host array, got memory kind {x.sharding.memory_kind!r}")
    # the array may still be filling (device_put to pinned_host is asynchronous):
    # a store racing that copy would be overwritten by it
    x.block_until_ready()
    dt = np.dtype(x.dtype)
    n = x.size * dt.itemsize
    buf = (ctypes.c_char * n).from_address(x.unsafe_buffer_pointer())
    return np.frombuffer(buf, dtype=np.uint8).view(dt).reshape(x.shape)
