"""Block metadata (Quest min/max, ArkVale cuboid) and Quest block scores.

Shapes (head-major KV cache, ragged batch):

* ``k``: ``[B, Hkv, S, D]``, ``lengths``: ``int32[B]`` (valid tokens per row).
* block metadata: ``[B, Hkv, NB, D]`` with ``NB = ceil(S / block_size)``, in
  ``k``'s dtype. Block ``n`` covers tokens ``[n*block_size, (n+1)*block_size)``.
  Tokens at or past ``lengths[b]`` are excluded; a block with no valid token is
  all zeros. Callers must mask blocks ``>= ceil(lengths[b] / block_size)``
  themselves: a zero box scores 0, which is not "very unlikely".
* ``q``: ``[B, Hq, D]``; query head ``i`` belongs to KV head ``i // G`` with
  ``G = Hq // Hkv``.
* scores: ``float32[B, Hkv, NB]``.

Quest score in AsyncTLS's GEMM form: ``s_n = sum_g q_g+ . kmax_n + q_g- . kmin_n``
(``q+ = max(q, 0)``, ``q- = min(q, 0)``); it is an upper bound of ``q_g . k_j``
summed over the group, for every token ``j`` of block ``n``. The sum over the
group is linear, so the kernel folds the ``G`` heads into one ``q+`` and one
``q-`` vector first and then streams ``kmax``/``kmin`` once: the op is a
memory-bound GEMV (``2 * NB * D`` elements per (b, kv-head)), whatever ``G``.

ArkVale's page summary is a box centred at ``c = (max + min) / 2`` with
half-width ``r = mean_j |c - k_j|`` over the block's valid tokens; returned as
``(c + r, c - r)`` it is scored with the same formula (no longer a bound).
It has no incremental update: the mean needs the block's tokens, so callers
re-summarise the block a new token lands in.

Kernels and tuning knobs:

* ``block_summary_kernel`` (min/max or cuboid, one pass over ``k``): grid
  ``(B, Hkv, ceil(NB / blocks_per_program))``; ``blocks_per_program`` (default
  ~128 tokens per program), ``num_warps``, ``num_stages``. The cuboid mode
  keeps the tile live for its second reduction (about 200 registers per
  thread at bf16, D=128, 128 tokens, 4 warps, no spills in ptxas): lower
  ``blocks_per_program`` or raise ``num_warps`` if occupancy matters.
* ``quest_block_scores_kernel``: grid ``(B, Hkv, ceil(NB / block_n))``;
  ``block_n`` (default 128), ``num_warps``, ``num_stages``.

Every kernel has a pure-jnp ``*_reference`` with the same signature (f32
math), used on CPU and as the test oracle. Kernels are Pallas-Triton and take
``interpret=True`` so CPU tests run their code.

Triton constraints honoured here: every in-kernel tensor has power-of-two
dimensions (``block_size``, ``D`` and the tiles must be powers of two; the
public ops fall back to the reference otherwise); ragged ends are handled with
masked loads/stores, never by padding the cache (that would copy it).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

__all__ = [
    "block_minmax_reference",
    "block_cuboid_reference",
    "update_block_minmax_reference",
    "quest_block_scores_reference",
    "block_summary_kernel",
    "quest_block_scores_kernel",
    "is_pow2",
]


def is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def _num_blocks(s: int, block_size: int) -> int:
    return -(-s // block_size)


# ----------------------------------------------------------------------------
# References (pure jnp, f32 math)
# ----------------------------------------------------------------------------


def _blocked_valid(k, lengths, block_size):
    """Pad S to NB*block_size and return (x [B,H,NB,bs,D] f32, valid [B,1,NB,bs,1])."""
    b, h, s, d = k.shape
    nb = _num_blocks(s, block_size)
    pad = nb * block_size - s
    x = jnp.pad(k.astype(jnp.float32), ((0, 0), (0, 0), (0, pad), (0, 0)))
    x = x.reshape(b, h, nb, block_size, d)
    tok = jnp.arange(nb * block_size, dtype=jnp.int32).reshape(nb, block_size)
    length = jnp.clip(lengths.astype(jnp.int32), 0, s)
    valid = tok[None] < length[:, None, None]  # [B, NB, bs]
    return x, valid[:, None, :, :, None]


@functools.partial(jax.jit, static_argnames=("block_size",))
def block_minmax_reference(k, lengths, *, block_size):
    """Per-block channel-wise max/min over valid tokens. See module docstring."""
    x, valid = _blocked_valid(k, lengths, block_size)
    kmax = jnp.max(jnp.where(valid, x, -jnp.inf), axis=3)
    kmin = jnp.min(jnp.where(valid, x, jnp.inf), axis=3)
    nonempty = jnp.any(valid, axis=3)  # [B, 1, NB, 1]
    kmax = jnp.where(nonempty, kmax, 0.0)
    kmin = jnp.where(nonempty, kmin, 0.0)
    return kmax.astype(k.dtype), kmin.astype(k.dtype)


@functools.partial(jax.jit, static_argnames=("block_size",))
def block_cuboid_reference(k, lengths, *, block_size):
    """ArkVale box (centre +- mean |centre - k|) over valid tokens, as (upper, lower)."""
    x, valid = _blocked_valid(k, lengths, block_size)
    kmax = jnp.max(jnp.where(valid, x, -jnp.inf), axis=3)
    kmin = jnp.min(jnp.where(valid, x, jnp.inf), axis=3)
    nonempty = jnp.any(valid, axis=3)
    centre = jnp.where(nonempty, 0.5 * (kmax + kmin), 0.0)
    count = jnp.sum(valid, axis=3).astype(jnp.float32)  # [B, 1, NB, 1]
    dev = jnp.where(valid, jnp.abs(x - centre[:, :, :, None, :]), 0.0)
    radius = jnp.sum(dev, axis=3) / jnp.maximum(count, 1.0)
    return (centre + radius).astype(k.dtype), (centre - radius).astype(k.dtype)


@functools.partial(jax.jit, static_argnames=("block_size",))
def update_block_minmax_reference(k_max, k_min, k_new, positions, *, block_size):
    """Fold one appended token per row into the Quest metadata.

    ``k_new``: ``[B, Hkv, D]``, the key written at ``positions[b]`` (the row's
    length before the append). When the position opens a block, that block's
    max/min become ``k_new`` (its old contents are stale or zero); otherwise
    they are the elementwise max/min with ``k_new``. Rows whose position is
    past the metadata's capacity (``NB * block_size``) are left unchanged.
    """
    b = k_max.shape[0]
    nb = k_max.shape[2]
    positions = positions.astype(jnp.int32)
    blk = positions // block_size
    opens = (positions % block_size == 0)[:, None, None]
    in_range = ((positions >= 0) & (blk < nb))[:, None, None]
    blk_c = jnp.clip(blk, 0, nb - 1)
    rows = jnp.arange(b)
    new = k_new.astype(k_max.dtype)
    old_max = k_max[rows, :, blk_c]  # [B, Hkv, D]
    old_min = k_min[rows, :, blk_c]
    upd_max = jnp.where(opens, new, jnp.maximum(old_max, new))
    upd_min = jnp.where(opens, new, jnp.minimum(old_min, new))
    upd_max = jnp.where(in_range, upd_max, old_max)
    upd_min = jnp.where(in_range, upd_min, old_min)
    return k_max.at[rows, :, blk_c].set(upd_max), k_min.at[rows, :, blk_c].set(upd_min)


@jax.jit
def quest_block_scores_reference(q, k_max, k_min):
    """``float32[B, Hkv, NB]``: sum over the group of q+ . kmax + q- . kmin."""
    b, hq, d = q.shape
    hkv = k_max.shape[1]
    g = hq // hkv
    qf = q.astype(jnp.float32).reshape(b, hkv, g, d)
    qpos = jnp.sum(jnp.maximum(qf, 0.0), axis=2)  # [B, Hkv, D]
    qneg = jnp.sum(jnp.minimum(qf, 0.0), axis=2)
    hi = jax.lax.Precision.HIGHEST
    s = jnp.einsum("bhd,bhnd->bhn", qpos, k_max.astype(jnp.float32), precision=hi)
    s = s + jnp.einsum("bhd,bhnd->bhn", qneg, k_min.astype(jnp.float32), precision=hi)
    return s


# ----------------------------------------------------------------------------
# Kernel: block summaries (min/max or cuboid), one pass over k
# ----------------------------------------------------------------------------


def _block_summary_body(len_ref, k_ref, hi_ref, lo_ref, *, seq_len, block_size,
                        blocks_per_program, num_blocks, mode):
    # k_ref: [S, D] of this (b, kv-head); hi_ref/lo_ref: [NB, D]; len_ref: [].
    t = pl.program_id(2)
    nbt = blocks_per_program
    tile = nbt * block_size
    d = k_ref.shape[-1]
    length = jnp.clip(len_ref[()], 0, seq_len)

    tok = t * tile + jnp.arange(tile, dtype=jnp.int32)
    valid = tok < length  # also excludes tok >= S: length <= S
    # Masked load: the tail tile reads past S, and no padding copy of the
    # cache is made; masked-off lanes never touch memory.
    x = plgpu.load(k_ref.at[pl.ds(t * tile, tile), :], mask=valid[:, None], other=0.0)
    x = x.astype(jnp.float32).reshape(nbt, block_size, d)
    valid3 = valid.reshape(nbt, block_size)[:, :, None]

    kmax = jnp.max(jnp.where(valid3, x, -jnp.inf), axis=1)  # [nbt, D]
    kmin = jnp.min(jnp.where(valid3, x, jnp.inf), axis=1)
    blk_start = t * tile + jnp.arange(nbt, dtype=jnp.int32) * block_size
    nonempty = (blk_start < length)[:, None]
    kmax = jnp.where(nonempty, kmax, 0.0)
    kmin = jnp.where(nonempty, kmin, 0.0)

    if mode == "minmax":
        hi, lo = kmax, kmin
    else:  # "cuboid": the tile is still in registers, so the second pass is free.
        centre = 0.5 * (kmax + kmin)
        dev = jnp.where(valid3, jnp.abs(x - centre[:, None, :]), 0.0)
        count = jnp.sum(valid3.astype(jnp.float32), axis=1)  # [nbt, 1]
        radius = jnp.sum(dev, axis=1) / jnp.maximum(count, 1.0)
        hi, lo = centre + radius, centre - radius

    blk = t * nbt + jnp.arange(nbt, dtype=jnp.int32)
    out_mask = (blk < num_blocks)[:, None]
    plgpu.store(hi_ref.at[pl.ds(t * nbt, nbt), :], hi.astype(hi_ref.dtype), mask=out_mask)
    plgpu.store(lo_ref.at[pl.ds(t * nbt, nbt), :], lo.astype(lo_ref.dtype), mask=out_mask)


@functools.partial(
    jax.jit,
    static_argnames=("block_size", "mode", "blocks_per_program", "num_warps",
                     "num_stages", "interpret"),
)
def block_summary_kernel(k, lengths, *, block_size, mode="minmax", blocks_per_program=None,
                         num_warps=4, num_stages=2, interpret=False):
    """Pallas kernel for ``block_minmax`` (mode "minmax") / ``block_cuboid`` ("cuboid").

    Grid ``(B, Hkv, ceil(NB / blocks_per_program))``; each program reads
    ``blocks_per_program * block_size`` tokens x ``D`` once and writes
    ``blocks_per_program`` rows of each output. Requires ``block_size``, ``D``
    and ``blocks_per_program`` to be powers of two. ``blocks_per_program``
    defaults to ~128 tokens per program (a 32 KiB bf16 tile at D=128).
    """
    b, hkv, s, d = k.shape
    nb = _num_blocks(s, block_size)
    if blocks_per_program is None:
        blocks_per_program = max(1, 128 // block_size)
    nbt = blocks_per_program
    if not (is_pow2(block_size) and is_pow2(d) and is_pow2(nbt)):
        raise ValueError("block_summary_kernel needs power-of-two block_size, D and blocks_per_program")
    body = functools.partial(
        _block_summary_body, seq_len=s, block_size=block_size, blocks_per_program=nbt,
        num_blocks=nb, mode=mode)
    out = jax.ShapeDtypeStruct((b, hkv, nb, d), k.dtype)
    return pl.pallas_call(
        body,
        grid=(b, hkv, pl.cdiv(nb, nbt)),
        in_specs=[
            pl.BlockSpec((None,), lambda i, j, t: (i,)),
            pl.BlockSpec((None, None, s, d), lambda i, j, t: (i, j, 0, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, nb, d), lambda i, j, t: (i, j, 0, 0)),
            pl.BlockSpec((None, None, nb, d), lambda i, j, t: (i, j, 0, 0)),
        ],
        out_shape=[out, out],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"block_{mode}",
    )(lengths.astype(jnp.int32), k)


# ----------------------------------------------------------------------------
# Kernel: Quest scores (GEMV over the block metadata)
# ----------------------------------------------------------------------------


def _quest_body(q_ref, kmax_ref, kmin_ref, o_ref, *, group, group_pad, block_n, num_blocks, reduce="sum"):
    # q_ref: [G, D]; kmax_ref/kmin_ref: [NB, D]; o_ref: [NB].
    t = pl.program_id(2)
    rows = t * block_n + jnp.arange(block_n, dtype=jnp.int32)
    rmask = rows < num_blocks
    kmax = plgpu.load(kmax_ref.at[pl.ds(t * block_n, block_n), :], mask=rmask[:, None], other=0.0)
    kmin = plgpu.load(kmin_ref.at[pl.ds(t * block_n, block_n), :], mask=rmask[:, None], other=0.0)
    kmax, kmin = kmax.astype(jnp.float32), kmin.astype(jnp.float32)

    def bound(qpos, qneg):
        # A 1-row GEMV: tensor cores would idle on M=1, so this is an FMA + row
        # reduction; the op is bound by reading kmax/kmin anyway.
        return jnp.sum(kmax * qpos[None, :] + kmin * qneg[None, :], axis=1)

    if reduce == "max":
        # each query head's bound over the same tiles, then the largest (the tiles are read
        # once; the FMAs are G times the sum's, still under the bytes' time)
        s = None
        for g in range(group):  # the real heads only: a zero pad row's bound (0) must not win
            qg = q_ref[g, :].astype(jnp.float32)  # [D]
            sg = bound(jnp.maximum(qg, 0.0), jnp.minimum(qg, 0.0))
            s = sg if s is None else jnp.maximum(s, sg)
    else:
        if group_pad == group:
            q = q_ref[...].astype(jnp.float32)
        else:  # G = 3 (SmolLM2) etc.: pad the group to a power of two with zero rows.
            gmask = (jnp.arange(group_pad) < group)[:, None]
            q = plgpu.load(q_ref.at[pl.ds(0, group_pad), :], mask=gmask, other=0.0)
            q = q.astype(jnp.float32)
        # Linear in q: fold the group into one q+ and one q- row (f32).
        s = bound(jnp.sum(jnp.maximum(q, 0.0), axis=0), jnp.sum(jnp.minimum(q, 0.0), axis=0))
    plgpu.store(o_ref.at[pl.ds(t * block_n, block_n)], s, mask=rmask)


@functools.partial(
    jax.jit, static_argnames=("block_n", "num_warps", "num_stages", "interpret", "reduce"))
def quest_block_scores_kernel(q, k_max, k_min, *, block_n=128, num_warps=4, num_stages=2,
                              interpret=False, reduce="sum"):
    """Pallas kernel for ``quest_block_scores``.

    Grid ``(B, Hkv, ceil(NB / block_n))``: each program reads its G query rows
    (tiny, L2-resident across programs) and ``block_n`` rows of kmax and kmin.
    ``block_n`` and ``D`` must be powers of two. ``reduce``: "sum" of the group's
    bounds (one folded q+/q- pair) or their "max" (per head, in registers).
    """
    if reduce not in ("sum", "max"):
        raise ValueError(f"reduce must be 'sum' or 'max', got {reduce!r}")
    b, hq, d = q.shape
    _, hkv, nb, _ = k_max.shape
    g = hq // hkv
    if not (is_pow2(block_n) and is_pow2(d)):
        raise ValueError("quest_block_scores_kernel needs power-of-two block_n and D")
    q4 = q.reshape(b, hkv, g, d)  # free: head i -> (i // G, i % G)
    body = functools.partial(_quest_body, group=g, group_pad=pl.next_power_of_2(g),
                             block_n=block_n, num_blocks=nb, reduce=reduce)
    meta_spec = pl.BlockSpec((None, None, nb, d), lambda i, j, t: (i, j, 0, 0))
    return pl.pallas_call(
        body,
        grid=(b, hkv, pl.cdiv(nb, block_n)),
        in_specs=[
            pl.BlockSpec((None, None, g, d), lambda i, j, t: (i, j, 0, 0)),
            meta_spec,
            meta_spec,
        ],
        out_specs=pl.BlockSpec((None, None, nb), lambda i, j, t: (i, j, 0)),
        out_shape=jax.ShapeDtypeStruct((b, hkv, nb), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="quest_block_scores",
    )(q4, k_max, k_min)
