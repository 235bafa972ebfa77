"""Session 47: the per-kernel latency floor on this GPU (CUPTI kernel time, medians): what a
launch of the smallest kernels costs, against which the B=1 step's 8 kernels are measured."""
import json, statistics
import jax, jax.numpy as jnp, numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from benchmarks.timing import time_fn, stamp

print(json.dumps(stamp()), flush=True)


def one_load(x_ref, o_ref):
    o_ref[0] = x_ref[0] + 1.0


def dep_load(i_ref, x_ref, o_ref):
    # two dependent global loads (an index, then the value it points at), like a gather stage
    i = i_ref[0]
    o_ref[0] = plgpu.load(x_ref.at[i]).astype(jnp.int32) + i


def call(kern, out, grid, *args):
    return pl.pallas_call(kern, out_shape=out, grid=grid, compiler_params=plgpu.CompilerParams(num_warps=4))(*args)


x = jnp.arange(1 << 20, dtype=jnp.float32)
idx = jnp.array([12345], jnp.int32)
f_one = jax.jit(lambda x: call(one_load, jax.ShapeDtypeStruct((1,), jnp.float32), (1,), x))
f_one132 = jax.jit(lambda x: call(one_load, jax.ShapeDtypeStruct((1,), jnp.float32), (132,), x))
f_dep = jax.jit(lambda i, x: call(dep_load, jax.ShapeDtypeStruct((1,), jnp.int32), (1,), i, x))


def chain8(i, x):
    for _ in range(8):
        i = call(dep_load, jax.ShapeDtypeStruct((1,), jnp.int32), (1,), i, x) & 0xFFFF
    return i


f_chain = jax.jit(chain8)
f_xla = jax.jit(lambda x: x[:1] * 2.0 + 1.0)
rows = []
for name, fn, args in (("pallas, 1 program, 1 load + store", f_one, (x,)),
                       ("pallas, 132 programs, 1 load + store", f_one132, (x,)),
                       ("pallas, 1 program, 2 dependent loads + store", f_dep, (idx, x)),
                       ("8 of those chained in one jit (each reads the last's output)", f_chain, (idx, x)),
                       ("XLA fusion on 1 element", f_xla, (x,))):
    t = time_fn(fn, args, runs=50)
    ks = t.kernels or []
    rows.append((name, t.device_ms * 1e3 if t.device_ms else float("nan"), len(ks), t.wall_ms * 1e3))
    print(name, rows[-1], ks[:3], flush=True)
print("| kernel(s) | CUPTI kernel time | kernels | wall per call |")
print("| --- | --- | --- | --- |")
for n, d, c, w in rows:
    print(f"| {n} | {d:.2f} us | {c} | {w:.1f} us |")
