"""The decoder-only transformer (Flax NNX): its modules and the pure layer computations.

Architectures: the Llama family (RMSNorm, RoPE with an optional Llama-3
frequency scaling, SwiGLU MLP, grouped-query attention, optionally tied
embeddings; SmolLM2 is one), Qwen3 (the same plus a per-head RMSNorm on q
and k before RoPE, no attention bias) and Gemma 3 (q/k norms, norms before
and after attention and the MLP, tanh-GELU GeGLU, embeddings scaled by
``sqrt(hidden)``, RMSNorm multiplying in f32 by the weight as stored, local
and global layers: :mod:`models.config` lists what the config switches).

The module only holds parameters (named like the Hugging Face checkpoints:
``embed_tokens``, ``layers.self_attn.q_proj``, ... so the loaders map names
one to one). The decoder layers are stacked: every parameter of
``layers`` has a leading ``[L]`` axis (built with ``nnx.vmap``), so the layer
driver (:mod:`models.driver`) scans over them. The computations are pure
functions of ``(module, arrays)``; :mod:`models.programs` runs them through the
driver and jits ``forward / prefill / decode_step`` over the split params.

Attention goes only through the method interface of
:mod:`sparse_jax.methods.base`, called by the driver. The KV cache
(:class:`sparse_jax.cache.KVCache`) is head-major, stacked per segment of
identical layers, and holds post-RoPE keys.

RoPE uses Hugging Face's half-split ("rotate_half") layout: the pair rotated
together is ``(x[i], x[i + D/2])``. The GGUF loader undoes llama.cpp's
interleaved-pair row permutation of ``q_proj``/``k_proj`` so the weights match.

Numerics: matmuls run in the parameter dtype with f32 accumulation where it
matters (logits); RMSNorm statistics, RoPE and the attention softmax run in
f32; logits are returned in f32.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.config import ModelConfig, RopeScaling
from sparse_jax.ops._dispatch import on_gpu

# -----------------------------------------------------------------------------
# Pieces (pure functions; tested against NumPy)
# -----------------------------------------------------------------------------


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, weight_f32: bool = False) -> jax.Array:
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last axis; statistics in f32.

    ``weight_f32``: multiply by the weight in f32 and cast after (Gemma's order);
    otherwise cast, then multiply in ``x.dtype`` (Llama's). Equal in f32."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if weight_f32:
        return (y * weight.astype(jnp.float32)).astype(x.dtype)
    return y.astype(x.dtype) * weight.astype(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> np.ndarray:
    """RoPE inverse frequencies ``float32[head_dim // 2]``, with Llama-3 scaling if given.

    Llama-3 scaling: wavelength ``w = 2 pi / f``. With ``L = original_max_position``,
    ``w > L / low`` -> ``f / factor``; ``w < L / high`` -> ``f``; in between
    ``(1 - s) f / factor + s f`` with ``s = (L / w - low) / (high - low)``.
    """
    inv = 1.0 / (np.float32(theta) ** (np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)))
    inv = inv.astype(np.float32)
    if scaling is None:
        return inv
    if scaling.rope_type != "llama3":
        raise ValueError(f"unsupported rope scaling type {scaling.rope_type!r} (supported: llama3)")
    factor, low, high = scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor
    old = scaling.original_max_position
    low_wavelen, high_wavelen = old / low, old / high
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_cos_sin(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """``cos, sin`` of ``positions[..., None] * inv_freq``: shape ``positions.shape + (D/2,)``, f32."""
    ang = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    return jnp.cos(ang), jnp.sin(ang)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate ``x [..., H, D]`` in half-split layout; ``cos, sin`` broadcast to ``[..., 1, D/2]``."""
    half = x.shape[-1] // 2
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos[..., None, :], sin[..., None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


def matmul(x: jax.Array, w: jax.Array, dims, preferred_element_type=None) -> jax.Array:
    """``lax.dot_general(x, w, dims)``, working around XLA:CPU's slow bf16/f16
    matrix-vector path: with a single row it is several times slower than with
    two (docs/models.md, 'CPU performance', item 3), so a lone row is duplicated
    on CPU. No effect on GPU or in f32."""
    rows = math.prod(x.shape[:-1])
    if rows == 1 and x.dtype != jnp.float32 and not on_gpu():
        y = jax.lax.dot_general(jnp.concatenate([x, x], axis=0), w, dims, preferred_element_type=preferred_element_type)
        return y[:1]
    return jax.lax.dot_general(x, w, dims, preferred_element_type=preferred_element_type)


# -----------------------------------------------------------------------------
# Modules (parameters only; names follow the HF checkpoints)
# -----------------------------------------------------------------------------


def _normal(rngs: nnx.Rngs, shape, dtype, std: float) -> jax.Array:
    # Drawn directly in the target dtype: no f32 copy of big matrices.
    return (jax.random.normal(rngs.params(), shape, dtype) * jnp.asarray(std, dtype)).astype(dtype)


class Linear(nnx.Module):
    """``y = x @ kernel`` with ``kernel [in, out]`` (no bias)."""

    def __init__(self, din: int, dout: int, *, dtype, rngs: nnx.Rngs):
        self.kernel = nnx.Param(_normal(rngs, (din, dout), dtype, din**-0.5))

    def __call__(self, x: jax.Array) -> jax.Array:
        return matmul(x, self.kernel[...], (((x.ndim - 1,), (0,)), ((), ())))


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, dtype, weight_f32: bool = False):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps
        self.weight_f32 = weight_f32

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight[...], self.eps, self.weight_f32)


