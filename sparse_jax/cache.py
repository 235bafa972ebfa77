"""The KV cache: an explicit pytree passed into and returned from pure jitted
functions (and donated), never hidden module state.

Layout (head-major, DESIGN.md): one entry per model layer, each its own
buffers: a :class:`LayerCache` (``k, v [B, Hkv, S_layer, D]`` resident on the
device, plus the method's per-layer state) or an offloaded layer's device tier
(:class:`sparse_jax.offload.tiers.OffloadedLayer`), plus one ``lengths
int32[B]`` for the whole batch so rows can hold different lengths.
``S_layer`` is the layer's capacity: ``max_len`` on global layers, a ring of
``window`` slots on sliding-window layers (token ``p`` in slot ``p % window``).
Head-major avoids the full-cache transpose that ``[B, S, Hkv, D]`` forces on
every decode step and matches per-KV-head selection.

Why one buffer per layer and not the layers stacked on a leading axis: a layer
reading its slice of a stacked cache makes XLA copy the slice before any
kernel that is not fused with it (our Pallas kernels, the attention GEMMs),
a whole layer's KV per layer per step. On the H100 (Qwen3-8B shape) a stacked
cache, scanned or unrolled, was about twice as slow as per-layer buffers, the
difference being those copies (docs/architecture.md, 'Measured', its table).

Positions ``>= lengths[b]`` hold garbage (padding of a ragged prefill, or
nothing yet); every reader masks them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerCache:
    """One resident layer: ``k, v [B, Hkv, S, D]`` and the method's state for it."""

    k: jax.Array
    v: jax.Array
    state: Any = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Every layer's entry plus the number of valid tokens per batch row ``int32[B]``.

    ``max_len`` (static): the context capacity (global layers hold that many tokens).
    """

    layers: tuple
    lengths: jax.Array
    max_len: int = dataclasses.field(default=0, metadata=dict(static=True))

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def layer(self, i: int):
        """Model layer ``i``'s entry."""
        return self.layers[i]

    def nbytes(self) -> int:
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(self))


def write_rows(k: jax.Array, v: jax.Array, k_new: jax.Array, v_new: jax.Array, rows: jax.Array):
    """``k, v [B, Hkv, R, D]`` with ``k_new, v_new [B, Hkv, D]`` written at row
    ``rows[b]`` of each batch row, in place (the arrays are donated by callers)."""

    def one(cache_row, new_row, r):
        # cache_row [Hkv, R, D], new_row [Hkv, D]
        return jax.lax.dynamic_update_slice(cache_row, new_row[:, None, :].astype(cache_row.dtype), (0, r, 0))

    k = jax.vmap(one)(k, k_new, rows)
    v = jax.vmap(one)(v, v_new, rows)
    # The barrier keeps the update a single in-place op. Without it XLA:CPU
    # duplicates the update into the fusion of each consumer (the attention dot
    # reading the cache) and copies the whole donated cache ~4 times per layer
    # per decode step (docs/models.md, 'CPU performance', item 2); on the GPU it
    # fused the offloaded ring write into a select over the whole slot pool
    # (docs/architecture.md, 'Measured reasons for runtime and benchmark choices').
    return jax.lax.optimization_barrier((k, v))
