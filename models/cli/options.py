"""The command line's shared pieces: ``--attention-opt KEY=VALUE`` parsing, the
``--prefill`` flags, and the error a bad command line raises (used by
``models.cli.generate`` and ``models.cli.serve``)."""

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


def parse_attention_opts(items: Sequence[str], flag: str = "--attention-opt") -> dict[str, Any]:
    opts: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        # a dotted key (anchor.kb=32) is an option of a composed method (sparse_jax.methods.registry)
        if not sep or not all(part.isidentifier() for part in key.split(".")):
            raise CLIError(f"{flag} expects KEY=VALUE (e.g. budget=512), got {item!r}")
        if key in opts:
            raise CLIError(f"{flag} {key} given twice")
        opts[key] = parse_option_value(value)
    return opts


#: ``--prefill`` choices -> the method's ``prefill`` field (:func:`sparse_jax.prefill.make_prefill`)
PREFILLS = {"dense": "dense", "tsa": "token_sparse"}


def add_prefill_flags(p) -> None:
    """``--prefill dense|tsa`` and ``--prefill-opt KEY=VALUE`` on an argparse parser."""
    p.add_argument("--prefill", choices=tuple(PREFILLS), default="dense",
                   help="the prompt's attention: dense (default, exact) or tsa (Token Sparse Attention on the "
                        "global layers of prompts of at least min_tokens, with any attention method)")
    p.add_argument("--prefill-opt", action="append", default=[], metavar="KEY=VALUE",
                   help="--prefill tsa: an option of sparse_jax.prefill.TokenSparsePrefill (repeatable), e.g. "
                        "tau=0.01, min_tokens=8192, layers=2,3,4")


def method_options(args) -> dict[str, Any]:
    """The attention method's options from ``--attention-opt`` and the ``--prefill`` flags
    (``--prefill tsa --prefill-opt tau=0.01`` is ``--attention-opt prefill=token_sparse
    --attention-opt prefill.tau=0.01``; giving both forms is an error)."""
    opts = parse_attention_opts(args.attention_opt)
    extra = parse_attention_opts(args.prefill_opt, flag="--prefill-opt")
    if args.prefill == "dense" and not extra:
        return opts
    if args.prefill == "dense":
        raise CLIError("--prefill-opt configures --prefill tsa; it was given without it")
    given = sorted(k for k in opts if k == "prefill" or k.startswith("prefill."))
    if given:
        raise CLIError(f"--prefill {args.prefill} and --attention-opt {', '.join(given)} both set the prefill: "
                       f"use one of them")
    opts["prefill"] = PREFILLS[args.prefill]
    opts.update({f"prefill.{k}": v for k, v in extra.items()})
    return opts
