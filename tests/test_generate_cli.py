"""The generation CLI (models/cli/generate.py) and the demo prompt (models/cli/demo_prompt.py).

Argument errors must be reported before any weights load or anything compiles:
those tests replace ``models.load_model`` (and the compiled functions) with
functions that fail the test if called. One real generation of 4 tokens runs
SmolLM2-135M through ``main([...])`` and checks its tokens against the
Hugging Face fixture (tests/fixtures/smollm2_parity.npz).
"""

from __future__ import annotations

import hashlib
import io
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from models.cli import demo_prompt
from models.cli import generate as gen
from models.detokenize import IncrementalDetokenizer
from models.sampling import sample_next
from sparse_jax.methods import available_methods
from tests.cli_runs import run_generate

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture
def no_model_load(monkeypatch):
    """Any weight load or prefill compile fails the test."""

    def boom(*a, **k):
        raise AssertionError("the model was loaded although the arguments are invalid")

    monkeypatch.setattr(models, "load_model", boom)
    return boom


@pytest.fixture(scope="module")
def tok_cfg():
    try:
        return gen.load_config_and_tokenizer("smollm2-135m")
    except gen.CLIError as e:  # weights package missing
        pytest.skip(str(e))


def _exit_message(capsys, argv) -> str:
    with pytest.raises(SystemExit) as ei:
        gen.main(argv)
    assert ei.value.code == 2
    return capsys.readouterr().err


# -- argument errors (before any load / compilation) --------------------------------


def test_unknown_method_lists_valid_names(capsys, no_model_load):
    err = _exit_message(capsys, ["--attention", "no-such-method", "--prompt", "hi"])
    assert "no-such-method" in err
    for name in available_methods():
        assert name in err


def test_help_lists_methods_and_models(capsys):
    with pytest.raises(SystemExit) as ei:
        gen.main(["--help"])
    assert ei.value.code == 0
    out = capsys.readouterr().out
    for name in available_methods() + models.available_models():
        assert name in out


def test_unknown_model_lists_valid_names(capsys, no_model_load):
    err = _exit_message(capsys, ["--model", "gpt-17", "--prompt", "hi"])
    assert "gpt-17" in err and "smollm2-135m" in err


