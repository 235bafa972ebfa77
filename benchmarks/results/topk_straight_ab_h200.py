"""A/B in one process (session 47): the AsyncTLS method step (128K, K=2048, B=1 and B=8) with
  old:   the top-k kernel of 104ba02 and that commit's tuned table;
  kern:  this session's top-k kernel (count_above's count packed with the search's valid count,
         the short-row fill behind a branch, the token map by shift and mask), the old table;
  both:  the new kernel and the new table (64x8192 k=2048: the bracketing search, 8 warps, swept
         on label-like scores; the B=8 class).
Each variant is traced and compiled with its module and table in place (jax.clear_caches()
between), then the compiled executables are timed in ABAB... rounds of CUPTI medians; outputs
compared to the bit. Run from the repository root as ``tmp_gpu/topk_straight_ab.py`` (commit 2686f99),
beside ``tmp_gpu/topk_old.py`` = ``git show 104ba02:pallas_kernels/topk.py`` and
``tmp_gpu/tuned_old.json`` = ``git show 104ba02:pallas_kernels/tuned_configs.json``; log:
``topk_straight_ab_h200.log``."""
import importlib.util, json, statistics, sys
import jax, jax.numpy as jnp
from benchmarks import kernels as kb
from benchmarks.timing import time_fn, cold_sets, stamp
from pallas_kernels import tuning
from pallas_kernels import topk as topk_new
from sparse_jax.ops import selection

print(json.dumps(stamp()), flush=True)
spec = importlib.util.spec_from_file_location("topk_old", "tmp_gpu/topk_old.py")
topk_old = importlib.util.module_from_spec(spec); sys.modules["topk_old"] = topk_old; spec.loader.exec_module(topk_old)
new_table = tuning._table()
old_table = json.load(open("tmp_gpu/tuned_old.json"))["configs"]
print("table keys", len(new_table), "old", len(old_table), [(kk, old_table.get(kk), new_table.get(kk)) for kk in
      new_table if old_table.get(kk) != new_table.get(kk)], flush=True)
orig_table = tuning._table


class Exe:
    lower = None  # time_fn jits what has no .lower

    def __init__(self, c):
        self.c = c

    def __call__(self, *a):
        return self.c(*a)


VARIANTS = {"old": (topk_old, old_table), "kern": (topk_new, old_table), "both": (topk_new, new_table)}
K, S = 2048, 131072
rows = []
for b in (1, 8):
    q, k, v = kb.make_inputs(jax.random.key(7 + b), b, S)
    lengths = jnp.full((b,), S - 37, jnp.int32)
    channels = jnp.tile((jnp.arange(kb.CHANNELS, dtype=jnp.int32) * 3 % kb.D)[None], (kb.HKV, 1))
    names = ["old", "kern"] + (["both"] if b == 8 else [])
    fns, outs = {}, {}
    for name in names:
        mod, table = VARIANTS[name]
        selection._topk = mod
        tuning._table = lambda t=table: t
        jax.clear_caches()
        fn, state = kb.asynctls_method_step(K, k, lengths, channels)
        args = (q, k, v, lengths, state)
        fns[name] = Exe(fn.lower(*args).compile())
        outs[name] = fns[name](*args)
    selection._topk, tuning._table = topk_new, orig_table
    diff = {n: float(jnp.max(jnp.abs(outs[n].astype(jnp.float32) - outs["old"].astype(jnp.float32)))) for n in names}
    sets = cold_sets((q, k, v, lengths, state), 2 * b * kb.HKV * K * kb.D * 2 * 4)
    if len(sets) == 1:
        # CUPTI's one-call timer (rotated sets) times a compiled executable; profiler.measure,
        # used for one set, does not. The set is > 2 GB here: a repeat finds little in the L2,
        # as measure's repeats of one set do in benchmarks.kernels.
        sets = sets * 2
    t = {n: [] for n in names}
    for r in range(6):
        for n in (names if r % 2 == 0 else names[::-1]):
            t[n].append(time_fn(fns[n], sets, runs=20, rotate=True).best_ms * 1e3)
    med = {n: statistics.median(x) for n, x in t.items()}
    for n in names:
        print(f"B={b} {n}: {med[n]:.2f} us {['%.2f' % x for x in t[n]]} max|diff vs old| {diff[n]:.2e}", flush=True)
    rows.append((b, med, diff))
print("| B | old kernel, old table | new kernel | new kernel + new table | max abs out diff |")
print("| --- | --- | --- | --- | --- |")
for b, med, diff in rows:
    both = f"{med['both']:.2f} us ({med['both'] - med['old']:+.2f})" if "both" in med else "(same class as new kernel)"
    print(f"| {b} | {med['old']:.2f} us | {med['kern']:.2f} us ({med['kern'] - med['old']:+.2f}) | {both} | "
          f"{max(diff.values()):.2e} |")
