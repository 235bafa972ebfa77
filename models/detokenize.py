"""The one incremental detokenizer: the new text of a growing list of token ids.

Used by ``Model.generate``, the generate CLI and the serving engine. Decoding every id
again at each token costs O(n) per token (O(n^2) per request: a 1,024-token answer decodes
half a million ids); so, as vLLM does, each update decodes only a short window: the ids
from ``prefix`` (a few tokens of left context, so a tokenizer that merges pieces or drops
a leading space at the start of a decode sees the same context as the whole decode) to
the end, and returns what that window's text adds to the text of the window's first part
(``prefix:read``). Text that ends in an incomplete UTF-8 sequence (U+FFFD) is held back
until its next bytes arrive, or until the final update.
"""

from __future__ import annotations

import os
from typing import Callable, Sequence

#: what a tokenizer's decode gives for the bytes of an incomplete UTF-8 sequence
REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """``update(ids) -> str``: the text added since the last update; ``ids`` is the whole
    list so far, growing by any number of ids per update (``decode(ids)`` is the text of
    ``ids``). The concatenated updates equal ``decode(ids)`` for tokenizers whose decode
    is a concatenation of pieces (byte-level BPE, SentencePiece); ``text`` holds them.

    Args:
      decode: ``list[int] -> str``.
      context: ids of left context each update decodes before the new ones (vLLM uses 5).
    """

    def __init__(self, decode: Callable[[list[int]], str], context: int = 5):
        self.decode = decode
        self.context = context
        self.prefix = 0  # the window's first id
        self.read = 0    # ids before this one have been returned as text
        self.text = ""   # everything returned so far

    def update(self, ids: Sequence[int], final: bool = False) -> str:
        ids = list(ids)
        if len(ids) <= self.read:
            return ""
        before = self.decode(ids[self.prefix:self.read])
        window = self.decode(ids[self.prefix:])
        if not final and (window.endswith(REPLACEMENT) or len(window) <= len(before)):
            return ""  # an incomplete character (or nothing visible yet): wait for the next ids
        new = window[len(os.path.commonprefix([window, before])):]  # `before` itself, unless a merge changed it
        # the next window starts `context` ids back, so its decode has left context
        self.read = len(ids)
        self.prefix = max(0, self.read - self.context)
        self.text += new
        return new



def held_for_stop(text: str, stops: Sequence[str]) -> int:
    """Characters at the end of ``text`` that could begin a stop string (held back)."""
    held = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), held, -1):
            if text.endswith(s[:k]):
                held = k
                break
    return held


class TextStream:
    """The text one request streams: its ids detokenized incrementally, with stop strings
    (OpenAI's ``stop``) looked for and never sent. Text that could begin a stop string is held
    back until it cannot; once ``min_tokens`` ids exist a stop string ends the text before it
    (vLLM's rules). ``push(ids) -> (delta, stopped)`` after each new id; ``finish(ids)`` the
    text still held at the end (what preceded a stop string, or, ended otherwise, the held
    text and an incomplete character's bytes)."""

    def __init__(self, decode: Callable[[list[int]], str], stops: Sequence[str] = (), min_tokens: int = 0):
        self.detok = IncrementalDetokenizer(decode)
        self.stops = tuple(stops)
        self.min_tokens = min_tokens
        self.held = ""        # decoded, not yet sent: a possible stop string's beginning
        self.stopped = False  # a stop string was found: nothing more is decoded

    def push(self, ids: Sequence[int]) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        # after what was held, the new text (held back by the detokenizer while it ends in an
        # incomplete UTF-8 sequence); a stop string can only begin in the held text, since any
        # text that could begin one is held
        pending = self.held + self.detok.update(ids)
        hit = -1 if len(ids) < self.min_tokens else \
            min((i for i in (pending.find(x) for x in self.stops) if i >= 0), default=-1)
        if hit >= 0:  # the text ends before it (nothing after it is sent)
            self.held, self.stopped = pending[:hit], True
            return "", True
        keep = held_for_stop(pending, self.stops)
        delta, self.held = pending[:len(pending) - keep], pending[len(pending) - keep:]
        return delta, False

    def finish(self, ids: Sequence[int]) -> str:
        rest = self.held + ("" if self.stopped else self.detok.update(ids, final=True))
        self.held = ""
        return rest
