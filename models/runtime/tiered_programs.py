"""The jitted pieces :class:`models.runtime.tiered.TieredRunner` compiles: the embedding and
head, the decode step over every layer (and its greedy loop), a prompt layer's prefill
(whole, or a chunk of it) and the building of its device tier, the extraction of completed
ring blocks for saving; and the cache's layout over a mesh (:class:`MeshLayout`).

Pure functions of the model's graph, the layer driver and the method; nothing here holds a
runner's state."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from flax import nnx

from models.driver import Driver, per_kv_head, prefill_kv, prompt_state
from models.runtime import sharding as shd
from sparse_jax.cache import KVCache, LayerCache
from sparse_jax.methods.base import LayerCtx
from sparse_jax.offload import pool as off
from sparse_jax.offload.tiers import HostLayer, OffloadedLayer


@functools.lru_cache(maxsize=8)
def embed_fn(graphdef):
    return jax.jit(lambda params, tokens: nnx.merge(graphdef, params).embed_tokens(tokens))


@functools.lru_cache(maxsize=8)
def head_fn(graphdef):
    return jax.jit(lambda params, x: nnx.merge(graphdef, params).logits(x))


def compiler_options(concurrent: bool):
    # CONCURRENT: XLA's CUDA graph keeps only the data dependences between
    # kernels (its default, LHS, serialises them as scheduled)
    return {"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"} if concurrent else None


@functools.lru_cache(maxsize=16)
def decode_fn(graphdef, driver: Driver, gather_programs, concurrent: bool):
    """``(params, tokens int32[B], cache, host) -> (logits f32[B, V], cache)``: one
    whole decode step, the cache donated, the host tiers read in place."""

    return jax.jit(decode_body(graphdef, driver, gather_programs), donate_argnums=(2,),
                   compiler_options=compiler_options(concurrent))


@functools.lru_cache(maxsize=16)
def greedy_fn(graphdef, driver: Driver, gather_programs, concurrent: bool):
    """``(params, io, cache, host) -> (io, cache)``: :func:`decode_fn`'s step on
    ``io["tokens"]``, writing its logits and their argmax back into ``io`` (donated with
    the cache, so the outputs alias the inputs: the same addresses every step)."""
    body = decode_body(graphdef, driver, gather_programs)

    def run(params, io, cache, host):
        logits, cache = body(params, io["tokens"], cache, host)
        return {"tokens": jnp.argmax(logits, -1).astype(jnp.int32), "logits": logits}, cache

    return jax.jit(run, donate_argnums=(1, 2), compiler_options=compiler_options(concurrent))


def decode_body(graphdef, driver: Driver, gather_programs):
    """:func:`decode_fn`'s step, not jitted (a mesh layout wraps it in its ``shard_map``)."""

    def offloaded_decode_step(params, tokens, cache, host, active=None):  # named: compile logs and tests find it
        model = nnx.merge(graphdef, params)
        x, cache = driver.decode(nnx.state(model.layers), model.embed_tokens(tokens), cache, host,
                                 gather_programs=gather_programs, active=active)
        return model.logits(x), cache

    return offloaded_decode_step


@functools.lru_cache(maxsize=32)
def prefill_layer_fn(driver: Driver, spec, max_len: int):
    """``(stacked params, x [B,T,H], lengths, data, carry) -> (x, k, v [B,Hkv,S,D], q_last
    [B,Hq,D], carry)``: one layer of the prompt (the method's prefill hook on its layers,
    dense elsewhere; cuDNN on GPU), its K/V as the cache holds them, and the prefill
    carry the next layer reads."""
    def prefill_layer(stacked, x, lengths, data, carry):  # named: compile logs and tests find it
        return driver.prompt_layer(stacked, x, lengths, data, spec, spec.capacity(max_len), carry)

    return jax.jit(prefill_layer)