def test_conflicting_prompt_options(capsys, no_model_load, tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("hello")
    err = _exit_message(capsys, ["--prompt", "hi", "--prompt-file", str(f)])
    assert "only one of" in err and "--prompt" in err and "--prompt-file" in err
    err = _exit_message(capsys, ["--demo", "--prompt", "hi"])
    assert "--demo" in err
    err = _exit_message(capsys, ["positional", "--prompt", "hi"])
    assert "only one of" in err


def test_no_prompt(capsys, no_model_load):
    assert "no prompt" in _exit_message(capsys, [])


def test_missing_prompt_file(capsys, no_model_load, tmp_path):
    err = _exit_message(capsys, ["--prompt-file", str(tmp_path / "missing.txt")])
    assert "missing.txt" in err and "does not exist" in err


@pytest.mark.parametrize("argv, needle", [
    (["--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--prompt", "hi", "--max-new-tokens", "-3"], "--max-new-tokens must be >= 1"),
    (["--prompt", "hi", "--top-p", "0"], "--top-p"),
    (["--prompt", "hi", "--temperature", "-1"], "--temperature"),
    (["--prompt", "hi", "--attention-opt", "nonsense"], "KEY=VALUE"),
    (["--prompt", "hi", "--attention-opt", "no_such_field=3"], "no_such_field"),
    (["--prompt", "hi", "--model", "qwen3-8b"], "no tokenizer"),
])
def test_bad_values(capsys, no_model_load, argv, needle):
    assert needle in _exit_message(capsys, argv)


def test_prompt_longer_than_context(capsys, no_model_load, tok_cfg):
    cfg, tok = tok_cfg
    text = "word " * (cfg.max_position + 100)
    n = len(tok.encode(text))
    err = _exit_message(capsys, ["--prompt", text])
    assert str(n) in err and str(cfg.max_position) in err and "longer than the context" in err


def test_prompt_plus_new_tokens_beyond_context(capsys, no_model_load, tok_cfg):
    cfg, tok = tok_cfg
    text = "word " * (cfg.max_position - 50)
    n = len(tok.encode(text))
    assert n <= cfg.max_position
    err = _exit_message(capsys, ["--prompt", text, "--max-new-tokens", "200"])
    assert str(n) in err and "200" in err and str(cfg.max_position) in err
    assert f"at most {cfg.max_position - n}" in err


def test_prepare_prompt_buckets(tok_cfg):
    cfg, tok = tok_cfg
    args = gen.build_parser().parse_args(["--prompt", "hello " * 300, "--max-new-tokens", "10"])
    spec = gen.resolve_args(args)
    prep = gen.prepare_prompt(spec, cfg, tok)
    n = len(prep.ids)
    assert prep.bucket % gen.BUCKET == 0 and n <= prep.bucket <= prep.cache_len
    assert prep.cache_len >= n + 10 and prep.cache_len % gen.BUCKET == 0


def test_resolve_args_defaults_and_demo(no_model_load):
    p = gen.build_parser()
    spec = gen.resolve_args(p.parse_args(["hello"]))
    assert spec.model == "smollm2-135m" and spec.attention == "dense" and spec.temperature == 0.0
    assert spec.max_new_tokens == gen.DEFAULT_MAX_NEW_TOKENS and spec.prompt == "hello" and not spec.chat
    assert spec.dtype == ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    spec = gen.resolve_args(p.parse_args(["--demo"]))
    assert spec.chat and spec.max_new_tokens == gen.DEMO_MAX_NEW_TOKENS and spec.demo is not None
    assert spec.prompt == spec.demo.text


def test_prompt_file_is_read(tmp_path, no_model_load):
    f = tmp_path / "p.txt"
    f.write_text("Grüße aus Köln\n", encoding="utf-8")
    spec = gen.resolve_args(gen.build_parser().parse_args(["--prompt-file", str(f), "--chat"]))
    assert spec.prompt == "Grüße aus Köln\n" and spec.chat


# -- pieces -------------------------------------------------------------------------


@pytest.mark.parametrize("s, want", [
    ("512", 512), ("-3", -3), ("0.25", 0.25), ("1e-3", 1e-3), ("true", True), ("False", False),
    ("none", None), ("0,1", (0, 1)), ("(0, -1)", (0, -1)), ("[2,3]", (2, 3)), ("()", ()),
    ("1,", (1,)), ("cudnn", "cudnn"), ("a,b", ("a", "b")),
])
def test_parse_option_value(s, want):
    got = gen.parse_option_value(s)
    assert got == want and type(got) is type(want)


def test_parse_attention_opts():
    assert gen.parse_attention_opts(["budget=512", "dense_layers=0,1"]) == {"budget": 512, "dense_layers": (0, 1)}
    with pytest.raises(gen.CLIError, match="twice"):
        gen.parse_attention_opts(["a=1", "a=2"])
    with pytest.raises(gen.CLIError, match="KEY=VALUE"):
        gen.parse_attention_opts(["=1"])


def test_attention_opt_reaches_the_method(no_model_load):
    spec = gen.resolve_args(gen.build_parser().parse_args(
        ["--prompt", "x", "--attention", "dense", "--attention-opt", "dense_layers=0,-1"]))
    assert spec.method.dense_layers == (0, -1)


def test_prefill_flags_reach_the_method(no_model_load):
    """``--prefill tsa --prefill-opt KEY=VALUE`` is Token Sparse Attention's prefill with those
    options on any method; the long form (``--attention-opt prefill=...``) still works, and
    mixing the two, options without ``tsa``, or a bad option is refused before any load."""
    def spec(*flags):
        return gen.resolve_args(gen.build_parser().parse_args(["--prompt", "x", *flags]))

    m = spec("--attention", "quest", "--prefill", "tsa", "--prefill-opt", "tau=0.01",
             "--prefill-opt", "min_tokens=8192").method
    assert (m.prefill, m.prefill_options) == ("token_sparse", (("tau", 0.01), ("min_tokens", 8192)))
    assert m.sparse_prefill().tau == 0.01 and m.sparse_prefill().min_tokens == 8192
    assert spec("--attention-opt", "prefill=token_sparse").method.prefill == "token_sparse"
    assert spec().method.prefill == "dense"
    for flags, needle in [(("--prefill-opt", "tau=0.01"), "given without it"),
                          (("--prefill", "tsa", "--attention-opt", "prefill=dense"), "both set the prefill"),
                          (("--prefill", "tsa", "--prefill-opt", "nope=1"), "bad token_sparse option"),
                          (("--prefill", "tsa", "--prefill-opt", "tau"), "--prefill-opt expects KEY=VALUE")]:
        with pytest.raises(gen.CLIError, match=needle):
            spec(*flags)


def test_text_stream_holds_back_partial_utf8():
    text = "naïve 日本 🙂 ok"
    data = list(text.encode("utf-8"))  # one "token" per byte

    def decode(ids):
        return bytes(ids).decode("utf-8", errors="replace")

    out = io.StringIO()
    pieces = []

    class W:
        def write(self, s):
            pieces.append(s)
            out.write(s)

        def flush(self):
            pass

    st = IncrementalDetokenizer(decode)
    w = W()
    for i in range(1, len(data) + 1):
        if piece := st.update(data[:i]):
            w.write(piece)
    if piece := st.update(data, final=True):
        w.write(piece)
    assert out.getvalue() == text
    assert all("\ufffd" not in p for p in pieces)
    assert len(pieces) > 5  # streamed, not printed at the end


def test_sample_next():
    key = jax.random.key(0)
    logits = jax.random.normal(key, (3, 50)) * 3
    greedy = sample_next(logits, key, temperature=0.0, top_p=1.0)
    np.testing.assert_array_equal(greedy, jnp.argmax(logits, -1))
    # a tiny nucleus keeps only the top token, whatever the temperature
    for s in range(5):
        t = sample_next(logits, jax.random.key(s), temperature=2.0, top_p=1e-4)
        np.testing.assert_array_equal(t, greedy)
    # top_p = 0.9 on [0.5, 0.3, 0.15, 0.05]: the last token is never drawn, the first three are
    lg = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]]))
    draws = np.array([int(sample_next(lg, jax.random.key(s), temperature=1.0, top_p=0.9)[0])
                      for s in range(200)])
    assert set(draws) == {0, 1, 2}
    # plain temperature sampling follows the distribution roughly
    draws = np.array([int(sample_next(lg, jax.random.key(s), temperature=1.0, top_p=1.0)[0])
                      for s in range(400)])
    assert abs((draws == 0).mean() - 0.5) < 0.1


