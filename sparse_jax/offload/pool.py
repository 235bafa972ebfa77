"""Offload for any selection: an offloaded layer's KV as a *view* (a resident
pool of blocks, a ring of the newest ones, the rest on the host) and its
decode step.

One decode step of an offloaded layer (inside the model's one jitted step):

1. the new token goes to the ring slot of its block; the method's state
   takes it (``append_state`` through the view: the newest key, or the keys of
   the newest block, both in the ring);
2. ``select`` returns a :class:`~sparse_jax.selection.Selection`;
3. a selection the previous step's ``prefetch`` already brought in
   (``within_prefetch``: AsyncTLS's one-step lag) is read straight from the
   pool. Any other block selection first places its blocks: one
   ``assign_pool_slots`` kernel finds the misses and gives them LRU slots,
   one ``host_gather_into`` kernel copies them from the host tier, and the
   attention waits for that copy (Quest, ArkVale: exact, but the copy is on
   the step's critical path);
4. attention over pool rows (``sparse_decode_attention``);
5. the selection's ``prefetch`` (the next step's blocks) is placed the same
   way after the attention read the pool (an optimisation barrier orders it):
   nothing in this step waits for that copy, so a concurrent CUDA graph runs
   it beside the layer's output projection and MLP.

Nothing here names a method: the method's selection (block ids, a prefetch,
``within_prefetch``) is the whole contract. Methods declare
``offload_block_size`` (None: cannot run offloaded), ``offload_blocks_per_step``
(the smallest pool) and ``first_prefetch`` (what to prime after prefill).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from sparse_jax.cache import write_rows
from sparse_jax.kv import newest_token
from sparse_jax.methods.base import AttentionMethod
from sparse_jax.offload.tiers import HostLayer, OffloadedLayer
from sparse_jax.ops.attention import sparse_decode_attention
from sparse_jax.ops.slot_pool import assign_pool_slots, assign_shared_pool_slots
from sparse_jax.ops.transfer import host_gather_into
from sparse_jax.selection import Selection

RING_SLOTS = 2  # the newest block and the one before it stay in the ring
POOLS = ("per_row", "shared")  # a pool per (row, KV head), or one per KV head shared by the rows


def check_offloadable(method: AttentionMethod) -> None:
    """Raise ValueError when ``method`` cannot run offloaded at all (whatever the sizes)."""
    if method.reads_all_keys:
        raise ValueError(f"{method.name} reads every key to select (reads_all_keys): it cannot run offloaded")
    if method.offload_block_size is None:
        raise ValueError(
            f"{method.name} cannot run offloaded: its selection names no blocks of the host tier "
            f"(offload_block_size is None; a token selection must lie in the previous step's prefetch)")


def check_offload(method: AttentionMethod, pool_slots: int, max_len: int) -> None:
    """Raise ValueError, before any compilation, when ``method`` cannot run offloaded
    with ``pool_slots`` block slots per (row, KV head) and ``max_len`` tokens."""
    check_offloadable(method)
    bs = method.offload_block_size
    if max_len % bs:
        raise ValueError(f"offloaded {method.name}: the cache length ({max_len}) must be a multiple of its "
                         f"block size ({bs})")
    need = method.offload_blocks_per_step(max_len)
    if pool_slots < need:
        raise ValueError(f"pool_slots={pool_slots} is smaller than the blocks one step of {method.name} reads "
                         f"outside the ring ({need}): the blocks of a step must fit in the pool")
    method.check_offload(max_len)


def check_pool(pool: str) -> str:
    if pool not in POOLS:
        raise ValueError(f"pool must be one of {POOLS}, got {pool!r}")
    return pool


def check_shared_fits(method: AttentionMethod, pool_slots: int, max_len: int, rows: int) -> None:
    """Raise ValueError when ``rows`` rows decoding at once could need more blocks in one
    step than a shared pool of ``pool_slots`` slots holds (each row reads up to
    ``offload_blocks_per_step`` blocks outside its ring): the step would have to evict
    blocks it reads. The runner checks it for every step's active rows; the serving
    engine caps its batch (R_max) so that it holds."""
    need = method.offload_blocks_per_step(max_len)
    if rows * need > pool_slots:
        raise ValueError(f"a shared pool of {pool_slots} slots cannot hold one step of {rows} rows of {method.name} "
                         f"({need} blocks each outside the ring: {rows * need}); use at most "
                         f"{pool_slots // need} rows at once or a larger pool")


def default_pool_slots(method: AttentionMethod, max_len: int) -> int:
    """Twice the blocks one step reads: on SmolLM2 with real text (8K context,
    AsyncTLS kb 32) the doubled pool misses several times fewer of the needed
    blocks than the smallest (README.md, 'Offloaded decoding', "Locality")."""
    return 2 * method.offload_blocks_per_step(max_len)


def ring_rows(pos: jax.Array, pool_slots: int, block_size: int, shared: bool = False) -> jax.Array:
    """Pool row of token ``pos int32[B]`` while its block is in the ring (a shared
    pool: each row's ring slots follow the ``pool_slots`` shared ones, two per row)."""
    base = pool_slots + (RING_SLOTS * jnp.arange(pos.shape[0], dtype=pos.dtype) if shared else 0)
    return (base + (pos // block_size) % RING_SLOTS) * block_size + pos % block_size


def _write_shared(pool_k, pool_v, k_new, v_new, rows):
    """The shared buffers ``[1, Hkv, S, D]`` with row ``b``'s new token ``[B, Hkv, D]``
    written at pool row ``rows[b]`` (its ring), in place."""
    k = pool_k[0].at[:, rows].set(jnp.swapaxes(k_new, 0, 1).astype(pool_k.dtype))[None]
    v = pool_v[0].at[:, rows].set(jnp.swapaxes(v_new, 0, 1).astype(pool_v.dtype))[None]
    return jax.lax.optimization_barrier((k, v))


def _take_per_head(table, idx):
    """``table[b, h, idx[b, h, ...]]`` (indices clipped) for ``table [B, Hkv, N]``,
    as one flat 1-D gather (a plain gather kernel), not a batched one."""
    b, h, n = table.shape
    base = (jnp.arange(b * h, dtype=jnp.int32) * n).reshape((b, h) + (1,) * (idx.ndim - 2))
    flat = (base + jnp.clip(idx, 0, n - 1)).reshape(-1)
    return jnp.take(table.reshape(-1), flat, mode="clip", indices_are_sorted=False).reshape(idx.shape)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PooledKV:
    """The view of an offloaded layer (see :mod:`sparse_jax.kv`): ``pool_k, pool_v
    [B, Hkv, (P+2)*bs, D]``, ``block_slot int32[B, Hkv, NB]``."""

    pool_k: jax.Array
    pool_v: jax.Array
    block_slot: jax.Array
    block_size: int = dataclasses.field(metadata=dict(static=True))
    #: a shared pool: ``pool_k, pool_v [1, Hkv, (P + 2B)*bs, D]`` read by every row
    shared: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @property
    def capacity(self) -> int:
        return self.block_slot.shape[2] * self.block_size

    @property
    def num_kv_heads(self) -> int:
        return self.pool_k.shape[1]

    @property
    def pool_slots(self) -> int:
        rings = RING_SLOTS * (self.block_slot.shape[0] if self.shared else 1)
        return self.pool_k.shape[2] // self.block_size - rings

    def _ring_start(self, blocks):
        """Pool slot of the ring slot of each row's block ``blocks int32[B]``."""
        rows = jnp.arange(blocks.shape[0], dtype=jnp.int32) if self.shared else 0
        return self.pool_slots + RING_SLOTS * rows + blocks % RING_SLOTS

    @property
    def k(self):
        raise ValueError("an offloaded layer has no whole key cache on the device: a method that reads every "
                         "key (reads_all_keys) cannot run offloaded")

    v = k

    def newest_keys(self, positions: jax.Array) -> jax.Array:
        rows = ring_rows(positions, self.pool_slots, self.block_size, self.shared)
        if self.shared:
            return jnp.swapaxes(self.pool_k[0][:, rows], 0, 1)
        return newest_token(self.pool_k, rows)

    def block_keys(self, blocks: jax.Array, block_size: int) -> jax.Array:
        """Keys of each row's newest block (in the ring): ``[B, Hkv, bs, D]``."""
        if block_size != self.block_size:
            raise ValueError(f"block_keys: the offloaded tier has blocks of {self.block_size} tokens, "
                             f"asked for {block_size}")
        start = self._ring_start(blocks) * block_size
        if self.shared:
            return jax.vmap(lambda s: jax.lax.dynamic_slice_in_dim(self.pool_k[0], s, block_size, axis=1))(start)
        return jax.vmap(lambda row, s: jax.lax.dynamic_slice_in_dim(row, s, block_size, axis=1))(self.pool_k, start)

    def pool_rows(self, positions: jax.Array, lengths: jax.Array) -> jax.Array:
        """Pool row of each token position ``int32[B, Hkv, K]``: the ring for the two
        newest blocks, the block's pool slot otherwise."""
        bs, p = self.block_size, self.pool_slots
        blk, off = positions // bs, positions % bs
        newest = ((lengths - 1) // bs)[:, None, None]
        slot = _take_per_head(self.block_slot, blk)
        ring = p + blk % RING_SLOTS
        if self.shared:
            ring = ring + RING_SLOTS * jnp.arange(blk.shape[0], dtype=blk.dtype)[:, None, None]
        return jnp.where(blk >= newest - 1, ring * bs + off, jnp.maximum(slot, 0) * bs + off)

    def attend(self, q: jax.Array, lengths: jax.Array, sel: Selection, *, impl: str = "auto") -> jax.Array:
        if sel.kind == "all":
            raise ValueError("an 'all' selection (exact attention) cannot read an offloaded layer")
        indices, counts = sel.token_view(lengths)
        rows = self.pool_rows(indices, lengths).astype(jnp.int32)
        return sparse_decode_attention(q, self.pool_k, self.pool_v, rows, counts, impl=impl)


def host_block_ids(src: jax.Array, host: HostLayer, hkv: int, nb: int):
    """``(ids, id_dims)`` for :func:`host_gather_into` of the copy list ``src int32[M]`` (flat
    ids ``(b*Hkv + h)*NB + n`` over the contiguous tier's ``(B, Hkv, NB)`` axes, as the slot
    assignment names blocks): ``src`` itself over ``[B, Hkv, NB, bs, D]`` (``id_dims=3``), or
    for a paged tier (:mod:`sparse_jax.offload.tiers`) the page's, ``table[b, n]*Hkv + h``
    over ``[N, Hkv, bs, D]`` (``id_dims=2``). Entries past a copy count may be anything: they
    are clipped here and not copied."""
    if host.table is None:
        return src, 3
    b = host.table.shape[0]
    row = jnp.clip(src // (hkv * nb), 0, b - 1)
    head, blk = (src // nb) % hkv, src % nb
    page = jnp.take(host.table.reshape(-1), row * nb + blk, mode="clip")
    return page * hkv + head, 2


def place_blocks(need, ring_start, clock, entry_tables, pool_k, pool_v, host: HostLayer, *, impl: str,
                 gather_programs: int | None = None):
    """Make the blocks ``need int32[B, Hkv, n]`` resident (those ``>= ring_start[b]``
    are in the ring and skipped): LRU slots for the misses, their copies from the host.

    Returns ``(tables, pool_k, pool_v, hits, misses)``; ``tables = (block_slot,
    slot_block, slot_used)`` each ``[B, Hkv, ...]``; counters ``int32[B, Hkv]``."""
    block_slot, slot_block, slot_used = entry_tables
    b, hkv, nb = block_slot.shape
    p = slot_block.shape[2]
    r = b * hkv
    bs, d = host.k.shape[-2:]
    rs = jnp.broadcast_to(ring_start[:, None], (b, hkv)).reshape(r)
    ck = jnp.broadcast_to(clock[:, None], (b, hkv)).reshape(r)
    bslot, sblock, sused, src, dst, copies, hits = assign_pool_slots(
        need.reshape(r, -1), rs, ck, block_slot.reshape(r, nb), slot_block.reshape(r, p), slot_used.reshape(r, p),
        ring_slots=RING_SLOTS, impl=impl)
    if need.shape[-1]:
        tuning = {} if gather_programs is None else {"programs": gather_programs}
        # src: the flat id over the host tier's (B, Hkv, NB) axes (paged: its page's); dst: the pool seen
        # as [B*Hkv*(P+2), bs, D]
        src, id_dims = host_block_ids(src.reshape(-1), host, hkv, nb)
        pk, pv = host_gather_into(host.k, host.v, pool_k.reshape(-1, bs, d), pool_v.reshape(-1, bs, d),
                                  src, dst.reshape(-1), copies, impl=impl, id_dims=id_dims, **tuning)
        pool_k, pool_v = pk.reshape(pool_k.shape), pv.reshape(pool_v.shape)
    tables = (bslot.reshape(b, hkv, nb), sblock.reshape(b, hkv, p), sused.reshape(b, hkv, p))
    return tables, pool_k, pool_v, hits.reshape(b, hkv), copies.reshape(b, hkv)


#: the shared pool's slot assignment when the step's ``impl`` is "auto": None follows the
#: step (the kernel on the GPU). On the H100 the kernel wins at a miss or two per row and
#: loses to the jnp reference with many misses (docs/offload.md, 'The shared slot kernel
#: on the H100');
#: ``python -m benchmarks.offload --shared-slot-impl reference`` sets this to A/B the step.
#: It is read when a step is traced: set it before the first offloaded step compiles.
SHARED_SLOT_IMPL: str | None = None


def place_blocks_shared(need, ring_start, clock, entry_tables, pool_k, pool_v, host: HostLayer, *, impl: str,
                        gather_programs: int | None = None):
    """:func:`place_blocks` for a shared pool: ``need int32[B, Hkv, n]`` (row ``b``'s
    blocks ``>= ring_start[b]`` skipped: 0 for a row that places nothing), ``clock
    int32[Hkv]``; ``tables = (block_slot [B, Hkv, NB], slot_block [1, Hkv, N],
    slot_used [1, Hkv, N])``, ``pool_* [1, Hkv, (N + 2B)*bs, D]``."""
    block_slot, slot_block, slot_used = entry_tables
    bs, d = host.k.shape[-2:]
    slot_impl = SHARED_SLOT_IMPL if (SHARED_SLOT_IMPL is not None and impl == "auto") else impl
    bslot, sblock, sused, src, dst, copies, hits = assign_shared_pool_slots(
        need, ring_start, clock, block_slot, slot_block[0], slot_used[0], ring_slots=RING_SLOTS, impl=slot_impl)
    if need.shape[-1]:
        tuning = {} if gather_programs is None else {"programs": gather_programs}
        # src: the flat id over the host tier's (B, Hkv, NB) axes (paged: its page's); dst: the buffer seen
        # as [Hkv*(N+2B), bs, D]
        src, id_dims = host_block_ids(src.reshape(-1), host, *block_slot.shape[1:])
        pk, pv = host_gather_into(host.k, host.v, pool_k.reshape(-1, bs, d), pool_v.reshape(-1, bs, d),
                                  src, dst.reshape(-1), copies.reshape(-1), impl=impl, id_dims=id_dims,
                                  **tuning)
        pool_k, pool_v = pk.reshape(pool_k.shape), pv.reshape(pool_v.shape)
    return (bslot, sblock[None], sused[None]), pool_k, pool_v, hits, copies


def decode_offloaded(method: AttentionMethod, q, k_new, v_new, pos, entry: OffloadedLayer, host: HostLayer, layer,
                     carry, *, gather_programs: int | None = None, active=None):
    """One decode step of an offloaded layer (module docstring).

    ``q [B,Hq,D]``, ``k_new, v_new [B,Hkv,D]`` (the new token, post-RoPE),
    ``pos int32[B]`` its position, ``layer`` the :class:`LayerCtx`, ``carry``
    the method's cross-layer carry. Returns ``(out [B,Hq,D], entry, carry)``.
    ``gather_programs``: the copy kernels' grid (``host_gather_into``'s
    ``programs``; None: one program per block and tile). ``active`` (``bool[B]``,
    shared pool only; None: every row): rows outside it place no block in the
    shared pool (a serving engine's free slots must not evict the others' blocks).
    """
    impl = getattr(method, "impl", "auto")
    bs, p, shared = entry.block_size, entry.pool_slots, entry.shared
    lengths = pos + 1
    nb = entry.block_slot.shape[2]
    # as the resident cache stores them
    k_new, v_new = k_new.astype(entry.pool_k.dtype), v_new.astype(entry.pool_v.dtype)
    write = _write_shared if shared else write_rows
    pool_k, pool_v = write(entry.pool_k, entry.pool_v, k_new, v_new, ring_rows(pos, p, bs, shared))
    tables = (entry.block_slot, entry.slot_block, entry.slot_used)
    kv = PooledKV(pool_k, pool_v, entry.block_slot, bs, shared)
    tick = None
    if shared:
        tick = entry.tick + 1  # the pool's clock: one tick per step
        live = jnp.ones(pos.shape, bool) if active is None else active

    def place(need, ring_start, tables, pool_k, pool_v):
        if shared:
            return place_blocks_shared(need, jnp.where(live, ring_start, 0), tick[0], tables, pool_k, pool_v, host,
                                       impl=impl, gather_programs=gather_programs)
        return place_blocks(need, ring_start, lengths, tables, pool_k, pool_v, host, impl=impl,
                            gather_programs=gather_programs)
    state = method.append_state(entry.state, kv, pos, layer)
    sel, state, carry = method.select(q, kv, lengths, state, carry, layer)
    zero = jnp.zeros_like(entry.hits)
    hits, misses = zero, zero
    newest = (lengths - 1) // bs
    if not sel.within_prefetch:
        if sel.kind != "blocks" or sel.block_size != bs:
            raise ValueError(f"offloaded {method.name}: a selection of kind {sel.kind!r} (block size "
                             f"{sel.block_size}) is neither blocks of the tier ({bs} tokens) nor within the "
                             f"previous step's prefetch")
        n = sel.indices.shape[-1]
        # entries past the count name the newest block (in the ring: skipped)
        need = jnp.where(jnp.arange(n) < sel.counts[..., None], sel.indices, newest[:, None, None])
        tables, pool_k, pool_v, hits, misses = place(jnp.clip(need, 0, nb - 1), newest - 1, tables, pool_k, pool_v)
        kv = PooledKV(pool_k, pool_v, tables[0], bs, shared)
    out = kv.attend(q, lengths, sel, impl=impl)
    if sel.prefetch is not None:
        if sel.block_size != bs:
            raise ValueError(f"offloaded {method.name}: prefetch blocks of {sel.block_size} tokens, the tier's "
                             f"are {bs}")
        # the attention read the pool before any slot is overwritten
        pool_k, pool_v, out = jax.lax.optimization_barrier((pool_k, pool_v, out))
        tables, pool_k, pool_v, h2, m2 = place(sel.prefetch, lengths // bs - 1, tables, pool_k, pool_v)
        hits, misses = hits + h2, misses + m2
    return out, OffloadedLayer(pool_k, pool_v, *tables, state, hits, misses, bs, tick, shared), carry


def tier_from_prefill(method: AttentionMethod, k, v, lengths, state, pool_slots: int, shared: bool = False):
    """The device tier of one layer from its prefill K/V (device ``[B,Hkv,S,D]``)
    and the method's state after prefill.

    Returns ``(entry: OffloadedLayer, host_k, host_v)`` where ``host_* [B, Hkv,
    NB, bs, D]`` (still on the device) is what the caller moves to the host tier.
    The pool is primed with ``method.first_prefetch(state)`` (the blocks the
    first decode step reads; nothing when None), the ring with the prompt's
    last two blocks. ``shared``: one pool of ``pool_slots`` per KV head for every row
    (row ``b``'s primed blocks in slots ``b*m .. b*m + m - 1``)."""
    b, hkv, s, d = k.shape
    bs = method.offload_block_size
    nb = s // bs
    kb_, vb_ = k.reshape(b, hkv, nb, bs, d), v.reshape(b, hkv, nb, bs, d)
    newest = lengths // bs  # the first decode step's newest block
    prime = method.first_prefetch(state)
    if prime is None:
        prime = jnp.zeros((b, hkv, 0), jnp.int32)
    m = prime.shape[-1]
    if m > pool_slots:  # (a shared pool: check_shared_fits, by the caller that decodes every row)
        raise ValueError(f"the first step's {m} blocks do not fit in a pool of {pool_slots} slots")

    def take_blocks(x, blocks):  # x [B,Hkv,NB,bs,D], blocks [B,Hkv,m] -> [B,Hkv,m,bs,D]
        idx = jnp.clip(blocks, 0, nb - 1)[..., None, None]
        return jnp.take_along_axis(x, idx, axis=2)

    need = (prime >= 0) & (prime < (newest - 1)[:, None, None])
    if shared:
        return _shared_tier_from_prefill(kb_, vb_, prime, need, newest, state, pool_slots, bs)
    slots = jnp.arange(m, dtype=jnp.int32)
    # the first m slots primed, the rest empty (-1). Built by concatenation, not by
    # `.at[..., :m].set`: that update covering the whole axis (m == pool_slots) segfaults
    # XLA:CPU's compiler inside a multi-device shard_map (jax 0.11.2)
    empty = jnp.full((b, hkv, pool_slots - m), -1, jnp.int32)
    slot_block = jnp.concatenate([jnp.where(need, prime, -1), empty], axis=-1)
    slot_used = jnp.concatenate([jnp.where(need, lengths[:, None, None], -1), empty], axis=-1)
    block_slot = jax.vmap(jax.vmap(lambda blk, ok: jnp.full((nb,), -1, jnp.int32).at[jnp.where(ok, blk, nb)].set(
        slots, mode="drop")))(prime, need)
    ring_blocks = jnp.stack([newest - 1, newest], -1)  # [B, 2]
    ring_order = jnp.argsort(ring_blocks % RING_SLOTS, axis=-1)  # ring slot j holds the block with n % 2 == j
    ring = jnp.take_along_axis(ring_blocks, ring_order, axis=-1)
    ring = jnp.broadcast_to(ring[:, None, :], (b, hkv, RING_SLOTS))

    def pool(x):
        primed = jnp.where(need[..., None, None], take_blocks(x, prime), 0).astype(x.dtype)
        empty = jnp.zeros((b, hkv, pool_slots - m, bs, d), x.dtype)
        rings = take_blocks(x, ring)
        return jnp.concatenate([primed, empty, rings], axis=2).reshape(b, hkv, (pool_slots + RING_SLOTS) * bs, d)

    zero = jnp.zeros((b, hkv), jnp.int32)
    entry = OffloadedLayer(pool(kb_), pool(vb_), block_slot, slot_block, slot_used, state, zero, zero, bs)
    return entry, kb_, vb_


def _ring_blocks(newest, hkv):
    """``[B, Hkv, 2]``: the blocks each row's two ring slots hold (slot j: block n, n % 2 == j)."""
    ring_blocks = jnp.stack([newest - 1, newest], -1)  # [B, 2]
    ring_order = jnp.argsort(ring_blocks % RING_SLOTS, axis=-1)
    ring = jnp.take_along_axis(ring_blocks, ring_order, axis=-1)
    return jnp.broadcast_to(ring[:, None, :], (ring.shape[0], hkv, RING_SLOTS))


def _shared_tier_from_prefill(kb_, vb_, prime, need, newest, state, pool_slots: int, bs: int):
    """:func:`tier_from_prefill` for a shared pool (layout: :mod:`sparse_jax.offload.tiers`):
    per KV head, the rows' primed blocks take slots 0, 1, ... in (row, position) order
    (a caller that decodes every row checks they fit: :func:`check_shared_fits`; any
    past the pool are left out, as a miss the first step fetches)."""
    b, hkv, nb, _, d = kb_.shape
    m = prime.shape[-1]
    n = pool_slots
    rows = jnp.arange(b, dtype=jnp.int32)
    flat = (rows[:, None, None] * nb + jnp.clip(prime, 0, nb - 1)).transpose(1, 0, 2).reshape(hkv, b * m)
    ok = need.transpose(1, 0, 2).reshape(hkv, b * m)
    rank = jnp.cumsum(ok.astype(jnp.int32), axis=-1) - 1
    slot = jnp.where(ok & (rank < n), rank, n)  # [Hkv, B*m]; n: not placed
    heads = jnp.arange(hkv, dtype=jnp.int32)[:, None]
    slot_block = jnp.full((hkv, n), -1, jnp.int32).at[heads, slot].set(flat, mode="drop")
    slot_used = jnp.full((hkv, n), -1, jnp.int32).at[heads, slot].set(0, mode="drop")
    src = jnp.full((hkv, n), -1, jnp.int32).at[heads, slot].set(jnp.arange(b * m, dtype=jnp.int32), mode="drop")
    placed = slot < n
    block_slot = jnp.full((hkv, b * nb), -1, jnp.int32).at[heads, jnp.where(placed, flat, b * nb)].set(
        slot, mode="drop").reshape(hkv, b, nb).transpose(1, 0, 2)
    ring = _ring_blocks(newest, hkv)

    def take_blocks(x, blocks):
        return jnp.take_along_axis(x, jnp.clip(blocks, 0, nb - 1)[..., None, None], axis=2)

    def pool(x):
        primed = take_blocks(x, prime).transpose(1, 0, 2, 3, 4).reshape(hkv, b * m, bs, d)
        slots = jnp.take_along_axis(primed, jnp.maximum(src, 0)[..., None, None], axis=1)  # [Hkv, N, bs, D]
        slots = jnp.where((src >= 0)[..., None, None], slots, 0).astype(x.dtype)
        rings = take_blocks(x, ring).transpose(1, 0, 2, 3, 4).reshape(hkv, b * RING_SLOTS, bs, d)
        return jnp.concatenate([slots, rings], axis=1).reshape(1, hkv, (n + RING_SLOTS * b) * bs, d)

    zero = jnp.zeros((b, hkv), jnp.int32)
    entry = OffloadedLayer(pool(kb_), pool(vb_), block_slot, slot_block[None], slot_used[None], state, zero, zero,
                           bs, jnp.zeros((1, hkv), jnp.int32), True)
    return entry, kb_, vb_


def insert_shared_row(big: OffloadedLayer, row: OffloadedLayer, slot, host: HostLayer, *, impl: str = "auto"):
    """Row ``slot`` of a shared-pool tier ``big`` replaced by the one-row per-row tier
    ``row`` (a prefilled request; its host blocks already copied into ``host``'s row
    ``slot``): the slot's previous blocks leave the pool, the row's ring and method
    state go in, and the blocks its pool held (what its first step reads: the primed
    prefetch) are placed LRU in the shared pool, copied from ``host``. The per-step
    counters are left as they are."""
    bs = big.block_size
    b, hkv, nb = big.block_slot.shape
    n, p1 = big.pool_slots, row.pool_slots
    sb, su = big.slot_block[0], big.slot_used[0]
    gone = (sb >= 0) & (sb // nb == slot)  # the previous occupant's blocks
    sb, su = jnp.where(gone, -1, sb), jnp.where(gone, -1, su)
    bslot = jax.lax.dynamic_update_index_in_dim(big.block_slot, jnp.full((hkv, nb), -1, jnp.int32), slot, 0)
    ring_k = row.pool_k[0, :, p1 * bs:(p1 + RING_SLOTS) * bs]
    ring_v = row.pool_v[0, :, p1 * bs:(p1 + RING_SLOTS) * bs]
    at = (n + RING_SLOTS * slot) * bs
    pool_k = jax.lax.dynamic_update_slice_in_dim(big.pool_k, ring_k[None].astype(big.pool_k.dtype), at, axis=2)
    pool_v = jax.lax.dynamic_update_slice_in_dim(big.pool_v, ring_v[None].astype(big.pool_v.dtype), at, axis=2)
    state = jax.tree.map(lambda x, y: jax.lax.dynamic_update_index_in_dim(x, y[0].astype(x.dtype), slot, 0),
                         big.state, row.state)
    # the row's resident blocks (its pool's table), placed for this row only
    mine = row.slot_block[0]  # [Hkv, P1] block ids, -1 empty
    need = jnp.zeros((b, hkv, p1), jnp.int32).at[slot].set(jnp.where(mine >= 0, mine, nb))
    # the row's pool holds blocks below its ring only: every listed block is placed (empties, nb, are not)
    ring_start = jnp.where(jnp.arange(b, dtype=jnp.int32) == slot, nb, 0)
    tables, pool_k, pool_v, _, _ = place_blocks_shared(need, ring_start, big.tick[0], (bslot, sb[None], su[None]),
                                                       pool_k, pool_v, host, impl=impl)
    return dataclasses.replace(big, pool_k=pool_k, pool_v=pool_v, block_slot=tables[0], slot_block=tables[1],
                               slot_used=tables[2], state=state)
