"""The built-in long prompt of ``python -m models.generate --demo``.

A needle-in-a-haystack question: about 3,300 tokens (SmolLM2 tokenizer) of
varied, plain English filler paragraphs about an invented coastal town,
assembled from word lists by a small fixed-seed generator (SplitMix64,
implemented here so the text is identical on every machine and Python
version), with one fact hidden once, in the middle of the text:

    The secret passphrase is <word>-<number>.

followed by a question asking for it. :func:`check_answer` says whether a
model's answer contains the passphrase (the word and the number, case and
separators ignored).

Calibration (SmolLM2-135M-Instruct, float32, dense, greedy; checked with both
this project's model and Hugging Face transformers): with ``Tangerine-4819``
the model answers correctly with the fact at 40%, 45%, 50%, 55% and 60% of
the text, for other filler seeds and for a shorter question. A first choice,
``marigold-7342``, failed (answers "mrs.m", "marble-7342"), so the 135M model
is near its limit here; sparse methods at small budgets may fail the demo
(Quest at budget 1024 did, at 2048 it passed; oracle top-k and ArkVale at
1024 passed; StreamingLLM cannot see the middle of the text by design).
"""

from __future__ import annotations

import dataclasses
import re

__all__ = ["DemoPrompt", "build_demo_prompt", "check_answer", "PASSPHRASE"]

PASSPHRASE = "Tangerine-4819"
FACT_TEMPLATE = "The secret passphrase is {passphrase}."
INTRO = "Read the following notes about a small coastal town."
QUESTION = (
    "Somewhere in the text above, a secret passphrase is mentioned. "
    "What is the secret passphrase? Reply with the passphrase only."
)
SEED = 20240611


