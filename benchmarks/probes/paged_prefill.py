"""The paged engine's prefill straight into the pool against the one-row cache it replaced (GPU).

``python -m benchmarks.probes.paged_prefill`` builds the Qwen3-8B shape with random bf16
weights and answers two questions for issue 49:

- **Memory.** A paged engine of ``--slots`` x ``--max-len`` used to keep a one-row contiguous
  cache of ``max_len`` beside its pool for every prompt's prefill. The default pool (as many
  pages as fit) with and without that row, from :func:`models.serving.paged.paged_footprint`
  and the device's budget (nothing compiled: the prefill's temporaries are left out of both).
- **Time and numerics.** Per prompt length (``--prompts``), on one engine whose pool leaves
  room for the old path's row: ``new_ms``, the prefill into the request's pages and slot
  (:meth:`PagedSlots.prefill` with the slot, one program); ``old_ms``, the one-row prefill
  then its scatter into the pages (:meth:`PagedSlots.prefill` without the slot, then
  :meth:`PagedSlots.insert`), each waited for, the median of ``--rounds`` after a warm-up.
  Both must give the same first-token logits (``max_logit_diff``) and the same K/V in the
  request's pages (``max_kv_diff``, every paged layer).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import markdown_table, parse_list, stamp, write_results

GiB = 2 ** 30


def _pages_of(kv, table: np.ndarray, tokens: int) -> list[np.ndarray]:
    """Every paged layer's K and V of a request's first ``tokens`` positions, from the pool."""
    from sparse_jax.cache import PagedLayer

    w = -(-tokens // kv.page)
    out = []
    for e in kv.cache.layers:
        if isinstance(e, PagedLayer):
            for pool in (e.pool_k, e.pool_v):
                _, hkv, n, d = pool.shape
                pages = pool.reshape(hkv, n // kv.page, kv.page, d)[:, jnp.asarray(table[:w])]
                out.append(np.asarray(pages.reshape(hkv, w * kv.page, d)[:, :tokens].astype(jnp.float32)))
    return out


def main(argv=None) -> int:
    from benchmarks.offload import qwen3_8b, random_model
    from models.serving.engine import Engine
    from models.serving.paged import PrefilledRow, paged_footprint
    from models.serving.requests import SamplingParams
    from sparse_jax.methods import get_method
    from sparse_jax.offload import capacity

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--max-len", type=int, default=131072)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--prompts", type=parse_list, default=[16384, 65536], help="prompt lengths (comma-separated)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--method", default="dense")
    p.add_argument("--tiny", action="store_true", help="a small random model (a CPU check of this probe)")
    p.add_argument("--out", default=None)
    p.add_argument("--name", default="paged_prefill")
    a = p.parse_args(argv)

    cfg = dataclasses.replace(qwen3_8b(a.max_len), num_layers=a.layers)
    if a.tiny:
        # the vocabulary kept: prompts are padded with Qwen3's pad id
        cfg = dataclasses.replace(cfg, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=128)
    method = get_method(a.method)
    model = random_model(cfg, method, a.max_len)

    # memory: the default pool with and without the one-row cache (temporaries left out of both)
    from models.serving.paged import page_size

    page = page_size(method)
    limit = capacity.device_budget()
    with_row = paged_footprint(model, a.slots, a.max_len, page, prefill_row=True)
    without = paged_footprint(model, a.slots, a.max_len, page, prefill_row=False)
    memory = {"max_len": a.max_len, "slots": a.slots, "page": page, "device_budget_gib": None if limit is None
              else round(limit / GiB, 2), "weights_gib": round(with_row.weights / GiB, 2),
              "per_slot_state_gib": round(with_row.per_slot / GiB, 3),
              "one_row_cache_gib": round(with_row.prefill_row / GiB, 2), "page_mib": round(with_row.block_bytes / 2**20, 3)}
    if limit is not None:
        memory["pages_before"] = int((limit - with_row.fixed()) // with_row.block_bytes)
        memory["pages_after"] = int((limit - without.fixed()) // without.block_bytes)
        memory["tokens_gained"] = (memory["pages_after"] - memory["pages_before"]) * page
    print(memory, flush=True)

    # time and numerics: a pool of two requests of max_len (the old path's row must fit beside it)
    engine = Engine(model, slots=2, max_len=a.max_len, stop_ids=(), paged=True,
                    kv_blocks=2 * (a.max_len // page) + 1)
    kv = engine.kv
    rng = np.random.default_rng(0)
    rows = []
    for n in a.prompts:
        ids = rng.integers(0, cfg.vocab_size, n).tolist()
        r = engine.make_request(ids, SamplingParams(max_tokens=1, ignore_eos=True))
        assert kv.reserve(r, n + 1)
        table = kv.blocks.table(r.id)
        times = {"new": [], "old": []}
        out = {}
        for rnd in range(a.rounds + 1):  # the first round of each compiles
            for path in ("new", "old"):
                t0 = time.perf_counter()
                if path == "new":
                    logits, row = kv.prefill(ids, 0, r)
                    kv.insert(row, 0, r)
                    assert isinstance(row, PrefilledRow)
                else:
                    logits, row = kv.prefill(ids)
                    kv.insert(row, 0, r)
                jax.block_until_ready((logits, kv.cache))
                if rnd:
                    times[path].append(1e3 * (time.perf_counter() - t0))
                if rnd == a.rounds:  # the last round's outputs, compared below
                    out[path] = (np.asarray(logits, np.float32), _pages_of(kv, table, n))
                del row
        kv.release(r)
        logit_diff = float(np.abs(out["new"][0] - out["old"][0]).max())
        kv_diff = max(float(np.abs(x - y).max()) for x, y in zip(out["new"][1], out["old"][1]))
        rows.append({"prompt": n, "new_ms": round(statistics.median(times["new"]), 2),
                     "old_ms": round(statistics.median(times["old"]), 2),
                     "new_over_old": round(statistics.median(times["new"]) / statistics.median(times["old"]), 3),
                     "max_logit_diff": logit_diff, "max_kv_diff": kv_diff})
        print(rows[-1], flush=True)
        assert logit_diff == 0.0 and kv_diff == 0.0, rows[-1]

    md = (f"# The paged engine's prefill into the pool against the one-row cache\n\n{stamp()}\n\n"
          f"{'a tiny config' if a.tiny else 'Qwen3-8B shape'}, {a.layers} layers, random bf16 weights, method "
          f"{a.method}, page {page}.\n\n## Memory: the default pool of {a.slots} slots x {a.max_len} tokens\n\n"
          + markdown_table([memory], list(memory)) +
          "\n\n`pages_before`: what the pool got beside the one-row cache a prompt was prefilled into; "
          "`pages_after`: without it (the prefill writes the pool). Both leave out the prefill's temporaries, "
          "which the engine measures by compiling its longest prefill.\n\n## Time and numerics, one prompt\n\n"
          + markdown_table(rows, ["prompt", "new_ms", "old_ms", "new_over_old", "max_logit_diff", "max_kv_diff"]) +
          "\n\n`new_ms`: the prefill into the request's pages and slot (one program, waited for); `old_ms`: the "
          "prefill into a one-row cache of max_len and its scatter into the pages. Medians of "
          f"{a.rounds} after a warm-up; both outputs compared bit for bit.\n")
    print(md)
    if a.out:
        write_results(a.name, {"memory": memory, "rows": rows, **stamp()}, md, out_dir=a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
