"""LLM.chat: messages through the checkpoint's chat template (the presets ship Qwen's ChatML),
rendered as transformers renders it, and the reply generated as from the rendered prompt."""

from __future__ import annotations

import json

import pytest

from pocketllm import LLM, EngineArgs, SamplingParams, write_checkpoint
from pocketllm.chat import ChatTemplateError, render_chat

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi, é!"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": [{"type": "text", "text": "2+2"}]}]


@pytest.fixture(scope="module")
def chat_llm(tmp_path_factory):
    path = write_checkpoint(tmp_path_factory.mktemp("chat") / "tiny", "tiny", seed=0)
    with LLM(EngineArgs(model=str(path), max_seq_len=256)) as llm:
        yield llm


def test_template_renders_as_transformers_does(chat_llm):
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(chat_llm.args.model)
    plain = [{**m, "content": "2+2"} if isinstance(m["content"], list) else m for m in MESSAGES]
    want = tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
    assert render_chat(chat_llm.chat_template, MESSAGES) == want
    assert want.endswith("<|im_start|>assistant\n")


def test_chat_generates_from_the_rendered_prompt(chat_llm):
    params = SamplingParams(max_tokens=6, temperature=0.7, seed=3)
    reply = chat_llm.chat(MESSAGES, params)
    assert reply.token_ids == chat_llm.generate(chat_llm.chat_prompt(MESSAGES), params).token_ids
    both = chat_llm.chat([MESSAGES, MESSAGES[:2]], params)
    assert both[0].token_ids == reply.token_ids and len(both) == 2


@pytest.mark.parametrize(("messages", "error"), [
    ([], "messages must be a non-empty list"),
    ([{"role": "wizard", "content": "x"}], "messages[0].role"),
    ([{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content[0]"),
    ([{"role": "user", "content": 5}], "messages[0].content"),
])
def test_bad_messages_name_the_message(chat_llm, messages, error):
    with pytest.raises((ValueError, TypeError), match=error.replace("[", r"\[").replace(".", r"\.")):
        chat_llm.chat(messages)


def test_a_checkpoint_without_a_template_is_refused(tmp_path):
    path = write_checkpoint(tmp_path / "tiny", "tiny", seed=0)
    config = json.loads((path / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    with LLM(EngineArgs(model=str(path), max_seq_len=64)) as llm, pytest.raises(ChatTemplateError, match="no chat"):
        llm.chat([{"role": "user", "content": "Hi"}])