class _SplitMix64:
    """Tiny deterministic PRNG (SplitMix64): same stream on every platform."""

    def __init__(self, seed: int):
        self.state = seed & 0xFFFFFFFFFFFFFFFF

    def next(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        return z ^ (z >> 31)

    def below(self, n: int) -> int:
        return self.next() % n

    def choice(self, seq):
        return seq[self.below(len(seq))]


_PEOPLE = [
    "the baker", "the harbour master", "an old fisherman", "the schoolteacher", "the mayor",
    "a travelling musician", "the librarian", "the ferry captain", "a young carpenter",
    "the postwoman", "the innkeeper", "a retired sailor", "the blacksmith's daughter",
    "the town clerk", "a visiting painter", "the lighthouse keeper", "the miller",
    "a pair of students", "the doctor", "the choir director",
]
_PLACES = [
    "the market square", "the north pier", "the chapel on the hill", "the reading room",
    "the old customs house", "the orchard behind the school", "the stone bridge",
    "the ropewalk", "the salt marsh", "the bakery on Gull Street", "the harbour wall",
    "the village green", "the boatyard", "the town hall", "the weaving shed",
    "the lane by the mill", "the quiet cove", "the fish market", "the watchtower",
]
_ACTIONS = [
    "repaired the nets", "counted the barrels", "painted the shutters blue",
    "sang an old song about the tides", "swept the cobblestones", "mended a broken chair",
    "read the weather report aloud", "planted rows of beans", "sorted the morning letters",
    "argued about the price of herring", "tuned a battered fiddle", "baked bread for the festival",
    "carried lanterns down the steps", "wrote a long letter to a cousin", "fed the harbour cats",
    "tarred the hull of a rowing boat", "polished the brass bell", "stacked firewood for winter",
    "measured the depth of the channel", "hung the washing in the wind",
]
_TIMES = [
    "early in the morning", "just after noon", "before the storm arrived", "on market day",
    "in the long summer evenings", "during the autumn fair", "when the fog rolled in",
    "at low tide", "on the first day of spring", "late at night", "every Sunday",
    "after the boats came home", "while the bells were ringing", "in the middle of winter",
]
_WEATHER = [
    "A cold wind blew in from the sea", "The sky was pale and clear",
    "Rain drummed on the slate roofs", "A thin mist hung over the water",
    "The sun warmed the harbour stones", "Grey clouds gathered over the headland",
    "The air smelled of salt and seaweed", "Snow dusted the tops of the hills",
]
_DETAILS = [
    "Nobody could remember when the custom had started.",
    "Children ran along the sea wall, shouting at the gulls.",
    "The smell of smoked fish drifted through the narrow streets.",
    "A dog slept in the doorway, untroubled by the noise.",
    "Someone had left a basket of apples on the steps.",
    "The church clock was, as usual, four minutes slow.",
    "Most of the shops closed early that day.",
    "The tide tables were pinned to every tavern door.",
    "A cart loaded with timber rattled over the bridge.",
    "Two ships waited outside the harbour for the wind to change.",
    "The old men on the bench disagreed about everything.",
    "Lamps were lit one by one along the quay.",
    "The gulls were louder than anyone could recall.",
    "It was, people agreed later, an ordinary sort of day.",
]
_TOPICS = [
    "the harbour", "the annual fair", "the fishing fleet", "the school", "the old mill",
    "the winter storms", "the lighthouse", "the market", "the choir", "the boatyard",
]
_OPENERS = [
    "People in the town still talk about {topic}.",
    "The records of the town say a great deal about {topic}.",
    "Visitors often ask about {topic}.",
    "There are many stories about {topic}.",
    "Every family in the town has an opinion about {topic}.",
]


def _sentence(rng: _SplitMix64) -> str:
    kind = rng.below(5)
    if kind == 0:
        return f"{rng.choice(_WEATHER)} {rng.choice(_TIMES)}."
    if kind == 1:
        return rng.choice(_DETAILS)
    who = rng.choice(_PEOPLE)
    s = f"{who[0].upper()}{who[1:]} {rng.choice(_ACTIONS)} near {rng.choice(_PLACES)} {rng.choice(_TIMES)}"
    if kind == 2:
        other = rng.choice(_PEOPLE)
        s += f", while {other} {rng.choice(_ACTIONS)}"
    return s + "."


def _paragraph(rng: _SplitMix64, n_sentences: int) -> str:
    opener = rng.choice(_OPENERS).format(topic=rng.choice(_TOPICS))
    return " ".join([opener] + [_sentence(rng) for _ in range(n_sentences)])


@dataclasses.dataclass(frozen=True)
class DemoPrompt:
    text: str            # the whole user message: filler with the fact, then the question
    passphrase: str      # what the answer must contain
    fact: str            # the sentence hidden in the filler
    fact_char_offset: int  # where the fact starts in ``text``

    @property
    def messages(self) -> list[dict[str, str]]:
        return [{"role": "user", "content": self.text}]


def build_demo_prompt(n_paragraphs: int = 29, sentences: int = 6, fact_at: float = 0.5,
                      seed: int = SEED, passphrase: str = PASSPHRASE, fact: str = FACT_TEMPLATE,
                      question: str = QUESTION, intro: str = INTRO) -> DemoPrompt:
    """The demo's user message (deterministic).

    ``n_paragraphs`` filler paragraphs of ``1 + sentences`` sentences; the fact
    is inserted once, as a sentence of the paragraph at relative position
    ``fact_at`` (0.5: the middle of the text).
    """
    rng = _SplitMix64(seed)
    fact_s = fact.format(passphrase=passphrase)
    paras = [_paragraph(rng, sentences) for _ in range(n_paragraphs)]
    i = min(n_paragraphs - 1, max(0, int(round(fact_at * n_paragraphs))))
    parts = paras[i].split(". ")
    mid = len(parts) // 2
    paras[i] = ". ".join(parts[:mid]) + ". " + fact_s + " " + ". ".join(parts[mid:])
    body = "\n\n".join(paras)
    text = intro + "\n\n" + body + "\n\n" + question
    assert text.count(passphrase) == 1
    return DemoPrompt(text=text, passphrase=passphrase, fact=fact_s, fact_char_offset=text.index(fact_s))


def check_answer(answer: str, passphrase: str = PASSPHRASE) -> bool:
    """True when ``answer`` contains the passphrase's word and number (case, separators ignored)."""
    norm = re.sub(r"[^a-z0-9]+", "", answer.lower())
    return re.sub(r"[^a-z0-9]+", "", passphrase.lower()) in norm