class Embed(nnx.Module):
    """Token embedding; ``scale`` (Gemma: ``sqrt(hidden)``) multiplies the rows, cast
    to the weight dtype first as Gemma does (25.25 in bf16, 25.298 in f32)."""

    def __init__(self, vocab: int, dim: int, *, dtype, rngs: nnx.Rngs, scale: float | None = None):
        self.weight = nnx.Param(_normal(rngs, (vocab, dim), dtype, 0.02))
        self.scale = scale

    def __call__(self, tokens: jax.Array) -> jax.Array:
        w = self.weight[...]
        x = jnp.take(w, tokens, axis=0)
        return x if self.scale is None else x * jnp.asarray(self.scale, w.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.q_proj = Linear(h, cfg.num_heads * d, dtype=dtype, rngs=rngs)
        self.k_proj = Linear(h, cfg.num_kv_heads * d, dtype=dtype, rngs=rngs)
        self.v_proj = Linear(h, cfg.num_kv_heads * d, dtype=dtype, rngs=rngs)
        self.o_proj = Linear(cfg.num_heads * d, h, dtype=dtype, rngs=rngs)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_eps, dtype=dtype, weight_f32=cfg.sandwich_norms)
            self.k_norm = RMSNorm(d, cfg.rms_eps, dtype=dtype, weight_f32=cfg.sandwich_norms)
        else:
            self.q_norm = self.k_norm = None
        # every attention path scales scores by head_dim ** -0.5; a model with another
        # scale (query_pre_attn_scalar) gets the ratio folded into q
        self.q_factor = cfg.query_scale_factor

    def qkv(self, x: jax.Array, cos: jax.Array, sin: jax.Array):
        """``x [..., H]`` -> post-RoPE ``q [..., Hq, D]``, ``k, v [..., Hkv, D]``."""
        lead = x.shape[:-1]
        q = self.q_proj(x).reshape(*lead, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(*lead, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(*lead, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, cos, sin)
        if self.q_factor != 1.0:
            q = q * jnp.asarray(self.q_factor, q.dtype)
        return q, apply_rope(k, cos, sin), v

    def out(self, o: jax.Array) -> jax.Array:
        """``o [..., Hq, D]`` -> ``[..., H]``."""
        return self.o_proj(o.reshape(*o.shape[:-2], self.num_heads * self.head_dim))


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = Linear(h, i, dtype=dtype, rngs=rngs)
        self.up_proj = Linear(h, i, dtype=dtype, rngs=rngs)
        self.down_proj = Linear(i, h, dtype=dtype, rngs=rngs)
        # Gemma: GeGLU with the tanh approximation (HF "gelu_pytorch_tanh"); else SwiGLU
        self.gelu_tanh = cfg.arch == "gemma3"

    def __call__(self, x: jax.Array) -> jax.Array:
        g = self.gate_proj(x)
        act = jax.nn.gelu(g, approximate=True) if self.gelu_tanh else jax.nn.silu(g)
        return self.down_proj(act * self.up_proj(x))


class DecoderLayer(nnx.Module):
    """One layer's parameters. Llama / Qwen3: ``input_layernorm`` before attention,
    ``post_attention_layernorm`` before the MLP (HF's names). Gemma 3 (sandwich
    norms, HF's names too): ``post_attention_layernorm`` on the attention output,
    ``pre_feedforward_layernorm`` / ``post_feedforward_layernorm`` around the MLP."""

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        f32 = cfg.sandwich_norms
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps, dtype=dtype, weight_f32=f32)
        self.self_attn = Attention(cfg, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps, dtype=dtype, weight_f32=f32)
        self.mlp = MLP(cfg, dtype=dtype, rngs=rngs)
        if cfg.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps, dtype=dtype, weight_f32=True)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps, dtype=dtype, weight_f32=True)
        else:
            self.pre_feedforward_layernorm = self.post_feedforward_layernorm = None


