"""Registry of attention methods: name -> frozen dataclass.

The generation CLI, the benchmarks and the accuracy harness iterate over it.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, TypeVar

from sparse_jax.methods.base import AttentionMethod, DenseAttention

_REGISTRY: dict[str, type[AttentionMethod]] = {}

T = TypeVar("T", bound=type[AttentionMethod])


def register(name: str) -> Callable[[T], T]:
    def deco(cls: T) -> T:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"attention method {name!r} is already registered")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def available_methods() -> list[str]:
    return sorted(_REGISTRY)


def get_method(name: "str | AttentionMethod", **overrides) -> AttentionMethod:
    """The method registered as ``name`` with its defaults, fields overridden by ``overrides``.

    Composition: a dotted key ``"<part>.<field>"`` (e.g. ``anchor.kb=32`` for
    ``kascade``'s anchor selector, ``selector.block_size=16`` for ``asyncspade``'s)
    is an option of the composed method the field ``<part>_selector`` names; such
    keys are collected into the field ``<part>_options`` (``((field, value), ...)``).
    """
    if isinstance(name, AttentionMethod):
        return name
    if name not in _REGISTRY:
        raise ValueError(f"unknown attention method {name!r}; available: {', '.join(available_methods())}")
    cls = _REGISTRY[name]
    overrides = _collect_dotted(name, overrides)
    if isinstance(overrides.get("prefill_options"), dict):  # hashable: methods key compilations
        overrides["prefill_options"] = tuple(overrides["prefill_options"].items())
    try:
        method = cls(**overrides)
    except TypeError as e:
        raise ValueError(f"bad options for attention method {name!r}: {e}") from None
    method.sparse_prefill()  # a bad prefill name or option: ValueError now, before any compilation
    return method


register("dense")(DenseAttention)


def _collect_dotted(name: str, overrides: dict) -> dict:
    """``{"anchor.kb": 32}`` -> ``{"anchor_options": (("kb", 32),)}`` (see :func:`get_method`)."""
    out, parts = {}, {}
    for key, value in overrides.items():
        if "." in key:
            part, field = key.split(".", 1)
            parts.setdefault(part, []).append((field, value))
        else:
            out[key] = value
    for part, items in parts.items():
        key = f"{part}_options"
        prev = tuple(out.get(key, ()))
        if key not in {f.name for f in dataclasses.fields(_REGISTRY[name])}:
            raise ValueError(f"bad options for attention method {name!r}: it composes no {part!r} method "
                             f"(options {[f'{part}.{f}' for f, _ in items]})")
        out[key] = prev + tuple(items)
    return out
