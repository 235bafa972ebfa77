"""Tokenizer: a ``tokenizers`` BPE built from a GGUF's vocabulary (GPT-2 byte-level
BPE, or SentencePiece-style BPE with byte fallback for Gemma), or read from /
written to an HF-style directory (``tokenizer.json`` + ``tokenizer_config.json``).

Chat templates: the template string comes with the weights (GGUF
``tokenizer.chat_template``, or ``chat_template`` in ``tokenizer_config.json``).
When ``jinja2`` is importable it renders the template itself (as Hugging Face
does). Otherwise -- the project venv does not ship jinja2 -- a built-in renderer
handles ChatML templates (SmolLM2, Qwen): ``<|im_start|>role\\ncontent<|im_end|>\\n``
per message, the template's default system prompt when the conversation has
none, and ``<|im_start|>assistant\\n`` to open the assistant turn. Any other
template without jinja2 is a clear error.
"""

from __future__ import annotations

import json
import os
import re
from typing import Iterable, Sequence

import tokenizers
from tokenizers import AddedToken, decoders, models as tk_models, normalizers, pre_tokenizers

# GGUF token types (llama.cpp): 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte
_CONTROL, _USER_DEFINED = 3, 4
_SPM_SPACE = "\u2581"  # SentencePiece's "▁", which stands for a space inside tokens

# llama.cpp pre-tokenizer names that split digits one by one before the GPT-2 regex
# (StarCoder-style; SmolLM's own tokenizer.json is Digits(individual) + ByteLevel).
_DIGIT_SPLIT_PRE = {"smollm", "starcoder", "refact", "codeshell", "exaone", "minerva", "command-r"}


