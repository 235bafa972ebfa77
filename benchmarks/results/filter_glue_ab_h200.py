"""A/B in one process (session 45): the AsyncTLS method step with the filter's short-row select and
newest-block concatenate in XLA (the old path, rebuilt here by patching) against the new path (both in
the top-k kernel), B=1 and B=8, 128K, K=2048, ABAB rounds of CUPTI medians; outputs compared. Then at
B=8 the label kernels with the table's knobs against the same plus q_prep="kernel"."""
import functools, json, statistics, sys
import jax, jax.numpy as jnp, numpy as np
from benchmarks import kernels as kb
from benchmarks.timing import time_fn, cold_sets, stamp
from sparse_jax.methods.double_sparsity import AsyncTLS
from sparse_jax.methods.base import Selection
from sparse_jax.ops.selection import topk_indices
from sparse_jax.ops.scoring import quest_block_scores_quantized, block_label_scores, build_label_cache
from pallas_kernels.tuning import tuned

print(json.dumps(stamp()), flush=True)
new_select = AsyncTLS.select

def old_pick(self, q, boxes, newest):
    scores = quest_block_scores_quantized(q, boxes, group_reduce=self.group_reduce, impl=self.impl)
    b, hkv, nb = scores.shape
    n1 = min(self.kb, nb) - 1
    top = topk_indices(scores, n1, newest[:, None], impl=self.impl)
    return jnp.where((newest <= n1)[:, None, None], jnp.arange(n1, dtype=jnp.int32), top).astype(jnp.int32)

def old_select(self, q, kv, lengths, state, carry, layer):
    blocks = old_pick(self, q, state.boxes, (lengths - 1) // self.block_size)
    indices, counts = self.select_tokens(q, state, blocks, lengths, layer.data["channels"], kv.capacity)
    return Selection.tokens(indices, counts), state, carry

import os
K = int(os.environ.get("AB_K", 2048))
S = int(os.environ.get("AB_S", 131072))
rows = []
for b in (1, 8):
    s = S
    q, k, v = kb.make_inputs(jax.random.key(7 + b), b, s)
    lengths = jnp.full((b,), s - 37, jnp.int32)
    channels = jnp.tile((jnp.arange(kb.CHANNELS, dtype=jnp.int32) * 3 % kb.D)[None], (kb.HKV, 1))
    fn_new, state = kb.asynctls_method_step(K, k, lengths, channels)
    AsyncTLS.select = old_select
    fn_old, _ = kb.asynctls_method_step(K, k, lengths, channels)
    out_old = fn_old(q, k, v, lengths, state)  # traced and compiled with the old select
    AsyncTLS.select = new_select
    out_new = fn_new(q, k, v, lengths, state)
    diff = float(jnp.max(jnp.abs(out_old.astype(jnp.float32) - out_new.astype(jnp.float32))))
    print(f"B={b}: max |old - new| = {diff}", flush=True)
    nbytes = 2 * b * kb.HKV * K * kb.D * 2 * 4
    sets = cold_sets((q, k, v, lengths, state), nbytes)
    t = {"old": [], "new": []}
    for rnd in range(4):
        for name, fn in (("old", fn_old), ("new", fn_new)) if rnd % 2 == 0 else (("new", fn_new), ("old", fn_old)):
            t[name].append(time_fn(fn, sets, runs=20, rotate=True).best_ms * 1e3)
    print(f"B={b} method step K={K}: old {statistics.median(t['old']):.2f} us {['%.2f' % x for x in t['old']]}, "
          f"new {statistics.median(t['new']):.2f} us {['%.2f' % x for x in t['new']]}", flush=True)
    rows.append((b, statistics.median(t["old"]), statistics.median(t["new"]), diff))
# B=8 label kernels: the table's knobs against the same plus the in-kernel query gather
b, s = 8, S
q, k, v = kb.make_inputs(jax.random.key(3), b, s)
lengths = jnp.full((b,), s, jnp.int32)
channels = jnp.tile((jnp.arange(kb.CHANNELS, dtype=jnp.int32) * 3 % kb.D)[None], (kb.HKV, 1))
labels = build_label_cache(k, channels)
blocks = jax.random.randint(jax.random.key(4), (b, kb.HKV, 128), 0, s // 64, jnp.int32)
bcount = jnp.full((b, kb.HKV), 128, jnp.int32)
knobs = tuned("block_label_scores", rows=b * kb.HKV, c=128 * 64, w=kb.CHANNELS // 2, g=kb.HQ // kb.HKV, block=64) or {}
print("B=8 block_label_scores table knobs:", knobs, flush=True)
variants = {"table": dict(knobs), "table+q_prep": {**knobs, "hoist_q": True, "q_prep": "kernel"},
            "table+prefetch1": {**knobs, "prefetch": 1}, "table+prefetch3": {**knobs, "prefetch": 3},
            "table+q_prep+prefetch3": {**knobs, "hoist_q": True, "q_prep": "kernel", "prefetch": 3}}
fns = {n: jax.jit(functools.partial(block_label_scores, block_size=64, impl="pallas", **c)) for n, c in variants.items()}
outs = {n: f(q, labels, channels, blocks, bcount, lengths) for n, f in fns.items()}
print("label max diff:", max(float(jnp.max(jnp.abs(outs["table"] - o))) for o in outs.values()), flush=True)
sets = cold_sets((q, labels, channels, blocks, bcount, lengths), b * kb.HKV * 8192 * 24)
t = {n: [] for n in fns}
for rnd in range(4):
    for n in (list(fns) if rnd % 2 == 0 else list(fns)[::-1]):
        t[n].append(time_fn(fns[n], sets, runs=20, rotate=True).best_ms * 1e3)
for n in fns:
    print(f"B=8 block_label_scores [{n}]: {statistics.median(t[n]):.2f} us {['%.2f' % x for x in t[n]]}", flush=True)
print("| B | method step, old (XLA select + concat) | new (in the top-k) | diff | max |out diff| |")
print("| --- | --- | --- | --- | --- |")
for b, o, n, d in rows:
    print(f"| {b} | {o:.2f} us | {n:.2f} us | {n - o:+.2f} us | {d} |")
