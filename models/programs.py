"""The model's jitted programs: ``forward``, ``prefill`` and ``decode_step`` of a
:class:`models.transformer.Transformer` under an attention method, each one pass of the
layer driver (:mod:`models.driver`) between the embedding and the LM head, and
:func:`build_functions`, which jits them over the split params with the cache donated
and the method static (closed over)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import ModelConfig
from models.driver import Driver, layer_rows
from models.transformer import Transformer, last_valid, layer_graphdef
from sparse_jax.cache import KVCache
from sparse_jax.methods.base import AttentionMethod


def _driver(graphdef_layers: nnx.GraphDef, cfg: ModelConfig, method: AttentionMethod, unroll: bool,
            tp: tuple[str, int] | None = None):
    if tp is None:
        return Driver(cfg, method, graphdef_layers, unroll)
    return Driver(cfg, method, graphdef_layers, unroll, tp_axis=tp[0], tp_size=tp[1])


def forward(model: Transformer, cfg: ModelConfig, method: AttentionMethod, tokens: jax.Array, *,
            unroll: bool = False, tp: tuple[str, int] | None = None) -> jax.Array:
    """Whole sequences, no cache: ``tokens int32[B, T]`` -> f32 logits ``[B, T, V]``.

    ``tp``: ``(mesh axis, size)`` when running inside ``shard_map`` on one device's KV
    heads (:mod:`models.runtime.sharding`; ``cfg`` is then the per-device config)."""
    drv = _driver(layer_graphdef(cfg, _dtype_of(model)), cfg, method, unroll, tp)
    x = drv.forward(nnx.state(model.layers), model.embed_tokens(tokens))
    return model.logits(x)


def prefill(model: Transformer, cfg: ModelConfig, method: AttentionMethod, tokens: jax.Array,
            lengths: jax.Array, cache: KVCache, *, unroll: bool = False,
            tp: tuple[str, int] | None = None) -> tuple[jax.Array, KVCache]:
    """Prefill right-padded ``tokens int32[B, T]`` (row ``b`` valid up to ``lengths[b]``)
    into an empty ``cache``; return the f32 logits ``[B, V]`` at each row's last valid
    position and the cache (``lengths`` set)."""
    drv = _driver(layer_graphdef(cfg, _dtype_of(model)), cfg, method, unroll, tp)
    x, cache = drv.prefill(nnx.state(model.layers), model.embed_tokens(tokens), lengths.astype(jnp.int32), cache)
    return model.logits(last_valid(x, lengths)), cache


def prefill_chunk(model: Transformer, cfg: ModelConfig, method: AttentionMethod, tokens: jax.Array,
                  start: jax.Array, lengths: jax.Array, cache: KVCache, *, kv_len: int, last: bool,
                  layers: tuple[int, int] | None = None, unroll: bool = False,
                  tp: tuple[str, int] | None = None) -> tuple[jax.Array | None, KVCache]:
    """One chunk ``tokens int32[1, C]`` at positions ``start ..`` of a prompt of ``lengths
    [1]`` tokens into a paged one-row view (:meth:`models.driver.Driver.prefill_chunk`):
    the f32 logits ``[1, V]`` at the prompt's last token when ``last``, else None, and the
    cache (its pages written; with ``last``, the method's state). ``tp``: as :func:`forward`.

    ``layers`` ``(lo, hi)``: the model layers ``[lo, hi)`` only (a chunk cut by layers);
    where ``lo > 0``, ``tokens`` is the hidden state ``[1, C, H]`` the previous part returned,
    and where ``hi`` is not the last layer the hidden state after layer ``hi - 1`` is
    returned in place of the logits (the cache: those layers' pages and, with ``last``,
    their method states)."""
    lo, hi = (0, cfg.num_layers) if layers is None else layers
    drv = _driver(layer_graphdef(cfg, _dtype_of(model)), cfg, method, unroll, tp)
    x = model.embed_tokens(tokens) if lo == 0 else tokens
    x, cache = drv.prefill_chunk(nnx.state(model.layers), x, start, lengths.astype(jnp.int32), cache, kv_len, last,
                                 layers=layers)
    if hi < cfg.num_layers:
        return x, cache
    return (model.logits(last_valid(x, lengths - start)) if last else None), cache


def decode_step(model: Transformer, cfg: ModelConfig, method: AttentionMethod, tokens: jax.Array,
                cache: KVCache, *, unroll: bool = False,
                tp: tuple[str, int] | None = None) -> tuple[jax.Array, KVCache]:
    """One token per row ``tokens int32[B]`` at positions ``cache.lengths``: f32 logits
    ``[B, V]`` and the cache with the token appended (``lengths + 1``)."""
    drv = _driver(layer_graphdef(cfg, _dtype_of(model)), cfg, method, unroll, tp)
    x, cache = drv.decode(nnx.state(model.layers), model.embed_tokens(tokens), cache)
    return model.logits(x), cache


def prompt_logprobs(model: Transformer, cfg: ModelConfig, method: AttentionMethod, tokens: jax.Array,
                    top_n: int, *, unroll: bool = False, chunk: int = 64):
    """The model's log-probabilities over a prompt ``tokens int32[B, T]`` (``T`` a multiple
    of ``chunk``): ``(next f32[B, T], top_ids int32[B, T, top_n], top f32[B, T, top_n])``,
    at position ``t`` the f32 log-softmax of the logits there (what predicts token ``t + 1``)
    taken at token ``t + 1`` (the last position's entry is meaningless), and its ``top_n``
    most likely tokens. The LM head runs ``chunk`` positions at a time: the ``[T, V]``
    logits of a long prompt never exist at once."""
    drv = _driver(layer_graphdef(cfg, _dtype_of(model)), cfg, method, unroll)
    x = drv.forward(nnx.state(model.layers), model.embed_tokens(tokens))
    b, t, d = x.shape
    nxt = jnp.concatenate([tokens[:, 1:], tokens[:, :1]], axis=1)  # the token each position predicts
    xs = x.reshape(b, t // chunk, chunk, d).swapaxes(0, 1)
    ns = nxt.reshape(b, t // chunk, chunk).swapaxes(0, 1)

    def one(args):
        xc, nc = args
        lp = jax.nn.log_softmax(model.logits(xc), axis=-1)  # f32 [B, chunk, V]
        chosen = jnp.take_along_axis(lp, nc[..., None].astype(jnp.int32), axis=-1)[..., 0]
        if top_n == 0:
            return chosen, jnp.zeros((b, chunk, 0), jnp.int32), jnp.zeros((b, chunk, 0), jnp.float32)
        top, ids = jax.lax.top_k(lp, top_n)
        return chosen, ids.astype(jnp.int32), top

    chosen, ids, top = jax.lax.map(one, (xs, ns))
    back = lambda a: a.swapaxes(0, 1).reshape((b, t) + a.shape[3:])  # noqa: E731
    return back(chosen), back(ids), back(top)


@functools.lru_cache(maxsize=32)
def prompt_logprobs_fn(graphdef: nnx.GraphDef, cfg: ModelConfig, method: AttentionMethod, top_n: int,
                       unroll: bool | None = None) -> Callable[..., tuple[jax.Array, jax.Array, jax.Array]]:
    """:func:`prompt_logprobs` jitted over the split params: ``fn(params, tokens)``."""
    unroll = default_unroll() if unroll is None else unroll

    def _fn(params, tokens):
        return prompt_logprobs(nnx.merge(graphdef, params), cfg, method, tokens, top_n, unroll=unroll)

    return jax.jit(_fn)


def _dtype_of(model: Transformer):
    return model.embed_tokens.weight[...].dtype


@dataclasses.dataclass(frozen=True)
class ModelFunctions:
    """Jitted pure functions of the split params (the method is closed over, static).

    ``forward(params, tokens) -> logits [B,T,V]``;
    ``prefill(params, tokens, lengths, cache) -> (logits [B,V], cache)`` (cache donated);
    ``decode_step(params, tokens, cache) -> (logits [B,V], cache)`` (cache donated), right
    for any row at any step; ``steady_decode_step``: the same signature, built from the
    method's :meth:`~sparse_jax.methods.base.AttentionMethod.steady_state`, right for rows
    past their first ``warmup_steps`` decode steps (AsyncSpade's ``dense_steps``: without
    the warm-up's per-layer branch); None where the method has no warm-up. Callers that
    count steps pick with :meth:`decode_at`.
    """

    forward: Callable[..., jax.Array]
    prefill: Callable[..., tuple[jax.Array, KVCache]]
    decode_step: Callable[..., tuple[jax.Array, KVCache]]
    steady_decode_step: Callable[..., tuple[jax.Array, KVCache]] | None = None
    warmup_steps: int = 0

    def decode_at(self, step: int) -> Callable[..., tuple[jax.Array, KVCache]]:
        """The decode program for a batch in which every row is at least at its ``step``-th
        decode step after its prompt (1: the first): :attr:`decode_step` within the
        method's warm-up, :attr:`steady_decode_step` past it (the same logits and cache)."""
        if self.steady_decode_step is None or step <= self.warmup_steps:
            return self.decode_step
        return self.steady_decode_step


def default_unroll() -> bool:
    """Whether the layer driver unrolls by default: on the GPU, where a scanned layer's
    cache slice costs a copy per layer and step (``sparse_jax/cache.py``); elsewhere
    the scan, which compiles several times faster (the CPU's decode step is unrolled
    all the same, over :class:`models.driver.LayerRows`: :func:`rows_decode`)."""
    return jax.default_backend() == "gpu"


def rows_decode() -> bool:
    """Whether a default (``unroll=None``) decode step runs unrolled over
    :class:`models.driver.LayerRows`: off the GPU, where slicing a stacked weight copies it."""
    return not default_unroll()


class RowsStep:
    """A jitted step whose params' ``layers`` go in as :class:`models.driver.LayerRows`:
    called, lowered and compiled with the model's stacked params like any other step, it
    passes each layer's weights as arrays of their own (:func:`models.driver.layer_rows`,
    zero copies on the CPU; the last params' rows are kept, so a loop makes them once)."""

    def __init__(self, jitted):
        self.jitted = jitted
        self._last: tuple[Any, Any] | None = None  # (params, their rows form)

    def rows(self, params):
        if self._last is None or self._last[0] is not params:
            def leaf(path, a):
                return layer_rows(a) if getattr(path[0], "key", None) == "layers" else a

            self._last = (params, jax.tree_util.tree_map_with_path(leaf, params))
        return self._last[1]

    def __call__(self, params, *args):
        return self.jitted(self.rows(params), *args)

    def lower(self, params, *args) -> "_RowsStage":
        return _RowsStage(self, self.jitted.lower(self.rows(params), *args))


class _RowsStage:
    """A lowered or compiled :class:`RowsStep`: ``compile()`` and calls take the stacked
    params; anything else (``memory_analysis``, ``as_text``, ...) is the jax stage's."""

    def __init__(self, step: RowsStep, stage):
        self.step, self.stage = step, stage

    def compile(self, *args, **kwargs) -> "_RowsStage":
        return _RowsStage(self.step, self.stage.compile(*args, **kwargs))

    def __call__(self, params, *args):
        return self.stage(self.step.rows(params), *args)

    def __getattr__(self, name):
        return getattr(self.stage, name)


@functools.lru_cache(maxsize=32)
def build_functions(graphdef: nnx.GraphDef, cfg: ModelConfig, method: AttentionMethod,
                    unroll: bool | None = None) -> ModelFunctions:
    """The jitted functions; cached, so models with the same structure, config and
    method (e.g. loaded twice, or from a GGUF and from its HF export) share compilations.
    ``unroll``: the layer driver's segments unrolled instead of scanned (default:
    :func:`default_unroll`). By default the CPU's decode step is unrolled over the
    layers' rows (:class:`RowsStep`): scanned or sliced, each step copied every layer's
    weights, most of the step (docs/models.md, 'CPU performance'); its prefill and forward
    stay scanned (compute-bound; they compile faster)."""
    rows = unroll is None and rows_decode()
    if unroll is None:
        unroll = default_unroll()
    def _forward(params, tokens):
        return forward(nnx.merge(graphdef, params), cfg, method, tokens, unroll=unroll)

    def _prefill(params, tokens, lengths, cache):
        return prefill(nnx.merge(graphdef, params), cfg, method, tokens, lengths, cache, unroll=unroll)

    def decode_program(m):
        def _decode(params, tokens, cache):
            return decode_step(nnx.merge(graphdef, params), cfg, m, tokens, cache, unroll=unroll or rows)

        decode = jax.jit(_decode, donate_argnums=(2,))
        return RowsStep(decode) if rows else decode

    warm = method.warmup_steps
    return ModelFunctions(
        forward=jax.jit(_forward),
        # keep_unused: the prefill reads only the empty cache's shapes, and jit would drop an
        # unused argument with its donation: the new cache then needs memory of its own
        prefill=jax.jit(_prefill, donate_argnums=(3,), keep_unused=True),
        decode_step=decode_program(method),
        steady_decode_step=decode_program(method.steady_state()) if warm else None,
        warmup_steps=warm,
    )
