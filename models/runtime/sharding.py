"""Several devices through JAX's own sharding: tensor parallelism over KV heads
and data-parallel replicas over batch rows.

A :class:`Parallelism` names a 2-D device mesh ``("data", "model")``:

* ``model``: tensor parallelism over KV heads (Megatron-style). Attention, the
  method's selection and its state are independent per KV head, so each device
  holds ``Hkv / model`` KV heads with their query heads: the q/k/v and MLP
  gate/up projections are split by columns, the output and MLP down
  projections by rows, and the two row-parallel results are summed with one
  ``psum`` each per layer (:meth:`models.driver.Driver._reduce`). The KV cache
  ``[B, Hkv, S, D]`` and every per-head piece of the method's state are split
  on the head axis; the embedding, the norms and the LM head are replicated.
* ``data``: replicas over batch rows: tokens, the cache and the state split
  on the batch axis, the weights replicated.

The whole step (a prefill, one decode step) is **one** ``shard_map`` over the
unchanged driver, run on each device's shard with the per-device config
(:func:`local_config`): the Pallas kernels see their device's heads and need no
change, and one device is the same code with a 1x1 mesh. Which axis of each
cache / state leaf is split is not written down per method: it is read off
the method's own ``init_state`` by comparing the shapes it builds for the whole
model and for one device (:func:`cache_specs`).

A model whose KV heads do not divide over ``model`` devices (SmolLM2: 3 KV
heads) is padded first (:func:`pad_kv_heads`): zero query/key/value columns
and zero output rows make the extra heads contribute exactly nothing.

Multi-host: the same functions run under ``jax.distributed.initialize()`` with
the mesh built over ``jax.devices()`` of every host; ``docs/sharding.md`` says
what crosses the network per step.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from models.api import Model, bind_method, method_for_model, round_up
from models.config import ModelConfig
from models.driver import init_cache as driver_init_cache
from models.programs import ModelFunctions, decode_step, default_unroll, forward, prefill
from models.transformer import abstract_model
from sparse_jax.cache import KVCache, paged_like
from sparse_jax.methods.base import AttentionMethod

DATA, MODEL = "data", "model"

# Parameters split over the model axis, by the tail of their path (stacked [L, in, out]):
# column-parallel (axis 2: output features, head-major) and row-parallel (axis 1).
_COLUMN = ("q_proj.kernel", "k_proj.kernel", "v_proj.kernel", "gate_proj.kernel", "up_proj.kernel")
_ROW = ("o_proj.kernel", "down_proj.kernel")


@dataclasses.dataclass(frozen=True)
class Parallelism:
    """``data`` replicas x ``model``-way tensor parallelism over KV heads."""

    data: int = 1
    model: int = 1

    @property
    def size(self) -> int:
        return self.data * self.model

    def mesh(self, devices=None) -> Mesh:
        """The ``("data", "model")`` mesh over the first ``size`` devices (default: ``jax.devices()``)."""
        devices = list(jax.devices() if devices is None else devices)
        if self.data < 1 or self.model < 1:
            raise ValueError(f"parallelism sizes must be >= 1, got data={self.data} model={self.model}")
        if len(devices) < self.size:
            raise ValueError(f"data={self.data} x model={self.model} needs {self.size} devices; "
                             f"{len(devices)} visible ({devices[0].platform}). On CPU, set "
                             f"XLA_FLAGS=--xla_force_host_platform_device_count={self.size} before jax starts")
        return Mesh(np.asarray(devices[: self.size]).reshape(self.data, self.model), (DATA, MODEL))

    @staticmethod
    def of(mesh: Mesh) -> "Parallelism":
        return Parallelism(mesh.shape[DATA], mesh.shape[MODEL])


def check_model(cfg: ModelConfig, model: int) -> None:
    """Clear errors for a config that cannot split ``model`` ways over KV heads."""
    if cfg.num_kv_heads % model:
        raise ValueError(f"{cfg.name}: {cfg.num_kv_heads} KV heads do not split over {model} devices; "
                         f"pad them first (models.runtime.sharding.pad_kv_heads(cfg, params, {model}))")
    if cfg.intermediate_size % model:
        raise ValueError(f"{cfg.name}: the MLP width {cfg.intermediate_size} does not split over {model} devices")


def local_config(cfg: ModelConfig, model: int) -> ModelConfig:
    """The config one device runs under ``model``-way tensor parallelism: its share
    of the query heads, KV heads and MLP width (the hidden size and vocabulary whole)."""
    check_model(cfg, model)
    if model == 1:
        return cfg
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // model, num_kv_heads=cfg.num_kv_heads // model,
                               intermediate_size=cfg.intermediate_size // model)


def pad_kv_heads(cfg: ModelConfig, params, multiple: int, method: AttentionMethod | None = None):
    """``(cfg, params[, method])`` with the KV heads padded up to a multiple of
    ``multiple``, each new KV head with its group of query heads. The new heads'
    q/k/v columns and output-projection rows are zero: their keys and values are
    zero, so their attention output is zero and nothing reaches the residual
    stream; the logits are those of the original model. A method with per-head
    calibration (Double Sparsity's channels) gets the new heads' rows copied
    from head 0 (any valid row: the head's output is zero whatever it selects)."""
    hkv = cfg.num_kv_heads
    new = -(-hkv // multiple) * multiple
    if new == hkv:
        return (cfg, params) if method is None else (cfg, params, method)
    group, d = cfg.num_heads // hkv, cfg.head_dim
    extra_kv, extra_q = (new - hkv) * d, (new - hkv) * group * d

    def pad(path, a):
        name = _name(path)
        if name.endswith("q_proj.kernel"):
            return jnp.pad(a, ((0, 0), (0, 0), (0, extra_q)))
        if name.endswith(("k_proj.kernel", "v_proj.kernel")):
            return jnp.pad(a, ((0, 0), (0, 0), (0, extra_kv)))
        if name.endswith("o_proj.kernel"):
            return jnp.pad(a, ((0, 0), (0, extra_q), (0, 0)))
        return a

    cfg = dataclasses.replace(cfg, num_heads=new * group, num_kv_heads=new)
    params = jax.tree_util.tree_map_with_path(pad, params)
    if method is None:
        return cfg, params
    return cfg, params, pad_method_heads(method, new, query_heads=hkv * group)


def pad_method_heads(method: AttentionMethod, num_kv_heads: int, query_heads: int | None = None) -> AttentionMethod:
    """``method`` with its per-KV-head calibration (Double Sparsity's channels) extended
    to ``num_kv_heads`` heads, the new heads copying head 0 (see :func:`pad_kv_heads`);
    and, given the model's own ``query_heads`` where padding added some, its Token Sparse
    prefill told them (``TokenSparsePrefill.query_heads``: the padded heads stay out of the
    head mean that sets the kept count, so the mesh keeps what one device keeps)."""
    tsa = method.sparse_prefill()
    if tsa is not None and query_heads is not None and tsa.query_heads is None \
            and "prefill_options" in {f.name for f in dataclasses.fields(method)}:
        opts = tuple(kv for kv in method.prefill_options if kv[0] != "query_heads") + (("query_heads", query_heads),)
        method = dataclasses.replace(method, prefill_options=opts)
    cpl = getattr(method, "channels_per_layer", None)
    if cpl is None or len(cpl[0]) >= num_kv_heads:
        return method
    cpl = tuple(tuple(layer) + (layer[0],) * (num_kv_heads - len(layer)) for layer in cpl)
    return dataclasses.replace(method, channels_per_layer=cpl)


def _name(path) -> str:
    """``['layers']['self_attn']['q_proj']['kernel'].value`` -> ``layers.self_attn.q_proj.kernel``."""
    parts = []
    for k in path:
        key = getattr(k, "key", getattr(k, "name", getattr(k, "idx", None)))
        if key != "value":
            parts.append(str(key))
    return ".".join(parts)


def param_specs(params) -> Any:
    """A ``PartitionSpec`` per parameter leaf (stacked layers ``[L, in, out]``)."""

    def spec(path, a):
        name = _name(path)
        if name.endswith(_COLUMN):
            return P(None, None, MODEL)
        if name.endswith(_ROW):
            return P(None, MODEL, None)
        return P()

    return jax.tree_util.tree_map_with_path(spec, params)


def shard_params(params, mesh: Mesh):
    """``params`` placed on ``mesh`` by :func:`param_specs` (replicated over ``data``)."""
    specs = param_specs(params)
    return jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), params, specs)


def _split_axes(whole, part) -> list[int]:
    return [i for i, (a, b) in enumerate(zip(whole.shape, part.shape)) if a != b]


def _cache_shape(cfg: ModelConfig, method: AttentionMethod, batch: int, max_len: int, dtype, prefilled: bool,
                 model: int = 1):
    """The cache's abstract shape, empty or after a prefill (a method may add state
    leaves only a prefill can size: AsyncSpade's query history ``[B, Hq, W+1, D]``);
    ``model > 1``: one device's (``cfg`` its config; layer data cut to its heads)."""
    # abstract: nothing is allocated (a whole-model cache need not fit one device)
    empty = jax.eval_shape(lambda: driver_init_cache(cfg, method, batch, max_len, dtype))
    if not prefilled:
        return empty
    graphdef, params = abstract_model(cfg, dtype)
    tokens = jax.ShapeDtypeStruct((batch, 1), jnp.int32)
    lengths = jax.ShapeDtypeStruct((batch,), jnp.int32)
    tp = (None, model) if model > 1 else None
    return jax.eval_shape(lambda p, t, n, c: prefill(nnx.merge(graphdef, p), cfg, method, t, n, c, tp=tp)[1],
                          params, tokens, lengths, empty)


@functools.lru_cache(maxsize=32)
def cache_specs(cfg: ModelConfig, method: AttentionMethod, batch: int, max_len: int, dtype, par: Parallelism,
                prefilled: bool = False):
    """``PartitionSpec`` of every leaf of the cache (``KVCache``, method state
    included), empty or (``prefilled``) as a prefill returns it: an axis is split over
    ``model`` where the method builds it ``model`` times smaller for one device's KV
    heads, over ``data`` where it shrinks with the batch. Refuses a leaf that shrinks
    in a way that is not an even split."""
    if batch % par.data:
        raise ValueError(f"batch {batch} does not split over data={par.data} replicas")
    dt = jnp.dtype(dtype)
    whole = _cache_shape(cfg, method, batch, max_len, dt, prefilled)
    by_heads = _cache_shape(local_config(cfg, par.model), method, batch, max_len, dt, prefilled, par.model)
    by_rows = _cache_shape(cfg, method, batch // par.data, max_len, dt, prefilled)

    return specs_from_shapes(whole, by_heads, by_rows, par, what="cache leaf")


def specs_from_shapes(whole, by_heads, by_rows, par: Parallelism, what: str = "leaf"):
    """A ``PartitionSpec`` per leaf of three abstract trees of one structure: the
    whole model's, one device's KV heads' (``model``-way) and one replica's rows
    (``data``-way). An axis that shrinks ``model`` times is split over ``model``, one
    that shrinks ``data`` times over ``data``; any other change is refused."""

    def spec(path, w, h, r):
        axes = [None] * len(w.shape)
        for i in _split_axes(w, h):
            if w.shape[i] != h.shape[i] * par.model:
                raise ValueError(f"{what} {jax.tree_util.keystr(path)}: {w.shape} -> {h.shape} per device "
                                 f"is not a {par.model}-way split")
            axes[i] = MODEL
        for i in _split_axes(w, r):
            if w.shape[i] != r.shape[i] * par.data or axes[i] is not None:
                raise ValueError(f"{what} {jax.tree_util.keystr(path)}: {w.shape} -> {r.shape} per replica "
                                 f"is not a {par.data}-way split of one axis")
            axes[i] = DATA
        return P(*axes)

    return jax.tree_util.tree_map_with_path(spec, whole, by_heads, by_rows)


@functools.lru_cache(maxsize=16)
def paged_cache_specs(cfg: ModelConfig, method: AttentionMethod, batch: int, max_len: int, num_pages: int,
                      page: int, dtype, par: Parallelism):
    """:func:`cache_specs` of a paged engine's cache (:func:`sparse_jax.cache.paged_like` of
    ``batch`` slots, ``num_pages`` pages of ``page`` positions): each pool ``[1, Hkv, P *
    page, D]`` split by KV head over ``model``, the block table and lengths on every device,
    the method state as in a contiguous cache. One replica (``data == 1``): a paged engine
    serves one, and :mod:`models.serving.replicas` runs one per device group."""
    if par.data != 1:
        raise ValueError(f"a paged cache lives on one replica: data={par.data} (run one engine per device group)")
    dt = jnp.dtype(dtype)

    def shape(c):
        return jax.eval_shape(lambda: paged_like(driver_init_cache(c, method, batch, max_len, dt), num_pages, page))

    whole = shape(cfg)
    return specs_from_shapes(whole, shape(local_config(cfg, par.model)), whole, par, what="paged cache leaf")


def init_cache(cfg: ModelConfig, method: AttentionMethod, batch: int, max_len: int, dtype, mesh: Mesh) -> KVCache:
    """An empty cache laid out on ``mesh`` (each device allocates only its shard)."""
    specs = cache_specs(cfg, method, batch, max_len, jnp.dtype(dtype), Parallelism.of(mesh))
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    return jax.jit(lambda: driver_init_cache(cfg, method, batch, max_len, jnp.dtype(dtype)), out_shardings=shardings)()


def check_method(method: AttentionMethod, model: int, devices: int | None = None) -> None:
    """Methods whose layers read other KV heads' data cannot split over heads; a
    method marked not ``shardable`` runs on one device only."""
    if (devices or model) > 1 and not getattr(method, "shardable", True):
        raise ValueError(f"{method.name}: not supported on several devices yet (see its `shardable` note); "
                         f"run it on one device")
    if model > 1 and getattr(method, "crosses_kv_heads", False):
        raise ValueError(f"{method.name}: its layers read other KV heads' selections (a head map), which "
                         f"tensor parallelism over KV heads splits across devices; run it with model=1 "
                         f"(data replicas work)")


@dataclasses.dataclass(frozen=True)
class ShardedFunctions(ModelFunctions):
    """:class:`models.transformer.ModelFunctions` over a mesh: the same signatures,
    taking params from :func:`shard_params` and a cache from :func:`init_cache`."""

    mesh: Mesh | None = None
    config: ModelConfig | None = None  # the whole model's config
    local: ModelConfig | None = None  # one device's


class _ByCacheLength:
    """A jitted function per cache length: the cache's ``max_len`` is static pytree
    metadata, so ``shard_map``'s specs (a tree of the cache's structure) are built per
    length. Callable, with ``lower`` (ahead-of-time compilation) like a jitted function."""

    def __init__(self, make: Callable[[int], Callable], cache_arg: int):
        self._make = functools.lru_cache(maxsize=None)(make)
        self._arg = cache_arg

    def _fn(self, args):
        return self._make(int(args[self._arg].max_len))

    def __call__(self, *args):
        return self._fn(args)(*args)

    def lower(self, *args):
        return self._fn(args).lower(*args)


def build_sharded_functions(cfg: ModelConfig, method: AttentionMethod, mesh: Mesh, *, max_len: int,
                            dtype=jnp.bfloat16, unroll: bool | None = None) -> ShardedFunctions:
    """Jitted ``forward / prefill / decode_step`` as one ``shard_map`` each over ``mesh``
    (see the module docstring). They take any batch that splits over the ``data`` axis
    and caches of any length (``prefill`` / ``decode_step``: one compilation per cache
    length, as for any jitted function of the cache; ``max_len`` is checked now)."""
    par = Parallelism.of(mesh)
    check_method(method, par.model, par.size)
    local = local_config(cfg, par.model)
    if unroll is None:
        unroll = default_unroll()
    dtype = jnp.dtype(dtype)
    graphdef_local = abstract_model(local, dtype)[0]
    pspecs = param_specs(abstract_model(cfg, dtype)[1])
    cache_specs(cfg, method, par.data, max_len, dtype, par)  # errors now, not at the first call
    tp = (MODEL, par.model)
    rows, rows2 = P(DATA), P(DATA, None)

    def smap(fn, in_specs, out_specs):
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)

    def _forward(params, tokens):
        return forward(nnx.merge(graphdef_local, params), local, method, tokens, unroll=unroll, tp=tp)

    def _prefill(params, tokens, lengths, cache):
        return prefill(nnx.merge(graphdef_local, params), local, method, tokens, lengths, cache, unroll=unroll, tp=tp)

    def _decode(params, tokens, cache, m=method):
        return decode_step(nnx.merge(graphdef_local, params), local, m, tokens, cache, unroll=unroll, tp=tp)

    def make_prefill(length):
        empty = cache_specs(cfg, method, par.data, length, dtype, par)
        full = cache_specs(cfg, method, par.data, length, dtype, par, prefilled=True)
        # keep_unused: the prefill reads only the empty cache's shapes (models.transformer)
        return jax.jit(smap(_prefill, (pspecs, rows2, rows, empty), (rows2, full)), donate_argnums=(3,),
                       keep_unused=True)

    def make_decode(length, m=method):
        cs = cache_specs(cfg, method, par.data, length, dtype, par, prefilled=True)
        fn = functools.partial(_decode, m=m)
        return jax.jit(smap(fn, (pspecs, rows, cs), (rows2, cs)), donate_argnums=(2,))

    warm = method.warmup_steps

    return ShardedFunctions(
        forward=jax.jit(smap(_forward, (pspecs, rows2), P(DATA, None, None))),
        prefill=_ByCacheLength(make_prefill, 3),
        decode_step=_ByCacheLength(make_decode, 2),
        steady_decode_step=(_ByCacheLength(functools.partial(make_decode, m=method.steady_state()), 2)
                            if warm else None),
        warmup_steps=warm,
        mesh=mesh, config=cfg, local=local,
    )

class ShardedModel(Model):
    """A :class:`models.api.Model` spread over a mesh (:func:`shard`):
    the same ``init_cache / prefill / decode_step / generate / generate_ids`` API, with
    the parameters sharded (KV heads padded first when they do not split: then
    ``config`` is the padded one, ``unpadded_config`` the original), the cache laid
    out on the mesh and the jitted functions one ``shard_map`` each. The unsharded
    model it came from is not kept: ``del`` it to free its device copy."""

    def __init__(self, base: Model, par: Parallelism, devices=None):
        check_method(base.method, par.model, par.size)
        mesh = par.mesh(devices)
        cfg, params, method = pad_kv_heads(base.config, base.params, par.model, base.method)
        graphdef = base.graphdef if cfg == base.config else abstract_model(cfg, base.dtype)[0]
        # Model.__init__ makes the unsharded jits (lazy: nothing compiles); replaced below
        super().__init__(cfg, graphdef, shard_params(params, mesh), base.tokenizer, method, base.dtype, base.max_len)
        self.mesh, self.parallelism, self.unpadded_config = mesh, par, base.config
        self.fns = self._functions(method)

    def _functions(self, method: AttentionMethod) -> ShardedFunctions:
        return build_sharded_functions(self.config, method, self.mesh,
                                       max_len=round_up(self.max_len, method.cache_multiple), dtype=self.dtype)

    def __repr__(self) -> str:
        return super().__repr__()[:-1] + f", data={self.parallelism.data}, model={self.parallelism.model})"

    def init_cache(self, batch: int = 1, max_len: int | None = None, dtype=None) -> KVCache:
        """An empty cache laid out on the mesh (``batch`` a multiple of ``data``)."""
        if int(batch) % self.parallelism.data:
            raise ValueError(f"batch {batch} does not split over data={self.parallelism.data} replicas: "
                             f"use a multiple of {self.parallelism.data}")
        max_len = self.cache_length(batch, max_len)
        return init_cache(self.config, self.method, int(batch), max_len, self.dtype if dtype is None else dtype,
                          self.mesh)

    def with_method(self, attention, **options) -> "ShardedModel":
        """The same sharded params with another method (bound to the unpadded model)."""
        method = bind_method(method_for_model(attention, options, self.unpadded_config), self.unpadded_config,
                             self.max_len)
        check_method(method, self.parallelism.model, self.parallelism.size)
        clone = object.__new__(type(self))
        clone.__dict__.update(self.__dict__)
        padded = self.config.num_kv_heads != self.unpadded_config.num_kv_heads
        clone.method = pad_method_heads(method, self.config.num_kv_heads,
                                        query_heads=self.unpadded_config.num_heads if padded else None)
        clone.fns = clone._functions(clone.method)
        return clone


def shard(base: Model, /, *, data: int = 1, model: int = 1, devices=None) -> ShardedModel:
    """``base`` over ``data x model`` devices: ``model``-way tensor parallelism over KV
    heads, ``data`` replicas over batch rows. The same API as a :class:`Model`; the
    cache comes from the returned model's ``init_cache``."""
    return ShardedModel(base, Parallelism(data, model), devices)