@functools.lru_cache(maxsize=64)
def prefill_chunk_fn(driver: Driver, spec, size: int):
    """``(stacked, x [B,T,H], start, kbuf, vbuf, q_last, lengths, data) -> (x, kbuf, vbuf,
    q_last)``: :meth:`Driver.prompt_layer_chunk` on positions ``start .. start + size - 1``
    of ``x`` (written back in place); ``x`` and the buffers donated."""

    def run(stacked, x, start, kbuf, vbuf, q_last, lengths, data):
        xc = jax.lax.dynamic_slice_in_dim(x, start, size, axis=1)
        xc, kbuf, vbuf, q_last = driver.prompt_layer_chunk(stacked, xc, start, kbuf, vbuf, q_last, lengths, data,
                                                           spec)
        return jax.lax.dynamic_update_slice_in_dim(x, xc, start, axis=1), kbuf, vbuf, q_last

    return jax.jit(run, donate_argnums=(1, 3, 4))


@functools.lru_cache(maxsize=32)
def chunked_layer_kv(spec, max_len: int):
    """``(kbuf, vbuf [B,T,Hkv,D], lengths) -> k, v [B,Hkv,cap,D]``: a chunked layer's K/V
    as the cache holds them (:func:`models.driver.prefill_kv`)."""
    return jax.jit(lambda k, v, lengths: prefill_kv(k, v, lengths, spec.capacity(max_len), spec))


@functools.lru_cache(maxsize=32)
def finish_layer(method, spec, offloaded: bool, pool: int, shared: bool = False):
    """``(k, v, lengths, q_last, data) -> (entry, host_k, host_v)``; K/V donated."""
    return jax.jit(finish_layer_body(method, spec, offloaded, pool, shared), donate_argnums=(0, 1))


def finish_layer_body(method, spec, offloaded: bool, pool: int, shared: bool = False):
    """:func:`finish_layer`, not jitted (a mesh layout wraps it in its ``shard_map``)."""

    def run(k, v, lengths, q_last, data):
        if method is None:
            return LayerCache(k, v, None), None, None
        b, hkv, s, d = k.shape
        ctx = LayerCtx(spec, data)
        st = method.init_state(spec, batch=b, num_kv_heads=hkv, max_len=s, head_dim=d, dtype=k.dtype,
                               num_q_heads=q_last.shape[1])
        st = prompt_state(method, st, k, v, q_last, lengths, ctx)
        if offloaded:
            return off.tier_from_prefill(method, k, v, lengths, st, pool, shared)
        return LayerCache(k, v, st), None, None

    return run


@functools.lru_cache(maxsize=16)
def empty_offloaded_layer(method, spec, pool: int, shared: bool, *, batch: int, num_kv_heads: int, max_len: int,
                          head_dim: int, num_q_heads: int, dtype):
    """``(lengths, data) -> entry``: :func:`finish_layer`'s offloaded tier of all-zero K/V and
    queries, the zeros made inside the program and the host copies not returned, so neither is
    ever a buffer of the batch's size (:meth:`models.runtime.tiered.TieredRunner.empty_state`)."""
    body = finish_layer_body(method, spec, True, pool, shared)
    shape = (batch, num_kv_heads, max_len, head_dim)

    @jax.jit
    def run(lengths, data):
        k = jnp.zeros(shape, dtype)
        q = jnp.zeros((batch, num_q_heads, head_dim), dtype)
        entry, _, _ = body(k, k, lengths, q, data)
        return entry

    return run


def padded_rows(n: int) -> int:
    """The row count a block extraction of ``n`` rows runs with: the next power of two."""
    return 1 << int(n - 1).bit_length()


@functools.lru_cache(maxsize=2)
def extract_block_fn():
    """``(tiers, rows int32[m], ring_slots int32[m]) -> (K, V) [n_layers, m, Hkv, bs, D]``:
    each listed row's ring block, in every offloaded layer."""
    @jax.jit
    def run(tiers, rows, ring_slots):
        def one(t: OffloadedLayer):
            bs = t.block_size

            def row(r, slot):
                r = 0 if t.shared else r  # a shared pool is one buffer; the slot names the row's ring
                k = jax.lax.dynamic_slice_in_dim(t.pool_k[r], slot * bs, bs, axis=1)
                v = jax.lax.dynamic_slice_in_dim(t.pool_v[r], slot * bs, bs, axis=1)
                return k, v

            return jax.vmap(row)(rows, ring_slots)

        ks, vs = zip(*(one(t) for t in tiers))
        return jnp.stack(ks), jnp.stack(vs)

    return run


