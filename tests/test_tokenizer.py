"""The SmolLM2 tokenizer built from the GGUF: round trips, special tokens, the chat
template, and agreement with Hugging Face's tokenizer (fixture
``tests/fixtures/smollm2_tokenizer.json``, made by scripts/make_hf_fixture.py)."""

import json
import os

import pytest

from models import gguf_loader
from models.tokenizer import Tokenizer, chatml_default_system, render_chatml

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "smollm2_tokenizer.json")


def _read_tokenizer(preset: str) -> Tokenizer:
    """The preset's tokenizer as ``sparse-jax-export-tokenizer`` reads it: the same read_gguf
    cache entry as the export test's (reading Gemma 3's 262k-token vocabulary takes ~8 s on the
    CI machine; a second call with another ``name`` read it again)."""
    from models.cli.export_tokenizer import read_tokenizer

    try:
        return read_tokenizer(preset)
    except gguf_loader.WeightsNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return _read_tokenizer("smollm2-135m")


@pytest.fixture(scope="module")
def hf():
    if not os.path.exists(FIXTURE):
        pytest.skip(f"missing fixture {FIXTURE} (python scripts/make_hf_fixture.py)")
    with open(FIXTURE) as f:
        return json.load(f)


TEXTS = [
    "Hello, world!",
    "Ünïcödé: Straße, naïve, 日本語, 한국어, emoji 🙂🚀👩‍💻 ∑∫√",
    "  leading and trailing spaces   ",
    "tabs\tand\t\ttabs\nnew line\n\n\nblank\r\nCRLF",
    "",
    " ",
    "\n",
    "digits 1234567890 and 3.14159",
]


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(isinstance(i, int) for i in ids)
    assert tok.decode(ids) == text


def test_basics(tok):
    assert tok.vocab_size == 49152
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)
    assert tok.bos_token == "<|im_start|>" and tok.eos_token == "<|im_end|>"
    assert tok.encode("Hello world") == [19556, 905]  # merged BPE tokens, no BOS added
    assert tok.encode("<|im_start|>") == [1]  # special-token text maps to the special id
    assert len(tok.encode("12345")) == 5  # digits split one by one (GGUF pre-tokenizer "smollm")


def test_matches_hf_tokenizer(tok, hf):
    assert tok.bos_token_id == hf["special"]["bos_token_id"]
    assert tok.eos_token_id == hf["special"]["eos_token_id"]
    assert tok.vocab_size == hf["special"]["vocab_size"]
    for s in hf["strings"]:
        assert tok.encode(s["text"]) == s["ids"], s["text"]
        assert tok.decode(s["ids"]) == s["decoded"]


def test_chat_template(tok, hf):
    assert tok.chat_template == hf["chat_template"]
    for name, case in hf["chat"].items():
        rendered = tok.apply_chat_template(case["messages"], add_generation_prompt=case["add_generation_prompt"])
        assert rendered == case["rendered"], name
        assert tok.encode(rendered) == case["ids"], name


def test_chat_template_opens_assistant_turn(tok):
    s = tok.apply_chat_template([{"role": "user", "content": "Hi there"}])
    assert s.endswith("<|im_start|>assistant\n")
    assert s.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    s2 = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert s2 == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ValueError, match="role"):
        tok.apply_chat_template([{"content": "no role"}])


def test_chatml_fallback_matches_jinja(tok):
    """The built-in ChatML renderer (used without jinja2) equals jinja2's rendering."""
    jinja2 = pytest.importorskip("jinja2")
    from models.tokenizer import _render_jinja

    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    want = _render_jinja(tok.chat_template, msgs, True, bos_token="", eos_token="")
    assert render_chatml(msgs, True, chatml_default_system(tok.chat_template)) == want


def test_hf_directory_round_trip(tok, tmp_path):
    tok.save_hf(tmp_path)
    t2 = Tokenizer.from_hf_directory(tmp_path)
    assert (t2.bos_token_id, t2.eos_token_id, t2.pad_token_id) == (1, 2, 2)
    assert t2.chat_template == tok.chat_template
    for text in TEXTS:
        assert t2.encode(text) == tok.encode(text)
    assert Tokenizer.from_hf_directory(tmp_path / "nothing") is None


def _gemma3_tokenizer():
    return _read_tokenizer("gemma3-270m")


