"""Where a two-level selector loses a retrieval needle: per layer, per decode step.

``python -m benchmarks.needle_probe --model gemma3-270m --task niah_single_2 --length 16384
--indices 0,1,2`` builds the accuracy harness's prompts (base-model form), prefills each
densely, and feeds dense's greedy answer back for ``--steps`` decode steps (teacher forcing:
every method sees the same queries). On each sparse layer and step it records, against the
needle (the prompt tokens of the expected answer, found by the tokenizer's character offsets):

* ``mass``: dense attention's probability on the needle tokens (summed, mean over the query
  heads): does this layer read the needle at all;
* ``block_rank``: for AsyncTLS-like methods (a Quest-bound block filter, then tokens), the best
  rank of a needle block among the blocks the filter ranks (0 = first; the filter keeps ranks
  below ``kb - 1``; the newest block is always kept), the worst over KV heads;
* ``block_rank_max_heads``: the same rank with the query group reduced by max
  (``group_reduce="max"``: does one head want the needle's block);
* ``in_selection``: the fraction of needle tokens in the method's final selection (its
  ``select``), the worst over KV heads;
* ``block_rank_q`` and ``filter_overlap_q`` (``--box-bits``, default 8; 0 leaves them out):
  what 8-bit block boxes would change. Each box channel is stored as a code over the
  (batch, KV head, channel) range of all blocks, the maximum rounded up and the minimum down,
  so the Quest bound stays a bound and the boxes take half the bytes of bf16 (the block bound
  is the largest stage of the AsyncTLS step at B=8: docs/kernels.md, v7, 'Where the step's time
  goes'). The needle's
  rank under that bound, and the fraction of the filter's ``kb - 1`` blocks it keeps (worst KV
  head).

Only decode is probed (prefill is dense, as in the harness). The first answer token comes from
the prefill, so step 0 here is the query of the first generated token producing the second.
Rows: prompt, step, layer. A summary gives, per layer, the steps where the needle's blocks
fell outside the filter while dense attention put mass on the needle.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from jax import lax

from benchmarks.fidelity import FidelityProbe, dense_probabilities
from benchmarks.timing import markdown_table, parse_list, stamp, write_results


@dataclasses.dataclass(frozen=True)
class NeedleProbe(FidelityProbe):
    """:class:`~benchmarks.fidelity.FidelityProbe` (dense output, the inner method's state kept
    current) that also records, at each decode step of each layer the inner method runs on,
    where the needle stands (see the module docstring). ``needle``: prompt positions (static:
    one prompt per compiled probe; row 0 of the batch is the one measured)."""

    needle: tuple[int, ...] = ()
    box_bits: int = 8

    def init_state(self, spec, *, batch, num_kv_heads, max_len, head_dim, dtype, num_q_heads=None):
        st = super().init_state(spec, batch=batch, num_kv_heads=num_kv_heads, max_len=max_len, head_dim=head_dim,
                                dtype=dtype, num_q_heads=num_q_heads)
        return {**st, "needle_mass": jnp.zeros((batch,), jnp.float32),
                "block_rank": jnp.full((batch,), -1, jnp.int32),
                "block_rank_max_heads": jnp.full((batch,), -1, jnp.int32),
                "in_selection": jnp.zeros((batch,), jnp.float32),
                "block_rank_q": jnp.full((batch,), -1, jnp.int32),
                "filter_overlap_q": jnp.ones((batch,), jnp.float32)}

    def decode(self, q, kv, lengths, state, carry, layer):
        dense, new, new_carry = super().decode(q, kv, lengths, state, carry, layer)
        inner, st = self.inner, state["inner"]
        pos = jnp.asarray(self.needle, jnp.int32)
        probs = dense_probabilities(q, kv.k, lengths)  # [B, Hkv, G, S]
        mass = probs[..., pos].sum(-1).mean((1, 2))
        rank = rank_max = rank_q = jnp.full(lengths.shape, -1, jnp.int32)
        overlap_q = jnp.ones(lengths.shape, jnp.float32)
        if hasattr(inner, "pick_blocks") and hasattr(st, "boxes"):
            from sparse_jax.ops.scoring import quest_block_scores

            bs = inner.block_size
            newest = (lengths - 1) // bs
            needle_blocks = jnp.asarray(sorted({p // bs for p in self.needle}), jnp.int32)

            def bound(reduce, upper, lower):  # the filter's bound over the blocks before the newest
                scores = quest_block_scores(q, upper, lower, group_reduce=reduce)  # [B, Hkv, NB]
                blk = jnp.arange(scores.shape[-1], dtype=jnp.int32)
                return jnp.where(blk[None, None] >= newest[:, None, None], -jnp.inf, scores)

            reduce = getattr(inner, "group_reduce", "sum")
            exact = bound(reduce, st.boxes.upper, st.boxes.lower)
            rank = _rank(exact, needle_blocks)
            rank_max = _rank(bound("max", st.boxes.upper, st.boxes.lower), needle_blocks)  # one head's want
            if self.box_bits:
                quant = bound(reduce, *quantized_boxes(st.boxes.upper, st.boxes.lower, self.box_bits))
                rank_q = _rank(quant, needle_blocks)
                overlap_q = filter_overlap(exact, quant, getattr(inner, "kb", exact.shape[-1]) - 1)
        sel, _, _ = inner.select(q, kv, lengths, st, carry, layer)
        if sel.kind == "all":
            frac = jnp.ones(lengths.shape, jnp.float32)
        else:
            idx, counts = sel.token_view(lengths)  # [B, Hkv, K], [B, Hkv]
            live = jnp.arange(idx.shape[-1])[None, None] < counts[..., None]
            hit = ((idx[..., None] == pos) & live[..., None]).any(-2)  # [B, Hkv, N]
            frac = hit.mean(-1).min(-1)
        return dense, {**new, "needle_mass": mass, "block_rank": rank, "block_rank_max_heads": rank_max,
                       "in_selection": frac, "block_rank_q": rank_q, "filter_overlap_q": overlap_q}, new_carry


def quantized_boxes(upper, lower, bits: int):
    """``(upper, lower)`` boxes ``[B, Hkv, NB, D]`` after a round trip through ``bits``-bit codes
    over each (batch, KV head, channel)'s range across the blocks, f32: the maximum rounded up,
    the minimum down, so every dequantized box contains the original (the Quest bound stays an
    upper bound, only looser)."""
    up, lo = upper.astype(jnp.float32), lower.astype(jnp.float32)
    levels = (1 << bits) - 1
    base = jnp.min(lo, axis=2, keepdims=True)
    step = (jnp.max(up, axis=2, keepdims=True) - base) / levels
    step = jnp.where(step > 0, step, 1.0)
    code_up = jnp.clip(jnp.ceil((up - base) / step), 0, levels)
    code_lo = jnp.clip(jnp.floor((lo - base) / step), 0, levels)
    # f32 rounding may put a dequantized edge an ulp inside the box: widen to keep the bound
    return (jnp.maximum(base + code_up * step, up), jnp.minimum(base + code_lo * step, lo))


def filter_overlap(exact, approx, n: int):
    """``float32[B]``: the fraction of the ``n`` best blocks under ``exact [B, Hkv, NB]`` that are
    also among the ``n`` best under ``approx``, the worst KV head (1 where a row has at most ``n``
    candidates: the filter keeps them all either way)."""
    n = max(1, min(n, exact.shape[-1]))
    top_e = lax.top_k(exact, n)[1]
    top_a = lax.top_k(approx, n)[1]
    live = jnp.take_along_axis(exact, top_e, -1) > -jnp.inf  # blocks before the newest only
    kept = ((top_e[..., :, None] == top_a[..., None, :]).any(-1) & live).sum(-1)
    n_live = live.sum(-1)
    return jnp.where(n_live < n, 1.0, kept / jnp.maximum(n_live, 1)).min(-1).astype(jnp.float32)


def _rank(scores, blocks):
    """``int32[B]``: the best rank (0 = first) of ``blocks`` under ``scores [B, Hkv, NB]``,
    the worst over KV heads."""
    best = scores[..., blocks].max(-1)
    return (scores > best[..., None]).sum(-1).max(-1).astype(jnp.int32)


def needle_positions(tokenizer, prompt: str, ids, answer: str) -> tuple[int, ...]:
    """Token positions of ``answer``'s first occurrence in ``prompt`` (character offsets of
    the tokenizer's encoding, which must give ``ids``)."""
    enc = tokenizer.backend.encode(prompt)
    shift = len(ids) - len(enc.ids)  # a BOS the wrapper prepends itself
    if shift not in (0, 1) or list(enc.ids) != list(ids)[shift:]:
        raise ValueError("the tokenizer's encoding differs from the sample's ids: cannot place the needle")
    at = prompt.find(answer)
    if at < 0:
        raise ValueError(f"answer {answer!r} is not in the prompt")
    end = at + len(answer)
    pos = tuple(i + shift for i, (a, b) in enumerate(enc.offsets) if b > at and a < end and b > a)
    if not pos:
        raise ValueError(f"no token covers the answer {answer!r}")
    return pos


