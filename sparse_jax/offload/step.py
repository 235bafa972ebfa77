"""Offloaded AsyncTLS, one layer at a time: building the tiers after prefill and
one decode step (Sec. 4.2 of AsyncTLS, with SparseServe's GPU-direct loads).

Decode step ``t`` of a sparse layer (all inside the caller's jit):

1. the new token goes to the ring slot of its block; the label cache and the
   block boxes take it (the same updates as the resident method);
2. token selection runs over the blocks chosen at step ``t-1`` (resident in
   the pool, or in the ring) plus the newest block, and attention reads the
   selected tokens from the pool: ``S_t = TokenSelect(q_t, M_{t-1})``;
3. the block filter picks ``M_t`` with ``q_t`` for step ``t+1``; blocks of
   ``M_t`` not resident are assigned LRU slots and copied from the host tier
   by one ``host_gather_into`` kernel (only the misses move:
   ``T_t = M_t \\ C_t``). Step ``t+1``'s attention needs them, step ``t``'s
   does not: the one-step lag.

The selection is exactly :class:`sparse_jax.methods.AsyncTLS` with
``lag=True``, with the same ops in the same order, so the offloaded output
equals the resident one; only where the selected K/V rows are read differs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sparse_jax.cache import write_rows
from sparse_jax.methods.double_sparsity import AsyncTLS, TwoLevelState
from sparse_jax.offload.tiers import HostLayer, OffloadLayer
from sparse_jax.ops.attention import sparse_decode_attention
from sparse_jax.ops.slot_pool import assign_pool_slots
from sparse_jax.ops.transfer import host_gather_into


def check_offload(method: AsyncTLS, pool_slots: int, max_len: int) -> None:
    """Raise ValueError when ``method`` cannot run offloaded with ``pool_slots``."""
    if not isinstance(method, AsyncTLS):
        raise ValueError(f"offloading runs the asynctls method (two-level, one-step lag), got {method.name!r}")
    if method.sink or method.window:
        raise ValueError("offloaded asynctls: sink/window tokens are not supported (the paper uses none)")
    n1 = method.filter_blocks(max_len)
    if pool_slots < max(n1, 1):
        raise ValueError(
            f"pool_slots={pool_slots} is smaller than the blocks the filter keeps besides the newest "
            f"(min(kb, S/block) - 1 = {n1}): the chosen set must fit in the pool")
    if method.budget > (n1 + 1) * method.block_size:
        raise ValueError(
            f"offloaded asynctls: the budget ({method.budget}) exceeds the candidate tokens "
            f"((kb) * block = {(n1 + 1) * method.block_size}); raise kb")


def default_pool_slots(method: AsyncTLS, max_len: int) -> int:
    """Twice the filter's set, ``2 * (min(kb, S/block) - 1)``: on SmolLM2 with real
    text (8K context, kb 32) the smallest pool hit 89.8% of the needed blocks
    and the doubled one 98.8% (``benchmarks/results/offload_smollm2_locality.md``)."""
    return 2 * max(method.filter_blocks(max_len), 1)


def _ring_rows(pos, pool_slots, bs):
    """Pool row of token ``pos`` while its block is in the ring."""
    return (pool_slots + (pos // bs) % 2) * bs + pos % bs


def layer_from_prefill(method: AsyncTLS, k, v, lengths, q_last, channels, pool_slots: int):
    """Tiers of one sparse layer from its prefill K/V (device, ``[B,Hkv,S,D]``).

    Returns ``(layer: OffloadLayer, host_k, host_v)`` where ``host_* [B*Hkv*NB,
    bs, D]`` (still on device) is what the caller moves to the host tier. The
    pool is primed with the blocks the last prompt query chose (the first
    decode step's set), the ring with the prompt's last two blocks.
    """
    b, hkv, s, d = k.shape
    bs = method.block_size
    nb = s // bs
    state = method.state_from_keys(k, lengths, channels)
    newest = lengths // bs  # the first decode step's newest block
    prev = method.pick_blocks(q_last, state.boxes, newest)  # [B, Hkv, n1]
    state = TwoLevelState(state.boxes, state.labels, prev)
    n1 = prev.shape[-1]
    kb_, vb_ = k.reshape(b, hkv, nb, bs, d), v.reshape(b, hkv, nb, bs, d)

    def take_blocks(x, blocks):  # x [B,Hkv,NB,bs,D], blocks [B,Hkv,m] -> [B,Hkv,m,bs,D]
        idx = jnp.clip(blocks, 0, nb - 1)[..., None, None]
        return jnp.take_along_axis(x, idx, axis=2)

    need = prev < (newest - 1)[:, None, None]
    slots = jnp.arange(n1, dtype=jnp.int32)
    slot_block = jnp.full((b, hkv, pool_slots), -1, jnp.int32).at[..., :n1].set(jnp.where(need, prev, -1))
    slot_used = jnp.full((b, hkv, pool_slots), -1, jnp.int32).at[..., :n1].set(
        jnp.where(need, lengths[:, None, None], -1))
    block_slot = jax.vmap(jax.vmap(lambda blk, ok: jnp.full((nb,), -1, jnp.int32).at[jnp.where(ok, blk, nb)].set(
        slots, mode="drop")))(prev, need)
    ring_blocks = jnp.stack([newest - 1, newest], -1)  # [B, 2]
    ring_order = jnp.argsort(ring_blocks % 2, axis=-1)  # ring slot j holds the block with n % 2 == j
    ring = jnp.take_along_axis(ring_blocks, ring_order, axis=-1)
    ring = jnp.broadcast_to(ring[:, None, :], (b, hkv, 2))

    def pool(x):
        primed = jnp.where(need[..., None, None], take_blocks(x, prev), 0).astype(x.dtype)
        empty = jnp.zeros((b, hkv, pool_slots - n1, bs, d), x.dtype)
        rings = take_blocks(x, ring)
        return jnp.concatenate([primed, empty, rings], axis=2).reshape(b, hkv, (pool_slots + 2) * bs, d)

    zero = jnp.zeros((b * hkv,), jnp.int32)
    layer = OffloadLayer(pool(kb_), pool(vb_), block_slot, slot_block, slot_used, state, zero, zero)
    return layer, k.reshape(b * hkv * nb, bs, d), v.reshape(b * hkv * nb, bs, d)


def decode_layer(method: AsyncTLS, q, k_new, v_new, pos, layer: OffloadLayer, host: HostLayer, channels,
                 churn: float = 0.0, gather_programs: int | None = None):
    """One decode step of an offloaded sparse layer.

    ``q [B,Hq,D]``, ``k_new, v_new [B,Hkv,D]`` (the new token, post-RoPE),
    ``pos int32[B]`` its position, ``channels int32[Hkv,r]`` the layer's label
    channels. Returns ``(out [B,Hq,D], layer)``.

    ``churn`` (benchmarks only, default 0 = the real method): random weights
    have no temporal locality, so a benchmark can set the fraction of the
    block set renewed per step: the filter still runs (its cost is paid), but
    the next set is the last one with ``round(churn * (kb-1))`` blocks
    replaced, which emulates a hit rate measured on real text.

    ``gather_programs``: the copy kernel's grid (``host_gather_into``'s
    ``programs``). Nothing after the copy in this layer reads the pool, so in
    a CUDA graph whose independent kernels run concurrently (XLA's
    ``xla_gpu_command_buffer_scheduling_mode=CONCURRENT``) the copy runs
    beside the caller's output projection and MLP; a small grid (8) leaves
    those kernels most SMs. None: one program per block and tile.
    """
    bs = method.block_size
    b, hkv, d = k_new.shape
    p = layer.pool_slots
    nb = layer.block_slot.shape[2]
    st = layer.state
    lengths = pos + 1
    k_new, v_new = k_new.astype(layer.pool_k.dtype), v_new.astype(layer.pool_v.dtype)  # as the resident cache stores them

    # 1. append the token (ring slot of its block), labels and boxes
    pool_k, pool_v = write_rows(layer.pool_k, layer.pool_v, k_new, v_new, _ring_rows(pos, p, bs))
    st = method.append_key(st, k_new, pos, channels)

    # 2. token selection inside last step's blocks + the newest, attention from the pool
    sel, counts = method.select_tokens(q, st, st.prev_blocks, lengths, channels, nb * bs)
    blk, off = sel // bs, sel % bs
    newest = ((lengths - 1) // bs)[:, None, None]
    in_ring = blk >= newest - 1
    slot = _take_per_head(layer.block_slot, blk)
    pool_rows = jnp.where(in_ring, (p + blk % 2) * bs + off, jnp.maximum(slot, 0) * bs + off)
    out = sparse_decode_attention(q, pool_k, pool_v, pool_rows.astype(jnp.int32), counts, impl=method.impl)

    # 3. the next step's blocks, and the copies of the missing ones
    newest_next = lengths // bs
    nxt = method.pick_blocks(q, st.boxes, newest_next)  # [B, Hkv, n1]
    if churn > 0 and nxt.shape[-1]:
        nxt = _churned(nxt, st.prev_blocks, newest_next, pos, churn)
    r = b * hkv
    ring_start = jnp.broadcast_to((newest_next - 1)[:, None], (b, hkv)).reshape(r)  # newer blocks: the ring
    clock = jnp.broadcast_to(lengths[:, None], (b, hkv)).reshape(r)
    # one kernel: hits, LRU victims, the new tables and the copy list (per row)
    block_slot, slot_block, slot_used, src, dst, copies, hits = assign_pool_slots(
        nxt.reshape(r, -1), ring_start, clock, layer.block_slot.reshape(r, nb), layer.slot_block.reshape(r, p),
        layer.slot_used.reshape(r, p), ring_slots=2, impl=method.impl)

    # attention read the pool before any slot is overwritten
    pool_k, pool_v, out = jax.lax.optimization_barrier((pool_k, pool_v, out))
    if nxt.shape[-1]:
        # src rows index the host tier [B*Hkv*NB, bs, D], dst rows the pool seen
        # as [B*Hkv*(P+2), bs, D]; the first copies[r] entries of row r are live
        tuning = {} if gather_programs is None else {"programs": gather_programs}
        pk, pv = host_gather_into(host.k, host.v, pool_k.reshape(-1, bs, d), pool_v.reshape(-1, bs, d),
                                  src.reshape(-1), dst.reshape(-1), copies, impl=method.impl, **tuning)
        pool_k, pool_v = pk.reshape(pool_k.shape), pv.reshape(pool_v.shape)

    state = TwoLevelState(st.boxes, st.labels, nxt)
    layer = OffloadLayer(pool_k, pool_v, block_slot.reshape(b, hkv, nb), slot_block.reshape(b, hkv, p),
                         slot_used.reshape(b, hkv, p), state, hits, copies)
    return out, layer


def _take_per_head(table, idx):
    """``table[b, h, idx[b, h, ...]]`` (indices clipped) for ``table [B, Hkv, N]``.

    As one flat 1-D gather (a plain gather kernel), not a batched one."""
    b, h, n = table.shape
    base = (jnp.arange(b * h, dtype=jnp.int32) * n).reshape((b, h) + (1,) * (idx.ndim - 2))
    flat = (base + jnp.clip(idx, 0, n - 1)).reshape(-1)
    return jnp.take(table.reshape(-1), flat, mode="clip", indices_are_sorted=False).reshape(idx.shape)


def _churned(real, prev, newest_next, pos, churn):
    """Last step's set with its first ``round(churn * n1)`` blocks moved (benchmarks)."""
    n1 = real.shape[-1]
    c = max(1, round(churn * n1))
    elig = jnp.maximum(newest_next - 1, 1)[:, None, None]
    shift = 1 + (pos[:, None, None] * 7919) % jnp.maximum(elig - 1, 1)
    moved = (prev + shift) % elig
    sim = jnp.where(jnp.arange(n1) < c, moved, prev)
    long = (newest_next > n1 + 1)[:, None, None]  # short rows keep the real (complete) set
    # keep the real filter in the graph: its cost is what the benchmark measures
    return jnp.where(long & (real != -12345), sim, real).astype(jnp.int32)
