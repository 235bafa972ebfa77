"""RULER-style synthetic long-context tasks, generated locally and scored by string match.

Seven tasks modelled on RULER (Hsieh et al., 2024), written from the paper's
task descriptions:

=====================  ========================================================
``niah_single_1``      one needle ("One of the special magic numbers for
                       <key> is: <7 digits>.") in repeated noise sentences
                       ("The grass is green. The sky is blue. ...")
``niah_single_2``      the same needle in real text: sentences from the
                       docstrings of a fixed list of Python standard-library
                       modules (on every machine; the list is sorted and the
                       extraction deterministic for a given Python version)
``niah_multikey``      one needle to find among distractor needles with other keys
``niah_multivalue``    one key with several values; all of them must be recalled
``niah_multiquery``    several keys asked at once; all their values must be recalled
``vt``                 variable tracking: ``VAR ABCDE = 12345.`` then
                       ``VAR FGHIJ = ABCDE.`` ... hidden in noise; recall every name
                       that holds the value
``cwe``                common-words extraction: a numbered list of words where
                       10 words appear 30 times and the rest 3 times; name the 10
                       (below 4K tokens the 10 appear ``target // 128`` times,
                       at least 4, and below 1536 tokens the rest once)
``passkey``            passkey retrieval (Mohtashami & Jaggi, 2023): a 5-digit
                       pass key stated once at a random depth of repeated
                       noise sentences; the prompt ends "The pass key is"
=====================  ========================================================

Prompt style: ``chat=True`` (default) wraps the message in the model's chat
template with the answer prefix after the opened assistant turn; ``chat=False``
(base models such as Gemma 3 270M, whose GGUF has no chat template) is the
message, a blank line and the answer prefix, nothing else.

Every sample is deterministic per ``(task, target length, index, seed)`` (its
random choices come from ``random.Random`` seeded with a string) and is built
to a target token length measured with the model's tokenizer: the chat-formatted
prompt (the model's chat template, the answer prefix appended after the opened
assistant turn, as RULER does) is as long as possible while
``len(prompt) + ANSWER_ROOM <= target`` (``ANSWER_ROOM = 64`` >= every task's
``max_new_tokens``, 32-64) -- so a sample of target 8192 plus its answer fits
SmolLM2's 8K context, and samples of different tasks batch together. The filler amount is found by an
interpolation search over the number of filler units (sentences or list
entries), measuring the whole prompt each time, so the prompt lands within one
filler unit (a few tokens) of its budget.

Scoring follows RULER's ``string_match_all``: the fraction of the expected
answer strings found (case-insensitive) in the model's output.

The haystack of the multi-needle NIAH tasks is the noise filler (RULER uses
essays there): a 135M-parameter model scores near zero on the harder variants
in real text, which would leave nothing to compare sparse methods against.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib.util
import random
import re
import string
import sys
from typing import Callable, Protocol, Sequence

__all__ = [
    "ANSWER_ROOM",
    "TASKS",
    "Sample",
    "TokenizerLike",
    "generate_sample",
    "generate_samples",
    "score",
    "stdlib_modules",
    "stdlib_prose_sentences",
    "stdlib_source_text",
    "stdlib_words",
]


class TokenizerLike(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def apply_chat_template(self, messages: Sequence[dict]) -> str: ...


# -----------------------------------------------------------------------------
# Text sources
# -----------------------------------------------------------------------------

#: Standard-library modules whose docstrings / source are used as real text. Sorted;
#: modules missing from an installation are skipped.
STDLIB_MODULES: tuple[str, ...] = tuple(sorted((
    "_pydecimal", "argparse", "ast", "asyncio.events", "asyncio.tasks", "calendar", "cmd",
    "collections", "concurrent.futures._base", "configparser", "contextlib", "copy", "csv",
    "dataclasses", "datetime", "difflib", "doctest", "email.message", "enum", "fractions",
    "ftplib", "functools", "getopt", "gettext", "heapq", "http.client", "http.cookiejar",
    "imaplib", "inspect", "ipaddress", "json", "json.decoder", "locale", "logging",
    "logging.handlers", "mailbox", "optparse", "os", "pathlib", "pdb", "pickle", "pkgutil",
    "platform", "poplib", "pprint", "pydoc", "random", "shlex", "shutil", "smtplib", "socket",
    "statistics", "string", "subprocess", "tarfile", "tempfile", "textwrap", "threading",
    "tokenize", "typing", "unittest.case", "unittest.mock", "urllib.parse", "urllib.request",
    "uuid", "warnings", "zipfile",
)))


@functools.lru_cache(maxsize=None)
def stdlib_modules() -> tuple[tuple[str, str], ...]:
    """``(module name, source file path)`` of the modules of :data:`STDLIB_MODULES` present here."""
    out = []
    for name in STDLIB_MODULES:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        if spec is not None and spec.origin and spec.origin.endswith(".py"):
            out.append((name, spec.origin))
    if not out:
        raise RuntimeError("none of the standard-library modules used as text were found")
    return tuple(out)


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def stdlib_source_text(min_chars: int | None = None) -> str:
    """The sources of :func:`stdlib_modules` concatenated in order (all of them, or
    just enough files to reach ``min_chars``), each preceded by a ``# file:`` line."""
    parts, n = [], 0
    for name, path in stdlib_modules():
        src = f"# file: {name.replace('.', '/')}.py\n" + _read(path)
        parts.append(src)
        n += len(src)
        if min_chars is not None and n >= min_chars:
            break
    return "\n".join(parts)