def stacked_layers(cfg: ModelConfig, dtype, rngs: nnx.Rngs) -> DecoderLayer:
    """``cfg.num_layers`` decoder layers as one module whose parameters carry a leading ``[L]`` axis."""

    @nnx.split_rngs(splits=cfg.num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, axis_size=cfg.num_layers)
    def make(r):
        return DecoderLayer(cfg, dtype=dtype, rngs=r)

    return make(rngs)


@functools.lru_cache(maxsize=32)
def layer_graphdef(cfg: ModelConfig, dtype) -> nnx.GraphDef:
    """The GraphDef of one (unstacked) decoder layer: ``nnx.merge`` it with a row of
    ``params["layers"]``."""
    return nnx.split(nnx.eval_shape(lambda: DecoderLayer(cfg, dtype=dtype, rngs=nnx.Rngs(0))))[0]


class Transformer(nnx.Module):
    """Parameters of a Llama-family / Qwen3 decoder. ``lm_head`` is None when tied;
    ``layers`` is one :class:`DecoderLayer` with every parameter stacked ``[L, ...]``."""

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.bfloat16, rngs: nnx.Rngs):
        self.embed_tokens = Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs, scale=cfg.embed_scale)
        self.layers = stacked_layers(cfg, dtype, rngs)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps, dtype=dtype, weight_f32=cfg.sandwich_norms)
        self.lm_head = None if cfg.tie_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, dtype=dtype, rngs=rngs)

    def logits(self, x: jax.Array) -> jax.Array:
        """Final norm + LM head: ``x [..., H]`` -> f32 ``[..., V]``."""
        tied = self.lm_head is None
        w = self.embed_tokens.weight[...] if tied else self.lm_head.kernel[...]
        return head_logits(x, self.norm.weight[...], w, eps=self.norm.eps, tied=tied,
                           norm_weight_f32=self.norm.weight_f32)


