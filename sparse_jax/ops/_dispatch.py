"""Choosing an implementation for a public op.

Every public op takes ``impl`` in {"auto", "pallas", "reference"}:

* ``"reference"``: the pure-jnp reference (runs anywhere; the test oracle).
* ``"pallas"``: the Pallas kernel; on a machine without a GPU it runs in
  Pallas interpret mode, so CPU tests exercise the kernel's own code.
* ``"auto"``: the kernel on GPU, the reference elsewhere. An op may also fall
  back to the reference on GPU for shapes its kernel does not support; it says
  why through ``kernel_unsupported``.
"""

from __future__ import annotations

import functools
from typing import Literal

import jax

Impl = Literal["auto", "pallas", "reference"]
IMPLS = ("auto", "pallas", "reference")


@functools.cache
def on_gpu() -> bool:
    """True when JAX's default backend is a GPU."""
    try:
        return jax.default_backend() == "gpu"
    except RuntimeError:
        return False


def resolve_impl(impl: str, *, kernel_unsupported: str | None = None) -> tuple[str, bool]:
    """Return ``(choice, interpret)`` where choice is "pallas" or "reference".

    ``kernel_unsupported`` is a reason the kernel cannot handle these
    arguments (``None`` when it can): "auto" then falls back to the reference,
    and "pallas" raises.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "reference":
        return "reference", False
    if impl == "auto":
        if not on_gpu() or kernel_unsupported is not None:
            return "reference", False
        return "pallas", False
    if kernel_unsupported is not None:
        raise ValueError(f"impl='pallas' cannot run these arguments: {kernel_unsupported}")
    return "pallas", not on_gpu()
