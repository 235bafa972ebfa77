"""The one incremental detokenizer: the new text of a growing list of token ids.

Each update decodes every id again (a tokenizer's pieces may merge across tokens, and
a multi-byte character may be split between them) and returns the suffix not yet
returned; text that ends in an incomplete UTF-8 sequence (U+FFFD) is held back until
its next bytes arrive, or until the final update.
"""

from __future__ import annotations

import os
from typing import Callable

#: what a tokenizer's decode gives for the bytes of an incomplete UTF-8 sequence
REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """``update(ids) -> str``: the text added since the last update (``decode(ids)`` is
    the whole text of ``ids``). If decoding changed text already returned (rare), it
    returns what follows the common prefix."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.sent = ""

    def update(self, ids: list[int], final: bool = False) -> str:
        text = self.decode(ids)
        if not final and text.endswith(REPLACEMENT):
            return ""
        if text.startswith(self.sent):
            new = text[len(self.sent):]
        else:
            new = text[len(os.path.commonprefix([text, self.sent])):]
        self.sent = text
        return new
