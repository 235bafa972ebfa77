"""``kascade`` (Deshmukh et al., 2025): exact top-k on a few anchor layers, reused
by the layers between them.

Per decode step and sparse layer, by its role (``layer_data``: ``role``,
``head_map``):

* **dense anchor** (the first anchor, layer 0 on an all-global model): exact
  attention over the whole context; its top-k goes into the carry;
* **anchor**: exact post-softmax probabilities summed over the GQA group
  (:func:`anchor_group_probabilities`), an exact top-k per KV head, attention
  over its own top-k (renormalised: the softmax runs over the selected tokens
  only); the top-k replaces the carry;
* **reuse**: KV head ``h`` attends the carried top-k of anchor head
  ``head_map[h]`` (``sparse_decode_attention`` with the mapped indices).

``shared_topk=True`` is the paper's other head strategy (Sec. 3.5, reported in its
Sec. 4.2 "for completeness"; LessIsMore and OmniKV do this): an anchor sums its
probabilities over every head of the layer and takes one top-k that every KV head
attends, so no head map is read. The paper measured it below the head map on
AIME-24; on SmolLM2 the reuse layers 25-29 map every head to one anchor head,
which a shared selection sidesteps (issue 51). Decode only: the tiled prefill
and a composed anchor selector select per head, and refuse it.

The carry (``init_carry``) is the most recent anchor's token selection
``indices int32[B, Hkv, K]``, ``counts int32[B, Hkv]`` (and, composed with a
lagged selector, its ``prefetch``); it crosses layers in the driver.

**Budget.** ``budget=0`` (default) is the paper's ``k = min(max(128, 10% of
the context), context)`` per row and step (``min_budget``,
``budget_fraction``), with ``10%`` rounded down. We follow the code's
``DecodeOnlyKascadeStrategy`` (attend ``k``), not ``KascadeStrategy``'s
``k - 32`` (which subtracts a prefill tile that decode does not have). A
``budget > 0`` fixes ``k`` (the accuracy harness's equal-budget comparison).

**Composition.** ``anchor_selector`` names a registered method (e.g.
``asynctls``, ``quest``, ``double_sparsity``) whose selection replaces the
exact top-k at the anchors (options through ``anchor_options``, or dotted
keys ``anchor.kb=32`` with :func:`~sparse_jax.methods.registry.get_method`).
Reuse layers map its tokens (and its ``prefetch`` blocks) by the head map, so
Kascade over a lagged AsyncTLS runs offloaded: a reuse layer's selection lies
in the blocks its previous step prefetched. A composed anchor is not exact,
so the first anchor then attends its selection rather than densely
(``dense_first_anchor`` applies to ``anchor_selector="exact"`` only).

**Calibration.** ``anchors``/``head_map`` default to the model's shipped
calibration (``sparse_jax/calibration_data/<model>/kascade.json``, from
``python -m models.cli.kascade_calibrate``); without one, 5 anchors spread from
layer 0 (:func:`sparse_jax.methods.kascade.calibration.fallback_anchors`) and the
identity head map. The first sparse layer is always an anchor (it has no
earlier anchor to reuse).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from sparse_jax.methods.kascade import prefill as kp
from sparse_jax.methods.kascade.calibration import anchors_from_calibration, fallback_anchors, load_kascade_calibration
from sparse_jax.methods.base import AttentionMethod
from sparse_jax.methods.registry import get_method, register
from sparse_jax.ops.scoring import group_softmax_scores
from sparse_jax.ops.selection import topk_indices
from sparse_jax.selection import Selection

DENSE_ANCHOR, ANCHOR, REUSE = 0, 1, 2


def kascade_budget(lengths: jax.Array, fraction: float, minimum: int) -> jax.Array:
    """The paper's ``k = min(max(minimum, floor(fraction * L)), L)`` per row: ``int32[B]``."""
    lengths = lengths.astype(jnp.int32)
    frac = jnp.floor(lengths.astype(jnp.float32) * fraction).astype(jnp.int32)
    return jnp.minimum(jnp.maximum(frac, minimum), lengths)


