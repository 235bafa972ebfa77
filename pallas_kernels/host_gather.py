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

In-place variant (``host_gather_into_pallas``): ``dst_k[slots[i]] =
src_k[block_ids[i]]`` and the same for V, for the live entries, in one launch
over the same grid; ``dst_k, dst_v [NS, *block_shape]`` are aliased to the
outputs. Its ``src`` may keep several leading axes, ``[*ids, *block_shape]``
(``id_dims`` of them: an offloaded layer's ``[B, Hkv, NB, bs, D]``, whose KV-head
axis stays its own so the tier can be sharded by heads): a block id is then
the row-major flat index over those axes, unravelled in the kernel, so no
reshape touches the host buffer. ``count int32[G]`` splits the list into ``G`` equal segments, of
which the first ``count[g]`` entries are live (``G = 1``: one list, one
count); programs of other entries return before touching memory.

Interpret mode (CPU tests): masked-off lanes use out-of-bounds indices only
(``col >= W`` or leading index ``>= block dim``) so the interpreter's
gather/scatter discharge of masked stores drops them instead of writing back
stale values over live lanes. ``pl.program_id`` is only substituted at the
kernel's top level, so kernels read it before any ``pl.when``.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from pallas_kernels._util import next_pow2

__all__ = [
    "host_gather_reference",
    "host_gather_pallas",
    "host_gather_into_reference",
    "host_gather_into_pallas",
    "plan_host_gather",
    "GatherPlan",
]

