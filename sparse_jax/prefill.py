"""Sparse prefill: Token Sparse Attention (TSA, 2025): jnp, with step 1 as a Pallas kernel on the GPU.

TSA drops, per layer and per query head, the prompt tokens that the last
``window`` queries barely attend, and runs causal attention over the kept tokens
only (as queries and as keys); a dropped position's attention output is zero, so
its hidden state keeps only the residual. The KV cache is written from the full
K/V *before* this (:meth:`models.driver.Driver.prompt_layer`), so any decode
method follows unchanged.

Steps (``../shared/notes/wave2_methods.md`` §2, as the public code resolves the
paper), for a row of ``L`` valid tokens with the last ``W`` as the observation
window and the ``P = L - W`` before them as the prefix:

1. **Score**: softmax over all keys of each window query (causal inside the
   window, scale ``1/sqrt(D)`` as every attention here), mean over the W
   queries; per query head (K/V shared by a GQA group, scored per query head).
   Only prefix keys are candidates. :func:`window_scores`: on the GPU the
   two-pass kernel of ``pallas_kernels.window_scores``, else the jnp reference.
2. **Smooth**: average pool of width ``pool`` (7) with zero padding, counting the
   padding (PyTorch's ``avg_pool1d`` default): the prefix's edges are damped.
3. **Count** (one number per row, shared by the heads): the head mean,
   normalised over the prefix, sorted ascending; ``drop = #(cumsum < tau) + 1``
   (the code's +1 drops one token more than the paper's Alg. 1; we follow the
   code) and ``keep = max(min_tokens, P - drop)``, at most ``P``.
4. **Select** per head: its own top-``keep`` prefix tokens, plus the whole window.
5. **Attend** causally in the compressed sequence (original positions keep the
   order), then **scatter** back: zero output at dropped positions.

TSA applies to a row only when ``L > min_tokens + W`` and ``tau > 0``; shorter
rows get exact causal attention. Step 5 runs compressed by default (each head's
kept tokens gathered, causal attention over the shorter sequence: cuDNN with the
row's kept count as its length on the GPU, scattered back); ``impl="masked"`` is the
reference with masks over the full sequence (exact semantics, no speed-up).

Which layers: the paper's drift profile picks them per model (layers whose
relative update ``|h_out - h_in| / |h_in|`` is at or below the median); until a
profile ships for a model, :meth:`TokenSparsePrefill.layers_for` falls back to
the paper's default, the second half of the layers. Only global layers: a
sliding window over compressed positions would be wrong.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.window_scores import unsupported_reason as window_scores_unsupported
from sparse_jax.calibration import CALIBRATION_ROOT
from sparse_jax.ops._dispatch import on_gpu, resolve_impl
from sparse_jax.ops.dense import chunk_prefill_attention, dense_prefill_attention
from sparse_jax.ops.window_scores import window_scores  # step 1 (an op: kernel and reference)

PREFILLS = ("dense", "token_sparse")
PROFILE_FILE = "token_sparse.json"


def profile_path(model_name: str, root=None) -> Path:
    return Path(root or CALIBRATION_ROOT) / model_name / PROFILE_FILE


def layers_from_drift(drift, eligible, quantile: float = 0.5) -> tuple[int, ...]:
    """The paper's rule: among the ``eligible`` layers (global ones), those whose drift
    is at or below the ``quantile`` of their drifts run TSA."""
    drift = np.asarray(drift, np.float64)
    idx = [i for i, ok in enumerate(eligible) if ok]
    if not idx:
        return ()
    cut = np.quantile(drift[idx], quantile)
    return tuple(i for i in idx if drift[i] <= cut)


def save_prefill_profile(model_name: str, drift, layers, meta: dict, root=None) -> Path:
    path = profile_path(model_name, root)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(meta, drift=[float(d) for d in drift], layers=[int(i) for i in layers]),
                               indent=1) + "\n")
    return path


def load_prefill_profile(model_name: str, root=None) -> dict | None:
    """The shipped drift profile of a model (``python -m models.cli.prefill_profile``), or None."""
    path = profile_path(model_name, root)
    return json.loads(path.read_text()) if path.exists() else None


#: how a chunk's kept keys are found (``token_sparse_chunk_attention(select=...)``)
CHUNK_SELECTS = ("sort", "argsort")


@dataclasses.dataclass(frozen=True)
class TokenSparsePrefill:
    """Token Sparse Attention's options (the paper's defaults).

    Attributes:
      tau: coverage: the prefix tokens whose cumulative normalised score stays
        below ``tau`` are dropped (0.005 for Llama, 0.008 for Mistral in the paper).
      min_tokens: at least this many prefix tokens are kept per head.
      window: the observation window: the last ``window`` queries score the
        prefix, and are always kept.
      pool: width of the average pool smoothing the scores (odd).
      layers: model layer indices where TSA runs; None: the model's shipped drift
        profile when ``load_model`` binds the method (``sparse_jax/calibration_data/
        <model>/token_sparse.json``), else the second half of the layers (the
        paper's default without a profile).
      block: query-block size of the masked reference attention (memory, not results).
      impl: "compressed" (default: each head's kept tokens gathered, causal attention
        over the shorter sequence, scattered back) or "masked" (the reference).
      gather: how "compressed" moves rows (:data:`GATHER_MODES`, the same numbers):
        "gather" (default: each query head reads its KV head's rows; the output is
        gathered back through the inverse order; faster on the H100 at every kept
        fraction: docs/methods.md, 'Token Sparse Attention prefill') or "scatter" (K/V
        repeated to the query heads, the output scattered back).
      buckets: the compressed attention runs at the shortest of ``buckets`` static
        lengths that holds the kept tokens (:func:`bucket_lengths`); 1: the padded
        prompt length (cuDNN then still visits every query tile).
      keep_fraction: an ablation knob (the paper's fixed-sparsity rows): keep this
        fraction of each row's prefix (at least ``min_tokens``) instead of the count
        ``tau`` gives; the kept tokens are still each head's top set by score. None
        (default): ``tau``. Timing with random weights needs it: their attention has
        no structure for ``tau`` to find.
      quantile: the paper's δ for the layer rule, applied to the model's shipped drift
        profile when ``load_model`` binds the method (the layers at or below this
        quantile of the eligible layers' drift). The shipped list records its own δ:
        0.5 (the paper's) for Gemma 3, 0.1 for SmolLM2, where δ = 0.5 (15 layers) cost
        many RULER points at 8K and δ = 0.1 (3 layers) matches dense (docs/methods.md,
        'Token Sparse prefill: τ against speed and accuracy'); ``quantile=0.5`` gives the
        paper's set there. Exclusive
        with ``layers``.
      chunk_select: how the chunk form (chunked prefill) finds each head's kept keys:
        "sort" (a value sort and a threshold, then the compressed order) or "argsort" (one
        argsort; the same keys): :data:`CHUNK_SELECTS`, to be chosen by the GPU's timing
        (``benchmarks.prefill_bench --parts chunk``).
      query_heads: the model's own query heads, where tensor parallelism padded the KV heads
        (``models.runtime.sharding.pad_method_heads`` sets it): the head mean that sets the
        kept count leaves the padded heads out, so a mesh keeps what one device keeps. None:
        every head counts.
    """

    tau: float = 0.005
    min_tokens: int = 1024
    window: int = 128
    pool: int = 7
    layers: tuple[int, ...] | None = None
    block: int = 512
    impl: str = "compressed"
    gather: str = "gather"
    buckets: int = 8
    keep_fraction: float | None = None
    quantile: float | None = None
    chunk_select: str = "sort"
    query_heads: int | None = None

    def __post_init__(self):
        if not (self.tau >= 0):
            raise ValueError(f"token_sparse: tau must be >= 0, got {self.tau}")
        for name in ("min_tokens", "window", "pool", "block", "buckets"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"token_sparse: {name} must be a positive int, got {v!r}")
        if self.impl not in ("compressed", "masked"):
            raise ValueError(f"token_sparse: impl must be 'compressed' or 'masked', got {self.impl!r}")
        if self.gather not in GATHER_MODES:
            raise ValueError(f"token_sparse: gather must be one of {GATHER_MODES}, got {self.gather!r}")
        if self.keep_fraction is not None and not 0.0 <= self.keep_fraction <= 1.0:
            raise ValueError(f"token_sparse: keep_fraction must be in [0, 1] or None, got {self.keep_fraction}")
        if self.pool % 2 == 0:
            raise ValueError(f"token_sparse: pool must be odd (centred), got {self.pool}")
        if self.quantile is not None:
            if isinstance(self.quantile, bool) or not 0.0 < self.quantile <= 1.0:
                raise ValueError(f"token_sparse: quantile must be in (0, 1], got {self.quantile!r}")
            if self.layers is not None:
                raise ValueError("token_sparse: give layers or quantile, not both")
        if self.layers is not None:
            object.__setattr__(self, "layers", tuple(int(i) for i in self.layers))
        if self.chunk_select not in CHUNK_SELECTS:
            raise ValueError(f"token_sparse: chunk_select must be one of {CHUNK_SELECTS}, got {self.chunk_select!r}")
        if self.query_heads is not None and (isinstance(self.query_heads, bool) or not isinstance(self.query_heads, int)
                                             or self.query_heads < 1):
            raise ValueError(f"token_sparse: query_heads must be a positive int or None, got {self.query_heads!r}")

    def layers_for(self, num_layers: int) -> frozenset[int]:
        """The model layers TSA runs on (before the global-only rule)."""
        if self.quantile is not None:
            raise ValueError("token_sparse: quantile picks layers from the model's drift profile when "
                             "models.load_model binds the method; here it is unbound (give layers instead)")
        if self.layers is None:
            return frozenset(range(num_layers // 2, num_layers))
        bad = [i for i in self.layers if not -num_layers <= i < num_layers]
        if bad:
            raise ValueError(f"token_sparse: layers {bad} outside a model of {num_layers} layers")
        return frozenset(i % num_layers for i in self.layers)

    def attention(self, q, k, v, lengths, head_axis: str | None = None):
        return token_sparse_attention(q, k, v, lengths, tau=self.tau, min_tokens=self.min_tokens,
                                      window=self.window, pool=self.pool, block=self.block, head_axis=head_axis,
                                      impl=self.impl, gather=self.gather, buckets=self.buckets,
                                      keep_fraction=self.keep_fraction, query_heads=self.query_heads)

    def chunk_attention(self, q, k, v, start, lengths, head_axis: str | None = None):
        """One chunk of a prompt under chunked prefill (:func:`token_sparse_chunk_attention`):
        the chunk's queries over the prefix keys its own last ``window`` queries keep, and
        every key of the chunk. ``head_axis``: as :meth:`attention`'s (the count shared by
        every device's heads)."""
        return token_sparse_chunk_attention(q, k, v, start, lengths, tau=self.tau, min_tokens=self.min_tokens,
                                            window=self.window, pool=self.pool, buckets=self.buckets,
                                            keep_fraction=self.keep_fraction, head_axis=head_axis,
                                            query_heads=self.query_heads, select=self.chunk_select)


def make_prefill(name: str, options=()) -> TokenSparsePrefill | None:
    """The prefill named ``name`` with ``options`` (pairs or a dict); None for dense."""
    if name not in PREFILLS:
        raise ValueError(f"unknown prefill {name!r}; choose from {', '.join(PREFILLS)}")
    opts = dict(options)
    if name == "dense":
        if opts:
            raise ValueError(f"the dense prefill takes no options, got {sorted(opts)}")
        return None
    try:
        return TokenSparsePrefill(**opts)
    except TypeError as e:
        fields = [f.name for f in dataclasses.fields(TokenSparsePrefill)]
        raise ValueError(f"bad token_sparse option ({e}); options: {', '.join(fields)}") from None


def _group(k, hq):
    """``k [B, T, Hkv, D]`` -> ``[B, Hq, T, D]`` (each query head's K/V)."""
    return jnp.repeat(k.transpose(0, 2, 1, 3), hq // k.shape[2], axis=1)


def smooth(scores, pool: int):
    """Step 2: average pool of width ``pool`` over the last axis, zero padding counted."""
    half = pool // 2
    padded = jnp.pad(scores, [(0, 0)] * (scores.ndim - 1) + [(half, half)])
    return jax.lax.reduce_window(padded, 0.0, jax.lax.add, (1,) * (scores.ndim - 1) + (pool,),
                                 (1,) * scores.ndim, "VALID") / pool


def keep_counts(scores, lengths, *, tau: float, min_tokens: int, window: int, head_axis: str | None = None,
                query_heads: int | None = None):
    """Step 3: prefix tokens kept per row ``int32[B]`` (the whole prefix where TSA does
    not apply: ``L <= min_tokens + window`` or ``tau == 0``). ``head_axis``: the mesh
    axis the query heads are split over (tensor parallelism): the head mean is taken
    over every device's heads, so each device keeps the same count. ``query_heads``: the
    model's own heads, the first ones (padding for the mesh comes after them): only those
    enter the mean."""
    b, hq, t = scores.shape
    prefix_len = jnp.maximum(lengths.astype(jnp.int32) - window, 0)
    in_prefix = jnp.arange(t)[None, :] < prefix_len[:, None]
    if query_heads is not None:  # this device's heads are [first, first + hq) of the mesh's
        first = 0 if head_axis is None else jax.lax.axis_index(head_axis) * hq
        scores = jnp.where((first + jnp.arange(hq) < query_heads)[None, :, None], scores, 0.0)
    head_sum, heads = scores.sum(axis=1), hq
    if head_axis is not None:
        head_sum, heads = jax.lax.psum(head_sum, head_axis), hq * jax.lax.psum(1, head_axis)
    if query_heads is not None:
        heads = query_heads
    m = jnp.where(in_prefix, head_sum / heads, 0.0)
    m = m / jnp.maximum(m.sum(-1, keepdims=True), 1e-30)
    ordered = jnp.sort(jnp.where(in_prefix, m, jnp.inf), axis=-1)  # prefix first, ascending
    csum = jnp.cumsum(jnp.where(jnp.isfinite(ordered), ordered, 0.0), axis=-1)
    below = (csum < tau) & jnp.isfinite(ordered)
    drop = below.sum(-1) + 1
    return _bounded_keep(prefix_len - drop, lengths, prefix_len, min_tokens=min_tokens, window=window,
                         applies=tau > 0)


def fixed_keep_counts(lengths, fraction: float, *, min_tokens: int, window: int):
    """Step 3 at a fixed fraction: ``int32[B]``, ``floor(fraction * prefix)`` tokens of
    each row's prefix, at least ``min_tokens`` (the whole prefix where TSA does not
    apply, ``L <= min_tokens + window``, as in :func:`keep_counts`)."""
    prefix_len = jnp.maximum(lengths.astype(jnp.int32) - window, 0)
    keep = jnp.floor(fraction * prefix_len.astype(jnp.float32)).astype(jnp.int32)
    return _bounded_keep(keep, lengths, prefix_len, min_tokens=min_tokens, window=window)


def fixed_keep_max(t: int, fraction: float, *, min_tokens: int, window: int) -> int:
    """A static bound on the tokens :func:`fixed_keep_counts` keeps in a row of a ``t``-token
    prompt, the window included (one more than the fraction's floor: the device rounds in f32)."""
    return min(t, max(min_tokens, int(fraction * max(t - window, 0)) + 1) + window)


def _bounded_keep(keep, lengths, prefix_len, *, min_tokens: int, window: int, applies=True):
    """Step 3's shared rule: ``keep`` raised to ``min_tokens`` and cut to the prefix; the
    whole prefix where TSA does not apply (``L <= min_tokens + window``, or not
    ``applies``)."""
    keep = jnp.clip(jnp.maximum(min_tokens, keep), 0, prefix_len)
    return jnp.where((lengths > min_tokens + window) & applies, keep, prefix_len).astype(jnp.int32)


def kept_tokens(scores, keep, lengths, window: int):
    """Step 4: ``bool[B, Hq, T]``: each head's top-``keep`` prefix tokens by its own
    score, and the window ``[L - W, L)``.

    Ties are broken towards the lower position (as a stable descending argsort would).
    One value sort per head (no argsort, no rank inversion): the ``keep``-th largest
    prefix score is the threshold; every score above it is kept, and of the scores
    equal to it the first ``keep - #above`` positions (float equality: ``-0.0`` ties
    with ``0.0``, which a total-order argsort would separate; window scores are
    ``>= +0.0``, so the two agree on them). NaN scores: unspecified."""
    b, hq, t = scores.shape
    prefix_len = jnp.maximum(lengths.astype(jnp.int32) - window, 0)
    j = jnp.arange(t)[None, None, :]
    in_prefix = j < prefix_len[:, None, None]
    keep = keep.astype(jnp.int32)[:, None, None]
    masked = jnp.where(in_prefix, scores, -jnp.inf)
    desc = -jnp.sort(-masked, axis=-1)  # descending; -inf (outside the prefix) last
    kth = jnp.take_along_axis(desc, jnp.clip(keep - 1, 0, t - 1), axis=-1)  # [B, Hq, 1]
    above = in_prefix & (masked > kth)
    tie = in_prefix & (masked == kth)
    need = keep - above.sum(-1, keepdims=True)  # ties to take, lowest positions first
    top = above | (tie & (jnp.cumsum(tie, axis=-1) <= need))
    in_window = (j >= prefix_len[:, None, None]) & (j < lengths[:, None, None])
    return top | in_window


def kept_tokens_argsort(scores, keep, lengths, window: int):
    """:func:`kept_tokens` by two stable argsorts (the previous formulation; the
    test oracle for the one-sort version)."""
    b, hq, t = scores.shape
    prefix_len = jnp.maximum(lengths.astype(jnp.int32) - window, 0)
    j = jnp.arange(t)[None, None, :]
    in_prefix = j < prefix_len[:, None, None]
    order = jnp.argsort(-jnp.where(in_prefix, scores, -jnp.inf), axis=-1, stable=True)
    rank = jnp.argsort(order, axis=-1)  # rank of each token within its head
    top = in_prefix & (rank < keep[:, None, None])
    in_window = (j >= prefix_len[:, None, None]) & (j < lengths[:, None, None])
    return top | in_window


def masked_causal_attention(q, k, v, kept, block: int = 512):
    """Step 5, with masks: query ``i`` of head ``h`` attends the kept keys ``j <= i``;
    rows not kept output zero. ``q [B,T,Hq,D]``, ``k, v [B,T,Hkv,D]``, ``kept
    [B,Hq,T]`` -> ``[B,T,Hq,D]`` (f32 softmax; blocks of queries bound the memory)."""
    b, t, hq, d = q.shape
    kh, vh = _group(k, hq), _group(v, hq)  # [B, Hq, T, D]
    c = min(block, t)
    tp = -(-t // c) * c
    qp = jnp.pad(q, ((0, 0), (0, tp - t), (0, 0), (0, 0))).transpose(0, 2, 1, 3)  # [B, Hq, Tp, D]
    keptp = jnp.pad(kept, ((0, 0), (0, 0), (0, tp - t)))

    def one(i):
        qi = jax.lax.dynamic_slice_in_dim(qp, i * c, c, axis=2).astype(jnp.float32)
        rows = i * c + jnp.arange(c)
        s = jnp.einsum("bhqd,bhtd->bhqt", qi, kh.astype(jnp.float32)) * (d ** -0.5)
        ok = kept[:, :, None, :] & (jnp.arange(t)[None, None, None, :] <= rows[None, None, :, None])
        p = jax.nn.softmax(jnp.where(ok, s, -jnp.inf), axis=-1)
        p = jnp.where(ok.any(-1, keepdims=True), p, 0.0)
        o = jnp.einsum("bhqt,bhtd->bhqd", p, vh.astype(jnp.float32))
        row_kept = jax.lax.dynamic_slice_in_dim(keptp, i * c, c, axis=2)
        return jnp.where(row_kept[..., None], o, 0.0)

    out = jax.lax.map(one, jnp.arange(tp // c))  # [nb, B, Hq, c, D]
    out = out.transpose(1, 2, 0, 3, 4).reshape(b, hq, tp, d)[:, :, :t]
    return out.transpose(0, 2, 1, 3).astype(q.dtype)


def compress_positions(kept):
    """``(order, dest)``, both ``int32[B, Hq, T]``: ``order`` lists each head's kept
    positions first, then the dropped ones, each ascending (what a stable argsort of
    ``~kept`` gives); ``dest`` is its inverse, the compressed index of every position.
    Two cumulative sums give ``dest``; one scatter with unique indices inverts it."""
    b, hq, t = kept.shape
    k32 = kept.astype(jnp.int32)
    before = jnp.cumsum(k32, axis=-1) - k32  # kept tokens before each position
    n = before[..., -1:] + k32[..., -1:]  # the head's kept count
    j = jnp.arange(t, dtype=jnp.int32)
    dest = jnp.where(kept, before, n + j - before)  # a dropped token follows the n kept and the drops before it
    rows = jnp.arange(b)[:, None, None]
    heads = jnp.arange(hq)[None, :, None]
    order = jnp.zeros((b, hq, t), jnp.int32).at[rows, heads, dest].set(
        jnp.broadcast_to(j, (b, hq, t)), unique_indices=True)
    return order, dest


def compress_order(kept):
    """``int32[B, Hq, T]``: :func:`compress_positions`' ``order`` alone."""
    return compress_positions(kept)[0]


def compress(x, order, *, repeat: bool = True):
    """Each head's kept tokens first, in their original order: ``x [B,T,H,D]`` (``H``
    the query heads, or the KV heads of a GQA group) gathered by ``order [B,Hq,T]`` ->
    ``[B,T,Hq,D]``. ``repeat``: a KV input is first repeated to the query heads (the
    original formulation); False gathers each query head's rows from its KV head
    directly, without the repeated copy."""
    b, hq, t = order.shape
    h = x.shape[2]
    if h == hq:
        return jnp.take_along_axis(x, order.transpose(0, 2, 1)[..., None], axis=1)
    if repeat:
        return jnp.take_along_axis(jnp.repeat(x, hq // h, axis=2), order.transpose(0, 2, 1)[..., None], axis=1)
    rows = jnp.arange(b)[:, None, None]
    kv_head = (jnp.arange(hq) // (hq // h))[None, None, :]
    return x[rows, order.transpose(0, 2, 1), kv_head]  # [B, T, Hq, D]


def decompress(o, order, counts, length: int | None = None):
    """The inverse of :func:`compress` for the first ``counts[b]`` compressed positions:
    ``o [B,L,Hq,D]`` scattered back to the original positions (``order [B,Hq,L]``, the
    first ``L`` entries of the full order), zero elsewhere -> ``[B,length,Hq,D]``
    (``length``: the original sequence, default ``L``)."""
    b, t, hq, d = o.shape
    length = t if length is None else length
    pos = jnp.where(jnp.arange(t)[None, None, :] < counts[:, None, None], order, length)  # length: dropped
    rows = jnp.arange(b)[:, None, None]
    heads = jnp.arange(hq)[None, :, None]
    out = jnp.zeros((b, length + 1, hq, d), o.dtype)  # one spare row takes the dropped writes
    return out.at[rows, pos, heads].set(o.transpose(0, 2, 1, 3))[:, :length]


def decompress_gather(o, dest, kept):
    """:func:`decompress` as a gather: position ``p`` of head ``h`` reads compressed row
    ``dest[b, h, p]`` where ``kept``, zero elsewhere (one pass, no zero fill and
    scatter): ``o [B,L,Hq,D]`` (``L`` at least every row's kept count), ``dest, kept
    [B,Hq,T]`` -> ``[B,T,Hq,D]``."""
    idx = jnp.minimum(dest, o.shape[1] - 1)  # a dropped position's dest may pass L; it reads zero anyway
    g = jnp.take_along_axis(o, idx.transpose(0, 2, 1)[..., None], axis=1)
    return jnp.where(kept.transpose(0, 2, 1)[..., None], g, jnp.zeros((), o.dtype))


def bucket_lengths(t: int, buckets: int) -> tuple[int, ...]:
    """The static compressed lengths :func:`compressed_causal_attention` chooses from:
    ``buckets`` steps of ``ceil(t / buckets)`` rounded up to 128 rows (a tile of the
    attention kernels), the last one ``t``. A call runs the shortest that holds every
    row's kept count, so the attention's work follows the kept fraction (within one
    step) instead of the padded prompt length: cuDNN's causal kernel with sequence
    lengths still visits every query tile of the padded sequence, so its time falls
    only linearly with the kept count, not quadratically."""
    if isinstance(buckets, bool) or not isinstance(buckets, int) or buckets < 1:
        raise ValueError(f"token_sparse: buckets must be a positive int, got {buckets!r}")
    step = -(-t // buckets)
    step = -(-step // 128) * 128
    return tuple(sorted({min(t, step * i) for i in range(1, buckets + 1)}))


#: how :func:`compressed_causal_attention` moves rows: "scatter" (the K/V repeated to the
#: query heads, then gathered; the output scattered back) or "gather" (each query head's
#: K/V rows read from its KV head; the output gathered back through the inverse order)
GATHER_MODES = ("scatter", "gather")


def compressed_causal_attention(q, k, v, kept, *, gather: str = "gather", buckets: int = 8,
                                max_count: int | None = None):
    """Step 5, compressed: each query head's kept tokens gathered into a shorter
    sequence (original order, so causal stays causal), causal attention over it (cuDNN
    on the GPU, with the row's kept count as its sequence length; the blockwise flash
    attention on CPU), scattered back. The same result as
    :func:`masked_causal_attention`: a compressed query attends exactly the kept keys
    before it. ``kept [B,Hq,T]`` must keep the same number of tokens in every head of a
    row (TSA's count is per row). ``gather``: one of :data:`GATHER_MODES` (the same
    numbers). ``buckets``: the compressed sequences are cut to the shortest of
    :func:`bucket_lengths` that holds the batch's largest kept count (one
    ``lax.switch`` branch per length, each compiled once), so the attention's work
    scales with the square of the kept fraction; 1 keeps the full length. ``max_count``: a
    static bound on every row's kept count (a fixed fraction's, :func:`fixed_keep_max`): the
    lengths past the first that holds it are never run, so they are not compiled, and the
    program's temporaries are the longest kept bucket's (at 131,072 tokens keeping 0.3 on the
    H100: 4.29 GiB a layer program with every bucket, the largest a full-length gather)."""
    if gather not in GATHER_MODES:
        raise ValueError(f"token_sparse: gather must be one of {GATHER_MODES}, got {gather!r}")
    b, t, hq, d = q.shape
    lengths = bucket_lengths(t, buckets)
    if max_count is not None:
        lengths = lengths[:1 + sum(n < max_count for n in lengths)]
    counts = kept[:, 0, :].sum(-1).astype(jnp.int32)  # [B], the same in every head
    order, dest = compress_positions(kept)  # kept first, ascending
    rep = gather == "scatter"
    use_cudnn = on_gpu() and q.dtype in (jnp.bfloat16, jnp.float16)

    def attend(length):
        def run(q, k, v, order, dest, kept, counts):
            o_l = order[..., :length]  # each head's kept tokens lead; the bucket holds them all
            qc, kc, vc = compress(q, o_l), compress(k, o_l, repeat=rep), compress(v, o_l, repeat=rep)
            if use_cudnn:
                oc = jax.nn.dot_product_attention(qc, kc, vc, is_causal=True, query_seq_lengths=counts,
                                                  key_value_seq_lengths=counts, implementation="cudnn")
            else:
                oc = dense_prefill_attention(qc, kc, vc)
            if rep:
                return decompress(oc.astype(q.dtype), o_l, counts, t)
            return decompress_gather(oc.astype(q.dtype), dest, kept)
        return run

    args = (q, k, v, order, dest, kept, counts)
    if len(lengths) == 1:
        return attend(lengths[0])(*args)
    which = jnp.searchsorted(jnp.asarray(lengths, jnp.int32), jnp.max(counts), side="left")
    return jax.lax.switch(which, [attend(n) for n in lengths], *args)


def token_sparse_attention(q, k, v, lengths, *, tau=0.005, min_tokens=1024, window=128, pool=7, block=512,
                           head_axis=None, impl: str = "compressed", scores_impl: str = "auto",
                           gather: str = "gather", buckets: int = 8, keep_fraction: float | None = None,
                           query_heads: int | None = None):
    """Token Sparse Attention over a right-padded prompt: ``q [B,T,Hq,D]``, ``k, v
    [B,T,Hkv,D]``, ``lengths int32[B]`` -> ``[B,T,Hq,D]`` (steps 1-5 above);
    ``head_axis``: see :func:`keep_counts`. ``impl``: "compressed" (gather, attend,
    scatter) or "masked" (the reference: masks over the whole prompt).
    ``scores_impl``: step 1's ``impl`` (:func:`window_scores`; "auto": the kernel on
    the GPU where it supports the head size, the reference elsewhere). ``gather``,
    ``buckets``: see :func:`compressed_causal_attention`. ``keep_fraction``: keep this
    fraction of each row's prefix (at least ``min_tokens``) instead of ``tau``'s count
    (:class:`TokenSparsePrefill`); ``query_heads``: see :func:`keep_counts`."""
    if impl not in ("compressed", "masked"):
        raise ValueError(f"token_sparse: impl must be 'compressed' or 'masked', got {impl!r}")
    lengths = lengths.astype(jnp.int32)
    scores = smooth(window_scores(q, k, lengths, window, impl=scores_impl), pool)
    if keep_fraction is None:
        keep = keep_counts(scores, lengths, tau=tau, min_tokens=min_tokens, window=window, head_axis=head_axis,
                           query_heads=query_heads)
    else:
        keep = fixed_keep_counts(lengths, keep_fraction, min_tokens=min_tokens, window=window)
    kept = kept_tokens(scores, keep, lengths, window)
    if impl == "masked":
        return masked_causal_attention(q, k, v, kept, block)
    bound = None if keep_fraction is None else fixed_keep_max(q.shape[1], keep_fraction, min_tokens=min_tokens,
                                                             window=window)
    return compressed_causal_attention(q, k, v, kept, gather=gather, buckets=buckets, max_count=bound)


# -- chunked prefill ------------------------------------------------------------------------------
# TSA as the paper states it needs the prompt's last window to choose what every layer keeps, so
# a prompt prefilled in chunks (the paged engine's chunked prefill) cannot run it: the window
# arrives with the last chunk. In chunks, each chunk chooses from its own last ``window`` queries
# which keys *before* it to keep (steps 1-4 over the prefix [0, start)), keeps every key of its own,
# and keeps every query (nothing is zeroed: a chunk's queries are all computed). This is our
# adaptation, not the paper's algorithm: at long context the prefix is most of a chunk's keys, so
# dropping prefix keys is most of TSA's saving (the attention is ~85% of a 2K chunk's floor at
# 128K on the H200, benchmarks/results/chunk_prefill_h200.md); its accuracy is measured apart.


def chunk_window_scores(q, k, start, lengths, window: int, tile: int = 4096, impl: str = "auto"):
    """Step 1 for a chunk: ``[B, Hq, T]`` f32, the mean attention probability each key before
    the chunk gets from the chunk's last ``window`` valid queries (0 at the chunk's own keys
    and past them). ``q [B,C,Hq,D]`` at positions ``start .. start + C - 1`` (``start``
    traced), ``k [B,T,Hkv,D]`` (positions past the chunk never read), ``lengths int32[B]``
    the prompt's tokens (queries past it are padding).

    ``impl``: "auto" (the window-scores kernel on a GPU where it supports the head size,
    :func:`window_scores` with ``q_start``; else the jnp form), "pallas" (the kernel;
    interpret mode on a CPU) or "reference" (the jnp form): two passes over ``tile`` keys
    at a time (the kernel's scheme in jnp), each window query's log-sum-exp, then each key's
    mean probability. Neither holds ``[B, Hq, W, T]`` f32 (2 GiB a layer at 128K with 32
    heads): the engine sizes its KV pool beside the chunk program's temporaries."""
    b, c, hq, d = q.shape
    t, hkv = k.shape[1], k.shape[2]
    w = min(int(window), c)
    start = jnp.asarray(start, jnp.int32)
    end = jnp.minimum(start + c, lengths.astype(jnp.int32))  # [B]: one past the chunk's last valid query
    choice, _ = resolve_impl(impl, kernel_unsupported=window_scores_unsupported(d, q.dtype, k.dtype))
    if choice == "pallas":
        return window_scores(q, k, end, w, q_start=start, prefix=jnp.broadcast_to(start, (b,)), impl=impl)
    tile = min(int(tile), t)
    n = -(-t // tile)
    qpos = end[:, None] - w + jnp.arange(w)[None, :]  # [B, W]
    live = qpos >= start  # a short last chunk has fewer than W queries of its own
    qw = jnp.take_along_axis(q, jnp.clip(qpos - start, 0, c - 1)[:, :, None, None], axis=1)
    qw = qw.reshape(b, w, hkv, hq // hkv, d)
    kp = jnp.pad(k, ((0, 0), (0, n * tile - t), (0, 0), (0, 0))).reshape(b, n, tile, hkv, d)

    def logits(i):  # [B, Hq, W, tile] f32, -inf where a key is past the query (or padding)
        sc = jnp.einsum("bwhgd,bthd->bhgwt", qw, kp[:, i], precision=jax.lax.Precision.HIGHEST,
                        preferred_element_type=jnp.float32).reshape(b, hq, w, tile) * (d ** -0.5)
        j = i * tile + jnp.arange(tile)[None, None, None, :]
        return jnp.where(j <= qpos[:, None, :, None], sc, -jnp.inf), j

    def lse_step(carry, i):
        m, z = carry
        sc, _ = logits(i)
        m2 = jnp.maximum(m, sc.max(-1))
        z = z * jnp.exp(m - m2) + jnp.exp(sc - m2[..., None]).sum(-1)
        return (m2, z), None

    init = (jnp.full((b, hq, w), -jnp.inf, jnp.float32), jnp.zeros((b, hq, w), jnp.float32))
    (m, z), _ = jax.lax.scan(lse_step, init, jnp.arange(n))  # every window query sees key 0: m finite
    lse = m + jnp.log(z)
    weight = live[:, None, :, None] / jnp.maximum(live.sum(-1), 1)[:, None, None, None]  # the mean over live queries

    def mean_probs(i):
        sc, j = logits(i)
        return jnp.where(j[:, :, 0, :] < start, (jnp.exp(sc - lse[..., None]) * weight).sum(2), 0.0)  # [B, Hq, tile]

    out = jax.lax.map(mean_probs, jnp.arange(n))  # [n, B, Hq, tile]
    return out.transpose(1, 2, 0, 3).reshape(b, hq, n * tile)[:, :, :t]


def chunk_kept_keys(q, k, start, lengths, *, tau: float, min_tokens: int, window: int, pool: int,
                    keep_fraction: float | None = None, scores_impl: str = "auto", head_axis: str | None = None,
                    query_heads: int | None = None):
    """Steps 1-4 for a chunk: ``(kept bool[B, Hq, T], keep int32[B])``, each head's kept keys
    before ``start`` (the same count in every head of a row, as TSA's) and that count. The
    chunk's prefix plays the prompt's prefix: all of it is kept while it is at most
    ``min_tokens`` or ``tau`` is 0. ``scores_impl``: :func:`chunk_window_scores`' ``impl``."""
    scores, keep = chunk_scores_and_keep(q, k, start, lengths, tau=tau, min_tokens=min_tokens, window=window,
                                         pool=pool, keep_fraction=keep_fraction, scores_impl=scores_impl,
                                         head_axis=head_axis, query_heads=query_heads)
    ends = jnp.broadcast_to(jnp.asarray(start, jnp.int32) + window, keep.shape)  # prefix = ends - window = start
    kept = kept_tokens(scores, keep, ends, window) & (jnp.arange(scores.shape[-1]) < start)[None, None, :]
    return kept, keep


def chunk_scores_and_keep(q, k, start, lengths, *, tau: float, min_tokens: int, window: int, pool: int,
                          keep_fraction: float | None = None, scores_impl: str = "auto", head_axis: str | None = None,
                          query_heads: int | None = None):
    """Steps 1-3 for a chunk: ``(scores f32[B, Hq, T], keep int32[B])``, the smoothed window
    scores (0 from ``start`` on) and the count of prefix keys each head keeps (``head_axis``:
    the mesh axis the heads are split over, :func:`keep_counts`')."""
    b = q.shape[0]
    scores = smooth(chunk_window_scores(q, k, start, lengths, window, impl=scores_impl), pool)
    ends = jnp.broadcast_to(jnp.asarray(start, jnp.int32) + window, (b,))  # prefix = ends - window = start
    if keep_fraction is None:
        keep = keep_counts(scores, ends, tau=tau, min_tokens=min_tokens, window=window, head_axis=head_axis,
                           query_heads=query_heads)
    else:
        keep = fixed_keep_counts(ends, keep_fraction, min_tokens=min_tokens, window=window)
    return scores, keep


def chunk_kept_order(scores, start):
    """Step 4 as an order: ``int32[B, Hq, T]``, each head's keys before ``start`` by descending
    score (ties: the lower position first), then the rest. Its first ``keep`` are
    :func:`kept_tokens`' set exactly (the same tie rule), in score order rather than position
    order, which the chunk's attention does not see (every kept key precedes every query).
    One stable argsort, where the set takes a value sort, a threshold, a cumulative sum and
    :func:`compress_order`'s scatter (``token_sparse_chunk_attention(select=...)``)."""
    t = scores.shape[-1]
    masked = jnp.where(jnp.arange(t)[None, None, :] < start, scores, -jnp.inf)
    return jnp.argsort(-masked, axis=-1, stable=True).astype(jnp.int32)


def sparse_chunk_attention(q, k, v, start, kept, keep, *, buckets: int = 8, order=None):
    """The chunk's queries over each head's ``kept`` keys before ``start`` and every key of the
    chunk (causal): ``q [B,C,Hq,D]``, ``k, v [B,T,Hkv,D]``, ``kept bool[B,Hq,T]`` (only keys
    before ``start``; ``keep[b]`` of them in every head) -> ``[B,C,Hq,D]``. Each head's keys
    are gathered as ``[its kept keys in order, the chunk's C keys]`` and the chunk attends them
    as a chunk starting at ``keep`` (:func:`chunk_prefill_attention`, cuDNN's split form on a
    GPU), so the work follows the kept count: the gathered prefix is the shortest of
    :func:`bucket_lengths` (``T``, ``buckets``) holding the batch's largest ``keep``.
    ``order``: each head's kept keys first in any order (:func:`chunk_kept_order`), in place
    of ``kept`` (then unused)."""
    b, c, hq, d = q.shape
    t, hkv = k.shape[1], k.shape[2]
    if b != 1:  # the chunk's start is one position (chunked prefill runs one prompt's row)
        raise ValueError(f"sparse_chunk_attention: one row (a prompt's chunk), got B={b}")
    start = jnp.asarray(start, jnp.int32)
    if order is None:
        order = compress_order(kept)  # [B, Hq, T]: each head's kept keys first, ascending
    rows = jnp.arange(b)[:, None, None]
    kv_head = (jnp.arange(hq) // (hq // hkv))[None, None, :]
    lengths = bucket_lengths(t, buckets)

    def attend(n):
        def run(q, k, v, order, keep):
            j = jnp.arange(n + c)[None, None, :]
            own = start + j - keep[:, None, None]  # the chunk's keys right after the kept ones
            idx = jnp.where(j < keep[:, None, None], jnp.pad(order, ((0, 0), (0, 0), (0, c)))[..., :n + c], own)
            idx = jnp.clip(idx, 0, t - 1).transpose(0, 2, 1)  # [B, n + C, Hq]; past keep + C: never read
            kc, vc = k[rows, idx, kv_head], v[rows, idx, kv_head]  # [B, n + C, Hq, D]
            return chunk_prefill_attention(q, kc, vc, keep[0])
        return run

    keep = keep.astype(jnp.int32)
    if len(lengths) == 1:
        return attend(lengths[0])(q, k, v, order, keep)
    which = jnp.searchsorted(jnp.asarray(lengths, jnp.int32), jnp.max(keep), side="left")
    return jax.lax.switch(which, [attend(n) for n in lengths], q, k, v, order, keep)


def token_sparse_chunk_attention(q, k, v, start, lengths, *, tau=0.005, min_tokens=1024, window=128, pool=7,
                                 buckets: int = 8, keep_fraction: float | None = None, scores_impl: str = "auto",
                                 select: str = "sort", head_axis: str | None = None, query_heads: int | None = None):
    """Token Sparse Attention for one chunk of a chunked prefill (see above): ``q [B,C,Hq,D]``
    at positions ``start .. start + C - 1``, ``k, v [B,T,Hkv,D]`` the prompt's keys so far,
    ``lengths int32[B]`` -> ``[B,C,Hq,D]``. Exact chunked attention where nothing is dropped
    (a prefix of at most ``min_tokens``, or ``tau`` 0). ``select``: the kept keys by
    :func:`kept_tokens` and :func:`compress_order` ("sort") or one argsort
    (:func:`chunk_kept_order`, "argsort"): the same keys, so the same output up to the
    order of a sum. ``head_axis``: the mesh axis the heads are split over (tensor parallelism):
    the count comes from every device's heads, as :func:`token_sparse_attention`'s."""
    if select not in CHUNK_SELECTS:
        raise ValueError(f"select must be one of {CHUNK_SELECTS}, got {select!r}")
    if select == "argsort":
        scores, keep = chunk_scores_and_keep(q, k, start, lengths, tau=tau, min_tokens=min_tokens, window=window,
                                             pool=pool, keep_fraction=keep_fraction, scores_impl=scores_impl,
                                             head_axis=head_axis, query_heads=query_heads)
        return sparse_chunk_attention(q, k, v, start, None, keep, buckets=buckets,
                                      order=chunk_kept_order(scores, jnp.asarray(start, jnp.int32)))
    kept, keep = chunk_kept_keys(q, k, start, lengths, tau=tau, min_tokens=min_tokens, window=window, pool=pool,
                                 keep_fraction=keep_fraction, scores_impl=scores_impl, head_axis=head_axis,
                                 query_heads=query_heads)
    return sparse_chunk_attention(q, k, v, start, kept, keep, buckets=buckets)

