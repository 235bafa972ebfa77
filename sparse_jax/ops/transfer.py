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
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import host_gather as _hg
from sparse_jax.ops import _checks
from sparse_jax.ops._dispatch import resolve_impl

__all__ = ["host_gather", "TUNING_KEYS"]

TUNING_KEYS = frozenset({"tile_bytes", "num_warps", "num_stages"})


def _check_args(src, block_ids, tuning):
    for name, x in (("src", src), ("block_ids", block_ids)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    if src.ndim < 1:
        raise ValueError(f"src must have shape [NB, *block_shape] (rank >= 1), got shape {src.shape}")
    if src.shape[0] < 1:
        raise ValueError(f"src must hold at least one block (NB >= 1), got shape {src.shape}")
    _checks.check_rank("block_ids", block_ids, 1, "[M]")
    _checks.check_int("block_ids", block_ids)
    unknown = set(tuning) - TUNING_KEYS
    if unknown:
        raise TypeError(f"unknown tuning keyword(s) {sorted(unknown)}; allowed: {sorted(TUNING_KEYS)}")
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
      **tuning: ``tile_bytes``, ``num_warps``, ``num_stages``.
    """
    _check_args(src, block_ids, tuning)
    choice, interpret = resolve_impl(impl, kernel_unsupported=_kernel_unsupported(src, tuning))
    if block_ids.shape[0] == 0:
        return jnp.zeros((0, *src.shape[1:]), src.dtype)
    tuning_items = tuple(sorted(tuning.items())) if choice == "pallas" else ()
    return _run(src, block_ids, choice=choice, interpret=interpret, tuning=tuning_items)
