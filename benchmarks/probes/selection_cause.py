"""Why AsyncSpade and Kascade lose a retrieval needle: the prediction, the granularity or the reuse.

    python -m benchmarks.probes.selection_cause --methods asyncspade,kascade --budget 256 \\
        --length 4096 --tasks niah_single_1,niah_single_2 --indices 0,1,2 --steps 8 --out /tmp/sc

The accuracy harness's prompts (its prompt style: SmolLM2's chat template), each prefilled
densely; then ``--steps`` decode steps teacher-forced with dense's greedy answer (every layer
sees dense's inputs: the probe returns dense attention, the method's state and carry are kept
current, as :mod:`benchmarks.needle_probe` does). The needle is the prompt tokens of the expected
answer (the tokenizer's character offsets). At each step and layer the method runs on, against
the dense softmax ``p`` of the true query:

* ``share``: the needle's share of dense attention mass (mean over query heads): does this
  layer read the needle;
* for each selection below, ``kept``: the fraction of the needle's dense mass that lies in it
  (summed over the query heads of each KV group and over KV heads, so heads that do not read
  the needle do not count), and ``recall``: the fraction of all dense mass in it;

  - ``oracle_tok``: the top ``budget`` tokens of the true query's softmax summed over the GQA
    group (Kascade's anchor, ``oracle_topk``);
  - ``oracle_blk``: the top ``budget // block`` blocks of 16 tokens by the true query's exact
    block mass, the newest block always kept (Quest's granularity and accounting, an exact
    scorer): ``oracle_tok - oracle_blk`` is what the block granularity costs;
  - ``shared_tok`` (Kascade): one top ``budget`` for all KV heads, the softmax summed over
    every query head (the paper's shared-top-k variant);
  - AsyncSpade: ``selector_true`` (its selector, e.g. Quest's bound, run on the true query:
    what the selector loses with a perfect prediction), ``pred_tok`` (the top ``budget - 1``
    tokens of the *predicted* query over the keys it could see, plus the new token: the
    paper's token-level selection, ``selector="oracle_topk"``), ``lag_tok`` (the same from the
    previous step's query: the predictor's W = 1), ``method`` (what AsyncSpade attends);
  - Kascade: ``method`` (an anchor's own exact top-k, a reuse layer the carried top-k of anchor
    head ``head_map[h]``; the dense first anchor: everything) and ``reuse_identity`` (a reuse
    layer reading the same KV head of the anchor: the head map's worth);

* AsyncSpade's predictor: ``cos`` (predicted against true query, per query head) and
  ``cos_lag`` (the previous query against it); the top-k overlap is ``pred_tok``'s overlap with
  ``oracle_tok`` (``overlap``, and ``overlap_lag`` for ``lag_tok``).

The first answer token comes from the prefill, so step 0 is the query of the first generated
token producing the second; AsyncSpade's selection at step 0 comes from the last prompt query
(its window holds one query), at step ``t`` from a window of ``t + 1``.

Prompts dense does not retrieve (its greedy answer lacks the expected string) are skipped;
``--score`` also generates each method's own greedy answer (the harness's
:func:`benchmarks.accuracy.greedy_generate`), so the tables split the prompts the method loses
from those it keeps. ``--tiny``: a random 4-layer model and a fake needle, seconds on a CPU
(the test's mode). Output: ``<name>.md`` and ``<name>.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.fidelity import FidelityProbe, selection_mask
from sparse_jax.methods.sparse_base import decode_probabilities
from sparse_jax.ops.dense import masked_decode_attention

BLOCK = 16
COMMON = ("oracle_tok", "oracle_blk", "shared_tok")
SPADE = ("selector_true", "pred_tok", "lag_tok", "method")
KASCADE = ("method", "reuse_identity")


def variants(method) -> tuple[str, ...]:
    """The selections recorded for ``method`` (the mask rows of the probe's state)."""
    if method.name == "asyncspade":
        return COMMON + SPADE
    if method.name == "kascade":
        return COMMON + KASCADE
    return COMMON + ("method",)


def _top_mask(scores, lengths, k: int, s: int):
    """Bool ``[B, Hkv, S]``: the top ``k`` of ``scores [B, Hkv, S]`` among positions ``< lengths``
    (all of them when the row has at most ``k``)."""
    scores = jnp.where(jnp.arange(s)[None, None] < lengths[:, None, None], scores, -jnp.inf)
    idx = jax.lax.top_k(scores, min(k, s))[1]
    counts = jnp.broadcast_to(jnp.minimum(lengths, k)[:, None], scores.shape[:2])
    return selection_mask(idx.astype(jnp.int32), counts, lengths, s)


def _with_newest(mask, lengths):
    """``mask`` plus each row's newest token (position ``lengths - 1``)."""
    s = mask.shape[-1]
    return mask | (jnp.arange(s)[None, None] == (lengths - 1)[:, None, None])


def _cos(a, b):
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    den = jnp.linalg.norm(a, axis=-1) * jnp.linalg.norm(b, axis=-1)
    return jnp.mean(jnp.sum(a * b, -1) / jnp.maximum(den, 1e-30), axis=-1)  # [B]


@dataclasses.dataclass(frozen=True)
class SelectionCauseProbe(FidelityProbe):
    """:class:`~benchmarks.fidelity.FidelityProbe` (dense output, ``inner``'s state and carry kept
    current) recording, per decode step of each layer ``inner`` runs on, the dense probabilities
    ``probs [B, Hkv, G, S]`` and one selection mask per :func:`variants` entry (``masks [V, B,
    Hkv, S]``), plus AsyncSpade's predictor cosines. ``budget``: the token budget of the oracle
    selections (the method's own)."""

    name: ClassVar[str] = "selection_cause_probe"
    budget: int = 256
    block_size: int = BLOCK

    def init_state(self, spec, *, batch, num_kv_heads, max_len, head_dim, dtype, num_q_heads=None):
        inner = self.inner.init_state(spec, batch=batch, num_kv_heads=num_kv_heads, max_len=max_len,
                                      head_dim=head_dim, dtype=dtype, num_q_heads=num_q_heads)
        g = self.num_q_heads // num_kv_heads
        nv = len(variants(self.inner))
        return {"inner": inner, "probs": jnp.zeros((batch, num_kv_heads, g, max_len), jnp.float32),
                "masks": jnp.zeros((nv, batch, num_kv_heads, max_len), bool),
                "cos": jnp.zeros((batch,), jnp.float32), "cos_lag": jnp.zeros((batch,), jnp.float32)}

    def decode(self, q, kv, lengths, state, carry, layer):
        k, v = kv.k, kv.v
        s = k.shape[2]
        valid = jnp.arange(s)[None, :] < lengths[:, None]
        dense = masked_decode_attention(q, k, v, valid[:, None, :])
        st = state["inner"]
        probs = decode_probabilities(q, k, lengths)  # [B, Hkv, G, S]
        group = probs.sum(2)
        masks = {"oracle_tok": _top_mask(group, lengths, self.budget, s)}
        # blocks: exact mass per block, the newest block forced (Quest's accounting)
        nb = s // self.block_size
        blk = group[..., : nb * self.block_size].reshape(*group.shape[:2], nb, self.block_size).sum(-1)
        newest_blk = (lengths - 1) // self.block_size
        blk = jnp.where(jnp.arange(nb)[None, None] == newest_blk[:, None, None], jnp.inf, blk)
        top_blk = _top_mask(blk, (lengths + self.block_size - 1) // self.block_size,
                            max(1, self.budget // self.block_size), nb)
        masks["oracle_blk"] = jnp.repeat(top_blk, self.block_size, axis=-1) & valid[:, None, :]
        shared = jnp.broadcast_to(group.sum(1, keepdims=True), group.shape)
        masks["shared_tok"] = _top_mask(shared, lengths, self.budget, s)
        cos = cos_lag = jnp.zeros(lengths.shape, jnp.float32)
        inner = self.inner
        if inner.name == "asyncspade":
            from sparse_jax.methods.asyncspade import predict_next_query

            sel_t, _, _ = inner.inner().select(q, kv, lengths, st["inner"], None, layer)
            masks["selector_true"] = self._mask(sel_t, lengths, s, k.shape[1])
            # q̂_t: predicted during step t - 1 from the history before this step's query
            q_hat = predict_next_query(st["hist"], st["count"], inner.window, inner.ridge, impl=inner.impl)
            q_lag = st["hist"][:, :, -1]
            seen = lengths - 1  # the keys the prediction could score (this step's key came after)
            for key, qq in (("pred_tok", q_hat), ("lag_tok", q_lag)):
                p_hat = decode_probabilities(qq.astype(q.dtype), k, seen).sum(2)
                masks[key] = _with_newest(_top_mask(p_hat, seen, self.budget - 1, s), lengths)
            cos, cos_lag = _cos(q_hat, q), _cos(q_lag, q)
        sel, _, _ = inner.select(q, kv, lengths, st, carry, layer)
        masks["method"] = self._mask(sel, lengths, s, k.shape[1])
        if inner.name == "kascade":
            from sparse_jax.methods.kascade.method import REUSE

            ident = selection_mask(carry["indices"], carry["counts"], lengths, s)
            masks["reuse_identity"] = jnp.where(layer.data["role"] == REUSE, ident, masks["method"])
        out, new_inner, new_carry = inner.decode(q, kv, lengths, st, carry, layer)
        del out
        stacked = jnp.stack([masks[v] for v in variants(inner)])
        return dense, {"inner": new_inner, "probs": probs, "masks": stacked, "cos": cos,
                       "cos_lag": cos_lag}, new_carry

    @staticmethod
    def _mask(sel, lengths, s, hkv):
        """Bool ``[B, Hkv, S]`` of a :class:`~sparse_jax.selection.Selection` (``"all"``: the context)."""
        if sel.kind == "all":
            return jnp.broadcast_to((jnp.arange(s)[None, :] < lengths[:, None])[:, None, :], (lengths.shape[0], hkv, s))
        idx, counts = sel.token_view(lengths)
        return selection_mask(idx, counts, lengths, s)


# -----------------------------------------------------------------------------
# Host side: one prompt, the metrics, the tables
# -----------------------------------------------------------------------------


def step_metrics(probs: np.ndarray, masks: np.ndarray, needle: np.ndarray, names) -> dict:
    """One layer and step of row 0: ``probs [Hkv, G, S]``, ``masks [V, Hkv, S]``, ``needle`` the
    needle's positions. Needle mass and each selection's kept needle mass are sums over query
    heads (so heads that do not read the needle weigh nothing); ``recall_*`` is the mean over
    query heads of the dense mass inside the selection."""
    pn = probs[..., needle]  # [Hkv, G, N]
    out = {"share": float(pn.sum(-1).mean()), "needle_mass": float(pn.sum())}
    for v, name in enumerate(names):
        m = masks[v]
        out[f"kept_{name}"] = float((pn * m[:, None, needle]).sum())
        out[f"recall_{name}"] = float((probs * m[:, None, :]).sum(-1).mean())
    if "pred_tok" in names:
        ora = masks[names.index("oracle_tok")]
        n = max(int(ora.sum()), 1)
        for key, name in (("overlap", "pred_tok"), ("overlap_lag", "lag_tok")):
            out[key] = float((masks[names.index(name)] & ora).sum() / n)
    return out


def probe_model(model, method, budget: int):
    """``model`` running :class:`SelectionCauseProbe` around ``method``, unrolled (static layer
    roles: Kascade's dense first anchor); build it once per method (it holds the compilations)."""
    probe = SelectionCauseProbe(inner=method, num_q_heads=model.config.num_heads, budget=budget)
    return model.with_method(probe, unroll=True)


def probe_prompt(pm, ids, needle, steps: int, width: int, index=None):
    """Teacher-forced dense decode of the prompt ``ids`` (padded to ``width`` tokens: one
    compilation for every prompt of a length) on ``pm`` (:func:`probe_model`); returns ``(rows,
    dense_tokens)``: per step and layer the :func:`step_metrics` of the probed method, and dense's
    greedy tokens (the first one from the prefill, then one per step)."""
    cfg = pm.config
    method = pm.method.inner
    names = variants(method)
    n = len(ids)
    if n + steps + 1 > width:
        raise ValueError(f"a prompt of {n} tokens + {steps} steps does not fit {width} tokens")
    cap = -(-(width + 1) // 64) * 64
    tokens = np.zeros((1, width), np.int32)
    tokens[0, :n] = ids
    logits, cache = pm.fns.prefill(pm.params, jnp.asarray(tokens), jnp.asarray([n], jnp.int32), pm.init_cache(1, cap))
    tok = jnp.argmax(logits, -1).astype(jnp.int32)
    out_tokens = [int(tok[0])]
    layers = [i for i in range(cfg.num_layers) if cache.layers[i].state is not None]
    needle = np.asarray(needle)
    rows = []
    for t in range(steps):
        logits, cache = pm.fns.decode_step(pm.params, tok, cache)
        for i in layers:
            st = cache.layers[i].state
            r = {"index": index, "step": t, "layer": i,
                 **step_metrics(np.asarray(st["probs"][0]), np.asarray(st["masks"][:, 0]), needle, names)}
            if method.name == "asyncspade":
                r.update(cos=float(st["cos"][0]), cos_lag=float(st["cos_lag"][0]))
            rows.append(r)
        tok = jnp.argmax(logits, -1).astype(jnp.int32)
        out_tokens.append(int(tok[0]))
    return rows, out_tokens


def layer_roles(method, num_layers: int) -> dict[int, str]:
    """Kascade: ``anchor`` (``dense anchor``) or ``reuse<-a`` per layer; others: empty."""
    if method.name != "kascade":
        return {}
    anchors = sorted(method.anchors or ())
    roles = {}
    for i in range(num_layers):
        if i in anchors:
            roles[i] = "dense anchor" if i == anchors[0] and method.dense_first_anchor else "anchor"
        else:
            prev = [a for a in anchors if a < i]
            roles[i] = f"reuse<-{prev[-1]}" if prev else "reuse"
    return roles


def summarize(rows: list[dict], names, by: str = "layer", roles: dict | None = None) -> list[dict]:
    """Rows grouped by ``by`` ("layer" or "step"): the mean needle share, each selection's kept
    fraction of the needle mass (mass-weighted: sum kept / sum needle mass), its mean recall,
    and the predictor's means; then one ``all`` row over every group."""
    def agg(rs, key):
        nm = sum(r["needle_mass"] for r in rs)
        out = {by: key, "n": len(rs), "share": float(np.mean([r["share"] for r in rs]))}
        if roles:
            out["role"] = roles.get(key, "")
        for name in names:
            out[f"kept_{name}"] = sum(r[f"kept_{name}"] for r in rs) / nm if nm > 0 else float("nan")
        for name in names:
            out[f"recall_{name}"] = float(np.mean([r[f"recall_{name}"] for r in rs]))
        for key2 in ("cos", "cos_lag", "overlap", "overlap_lag"):
            if key2 in rs[0]:
                out[key2] = float(np.mean([r[key2] for r in rs]))
        return out

    keys = sorted({r[by] for r in rows})
    table = [agg([r for r in rows if r[by] == k], k) for k in keys]
    if rows:
        table.append(agg(rows, "all"))
    return table


def reading_layers(summary: list[dict], min_share: float) -> list:
    """The layers whose mean needle share is at least ``min_share`` (the retrieval layers)."""
    return [r["layer"] for r in summary if r["layer"] != "all" and r["share"] >= min_share]


def table_columns(names, method_name: str, by: str) -> list[str]:
    cols = [by] + (["role"] if method_name == "kascade" and by == "layer" else []) + ["n", "share"]
    cols += [f"kept_{v}" for v in names]
    cols += ["recall_oracle_tok", "recall_method"]
    if method_name == "asyncspade":
        cols += ["recall_pred_tok", "cos", "cos_lag", "overlap", "overlap_lag"]
    return cols


def render(payload: dict) -> str:
    st = payload["stamp"]
    lines = [f"# Selection-cause probe: {payload['model']}, {', '.join(payload['tasks'])} at {payload['length']}, "
             f"budget {payload['budget']}", "",
             f"- {st['device']}, jax {st['jax']}, {st['date']}, commit {st['git_commit']}",
             f"- command: `{st['command']}`",
             f"- prompts dense retrieves: {payload['prompts']}; skipped (dense misses): {payload['skipped']}",
             f"- {payload['steps']} teacher-forced decode steps per prompt (dense's greedy answer); "
             f"`kept_*`: fraction of the needle's dense attention mass inside the selection (mass-weighted over "
             f"query heads, steps and prompts); `share`: the needle's share of dense mass (mean over query heads); "
             f"`recall_*`: dense mass inside the selection (all tokens)", ""]
    fmt = {c: ".3f" for c in ("share",)}
    for m in payload["methods"]:
        names = m["variants"]
        lines += [f"## {m['name']}: `{m['method']}`", ""]
        if m.get("scores") is not None:
            lines += [f"- its own greedy answers (`--score`): {m['scores']}; lost: {m['lost']}", ""]
        for title, key in (("per layer, every prompt", "by_layer"),
                           (f"per layer, the prompts it loses ({m['lost']})", "by_layer_lost"),
                           (f"per step, the reading layers {m['reading_layers']}", "by_step")):
            tab = m.get(key)
            if not tab:
                continue
            by = "step" if key == "by_step" else "layer"
            cols = table_columns(names, m["name"], by)
            lines += [f"### {title}", "", _table(tab, cols, fmt), ""]
    return "\n".join(lines)


def _table(rows, cols, fmt):
    from benchmarks.timing import markdown_table

    def cell(r):
        return {c: (round(v, 3) if isinstance(v, float) else v) for c, v in r.items()}

    return markdown_table([cell(r) for r in rows], cols, fmt)


# -----------------------------------------------------------------------------
# Command line
# -----------------------------------------------------------------------------


def _tiny_model():
    import models
    from models.config import ModelConfig

    cfg = ModelConfig(name="tiny-cause", arch="llama", num_layers=4, hidden_size=48, num_heads=4, num_kv_heads=2,
                      head_dim=16, intermediate_size=80, vocab_size=97, max_position=512, rope_theta=1e4,
                      rms_eps=1e-6, tie_embeddings=True, eos_token_id=3)
    return models.load_model(config=cfg, dtype=jnp.float32)


def build_method(name: str, budget: int, opts: dict, cfg, tiny: bool):
    from models.api import method_for_model

    opts = {"budget": budget, **opts}
    if tiny and name == "kascade":
        opts.setdefault("anchors", (0, 2))
    if tiny and name == "asyncspade":
        opts.setdefault("window", 4)
    return method_for_model(name, opts, cfg)


def parse_sets(items) -> dict[str, dict]:
    """``--set asyncspade.selector=oracle_topk`` -> ``{"asyncspade": {"selector": "oracle_topk"}}``."""
    from models.cli.options import parse_option_value

    out: dict[str, dict] = {}
    for kv in items:
        key, _, val = kv.partition("=")
        name, _, field = key.partition(".")
        if not val or not field:
            raise SystemExit(f"--set takes METHOD.KEY=VALUE, got {kv!r}")
        out.setdefault(name, {})[field] = parse_option_value(val)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--methods", default="asyncspade,kascade", help="comma-separated: asyncspade, kascade, ...")
    p.add_argument("--set", action="append", default=[], help="METHOD.KEY=VALUE (asyncspade.selector=oracle_topk)")
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--tasks", default="niah_single_1,niah_single_2")
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--indices", default="0,1,2", help="sample indices per task")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--min-share", type=float, default=0.05, help="a reading layer's mean needle share")
    p.add_argument("--score", action="store_true", help="also generate each method's own greedy answers")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--tiny", action="store_true", help="a random 4-layer model and a fake needle (a CPU test)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("--name", default=None)
    a = p.parse_args(argv)
    from tqdm.auto import tqdm

    from benchmarks.timing import stamp, write_results

    t0 = time.perf_counter()
    sets = parse_sets(a.set)
    methods = [m for m in a.methods.split(",") if m]
    if a.tiny:
        model = _tiny_model()
        rng = np.random.default_rng(0)
        prompts = [{"task": "tiny", "index": i, "ids": rng.integers(5, 97, 150 + 7 * i).tolist(),
                    "needle": (40 + i, 41 + i, 42 + i), "answers": None, "max_new": a.steps} for i in range(2)]
        width = length = 192
    else:
        import models
        from benchmarks import ruler_tasks
        from benchmarks.needle_probe import needle_positions

        # a prompt leaves ANSWER_ROOM (64) of its length for the answer: the length is the context
        model = models.load_model(a.model, dtype=jnp.dtype(a.dtype), max_len=a.length)
        chat = getattr(model.tokenizer, "chat_template", None) is not None  # the harness's "auto"
        prompts = []
        for task in a.tasks.split(","):
            for i in (int(x) for x in a.indices.split(",")):
                smp = ruler_tasks.generate_sample(task, a.length, i, model.tokenizer, chat=chat)
                prompts.append({"task": task, "index": i, "ids": list(smp.input_ids), "answers": list(smp.answers),
                                "needle": needle_positions(model.tokenizer, smp.prompt, smp.input_ids, smp.answers[0]),
                                "max_new": smp.max_new_tokens})
        # every prompt padded to one width (one compilation): the longest prompt and its steps, so a
        # prompt of a target at the model's context still fits it (its cache rounds up to 64)
        width, length = max(len(pr["ids"]) for pr in prompts) + a.steps + 1, a.length
    cfg = model.config
    budget = min(a.budget, 32) if a.tiny else a.budget  # the tiny prompts are 150-157 tokens
    payload = {"stamp": stamp(), "model": cfg.name, "tasks": a.tasks.split(",") if not a.tiny else ["tiny"],
               "length": length, "budget": budget, "steps": a.steps, "methods": [], "prompts": [], "skipped": []}
    jobs = [(m, pr) for m in methods for pr in prompts]
    bar = tqdm(total=len(jobs), desc="selection_cause", unit="prompt", file=sys.stderr, disable=a.no_progress)
    dense_ok: dict = {}
    for name in methods:
        method = build_method(name, budget, sets.get(name, {}), cfg, a.tiny)
        pm = probe_model(model, method, budget)
        bound = pm.method.inner  # bound to the model (calibration, anchors)
        names = variants(bound)
        rows, keys = [], []
        for pr in prompts:
            key = f"{pr['task']}/{pr['index']}"
            if dense_ok.get(key) is False:
                bar.update(1)
                continue
            r, toks = probe_prompt(pm, pr["ids"], pr["needle"], a.steps, width, index=key)
            if pr["answers"] is not None and key not in dense_ok:
                from benchmarks.ruler_tasks import score

                dense_ok[key] = score(model.tokenizer.decode(toks), pr["answers"]) > 0
                if not dense_ok[key]:
                    payload["skipped"].append(key)
                    bar.update(1)
                    continue
                payload["prompts"].append(key)
            elif pr["answers"] is None and key not in dense_ok:
                dense_ok[key] = True
                payload["prompts"].append(key)
            rows += r
            keys.append(key)
            bar.update(1)
        entry = {"name": name, "method": repr(bound), "variants": list(names), "scores": None, "lost": [],
                 "rows": rows}
        if a.score and keys and not a.tiny:  # the tiny prompts have no answer to score
            entry["scores"], entry["lost"] = score_method(model, method, [pr for pr in prompts
                                                                          if f"{pr['task']}/{pr['index']}" in keys],
                                                          length)  # the harness's: answers fit it
        roles = layer_roles(bound, cfg.num_layers)
        entry["by_layer"] = summarize(rows, names, "layer", roles)
        lost_rows = [r for r in rows if r["index"] in entry["lost"]]
        entry["by_layer_lost"] = summarize(lost_rows, names, "layer", roles) if lost_rows else []
        reading = reading_layers(entry["by_layer"], a.min_share)
        entry["reading_layers"] = reading
        for key in ("by_layer", "by_layer_lost"):  # one more row: the reading layers together
            sub = [r for r in (rows if key == "by_layer" else lost_rows) if r["layer"] in reading]
            if sub and entry[key]:
                entry[key].append({**summarize(sub, names, "layer")[-1], "layer": "reading"})
        entry["by_step"] = summarize([r for r in rows if r["layer"] in reading], names, "step") if reading else []
        payload["methods"].append(entry)
    bar.close()
    payload["wall_s"] = round(time.perf_counter() - t0, 1)
    md = render(payload)
    name = a.name or f"selection_cause_{cfg.name}_{length}_b{budget}"
    if a.out:
        write_results(name, payload, md, Path(a.out))
    print(md)
    return 0


def score_method(model, method, prompts, width: int):
    """The method's own greedy answers on ``prompts`` (one batch, the harness's generation):
    ``({key: score}, [keys it loses])``."""
    from benchmarks import accuracy
    from benchmarks.ruler_tasks import score

    mm = model.with_method(method)
    outs = accuracy.greedy_generate(mm, [pr["ids"] for pr in prompts], [pr["max_new"] for pr in prompts],
                                    width=width, batch_size=len(prompts), stops=accuracy.stop_ids(mm, model.tokenizer),
                                    pad=accuracy.pad_id(mm))
    scores = {f"{pr['task']}/{pr['index']}": score(model.tokenizer.decode(o), pr["answers"])
              for pr, o in zip(prompts, outs)}
    return scores, [k for k, v in scores.items() if v < 1]


if __name__ == "__main__":
    sys.exit(main())
