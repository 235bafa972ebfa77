"""Host -> device block gather: ``host_gather`` (SparseServe's FlashH2D).

Shapes: ``src: [NB, *block_shape]`` (any dtype; typically a jax Array in
``pinned_host`` memory), ``block_ids: int32[M]`` -> ``[M, *block_shape]`` in
device memory, ``out[i] = src[block_ids[i]]``. Ids are clamped to
``[0, NB)``; repeated ids are fine.

Implementations (``impl``):

* ``"pallas"``: one Pallas-Triton kernel reads the listed blocks straight
  from ``src`` where it lives (pinned host memory over PCIe, or device
  memory); interpret mode without a GPU. See ``pallas_kernels/host_gather.py``.
* ``"reference"``: ``jnp.take`` after ``device_put`` of the whole ``src`` to
  device memory (moves all NB blocks, not M).
* ``"auto"``: the kernel on GPU, the reference elsewhere.

Tuning keywords: ``tile_bytes`` (bytes copied per program, default 8192),
``num_warps`` (default 4), ``num_stages`` (default 1).

Use: pass the pinned-host array itself (not a device copy). Inside your own
``jit`` do not apply any op to ``src`` before ``host_gather``: ops on a
host-memory operand are either refused by JAX or turn into a bulk transfer.

In-place variant ``host_gather_into``: one launch copies listed blocks of a
K and a V host array into chosen slots of existing device buffers
(``dst_k[slots[i]] = src_k[block_ids[i]]``, same for V, for ``i < count``),
for a device-side block cache that is refilled inside a jitted decode step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import host_gather as _hg
from sparse_jax.ops import _checks
from sparse_jax.ops._dispatch import resolve_impl

__all__ = ["host_gather", "host_gather_into", "TUNING_KEYS"]

TUNING_KEYS = frozenset({"tile_bytes", "num_warps", "num_stages"})
INTO_TUNING_KEYS = TUNING_KEYS | {"programs", "unroll"}


def _check_arrays(**named):
    for name, x in named.items():
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{name} must be an array, got {type(x).__name__}")


def _check_blocks(name, x):
    """``x`` is ``[NB, *block_shape]`` with at least one block."""
    if x.ndim < 1:
        raise ValueError(f"{name} must have shape [NB, *block_shape] (rank >= 1), got shape {x.shape}")
    if x.shape[0] < 1:
        raise ValueError(f"{name} must hold at least one block (NB >= 1), got shape {x.shape}")


def _check_args(src, block_ids, tuning):
    _check_arrays(src=src, block_ids=block_ids)
    _check_blocks("src", src)
    _checks.check_rank("block_ids", block_ids, 1, "[M]")
    _checks.check_int("block_ids", block_ids)
    _check_tuning(tuning)


def _check_tuning(tuning, keys=TUNING_KEYS):
    unknown = set(tuning) - keys
    if unknown:
        raise TypeError(f"unknown tuning keyword(s) {sorted(unknown)}; allowed: {sorted(keys)}")
    for name in ("programs", "unroll"):
        val = tuning.get(name)
        if val is not None and (isinstance(val, bool) or not isinstance(val, int) or val < 1):
            raise ValueError(f"{name} must be a positive int{' or None' if name == 'programs' else ''}, got {val!r}")
    tb = tuning.get("tile_bytes", _hg.DEFAULT_TILE_BYTES)
    if isinstance(tb, bool) or not isinstance(tb, int) or tb < 1:
        raise ValueError(f"tile_bytes must be a positive int, got {tb!r}")
    nw = tuning.get("num_warps", 4)
    if nw not in (1, 2, 4, 8, 16, 32):
        raise ValueError(f"num_warps must be a power of two in [1, 32], got {nw!r}")


def _kernel_unsupported(src, tuning) -> str | None:
    dt = jnp.dtype(src.dtype)
    if jnp.issubdtype(dt, jnp.complexfloating):
        return f"dtype {dt} (complex) has no Triton type"
    if dt.itemsize < 1 or dt.name in ("int4", "uint4", "int2", "uint2"):
        return f"sub-byte dtype {dt}"
    if dt.name.startswith("float8") or dt.name.startswith("float4"):
        return f"dtype {dt} is not loaded by the Pallas-Triton lowering"
    try:
        _hg.plan_host_gather(tuple(src.shape[1:]), dt.itemsize, tile_bytes=tuning.get("tile_bytes", _hg.DEFAULT_TILE_BYTES))
    except ValueError as e:
        return str(e)
    return None


@functools.partial(jax.jit, static_argnames=("choice", "interpret", "tuning"))
def _run(src, block_ids, *, choice, interpret, tuning):
    block_ids = block_ids.astype(jnp.int32)
    if choice == "reference":
        return _hg.host_gather_reference(src, block_ids)
    return _hg.host_gather_pallas(src, block_ids, interpret=interpret, **dict(tuning))


def host_gather(src, block_ids, *, impl: str = "auto", **tuning):
    """``src[block_ids]`` in device memory: ``[M, *block_shape]``.

    Args:
      src: ``[NB, *block_shape]``, any memory kind (pinned_host is the point).
      block_ids: ``int[M]``; clamped to ``[0, NB)``.
      impl: "auto" | "pallas" | "reference".
      id_dims: how many leading axes of ``src`` a block id indexes (row-major
        flat index over them): ``src [*ids, *block_shape]``, e.g. an offloaded
        layer's ``[B, Hkv, NB, bs, D]`` with ``id_dims=3`` (the head axis stays
        its own: no reshape touches the host buffer).
      **tuning: ``tile_bytes``, ``num_warps``, ``num_stages``.
    """
    _check_args(src, block_ids, tuning)
    choice, interpret = resolve_impl(impl, kernel_unsupported=_kernel_unsupported(src, tuning))
    if block_ids.shape[0] == 0:
        return jnp.zeros((0, *src.shape[1:]), src.dtype)
    tuning_items = tuple(sorted(tuning.items())) if choice == "pallas" else ()
    return _run(src, block_ids, choice=choice, interpret=interpret, tuning=tuning_items)


# ---------------------------------------------------------------------------
# in place: listed host blocks into slots of device K/V buffers
# ---------------------------------------------------------------------------


def _check_into_args(src_k, src_v, dst_k, dst_v, block_ids, slots, count, tuning, id_dims=1):
    _check_arrays(src_k=src_k, src_v=src_v, dst_k=dst_k, dst_v=dst_v, block_ids=block_ids, slots=slots)
    _check_blocks("src_k", src_k)
    if isinstance(id_dims, bool) or not isinstance(id_dims, int) or not 1 <= id_dims <= src_k.ndim:
        raise ValueError(f"id_dims must be an int in [1, src_k.ndim = {src_k.ndim}], got {id_dims!r}")
    if tuple(src_v.shape) != tuple(src_k.shape) or src_v.dtype != src_k.dtype:
        raise ValueError(
            f"src_v must match src_k ([NB, *block_shape] = {tuple(src_k.shape)} {src_k.dtype}), "
            f"got {tuple(src_v.shape)} {src_v.dtype}"
        )
    bs = tuple(src_k.shape[id_dims:])
    if dst_k.ndim != src_k.ndim - id_dims + 1 or tuple(dst_k.shape[1:]) != bs:
        raise ValueError(
            f"dst_k must have shape [NS, *block_shape] with src's block_shape {bs}, got shape {tuple(dst_k.shape)}"
        )
    if dst_k.shape[0] < 1:
        raise ValueError(f"dst_k must hold at least one slot (NS >= 1), got shape {tuple(dst_k.shape)}")
    if dst_k.dtype != src_k.dtype:
        raise TypeError(f"dst_k must have src's dtype {src_k.dtype} (no conversion is done), got {dst_k.dtype}")
    if tuple(dst_v.shape) != tuple(dst_k.shape) or dst_v.dtype != dst_k.dtype:
        raise ValueError(
            f"dst_v must match dst_k ([NS, *block_shape] = {tuple(dst_k.shape)} {dst_k.dtype}), "
            f"got {tuple(dst_v.shape)} {dst_v.dtype}"
        )
    _checks.check_rank("block_ids", block_ids, 1, "[M]")
    _checks.check_int("block_ids", block_ids)
    _checks.check_int_array("slots", slots, tuple(block_ids.shape), "[M] (one slot per block id)")
    if isinstance(count, bool) or not (isinstance(count, int) or hasattr(count, "dtype")):
        raise TypeError(f"count must be an int or an integer array of shape [] or [G], got {type(count).__name__}")
    if not isinstance(count, int):
        _checks.check_int("count", count)
        m = block_ids.shape[0]
        if count.ndim > 1 or (count.ndim == 1 and (count.shape[0] < 1 or m % count.shape[0])):
            raise ValueError(
                f"count must have shape [] or [G] with G dividing the {m} listed blocks (G equal segments), "
                f"got shape {tuple(count.shape)}")
    _check_tuning(tuning, INTO_TUNING_KEYS)


@functools.partial(jax.jit, static_argnames=("choice", "interpret", "tuning", "id_dims"))
def _run_into(src_k, src_v, dst_k, dst_v, block_ids, slots, count, *, choice, interpret, tuning, id_dims=1):
    # no donation here: an eager call leaves the caller's dst valid (XLA
    # copies it once); inside a caller's jit this jit is inlined, and a dst
    # the caller donates is written in place through the kernel's aliasing
    block_ids = block_ids.astype(jnp.int32)
    slots = slots.astype(jnp.int32)
    count = jnp.asarray(count).astype(jnp.int32)
    count = count.reshape(1) if count.ndim == 0 else count  # no op on an int32[G]
    if choice == "reference":
        return _hg.host_gather_into_reference(src_k, src_v, dst_k, dst_v, block_ids, slots, count, id_dims)
    return _hg.host_gather_into_pallas(
        src_k, src_v, dst_k, dst_v, block_ids, slots, count, interpret=interpret, id_dims=id_dims, **dict(tuning)
    )


def host_gather_into(src_k, src_v, dst_k, dst_v, block_ids, slots, count, *, impl: str = "auto",
                     id_dims: int = 1, **tuning):
    """Copy listed host blocks into slots of device buffers, K and V in one launch.

    For every live entry ``i`` (``i < count``; see ``count`` for segments):
    ``dst_k[slots[i]] = src_k[block_ids[i]]`` and ``dst_v[slots[i]] =
    src_v[block_ids[i]]``; other entries are ignored (their kernel programs exit before any load or store, so a
    static ``M`` sized for the worst case costs next to nothing when few
    blocks are missing). Slots not listed keep their contents.

    Args:
      src_k, src_v: ``[NB, *block_shape]``, same shape and dtype; any memory
        kind (``pinned_host`` is the point: read in place, over PCIe).
      dst_k, dst_v: ``[NS, *block_shape]`` device arrays of src's dtype.
      block_ids: ``int[M]``; clamped to ``[0, NB)``.
      slots: ``int[M]``; clamped to ``[0, NS)``. If two of the first
        ``count`` entries name the same slot, that slot's content is
        unspecified: each element comes from one of the writers, and on GPU
        different tiles (and K vs V) may come from different writers.
      count: ``int[]``, ``int[1]`` or a Python int: how many leading entries
        are live; values above ``M`` act as ``M``, values ``<= 0`` copy
        nothing. Or ``int[G]`` with ``G`` dividing ``M``: the list is ``G``
        equal segments (one per row of a block table, say), and the first
        ``count[g]`` entries of segment ``g`` are live.
      impl: "auto" | "pallas" | "reference".
      **tuning: ``tile_bytes``, ``num_warps``, ``num_stages``; ``programs``
        (None: one program per entry and tile; an int: that many programs
        stride over the entries, so the copy holds few SMs and kernels that
        run beside it in a concurrent CUDA graph keep the rest) and
        ``unroll`` (entries in flight per strided program, default 4).

    Returns:
      ``(dst_k, dst_v)`` updated. The kernel writes through
      ``input_output_aliases``: inside your ``jit`` with ``dst_k, dst_v``
      donated (and the old values not read after this call) XLA needs no
      copy of them. Called eagerly it does not donate: the arrays you pass
      stay valid and XLA copies them once.

    Inside your own ``jit``, pass ``src_k, src_v`` straight from the jit's
    parameters (no op on them first; see the module docstring).
    """
    _check_into_args(src_k, src_v, dst_k, dst_v, block_ids, slots, count, tuning, id_dims)
    choice, interpret = resolve_impl(impl, kernel_unsupported=_kernel_unsupported(src_k, tuning))
    m = block_ids.shape[0]
    if m == 0:
        return dst_k, dst_v
    if isinstance(count, int):  # keep a huge Python int from overflowing int32
        count = min(max(count, 0), m)
    tuning_items = tuple(sorted(tuning.items())) if choice == "pallas" else ()
    return _run_into(
        src_k, src_v, dst_k, dst_v, block_ids, slots, count, choice=choice, interpret=interpret, tuning=tuning_items,
        id_dims=id_dims)
