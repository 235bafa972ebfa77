"""Kascade's offline calibration: anchor layers and the head map of a model.

    python -m models.cli.kascade_calibrate --model smollm2-135m --prompts 16 --seq-len 512

Runs the model densely over real text (the docstring text of
:mod:`models.cli.calibrate`: plain English, deterministic), and for every prompt
and every pair of layers ``a < b`` measures how much of layer ``b``'s oracle
top-k attention mass layer ``a``'s top-k recovers, per KV head pair
(:mod:`sparse_jax.methods.kascade.calibration`: min over query tiles, mean over
prompts, weighted by the reuse layer's importance ``1 - cos(h_in, h_in +
attn_out)``). The paper's DP picks ``--anchors`` anchor layers (the first
layer forced), the argmax over anchor heads the head map, and the result is
saved where ``kascade`` reads it (``sparse_jax/calibration_data/<model>/kascade.json``).

Model-agnostic: only the layers the method can run on (global layers: on a
model with sliding-window layers, such as Gemma 3, the local ones are
excluded) take part; the others keep the identity head map and are never
anchors.

Departures from the paper's setting, for a CPU run: docstring text instead of
MuSiQue, and prompts of ``--seq-len`` tokens (the paper's development set
averages 2.3K tokens); the paper's stats k is 64 (32 effective in its code),
``--k`` here (default 64).

``--text-file PATH`` calibrates on other text, as the paper's development set is
multi-hop QA: a UTF-8 text (consecutive windows from its start), or JSON lines of
``{"text": ...}`` prompts, each tokenised and cut to its last ``--seq-len`` tokens (so
a question at the end stays). On SmolLM2 the docstrings weight layers 4-13 ~0.01,
and the DP then puts no anchor where the first needle-reading layer (7) is
(docs/methods.md, issue 51).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import sys
import time
from typing import NamedTuple

import numpy as np

import models
from models.cli.calibrate import calibration_batches, calibration_text
from models.driver import _layer_at, inv_freq, make_plan
from models.transformer import layer_graphdef, layer_output, layer_qkv, rope_cos_sin
from sparse_jax.methods.kascade.calibration import (
    CALIBRATION_ROOT,
    choose_anchors,
    group_probs_per_query,
    head_map_for,
    importance,
    layer_scores,
    prompt_similarity,
    save_kascade_calibration,
)
from sparse_jax.methods.base import DenseAttention
from sparse_jax.methods.kascade import Kascade
from sparse_jax.ops.dense import dense_prefill_attention


@functools.lru_cache(maxsize=4)
def _trace_fn(cfg, graphdef_layers):
    """``(stacked, x [1,T,H]) -> per layer (q [T,Hq,D], k [T,Hkv,D], x_in [T,H], x_attn [T,H])``,
    dense, through the driver's per-layer pieces."""
    import jax
    import jax.numpy as jnp

    plan = make_plan(cfg, DenseAttention())

    @jax.jit
    def run(stacked, x):
        t = x.shape[1]
        out = []
        for g, spec in enumerate(plan.specs):
            layer = _layer_at(graphdef_layers, stacked, g)
            cos, sin = rope_cos_sin(jnp.arange(t), inv_freq(cfg, spec))
            q, k, v = layer_qkv(layer, x, cos, sin)
            o = dense_prefill_attention(q, k, v, spec.window)
            # the residual stream after attention (importance = 1 - cos(x, x + attn_out))
            x_attn = x + layer.self_attn.out(o)
            out.append((q[0], k[0], x[0], x_attn[0]))
            x = layer_output(layer, x, o)
        return out

    return run


def calibrate(model, prompts: np.ndarray, *, k: int, tile: int, num_anchors: int, log=print) -> dict:
    """Anchors and head map of ``model`` from ``prompts int32[N, T]``."""
    import jax.numpy as jnp
    from flax import nnx

    cfg = model.config
    graph_model = nnx.merge(model.graphdef, model.params)
    stacked = nnx.state(graph_model.layers)
    run = _trace_fn(cfg, layer_graphdef(cfg, graph_model.embed_tokens.weight[...].dtype))
    # the layers Kascade can run on (global layers; no dense-layer rule)
    layers = [i for i, s in enumerate(make_plan(cfg, Kascade(anchors=(0,))).specs) if s.sparse]
    scale = cfg.head_dim ** -0.5
    nl, hkv = cfg.num_layers, cfg.num_kv_heads
    sim_sum = np.zeros((len(layers), len(layers), hkv, hkv))
    imp = np.zeros(nl)
    t0 = time.time()
    for n, ids in enumerate(prompts):
        per_layer = run(stacked, graph_model.embed_tokens(jnp.asarray(ids[None], jnp.int32)))
        probs = []
        for g in layers:
            q, kk, x_in, x_attn = (np.asarray(a, np.float64) for a in per_layer[g])
            probs.append(group_probs_per_query(q, kk, scale))
            imp[g] += importance(x_in, x_attn)
        sim_sum += prompt_similarity(probs, k, tile, first_query=k)
        log(f"prompt {n + 1}/{len(prompts)} ({time.time() - t0:.0f} s)")
    sim = sim_sum / len(prompts)
    imp /= len(prompts)
    score, heads = layer_scores(sim, imp[layers])
    pos = choose_anchors(score, num_anchors)
    anchors = [layers[i] for i in pos]
    # heads[a, b] in positions of ``layers`` -> full model indices
    full_heads = np.zeros((nl, nl, hkv), np.int64)
    for ia, a in enumerate(layers):
        for ib, b in enumerate(layers):
            full_heads[a, b] = heads[ia, ib]
    hm = head_map_for(anchors, full_heads, nl, hkv, layers)
    return {
        "anchors": anchors,
        "head_map": hm.tolist(),
        "layers": layers,
        "importance": [round(float(x), 6) for x in imp],
        "layer_score": np.round(score, 5).tolist(),  # [len(layers)]^2: positions in ``layers``
        "heads": full_heads.astype(int).tolist(),  # [L, L, Hkv]: best anchor head of (anchor a, layer b, head)
        # [a, b]: the mean over b's heads of each one's best head of a (layer_score before the weights)
        "mean_head_similarity": np.round(sim.max(axis=-1).mean(axis=2), 5).tolist(),
    }