def head_logits(x: jax.Array, norm_weight: jax.Array, w: jax.Array, *, eps: float, tied: bool,
                norm_weight_f32: bool = False) -> jax.Array:
    """Final RMSNorm and LM head: ``x [..., H]`` -> f32 ``[..., V]``; ``w`` is the
    embedding ``[V, H]`` when ``tied``, else ``lm_head [H, V]`` (the tied head is the
    unscaled embedding, also on Gemma)."""
    x = rms_norm(x, norm_weight, eps, norm_weight_f32)
    # tied: contract with the embedding's hidden axis directly; a `.T` here makes
    # XLA:CPU materialise the transposed [H, V] matrix every call (slower: docs/models.md,
    # 'CPU performance')
    dims = (((x.ndim - 1,), (1 if tied else 0,)), ((), ()))
    return matmul(x, w, dims, preferred_element_type=jnp.float32)


# -----------------------------------------------------------------------------
# Pure computations on a (merged) module
# -----------------------------------------------------------------------------


def _inv_freq(cfg: ModelConfig) -> np.ndarray:
    return rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)


def rope_for(cfg: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``cos, sin`` of the model's RoPE at ``positions`` (``positions.shape + (D/2,)``)."""
    return rope_cos_sin(positions, _inv_freq(cfg))


def _token_slices(token_chunk: int | None, x: jax.Array) -> int:
    """The slice length ``x [B, T, ...]`` runs in (0: whole): ``token_chunk`` where ``T`` is
    longer than it (the last slice may be shorter)."""
    if not token_chunk or x.ndim < 3 or x.shape[1] <= token_chunk:
        return 0
    return token_chunk


def _map_token_slices(fn, c: int, batched: tuple, shared: tuple = ()):
    """``fn(*batched, *shared)`` run on ``c`` tokens at a time: each of ``batched`` is
    ``[B, T, ...]`` and each of ``shared`` ``[T, ...]`` (no batch axis, e.g. RoPE's ``cos,
    sin``); ``fn``'s outputs (a pytree of ``[B, c, ...]``) come back joined along ``T``. Exact
    for per-token blocks; what a slice holds is what the program holds. A ``fori_loop`` reads
    each whole slice in place and writes its outputs into buffers of the whole prompt (a
    ``lax.map`` over split inputs held a copy of each input and a stacked copy of each output:
    1 GiB each for a 128K prompt's hidden state on the Qwen3-8B shape); a ``T`` that is not a
    multiple of ``c`` runs its last ``T mod c`` tokens as one shorter slice after the loop. The
    capacity check's bucket is such a length (133,056 tokens for a 133,120 cache): sliced only
    where ``T`` was a multiple, its program held 10.25 GiB on the H100 against 2.56 at 131,072
    (benchmark C, 2026-12-06)."""
    b, t = batched[0].shape[:2]
    n, tail = divmod(t, c)

    def piece(a, start, size, axis):
        return jax.lax.dynamic_slice_in_dim(a, start, size, axis=axis)

    def run(start, size):
        return fn(*(piece(a, start, size, 1) for a in batched), *(piece(a, start, size, 0) for a in shared))

    def write(out, y, start):
        return jax.tree.map(lambda o, yi: jax.lax.dynamic_update_slice_in_dim(o, yi, start, axis=1), out, y)

    shapes = jax.eval_shape(fn, *(jax.ShapeDtypeStruct((b, c) + a.shape[2:], a.dtype) for a in batched),
                            *(jax.ShapeDtypeStruct((c,) + a.shape[1:], a.dtype) for a in shared))
    out = jax.tree.map(lambda sd: jnp.zeros((b, t) + sd.shape[2:], sd.dtype), shapes)
    out = jax.lax.fori_loop(0, n, lambda i, out: write(out, run(i * c, c), i * c), out)
    return write(out, run(n * c, tail), n * c) if tail else out


def layer_qkv(layer: DecoderLayer, x: jax.Array, cos: jax.Array, sin: jax.Array, token_chunk: int | None = None):
    """Pre-norm and projections of one layer: post-RoPE ``q, k, v`` of ``x [..., H]``.

    ``token_chunk``: for ``x [B, T, H]`` (``cos, sin [T, D/2]``) with ``T`` longer than it, the
    block runs on ``token_chunk`` tokens at a time (as :func:`layer_output`):
    the norms and RoPE's f32 intermediates are a slice's, not the prompt's (at 128K on the
    Qwen3-8B shape the queries alone are 2 GiB in f32)."""
    c = _token_slices(token_chunk, x) if cos.ndim == 2 and cos.shape[0] == x.shape[1] else 0
    if c:
        return _map_token_slices(lambda xs, cs, sn: layer_qkv(layer, xs, cs, sn), c, (x,), (cos, sin))
    return layer.self_attn.qkv(layer.input_layernorm(x), cos, sin)


def layer_output(layer: DecoderLayer, x: jax.Array, o: jax.Array,
                 reduce: Callable[[jax.Array], jax.Array] | None = None, token_chunk: int | None = None) -> jax.Array:
    """The attention output ``o [..., Hq, D]`` added to ``x``, then the MLP block
    (Gemma 3: each branch normed before it is added).

    ``reduce``: applied to the output projection's and the MLP's results before they
    are added (tensor parallelism: a ``psum`` of the row-parallel partial sums; it
    comes before Gemma's post-norms, which need the whole sum).

    ``token_chunk``: for ``x [B, T, H]`` with ``T`` longer than it, the block runs on
    ``token_chunk`` tokens at a time (:func:`_map_token_slices`; every op here is per token): a long
    prompt's MLP activations ``[T, intermediate]`` are not held at once. At 128K tokens on the
    Qwen3-8B shape they were most of a layer program's 10.3 GiB of temporaries, which the
    offloaded engine's capacity check counts beside its batch (benchmark C, 2026-12-06)."""
    c = _token_slices(token_chunk, x)
    if c:
        return _map_token_slices(lambda xs, os_: layer_output(layer, xs, os_, reduce), c, (x, o))
    reduce = reduce or (lambda y: y)
    if layer.pre_feedforward_layernorm is not None:
        x = x + layer.post_attention_layernorm(reduce(layer.self_attn.out(o)))
        return x + layer.post_feedforward_layernorm(reduce(layer.mlp(layer.pre_feedforward_layernorm(x))))
    x = x + reduce(layer.self_attn.out(o))
    return x + reduce(layer.mlp(layer.post_attention_layernorm(x)))


def last_valid(x: jax.Array, lengths: jax.Array) -> jax.Array:
    """``x [B, T, ...]`` at each row's last valid position ``lengths - 1`` -> ``[B, ...]``."""
    idx = (lengths - 1).astype(jnp.int32).reshape((-1,) + (1,) * (x.ndim - 1))
    return jnp.take_along_axis(x, idx, axis=1)[:, 0]


# -----------------------------------------------------------------------------
# Construction and the jitted pure functions
# -----------------------------------------------------------------------------


def abstract_model(cfg: ModelConfig, dtype=jnp.bfloat16) -> tuple[nnx.GraphDef, nnx.State]:
    """GraphDef and abstract (ShapeDtypeStruct) params; allocates nothing."""
    return nnx.split(nnx.eval_shape(lambda: Transformer(cfg, dtype=dtype, rngs=nnx.Rngs(0))))


def init_params(cfg: ModelConfig, dtype=jnp.bfloat16, seed: int = 0) -> tuple[nnx.GraphDef, nnx.State]:
    """Random parameters drawn under ``jit`` directly in ``dtype`` (cheap even for 8B)."""
    graphdef, _ = abstract_model(cfg, dtype)
    return graphdef, _init_fn(cfg, jnp.dtype(dtype))(jax.random.key(seed))


@functools.lru_cache(maxsize=16)
def _init_fn(cfg: ModelConfig, dtype):
    @jax.jit
    def make(key):
        return nnx.state(Transformer(cfg, dtype=dtype, rngs=nnx.Rngs(params=key)))

    return make
