"""Text in, text out: the byte-level tokenizer that write_checkpoint writes, LLM.generate(prompts=...)
against the same prompts as token ids (serial and batched), its errors, and `generate --prompt`."""

from __future__ import annotations

import json
import re
import sys

import pytest
from helpers import budget
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from pocketllm import LLM, EngineArgs, SamplingParams, write_checkpoint
from pocketllm.cli import main
from pocketllm.tokenizer import byte_level_tokenizer_files

MAX_SEQ_LEN = 64
TEXTS = ["Hello", "héllo wörld", "日本語 🙂", " a\n\tb <|x|>"]
PARAMS = SamplingParams(max_tokens=6, temperature=0.8, seed=5, ignore_eos=True)


def _engine(path, **backend_options) -> LLM:
    return LLM(EngineArgs(model=str(path), max_seq_len=MAX_SEQ_LEN, backend_options=backend_options))


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_checkpoint / "tokenizer.json"))


@pytest.fixture(scope="module")
def serial(tiny_checkpoint) -> LLM:
    return _engine(tiny_checkpoint, enable_batching=False)


# -- the written tokenizer ------------------------------------------------------------------------------


@settings(max_examples=budget(0.625))
@given(text=st.text(max_size=40))
def test_byte_level_tokenizer_round_trips_any_text(tokenizer, text):
    """Any unicode text encodes to its UTF-8 bytes as ids and decodes back to itself."""
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert ids == list(text.encode("utf-8"))
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


@pytest.mark.parametrize("variant", ["tiny", "mha_hd24"])
def test_every_id_decodes_and_eos_and_extra_ids_decode_to_nothing(checkpoint_dir, variant):
    """Bytes decode to themselves; the EOS id (255 in a 256 vocabulary, 299 in a 300 one) is
    "<|endoftext|>" and, like the ids past the bytes, decodes to "" when special tokens are skipped."""
    path = checkpoint_dir(variant)
    raw = json.loads((path / "config.json").read_text())
    vocab, eos = raw["vocab_size"], raw["eos_token_id"]
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    assert tok.get_vocab_size() == vocab and tok.token_to_id("<|endoftext|>") == eos
    assert tok.decode([eos], skip_special_tokens=False) == "<|endoftext|>"
    for i in range(vocab):
        expected = "" if i == eos or i >= 256 else bytes([i]).decode("utf-8", errors="replace")
        assert tok.decode([i], skip_special_tokens=True) == expected, i
    assert tok.decode([*b"ok", eos, *range(256, vocab)], skip_special_tokens=True) == "ok"


def test_eos_that_utf8_needs_stays_a_byte(tmp_path):
    """An EOS id that is a byte UTF-8 text can contain ("\\n") keeps decoding as that byte, so text
    still round-trips; without an EOS token, tokenizer_config.json names none."""
    files = byte_level_tokenizer_files(256, (10,), MAX_SEQ_LEN)
    (tmp_path / "tokenizer.json").write_text(json.dumps(files["tokenizer.json"]), encoding="utf-8")
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tok.encode("a\nb", add_special_tokens=False).ids == [97, 10, 98]
    assert tok.decode([97, 10, 98], skip_special_tokens=True) == "a\nb"
    assert "eos_token" not in files["tokenizer_config.json"]


