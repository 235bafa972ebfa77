"""Exact attention in XLA (jnp): the dense decode reference, masked decode attention,
and the prompt's causal attention (whole, blockwise on CPU, and by chunks).

These are the floor every method's dense path runs on: the dense decode op
(:func:`sparse_jax.ops.attention.dense_decode_attention`) falls back to
:func:`dense_decode_reference` off the GPU, the layer driver runs
:func:`dense_prefill_attention` / :func:`chunk_prefill_attention` on every prompt, and
the methods' masks and the tests' oracles use :func:`masked_decode_attention`.

Layouts: decode ``q [B,Hq,D]``, ``k, v [B,Hkv,S,D]`` (head-major cache); prefill
``q [B,T,Hq,D]``, ``k, v [B,T,Hkv,D]`` (token-major, as the projections make them).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.merge import MASK_VALUE, merge_normalized
from sparse_jax.ops._dispatch import on_gpu


def dense_decode_reference(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array) -> jax.Array:
    """Exact decode attention over the first ``lengths[b]`` slots of ``k, v [B,Hkv,S,D]``."""
    valid = jnp.arange(k.shape[2])[None, :] < lengths[:, None]  # [B, S]
    return masked_decode_attention(q, k, v, valid[:, None, :])


def masked_decode_attention(q: jax.Array, k: jax.Array, v: jax.Array, keep: jax.Array) -> jax.Array:
    """Exact decode attention over the tokens where ``keep`` is true.

    ``q [B,Hq,D]``, ``k, v [B,Hkv,S,D]``, ``keep`` bool broadcastable to
    ``[B,Hkv,S]``. f32 softmax; a row with nothing kept returns zeros.
    """
    b, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    qg = q.reshape(b, hkv, g, d)
    logits = jnp.einsum("bhgd,bhsd->bhgs", qg, k, preferred_element_type=jnp.float32) * (d**-0.5)
    keep = jnp.broadcast_to(keep, (b, hkv, k.shape[2]))[:, :, None, :]
    logits = jnp.where(keep, logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(keep, jnp.exp(logits - m), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    out = jnp.einsum("bhgs,bhsd->bhgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    out = out / jnp.where(denom > 0, denom, 1.0)
    return out.reshape(b, hq, d).astype(q.dtype)


def dense_prefill_attention(q: jax.Array, k: jax.Array, v: jax.Array, window: int | None = None) -> jax.Array:
    """Causal attention over the new tokens: ``q [B,T,Hq,D]``, ``k, v [B,T,Hkv,D]``;
    with ``window``, query ``t`` sees keys ``t - window + 1 .. t`` only (sliding window).

    Right-padded ragged rows need no extra mask: a valid query at position t
    only sees keys ``<= t``, all valid. GQA is passed to the backend as is (no
    repeated K/V). cuDNN needs bf16/f16 and a GPU; other GPU dtypes use XLA.
    On CPU, :func:`blockwise_causal_attention` (several times faster than XLA's
    version: docs/models.md, 'CPU performance'; XLA's materialises and re-reads
    the whole ``[T, T]`` score matrix).
    """
    if not on_gpu():
        return blockwise_causal_attention(q, k, v, window=window)
    impl = "cudnn" if q.dtype in (jnp.bfloat16, jnp.float16) else "xla"
    local = None if window is None else (window - 1, 0)
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl, local_window_size=local)


#: backends of :func:`chunk_prefill_attention`
CHUNK_ATTENTION_IMPLS = ("auto", "cudnn", "xla", "blockwise")


def _attention_lse(q, k, v, *, causal: bool, kv_len, implementation: str):
    """``(o [B,T,Hq,D], lse f32[B,T,Hq])``: attention of ``q`` over the first ``kv_len``
    (``[B]``) keys of ``k, v [B,S,Hkv,D]`` (causal: top-left aligned, ``T == S``) and
    the log-sum-exp of each query's scaled scores. cuDNN's softmax statistics are f32,
    but ``jax.nn.dot_product_attention(return_residual=True)`` casts them to the output
    dtype (bf16 would move a merge weight by up to 3%), so the cuDNN call is jax's
    own ``jax._src.cudnn`` entry, which returns them as they are (jax is pinned)."""
    b, t = q.shape[:2]
    q_len = jnp.full((b,), t, jnp.int32)
    if implementation == "cudnn":
        from jax._src.cudnn.fused_attention_stablehlo import MaskType
        from jax._src.cudnn.fused_attention_stablehlo import dot_product_attention as cudnn_attention

        o, lse = cudnn_attention(q, k, v, q_seqlen=q_len, kv_seqlen=kv_len, scale=q.shape[-1] ** -0.5,
                                 mask_type=MaskType.PADDING_CAUSAL if causal else MaskType.PADDING,
                                 return_residual=True)
        return o, jnp.swapaxes(lse.astype(jnp.float32), 1, 2)  # [B, Hq, T] -> [B, T, Hq]
    o, lse = jax.nn.dot_product_attention(q, k, v, is_causal=causal, query_seq_lengths=q_len,
                                          key_value_seq_lengths=kv_len, implementation=implementation,
                                          return_residual=True)
    return o, lse.astype(jnp.float32)


def chunk_prefill_attention(q: jax.Array, k: jax.Array, v: jax.Array, start: jax.Array | int,
                            window: int | None = None, implementation: str = "auto",
                            split: bool | None = None) -> jax.Array:
    """Causal attention of one chunk of a prompt over the keys so far (chunked prefill).

    ``q [B,C,Hq,D]`` holds the queries at positions ``start .. start + C - 1``
    (``start`` may be traced), ``k, v [B,T,Hkv,D]`` every position of the prompt
    (those past ``start + C - 1`` are never read: they may be stale). Returns
    ``[B,C,Hq,D]``; ``window`` as in :func:`dense_prefill_attention`.

    ``implementation``: ``"cudnn"`` (a GPU, bf16/f16), ``"xla"`` (the same calls
    through XLA's attention, which materialises the masks: tests only), ``"blockwise"``
    (:func:`blockwise_causal_attention` with ``q_offset=start``, the CPU path; a jnp
    loop of thousands of small kernels a chunk on a GPU, seconds a chunk at 98K on
    the H100: docs/architecture.md, 'Measured reasons for runtime and benchmark
    choices'), or ``"auto"``: cuDNN on a GPU for bf16/f16, else
    blockwise. For cuDNN and XLA, ``split`` picks the form:

    * split (the default without a window): the chunk's queries over the keys before
      it (no mask, key length ``start``) and over its own keys (causal, ``C x C``),
      merged by their log-sum-exps: exactly the scores the chunk needs.
    * padded (``split=False``; always with a window, whose first half is not a prefix):
      the chunk's queries at their positions in a ``[B, T]`` array of zeros, causal,
      with key lengths ``start + C``. cuDNN's causal mask is aligned at the top left,
      so the chunk gets exactly its keys; it skips keys past ``start + C`` but not the
      queries, so it does ``T x (start + C)``-ish work: more than twice the whole
      prompt's attention over the three chunks of a 98K prompt on the H100
      (docs/architecture.md, 'Measured reasons for runtime and benchmark choices').
    """
    if implementation not in CHUNK_ATTENTION_IMPLS:
        raise ValueError(f"implementation must be one of {CHUNK_ATTENTION_IMPLS}, got {implementation!r}")
    if implementation == "auto":
        implementation = "cudnn" if on_gpu() and q.dtype in (jnp.bfloat16, jnp.float16) else "blockwise"
    if implementation == "blockwise":
        return blockwise_causal_attention(q, k, v, window=window, q_offset=start)
    b, c = q.shape[:2]
    t = k.shape[1]
    start = jnp.asarray(start, jnp.int32)
    if split is None:
        split = window is None
    if split:
        if window is not None:
            raise ValueError("chunk_prefill_attention: the split form has no sliding window (use split=False)")
        # the keys before the chunk; a first chunk has none: one key, weighted out below
        o_pre, lse_pre = _attention_lse(q, k, v, causal=False, kv_len=jnp.full((b,), jnp.maximum(start, 1)),
                                        implementation=implementation)
        kc = jax.lax.dynamic_slice_in_dim(k, start, c, axis=1)
        vc = jax.lax.dynamic_slice_in_dim(v, start, c, axis=1)
        o_own, lse_own = _attention_lse(q, kc, vc, causal=True, kv_len=jnp.full((b,), c, jnp.int32),
                                        implementation=implementation)
        # a log-sum-exp is a partial's (m, l) with l = 1; a first chunk's prefix is the empty set
        lse_pre = jnp.where(start > 0, lse_pre, MASK_VALUE)
        one = jnp.ones_like(lse_own)
        o, _, _ = merge_normalized(o_pre, lse_pre, one, o_own, lse_own, one)
        return o.astype(q.dtype)
    q_full = jax.lax.dynamic_update_slice_in_dim(jnp.zeros((b, t) + q.shape[2:], q.dtype), q, start, axis=1)
    seen = jnp.full((b,), start + c, jnp.int32)
    local = None if window is None else (window - 1, 0)
    o = jax.nn.dot_product_attention(q_full, k, v, is_causal=True, query_seq_lengths=seen,
                                     key_value_seq_lengths=seen, local_window_size=local,
                                     implementation=implementation)
    return jax.lax.dynamic_slice_in_dim(o, start, c, axis=1)


def blockwise_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, block: int = 256,
                               window: int | None = None, q_offset: jax.Array | int = 0) -> jax.Array:
    """Causal attention in blocks with an online softmax (flash-attention in jnp).

    ``q [B,T,Hq,D]``, ``k, v [B,S,Hkv,D]`` -> ``[B,T,Hq,D]``; query ``i`` sits at position
    ``q_offset + i`` (a traced int is fine) and sees keys ``<=`` it, so ``S`` may exceed
    ``T``: a chunk of a prompt over the keys of the chunks before it and its own
    (``S >= q_offset + T``; keys past a query are masked). ``window``: sliding window
    (keys ``t - window + 1 .. t``). A scan over query blocks; for each, a loop over the
    key blocks it can see only (up to the diagonal and, with a window, from the window's
    first block), each ``[G*block, block]`` score tile small enough to stay in cache. f32
    scores and accumulators. On 2 CPU cores (T=4000, Hq=9, Hkv=3, D=64, f32) it is
    several times faster than ``jax.nn.dot_product_attention(implementation="xla")``
    (docs/models.md, 'CPU performance', item 1).
    """
    b, t, hq, d = q.shape
    s_len, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    c = min(block, -(-t // 8) * 8)
    tp = -(-t // c) * c
    sp = -(-s_len // c) * c
    nb, nkb = tp // c, sp // c

    def pad(x, n):
        return jnp.pad(x, ((0, 0), (0, n - x.shape[1]), (0, 0), (0, 0)))

    qs = (pad(q, tp) * jnp.asarray(d**-0.5, q.dtype)).reshape(b, nb, c, hkv, g, d).transpose(1, 0, 3, 4, 2, 5)
    kp = pad(k, sp).transpose(0, 2, 1, 3)  # [B, Hkv, Sp, D]
    vp = pad(v, sp).transpose(0, 2, 1, 3)

    def per_query_block(_, xs):
        i, qi = xs  # qi [B, Hkv, G, c, D]
        start = q_offset + i * c  # the block's first query position
        qpos = start + jnp.arange(c)

        def body(j, carry):
            m, l, acc = carry
            kb = jax.lax.dynamic_slice_in_dim(kp, j * c, c, axis=2)
            vb = jax.lax.dynamic_slice_in_dim(vp, j * c, c, axis=2)
            s = jnp.einsum("bhgqd,bhkd->bhgqk", qi, kb, preferred_element_type=jnp.float32)
            kpos = j * c + jnp.arange(c)
            seen = qpos[:, None] >= kpos[None, :]
            if window is not None:
                seen &= qpos[:, None] - kpos[None, :] < window
            s = jnp.where(seen, s, -jnp.inf)
            m_new = jnp.maximum(m, s.max(-1))
            # a tile this query sees nothing of (window): keep exp() finite
            m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
            p = jnp.exp(s - m_safe[..., None])
            corr = jnp.exp(jnp.where(jnp.isfinite(m), m - m_safe, -jnp.inf))
            pv = jnp.einsum("bhgqk,bhkd->bhgqd", p.astype(vb.dtype), vb, preferred_element_type=jnp.float32)
            return m_new, l * corr + p.sum(-1), acc * corr[..., None] + pv

        init = (jnp.full((b, hkv, g, c), -jnp.inf, jnp.float32), jnp.zeros((b, hkv, g, c), jnp.float32),
                jnp.zeros((b, hkv, g, c, d), jnp.float32))
        first = 0 if window is None else jnp.maximum(0, (start - window + 1) // c)
        last = jnp.minimum((start + c - 1) // c, nkb - 1)  # the block of the block's last query
        _, l, acc = jax.lax.fori_loop(first, last + 1, body, init)
        # padded queries past the keys see nothing: l = 0 (their rows are dropped below)
        return None, (acc / jnp.where(l > 0, l, 1.0)[..., None]).astype(q.dtype)

    _, out = jax.lax.scan(per_query_block, None, (jnp.arange(nb), qs))  # [nb, B, Hkv, G, c, D]
    return out.transpose(1, 0, 4, 2, 3, 5).reshape(b, tp, hq, d)[:, :t]