@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_incremental_detokenizer_equals_the_whole_decode(which, tok):
    """The windowed detokenizer (a few ids of left context per update, not every id again)
    streams exactly ``decode(ids)``, on byte-level BPE (SmolLM2) and SentencePiece (Gemma 3):
    text with multi-byte characters, split one id at a time and in uneven chunks, and random
    ids (characters cut between tokens); no piece carries a replacement character when the
    whole decode has none."""
    import numpy as np

    from models.detokenize import IncrementalDetokenizer

    t = tok if which == "smollm2" else _gemma3_tokenizer()
    rng = np.random.default_rng(0)
    cases = [t.encode(x) for x in TEXTS if x] + [rng.integers(0, 2000, 300).tolist()]
    for ids in cases:
        for steps in (1, 3):
            d, pieces = IncrementalDetokenizer(t.decode), []
            for i in range(steps, len(ids) + steps, steps):
                pieces.append(d.update(ids[:i]))
            pieces.append(d.update(ids, final=True))
            assert "".join(pieces) == t.decode(ids) == d.text, (which, ids[:20])
            if "\ufffd" not in t.decode(ids):
                assert all("\ufffd" not in p for p in pieces)


def test_text_stream_holds_stop_strings_back():
    """``TextStream``: a stop string is never sent and ends the text before it, text that could
    begin one is held until it cannot, before ``min_tokens`` ids none is looked for, and without
    a stop the deltas and the final flush are the whole text (a character-per-id decode)."""
    from models.detokenize import TextStream, held_for_stop

    decode = lambda ids: "".join(chr(i) for i in ids)  # noqa: E731
    text = "hello wor" + "ld, END here"

    def stream(stops, min_tokens=0):
        t, ids, sent = TextStream(decode, stops, min_tokens), [], []
        for ch in text:
            ids.append(ord(ch))
            delta, stopped = t.push(ids)
            sent.append(delta)
            if stopped:
                return "".join(sent), t.finish(ids), True
        return "".join(sent), t.finish(ids), False

    assert stream(()) == (text, "", False)
    sent, rest, stopped = stream(("END",))
    assert stopped and sent + rest == "hello world, " and "E" not in sent  # "E" was held: it could begin END
    assert stream(("world",)) [2] and "".join(stream(("world",))[:2]) == "hello "
    # a stop string that never completes: its beginning is held, then sent with the rest
    sent, rest, stopped = stream(("here!",))
    assert not stopped and sent + rest == text and rest == "here"
    # min_tokens: before that many ids a stop string is not a stop
    sent, rest, stopped = stream(("wor",), min_tokens=12)
    assert not stopped and sent + rest == text
    assert held_for_stop("abc EN", ("END", "xyz")) == 2 and held_for_stop("abc", ("END",)) == 0


@pytest.mark.parametrize("preset", ["smollm2-135m", "gemma3-270m"])
def test_exported_tokenizer_loads_in_transformers_offline(preset, tmp_path, monkeypatch, capsys):
    """``sparse-jax-export-tokenizer MODEL DIR`` writes a directory that
    ``transformers.AutoTokenizer`` loads with the hub off (what lm-eval and guidellm do with
    ``tokenizer=DIR``): the same ids as the served tokenizer (BOS included where the model
    prepends one), the same chat rendering, and our own loader reads it back."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("jinja2")
    from models.cli.export_tokenizer import main, read_tokenizer

    try:
        ours = read_tokenizer(preset)
    except gguf_loader.WeightsNotFoundError as e:
        pytest.skip(str(e))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "tok"
    assert main([preset, str(out)]) == 0
    with pytest.raises(SystemExit):  # an existing tokenizer is not overwritten without --force
        main([preset, str(out)])
    assert "already holds" in capsys.readouterr().err
    hf = transformers.AutoTokenizer.from_pretrained(str(out))
    back = Tokenizer.from_hf_directory(out)
    for text in TEXTS:
        assert hf.encode(text) == ours.encode(text) == back.encode(text), text
        assert hf.decode(ours.encode(text)) == ours.decode(ours.encode(text))
    if ours.chat_template:
        msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]
        assert hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
            ours.apply_chat_template(msgs)
    assert hf.eos_token == ours.eos_token


def test_export_tokenizer_refuses_what_has_none(tmp_path, capsys):
    from models.cli.export_tokenizer import main

    for model in ("qwen3-8b", str(tmp_path)):
        with pytest.raises(SystemExit):
            main([model, str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert "neither a preset with real weights" in err and "has no tokenizer.json" in err