class Tokenizer:
    """Text <-> token ids, special tokens, and the chat template.

    Attributes: ``bos_token_id``, ``eos_token_id``, ``pad_token_id`` (may be None),
    ``chat_template`` (a Jinja string or None), ``add_bos`` (prepend BOS in ``encode``).
    """

    def __init__(self, tok: tokenizers.Tokenizer, *, bos_token_id: int | None = None,
                 eos_token_id: int | None = None, pad_token_id: int | None = None,
                 chat_template: str | None = None, add_bos: bool = False):
        self._tok = tok
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.chat_template = chat_template
        self.add_bos = add_bos

    # -- basic ------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def backend(self) -> tokenizers.Tokenizer:
        return self._tok

    def id_to_token(self, i: int | None) -> str | None:
        return None if i is None else self._tok.id_to_token(i)

    @property
    def bos_token(self) -> str | None:
        return self.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return self.id_to_token(self.eos_token_id)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special-token strings in it (``<|im_start|>``) map to their ids."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    # -- chat -------------------------------------------------------------------
    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        """Render ``messages`` ([{"role": ..., "content": ...}, ...]) with the model's
        template; with ``add_generation_prompt`` the result ends with the assistant
        turn opened (``<|im_start|>assistant\\n`` for ChatML)."""
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"each message must be a dict with 'role' and 'content', got {m!r}")
        try:
            import jinja2  # noqa: F401
        except ImportError:
            jinja2 = None
        if jinja2 is not None and self.chat_template:
            return _render_jinja(self.chat_template, messages, add_generation_prompt,
                                 bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        if self.chat_template is None or "<|im_start|>" in self.chat_template:
            return render_chatml(messages, add_generation_prompt,
                                 default_system=chatml_default_system(self.chat_template))
        raise NotImplementedError(
            "this model's chat template is not ChatML and jinja2 is not installed; "
            "install it with `pip install jinja2` to render arbitrary templates")

    # -- construction / persistence --------------------------------------------
    @classmethod
    def from_gguf_vocab(cls, tokens: Sequence[str], merges: Sequence[str], token_types: Sequence[int] | None,
                        *, pre: str | None = None, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                        chat_template=None, add_bos=False) -> "Tokenizer":
        """A GPT-2 byte-level BPE from GGUF ``tokenizer.ggml.*`` arrays."""
        vocab = {t: i for i, t in enumerate(tokens)}
        pairs = [tuple(m.split(" ", 1)) for m in merges]
        tok = tokenizers.Tokenizer(tk_models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if pre in _DIGIT_SPLIT_PRE:
            tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        else:
            tok.pre_tokenizer = byte_level
        tok.decoder = decoders.ByteLevel()
        if token_types is not None:
            special = [AddedToken(tokens[i], special=True, normalized=False)
                       for i, t in enumerate(token_types) if t == _CONTROL]
            user = [AddedToken(tokens[i], special=False, normalized=False)
                    for i, t in enumerate(token_types) if t == _USER_DEFINED]
            if special:
                tok.add_special_tokens(special)
            if user:
                tok.add_tokens(user)
        return cls(tok, bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                   chat_template=chat_template, add_bos=add_bos)

    @classmethod
    def from_gguf_spm(cls, tokens: Sequence[str], token_types: Sequence[int], *, bos_token_id=None,
                      eos_token_id=None, pad_token_id=None, unk_token_id=None, chat_template=None,
                      add_bos=True) -> "Tokenizer":
        """A SentencePiece-style BPE with byte fallback from GGUF arrays (``tokenizer.ggml.model
        == "llama"`` without stored merges: Gemma 3), built as transformers builds it.

        * Spaces are ``▁`` inside the model (normalizer ``" " -> "▁"``, no prefix space);
          the user-defined runs of spaces, stored with real spaces, are respelled.
        * No merges are stored: every split of a token into two vocabulary tokens is a
          merge, ranked by the token's id (file order), then the longer left piece first.
          The scores do not give the order (byte and user tokens score 0 or -1000).
        * Unknown characters fall back to the ``<0xNN>`` byte tokens.
        * Control tokens are special added tokens; the other user-defined tokens (runs of
          newlines and tabs, HTML tags, ``[multimodal]``) are plain added tokens, matched
          before the BPE.
        """
        tokens = [t if not (t and t.strip(" ") == "") else _SPM_SPACE * len(t) for t in tokens]
        vocab = {t: i for i, t in enumerate(tokens)}
        unk = tokens[unk_token_id] if unk_token_id is not None else "<unk>"
        tok = tokenizers.Tokenizer(tk_models.BPE(vocab=vocab, merges=spm_merges(tokens, vocab), byte_fallback=True,
                                                 fuse_unk=True, unk_token=unk))
        tok.normalizer = normalizers.Replace(" ", _SPM_SPACE)
        # a split on " " after the normalizer never fires; kept so the pipeline is the one
        # transformers builds for this vocabulary (Metaspace-free, no prefix space)
        tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
        tok.decoder = decoders.Sequence([decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(),
                                         decoders.Fuse()])
        special = [AddedToken(tokens[i], special=True, normalized=False)
                   for i, t in enumerate(token_types) if t == _CONTROL]
        user = [AddedToken(tokens[i], special=False, normalized=False)
                for i, t in enumerate(token_types) if t == _USER_DEFINED and not tokens[i].startswith(_SPM_SPACE)]
        tok.add_special_tokens(special)
        tok.add_tokens(user)
        return cls(tok, bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                   chat_template=chat_template, add_bos=add_bos)

    def save_hf(self, path: str | os.PathLike) -> None:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` into directory ``path``."""
        os.makedirs(path, exist_ok=True)
        tok = self._tok
        if self.add_bos and self.bos_token_id is not None:
            # this class prepends BOS itself (encode); a Hugging Face loader expects the file's
            # post-processor to, so a copy carries one (Gemma's SentencePiece vocabulary)
            tok = tokenizers.Tokenizer.from_str(self._tok.to_str())
            bos = self.bos_token
            tok.post_processor = tokenizers.processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, self.bos_token_id)])
        tok.save(os.path.join(path, "tokenizer.json"))
        cfg = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "pad_token": self.id_to_token(self.pad_token_id),
            "add_bos_token": self.add_bos,
            "chat_template": self.chat_template,
        }
        with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
            json.dump(cfg, f, indent=2, ensure_ascii=False)

    @classmethod
    def from_hf_directory(cls, path: str | os.PathLike) -> "Tokenizer | None":
        """The tokenizer stored in an HF-style directory, or None if it has none."""
        tj = os.path.join(path, "tokenizer.json")
        if not os.path.exists(tj):
            return None
        tok = tokenizers.Tokenizer.from_file(tj)
        cfg = {}
        tc = os.path.join(path, "tokenizer_config.json")
        if os.path.exists(tc):
            with open(tc) as f:
                cfg = json.load(f)

        def tid(key):
            v = cfg.get(key)
            if isinstance(v, dict):
                v = v.get("content")
            return None if v is None else tok.token_to_id(v)

        return cls(tok, bos_token_id=tid("bos_token"), eos_token_id=tid("eos_token"),
                   pad_token_id=tid("pad_token"), chat_template=cfg.get("chat_template"),
                   add_bos=bool(cfg.get("add_bos_token", False)))


def spm_merges(tokens: Sequence[str], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """BPE merges implied by a vocabulary without stored merges: for each token in id
    order, each split into two vocabulary tokens, the longer left piece first.

    The id order is the merge priority (lower id: merged earlier), the ranking
    transformers gives a SentencePiece BPE vocabulary (scores ``-id``)."""
    merges = []
    for t in tokens:
        for cut in range(len(t) - 1, 0, -1):
            left, right = t[:cut], t[cut:]
            if left in vocab and right in vocab:
                merges.append((left, right))
    return merges


# -----------------------------------------------------------------------------
# Chat template rendering
# -----------------------------------------------------------------------------

_DEFAULT_SYSTEM = re.compile(r"<\|im_start\|>system\n(.*?)<\|im_end\|>", re.S)


def chatml_default_system(template: str | None) -> str | None:
    """The default system prompt a ChatML template inserts when the conversation
    has none (SmolLM2: "You are a helpful AI assistant named SmolLM, ..."), or None."""
    if not template:
        return None
    m = _DEFAULT_SYSTEM.search(template)
    return m.group(1) if m else None


def render_chatml(messages: Sequence[dict], add_generation_prompt: bool = True,
                  default_system: str | None = None) -> str:
    parts = []
    for i, m in enumerate(messages):
        if i == 0 and m["role"] != "system" and default_system is not None:
            parts.append(f"<|im_start|>system\n{default_system}<|im_end|>\n")
        parts.append(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n")
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)


def _render_jinja(template: str, messages, add_generation_prompt: bool, **special) -> str:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(msg):
        raise ValueError(msg)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(messages=list(messages),
                                            add_generation_prompt=add_generation_prompt, **special)
