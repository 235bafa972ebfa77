"""``sparse-jax-export-tokenizer MODEL DIR``: write the tokenizer a model is served with as a
Hugging Face tokenizer directory (``tokenizer.json``, and ``tokenizer_config.json`` with the
chat template and the special tokens) that ``transformers.AutoTokenizer``, lm-eval and
guidellm load offline, without the hub::

    sparse-jax-export-tokenizer smollm2-135m ./smollm2-tokenizer
    lm_eval --model local-completions --tasks lambada_openai \\
        --model_args model=smollm2-135m,base_url=http://127.0.0.1:8000/v1/completions,tokenizer=./smollm2-tokenizer,tokenized_requests=True

``MODEL``: a preset with real weights (``smollm2-135m``, ``gemma3-270m``), a ``.gguf`` file,
or an HF-style or checkpoint directory holding a tokenizer. Only the tokenizer is read; no
weights are loaded.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from models import gguf_loader
from models.config import REAL_WEIGHTS
from models.tokenizer import Tokenizer


def read_tokenizer(model: str) -> Tokenizer:
    """The tokenizer of ``model`` (module docstring); ValueError naming what was looked for."""
    if model in REAL_WEIGHTS:
        return gguf_loader.read_gguf(gguf_loader.weights_path(model), name=model, tensors=False).tokenizer
    if os.path.isfile(model):
        if not model.endswith(".gguf"):
            raise ValueError(f"{model} is a file but not a .gguf")
        return gguf_loader.read_gguf(model, tensors=False).tokenizer
    if os.path.isdir(model):
        tok = Tokenizer.from_hf_directory(model)
        if tok is None:
            raise ValueError(f"{model} has no tokenizer.json")
        return tok
    raise ValueError(f"{model!r} is neither a preset with real weights ({', '.join(sorted(REAL_WEIGHTS))}), "
                     "a .gguf file nor a directory")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="sparse-jax-export-tokenizer", description=__doc__.split("\n\n")[0])
    p.add_argument("model", metavar="MODEL", help="preset, .gguf file or tokenizer directory")
    p.add_argument("out", metavar="DIR", help="the directory to write (created)")
    p.add_argument("--force", action="store_true", help="overwrite a DIR that already holds a tokenizer")
    a = p.parse_args(argv)
    if os.path.exists(os.path.join(a.out, "tokenizer.json")) and not a.force:
        p.error(f"{a.out} already holds a tokenizer.json (--force overwrites it)")
    try:
        tok = read_tokenizer(a.model)
    except (ValueError, FileNotFoundError, gguf_loader.WeightsNotFoundError) as e:
        p.error(str(e))
    tok.save_hf(a.out)
    print(f"wrote {os.path.join(a.out, 'tokenizer.json')} and tokenizer_config.json "
          f"({tok.vocab_size} tokens{', chat template' if tok.chat_template else ''})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