def _docstrings(tree: ast.AST) -> list[str]:
    """Docstrings of a module, its classes and functions, in source order."""
    out = []

    def visit(node):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc:
                out.append(doc)
            for child in node.body:
                visit(child)

    visit(tree)
    return out


_PROSE_OK = set(string.ascii_letters + " ,.;:'-()")
_SENT_SPLIT = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")


@functools.lru_cache(maxsize=None)
def stdlib_prose_sentences() -> tuple[str, ...]:
    """English sentences from the docstrings of :func:`stdlib_modules` (deduplicated,
    in module order then source order): paragraphs that read as prose (mostly
    letters, no code or doctest lines), split at sentence ends."""
    seen, out = set(), []
    for _, path in stdlib_modules():
        try:
            tree = ast.parse(_read(path))
        except SyntaxError:
            continue
        for doc in _docstrings(tree):
            for para in re.split(r"\n\s*\n", doc):
                lines = para.strip().splitlines()
                if not lines or any(l.lstrip().startswith((">>>", "...", "$", "|", "*", "-", ":", "#")) for l in lines):
                    continue
                text = " ".join(l.strip() for l in lines)
                if len(text) < 40 or not text[0].isupper() or not text.endswith("."):
                    continue
                if sum(c in _PROSE_OK for c in text) < 0.97 * len(text):
                    continue
                for s in _SENT_SPLIT.split(text):
                    s = s.strip()
                    if len(s) >= 20 and s.endswith(".") and s not in seen:
                        seen.add(s)
                        out.append(s)
    return tuple(out)


@functools.lru_cache(maxsize=None)
def stdlib_words() -> tuple[str, ...]:
    """Distinct lowercase words (4-10 letters) of :func:`stdlib_prose_sentences`, sorted."""
    words = set()
    for s in stdlib_prose_sentences():
        for w in re.findall(r"[A-Za-z]+", s):
            if 4 <= len(w) <= 10 and w.islower():
                words.add(w)
    return tuple(sorted(words))


NOISE_SENTENCES = (
    "The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.",
    "There and back again.",
)

# Keys of the needles: "<adjective>-<noun>" (RULER draws random words too).
_ADJECTIVES = (
    "amber", "ancient", "bitter", "bold", "brave", "breezy", "bright", "calm", "clever", "cosmic",
    "crimson", "curious", "dusty", "eager", "electric", "fancy", "fierce", "fluffy", "frozen",
    "gentle", "gigantic", "golden", "grumpy", "hidden", "hollow", "humble", "icy", "jolly",
    "lively", "lonely", "lucky", "marble", "mellow", "misty", "noisy", "odd", "pale", "polite",
    "proud", "quiet", "rapid", "rusty", "silent", "silver", "sleepy", "smooth", "spicy", "steady",
    "sturdy", "tame", "tidy", "velvet", "vivid", "wild", "witty", "wooden", "young", "zesty",
)
_NOUNS = (
    "anchor", "badger", "banjo", "beacon", "bicycle", "biscuit", "canyon", "castle", "cello",
    "comet", "compass", "cricket", "dolphin", "dragon", "falcon", "fern", "galaxy", "garden",
    "giraffe", "glacier", "harbor", "hedgehog", "helmet", "island", "kettle", "lantern",
    "lemon", "meadow", "mirror", "monsoon", "needle", "orchid", "otter", "parrot", "pebble",
    "pepper", "piano", "pillow", "planet", "puzzle", "rabbit", "river", "rocket", "saddle",
    "salmon", "sparrow", "spoon", "squirrel", "teapot", "thunder", "tiger", "trumpet", "tulip",
    "turtle", "violin", "volcano", "walrus", "whistle", "window", "zebra",
)


