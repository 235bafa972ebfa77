"""Layer kinds as data: what a method and the layer driver know of one layer.

A model's stack is a sequence of layers, each with an attention *kind*:

* ``"global"``: attends the whole context (a cache of ``max_len`` tokens);
* ``"local"``: sliding-window attention over the last ``window`` keys (the
  current one included), so its cache is a ring of ``window`` tokens, not
  ``max_len`` (Gemma 3's local layers).

Sparse methods run on global layers only (a sliding window is already
sparse), and a method's dense-layer rule (``dense_layers=(0, 1)``: "layers
0-1 dense") counts global layers: on a model of 18 layers with global layers
5, 11 and 17, ``dense_layers=(0,)`` keeps layer 5 exact.

:func:`layer_specs` turns a model's layer kinds and a method into one
:class:`LayerSpec` per layer; :func:`segments` cuts the stack into runs of
identical specs, each of which the driver runs as one ``lax.scan`` over
stacked parameters and caches.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

KINDS = ("global", "local")


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """One layer as the driver and the methods see it (static, hashable).

    Attributes:
      kind: ``"global"`` or ``"local"``.
      window: keys a local layer attends, the current one included (None for global).
      rope_theta: RoPE base of this layer's kind.
      sparse: whether the attention method runs here; False on local layers and on
        the global layers the method's dense-layer rule keeps exact.
      sparse_prefill: whether the method's sparse prefill (Token Sparse Attention,
        :mod:`sparse_jax.prefill`) runs here; global layers only.
    """

    kind: str = "global"
    window: int | None = None
    rope_theta: float = 10000.0
    sparse: bool = False
    sparse_prefill: bool = False

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"layer kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind == "local" and (self.window is None or self.window < 1):
            raise ValueError(f"a local layer needs a window >= 1, got {self.window!r}")
        if self.kind == "global" and self.window is not None:
            raise ValueError("a global layer has no window")
        if self.kind == "local" and self.sparse:
            raise ValueError("sparse methods run on global layers only")
        if self.kind == "local" and self.sparse_prefill:
            raise ValueError("sparse prefill runs on global layers only (a window over compressed positions "
                             "would be wrong)")

    def capacity(self, max_len: int) -> int:
        """Cache slots of this layer for a context of ``max_len`` tokens."""
        return max_len if self.kind == "global" else min(self.window, max_len)


def layer_specs(kinds: Sequence[str], *, window: int | None, rope_theta: float,
                local_rope_theta: float | None, is_sparse, is_sparse_prefill=None) -> tuple[LayerSpec, ...]:
    """One :class:`LayerSpec` per layer.

    ``kinds``: the kind of each layer. ``is_sparse(i, n) -> bool`` is the method's
    rule for the ``i``-th of ``n`` global layers; ``is_sparse_prefill(i, n) ->
    bool`` its sparse-prefill rule for model layer ``i`` of ``n`` (global layers only).
    """
    kinds = tuple(kinds)
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        raise ValueError(f"layer kinds must be among {KINDS}, got {bad[0]!r}")
    n_global = sum(k == "global" for k in kinds)
    specs, g = [], 0
    for i, k in enumerate(kinds):
        if k == "global":
            sp = bool(is_sparse_prefill(i, len(kinds))) if is_sparse_prefill is not None else False
            specs.append(LayerSpec("global", None, float(rope_theta), bool(is_sparse(g, n_global)), sp))
            g += 1
        else:
            theta = rope_theta if local_rope_theta is None else local_rope_theta
            specs.append(LayerSpec("local", int(window), float(theta), False))
    return tuple(specs)


@dataclasses.dataclass(frozen=True)
class Segment:
    """Consecutive layers ``start .. start + length - 1`` with the same ``spec``."""

    spec: LayerSpec
    start: int
    length: int

    @property
    def layers(self) -> range:
        return range(self.start, self.start + self.length)


def segments(specs: Sequence[LayerSpec]) -> tuple[Segment, ...]:
    """The stack cut into runs of identical layer specs (each run is one scan)."""
    out: list[Segment] = []
    for i, s in enumerate(specs):
        if out and out[-1].spec == s:
            out[-1] = dataclasses.replace(out[-1], length=out[-1].length + 1)
        else:
            out.append(Segment(s, i, 1))
    return tuple(out)
