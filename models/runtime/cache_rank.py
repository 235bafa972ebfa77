"""AsyncSpade's cache rank: the next step's selection computed on a second device.

AsyncSpade (``sparse_jax.methods.asyncspade``) chooses step ``t + 1``'s tokens
during step ``t``, from a query predicted by ridge regression over the layer's
past queries. Its paper (Sec. 4.1, 4.3) puts that work on a second GPU, the
*cache rank*, beside the *inference rank* that runs the forward. Here:

* **inference rank** (device 0): the weights, every layer's K/V, and per sparse
  layer the selection it attends this step. It runs the step in *packs* of
  consecutive layers (the paper's "depth-wise" units), one jitted program per
  pack. Each sparse layer attends the selection the cache rank chose one step
  earlier, plus the new token, with the same kernel as on one device
  (``sparse_decode_attention`` / ``block_sparse_decode_attention``), and ships its
  query and new key to the cache rank.
* **cache rank** (device 1): per sparse layer the selector's index (Quest's block
  boxes, Double Sparsity's or AsyncTLS's INT4 labels), the query history, and
  one program per pack that appends the shipped keys to the index, predicts
  ``q̂_{t+1}``, scores the index with it and sends the chosen block ids (or token
  positions) back: ``[B, Hkv, K]`` int32 per layer.

Pack ``p``'s cache-rank work for step ``t + 1`` runs while device 0 runs packs
``p + 1 ...`` of step ``t``; device 0 needs the result only at pack ``p`` of the
next step. The selector's scoring (Quest reads ``2 x S / 16`` box rows per KV
head per layer: 4x the bytes of a 2,048-token attention at 128K) leaves the
inference rank's critical path, as do the prediction and the top-k.

**What crosses between the devices** (JAX device-to-device copies, no transport
of our own): per sparse layer and step, ``q [B, Hq, D]`` and ``k [B, Hkv, D]`` to
the cache rank, ``[B, Hkv, K]`` ids and ``[B, Hkv]`` counts back; for Qwen3-8B at
B=8 and Quest's 128 blocks, 80 KiB + 32 KiB per layer. The paper's cache rank
holds the whole KV and returns the *gathered* K/V (2 x B x Hkv x K x D x 2 bytes:
67 MB per layer at B=8, K=2,048); returning indices instead keeps the K/V on the
inference rank, where attention reads it, and the transfer a thousand times
smaller. The cost is that the cache rank cannot run a selector that reads raw
keys beyond the newest one (an exact ``q̂ Kᵀ`` over every key, ArkVale's page
re-summary): such a selector is refused before anything compiles.

Numerically this is the one-device AsyncSpade: the same selector state, the same
prediction, the same selection for the same step (``tests/test_cache_rank.py``
checks the logits and greedy tokens against ``decode_step`` on one device).
Resident caches only; offloading and tensor parallelism are not combined with it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from models.api import Model, round_up
from models.driver import Driver, make_plan, segment_data
from models.programs import default_unroll
from models.transformer import layer_graphdef
from sparse_jax.cache import KVCache, LayerCache
from sparse_jax.methods.asyncspade import AsyncSpade
from sparse_jax.methods.base import AttentionMethod, LayerCtx

# -----------------------------------------------------------------------------
# The two sides of the method
# -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ShippedKey:
    """The cache rank's view of a layer: the newest key only, ``k [B, Hkv, D]``
    (what the selectors' ``append_state`` reads), and the layer's capacity."""

    k: jax.Array
    capacity: int

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[1]

    def newest_keys(self, positions: jax.Array) -> jax.Array:
        return self.k

    def __getattr__(self, name):
        # only called for what the dataclass lacks (k's other views: the whole cache, a block)
        raise AttributeError(f"the selector reads `{name}` of the key cache, which stays on the inference rank: "
                             f"it cannot run on AsyncSpade's cache rank (selectors that read the newest key "
                             f"only: quest, double_sparsity, asynctls)")


@dataclasses.dataclass(frozen=True)
class InferenceSide(AttentionMethod):
    """AsyncSpade on the inference rank: attends the selection held in its state
    (``next``, ``next_counts``: chosen on the cache rank during the previous step)
    and records the layer's query ``q`` and new key ``k`` for the cache rank."""

    name: ClassVar[str] = "asyncspade/inference-rank"
    spade: AsyncSpade = None

    @property
    def impl(self) -> str:
        return self.spade.impl

    def is_sparse_layer(self, index, num_layers):
        return self.spade.is_sparse_layer(index, num_layers)

    def is_sparse_prefill_layer(self, index, num_layers):
        return self.spade.is_sparse_prefill_layer(index, num_layers)

    @property
    def cache_multiple(self) -> int:
        return self.spade.cache_multiple

    def append_state(self, state, kv, positions, layer):
        return dict(state, k=kv.newest_keys(positions).astype(state["k"].dtype))

    def select(self, q, kv, lengths, state, carry, layer):
        sel = self.spade.step_selection(state["next"], state["next_counts"], lengths)
        return sel, dict(state, q=q.astype(state["q"].dtype)), carry


def rank_layer(spade: AsyncSpade, state: dict, q: jax.Array, k: jax.Array, pos: jax.Array, ctx: LayerCtx,
               capacity: int) -> tuple[dict, tuple[jax.Array, jax.Array]]:
    """One sparse layer's cache-rank work for the step at positions ``pos int32[B]``:
    append the shipped key ``k [B,Hkv,D]`` to the selector's index, push ``q [B,Hq,D]``,
    predict and choose the next step's selection. ``state``: ``inner``, ``hist``,
    ``count``. Returns the new state and ``(ids [B,Hkv,K], counts [B,Hkv])``."""
    view = ShippedKey(k, capacity)
    full = dict(state, inner=spade.inner().append_state(state["inner"], view, pos, ctx))
    full = spade.advance(q, view, pos + 1, full, ctx)
    return ({"inner": full["inner"], "hist": full["hist"], "count": full["count"]},
            (full["next"], full["next_counts"]))


def check_selector(spade: AsyncSpade, cfg, max_len: int, dtype) -> None:
    """Trace one sparse layer's :func:`rank_layer` abstractly (nothing is allocated or
    compiled): a selector that reads more of the key cache than the newest key is
    refused here with a ValueError."""
    max_len = round_up(max_len, spade.cache_multiple)
    seg = next((s for s in make_plan(cfg, spade).segments if s.spec.sparse), None)
    if seg is None:
        return
    spade.check(num_q_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, max_len=max_len)
    if spade.reads_all_keys:
        raise ValueError(f"asyncspade's selector {spade.inner().name!r} reads every key, which stays on the inference "
                         f"rank: it cannot run on the cache rank (selectors that read the newest key only: quest, "
                         f"double_sparsity, asynctls)")
    cap = seg.spec.capacity(max_len)
    ctx = LayerCtx(seg.spec, {k: jnp.asarray(v[0]) for k, v in segment_data(spade, seg).items()})

    def one():
        st = spade.init_state(seg.spec, batch=1, num_kv_heads=cfg.num_kv_heads, max_len=cap, head_dim=cfg.head_dim,
                              dtype=dtype, num_q_heads=cfg.num_heads)
        st = {"inner": st["inner"], "hist": st["hist"], "count": st["count"]}
        q = jnp.zeros((1, cfg.num_heads, cfg.head_dim), dtype)
        k = jnp.zeros((1, cfg.num_kv_heads, cfg.head_dim), dtype)
        return rank_layer(spade, st, q, k, jnp.ones((1,), jnp.int32), ctx, cap)

    try:
        jax.eval_shape(one)
    except AttributeError as e:
        if "cache rank" in str(e):
            raise ValueError(f"asyncspade with selector {spade.selector_name!r}: {e}") from None
        raise


# -----------------------------------------------------------------------------
# The cache and the programs
# -----------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SplitCache:
    """The decode state over the two devices.

    ``inference``: the :class:`KVCache` on the inference rank (every layer's K/V;
    sparse layers' state: ``next [B,Hkv,K]``, ``next_counts [B,Hkv]``, ``q [B,Hq,D]``,
    ``k [B,Hkv,D]``). ``selections``: per pack, the selection its sparse layers attend
    next step, ``(ids [1, n, B, Hkv, K], counts [1, n, B, Hkv])`` on the inference rank
    (None for a pack without sparse layers; the leading 1 is the transfer's device
    axis). ``rank``: per layer, the cache rank's state (``inner``: the selector's index,
    ``hist [B,Hq,W+1,D]``, ``count [B]``) or None on dense layers. ``rank_lengths``: the
    positions, on the cache rank."""

    inference: KVCache
    selections: tuple
    rank: tuple
    rank_lengths: jax.Array

    @property
    def lengths(self) -> jax.Array:
        return self.inference.lengths

    @property
    def max_len(self) -> int:
        return self.inference.max_len

    @property
    def batch(self) -> int:
        return self.inference.batch

    @property
    def num_layers(self) -> int:
        return self.inference.num_layers


def packs_of(num_layers: int, pack_layers: int) -> tuple[range, ...]:
    """Consecutive layer ranges of ``pack_layers`` (the last may be shorter)."""
    return tuple(range(a, min(a + pack_layers, num_layers)) for a in range(0, num_layers, pack_layers))


TRANSFERS = ("device_put", "collective")


class Courier:
    """Moves a tuple of ``[1, ...]`` arrays from one device to the other.

    ``device_put``: ``jax.device_put`` of each array. ``collective``: one program over
    a two-device mesh, a ``ppermute`` (NCCL on GPUs) of every array: its launch never
    waits on the host, and the destination's part comes out as that device's shard
    (the sender's zero part is a buffer kept per shape)."""

    def __init__(self, devices, mode: str):
        if mode not in TRANSFERS:
            raise ValueError(f"transfer must be one of {TRANSFERS}, got {mode!r}")
        self.devices, self.mode = tuple(devices), mode
        self._zeros: dict = {}
        self._perm: dict = {}
        if mode == "collective":
            import numpy as np
            from jax.sharding import Mesh, NamedSharding
            from jax.sharding import PartitionSpec as P

            self.mesh = Mesh(np.array(self.devices), ("rank",))
            self.sharding = NamedSharding(self.mesh, P("rank"))

    def send(self, xs: tuple, dst: int) -> tuple:
        if self.mode == "device_put":
            return jax.device_put(xs, self.devices[dst])
        src = 1 - dst
        if dst not in self._perm:
            from jax.sharding import PartitionSpec as P

            def perm(arrays):
                return tuple(jax.lax.ppermute(x, "rank", [(src, dst)]) for x in arrays)

            self._perm[dst] = jax.jit(jax.shard_map(perm, mesh=self.mesh, in_specs=(P("rank"),),
                                                    out_specs=P("rank")))
        glob = []
        for x in xs:
            key = (x.shape, x.dtype, dst)
            if key not in self._zeros:  # the receiver's part of the input: never read
                self._zeros[key] = jnp.zeros(x.shape, x.dtype, device=self.devices[dst])
            parts = [x, self._zeros[key]] if src == 0 else [self._zeros[key], x]
            glob.append(jax.make_array_from_single_device_arrays((2,) + x.shape[1:], self.sharding, parts))
        out = self._perm[dst](tuple(glob))
        return tuple(next(sh.data for sh in y.addressable_shards if sh.device == self.devices[dst]) for y in out)


class CacheRankFunctions:
    """``prefill`` and ``decode_step`` with :class:`models.api.ModelFunctions`'
    signatures (``decode_step`` takes and returns a :class:`SplitCache`): per step,
    ``2 x packs`` programs on the two devices and ``2 x packs`` transfers
    (:class:`Courier`), dispatched from the host in an order that keeps the next pack
    queued on device 0 while a pack's transfers are issued."""

    def __init__(self, model: "CacheRankModel", base_prefill, transfer: str = "device_put", threads: bool = True,
                 wait_copies: bool = False):
        self.cfg, self.graphdef, self.dtype = model.config, model.graphdef, model.dtype
        self.spade: AsyncSpade = model.method
        self.devices = model.devices
        self.courier = Courier(self.devices, transfer)
        self.base_prefill = base_prefill
        self.side = InferenceSide(spade=self.spade)
        self.plan = make_plan(self.cfg, self.spade)
        self.packs = packs_of(self.cfg.num_layers, model.pack_layers)
        self.driver = Driver(self.cfg, self.side, layer_graphdef(self.cfg, self.dtype), default_unroll())
        # each sparse layer's spec and layer-data row (the selector's channels) for the rank programs
        self.layer_ctx: dict[int, LayerCtx] = {}
        for seg in self.plan.segments:
            if seg.spec.sparse:
                data = segment_data(self.spade, seg)
                for j, i in enumerate(seg.layers):
                    self.layer_ctx[i] = LayerCtx(seg.spec, {k: jnp.asarray(v[j]) for k, v in data.items()})
        self.sparse_in = [tuple(i for i in r if i in self.layer_ctx) for r in self.packs]
        self._infer = [jax.jit(functools.partial(self._infer_pack, p), static_argnums=(5,), donate_argnums=(3,))
                       for p in range(len(self.packs))]
        self._rank = [jax.jit(functools.partial(self._rank_pack, p), static_argnums=(3,), donate_argnums=(0,))
                      for p in range(len(self.packs))]
        #: host seconds spent in each kind of call of decode_step (filled when ``trace_host``)
        self.trace_host = False
        self.host_s: dict[str, float] = {}
        #: the cache rank's calls (copies in, its program, copies out) issued from a second
        #: host thread, so a call that waits for a cross-device copy blocks that thread only
        #: and device 0's packs keep being queued
        self.threads = bool(threads)
        #: with ``threads``: the cache-rank thread waits until each copy's source is computed
        #: before issuing the copy, so the copy is queued at once and a call consuming it
        #: finds it defined (the main thread then never waits on a cross-device copy)
        self.wait_copies = bool(wait_copies) and self.threads
        self._pool = None
        if self.threads:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cache-rank")

    # -- the inference rank -------------------------------------------------------------
    def _infer_pack(self, p, params, x, pos, entries, sel, max_len):
        """Pack ``p`` on device 0: ``x`` (tokens ``int32[B]`` for the first pack, else
        the hidden state ``[B, H]``), positions ``pos [B]``, the pack's cache entries,
        its selection ``(ids [1,n,B,Hkv,K], counts [1,n,B,Hkv])`` -> (hidden state, or
        the logits and ``pos + 1`` after the last pack), the entries, and ``(q [1,n,B,
        Hq,D], k [1,n,B,Hkv,D])`` of its sparse layers for the cache rank."""
        model = nnx.merge(self.graphdef, params)
        rng = self.packs[p]
        if p == 0:
            x = model.embed_tokens(x)
        layers = [None] * self.cfg.num_layers
        for i, e in zip(rng, entries):
            layers[i] = e
        for j, i in enumerate(self.sparse_in[p]):
            e = layers[i]
            layers[i] = LayerCache(e.k, e.v, dict(e.state, next=sel[0][0, j], next_counts=sel[1][0, j]))
        x, cache = self.driver.decode(nnx.state(model.layers), x, KVCache(tuple(layers), pos, max_len), layers=rng)
        out = tuple(cache.layers[i] for i in rng)
        shipped = None
        if self.sparse_in[p]:
            shipped = tuple(jnp.stack([cache.layers[i].state[n] for i in self.sparse_in[p]])[None] for n in ("q", "k"))
        if p == len(self.packs) - 1:
            return (model.logits(x), pos + 1), out, shipped
        return x, out, shipped

    # -- the cache rank -----------------------------------------------------------------
    def _rank_pack(self, p, states, shipped, pos, max_len):
        """Pack ``p`` on device 1: each sparse layer's :func:`rank_layer` ->
        (states, the next step's ``(ids [1,n,B,Hkv,K], counts [1,n,B,Hkv])``)."""
        new, ids, counts = [], [], []
        for j, (i, st) in enumerate(zip(self.sparse_in[p], states)):
            ctx = self.layer_ctx[i]
            s, (a, c) = rank_layer(self.spade, st, shipped[0][0, j], shipped[1][0, j], pos, ctx,
                                   ctx.spec.capacity(max_len))
            new.append(s)
            ids.append(a)
            counts.append(c)
        return tuple(new), (jnp.stack(ids)[None], jnp.stack(counts)[None])

    # -- the ModelFunctions interface -----------------------------------------------------
    def prefill(self, params, tokens, lengths, cache: KVCache):
        """The one-device AsyncSpade prefill on device 0 (it chooses the first step's
        selection), then its state split: the selector's index and the query history
        move to device 1, the first selection stays. Returns ``(logits, SplitCache)``."""
        logits, cache = self.base_prefill(params, tokens, lengths, cache)
        return logits, self.split(cache)

    def split(self, cache: KVCache) -> SplitCache:
        d0, d1 = self.devices
        layers, rank = [], []
        for i, lc in enumerate(cache.layers):
            if i not in self.layer_ctx:
                layers.append(lc)
                rank.append(None)
                continue
            st = lc.state
            b, hkv = st["next_counts"].shape
            keep = {"next": st["next"], "next_counts": st["next_counts"],
                    "q": jnp.zeros((b, self.cfg.num_heads, self.cfg.head_dim), self.dtype, device=d0),
                    "k": jnp.zeros((b, hkv, self.cfg.head_dim), lc.k.dtype, device=d0)}
            layers.append(LayerCache(lc.k, lc.v, keep))
            rank.append(jax.device_put({"inner": st["inner"], "hist": st["hist"], "count": st["count"]}, d1))
        sels = tuple((jnp.stack([layers[i].state["next"] for i in sp])[None],
                      jnp.stack([layers[i].state["next_counts"] for i in sp])[None]) if sp else None
                     for sp in self.sparse_in)
        return SplitCache(KVCache(tuple(layers), cache.lengths, cache.max_len), sels, tuple(rank),
                          jax.device_put(cache.lengths, d1))

    def _timed(self, what: str, fn, *args):
        if not self.trace_host:
            return fn(*args)
        import time

        t = time.perf_counter()
        out = fn(*args)
        self.host_s[what] = self.host_s.get(what, 0.0) + time.perf_counter() - t
        return out

    def decode_at(self, step: int):
        """:meth:`decode_step` at every step: the cache rank runs no warm-up (AsyncSpade's
        θ_t is 0 here: ``dense_steps > 0`` is refused, the default resolves to 0;
        :meth:`models.programs.ModelFunctions.decode_at`)."""
        return self.decode_step

    def decode_step(self, params, tokens, split: SplitCache):
        """One step over both devices: ``(logits [B, V] on device 0, SplitCache)``."""
        max_len = split.max_len
        entries = list(split.inference.layers)
        sels = list(split.selections)
        rank = list(split.rank)
        pos0, pos1 = split.inference.lengths, split.rank_lengths
        x = tokens
        pending = None  # (pack, shipped): handed to the cache rank once the next pack is queued

        def ship(p, shipped):
            sp = self.sparse_in[p]
            if not sp:
                return
            if self.wait_copies:
                self._timed("wait", jax.block_until_ready, shipped)
            shipped = self._timed("to_rank", self.courier.send, shipped, 1)
            states, sel = self._timed("rank", self._rank[p], tuple(rank[i] for i in sp), shipped, pos1, max_len)
            if self.wait_copies:
                self._timed("wait", jax.block_until_ready, sel)
            sels[p] = self._timed("to_inference", self.courier.send, sel, 0)
            for i, st in zip(sp, states):
                rank[i] = st

        futures = []
        for p, rng in enumerate(self.packs):
            x, out, shipped = self._timed("infer", self._infer[p], params, x, pos0, tuple(entries[i] for i in rng),
                                          sels[p], max_len)
            for i, e in zip(rng, out):
                entries[i] = e
            if self._pool is not None:  # one FIFO worker: the packs reach the cache rank in order
                futures.append(self._pool.submit(ship, p, shipped))
                continue
            if pending is not None:
                ship(*pending)
            pending = (p, shipped)
        if pending is not None:
            ship(*pending)
        for f in futures:  # every cache-rank call of this step issued (not finished)
            f.result()
        logits, new_pos0 = x
        return logits, SplitCache(KVCache(tuple(entries), new_pos0, max_len), tuple(sels), tuple(rank), pos1 + 1)

    def forward(self, params, tokens):
        raise NotImplementedError("forward (whole sequences, no cache) has no cache rank: use the base model")


# -----------------------------------------------------------------------------
# The model
# -----------------------------------------------------------------------------


class CacheRankModel(Model):
    """A :class:`models.api.Model` running AsyncSpade with its cache rank on a second
    device (:func:`with_cache_rank`): the same ``init_cache / prefill /
    decode_step / generate / generate_ids`` API; ``prefill`` returns a
    :class:`SplitCache`, which ``decode_step`` takes."""

    def __init__(self, base: Model, devices=None, pack_layers: int = 6, transfer: str = "device_put",
                 threads: bool = True, wait_copies: bool = False):
        method = base.method
        if not isinstance(method, AsyncSpade):
            raise ValueError(f"the cache rank is AsyncSpade's: the model runs {method.name!r}; load it with "
                             f"attention='asyncspade' (or model.with_method('asyncspade'))")
        if transfer not in TRANSFERS:
            raise ValueError(f"transfer must be one of {TRANSFERS}, got {transfer!r}")
        if int(pack_layers) < 1:
            raise ValueError(f"pack_layers must be >= 1, got {pack_layers}")
        method = method.without_dense_steps("the cache rank's inference side")
        check_selector(method, base.config, base.max_len, base.dtype)
        devs = list(jax.devices()) if devices is None else list(devices)
        if len(devs) < 2:
            raise ValueError(f"the cache rank needs a second device: jax sees {len(devs)} "
                             f"(on CPU: XLA_FLAGS=--xla_force_host_platform_device_count=2)")
        if devs[0] == devs[1]:
            raise ValueError("the inference rank and the cache rank must be two different devices")
        if getattr(base, "mesh", None) is not None:
            raise ValueError("the cache rank is not combined with tensor parallelism (models.runtime.shard)")
        super().__init__(base.config, base.graphdef, jax.device_put(base.params, devs[0]), base.tokenizer, method,
                         base.dtype, base.max_len)
        self.devices = (devs[0], devs[1])
        self.pack_layers = int(pack_layers)
        self.base_fns = self.fns
        self.fns = CacheRankFunctions(self, self.base_fns.prefill, transfer, threads, wait_copies)

    def __repr__(self) -> str:
        return (super().__repr__()[:-1] + f", inference rank {self.devices[0]}, cache rank {self.devices[1]}, "
                f"packs of {self.pack_layers} layers)")

    def init_cache(self, batch: int = 1, max_len: int | None = None, dtype=None) -> KVCache:
        """An empty one-device cache on the inference rank; ``prefill`` splits it."""
        with jax.default_device(self.devices[0]):
            return super().init_cache(batch, max_len, dtype)

    def prefill(self, tokens, lengths, cache: KVCache) -> tuple[jax.Array, SplitCache]:
        """As :meth:`models.api.Model.prefill`; the cache comes back split (:class:`SplitCache`)."""
        logits, split = super().prefill(tokens, lengths, cache)
        return logits, split

    def _check_cache(self, cache, batch: int):
        super()._check_cache(cache.inference if isinstance(cache, SplitCache) else cache, batch)

    def decode_step(self, tokens, cache) -> tuple[jax.Array, SplitCache]:
        if not isinstance(cache, SplitCache):
            raise TypeError("decode_step on the cache rank takes the SplitCache that prefill returned")
        return super().decode_step(tokens, cache)

    def forward(self, tokens) -> jax.Array:
        return Model(self.config, self.graphdef, self.params, self.tokenizer, self.method, self.dtype,
                     self.max_len).forward(tokens)

    def with_method(self, attention, **options):
        raise ValueError("a cache-rank model runs AsyncSpade only: take the base model's with_method, then "
                         "models.runtime.with_cache_rank() again")


def with_cache_rank(base: Model, /, devices=None, *, pack_layers: int = 6, transfer: str = "device_put",
                    threads: bool = True, wait_copies: bool = False) -> CacheRankModel:
    """``base`` (running AsyncSpade) with its cache rank on a second device: the next
    step's selection is chosen on ``devices[1]`` while ``devices[0]`` runs the step, in
    packs of ``pack_layers`` layers; ``transfer``: ``"device_put"`` or ``"collective"``
    (a ``ppermute`` program, NCCL on GPUs); ``threads``: the cache rank's calls issued
    from a second host thread; ``wait_copies``: that thread waits for each copy's
    source before issuing it. The same API as a :class:`Model`."""
    return CacheRankModel(base, devices, pack_layers, transfer, threads, wait_copies)
