"""A/B in one process (session 46): the top-k's bracketing search (search="bracket") against the
radix search, the tuned table's knobs otherwise. (1) topk_indices alone on label-like scores (sums of
4 softmaxes over 8,192 candidates) and on normal scores, the four classes the AsyncTLS step uses;
(2) the AsyncTLS method step, 128K, K=2048, B=1 and B=8, with every top-k entry of the table switched
to the bracketing search (the table patched in memory). ABAB rounds of CUPTI medians; selections and
outputs compared."""
import copy, functools, json, statistics
import jax, jax.numpy as jnp, numpy as np
from benchmarks import kernels as kb
from benchmarks.timing import time_fn, cold_sets, stamp
from pallas_kernels import tuning as tn
from sparse_jax.ops.selection import topk_indices

print(json.dumps(stamp()), flush=True)
base = copy.deepcopy(tn._table())
def table_with(search):
    t = copy.deepcopy(base)
    for key, e in t.items():
        if key.startswith("topk|") and search == "bracket":
            e["config"] = {"num_warps": e["config"].get("num_warps"), "search": "bracket", "early_exit": True}
            if e["config"]["num_warps"] is None:
                del e["config"]["num_warps"]
    return t
def use(search):
    tn._table.cache_clear()
    t = table_with(search)
    tn._table = functools.cache(lambda: t)

def rounds(fns, sets, n=4):
    t = {name: [] for name in fns}
    for r in range(n):
        for name in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
            t[name].append(time_fn(fns[name], sets, runs=20, rotate=True).best_ms * 1e3)
    return {name: statistics.median(v) for name, v in t.items()}

out = []
# (1) the top-k alone
def softmax_sums(key, rows, n):
    lg = jax.random.normal(key, (rows, 4, n)) * 2.0
    return jax.nn.softmax(lg, axis=-1).sum(1)
for rows_, n, k in ((8, 2048, 127), (64, 2048, 127), (8, 8192, 2048), (64, 8192, 2048)):
    for dist in ("softmax-sums", "normal"):
        x = (softmax_sums if dist == "softmax-sums" else lambda kk, r, nn: jax.random.normal(kk, (r, nn)))(jax.random.key(n + k), rows_, n)
        cur = tn.tuned("topk", rows=rows_, n=n, k=k)
        variants = {"radix (table)": dict(cur)}
        for nw in sorted({cur.get("num_warps"), 4, 8, 16} - {None}):
            variants[f"bracket w{nw}"] = {"num_warps": nw, "search": "bracket"}
        fns = {name: jax.jit(functools.partial(topk_indices, k=k, impl="pallas", **c)) for name, c in variants.items()}
        ref = np.sort(np.asarray(fns["radix (table)"](x)), -1)
        same = all(np.array_equal(np.sort(np.asarray(f(x)), -1), ref) for f in fns.values())
        med = rounds(fns, cold_sets((x,), x.size * 4))
        line = f"topk {rows_}x{n} k={k} {dist}: " + ", ".join(f"{nm} {v:.2f} us" for nm, v in med.items()) + f"  same sets: {same}"
        print(line, flush=True)
        out.append(("topk", f"{rows_}x{n} k={k}", dist, med, same))
# (2) the method step
K, S = 2048, 131072
for b in (1, 8):
    q, k, v = kb.make_inputs(jax.random.key(7 + b), b, S)
    lengths = jnp.full((b,), S - 37, jnp.int32)
    channels = jnp.tile((jnp.arange(kb.CHANNELS, dtype=jnp.int32) * 3 % kb.D)[None], (kb.HKV, 1))
    fns, outs = {}, {}
    for search in ("radix", "bracket"):
        use(search)
        fn, state = kb.asynctls_method_step(K, k, lengths, channels)
        outs[search] = fn(q, k, v, lengths, state)  # traced with this table
        fns[search] = fn
    diff = float(jnp.max(jnp.abs(outs["radix"].astype(jnp.float32) - outs["bracket"].astype(jnp.float32))))
    med = rounds(fns, cold_sets((q, k, v, lengths, state), 2 * b * kb.HKV * K * kb.D * 2 * 4))
    print(f"B={b} method step 128K K={K}: radix {med['radix']:.2f} us, bracket {med['bracket']:.2f} us, "
          f"max |diff| {diff:.2e}", flush=True)
    out.append(("step", f"B={b}", "", med, diff))
print("| what | shape | scores | radix (table) | best bracket | change |")
print("| --- | --- | --- | --- | --- | --- |")
for what, shape, dist, med, chk in out:
    r = med.get("radix (table)", med.get("radix"))
    bn, bv = min(((n, v) for n, v in med.items() if n.startswith("bracket")), key=lambda t: t[1])
    print(f"| {what} | {shape} | {dist} | {r:.2f} us | {bv:.2f} us ({bn}) | {bv - r:+.2f} us |")
