"""``asyncspade`` (AsyncSpade): the next step's selection from a *predicted* query,
computed one step ahead, so selection leaves the attention's critical path.

At decode step ``t`` of a layer:

1. attend the selection chosen during step ``t - 1`` (from the predicted
   ``q̂_t``; after prefill, from the last prompt query), plus the new token;
2. push ``q_t`` into the layer's query history and predict ``q̂_{t+1}``
   (:func:`predict_next_query`);
3. run the wrapped ``selector`` (``quest``, ``double_sparsity``,
   ``asynctls``, ...) on ``q̂_{t+1}`` and keep its selection for step
   ``t + 1``; its blocks are the ``Selection``'s ``prefetch``.

Step 3 does not depend on step 1 (nor on anything after it in the layer), so
XLA may run it beside the attention and the MLP; offloaded, the prefetch
copies the next step's blocks during this step (AsyncTLS's lag with a better
query). The state is a plain pytree (history, the selector's state, the next
selection): moving the selection to another device (the paper's "cache
rank") moves that pytree, not the code.

**The predictor, resolved** (the paper's Eq. 2-5 and App. C disagree; none has
public code):

* *closed form*: for each window size ``k = 1..W``, ridge regression of
  ``Q_t`` on ``Q_{t-k..t-1}``: ``w = (X Xᵀ + ε I)⁻¹ X q_t`` (``X [k, D]``; the
  unconstrained solution, as App. C's Alg. 1 computes; Eq. 2's
  softmax-in-the-objective has no closed form), then Eq. 3's softmax over
  ``w`` (Alg. 1's minus sign in ``softmax(-G⁻¹b)`` is not followed: it
  contradicts Eq. 2), applied to the **shifted** window ``Q_{t-k+1..t}`` (Eq.
  4; Alg. 1's unshifted window contradicts it); the ``W`` candidates are
  averaged (Eq. 5, "assembled regression"). With ``W = 1`` the single weight
  is 1 and ``q̂_{t+1} = q_t``: AsyncTLS's one-step lag, exactly.
* *window*: ``window=16`` (the only W in the paper).
* *regulariser*: ``ridge=1e-2`` times the mean squared norm of the history's
  queries (``ε`` scale-free, so one value serves every layer and model).
* *pre/post-RoPE*: post-RoPE queries (selection scores against the cache's
  post-RoPE keys and metadata).
* *group reduction*: one prediction per query head (Alg. 1 works per
  batch x query head); the selector reduces over the GQA group as it always
  does (Quest sums its bound over the group, DS averages label softmaxes).
* *computation*: window ``k``'s Gram matrix is a block of one ``W x W``
  matrix, and a Cholesky factor's blocks factor its blocks, so one
  factorization and one triangular inverse give every window's weights
  (``pallas_kernels.query_predictor``: one Pallas launch per layer on the GPU,
  ``impl="auto"``; the ``W - 1`` batched LU solves it replaces stay the
  reference).
* *start step* (the paper's θ_t, Sec. 4.1: "once the generation length exceeds a
  predefined threshold ... the model transitions to sparse decoding mode"; no value
  given): ``dense_steps`` decode steps after the prompt attend every key, while the
  history fills, so the first prediction regresses on a full window of ``W + 1`` known
  queries. The default (``None``) is ``window`` (16): on issue 51's harness (SmolLM2, budget
  2048, H200) it gives 63.1 against dense's 63.9 at 4K and 51.1 against 54.4 at 8K, where
  sparse from the first step (``dense_steps=0``; until ``W + 1`` queries are known the
  candidates use the window sizes the history supports) gives 59.3 and 24.2
  (``accuracy_smollm2_h200_theta_{4096,8192}.md``). The warm-up is a program of its own: its per-layer ``lax.cond``
  cost 1.2 ms a step even past the warm-up (8.15 against 6.93 ms at 32K, B=4, Qwen3-8B
  shape, H200: ``git show f54dc57:benchmarks/results/asyncspade_e2e_32k_b4_h200.md``), so a step in which no row warms up
  runs :meth:`steady_state`'s program, which has none
  (:meth:`models.programs.ModelFunctions.decode_at`; the engines:
  :class:`models.serving.slots.WarmupSteps`). Resident only: the offloaded tier
  (``for_offload``) and the cache rank hold no whole cache on the attending device
  (``dense_steps > 0`` there is an error; the default resolves to 0 there: :meth:`without_dense_steps`).

**Token-level selection** (the paper's, Sec. 4.2 and Alg. 1 step 7: ``q̂ Kᵀ`` over the
whole cache, then top-k): ``selector="oracle_topk"``, the exact softmax of ``q̂`` summed
over the GQA group (Kascade's post-softmax pooling; the paper leaves the group reduction
open), top ``budget - 1`` tokens. It reads every key (``reads_all_keys``): resident only,
neither offloaded nor on the cache rank (:mod:`models.runtime.cache_rank`, whose rank
holds no keys).

**Per-model defaults** (:meth:`AsyncSpade.with_model_defaults`, before the model's layer
plan): ``selector`` and ``dense_layers`` left unset take the model's shipped
``calibration_data/<model>/asyncspade.json``, the choice that measured best on issue 51's
harness. SmolLM2-135M ships ``selector="asynctls"`` (AsyncTLS's token selection through its
label filter: it keeps the needle on layers 18-19 where Quest's bound does not) and
``dense_layers=(0, 1, 7)`` (the predicted query misses the needle on layer 7, where the
reading query is not among the recent ones): 63.7 and 54.4 against dense's 63.9 and 54.5 at
4K and 8K, where Quest gives 63.0 and 51.1 (``accuracy_smollm2_issue51_anchors_*.md``). A
model without the file gets ``quest`` (16-token blocks; it needs no calibration) and the
selectors' ``(0, 1)``.

**Budget.** ``budget`` is the selector's budget; a token selector chooses
``budget - 1`` tokens at step ``t`` and the new token of step ``t + 1`` is
added (it did not exist yet), so ``budget`` tokens are attended. A block
selector (Quest) runs with the next step's length, whose newest block it
always attends.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from sparse_jax.calibration import CALIBRATION_ROOT
from sparse_jax.methods.base import AttentionMethod
from sparse_jax.methods.registry import get_method, register
from sparse_jax.methods.sparse_base import BlockSparseMethod
from sparse_jax.ops._dispatch import IMPLS
from sparse_jax.ops.prediction import predict_query
from sparse_jax.selection import Selection


def ridge_weights(x: jax.Array, y: jax.Array, eps: jax.Array) -> jax.Array:
    """Closed-form ridge regression ``argmin_w |wᵀx - y|² + eps |w|²``:
    ``w = (x xᵀ + eps I)⁻¹ x y``. ``x [..., k, D]``, ``y [..., D]``, ``eps [...]`` -> ``[..., k]`` f32."""
    x = x.astype(jnp.float32)
    g = jnp.einsum("...id,...jd->...ij", x, x) + eps[..., None, None] * jnp.eye(x.shape[-2], dtype=jnp.float32)
    b = jnp.einsum("...id,...d->...i", x, y.astype(jnp.float32))
    return jnp.linalg.solve(g, b[..., None])[..., 0]


def predict_next_query(hist: jax.Array, count: jax.Array, window: int, ridge: float, *,
                       impl: str = "reference", reference: str = "lu") -> jax.Array:
    """``q̂_{t+1}`` from the history ``hist [B, Hq, W+1, D]`` (oldest first, the newest
    ``q_t`` last; the first ``W+1-count`` entries are not real) -> ``[B, Hq, D]`` f32.

    Candidates ``k = 1..W``: regress ``Q_t`` on ``Q_{t-k..t-1}``, softmax the
    weights, apply them to ``Q_{t-k+1..t}``; candidates needing more than the
    ``count - 1`` past queries are left out of the average.

    :func:`sparse_jax.ops.prediction.predict_query`: by default the reference
    (``W - 1`` batched LU solves, :func:`pallas_kernels.query_predictor.predict_lu_reference`);
    ``impl="auto"`` runs the one-launch Cholesky kernel on the GPU (AsyncSpade's
    ``impl``), ``reference="cholesky"`` the one-factorization jnp form."""
    return predict_query(hist, count, window=window, ridge=ridge, impl=impl, reference=reference)


DEFAULTS_FILE = "asyncspade.json"
#: without a model's shipped defaults: Quest (needs no calibration) and the selectors' dense layers
FALLBACK_SELECTOR = "quest"
FALLBACK_DENSE_LAYERS = (0, 1)


@functools.cache
def load_model_defaults(model_name: str, root: str | None = None) -> dict | None:
    """``CALIBRATION_ROOT/<model>/asyncspade.json``: ``{"selector": ..., "dense_layers": [...],
    and how they were measured}``, or None when the model ships none."""
    path = Path(root or CALIBRATION_ROOT) / model_name / DEFAULTS_FILE
    return json.loads(path.read_text()) if path.exists() else None


@dataclasses.dataclass(frozen=True)
class _Capacity:
    """The one thing a selector's ``select`` reads of the view at prefill time."""

    capacity: int