DEFAULT_TILE_BYTES = 8192
MAX_GRID_Y = 65535  # CUDA limit on the second grid dimension



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
    tile_elems = max(1, next_pow2(max(1, tile_bytes // itemsize)))
    tw = min(next_pow2(w), tile_elems)
    th = max(1, min(tile_elems // tw, next_pow2(h)))
    n_row_tiles = -(-h // th)
    n_col_tiles = -(-w // tw)
    if n_row_tiles * n_col_tiles > MAX_GRID_Y:
        raise ValueError(
            f"block {block_shape} needs {n_row_tiles * n_col_tiles} tiles of {tile_bytes} bytes; "
            f"raise tile_bytes (grid dim 1 is limited to {MAX_GRID_Y})"
        )
    return GatherPlan(tuple(outer), w, th, tw, n_row_tiles, n_col_tiles, num_warps)


def _tile_index(t, plan: GatherPlan):
    """Index arrays and mask of tile ``t`` of one block: ``(lead, col, mask)``.

    ``lead`` indexes the block's leading dims (``[TH, 1]`` each), ``col`` the
    last dim (``[1, TW]``); ``mask`` is ``None`` when the tile is full.
    """
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
    return lead, col, mask


def _gather_kernel(ids_ref, src_ref, out_ref, *, nb: int, plan: GatherPlan):
    i = pl.program_id(0)
    b = jnp.clip(ids_ref[i], 0, nb - 1)
    lead, col, mask = _tile_index(pl.program_id(1), plan)
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


# ---------------------------------------------------------------------------
# in-place variant: scatter listed host blocks into slots of device buffers
# ---------------------------------------------------------------------------


def host_gather_into_reference(src_k, src_v, dst_k, dst_v, block_ids, slots, count, id_dims: int = 1):
    """Pure-jnp ``host_gather_into``: whole-``src`` ``device_put``, then a scatter.

    ``src_k, src_v [*ids, *bs]`` (``id_dims`` leading axes, flat block ids
    over them), ``dst_k, dst_v [NS, *bs]``, ``block_ids, slots int32[M]``,
    ``count int32[G]`` (``G`` divides ``M``: per-segment live counts).
    Returns the new ``(dst_k, dst_v)``.
    """
    nb, ns, m = math.prod(src_k.shape[:id_dims]), dst_k.shape[0], block_ids.shape[0]
    seg = m // count.shape[0]
    ids = jnp.clip(block_ids.astype(jnp.int32), 0, nb - 1)
    # entries past their segment's count go to slot NS, which mode="drop"
    # discards, so they leave dst exactly as it was (clipping them would
    # overwrite slot NS-1)
    i = jnp.arange(m, dtype=jnp.int32)
    live = i % seg < count.astype(jnp.int32)[i // seg]
    tgt = jnp.where(live, jnp.clip(slots.astype(jnp.int32), 0, ns - 1), ns)
    out = []
    for src, dst in ((src_k, dst_k), (src_v, dst_v)):
        src = jax.device_put(src, jax.memory.Space.Device)
        blocks = jnp.take(src.reshape((nb,) + src.shape[id_dims:]), ids, axis=0)
        out.append(dst.at[tgt].set(blocks, mode="drop"))
    return tuple(out)


def _unravel(b, id_shape: tuple[int, ...]) -> tuple:
    """Flat block id ``b`` -> its index over the leading ``id_shape`` axes (row-major)."""
    idx = []
    for d in reversed(id_shape[1:]):
        idx.append(b % d)
        b = b // d
    idx.append(b)
    return tuple(reversed(idx))


def _gather_into_kernel(
    ids_ref, slots_ref, count_ref, src_k_ref, src_v_ref, _dst_k_in, _dst_v_in, dst_k_ref, dst_v_ref,
    *, nb: int, ns: int, seg: int, plan: GatherPlan, id_shape: tuple[int, ...],
):
    # _dst_*_in are the same buffers as dst_*_ref (input_output_aliases);
    # the kernel only writes the output refs, and only the listed slots
    # program ids are read outside pl.when: interpret mode substitutes them
    # only at the kernel's top level, not inside the cond's branch
    i, t = pl.program_id(0), pl.program_id(1)

    @pl.when(i % seg < count_ref[i // seg])
    def _():
        b = _unravel(jnp.clip(ids_ref[i], 0, nb - 1), id_shape)
        s = jnp.clip(slots_ref[i], 0, ns - 1)
        lead, col, mask = _tile_index(t, plan)
        # both loads before either store: two PCIe reads in flight per program
        k = plgpu.load(src_k_ref.at[(*b, *lead, col)], mask=mask)
        v = plgpu.load(src_v_ref.at[(*b, *lead, col)], mask=mask)
        plgpu.store(dst_k_ref.at[(s, *lead, col)], k, mask=mask)
        plgpu.store(dst_v_ref.at[(s, *lead, col)], v, mask=mask)


def _gather_into_strided_kernel(
    ids_ref, slots_ref, count_ref, src_k_ref, src_v_ref, _dst_k_in, _dst_v_in, dst_k_ref, dst_v_ref,
    *, nb: int, ns: int, g: int, seg: int, plan: GatherPlan, sub: int, groups: int, unroll: int,
    id_shape: tuple[int, ...],
):
    # A fixed, small grid, so that the copy holds few SMs while it waits on
    # PCIe and kernels running beside it (another stream of a concurrent CUDA
    # graph) keep the rest. Programs visit only live entries: a static list
    # sized for the worst case (M = rows x n1, most entries dead) would
    # otherwise cost one dependent scalar load per entry and program.
    # Program (p, t): segments q, q + groups, ... (q = p // sub); in each, the
    # live entries r, r + sub, ... (r = p % sub), `unroll` of them loaded
    # before any is stored (2 * unroll tiles of PCIe reads in flight).
    p, t = pl.program_id(0), pl.program_id(1)
    q, r = p // sub, p % sub
    lead, col, mask = _tile_index(t, plan)
    tile_shape = (plan.th if plan.outer else 1, plan.tw)
    step = sub * unroll

    def segment(i, carry):
        gi = jnp.minimum(q + i * groups, g - 1)
        c = jnp.where(q + i * groups < g, jnp.clip(count_ref[gi], 0, seg), 0)

        def entries(k, carry):
            tiles = []
            for u in range(unroll):
                j = r + (k * unroll + u) * sub
                live = j < c
                e = gi * seg + jnp.minimum(j, seg - 1)
                # a dead entry's lanes are masked off; its ids stay in bounds
                b = _unravel(jnp.clip(ids_ref[e], 0, nb - 1), id_shape)
                s = jnp.where(live, jnp.clip(slots_ref[e], 0, ns - 1), ns)  # ns: out of bounds (interpret)
                lane = jnp.broadcast_to(live if mask is None else (mask & live), tile_shape)
                kt = plgpu.load(src_k_ref.at[(*b, *lead, col)], mask=lane)
                vt = plgpu.load(src_v_ref.at[(*b, *lead, col)], mask=lane)
                tiles.append((s, lane, kt, vt))
            for s, lane, kt, vt in tiles:
                plgpu.store(dst_k_ref.at[(s, *lead, col)], kt, mask=lane)
                plgpu.store(dst_v_ref.at[(s, *lead, col)], vt, mask=lane)
            return carry

        n_k = jnp.maximum(c - r + step - 1, 0) // step
        return jax.lax.fori_loop(0, n_k, entries, carry)

    jax.lax.fori_loop(0, -(-g // groups), segment, 0)


def host_gather_into_pallas(
    src_k,
    src_v,
    dst_k,
    dst_v,
    block_ids,
    slots,
    count,
    *,
    tile_bytes: int = DEFAULT_TILE_BYTES,
    num_warps: int = 4,
    num_stages: int = 1,
    programs: int | None = None,
    unroll: int = 4,
    id_dims: int = 1,
    interpret: bool = False,
):
    """Kernel path: ``dst_k[slots[i]] = src_k[block_ids[i]]`` (same for V), live ``i``.

    ``src_k, src_v [NB, *bs]`` (any memory kind, read in place), ``dst_k,
    dst_v [NS, *bs]`` (device; updated in place through
    ``input_output_aliases``), ``block_ids, slots int32[M]``, ``count
    int32[G]`` (``G`` divides ``M``; entry ``i`` is live when ``i % (M/G) <
    count[i // (M/G)]``). Grid ``(M, tiles per block)``; programs of entries
    that are not live return before any load or store. Ids are clamped to ``[0, NB)``, slots to
    ``[0, NS)``. Returns ``(dst_k, dst_v)``. Tuning as ``host_gather_pallas``,
    plus ``programs``: None (default) = one program per entry and tile, as
    above; an int = a fixed grid of about ``programs x tiles per block``
    programs that stride over the segments and visit only their live entries,
    ``unroll`` at a time (few SMs busy: for running beside other kernels).
    """
    squeeze = src_k.ndim == id_dims
    if squeeze:  # scalar blocks: give the kernel a last dim (tiny arrays only)
        src_k, src_v = src_k[..., None], src_v[..., None]
        dst_k, dst_v = dst_k.reshape(-1, 1), dst_v.reshape(-1, 1)
    id_shape = tuple(src_k.shape[:id_dims])
    nb, block_shape = math.prod(id_shape), list(src_k.shape[id_dims:])
    ns, m = dst_k.shape[0], block_ids.shape[0]
    plan = plan_host_gather(tuple(block_shape), src_k.dtype.itemsize, tile_bytes=tile_bytes, num_warps=num_warps)
    seg = m // count.shape[0]
    if programs is None:
        kernel = functools.partial(_gather_into_kernel, nb=nb, ns=ns, seg=seg, plan=plan, id_shape=id_shape)
        grid = (m, plan.n_row_tiles * plan.n_col_tiles)
    else:
        if programs < 1 or unroll < 1:
            raise ValueError(f"programs and unroll must be >= 1, got {programs}, {unroll}")
        g = count.shape[0]
        # programs per segment (several when there are fewer segments than programs)
        sub = max(1, min(programs // g, seg))
        groups = min(g, max(1, programs // sub))
        kernel = functools.partial(_gather_into_strided_kernel, nb=nb, ns=ns, g=g, seg=seg, plan=plan,
                                   sub=sub, groups=groups, unroll=unroll, id_shape=id_shape)
        grid = (groups * sub, plan.n_row_tiles * plan.n_col_tiles)
    out_k, out_v = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct(dst_k.shape, dst_k.dtype), jax.ShapeDtypeStruct(dst_v.shape, dst_v.dtype)),
        grid=grid,
        input_output_aliases={5: 0, 6: 1},
        compiler_params=plgpu.CompilerParams(num_warps=plan.num_warps, num_stages=num_stages),
        interpret=interpret,
        name="host_gather_into",
    )(block_ids.astype(jnp.int32), slots.astype(jnp.int32), count.astype(jnp.int32), src_k, src_v, dst_k, dst_v)
    if squeeze:
        return out_k.reshape(ns), out_v.reshape(ns)
    return out_k, out_v