def test_transformers_auto_tokenizer_loads_the_checkpoint(tiny_checkpoint):
    """transformers.AutoTokenizer reads the same tokenizer, with the EOS token set."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(tiny_checkpoint))
    assert hf.eos_token_id == 255 and len(hf) == 256
    for text in TEXTS[:3]:
        ids = hf.encode(text, add_special_tokens=False)
        assert ids == list(text.encode("utf-8"))
        assert hf.decode(ids + [hf.eos_token_id], skip_special_tokens=True) == text


# -- LLM.generate(prompts=...) ----------------------------------------------------------------------------


def test_text_prompts_generate_what_their_token_ids_generate(serial, tokenizer):
    """Each text prompt gives the tokens and logprobs of its encoded ids, and text is their decoding;
    a token-id prompt gets the same text; a single str gives a single result."""
    results = serial.generate(prompts=TEXTS, sampling_params=PARAMS)
    assert len(results) == len(TEXTS)
    for text, result in zip(TEXTS, results):
        encoded = tokenizer.encode(text, add_special_tokens=False).ids
        alone = serial.generate(prompt_tokens=encoded, sampling_params=PARAMS)
        assert result.prompt_tokens == encoded
        assert (result.token_ids, result.logprobs) == (alone.token_ids, alone.logprobs)
        assert result.text == alone.text == tokenizer.decode(result.token_ids, skip_special_tokens=True)
    single = serial.generate(prompts=TEXTS[0], sampling_params=PARAMS)
    assert (single.token_ids, single.text) == (results[0].token_ids, results[0].text)


def test_text_leaves_out_eos_and_extra_ids(checkpoint_dir):
    """In a 300-token vocabulary (EOS 299), sampled ids past the bytes add nothing to `text`."""
    path = checkpoint_dir("mha_hd24")
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    result = _engine(path).generate(prompts="Hello", sampling_params=SamplingParams(max_tokens=24, seed=1,
                                                                                    ignore_eos=True))
    assert any(t >= 256 for t in result.token_ids)  # this seed samples some; the check below needs them
    assert result.text == tok.decode([t for t in result.token_ids if t < 256], skip_special_tokens=False)


def test_batched_text_prompts_match_serial(tiny_checkpoint, serial):
    """Through the batch scheduler, text prompts give the serial path's tokens, logprobs and text."""
    batched = _engine(tiny_checkpoint, enable_batching=True, background_thread=False)
    try:
        got = batched.generate(prompts=TEXTS, sampling_params=PARAMS)
    finally:
        batched.close()
    expected = serial.generate(prompts=TEXTS, sampling_params=PARAMS)
    assert [(r.token_ids, r.logprobs, r.text) for r in got] == [(r.token_ids, r.logprobs, r.text) for r in expected]


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(prompt_tokens=[1, 2], prompts="hi"), TypeError, "not both"),
    (dict(), TypeError, "needs prompt_tokens .* or prompts"),
    (dict(prompts=""), ValueError, r"prompts\[0\] must not be an empty string"),
    (dict(prompts=["hi", ""]), ValueError, r"prompts\[1\] must not be an empty string"),
    (dict(prompts=[]), ValueError, "prompts must not be empty"),
    (dict(prompts=["hi", 3]), TypeError, r"prompts\[1\] must be a str, got int"),
    (dict(prompts=b"hi"), TypeError, "prompts must be a str or a list of str, got bytes"),
    (dict(prompt_tokens="hi"), TypeError, "text goes in prompts="),
    (dict(prompts="x" * MAX_SEQ_LEN), ValueError, "exceeds max_seq_len"),
])
def test_bad_text_arguments_raise(serial, kwargs, error, message):
    with pytest.raises(error, match=message):
        serial.generate(sampling_params=PARAMS, **kwargs)


def test_directory_without_tokenizer_rejects_text_and_serves_token_ids(tmp_path):
    """A vocabulary under 256 gets no tokenizer.json; text prompts then raise a ValueError naming the
    directory, while token-id prompts still run, with no text."""
    path = write_checkpoint(tmp_path / "v100", "tiny", seed=1, num_hidden_layers=1, vocab_size=100, eos_token_id=99)
    assert not (path / "tokenizer.json").exists()
    llm = _engine(path)
    with pytest.raises(ValueError, match=re.escape(str(path))):
        llm.generate(prompts="hi", sampling_params=PARAMS)
    result = llm.generate(prompt_tokens=[1, 2], sampling_params=PARAMS)
    assert len(result.token_ids) == PARAMS.max_tokens and result.text is None


def test_missing_tokenizers_package_names_the_extra(tiny_checkpoint, monkeypatch, capsys):
    """Without the tokenizers package, token ids still work and text prompts say what to install."""
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    llm = _engine(tiny_checkpoint)
    assert llm.tokenizer is None and llm.generate(prompt_tokens=[1, 2], sampling_params=PARAMS).text is None
    with pytest.raises(ImportError, match=re.escape("pip install 'pocketllm[text]'")):
        llm.generate(prompts="hi", sampling_params=PARAMS)
    assert main(["generate", "--model", str(tiny_checkpoint), "--prompt", "hi", "--max-seq-len", "64"]) == 2
    assert "pocketllm[text]" in capsys.readouterr().err


# -- command line -----------------------------------------------------------------------------------------


def test_cli_prompt_prints_the_generated_text(tiny_checkpoint, capsys):
    """--prompt prints the text the API generates on stdout and its token ids on stderr;
    --prompt-tokens keeps ids on stdout and adds the text on stderr."""
    greedy = SamplingParams(max_tokens=5, temperature=0.0)
    expected = _engine(tiny_checkpoint).generate(prompts="Hello", sampling_params=greedy)
    args = ["generate", "--model", str(tiny_checkpoint), "--max-tokens", "5", "--temperature", "0", "--max-seq-len",
            "64"]
    assert main([*args, "--prompt", "Hello"]) == 0
    out, err = capsys.readouterr()
    assert out == expected.text + "\n"
    assert f"token_ids={','.join(map(str, expected.token_ids))}\n" in err
    assert main([*args, "--prompt-tokens", ",".join(map(str, b"Hello"))]) == 0
    out, err = capsys.readouterr()
    assert out == ",".join(map(str, expected.token_ids)) + "\n" and f"text={expected.text!r}\n" in err


def test_cli_prompt_errors(tmp_path, tiny_checkpoint, capsys):
    """--prompt with --prompt-tokens is a usage error; --prompt on a directory without tokenizer.json
    exits 2 naming the directory."""
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--model", str(tiny_checkpoint), "--prompt", "hi", "--prompt-tokens", "1"])
    assert exit_info.value.code == 2 and "not allowed with" in capsys.readouterr().err
    path = write_checkpoint(tmp_path / "v100", "tiny", seed=1, num_hidden_layers=1, vocab_size=100, eos_token_id=99)
    assert main(["generate", "--model", str(path), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert "tokenizer.json" in err and str(path) in err