def anchor_group_probabilities(q: jax.Array, k: jax.Array, lengths: jax.Array, *, impl: str = "auto") -> jax.Array:
    """Exact post-softmax probabilities summed over each GQA group: ``[B, Hkv, S]`` f32,
    0 at and past ``lengths`` (the anchor step; ``sparse_jax.ops.scoring``'s fused kernel)."""
    return group_softmax_scores(q, k, lengths, impl=impl)


def _is_static(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


@register("kascade")
@dataclasses.dataclass(frozen=True)
class Kascade(AttentionMethod):
    """Kascade decode: anchors' exact top-k reused through a head map.

    Attributes:
      budget: tokens per KV head; 0 = the paper's 10% rule (``budget_fraction``,
        at least ``min_budget``, at most the context).
      paper_budget: the 10% rule even when ``budget`` is set.
      anchors: model layer indices of the anchor layers (None: the calibration).
      num_anchors: with a calibration and no ``anchors``: rerun its DP for this many
        anchors (None: the calibration's own, 5 as in the paper).
      head_map: ``[L][Hkv]`` anchor head each KV head of each layer reads (None:
        the calibration's, else the identity).
      dense_first_anchor: the first anchor attends densely (the paper's layer 0).
      anchor_selector: ``"exact"`` or a registered method selecting at anchors.
      anchor_options: ``((field, value), ...)`` for the anchor selector.
      calibration_root: where calibrations live (default: the package's).
      impl: kernel implementation ("auto", "pallas", "reference").
      tiled_prefill: Kascade's tile-sparse prefill (module :mod:`sparse_jax.methods.kascade.prefill`;
        the 10% rule less one tile per tile, or ``budget`` keys per tile when fixed).
      prefill_tile: queries per prefill tile (32, as the code; the paper says 128).
      prefill_impl: the tiled prefill's attention: "composed" (the gather kernel over
        each tile's keys, LSE-merged with the causal diagonal tile; ``impl`` picks the
        kernel; anchors select chunk by chunk of tiles, ``prefill_chunk_bytes`` of f32
        logits at a time, no ``[T, T]`` array) or "masked" (the ``[T, T]``-mask reference).
      prefill_chunk_bytes: the composed anchors' selection chunk (default 2 GiB).
      shared_topk: one top-k per anchor, from the probabilities summed over every head, shared
        by every KV head (the paper's shared variant; the head map is then not read).
      tiled_prefill_layers: the layers whose prompt attention is tile-sparse (None: all).
        The others attend densely: an anchor among them still selects for the layers
        after it (as the dense first anchor does), a reuse layer leaves the selection
        as it is. On SmolLM2 the tiled prefill on 29 of 30 layers costs 21-42 RULER
        points at 4K (``docs/methods.md``): fewer sparse layers is the knob, as TSA's δ.
    """

    crosses_kv_heads: ClassVar[bool] = True  # reuse head h reads the anchor head head_map[h]

    budget: int = 0
    #: use the paper's rule whatever ``budget`` says (the accuracy harness sets a budget on
    #: every method that has one: ``--set kascade.paper_budget=True`` runs the 10% rule)
    paper_budget: bool = False
    budget_fraction: float = 0.1
    min_budget: int = 128
    anchors: tuple[int, ...] | None = None
    num_anchors: int | None = None
    head_map: tuple | None = dataclasses.field(default=None, repr=False)
    dense_first_anchor: bool = True
    anchor_selector: str = "exact"
    anchor_options: tuple = ()
    calibration_root: str | None = None
    impl: str = "auto"
    dense_layers: tuple[int, ...] = ()
    #: the paper's shared Top-k across all heads (module docstring): decode's anchors only
    shared_topk: bool = False
    #: the paper's tile-sparse prefill (:mod:`sparse_jax.methods.kascade.prefill`): anchors take a
    #: top-k per tile of ``prefill_tile`` queries, reuse layers attend it plus their
    #: diagonal tile. Off by default: dense prefill, Kascade in decode only
    tiled_prefill: bool = False
    prefill_tile: int = 32
    #: "composed" (fast: :func:`sparse_jax.methods.kascade.prefill.tiled_attention_composed`) or
    #: "masked" (the reference with dense [T, T] masks)
    prefill_impl: str = "composed"
    #: "composed" anchors' selection: f32 logits of at most this many bytes at a time
    #: (:func:`sparse_jax.methods.kascade.prefill.anchor_selection_chunked`; default 2 GiB)
    prefill_chunk_bytes: int = 2 << 30
    #: layers with a tile-sparse prompt attention (None: every layer); the rest attend densely
    tiled_prefill_layers: tuple[int, ...] | None = None
    #: the anchor selector bound to the model (``for_model``), filled in
    selector: Any = dataclasses.field(default=None, repr=False)

    # -- the composed selector --------------------------------------------------
    @property
    def composed(self) -> bool:
        return self.anchor_selector != "exact"

    @property
    def reads_all_keys(self) -> bool:  # type: ignore[override]
        return not self.composed

    def _selector(self) -> AttentionMethod | None:
        if not self.composed:
            return None
        if self.selector is not None:
            return self.selector
        opts = dict(self.anchor_options)
        if self.budget and "budget" not in opts:
            opts["budget"] = self.budget
        return get_method(self.anchor_selector, **opts)

    # -- binding -------------------------------------------------------------------
    def for_model(self, model_name, *, num_layers, head_dim, sparse_layers=None):
        if self.num_anchors is not None and self.num_anchors < 1:
            raise ValueError(f"kascade: num_anchors must be >= 1, got {self.num_anchors}")
        anchors, head_map = self.anchors, self.head_map
        cal = load_kascade_calibration(model_name, self.calibration_root)
        cal_map = None if cal is None else cal.get("head_map")
        if anchors is None and cal is not None and self.num_anchors is not None:
            anchors, cal_map = anchors_from_calibration(cal, self.num_anchors)
        elif anchors is None:
            anchors = tuple(cal["anchors"]) if cal else fallback_anchors(num_layers, self.num_anchors or 5)
        if head_map is None and cal_map is not None:
            head_map = tuple(tuple(int(h) for h in row) for row in np.asarray(cal_map))
        anchors = tuple(sorted(int(a) for a in anchors))
        # the first layer the method runs on must be an anchor: nothing before it to reuse. On
        # a hybrid model that is a global layer, which only the model's plan knows
        if sparse_layers is not None:
            first_sparse = min(sparse_layers, default=None)
        else:
            dense = {i % num_layers for i in self.dense_layers}
            first_sparse = next((i for i in range(num_layers) if i not in dense), None)
        if first_sparse is not None and first_sparse not in anchors:
            anchors = tuple(sorted({first_sparse, *anchors}))
        sel = self._selector()
        if sel is not None:
            sel = sel.for_model(model_name, num_layers=num_layers, head_dim=head_dim, sparse_layers=sparse_layers)
        return dataclasses.replace(self, anchors=anchors, head_map=head_map, selector=sel)

    def check(self, *, num_q_heads, num_kv_heads, head_dim, max_len):
        if self.budget < 0 or self.min_budget < 1 or not 0 < self.budget_fraction <= 1:
            raise ValueError("kascade: budget must be >= 0, min_budget >= 1 and 0 < budget_fraction <= 1")
        if self.prefill_tile < 1:
            raise ValueError(f"kascade: prefill_tile must be >= 1, got {self.prefill_tile}")
        if self.prefill_chunk_bytes < 1:
            raise ValueError(f"kascade: prefill_chunk_bytes must be >= 1, got {self.prefill_chunk_bytes}")
        if self.tiled_prefill_layers is not None and any(int(i) < 0 for i in self.tiled_prefill_layers):
            raise ValueError(f"kascade: tiled_prefill_layers must be layer indices >= 0, "
                             f"got {self.tiled_prefill_layers}")
        if self.prefill_impl not in ("composed", "masked"):
            raise ValueError(f"kascade: prefill_impl must be 'composed' or 'masked', got {self.prefill_impl!r}")
        if self.shared_topk and (self.composed or self.tiled_prefill):
            raise ValueError("kascade: shared_topk is the exact anchors' decode selection; "
                             + (f"anchor_selector={self.anchor_selector!r} selects per head" if self.composed
                                else "the tiled prefill selects per head: drop tiled_prefill or shared_topk"))
        if self.anchors is None:
            raise ValueError("kascade needs its anchors: load the model with models.load_model(..., "
                             "attention='kascade') (reads the calibration) or pass anchors=(...)")
        if any(a < 0 for a in self.anchors):
            raise ValueError(f"kascade: anchor layers must be >= 0, got {self.anchors}")
        if self.head_map is not None:
            hm = np.asarray(self.head_map)
            if hm.ndim != 2 or hm.shape[1] != num_kv_heads:
                raise ValueError(f"kascade: head_map must be [L, Hkv={num_kv_heads}], got shape {hm.shape}")
            if hm.min() < 0 or hm.max() >= num_kv_heads:
                raise ValueError(f"kascade: head_map entries must lie in [0, {num_kv_heads})")
        sel = self._selector()
        if sel is not None:
            sel.check(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, max_len=max_len)

    @property
    def cache_multiple(self) -> int:
        sel = self._selector()
        return 1 if sel is None else sel.cache_multiple

    # -- per-layer constants -----------------------------------------------------------
    def layer_role(self, index: int) -> int:
        anchors = self.anchors or ()
        if anchors and index == anchors[0] and self.dense_first_anchor and not self.composed:
            return DENSE_ANCHOR
        return ANCHOR if index in anchors else REUSE

    def layer_data(self, index):
        d = {"role": np.int32(self.layer_role(index))}
        if self.tiled_prefill:  # whether this layer's prompt attention is tile-sparse
            d["tiled_prefill"] = np.bool_(self.tiled_prefill_layers is None or index in self.tiled_prefill_layers)
        if self.head_map is not None:
            d["head_map"] = np.asarray(self.head_map[index], np.int32)
        sel = self._selector()
        if sel is not None:
            inner = sel.layer_data(index)
            if inner:
                d.update(inner)
        return d

    # -- sizes ---------------------------------------------------------------------
    @property
    def fixed_budget(self) -> int:
        """k when fixed, 0 for the paper's per-row rule."""
        return 0 if self.paper_budget else self.budget

    def carry_tokens(self, max_len: int) -> int:
        """Static width K of the carried selection."""
        if self.composed:
            return min(self._selector().budget, max_len)
        if self.fixed_budget:
            return min(self.fixed_budget, max_len)
        return min(max(self.min_budget, int(np.floor(max_len * self.budget_fraction))), max_len)

    def init_carry(self, *, batch, num_kv_heads, max_len):
        kk = self.carry_tokens(max_len)
        carry = {"indices": jnp.zeros((batch, num_kv_heads, kk), jnp.int32),
                 "counts": jnp.zeros((batch, num_kv_heads), jnp.int32)}
        sel = self._selector()
        if sel is not None and getattr(sel, "lag", False):
            carry["prefetch"] = jnp.zeros((batch, num_kv_heads, sel.offload_blocks_per_step(max_len)), jnp.int32)
        return carry

    # -- the tiled prefill --------------------------------------------------------------
    def _prefill_args(self) -> dict:
        return dict(tile=self.prefill_tile, budget=self.fixed_budget, fraction=self.budget_fraction,
                    min_keys=self.min_budget)

    def init_prefill_carry(self, *, batch, num_kv_heads, length):
        if not self.tiled_prefill:
            return None

        return kp.empty_carry(batch, num_kv_heads, length, **self._prefill_args())

    def prefill_attention_carry(self, q, k, v, lengths, layer, carry):
        if not self.tiled_prefill:
            return super().prefill_attention_carry(q, k, v, lengths, layer, carry)

        args, tile = self._prefill_args(), self.prefill_tile

        chunk = dict(impl=self.prefill_impl, max_chunk_bytes=self.prefill_chunk_bytes)

        def dense(_):  # the driver's dense (flash) prefill attention, the selection alone
            return self.prefill_attention(q, k, v, lengths, layer), self._anchor_selection(q, k, lengths)

        impls = dict(impl=self.prefill_impl, kernel_impl=self.impl)

        def anchor(_):
            return kp.anchor_attention_impl(q, k, v, lengths, **chunk, kernel_impl=self.impl, **args)

        def reuse(_):
            idx = kp.reused(carry, layer.data.get("head_map"))
            return kp.tiled_attention_impl(q, k, v, idx, carry["counts"], tile, **impls), carry

        def dense_reuse(_):  # a reuse layer outside tiled_prefill_layers: dense, the selection kept
            return self.prefill_attention(q, k, v, lengths, layer), carry

        role, tiled = layer.data["role"], layer.data.get("tiled_prefill", True)
        # outside tiled_prefill_layers an anchor attends densely and still selects (the dense branch)
        if _is_static(role) and _is_static(tiled):
            branch = role if tiled else (3 if role == REUSE else DENSE_ANCHOR)
        else:
            branch = jnp.where(tiled, role, jnp.where(role == REUSE, 3, DENSE_ANCHOR))
        if _is_static(branch):
            return (dense, anchor, reuse, dense_reuse)[int(branch)](None)
        return jax.lax.switch(branch, (dense, anchor, reuse, dense_reuse), None)

    def prefill_carry(self, q, k, lengths, layer, carry):
        """With the tiled prefill composed with Token Sparse Attention (``prefill=
        "token_sparse"``): on a TSA layer an anchor still selects each tile's keys from its
        own ``q, k`` (the exact selection, as an anchor outside ``tiled_prefill_layers``
        does), so the reuse layers after it keep an anchor; a reuse layer passes the carry on."""
        if not self.tiled_prefill:
            return carry
        role = layer.data["role"]
        if _is_static(role):
            return carry if int(role) == REUSE else self._anchor_selection(q, k, lengths)
        return jax.lax.cond(role == REUSE, lambda _: carry, lambda _: self._anchor_selection(q, k, lengths), None)

    def _anchor_selection(self, q, k, lengths):
        """An anchor's exact per-tile selection (the new carry) when it attends by another
        path: densely (the dense first anchor, an anchor outside ``tiled_prefill_layers``)
        or through Token Sparse Attention."""
        return kp.anchor_selection_impl(q, k, lengths, impl=self.prefill_impl,
                                        max_chunk_bytes=self.prefill_chunk_bytes, kernel_impl=self.impl,
                                        **self._prefill_args())

    # -- state: the selector's, on every sparse layer (a scanned segment stacks
    #    identical states); plus whether the first decode step is still to come
    def init_state(self, spec, *, batch, num_kv_heads, max_len, head_dim, dtype, num_q_heads=None):
        sel = self._selector()
        if sel is None:
            return None
        inner = sel.init_state(spec, batch=batch, num_kv_heads=num_kv_heads, max_len=max_len, head_dim=head_dim,
                               dtype=dtype, num_q_heads=num_q_heads)
        return {"inner": inner, "first": jnp.zeros((batch,), jnp.bool_)}

    def prefill_state(self, state, k, v, lengths, layer):
        sel = self._selector()
        if sel is None:
            return state
        return {"inner": sel.prefill_state(state["inner"], k, v, lengths, layer),
                "first": jnp.ones_like(state["first"])}

    def prefill_query_state(self, state, q_last, lengths, layer):
        sel = self._selector()
        if sel is None:
            return state
        return dict(state, inner=sel.prefill_query_state(state["inner"], q_last, lengths, layer))

    def append_state(self, state, kv, positions, layer):
        sel = self._selector()
        if sel is None:
            return state
        return dict(state, inner=sel.append_state(state["inner"], kv, positions, layer))

    # -- selection -------------------------------------------------------------------
    def exact_topk(self, q, kv, lengths) -> tuple[jax.Array, jax.Array]:
        """The anchor step: ``(indices int32[B,Hkv,K], counts int32[B,Hkv])``, the
        exact top-k of the group-summed probabilities, the best first where ``k``
        varies per row (the 10% rule)."""
        kk = self.carry_tokens(kv.capacity)
        scores = anchor_group_probabilities(q, kv.k, lengths, impl=self.impl)
        b, hkv, _ = scores.shape
        if self.shared_topk:  # one selection for the layer: every head's probabilities summed
            scores = jnp.sum(scores, axis=1, keepdims=True)
        top = topk_indices(scores, kk, lengths[:, None], impl=self.impl)
        if self.fixed_budget:
            counts = jnp.minimum(self.fixed_budget, lengths)
        else:
            # the kernel's order is unspecified: best first, so a row's k <= K leads
            sc = jnp.take_along_axis(scores, top, axis=-1)
            sc = jnp.where(top < lengths[:, None, None], sc, -jnp.inf)
            top = jnp.take_along_axis(top, jnp.argsort(-sc, axis=-1), axis=-1)
            counts = kascade_budget(lengths, self.budget_fraction, self.min_budget)
        top = jnp.broadcast_to(top, (b, hkv, top.shape[-1]))  # shared_topk: the one row for every head
        return top.astype(jnp.int32), jnp.broadcast_to(counts[:, None], (b, hkv)).astype(jnp.int32)

    def _anchor(self, q, kv, lengths, state, layer):
        """An anchor's own selection (tokens) and the carry it leaves."""
        sel = self._selector()
        if sel is None:
            idx, cnt = self.exact_topk(q, kv, lengths)
            return Selection.tokens(idx, cnt), state, {"indices": idx, "counts": cnt}
        own, inner, _ = sel.select(q, kv, lengths, state["inner"], None, layer)
        if own.kind == "all":
            raise ValueError(f"kascade: anchor selector {sel.name!r} selected every token on a sparse layer")
        idx, cnt = own.token_view(lengths)
        kk = self.carry_tokens(kv.capacity)
        idx = idx[..., :kk] if idx.shape[-1] >= kk else jnp.pad(idx, ((0, 0), (0, 0), (0, kk - idx.shape[-1])))
        cnt = jnp.minimum(cnt, kk)
        carry = {"indices": idx.astype(jnp.int32), "counts": cnt.astype(jnp.int32)}
        if own.prefetch is not None:
            carry["prefetch"] = own.prefetch
        own = Selection.tokens(idx, cnt, prefetch=own.prefetch, block_size=own.block_size,
                               within_prefetch=own.within_prefetch)
        return own, dict(state, inner=inner, first=jnp.zeros_like(state["first"])), carry

    def _reuse(self, q, kv, lengths, state, carry, layer):
        """A reuse layer attends the carried tokens of anchor head ``head_map[h]``."""
        b, hkv = carry["counts"].shape
        hm = layer.data.get("head_map")
        hm = jnp.arange(hkv, dtype=jnp.int32) if hm is None else jnp.asarray(hm, jnp.int32)
        idx = jnp.take(carry["indices"], hm, axis=1)
        cnt = jnp.take(carry["counts"], hm, axis=1)
        sel = self._selector()
        if sel is None:
            return Selection.tokens(idx, cnt), state, carry
        pre = None if "prefetch" not in carry else jnp.take(carry["prefetch"], hm, axis=1)
        lagged = pre is not None
        if lagged:
            # the first decode step: the anchor chose its blocks during prefill, which has no carry,
            # so this layer's pool holds its own lagged choice: select with it once (exactly what
            # the resident run does too, so offloaded == resident)
            own, inner, _ = sel.select(q, kv, lengths, state["inner"], None, layer)
            o_idx, o_cnt = own.token_view(lengths)
            kk = idx.shape[-1]
            o_idx = o_idx[..., :kk] if o_idx.shape[-1] >= kk else jnp.pad(o_idx, ((0, 0), (0, 0), (0, kk - o_idx.shape[-1])))
            first = state["first"][:, None]
            idx = jnp.where(first[..., None], o_idx, idx)
            cnt = jnp.where(first, jnp.minimum(o_cnt, kk), cnt)
            state = dict(state, inner=inner, first=jnp.zeros_like(state["first"]))
        bs = (sel.offload_block_size or 1) if lagged else 1
        out = Selection.tokens(idx.astype(jnp.int32), cnt.astype(jnp.int32), prefetch=pre, block_size=bs,
                               within_prefetch=lagged)
        return out, state, carry

    def select(self, q, kv, lengths, state, carry, layer):
        role = layer.data["role"]
        if _is_static(role):
            role = int(role)
            if role == DENSE_ANCHOR:
                idx, cnt = self.exact_topk(q, kv, lengths)
                return Selection.all_tokens(), state, {"indices": idx, "counts": cnt}
            if role == ANCHOR:
                return self._anchor(q, kv, lengths, state, layer)
            return self._reuse(q, kv, lengths, state, carry, layer)
        if not self.composed and self.dense_first_anchor:
            # NotImplementedError: what the fidelity probe expects of a method with no selection
            raise NotImplementedError("kascade.select with a traced layer role cannot return the dense anchor's "
                                      "'all' selection: call decode (the driver does), or unroll the layers")
        # traced role (a scanned segment): both branches, one result (same structure)
        a = self._anchor(q, kv, lengths, state, layer)
        r = self._reuse(q, kv, lengths, state, carry, layer)
        return jax.tree.map(lambda x, y: jnp.where(role == ANCHOR, x, y), a, r)

    def decode(self, q, kv, lengths, state, carry, layer):
        role = layer.data["role"]
        if _is_static(role) or self.composed or not self.dense_first_anchor:
            return super().decode(q, kv, lengths, state, carry, layer)
        # a scanned segment with the dense anchor in it: switch on the role at run time

        def dense(_):
            idx, cnt = self.exact_topk(q, kv, lengths)
            return kv.attend(q, lengths, Selection.all_tokens(), impl=self.impl), {"indices": idx, "counts": cnt}

        def anchor(_):
            sel, _, c = self._anchor(q, kv, lengths, state, layer)
            return kv.attend(q, lengths, sel, impl=self.impl), c

        def reuse(_):
            sel, _, c = self._reuse(q, kv, lengths, state, carry, layer)
            return kv.attend(q, lengths, sel, impl=self.impl), c

        out, carry = jax.lax.switch(role, (dense, anchor, reuse), None)
        return out, state, carry

    # -- offloading: through the composed selector -----------------------------------------
    def for_offload(self):
        sel = self._selector()
        if sel is None:
            return self
        return dataclasses.replace(self, selector=sel.for_offload())

    @property
    def offload_block_size(self):
        sel = self._selector()
        return None if sel is None else sel.offload_block_size

    def offload_blocks_per_step(self, max_len):
        return self._selector().offload_blocks_per_step(max_len)

    def check_offload(self, max_len):
        sel = self._selector()
        if sel is not None and not getattr(sel, "lag", False):
            raise ValueError(f"offloaded kascade: the anchor selector {sel.name!r} must select one step ahead "
                             f"(a lagged selection's prefetch is what the reuse layers' pools follow)")
        sel.check_offload(max_len)

    def first_prefetch(self, state):
        sel = self._selector()
        return None if sel is None else sel.first_prefetch(state["inner"])