@register("asyncspade")
@dataclasses.dataclass(frozen=True)
class AsyncSpade(AttentionMethod):
    """One-step-ahead selection from a ridge-predicted query (module docstring).

    Attributes:
      selector: the registered method that selects from the predicted query; None
        (default): the model's shipped choice (:meth:`with_model_defaults`), else ``quest``.
      selector_options: ``((field, value), ...)`` for it (or dotted keys
        ``selector.block_size=16`` through ``get_method``); given, they keep the
        selector ``quest`` unless ``selector`` names another (they are that selector's fields).
      budget: the selector's budget (tokens per KV head, the new token included).
      window: W, past queries the predictor regresses on (1: AsyncTLS's lag).
      ridge: ``ε`` relative to the newest query's squared norm.
      dense_layers: global layers kept exact; None (default): the model's shipped list
        (:meth:`with_model_defaults`), else the selectors' convention (0, 1).
      dense_steps: θ_t, decode steps after the prompt that attend every key (the
        predictor's window fills meanwhile); ``None`` (default): ``window`` where the whole
        cache is on the attending device, 0 where it is not (offloaded, the cache rank);
        0: sparse from the first step. At most ``window`` (the step count is the history's).
      impl: the query predictor's implementation (``auto``: the kernel on the GPU).
      prefetch_block_size: blocks of the offloaded tier under a token selector.
      calibration_root: where the per-model defaults live (default ``CALIBRATION_ROOT``).
    """


    selector: str | None = None
    selector_options: tuple = ()
    budget: int = 1024
    window: int = 16
    ridge: float = 1e-2
    dense_layers: tuple[int, ...] | None = None
    dense_steps: int | None = None
    impl: str = "auto"
    #: the program of rows past their warm-up (:meth:`steady_state`; not a user option): no
    #: dense steps, and no first-step choice of a token selector
    steady: bool = False
    #: block size of the offloaded tier (and of the prefetch) under a token selector
    prefetch_block_size: int = 16
    calibration_root: str | None = None
    #: the selector bound to the model (``for_model``)
    bound: Any = dataclasses.field(default=None, repr=False)

    # -- per-model defaults (before the layer plan: dense_layers decides which layers are sparse)
    def with_model_defaults(self, model_name: str) -> "AsyncSpade":
        """A copy with ``selector`` and ``dense_layers``, where left unset (None), from the
        model's shipped ``asyncspade.json`` (the measured best: module docstring); a
        ``selector_options`` given keeps the selector unset (they name its fields)."""
        found = load_model_defaults(model_name, self.calibration_root)
        if not found or self.bound is not None:
            return self
        changes = {}
        if self.selector is None and not self.selector_options and "selector" in found:
            changes["selector"] = str(found["selector"])
        if self.dense_layers is None and "dense_layers" in found:
            changes["dense_layers"] = tuple(int(i) for i in found["dense_layers"])
        return dataclasses.replace(self, **changes) if changes else self

    @property
    def selector_name(self) -> str:
        """``selector``, resolved (``quest`` where unset)."""
        return self.selector or FALLBACK_SELECTOR

    @property
    def exact_layers(self) -> tuple[int, ...]:
        """``dense_layers``, resolved (the selectors' ``(0, 1)`` where unset)."""
        return FALLBACK_DENSE_LAYERS if self.dense_layers is None else tuple(self.dense_layers)

    def is_sparse_layer(self, index, num_layers):
        return index not in {i % num_layers for i in self.exact_layers}

    # -- the wrapped selector -------------------------------------------------------
    def inner(self) -> AttentionMethod:
        if self.bound is not None:
            return self.bound
        opts = dict(self.selector_options)
        blocks = issubclass(type(get_method(self.selector_name, **opts)), BlockSparseMethod)
        opts.setdefault("budget", self.budget if blocks else self.budget - 1)
        opts.setdefault("dense_layers", self.exact_layers)
        return get_method(self.selector_name, **opts)

    @property
    def blocks(self) -> bool:
        return isinstance(self.inner(), BlockSparseMethod)

    @property
    def reads_all_keys(self) -> bool:  # type: ignore[override]
        # a token top-k of the predicted query's exact scores (selector="oracle_topk") reads
        # every key: resident only
        return self.inner().reads_all_keys

    def for_model(self, model_name, *, num_layers, head_dim, sparse_layers=None):
        return dataclasses.replace(self, bound=self.inner().for_model(model_name, num_layers=num_layers,
                                                                       head_dim=head_dim, sparse_layers=sparse_layers))

    def check(self, *, num_q_heads, num_kv_heads, head_dim, max_len):
        if self.steady:  # steady_state()'s program is built from the checked method, never from options
            raise ValueError("asyncspade: steady is the program past the warm-up (steady_state()), not an option: "
                             "it would skip the dense steps and the first step's choice")
        if self.window < 1:
            raise ValueError(f"asyncspade: window must be >= 1, got {self.window}")
        if self.ridge <= 0:
            raise ValueError(f"asyncspade: ridge must be > 0, got {self.ridge}")
        if self.impl not in IMPLS:
            raise ValueError(f"asyncspade: impl must be one of {IMPLS}, got {self.impl!r}")
        if self.budget < 2:
            raise ValueError(f"asyncspade: budget must be >= 2, got {self.budget}")
        if self.dense_steps is not None and (isinstance(self.dense_steps, bool) or not isinstance(self.dense_steps, int)
                                             or not 0 <= self.dense_steps <= self.window):
            raise ValueError(f"asyncspade: dense_steps must be None (the window) or an int in [0, window={self.window}] "
                             f"(the steps are counted by the query history), got {self.dense_steps!r}")
        inner = self.inner()
        if getattr(inner, "lag", False):
            raise ValueError("asyncspade: the selector must not lag itself (asyncspade selects one step ahead)")
        if inner.reads_all_keys and inner.name != "oracle_topk":
            raise ValueError(f"asyncspade: selector {inner.name!r} reads every key; pick quest, double_sparsity, "
                             f"asynctls, or oracle_topk (the paper's token top-k of the predicted query)")
        inner.check(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, max_len=max_len)

    @property
    def cache_multiple(self) -> int:
        return self.inner().cache_multiple

    def layer_data(self, index):
        return self.inner().layer_data(index)

    # -- state ------------------------------------------------------------------------
    def init_state(self, spec, *, batch, num_kv_heads, max_len, head_dim, dtype, num_q_heads=None):
        inner = self.inner()
        st = inner.init_state(spec, batch=batch, num_kv_heads=num_kv_heads, max_len=max_len, head_dim=head_dim,
                              dtype=dtype, num_q_heads=num_q_heads)
        k = self._next_width(max_len)
        # the query history [B, Hq, W+1, D]: allocated here when the caller gives the query
        # heads (the model's cache does), so every leaf exists before a prefill (the
        # serving engine's slots, sharded layouts); else prefill_query_state sizes it
        hist = None
        if num_q_heads is not None:
            hist = jnp.zeros((batch, num_q_heads, self.window + 1, head_dim), jnp.float32)
        return {"inner": st, "hist": hist, "count": jnp.zeros((batch,), jnp.int32),
                "next": jnp.zeros((batch, num_kv_heads, k), jnp.int32),
                "next_counts": jnp.zeros((batch, num_kv_heads), jnp.int32)}

    def _next_width(self, max_len):
        inner = self.inner()
        if self.blocks:
            return min(inner.num_blocks, max_len // inner.block_size)
        return min(inner.budget, max_len)

    def prefill_state(self, state, k, v, lengths, layer):
        return dict(state, inner=self.inner().prefill_state(state["inner"], k, v, lengths, layer))

    def prefill_query_state(self, state, q_last, lengths, layer):
        b, hq, d = q_last.shape
        # by concatenation: `.at[:, :, -1].set` here segfaulted XLA:CPU inside a multi-device shard_map
        hist = jnp.concatenate([jnp.zeros((b, hq, self.window, d), jnp.float32),
                                q_last.astype(jnp.float32)[:, :, None]], axis=2)
        inner = self.inner().prefill_query_state(state["inner"], q_last, lengths, layer)
        # the first decode step (length lengths + 1) attends what the last prompt query picks
        if layer.capacity is None:
            raise ValueError("asyncspade.prefill_query_state needs the layer's cache capacity (LayerCtx.capacity; "
                             "models.driver.prompt_state sets it)")
        if self.reads_all_keys:
            # a token top-k over the keys (oracle_topk): this hook has no keys, so the first decode
            # step makes this choice itself, from the same query and keys (``select``)
            nxt, cnt = state["next"], jnp.zeros_like(state["next_counts"])
        else:
            nxt, cnt = self._choose(q_last, lengths, inner, layer, _Capacity(layer.capacity))
        return dict(state, inner=inner, hist=hist, count=jnp.ones((b,), jnp.int32), next=nxt, next_counts=cnt)

    def append_state(self, state, kv, positions, layer):
        return dict(state, inner=self.inner().append_state(state["inner"], kv, positions, layer))

    # -- selection ----------------------------------------------------------------------
    def _choose(self, q_hat, lengths, inner_state, layer, kv=None):
        """The selector's choice for the step after the one of length ``lengths``:
        ``(ids [B,Hkv,K], counts [B,Hkv])``: block ids for a block selector (run with
        that step's length), token positions ``< lengths`` for a token selector."""
        inner = self.inner()
        q_hat = q_hat.astype(jnp.float32)
        if self.blocks:
            return inner.select_blocks(q_hat, lengths + 1, inner_state)
        sel, _, _ = inner.select(q_hat, kv, lengths, inner_state, None, layer)
        return sel.token_view(lengths)

    def advance(self, q, kv, lengths, state, layer):
        """Steps 2 and 3 of the module docstring: push ``q [B,Hq,D]`` into the history,
        predict ``q̂_{t+1}`` and choose the next step's selection from it; ``state``
        needs ``hist``, ``count`` and ``inner`` (the selector's state, the new key
        appended). Reads nothing of ``kv`` but its ``capacity`` (and what the selector's
        ``select`` reads: every key for ``oracle_topk``, the newest only for the others), so
        with those it can run apart from the attention: on a second device
        (:mod:`models.runtime.cache_rank`)."""
        hist = jnp.concatenate([state["hist"][:, :, 1:], q.astype(jnp.float32)[:, :, None]], axis=2)
        count = jnp.minimum(state["count"] + 1, self.window + 1)
        q_hat = predict_next_query(hist, count, self.window, self.ridge, impl=self.impl)
        nxt, nxt_counts = self._choose(q_hat, lengths, state["inner"], layer, kv)
        return dict(state, hist=hist, count=count, next=nxt, next_counts=nxt_counts)

    def _first_step_choice(self, kv, lengths, state, layer, cur, cur_counts):
        """Rows at their first decode step (``count == 1``: only the last prompt query is
        known) under a selector that reads the keys: the choice ``prefill_query_state`` could
        not make, from that query over the prompt's keys (positions ``< lengths - 1``),
        exactly what it would have chosen."""
        first = state["count"] == 1

        def choose(_):
            nxt, cnt = self._choose(state["hist"][:, :, -1], lengths - 1, state["inner"], layer, kv)
            return (jnp.where(first[:, None, None], nxt.astype(cur.dtype), cur),
                    jnp.where(first[:, None], cnt.astype(cur_counts.dtype), cur_counts))

        return jax.lax.cond(jnp.any(first), choose, lambda _: (cur, cur_counts), None)

    def step_selection(self, cur, cur_counts, lengths, prefetch=None) -> Selection:
        """This step's :class:`Selection` from the choice made one step earlier
        (``cur [B,Hkv,K]``, ``cur_counts [B,Hkv]``: block ids, or token positions to which
        this step's new token is added: it did not exist when they were chosen)."""
        if self.blocks:
            return Selection.blocks(cur, cur_counts, self.inner().block_size, prefetch=prefetch,
                                    within_prefetch=prefetch is not None)
        b, hkv, kk = cur.shape
        newest = jnp.broadcast_to((lengths - 1)[:, None, None], (b, hkv, 1))
        idx = jnp.concatenate([cur, newest], -1)
        slot = jnp.arange(kk + 1)
        idx = jnp.where(slot == cur_counts[..., None], newest, jnp.where(slot < cur_counts[..., None], idx, 0))
        return Selection.tokens(idx.astype(jnp.int32), cur_counts + 1, block_size=self.prefetch_block_size,
                                within_prefetch=prefetch is not None, prefetch=prefetch)

    def select(self, q, kv, lengths, state, carry, layer):
        # 1. this step's selection: chosen during the previous step
        cur, cur_counts = state["next"], state["next_counts"]
        if self.reads_all_keys and not self.steady:
            cur, cur_counts = self._first_step_choice(kv, lengths, state, layer, cur, cur_counts)
        # 2-3. the history, the prediction and the next step's selection (independent
        # of this step's attention)
        state = self.advance(q, kv, lengths, state, layer)
        prefetch = self._prefetch_blocks(state["next"], state["next_counts"], lengths, self.blocks)
        return self.step_selection(cur, cur_counts, lengths, prefetch), state, carry

    @property
    def theta_steps(self) -> int:
        """θ_t, resolved: ``dense_steps``, or ``window`` where it is ``None``."""
        return self.window if self.dense_steps is None else self.dense_steps

    @property
    def warmup_steps(self) -> int:  # type: ignore[override]
        """The first θ_t (:attr:`theta_steps`) decode steps, and with a token selector
        (``reads_all_keys``) at least the first, whose selection is made from the last
        prompt query then (:meth:`_first_step_choice`); 0 for :meth:`steady_state`."""
        if self.steady:
            return 0
        return max(self.theta_steps, 1 if self.reads_all_keys else 0)

    def steady_state(self) -> "AsyncSpade":
        """The program of rows past :attr:`warmup_steps`: neither the dense steps' nor the
        first step's per-layer ``lax.cond`` (1.2 ms of a 6.9 ms step at 32K, B=4 on the
        H200, taken or not; 7.05 against 6.95 ms without it: ``step_e2e_32k_b4_h200.md``). The state is the same."""
        return dataclasses.replace(self, steady=True) if self.warmup_steps else self

    def without_dense_steps(self, where: str) -> "AsyncSpade":
        """The method for ``where``, a path that holds no whole cache on the attending device
        (the offloaded tier, the cache rank): the default θ_t (``dense_steps=None``) resolved
        to 0 there; ValueError when ``dense_steps > 0`` was asked for."""
        if self.dense_steps:
            raise ValueError(f"asyncspade: dense_steps={self.dense_steps} attends every key, which {where} does not "
                             f"hold on the attending device: pass dense_steps=0")
        return self if self.dense_steps == 0 else dataclasses.replace(self, dense_steps=0)

    def decode(self, q, kv, lengths, state, carry, layer):
        """The selection's attention; rows within their first θ_t decode steps
        (``1 <= count <= theta_steps``: ``count`` is 1 at the first step after the prompt)
        attend every key instead. The whole-cache attention runs only in steps where
        some row warms up (``lax.cond``), and each row takes its own result, so a row's
        output does not depend on the others in the batch."""
        n = 0 if self.steady else self.theta_steps
        sel, new_state, carry = self.select(q, kv, lengths, state, carry, layer)
        impl = self.impl

        def sparse(_):
            return kv.attend(q, lengths, sel, impl=impl)

        if n == 0:
            return sparse(None), new_state, carry
        warm = (state["count"] >= 1) & (state["count"] <= n)

        def mixed(_):
            full = kv.attend(q, lengths, Selection.all_tokens(), impl=impl)
            return jnp.where(warm[:, None, None], full, sparse(None))

        return jax.lax.cond(jnp.any(warm), mixed, sparse, None), new_state, carry

    def for_offload(self) -> "AsyncSpade":
        return self.without_dense_steps("the offloaded tier")

    # -- offloading: the next selection's blocks are the prefetch ---------------------------
    def _prefetch_blocks(self, nxt, counts, lengths, blocks: bool):
        """The blocks of the next step's selection, each once; the rest name the next
        step's newest block (in the ring: skipped)."""
        bs = self.inner().block_size if blocks else self.prefetch_block_size
        newest_next = (lengths // bs)[:, None, None]
        ids = nxt if blocks else nxt // bs
        ids = jnp.where(jnp.arange(ids.shape[-1]) < counts[..., None], ids, newest_next)
        if not blocks:  # dedupe: sorted, repeats -> the newest block
            ids = jnp.sort(ids, axis=-1)
            dup = jnp.concatenate([jnp.zeros_like(ids[..., :1], bool), ids[..., 1:] == ids[..., :-1]], -1)
            ids = jnp.where(dup, newest_next, ids)
        return ids.astype(jnp.int32)

    @property
    def offload_block_size(self):
        return self.inner().block_size if self.blocks else self.prefetch_block_size

    def offload_blocks_per_step(self, max_len):
        return self._next_width(max_len)

    def first_prefetch(self, state):
        # after prefill: the blocks of the first step's selection (lengths unknown here:
        # entries past the count are clipped into the ring's newest blocks by the tier)
        bs = self.offload_block_size
        ids = state["next"] if self.blocks else state["next"] // bs
        cnt = state["next_counts"]
        ok = jnp.arange(ids.shape[-1]) < cnt[..., None]
        if not self.blocks:
            ids = jnp.where(ok, ids, -1)
            ids = jnp.sort(ids, axis=-1)
            dup = jnp.concatenate([jnp.zeros_like(ids[..., :1], bool), ids[..., 1:] == ids[..., :-1]], -1)
            return jnp.where(dup, -1, ids).astype(jnp.int32)
        return jnp.where(ok, ids, -1).astype(jnp.int32)
