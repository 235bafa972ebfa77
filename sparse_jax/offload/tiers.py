"""The tiered KV cache of one sparse layer: what lives on the device, what on the host.

Host tier (``pinned_host`` memory, jax memory kinds): every KV block of the
layer, ``host_k, host_v [B*Hkv*NB, bs, D]`` (block ``n`` of row ``b``, KV head
``h`` at ``(b*Hkv + h)*NB + n``), so one block is one contiguous
``bs*D*itemsize`` chunk that :func:`sparse_jax.ops.transfer.host_gather_into`
copies with one program (SparseServe's head-major (H, N, D) block layout).

Device tier (:class:`OffloadLayer`):

* ``pool_k, pool_v [B, Hkv, (P+2)*bs, D]``: ``P`` resident block slots per
  (row, KV head), then a two-block ring: slot ``P + n % 2`` holds block ``n``
  while it is the newest (partial) block and during the block after it. New
  tokens are written there; a completed block is copied to the host tier by
  the engine within ``bs - 1`` steps, before the ring slot is reused.
* ``block_slot int32[B, Hkv, NB]`` (pool slot of each block, -1 when not
  resident), ``slot_block int32[B, Hkv, P]`` (block in each slot, -1 when
  empty), ``slot_used int32[B, Hkv, P]`` (row length at the slot's last use:
  the LRU clock).
* ``state``: the method's small per-layer state (AsyncTLS: block boxes, INT4
  label cache, the blocks chosen for the next step).
* ``hits, misses int32[B*Hkv]``: this step's block counters per (row, KV
  head): needed blocks found in the pool, and blocks copied from the host.

Eviction policy (documented contract): the blocks the last query chose for
the next step are never evicted; a miss takes the least recently used other
slot (empty slots first; ties by slot index). ``P >= kb - 1`` so the chosen
set always fits; a larger pool keeps blocks that may come back.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class OffloadLayer:
    pool_k: jax.Array
    pool_v: jax.Array
    block_slot: jax.Array
    slot_block: jax.Array
    slot_used: jax.Array
    state: Any
    hits: jax.Array
    misses: jax.Array

    @property
    def pool_slots(self) -> int:
        return self.slot_block.shape[2]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HostLayer:
    """``k, v [B*Hkv*NB, bs, D]`` in ``pinned_host`` memory (read-only inside jit)."""

    k: jax.Array
    v: jax.Array


def pinned_host_sharding(device=None) -> jax.sharding.Sharding:
    device = device or jax.devices()[0]
    return jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")


def device_sharding(device=None) -> jax.sharding.Sharding:
    device = device or jax.devices()[0]
    return jax.sharding.SingleDeviceSharding(device, memory_kind="device")
