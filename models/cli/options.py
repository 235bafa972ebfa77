"""The command line's shared pieces: ``--attention-opt KEY=VALUE`` parsing and the
error a bad command line raises (used by ``models.cli.generate`` and ``models.cli.serve``)."""

from __future__ import annotations

import ast
from typing import Any, Sequence


class CLIError(ValueError):
    """A bad command line; the message says what is wrong and what is valid."""


def _parse_scalar(s: str) -> Any:
    t = s.strip()
    low = t.lower()
    if low in ("true", "yes", "on"):
        return True
    if low in ("false", "no", "off"):
        return False
    if low in ("none", "null"):
        return None
    try:
        return int(t)
    except ValueError:
        pass
    try:
        return float(t)
    except ValueError:
        pass
    return t


def parse_option_value(s: str) -> Any:
    """``"512"`` -> 512, ``"0.5"`` -> 0.5, ``"true"`` -> True, ``"none"`` -> None,
    ``"0,1"`` / ``"(0, 1)"`` / ``"[0,1]"`` -> (0, 1), ``"()"`` -> (), else the string."""
    t = s.strip()
    if (t.startswith("(") and t.endswith(")")) or (t.startswith("[") and t.endswith("]")):
        try:
            v = ast.literal_eval(t)
            return tuple(v) if isinstance(v, (list, tuple)) else v
        except (ValueError, SyntaxError):
            t = t[1:-1]
            return tuple(_parse_scalar(x) for x in t.split(",") if x.strip())
    if "," in t:
        return tuple(_parse_scalar(x) for x in t.split(",") if x.strip())
    return _parse_scalar(t)


def parse_attention_opts(items: Sequence[str]) -> dict[str, Any]:
    opts: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        # a dotted key (anchor.kb=32) is an option of a composed method (sparse_jax.methods.registry)
        if not sep or not all(part.isidentifier() for part in key.split(".")):
            raise CLIError(f"--attention-opt expects KEY=VALUE (e.g. budget=512), got {item!r}")
        if key in opts:
            raise CLIError(f"--attention-opt {key} given twice")
        opts[key] = parse_option_value(value)
    return opts
