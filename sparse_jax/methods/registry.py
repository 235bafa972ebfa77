"""Registry of attention methods: name -> frozen dataclass.

The generation CLI, the benchmarks and the accuracy harness iterate over it.
"""

from __future__ import annotations

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
    """The method registered as ``name`` with its defaults, fields overridden by ``overrides``."""
    if isinstance(name, AttentionMethod):
        return name
    if name not in _REGISTRY:
        raise ValueError(f"unknown attention method {name!r}; available: {', '.join(available_methods())}")
    cls = _REGISTRY[name]
    try:
        return cls(**overrides)
    except TypeError as e:
        raise ValueError(f"bad options for attention method {name!r}: {e}") from None


register("dense")(DenseAttention)