def probe_prompt(model, method, ids, needle: tuple[int, ...], steps: int, index: int = 0,
                 box_bits: int = 8) -> list[dict]:
    """Per step and sparse layer: mass, block rank and selection recall of the ``needle``
    positions of the prompt ``ids``; with ``box_bits``, what boxes of that many bits change."""
    cfg = model.config
    ids = list(ids)
    if getattr(method, "box_bits", None) is not None:
        # the probe ranks blocks by the exact boxes and studies quantized ones itself (``box_bits``):
        # the inner method keeps its boxes in the cache's dtype (AsyncTLS's default is 8-bit codes)
        method = dataclasses.replace(method, box_bits=None)
    probe = NeedleProbe(inner=method, num_q_heads=cfg.num_heads, needle=tuple(needle), box_bits=box_bits)
    pm = model.with_method(probe)
    n = len(ids)
    cap = -(-(n + steps + 1) // 64) * 64
    tokens = jnp.asarray([ids], jnp.int32)
    logits, cache = pm.fns.prefill(pm.params, tokens, jnp.asarray([n], jnp.int32), pm.init_cache(1, cap))
    tok = jnp.argmax(logits, -1).astype(jnp.int32)
    sparse = [i for i in range(cfg.num_layers) if cache.layers[i].state is not None]
    rows = []
    for t in range(steps):
        logits, cache = pm.fns.decode_step(pm.params, tok, cache)
        for i in sparse:
            s = cache.layers[i].state
            rows.append({"index": index, "step": t, "layer": i, "needle_tokens": len(needle),
                         "mass": float(s["needle_mass"][0]), "block_rank": int(s["block_rank"][0]),
                         "block_rank_max_heads": int(s["block_rank_max_heads"][0]),
                         "in_selection": float(s["in_selection"][0]),
                         **({"block_rank_q": int(s["block_rank_q"][0]),
                             "filter_overlap_q": float(s["filter_overlap_q"][0])} if box_bits else {})})
        tok = jnp.argmax(logits, -1).astype(jnp.int32)  # dense's greedy token (the probe's output is dense)
    return rows


def summarize(rows: list[dict], kept_ranks: int | None) -> list[dict]:
    """Per prompt and layer: steps probed, mean needle mass, the worst block rank, the
    steps whose needle blocks fell outside the filter, the mean selection recall."""
    out = []
    for key in sorted({(r["index"], r["layer"]) for r in rows}):
        rs = [r for r in rows if (r["index"], r["layer"]) == key]
        ranks = [r["block_rank"] for r in rs]
        out.append({"index": key[0], "layer": key[1], "steps": len(rs),
                    "mean_mass": float(np.mean([r["mass"] for r in rs])),
                    "worst_block_rank": max(ranks),
                    "worst_rank_max_heads": max(r.get("block_rank_max_heads", -1) for r in rs),
                    "steps_outside_filter": (sum(rk >= kept_ranks for rk in ranks) if kept_ranks is not None
                                             and min(ranks) >= 0 else "-"),
                    "mean_in_selection": float(np.mean([r["in_selection"] for r in rs])),
                    **({"worst_rank_q": max(r["block_rank_q"] for r in rs),
                        "min_filter_overlap_q": min(r["filter_overlap_q"] for r in rs)}
                       if "block_rank_q" in rs[0] else {})})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--method", default="asynctls")
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--set", action="append", default=[], help="KEY=VALUE method option (e.g. kb=256, group_reduce=max)")
    p.add_argument("--task", default="niah_single_2")
    p.add_argument("--length", type=int, default=16384)
    p.add_argument("--indices", type=parse_list, default=[0], help="comma-separated sample indices")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", default=None)
    p.add_argument("--name", default="needle_probe")
    p.add_argument("--box-bits", type=int, default=8,
                   help="also rank the blocks under boxes of this many bits (0: off; default %(default)s)")
    args = p.parse_args(argv)
    from models.cli.options import parse_option_value

    opts = {}
    for kv in args.set:
        k, _, v = kv.partition("=")
        if not v:
            p.error(f"--set takes KEY=VALUE, got {kv!r}")
        opts[k] = parse_option_value(v)

    import models
    from benchmarks import ruler_tasks
    from models.api import method_for_model

    model = models.load_model(args.model, dtype=jnp.dtype(args.dtype), max_len=args.length + 64)
    # named as the harness names it: the model's dense-layer rule applies (Gemma 3: every global layer)
    method = method_for_model(args.method, {"budget": args.budget, **opts}, model.config)
    rows = []
    for i in args.indices:
        sample = ruler_tasks.generate_sample(args.task, args.length, i, model.tokenizer, chat=False)
        needle = needle_positions(model.tokenizer, sample.prompt, sample.input_ids, sample.answers[0])
        rows += probe_prompt(model, method, sample.input_ids, needle, args.steps, index=i, box_bits=args.box_bits)
        print(f"[needle_probe] prompt {i}: {len(sample.input_ids)} tokens done", file=sys.stderr, flush=True)
    kb = getattr(method, "kb", None)
    summary = summarize(rows, kb - 1 if kb else None)
    payload = {"stamp": stamp(), "settings": {k: v for k, v in vars(args).items() if k not in ("out",)},
               "method": repr(method), "rows": rows, "summary": summary}
    md = [f"# Needle probe: {args.method} on {args.model}, {args.task} at {args.length}", "",
          f"- {payload['stamp']['device']}, jax {payload['stamp']['jax']}, {payload['stamp']['date']}, "
          f"commit {payload['stamp']['git_commit']}", f"- command: `{payload['stamp']['command']}`",
          f"- method: `{payload['method']}`; the filter keeps block ranks below {kb - 1 if kb else '-'}",
          f"- `_q` columns: the same bound on boxes of {args.box_bits} bits (max rounded up, min down)"
          if args.box_bits else "- boxes kept at full precision only", "",
          markdown_table(summary, list(summary[0])), ""]
    write_results(args.name, payload, "\n".join(md), Path(args.out) if args.out else None)
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
