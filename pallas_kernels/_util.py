"""Small helpers every kernel module shares."""

from __future__ import annotations

import math

LOG2E = math.log2(math.e)  # exp(x) == exp2(x * LOG2E)


def next_pow2(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``): Triton tiles and
    ``tl.arange`` extents must be powers of two."""
    return 1 << max(0, (int(n) - 1).bit_length())


def prev_pow2(n: int) -> int:
    """The largest power of two ``<= max(n, 1)``."""
    return 1 << (max(1, int(n)).bit_length() - 1)


def exp2_fast(x, *, interpret: bool):
    """``2 ** x`` elementwise inside a Pallas-Triton kernel (f32).

    ``jnp.exp`` / ``jnp.exp2`` lower to libdevice's accurate ``__nv_expf`` /
    ``__nv_exp2f`` (range reduction and polynomial on the FP32 pipe); a
    compute-bound kernel wants the MUFU instruction ``ex2.approx.ftz.f32`` (max
    relative error 2^-22, what Triton's own ``tl.exp2`` emits), here through
    inline PTX. ``interpret`` (the CPU path, no PTX) uses ``jnp.exp2``.
    """
    import jax
    import jax.numpy as jnp

    if interpret:
        return jnp.exp2(x)
    from jax.experimental.pallas import triton as plgpu

    [y] = plgpu.elementwise_inline_asm("ex2.approx.ftz.f32 $0, $1;", args=[x], constraints="=f,f", pack=1,
                                       result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, x.dtype)])
    return y


def exp_fast(x, *, interpret: bool):
    """``e ** x`` elementwise inside a Pallas-Triton kernel (f32): on the GPU the MUFU
    ``ex2.approx`` of ``x * log2 e`` (:func:`exp2_fast`); in interpret mode (the CPU
    path) ``jnp.exp`` itself, so CPU results stay bit for bit those of ``jnp.exp``."""
    import jax.numpy as jnp

    return jnp.exp(x) if interpret else exp2_fast(x * LOG2E, interpret=False)


def fma_f32(a, b, c, *, interpret: bool):
    """``a * b + c`` elementwise inside a Pallas-Triton kernel (f32), as one FFMA on the GPU.

    Pallas-Triton lowers ``a * b + c`` to a multiply and an add that the compiler
    does not contract: the label kernel's SASS on the H200 had far more FMUL and FADD than
    FFMA (docs/kernels.md, 'Nsight Compute on the step'). ``fma.rn.f32`` through inline PTX
    makes each pair one instruction. Arguments broadcast to one shape first (the
    inline-asm primitive wants equal shapes; a broadcast costs no instruction).
    ``interpret`` (the CPU path, no PTX) keeps ``a * b + c``.
    """
    import jax
    import jax.numpy as jnp

    if interpret:
        return a * b + c
    from jax.experimental.pallas import triton as plgpu

    shape = jnp.broadcast_shapes(jnp.shape(a), jnp.shape(b), jnp.shape(c))
    a, b, c = (jnp.broadcast_to(jnp.asarray(x, jnp.float32), shape) for x in (a, b, c))
    [y] = plgpu.elementwise_inline_asm("fma.rn.f32 $0, $1, $2, $3;", args=[a, b, c], constraints="=f,f,f,f",
                                       pack=1, result_shape_dtypes=[jax.ShapeDtypeStruct(shape, jnp.float32)])
    return y