class CalibrationText(NamedTuple):
    """What ``--text-file`` holds: ``texts``, whether they are cut into ``windows`` (a plain
    text, one entry) or are prompts (JSON lines), and the file's ``sha256`` (16 hex digits)."""

    texts: list[str]
    windows: bool
    sha256: str


def read_texts(path: str) -> CalibrationText:
    """The calibration text of ``path``, read once: ``[text]`` for a plain UTF-8 file, the
    ``"text"`` of every line of a ``.jsonl`` file. ValueError when it holds none."""
    with open(path, "rb") as f:
        data = f.read()
    raw, digest = data.decode("utf-8"), hashlib.sha256(data).hexdigest()[:16]
    if not path.endswith(".jsonl"):
        if not raw.strip():
            raise ValueError("the file is empty")
        return CalibrationText([raw], True, digest)
    texts = []
    for n, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"line {n} is not JSON: {e}") from e
        if not isinstance(rec, dict) or not isinstance(rec.get("text"), str):
            raise ValueError(f"line {n}: expected an object with a string \"text\"")
        texts.append(rec["text"])
    if not texts:
        raise ValueError("no prompts in the file")
    return CalibrationText(texts, False, digest)


def prompts_from_texts(texts: list[str], tokenizer, seq_len: int, count: int, *, windows: bool) -> np.ndarray:
    """``int32[count, seq_len]``: ``windows`` (a plain text: ``texts`` is one) -> consecutive
    windows from its start; else the first ``count`` prompts, each its last ``seq_len``
    tokens. ValueError when too short."""
    if windows:
        return calibration_batches(tokenizer.encode(texts[0]), seq_len, count)
    if len(texts) < count:
        raise ValueError(f"{len(texts)} prompts, --prompts {count} asked")
    out = []
    for n, text in enumerate(texts[:count]):
        ids = tokenizer.encode(text)
        if len(ids) < seq_len:
            raise ValueError(f"prompt {n + 1} has {len(ids)} tokens, --seq-len {seq_len} asked")
        out.append(ids[-seq_len:])
    return np.asarray(out, np.int32)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m models.cli.kascade_calibrate", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--prompts", type=int, default=16, help="development-set prompts (the paper: 1000 MuSiQue)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per prompt")
    p.add_argument("--k", type=int, default=64, help="top-k of the similarity statistic (the paper: 64)")
    p.add_argument("--tile", type=int, default=32, help="query tile the minimum runs over (the code: 32)")
    p.add_argument("--anchors", type=int, default=5, help="anchor layers, layer 0 included (the paper: 5)")
    p.add_argument("--text-file", default=None, metavar="PATH",
                   help="calibrate on this UTF-8 text (consecutive windows from its start) or, for a .jsonl file, "
                        "these {\"text\": ...} prompts (each cut to its last --seq-len tokens) instead of the "
                        "standard library's docstrings")
    p.add_argument("--root", default=None, help=f"where to save (default {CALIBRATION_ROOT})")
    args = p.parse_args(argv)
    if args.prompts < 1 or args.seq_len <= args.k or args.k < 1 or args.tile < 1 or args.anchors < 1:
        p.error("--prompts, --k, --tile, --anchors must be >= 1 and --seq-len > --k")
    text = None
    if args.text_file is not None:  # read before the model loads: a bad file costs nothing
        try:
            text = read_texts(args.text_file)
        except (OSError, UnicodeDecodeError, ValueError) as e:
            p.error(f"--text-file {args.text_file}: {e}")

    import jax.numpy as jnp

    model = models.load_model(args.model, dtype=jnp.float32)
    if model.tokenizer is None:
        p.error(f"model {args.model!r} has no tokenizer (random weights): calibrate a model with real weights")
    need = args.seq_len * args.prompts
    if text is None:
        ids = model.tokenizer.encode(calibration_text())
        # prompts from the far end of the text: disjoint from the channel calibration's windows
        prompts = calibration_batches(ids[::-1][:need][::-1], args.seq_len, args.prompts)
        source = "docstrings of the standard-library modules of models.cli.calibrate, from the end"
    else:
        try:
            prompts = prompts_from_texts(text.texts, model.tokenizer, args.seq_len, args.prompts, windows=text.windows)
        except ValueError as e:
            p.error(f"--text-file {args.text_file}: {e}")
        source = (f"{os.path.basename(args.text_file)} (sha256 {text.sha256}; "
                  + ("windows from its start)" if text.windows
                     else f"{args.prompts} of its {len(text.texts)} prompts, each its last {args.seq_len} tokens)"))
    out = calibrate(model, prompts, k=args.k, tile=args.tile, num_anchors=args.anchors,
                    log=lambda s: print(s, file=sys.stderr))
    out["meta"] = {
        "model": args.model, "prompts": args.prompts, "seq_len": args.seq_len, "k": args.k, "tile": args.tile,
        "text": source,
        "command": "python -m models.cli.kascade_calibrate " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    path = save_kascade_calibration(args.model, out, args.root)
    print(f"anchors {out['anchors']}; saved to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
