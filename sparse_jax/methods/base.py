"""The attention-method interface: how the layer driver calls attention.

The model never calls attention directly: the layer driver
(:mod:`models.driver`) calls a method's pure functions for every layer on
which the method runs (``LayerSpec.sparse``: a global layer its dense-layer
rule does not keep exact); other layers run exact attention. A method is one
frozen dataclass (hyperparameters with the papers' defaults) in one module
and a registry entry, never a model edit.

Selection is data: ``select`` returns a :class:`sparse_jax.selection.Selection`
(token ids, or block ids, and counts, plus an optional ``prefetch`` of the
blocks the next step needs), and one generic attention
(:func:`sparse_jax.selection.attend`) runs it. Whoever needs the selection in
between (the offloaded cache, Kascade's reuse layers, composition) reads the
``Selection``; a method that wants to fuse selection and attention overrides
``decode`` behind the same interface.

Shapes: ``B`` batch, ``T`` new tokens, ``S`` cache capacity, ``Hq`` query
heads, ``Hkv`` KV heads (GQA: query head ``i`` reads KV head ``i // (Hq // Hkv)``),
``D`` head dim. Keys in the cache are post-RoPE.

``layer`` (a :class:`LayerCtx`) tells a hook which layer it runs: ``layer.spec``
(static :class:`sparse_jax.layers.LayerSpec`) and ``layer.data``, the layer's
row of the per-layer constants the method declared in ``layer_data`` (traced:
the driver stacks them and scans over them), with ``layer.data["index"]`` the
layer's index in the model.

The hooks, in four groups; each has a default in :class:`AttentionMethod` (in
brackets), so a method overrides only what it changes: a decode-only method is a
``select`` and its fields (the example below).

==========================  ===================================================
hook [default]              called
==========================  ===================================================
*binding* (once, before anything compiles)
``with_model_defaults``     first, by ``load_model``: the model's shipped defaults
[self]                      for options left unset (before the layer plan)
``for_model`` [self]        by ``load_model``: a copy holding per-model data
                            (calibrated channels, anchors), or a clear error
``check`` [nothing]         ValueError if the method cannot run the model's shape
``is_sparse_layer``         which global layers it runs on [all but
                            ``dense_layers``]; ``cache_multiple`` [1]: the cache
                            capacity must be a multiple of it (block methods)
``layer_data`` [None]       per-layer constants (NumPy arrays of the same shapes
                            on every layer: Double Sparsity's channels)
*decode* (every step)
``init_state`` [None]       once per layer by ``init_cache``: the method's
                            per-layer state (a pytree, batch leading)
``init_carry`` [None]       once per step: the pytree that crosses layers
                            (Kascade: the last anchor's selection)
``append_state`` [same]     after the new token was written at ``positions
                            int32[B]``: ``kv``, a view of the layer's KV
                            (:mod:`sparse_jax.kv`: ``kv.newest_keys(positions)``,
                            ``kv.block_keys(blocks, bs)``)
``select`` [required]       ``q [B,Hq,D]`` against the view ``kv`` whose first
                            ``lengths`` tokens are valid (the new one included),
                            the state and the carry -> ``(Selection, state,
                            carry)``
``decode`` [select+attend]  -> ``(out [B,Hq,D], state, carry)``; override only to
                            fuse selection and attention
*prefill* (once per prompt)
``prefill_attention``       ``q [B,T,Hq,D]``, ``k, v [B,T,Hkv,D]`` (the new
  [dense, causal]           tokens, cache empty before) -> ``[B,T,Hq,D]``
``init_prefill_carry``      the pytree that crosses layers during the prompt
  [None]                    (Kascade's tiled prefill: the last anchor's per-tile
                            selection)
``prefill_attention_carry`` ``prefill_attention`` with that carry -> ``(out,
  [carry unchanged]         carry)``
``prefill_carry``           the carry after a layer whose prompt attention another
  [unchanged]               path ran (Token Sparse Attention on that layer);
                            Kascade's anchors still select there
``prefill_state`` [same]    after the prefill wrote K/V: state from the whole
                            layer cache ``k, v [B,Hkv,S,D]`` and ``lengths
                            int32[B]``
``prefill_query_state``     after ``prefill_state``: the query of each row's last
  [same]                    prompt token ``q [B,Hq,D]`` (a method whose selection
                            lags one step picks the first decode step's blocks)
*offload* (an offloaded cache: :mod:`sparse_jax.offload`)
``offload_block_size``      tokens per block of the host tier, or None [None:
                            the method cannot run offloaded]
``for_offload`` [self]      the variant an offloaded cache runs (AsyncTLS:
                            ``lag=True``, so its selection carries a ``prefetch``)
``offload_blocks_per_step`` the most blocks one step reads outside the ring: the
                            smallest pool [required when offloadable]
``check_offload`` [nothing] ValueError when this configuration cannot run offloaded
``first_prefetch`` [None]   after prefill: the blocks the first decode step reads,
                            ``int32[B,Hkv,m]``, primed into the pool
==========================  ===================================================

Class attributes say what the method needs from a runner: ``reads_all_keys`` (its
``select`` reads the whole key cache ``kv.k``: no offload), ``crosses_kv_heads`` (a
layer reads another KV head's data: no split over KV heads) and ``shardable``.
Token Sparse Attention's prefill is chosen per method by ``prefill`` and
``prefill_options`` (:meth:`AttentionMethod.sparse_prefill`).

The view is what lets one method run resident and offloaded unchanged: a
resident layer's view holds ``k, v [B,Hkv,S,D]``, an offloaded layer's a
pool of blocks (``sparse_jax.offload.pool.PooledKV``); ``kv.attend(q,
lengths, selection)`` runs the attention wherever the KV is.

Everything runs inside the model's ``jax.jit``; a method's dataclass fields
are static (hashable, frozen), its state and carry are traced.

Example: a method that attends to the last ``window`` tokens only::

    @register("last_window")
    @dataclasses.dataclass(frozen=True)
    class LastWindow(AttentionMethod):
        window: int = 256

        def select(self, q, kv, lengths, state, carry, layer):
            b, hkv = q.shape[0], kv.num_kv_heads
            idx = lengths[:, None, None] - self.window + jnp.arange(self.window)
            counts = jnp.minimum(lengths, self.window)
            idx = jnp.where(lengths[:, None, None] > self.window, idx, jnp.arange(self.window))
            return (Selection.tokens(jnp.broadcast_to(idx, (b, hkv, self.window)).astype(jnp.int32),
                                     jnp.broadcast_to(counts[:, None], (b, hkv))), state, carry)

    model = models.load_model("smollm2-135m", attention="last_window")
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from sparse_jax.layers import LayerSpec
from sparse_jax.ops.dense import dense_prefill_attention
from sparse_jax.prefill import make_prefill
from sparse_jax.selection import Selection, attend  # noqa: F401  (re-exported: the methods' vocabulary)


@dataclasses.dataclass(frozen=True)
class LayerCtx:
    """Which layer a hook runs: its static ``spec`` and its traced per-layer ``data``
    (the method's ``layer_data`` row, plus ``"index"``: the layer's index, int32);
    in the prefill hooks, ``capacity``: the tokens the layer's cache holds (static;
    :func:`models.driver.prompt_state` sets it, None elsewhere)."""

    spec: LayerSpec
    data: dict
    capacity: int | None = None

    @property
    def index(self) -> jax.Array:
        return self.data["index"]


def single_layer(index: int = 0, spec: LayerSpec | None = None, data: dict | None = None,
                 capacity: int | None = None) -> LayerCtx:
    """A :class:`LayerCtx` for calling a method's hooks outside the driver (tests,
    analysis): ``data`` defaults to the method-independent ``{"index": index}``."""
    d = {"index": jnp.int32(index)}
    d.update(data or {})
    return LayerCtx(spec or LayerSpec(sparse=True), d, capacity)


@dataclasses.dataclass(frozen=True)
class AttentionMethod:
    """Base class: dense prefill, no state, no carry. Subclasses override what they change.

    Attributes:
      dense_layers: indices among the model's *global* layers that always use
        exact attention (negative indices count from the end).
    """

    name: ClassVar[str] = "base"
    #: whether ``select`` reads the whole key cache (``kv.k``: an exact-score method):
    #: such a method cannot run on an offloaded cache
    reads_all_keys: ClassVar[bool] = False
    #: whether a layer reads another KV head's data (Kascade's head map): such a method
    #: cannot split over KV heads across devices (``models.runtime.sharding``)
    crosses_kv_heads: ClassVar[bool] = False
    #: whether the method may run on several devices (``models.runtime.sharding``); False where
    #: that is known not to work yet (the reason in the subclass)
    shardable: ClassVar[bool] = True
    dense_layers: tuple[int, ...] = ()
    #: the prefill on the layers it names (every method, dense included): "dense", or
    #: "token_sparse" (Token Sparse Attention, :mod:`sparse_jax.prefill`) with its options
    #: as ``prefill_options`` pairs (``--attention-opt prefill.tau=0.01``)
    prefill: str = "dense"
    prefill_options: tuple = ()

    # -- binding (once, before anything compiles) --------------------------------
    def with_model_defaults(self, model_name: str) -> "AttentionMethod":
        """Called first by ``load_model``, before the model's layer plan: a copy with the
        model's shipped defaults for options left unset (AsyncSpade's measured selector and
        dense layers, which decide the plan's sparse layers); most methods have none."""
        return self

    def for_model(self, model_name: str, *, num_layers: int, head_dim: int,
                  sparse_layers: tuple[int, ...] | None = None) -> "AttentionMethod":
        """Called once by ``load_model``: a method that needs per-model data
        (calibrated channels) returns a copy holding it, or raises a clear error.
        ``sparse_layers``: the model layers the method runs on, from the model's layer
        plan (layer kinds and the dense-layer rule applied; on a hybrid model only
        global layers), when the caller has the plan; None: derive from
        ``dense_layers`` over ``num_layers``."""
        return self

    def sparse_prefill(self):
        """The :class:`sparse_jax.prefill.TokenSparsePrefill` of ``prefill`` (None: dense);
        a bad name or option raises ValueError (before anything compiles)."""
        return make_prefill(self.prefill, self.prefill_options)

    def is_sparse_prefill_layer(self, index: int, num_layers: int) -> bool:
        """Whether the sparse prefill runs on model layer ``index`` (global layers only)."""
        tsa = self.sparse_prefill()
        return tsa is not None and index in tsa.layers_for(num_layers)

    def is_sparse_layer(self, index: int, num_layers: int) -> bool:
        """Whether the method runs on the ``index``-th of ``num_layers`` global layers."""
        return index not in {i % num_layers for i in self.dense_layers}

    @property
    def cache_multiple(self) -> int:
        """The KV cache capacity must be a multiple of this (block methods: the block size)."""
        return 1

    def check(self, *, num_q_heads: int, num_kv_heads: int, head_dim: int, max_len: int) -> None:
        """Raise ValueError, before any compilation, if this method cannot run the model."""

    def layer_data(self, index: int) -> dict[str, np.ndarray] | None:
        """Constants of model layer ``index`` (the same shapes on every layer), or None."""
        return None

    # -- decode (every step) -------------------------------------------------------
    def init_state(self, spec: LayerSpec, *, batch: int, num_kv_heads: int, max_len: int, head_dim: int,
                   dtype, num_q_heads: int | None = None) -> Any:
        """The layer's empty state; every leaf has the batch as its leading axis.
        ``num_q_heads``: the model's query heads (None where a caller does not know them:
        a method that needs them sizes those leaves in ``prefill_query_state``)."""
        return None

    def init_carry(self, *, batch: int, num_kv_heads: int, max_len: int) -> Any:
        return None

    def append_state(self, state: Any, kv, positions: jax.Array, layer: LayerCtx) -> Any:
        return state

    def select(self, q: jax.Array, kv, lengths: jax.Array, state: Any, carry: Any,
               layer: LayerCtx) -> tuple[Selection, Any, Any]:
        raise NotImplementedError

    def decode(self, q: jax.Array, kv, lengths: jax.Array, state: Any, carry: Any,
               layer: LayerCtx) -> tuple[jax.Array, Any, Any]:
        sel, state, carry = self.select(q, kv, lengths, state, carry, layer)
        return kv.attend(q, lengths, sel, impl=getattr(self, "impl", "auto")), state, carry

    # -- a warm-up after the prompt (AsyncSpade's θ_t) ------------------------------
    @property
    def warmup_steps(self) -> int:
        """Decode steps after a row's prompt that run differently from the steady state
        (AsyncSpade's ``dense_steps``: they attend every key); 0: none. A caller that
        knows no row of a batch is within its first ``warmup_steps`` decode steps may run
        :meth:`steady_state`'s program instead: the same logits and state for every such
        row, without the warm-up's work (:attr:`models.programs.ModelFunctions.steady_decode_step`)."""
        return 0

    def steady_state(self) -> "AttentionMethod":
        """This method past its warm-up: the same cache and state, and the same decode
        for a row past its first :attr:`warmup_steps` steps. Default: itself."""
        return self

    # -- prefill (once per prompt) ------------------------------------------------
    def prefill_attention(self, q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array,
                          layer: LayerCtx) -> jax.Array:
        return dense_prefill_attention(q, k, v)

    def init_prefill_carry(self, *, batch: int, num_kv_heads: int, length: int) -> Any:
        """The carry that crosses layers during a prefill of ``length`` (padded) tokens."""
        return None

    def prefill_attention_carry(self, q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array,
                                layer: LayerCtx, carry: Any) -> tuple[jax.Array, Any]:
        return self.prefill_attention(q, k, v, lengths, layer), carry

    def prefill_carry(self, q: jax.Array, k: jax.Array, lengths: jax.Array, layer: LayerCtx, carry: Any) -> Any:
        """The prefill carry after a layer whose prompt attention did not run through this
        method (the layer's spec chose Token Sparse Attention): what the layer adds to
        the carry from its ``q [B,T,Hq,D]`` and ``k [B,T,Hkv,D]`` alone. Default: unchanged."""
        return carry

    def prefill_state(self, state: Any, k: jax.Array, v: jax.Array, lengths: jax.Array, layer: LayerCtx) -> Any:
        return state

    def prefill_query_state(self, state: Any, q_last: jax.Array, lengths: jax.Array, layer: LayerCtx) -> Any:
        return state

    # -- offloading ---------------------------------------------------------------
    def for_offload(self) -> "AttentionMethod":
        """The variant of this method an offloaded cache runs (AsyncTLS: ``lag=True``,
        so its selection carries the next step's blocks as ``prefetch``)."""
        return self

    @property
    def offload_block_size(self) -> int | None:
        """Tokens per block of the offloaded tiers (the granularity of ``select``'s
        blocks and ``prefetch``), or None when the method cannot run offloaded."""
        return None

    def offload_blocks_per_step(self, max_len: int) -> int:
        """The most blocks one step's selection (or its prefetch) reads outside the
        ring of the two newest blocks: the smallest pool that can hold them."""
        raise NotImplementedError

    def check_offload(self, max_len: int) -> None:
        """Raise ValueError when this configuration cannot run offloaded (beyond the
        generic checks of :func:`sparse_jax.offload.pool.check_offload`)."""

    def first_prefetch(self, state: Any) -> jax.Array | None:
        """After prefill: the blocks the first decode step reads, ``int32[B,Hkv,m]``
        (primed into the pool), or None (that step fetches what it selects)."""
        return None


@dataclasses.dataclass(frozen=True)
class DenseAttention(AttentionMethod):
    """Exact attention: cuDNN flash attention in prefill on GPU, exact decode."""

    name: ClassVar[str] = "dense"

    def is_sparse_layer(self, index, num_layers):
        return False

    def select(self, q, kv, lengths, state, carry, layer):
        return Selection.all_tokens(), state, carry