# -----------------------------------------------------------------------------
# Samples and scoring
# -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Sample:
    """One prompt: ``input_ids`` (``len + ANSWER_ROOM <= target_len``), the strings
    the answer must contain and how many tokens to generate."""

    task: str
    target_len: int
    index: int
    prompt: str
    input_ids: tuple[int, ...]
    answers: tuple[str, ...]
    max_new_tokens: int

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


def score(prediction: str, answers: Sequence[str]) -> float:
    """RULER's ``string_match_all``: fraction of ``answers`` contained in ``prediction``
    (case-insensitive), in [0, 1]."""
    if not answers:
        raise ValueError("a sample needs at least one expected answer")
    pred = prediction.lower()
    return sum(a.lower() in pred for a in answers) / len(answers)


@dataclasses.dataclass(frozen=True)
class _Spec:
    """What a task generator returns: a prompt built from ``n`` filler units."""

    build: Callable[[int], tuple[str, str]]  # n -> (user message, answer prefix)
    answers: tuple[str, ...]
    max_new_tokens: int
    unit_hint: float  # rough tokens per filler unit (the search's first step)


def _key(rng: random.Random, taken: set) -> str:
    while True:
        k = f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}"
        if k not in taken:
            taken.add(k)
            return k


def _number(rng: random.Random, digits: int, taken: set) -> str:
    while True:
        v = str(rng.randint(10 ** (digits - 1), 10**digits - 1))
        if v not in taken:
            taken.add(v)
            return v


def _filler(kind: str, n: int, offset: int) -> list[str]:
    """``n`` filler sentences: the noise cycle, or stdlib prose starting at ``offset``."""
    pool = NOISE_SENTENCES if kind == "noise" else stdlib_prose_sentences()
    if kind == "noise":
        offset = 0
    return [pool[(offset + i) % len(pool)] for i in range(n)]


def _insert(units: list[str], inserts: Sequence[tuple[float, str]]) -> str:
    """Join ``units`` with spaces, placing each ``(depth in [0, 1], text)`` at the unit
    boundary nearest to that depth (order kept for equal depths)."""
    n = len(units)
    at: dict[int, list[str]] = {}
    for depth, text in inserts:
        at.setdefault(int(round(depth * n)), []).append(text)
    out = []
    for i in range(n + 1):
        out.extend(at.get(i, ()))
        if i < n:
            out.append(units[i])
    return " ".join(out)


_NIAH_INTRO = ("Some special magic numbers are hidden within the following text. Make sure to "
               "memorize them. I will quiz you about the numbers afterwards.\n")


def _niah(rng: random.Random, *, haystack: str, num_keys: int, num_values: int, num_queries: int,
          max_new_tokens: int) -> _Spec:
    keys_taken: set = set()
    vals_taken: set = set()
    keys = [_key(rng, keys_taken) for _ in range(num_keys)]
    values = [[_number(rng, 7, vals_taken) for _ in range(num_values)] for _ in keys]
    needles = [(k, v) for k, vs in zip(keys, values) for v in vs]
    rng.shuffle(needles)
    depths = sorted(rng.random() for _ in needles)
    inserts = [(d, f"One of the special magic numbers for {k} is: {v}.") for d, (k, v) in zip(depths, needles)]
    query_keys = keys[:num_queries]  # keys[num_queries:] are distractors
    answers = tuple(v for k, vs in zip(keys, values) if k in query_keys for v in vs)
    if len(query_keys) == 1:
        query = query_keys[0]
    else:
        query = ", ".join(query_keys[:-1]) + ", and " + query_keys[-1]
    many = len(answers) > 1
    offset = rng.randrange(len(stdlib_prose_sentences())) if haystack == "text" else 0

    def build(n):
        context = _insert(_filler(haystack, n, offset), inserts)
        if many:
            q = f"What are all the special magic numbers for {query} mentioned in the provided text?"
            prefix = f"The special magic numbers for {query} mentioned in the provided text are"
        else:
            q = f"What is the special magic number for {query} mentioned in the provided text?"
            prefix = f"The special magic number for {query} mentioned in the provided text is"
        return _NIAH_INTRO + context + "\n" + q, prefix

    return _Spec(build, answers, max_new_tokens, unit_hint=6.0 if haystack == "noise" else 25.0)