class MeshLayout:
    """A sharded model's runner pieces for one ``(batch, max_len)``: per layer the
    prompt program and the finishing program (device tier, host tier), and the
    decode step, each one ``shard_map`` over the mesh running the per-device code
    (the driver on its KV heads and rows). Which axis of each cache, tier and
    method-state leaf is split is read off abstract shapes, for the whole model,
    one device's heads and one replica's rows
    (:func:`models.runtime.sharding.specs_from_shapes`), as for the resident cache: the
    host tier ``[B, Hkv, NB, bs, D]`` splits like the device tier, so each device
    gathers its own heads' blocks from its own part of pinned host memory."""

    def __init__(self, runner, batch: int, max_len: int):  # runner: the TieredRunner (mesh, configs, method)
        par, mesh, cfg, local = runner.par, runner.mesh, runner.cfg, runner.local_cfg
        if batch % par.data:
            raise ValueError(f"batch {batch} does not split over data={par.data} replicas")
        dtype = jnp.dtype(runner.model.dtype)
        pool = runner._pool(max_len)
        rows, heads, per_head = P(shd.DATA), P(shd.DATA, shd.MODEL), P(shd.MODEL)
        self.rows = NamedSharding(mesh, rows)
        self.host_tier = NamedSharding(mesh, heads).with_memory_kind("pinned_host")

        def smap(fn, ins, outs):
            return jax.shard_map(fn, mesh=mesh, in_specs=ins, out_specs=outs, check_vma=False)

        self.prompt, self.finish, entry_specs, host_specs = [], [], [], []
        built = {}  # layers of one kind share their programs (one compilation, not one per layer)
        for i, spec in enumerate(runner.plan.specs):
            data = runner.layer_data(i)
            # per-KV-head layer constants (Double Sparsity's channels: [Hkv, r]) split with the heads
            dspecs = {k: per_head if per_kv_head(k, v, cfg.num_kv_heads, axis=0) else P() for k, v in data.items()}
            key = (spec, runner.offloaded[i], tuple((k, dspecs[k], v.shape, str(v.dtype)) for k, v in data.items()))
            if key in built:
                for lst, item in zip((entry_specs, host_specs, self.finish, self.prompt), built[key]):
                    lst.append(item)
                continue
            body = finish_layer_body(runner.method if spec.sparse else None, spec, runner.offloaded[i], pool)
            cap = spec.capacity(max_len)

            def shapes(c, b, body=body, data=data, dspecs=dspecs, cap=cap):
                kv = jax.ShapeDtypeStruct((b, c.num_kv_heads, cap, c.head_dim), dtype)
                q = jax.ShapeDtypeStruct((b, c.num_heads, c.head_dim), dtype)
                dd = {k: jax.ShapeDtypeStruct((c.num_kv_heads,) + v.shape[1:] if dspecs[k] == per_head else v.shape,
                                              v.dtype) for k, v in data.items()}
                return jax.eval_shape(body, kv, kv, jax.ShapeDtypeStruct((b,), jnp.int32), q, dd)

            out = shd.specs_from_shapes(shapes(cfg, batch), shapes(local, batch), shapes(cfg, batch // par.data),
                                        par, what=f"layer {i}")
            entry_specs.append(out[0])
            host_specs.append(HostLayer(heads, heads) if runner.offloaded[i] else None)
            self.finish.append(jax.jit(smap(body, (heads, heads, rows, heads, dspecs), out), donate_argnums=(0, 1)))
            prompt = functools.partial(prompt_layer, runner.driver, spec, cap)
            self.prompt.append(jax.jit(smap(prompt, (runner._param_specs["layers"], rows, rows, dspecs),
                                            (rows, heads, heads, heads))))
            built[key] = (entry_specs[-1], host_specs[-1], self.finish[-1], self.prompt[-1])

        cache_specs = KVCache(tuple(entry_specs), rows, max_len)
        step = decode_body(runner._local_graphdef, runner.driver, runner.gather_programs)
        self.decode = jax.jit(smap(step, (runner._param_specs, rows, cache_specs, tuple(host_specs)),
                                   (P(shd.DATA, None), cache_specs)),
                              donate_argnums=(2,), compiler_options=compiler_options(runner._conc))


def prompt_layer(driver: Driver, spec, cap: int, stacked, x, lengths, data):
    return driver.prompt_layer(stacked, x, lengths, data, spec, cap)[:4]
