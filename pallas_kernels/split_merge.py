"""The merge of flash-decoding splits as one Pallas kernel.

The decode kernels write per-split partials ``o [B, Hkv, NS, G, D]`` (unnormalised),
``m, l [B, Hkv, NS, G]`` (f32; see ``pallas_kernels.merge``). ``combine_splits`` merges
them in jnp, which XLA compiles to one fusion at B=8 and two at B=1 (a reduce, then the
combine with the cast): a visible share of the AsyncTLS step at B=1, 128K on the H200
(docs/kernels.md, 'Measured reasons for kernel choices'). This kernel does it in one
launch: program ``(b, h)`` loads its ``NS x G x D`` partials, takes the max over the
splits, weights and sums, and writes the output in the caller's dtype and the residuals.

Same maths as ``combine_splits`` (the reference), with its conventions: an empty split
has ``m = MASK_VALUE``, ``l = 0``, ``o = 0``; a row with no token anywhere comes out 0.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._util import next_pow2
from pallas_kernels.merge import MASK_VALUE, combine_splits

#: how ``finish_splits`` merges: "xla" (``combine_splits`` in jnp) or "pallas" (this kernel)
MERGES = ("xla", "pallas")


def merge_splits_reference(o, m, l, out_dtype):
    """``(out [B, Hkv, G, D] out_dtype, m_all, l_all [B, Hkv, G] f32)`` of partials
    ``o [B, Hkv, NS, G, D]``, ``m, l [B, Hkv, NS, G]``."""
    out, m_all, l_all = combine_splits(o, m, l, axis=2)
    return out.astype(out_dtype), m_all, l_all


def _merge_body(o_ref, m_ref, l_ref, out_ref, mo_ref, lo_ref, *, ns: int, g: int, d: int):
    # o_ref: [NS, G, D] f32; m_ref, l_ref: [NS, G]; out_ref: [G, D]; mo_ref, lo_ref: [G].
    nsp, gp, dp = next_pow2(ns), next_pow2(g), next_pow2(d)
    s_ok = jnp.arange(nsp, dtype=jnp.int32) < ns
    g_ok = jnp.arange(gp, dtype=jnp.int32) < g
    d_ok = jnp.arange(dp, dtype=jnp.int32) < d
    # loads through clamped indices (every address valid), masked; stores through an
    # out-of-bounds index where masked (what the interpreter's scatter drops)
    si = jnp.minimum(jnp.arange(nsp, dtype=jnp.int32), ns - 1)
    gi = jnp.minimum(jnp.arange(gp, dtype=jnp.int32), g - 1)
    di = jnp.minimum(jnp.arange(dp, dtype=jnp.int32), d - 1)
    sg_ok = s_ok[:, None] & g_ok[None, :]
    m = plgpu.load(m_ref.at[si[:, None], gi[None, :]], mask=sg_ok, other=MASK_VALUE)  # [NSP, GP]
    l = plgpu.load(l_ref.at[si[:, None], gi[None, :]], mask=sg_ok, other=0.0)
    o = plgpu.load(o_ref.at[si[:, None, None], gi[None, :, None], di[None, None, :]],
                   mask=sg_ok[:, :, None] & d_ok[None, None, :], other=0.0)  # [NSP, GP, DP]
    m_all = jnp.max(m, axis=0)  # [GP]
    w = jnp.exp(m - m_all[None, :])  # <= 1; padded and empty splits weigh ~0 (or l = 0)
    l_all = jnp.sum(w * l, axis=0)
    o_all = jnp.sum(w[:, :, None] * o, axis=0)  # [GP, DP]
    out = o_all / jnp.where(l_all > 0, l_all, 1.0)[:, None]
    go = jnp.where(g_ok, jnp.arange(gp, dtype=jnp.int32), g)
    do = jnp.where(d_ok, jnp.arange(dp, dtype=jnp.int32), d)
    plgpu.store(out_ref.at[go[:, None], do[None, :]], out.astype(out_ref.dtype),
                mask=g_ok[:, None] & d_ok[None, :])
    plgpu.store(mo_ref.at[go], m_all, mask=g_ok)
    plgpu.store(lo_ref.at[go], l_all, mask=g_ok)


@functools.partial(jax.jit, static_argnames=("out_dtype", "num_warps", "interpret"))
def merge_splits_pallas(o, m, l, out_dtype, *, num_warps: int = 4, interpret: bool = False):
    """The kernel form of :func:`merge_splits_reference` (same signature and outputs)."""
    check_partials(o, m, l)
    b, hkv, ns, g, d = o.shape
    out_dtype = jnp.dtype(out_dtype)
    grid_spec = dict(
        grid=(b, hkv),
        in_specs=[pl.BlockSpec((None, None, ns, g, d), lambda i, j: (i, j, 0, 0, 0)),
                  pl.BlockSpec((None, None, ns, g), lambda i, j: (i, j, 0, 0)),
                  pl.BlockSpec((None, None, ns, g), lambda i, j: (i, j, 0, 0))],
        out_specs=[pl.BlockSpec((None, None, g, d), lambda i, j: (i, j, 0, 0)),
                   pl.BlockSpec((None, None, g), lambda i, j: (i, j, 0)),
                   pl.BlockSpec((None, None, g), lambda i, j: (i, j, 0))],
    )
    return pl.pallas_call(
        functools.partial(_merge_body, ns=ns, g=g, d=d),
        out_shape=[jax.ShapeDtypeStruct((b, hkv, g, d), out_dtype),
                   jax.ShapeDtypeStruct((b, hkv, g), jnp.float32),
                   jax.ShapeDtypeStruct((b, hkv, g), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=int(num_warps), num_stages=1),
        interpret=interpret, name=f"split_merge_ns{ns}", **grid_spec,
    )(o.astype(jnp.float32), m.astype(jnp.float32), l.astype(jnp.float32))


def check_partials(o, m, l) -> None:
    """Shapes of the partials: ``o [B, Hkv, NS, G, D]``, ``m, l`` = ``o.shape[:-1]``, NS >= 1."""
    if o.ndim != 5 or m.shape != o.shape[:-1] or l.shape != o.shape[:-1]:
        raise ValueError(f"partials: expected o [B, Hkv, NS, G, D] and m, l [B, Hkv, NS, G], "
                         f"got {o.shape}, {m.shape}, {l.shape}")
    if min(o.shape) < 1:
        raise ValueError(f"partials: every dimension must be >= 1, got o {o.shape}")
