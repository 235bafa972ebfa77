"""Gather listed blocks of a (pinned-)host array into device memory in one kernel
(SparseServe's FlashH2D).

Shapes:

* ``src``: ``[NB, *block_shape]``, any dtype. In the real use it lives in
  ``pinned_host`` memory (``jax.device_put(x, SingleDeviceSharding(dev,
  memory_kind="pinned_host"))``); the kernel reads it there, over PCIe, through
  the unified address space: pinned host pages are mapped into the GPU's
  address space, so plain global loads reach them.
* ``block_ids``: ``int32[M]``; ids are clamped to ``[0, NB)`` (a wild id must
  not make the GPU read outside the host buffer).
* result: ``[M, *block_shape]`` in device memory, ``out[i] = src[ids[i]]``.

How the operand reaches the kernel without a bulk copy: a jitted function
whose argument is committed to ``pinned_host`` gets an HLO parameter with
``mhlo.memory_kind = "pinned_host"``; JAX gives the ``pallas_call`` that
operand as is (its aval is ``f32<host>[...]``; Pallas-Triton has no memory
space of its own and just takes a pointer), and XLA passes the parameter's
buffer to the Triton custom call. Nothing else may touch ``src`` inside the
jit: ``jnp.take`` on it is refused ("memory_space of all inputs ... must be
the same"), and ``jax.device_put(src, Space.Device)`` is the bulk copy we
avoid. In particular the kernel indexes ``src`` in its own N-d shape, so that
not even a reshape (a bitcast, but still an op on a host buffer) sits between
the parameter and the custom call.

Kernel: grid ``(M, tiles per block)``; program ``(i, t)`` copies tile ``t`` of
block ``ids[i]``: a ``[TH, TW]`` tile over (flattened leading block dims, last
block dim). The last dim is contiguous, so Triton emits 16-byte vector loads
when the row size allows, and every program is one independent load + store:
thousands of small CTAs keep many PCIe reads in flight, which is what host
bandwidth needs (latency ~1-2 us x ~50 GB/s = ~100 KB outstanding).

Interpret mode (CPU tests): masked-off lanes use out-of-bounds indices only
(``col >= W`` or leading index ``>= block dim``) so the interpreter's
gather/scatter discharge of masked stores drops them instead of writing back
stale values over live lanes.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

__all__ = ["host_gather_reference", "host_gather_pallas", "plan_host_gather", "GatherPlan"]

DEFAULT_TILE_BYTES = 8192
MAX_GRID_Y = 65535  # CUDA limit on the second grid dimension


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def host_gather_reference(src, block_ids):
    """``jnp.take`` after moving ``src`` to device memory (the bulk-copy path)."""
    src_dev = jax.device_put(src, jax.memory.Space.Device)
    return jnp.take(src_dev, block_ids.astype(jnp.int32), axis=0, mode="clip")


@dataclasses.dataclass(frozen=True)
class GatherPlan:
    outer: tuple[int, ...]  # block dims before the last one
    w: int  # last block dim (contiguous)
    th: int  # tile rows (over the flattened outer dims), power of two
    tw: int  # tile columns (over the last dim), power of two
    n_row_tiles: int
    n_col_tiles: int
    num_warps: int


def plan_host_gather(
    block_shape: tuple[int, ...],
    itemsize: int,
    *,
    tile_bytes: int = DEFAULT_TILE_BYTES,
    num_warps: int = 4,
) -> GatherPlan:
    """Tiling of one block: ``[TH, TW]`` tiles of about ``tile_bytes``.

    ``TW`` covers the whole last dim when it fits (next power of two, masked),
    else a power-of-two slice of it; ``TH`` fills the rest of the tile.
    """
    if not block_shape:
        block_shape = (1,)
    *outer, w = block_shape
    h = math.prod(outer)
    tile_elems = max(1, _next_pow2(max(1, tile_bytes // itemsize)))
    tw = min(_next_pow2(w), tile_elems)
    th = max(1, min(tile_elems // tw, _next_pow2(h)))
    n_row_tiles = -(-h // th)
    n_col_tiles = -(-w // tw)
    if n_row_tiles * n_col_tiles > MAX_GRID_Y:
        raise ValueError(
            f"block {block_shape} needs {n_row_tiles * n_col_tiles} tiles of {tile_bytes} bytes; "
            f"raise tile_bytes (grid dim 1 is limited to {MAX_GRID_Y})"
        )
    return GatherPlan(tuple(outer), w, th, tw, n_row_tiles, n_col_tiles, num_warps)


def _gather_kernel(ids_ref, src_ref, out_ref, *, nb: int, plan: GatherPlan):
    i = pl.program_id(0)
    t = pl.program_id(1)
    b = jnp.clip(ids_ref[i], 0, nb - 1)
    if plan.n_col_tiles == 1:
        rt, ct = t, 0
    else:
        rt, ct = t // plan.n_col_tiles, t % plan.n_col_tiles
    h_total = math.prod(plan.outer)
    col = ct * plan.tw + jax.lax.broadcasted_iota(jnp.int32, (1, plan.tw), 1)
    mask = None
    if plan.w % plan.tw:
        mask = col < plan.w
    # unravel the flattened leading index into the block's leading dims
    # (divisions by constants; for masked rows the outermost index ends up
    # >= its dim, i.e. out of bounds, as interpret mode needs)
    lead = []
    if plan.outer:
        h = rt * plan.th + jax.lax.broadcasted_iota(jnp.int32, (plan.th, 1), 0)
        if h_total % plan.th:
            row_ok = h < h_total
            mask = row_ok if mask is None else (row_ok & mask)
        rem = h
        for d in reversed(plan.outer[1:]):
            lead.append(rem % d)
            rem = rem // d
        lead.append(rem)
        lead.reverse()
    tile = plgpu.load(src_ref.at[(b, *lead, col)], mask=mask)
    plgpu.store(out_ref.at[(i, *lead, col)], tile, mask=mask)


def host_gather_pallas(
    src,
    block_ids,
    *,
    tile_bytes: int = DEFAULT_TILE_BYTES,
    num_warps: int = 4,
    num_stages: int = 1,
    interpret: bool = False,
):
    """Kernel path. ``src [NB, *bs]`` (any memory kind), ``block_ids int32[M]``.

    Tuning: ``tile_bytes`` (bytes per program; rounded to a power-of-two
    element count), ``num_warps``, ``num_stages`` (no loop to pipeline: 1).
    """
    squeeze = src.ndim == 1
    if squeeze:  # scalar blocks: give the kernel a last dim (tiny arrays only)
        src = src.reshape(src.shape[0], 1)
    nb, *block_shape = src.shape
    m = block_ids.shape[0]
    plan = plan_host_gather(tuple(block_shape), src.dtype.itemsize, tile_bytes=tile_bytes, num_warps=num_warps)
    out = pl.pallas_call(
        functools.partial(_gather_kernel, nb=nb, plan=plan),
        out_shape=jax.ShapeDtypeStruct((m, *block_shape), src.dtype),
        grid=(m, plan.n_row_tiles * plan.n_col_tiles),
        compiler_params=plgpu.CompilerParams(num_warps=plan.num_warps, num_stages=num_stages),
        interpret=interpret,
        name="host_gather",
    )(block_ids.astype(jnp.int32), src)
    return out.reshape(m) if squeeze else out