def test_peak_memory_reports_something():
    b, label = gen.peak_memory()
    assert b > 0 and ("device" in label or "RSS" in label)


# -- the demo prompt ---------------------------------------------------------------


def test_demo_prompt_is_deterministic_and_hides_the_fact_once():
    d = demo_prompt.build_demo_prompt()
    assert d.text == demo_prompt.build_demo_prompt().text
    # same text on every machine: update this hash only when changing the prompt on purpose
    assert hashlib.sha256(d.text.encode()).hexdigest()[:16] == DEMO_SHA256_PREFIX
    assert d.text.count(d.passphrase) == 1 and d.text.count(d.fact) == 1
    assert 0.4 < d.fact_char_offset / len(d.text) < 0.6
    assert d.text.endswith(demo_prompt.QUESTION) and d.passphrase not in demo_prompt.QUESTION
    assert demo_prompt.check_answer(f'The secret passphrase is "{d.passphrase}".')
    assert demo_prompt.check_answer(d.passphrase.lower().replace("-", " "))
    assert not demo_prompt.check_answer("The secret passphrase is 4819.")
    assert not demo_prompt.check_answer("I do not know.")


DEMO_SHA256_PREFIX = "fa2af30b7823f365"


def test_demo_prompt_token_count(tok_cfg):
    cfg, tok = tok_cfg
    d = demo_prompt.build_demo_prompt()
    n = len(tok.encode(tok.apply_chat_template(d.messages)))
    assert 3000 <= n <= 3500, n
    before = len(tok.encode(d.text[: d.fact_char_offset]))
    assert 0.4 < before / n < 0.6


# -- a real generation -------------------------------------------------------------


@pytest.mark.slow
def test_generate_four_tokens_matches_hf(tok_cfg):
    """SmolLM2-135M, f32, greedy: the CLI's 4 tokens equal Hugging Face's (fixture)."""
    f = np.load(FIXTURES / "smollm2_parity.npz")
    cfg, tok = tok_cfg
    prompt = str(f["prompt_text"])
    assert tok.encode(prompt) == f["prompt_ids"].tolist()
    run = run_generate(["--prompt", prompt, "--max-new-tokens", "4", "--dtype", "float32"])
    assert run.rc == 0, run.err[-2000:]
    want = tok.decode(f["greedy_ids"][:4].tolist())
    header, text, stats = run.head, run.text, run.report
    assert text == want, (text, want)
    assert "prompt 64 tokens" in header and "padded to 256" in header
    assert re.search(r"prefill: 64 tokens in [\d.]+ s = [\d.]+ tok/s", stats)
    assert re.search(r"decode: 3 steps in [\d.]+ s = [\d.]+ tok/s", stats)
    assert "compile" in stats and ("peak device memory" in stats or "peak RSS" in stats)
    assert "generated 4 tokens" in stats


def test_readme_asynctls_example_passes_the_checks(no_model_load, tok_cfg):
    """The README's ``--attention asynctls --attention-opt budget=1024`` command line gets
    past every check (the method is bound to SmolLM2's calibration) up to the model load."""
    spec = gen.resolve_args(gen.build_parser().parse_args(
        ["--prompt", "The capital of France is", "--attention", "asynctls", "--attention-opt", "budget=1024"]))
    cfg, tok = tok_cfg
    gen.prepare_prompt(spec, cfg, tok)
    assert spec.method.channels_per_layer is not None
    with pytest.raises(AssertionError, match="was loaded"):
        gen.run(spec, io.StringIO())
