"""A/B in one process (session 46): the AsyncTLS method step (128K, K=2048, B=1 and B=8) with the
token top-k as before the fix (block_label_topk passed radix_bits=1, so topk_indices never read the
tuned table: the radix search, default warps) against after it (the table's knobs: the bracketing
search at 8x8192:2048, radix with 8 warps at 64x8192:2048). ABAB rounds of CUPTI medians; outputs
compared."""
import functools, json, statistics
import jax, jax.numpy as jnp
from benchmarks import kernels as kb
from benchmarks.timing import time_fn, cold_sets, stamp
from sparse_jax.methods import double_sparsity as ds

print(json.dumps(stamp()), flush=True)
orig = ds.block_label_topk
K, S = 2048, 131072
rows = []
for b in (1, 8):
    q, k, v = kb.make_inputs(jax.random.key(7 + b), b, S)
    lengths = jnp.full((b,), S - 37, jnp.int32)
    channels = jnp.tile((jnp.arange(kb.CHANNELS, dtype=jnp.int32) * 3 % kb.D)[None], (kb.HKV, 1))
    fns, outs = {}, {}
    for name, fn_label in (("before", functools.partial(orig, radix_bits=1)), ("after", orig)):
        ds.block_label_topk = fn_label
        fn, state = kb.asynctls_method_step(K, k, lengths, channels)
        outs[name] = fn(q, k, v, lengths, state)  # traced with this selection
        fns[name] = fn
    ds.block_label_topk = orig
    diff = float(jnp.max(jnp.abs(outs["before"].astype(jnp.float32) - outs["after"].astype(jnp.float32))))
    sets = cold_sets((q, k, v, lengths, state), 2 * b * kb.HKV * K * kb.D * 2 * 4)
    t = {n: [] for n in fns}
    for r in range(4):
        for n in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
            t[n].append(time_fn(fns[n], sets, runs=20, rotate=True).best_ms * 1e3)
    med = {n: statistics.median(x) for n, x in t.items()}
    print(f"B={b} method step 128K K={K}: before {med['before']:.2f} us {['%.2f' % x for x in t['before']]}, "
          f"after {med['after']:.2f} us {['%.2f' % x for x in t['after']]}, max |diff| {diff:.2e}", flush=True)
    rows.append((b, med["before"], med["after"], diff))
print("| B | method step, token top-k off the table (before) | on the table (after) | change | max |out diff| |")
print("| --- | --- | --- | --- | --- |")
for b, o, n, d in rows:
    print(f"| {b} | {o:.2f} us | {n:.2f} us | {n - o:+.2f} us | {d:.2e} |")
