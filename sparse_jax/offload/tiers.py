"""The tiered KV cache of one offloaded layer: what lives on the device, what on the host.

Host tier (:class:`HostLayer`, ``pinned_host`` memory, jax memory kinds): every
KV block of the layer, ``k, v [B, Hkv, NB, bs, D]``: the resident layout with
the sequence cut into blocks, the KV-head axis kept its own (so the tier can
be sharded by heads). One block is one contiguous ``bs*D*itemsize`` chunk that
:func:`sparse_jax.ops.transfer.host_gather_into` copies with one program
(``id_dims=3``: block ``n`` of row ``b``, KV head ``h`` has the flat id
``(b*Hkv + h)*NB + n``; SparseServe's head-major block layout).

Paged host tier (``TieredRunner(host_pages=N)``, the offloaded paged engine): the
host holds the blocks that exist, not ``B x max_len``. ``k, v [N, Hkv, bs, D]``: a pool
of ``N`` pages shared by the rows (page 0 the null page, never given out), one page
holding one block of every KV head of the layer, and ``table int32[B, NB]`` (device
memory; one table for every offloaded layer: a request's block ``n`` is page
``table[b, n]`` in each layer's pool; entries past the row's blocks are the null page).
The slot assignment still names blocks by ``(b*Hkv + h)*NB + n``; the copy's source id
becomes ``table[b, n]*Hkv + h`` (``id_dims=2``) before ``host_gather_into``
(:func:`sparse_jax.offload.pool.host_block_ids`). The device tier is the same either way.

Device tier (:class:`OffloadedLayer`, one entry of :class:`sparse_jax.cache.KVCache`):

* ``pool_k, pool_v [B, Hkv, (P+2)*bs, D]``: ``P`` resident block slots per
  (row, KV head), then a two-block ring: slot ``P + n % 2`` holds block ``n``
  while it is the newest (partial) block and during the block after it. New
  tokens are written there; a completed block is copied to the host tier by
  the runner within ``bs - 1`` steps, before the ring slot is reused.
* ``block_slot int32[B, Hkv, NB]`` (pool slot of each block, -1 when not
  resident), ``slot_block int32[B, Hkv, P]`` (block in each slot, -1 when
  empty), ``slot_used int32[B, Hkv, P]`` (row length at the slot's last use:
  the LRU clock).
* ``state``: the method's per-layer state (AsyncTLS: block boxes, INT4 label
  cache, the blocks chosen for the next step; Quest: the boxes).
* ``hits, misses int32[B, Hkv]``: this step's block counters per (row, KV
  head): needed blocks found in the pool, and blocks copied from the host
  (batch and head axes kept apart, so they split over a mesh like the rest).

Shared pool (``pool="shared"``, :mod:`sparse_jax.offload.pool`): one pool of
``N`` slots per KV head shared by every row, LRU across rows:

* ``pool_k, pool_v [1, Hkv, (N + 2B)*bs, D]``: the ``N`` shared slots, then each
  row's two ring slots (row ``b``'s at ``N + 2b + n % 2``);
* ``block_slot int32[B, Hkv, NB]``: the map (row, block) -> shared slot;
* ``slot_block int32[1, Hkv, N]`` (the flat id ``b * NB + block`` of the row's
  block held by each slot), ``slot_used int32[1, Hkv, N]`` and ``tick int32[1,
  Hkv]``: the LRU clock is the pool's step count, not a row's length.

Eviction policy (documented contract): the blocks a step needs (its selection,
or the next step's prefetch) are never evicted while it places them; a miss
takes the least recently used other slot (empty slots first; ties by slot
index). ``P`` must hold the most blocks one step needs.

Placement: both tiers are built from a :class:`jax.sharding.Sharding` the
caller gives (its memory kind replaced: ``device`` / ``pinned_host``), not
from ``jax.devices()[0]``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class OffloadedLayer:
    pool_k: jax.Array
    pool_v: jax.Array
    block_slot: jax.Array
    slot_block: jax.Array
    slot_used: jax.Array
    state: Any
    hits: jax.Array
    misses: jax.Array
    block_size: int = dataclasses.field(default=1, metadata=dict(static=True))
    #: shared pool only: the pool's clock ``int32[1, Hkv]`` (decode steps run)
    tick: Any = None
    #: the pool is shared by every row (``pool="shared"``): see the module docstring
    shared: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @property
    def pool_slots(self) -> int:
        return self.slot_block.shape[2]

    @property
    def batch(self) -> int:
        return self.block_slot.shape[0]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HostLayer:
    """``k, v [B, Hkv, NB, bs, D]`` in ``pinned_host`` memory (read-only inside jit); paged
    (``table`` given): ``k, v [N, Hkv, bs, D]`` pages and the block table ``int32[B, NB]``
    on the device (module docstring)."""

    k: jax.Array
    v: jax.Array
    table: Any = None

    @property
    def paged(self) -> bool:
        return self.table is not None


def with_memory_kind(sharding: jax.sharding.Sharding | None, kind: str) -> jax.sharding.Sharding:
    """``sharding`` (default: one device, the first) placed in memory ``kind``."""
    if sharding is None:
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return sharding.with_memory_kind(kind)


def pinned_host_sharding(sharding: jax.sharding.Sharding | None = None) -> jax.sharding.Sharding:
    return with_memory_kind(sharding, "pinned_host")


def device_sharding(sharding: jax.sharding.Sharding | None = None) -> jax.sharding.Sharding:
    return with_memory_kind(sharding, "device")