def _vt(rng: random.Random, *, num_hops: int = 4, max_new_tokens: int = 32) -> _Spec:
    names: list[str] = []
    while len(names) < num_hops + 1:
        nm = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
        if nm not in names:
            names.append(nm)
    value = str(rng.randint(10000, 99999))
    chain = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i]} = {names[i - 1]}." for i in range(1, len(names))]
    depths = sorted(rng.random() for _ in chain)
    inserts = list(zip(depths, chain))

    def build(n):
        context = _insert(_filler("noise", n, 0), inserts)
        msg = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
               + context + "\nQuestion: Find all variables that are assigned the value "
               + value + " in the text above.")
        prefix = (f"Answer: According to the chain(s) of variable assignment in the text above, "
                  f"{len(names)} variables are assigned the value {value}, they are:")
        return msg, prefix

    return _Spec(build, tuple(names), max_new_tokens, unit_hint=6.0)


def _passkey(rng: random.Random, *, max_new_tokens: int = 16) -> _Spec:
    key = str(rng.randint(10000, 99999))
    depth = rng.random()
    needle = f"The pass key is {key}. Remember it. {key} is the pass key."

    def build(n):
        context = _insert(_filler("noise", n, 0), [(depth, needle)])
        msg = ("There is an important piece of information hidden inside a lot of irrelevant text. "
               "Find it and memorize it. I will quiz you about it.\n\n" + context
               + "\n\nWhat is the pass key?")
        return msg, "The pass key is"

    return _Spec(build, (key,), max_new_tokens, unit_hint=6.0)


def _cwe(rng: random.Random, *, num_common: int = 10, freq_common: int = 30, freq_rare: int = 3,
         max_new_tokens: int = 64) -> _Spec:
    pool = list(stdlib_words())
    rng.shuffle(pool)
    common, rare_pool = pool[:num_common], pool[num_common:]
    order_seed = rng.random()

    def build(n):
        if n > len(rare_pool):
            raise ValueError(f"cwe needs {n} distinct rare words, the word pool has {len(rare_pool)}")
        words = common * freq_common + rare_pool[:n] * freq_rare
        random.Random(order_seed).shuffle(words)
        context = "\n".join(f"{i + 1}. {w}" for i, w in enumerate(words))
        msg = ("Below is a numbered list of words. In these words, some appear more often than others. "
               "Memorize the ones that appear most often.\n" + context
               + f"\nQuestion: What are the {num_common} most common words in the above list?")
        prefix = f"Answer: The top {num_common} words that appear most often in the list are:"
        return msg, prefix

    return _Spec(build, tuple(common), max_new_tokens, unit_hint=4.0 * freq_rare)


