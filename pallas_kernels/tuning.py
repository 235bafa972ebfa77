"""Tuned kernel configurations per shape class, measured on the GPU.

``benchmarks/tune.py`` sweeps each kernel's knobs over the shape classes that
matter (decode batch 1 / 8 / 32, budgets 1024 / 2048, 32K-128K contexts), checks
every configuration against the reference before timing it, and writes the best
one per class into ``tuned_configs.json`` next to this file, under the device kind
it ran on. The public ops
(``sparse_jax.ops``) read it when the caller passes no tuning of their own, so
``impl="auto"`` runs the measured best; a class that was never measured gets the
kernel's built-in defaults.

A shape class rounds the dimensions that only move the optimum a little (the
number of ``(batch, KV head)`` rows, the selected length) up to a power of two,
and keeps exact the ones a kernel is compiled for (head_dim, the GQA group).

The table is keyed by device kind first: ``{"about": ..., "devices": {kind:
{shape class: entry}}}``, ``kind`` being ``jax.devices()[0].device_kind`` of the
GPU that measured it ("NVIDIA H200", "NVIDIA H100 80GB HBM3"). A lookup reads
only the entries of the device it runs on (the default backend's first device,
read once, on the first lookup), so an H100 entry is never used on an H200 nor
the other way round; a device without entries, or a backend that is not a GPU,
gets the kernels' defaults for every class (and the classes are listed by
:func:`untuned_classes`). :func:`set_device_kind` overrides the device kind
(``set_device_kind("NVIDIA H200")`` on a CPU reads the H200 entries, as tests
do; ``set_device_kind(None)`` goes back to the detected one); :func:`device_kind`
says which one lookups use.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from pallas_kernels._util import next_pow2

TABLE_PATH = Path(__file__).with_name("tuned_configs.json")

#: the dimensions each kernel's class is made of, in key order
CLASS_DIMS = {
    "sparse_decode": ("rows", "k", "d", "g"),
    "block_sparse_decode": ("rows", "k", "d", "g", "block"),
    "label_scores": ("rows", "c", "w", "g"),
    "block_label_scores": ("rows", "c", "w", "g", "block"),
    "quest_block_scores": ("rows", "nb", "d", "g"),
    "quest_block_scores_q8": ("rows", "nb", "d", "g"),
    "topk": ("rows", "n", "k"),
}
#: dimensions rounded up to a power of two (the rest are exact)
_ROUNDED = {"rows", "k", "c", "nb", "n"}


def shape_class(kernel: str, **dims: int) -> str:
    """``"sparse_decode|rows=64|k=2048|d=128|g=4"``: the table key of one call.

    ``rows`` is ``B * Hkv``; ``k`` selected tokens; ``c`` candidates; ``nb``
    blocks; ``d`` head_dim; ``g`` query heads per KV head; ``w`` packed label
    bytes per token; ``block`` tokens per block; ``n`` keys per row of a top-k
    (``rows`` its rows)."""
    names = CLASS_DIMS[kernel]
    if set(dims) != set(names):
        raise ValueError(f"{kernel}: a shape class needs exactly {names}, got {sorted(dims)}")
    parts = [kernel]
    for n in names:
        v = int(dims[n])
        parts.append(f"{n}={max(1, next_pow2(v)) if n in _ROUNDED else v}")
    return "|".join(parts)


@functools.cache
def _tables() -> dict:
    """The whole table: ``{device kind: {shape class: entry}}``."""
    if not TABLE_PATH.exists():
        return {}
    return json.loads(TABLE_PATH.read_text()).get("devices", {})


@functools.cache
def _detected_device_kind() -> str | None:
    """The default backend's first device's kind when that backend is a GPU, else None
    (read on the first lookup, not at import)."""
    import jax

    try:
        if jax.default_backend() != "gpu":
            return None
        return jax.devices()[0].device_kind
    except RuntimeError:  # no backend could be initialized
        return None


_UNSET = object()
_override: object = _UNSET


def set_device_kind(name: str | None) -> None:
    """Look the table up as if running on ``name`` (a ``device_kind`` such as
    ``"NVIDIA H200"``); ``None`` drops the override (the detected device again)."""
    global _override
    _override = _UNSET if name is None else str(name)
    _table.cache_clear()


def device_kind() -> str | None:
    """The device kind whose entries lookups read: the override, else the detected GPU's
    kind (None off the GPU: no entries)."""
    return _detected_device_kind() if _override is _UNSET else _override


@functools.cache
def _table() -> dict:
    """The current device kind's entries, ``{shape class: entry}`` (``{}`` for a device
    without any)."""
    kind = device_kind()
    return _tables().get(kind, {}) if kind is not None else {}


#: the classes ``tuned`` was asked for in this process that the table has no entry for
_MISSED: set[str] = set()


def tuned(kernel: str, **dims: int) -> dict:
    """The measured best tuning of ``kernel`` for this shape's class on this device kind
    (``{}`` when the class was never measured on it: the kernel's defaults apply, and the
    class is remembered for :func:`untuned_classes`)."""
    cls = shape_class(kernel, **dims)
    entry = _table().get(cls)
    if not entry:
        _MISSED.add(cls)
    return dict(entry["config"]) if entry else {}


def untuned_classes() -> list[str]:
    """The shape classes looked up in this process that ran the kernels' defaults (no table
    entry for the device kind they were looked up on). ``benchmarks.kernels`` reports them:
    an unswept class is otherwise silent, and untuned classes were the largest single lever
    found on the H200 (B=32's 8-bit bound ran B=1's defaults; tuned, it took about half the
    time: README.md, 'Decode kernels vs dense cuDNN', "Changed on 2026-11-29")."""
    return sorted(_MISSED)


def with_tuned(user: dict, kernel: str, **dims: int) -> dict:
    """``user``'s tuning when it names any knob (the caller knows best), else the
    table's for this class. Knobs the caller sets to None count as unset."""
    given = {k: v for k, v in user.items() if v is not None}
    if given:
        return given
    return tuned(kernel, **dims)