_GENERATORS: dict[str, Callable[[random.Random, int], _Spec]] = {
    "niah_single_1": lambda r, n: _niah(r, haystack="noise", num_keys=1, num_values=1, num_queries=1,
                                        max_new_tokens=32),
    "niah_single_2": lambda r, n: _niah(r, haystack="text", num_keys=1, num_values=1, num_queries=1,
                                        max_new_tokens=32),
    "niah_multikey": lambda r, n: _niah(r, haystack="noise", num_keys=4, num_values=1, num_queries=1,
                                        max_new_tokens=32),
    "niah_multivalue": lambda r, n: _niah(r, haystack="noise", num_keys=1, num_values=4, num_queries=1,
                                          max_new_tokens=48),
    "niah_multiquery": lambda r, n: _niah(r, haystack="noise", num_keys=4, num_values=1, num_queries=4,
                                          max_new_tokens=48),
    "vt": lambda r, n: _vt(r),
    # RULER's 10 words x 30 against 3 each; fewer repeats below 4K so short contexts fit
    "cwe": lambda r, n: _cwe(r, freq_common=min(30, max(4, n // 128)), freq_rare=3 if n >= 1536 else 1),
    "passkey": lambda r, n: _passkey(r),
}

#: Tokens every sample leaves free after its prompt (>= every task's max_new_tokens), so
#: a batch mixing tasks can decode the longest answer without overflowing the context.
ANSWER_ROOM = 64

#: Task names, in report order.
TASKS: tuple[str, ...] = tuple(_GENERATORS)


def _fit(measure: Callable[[int], int], budget: int, hint: float) -> int:
    """Largest ``n >= 0`` with ``measure(n) <= budget`` (``measure`` non-decreasing).

    Interpolation search on a bracket, falling back to bisection when the
    interpolation does not shrink it; typically 3-6 measurements.
    """
    lo, l_lo = 0, measure(0)
    if l_lo > budget:
        raise ValueError(f"the task's prompt without filler is {l_lo} tokens, over its budget of {budget}")
    hi, l_hi = None, None
    guess = lo + max(1, int((budget - l_lo) / max(hint, 1e-3)))
    while hi is None:  # find an n over the budget
        l_g = measure(guess)
        if l_g > budget:
            hi, l_hi = guess, l_g
        else:
            slope = (l_g - l_lo) / max(guess - lo, 1)
            lo, l_lo = guess, l_g
            guess = lo + max(1, int(1.05 * (budget - l_lo) / max(slope, 1e-3)) + 1)
    shrink_ok = True
    while hi - lo > 1:
        if shrink_ok:
            g = lo + int((budget - l_lo) * (hi - lo) / max(l_hi - l_lo, 1))
        else:
            g = (lo + hi) // 2
        g = min(max(g, lo + 1), hi - 1)
        width = hi - lo
        l_g = measure(g)
        if l_g <= budget:
            lo, l_lo = g, l_g
        else:
            hi, l_hi = g, l_g
        shrink_ok = (hi - lo) <= width // 2 or not shrink_ok
    return lo


def _chat_prompt(tokenizer: TokenizerLike, message: str, prefix: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": message}]) + prefix


def _base_prompt(message: str, prefix: str) -> str:
    """A base model's prompt: the message, a blank line, the answer prefix (no template)."""
    return message + "\n\n" + prefix


def generate_sample(task: str, target_len: int, index: int, tokenizer: TokenizerLike, *, seed: int = 0,
                    chat: bool = True) -> Sample:
    """Sample ``index`` of ``task`` at ``target_len`` tokens (prompt + answer room);
    ``chat=False``: a base-model prompt (no chat template)."""
    if task not in _GENERATORS:
        raise ValueError(f"unknown task {task!r}; available: {', '.join(TASKS)}")
    if target_len <= 0 or index < 0:
        raise ValueError(f"target_len must be positive and index non-negative, got {target_len}, {index}")
    rng = random.Random(f"sparse-jax-ruler:{seed}:{task}:{target_len}:{index}")
    spec = _GENERATORS[task](rng, target_len)
    budget = target_len - ANSWER_ROOM

    cache: dict[int, tuple[str, list[int]]] = {}

    def measure(n: int) -> int:
        if n not in cache:
            prompt = _chat_prompt(tokenizer, *spec.build(n)) if chat else _base_prompt(*spec.build(n))
            cache[n] = (prompt, tokenizer.encode(prompt))
        return len(cache[n][1])

    try:
        n = _fit(measure, budget, spec.unit_hint)
    except ValueError as e:
        raise ValueError(f"{task} at {target_len} tokens: {e}") from None
    measure(n)
    prompt, ids = cache[n]
    return Sample(task=task, target_len=target_len, index=index, prompt=prompt, input_ids=tuple(ids),
                  answers=spec.answers, max_new_tokens=spec.max_new_tokens)


def generate_samples(tasks: Sequence[str], target_len: int, num_samples: int, tokenizer: TokenizerLike,
                     *, seed: int = 0, progress: bool = False, chat: bool = True,
                     indices: Sequence[int] | None = None) -> list[Sample]:
    """``num_samples`` samples of each task at ``target_len``, task-major; ``indices``: those
    samples of each task instead (e.g. the prompts a method lost in a larger run)."""
    jobs = [(t, i) for t in tasks for i in (range(num_samples) if indices is None else indices)]
    if progress:
        from tqdm.auto import tqdm

        jobs = tqdm(jobs, desc=f"tasks@{target_len}", leave=False, file=sys.stderr)
    return [generate_sample(t, target_len, i, tokenizer, seed=seed, chat=chat) for t, i in jobs]
