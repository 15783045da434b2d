"""Chat messages -> prompt text, through the checkpoint's own chat template.

A Hugging Face checkpoint ships its conversation format as a Jinja template in
tokenizer_config.json (`chat_template`); rendering it here, once, gives `LLM.chat` and the
server's /v1/chat/completions the same prompt for the same messages. Templates are untrusted
input, so they run in Jinja's immutable sandbox, as transformers runs them.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .config import read_json_object
from .tokenizer import TOKENIZER_CONFIG_FILE

ROLES = ("system", "user", "assistant", "tool", "developer")
Message = Mapping[str, Any]


class ChatTemplateError(ValueError):
    """The template is missing, does not compile, or raised while rendering (raise_exception)."""


def load_chat_template(model_dir: str | Path) -> str | None:
    """The directory's chat template (the "default" one when it names several), or None."""
    path = Path(model_dir) / TOKENIZER_CONFIG_FILE
    if not path.is_file():
        return None
    template = read_json_object(path).get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _text_content(content: Any, where: str) -> str:
    """A message's content as text: a str, or a list of {"type": "text", "text": ...} parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence) and not isinstance(content, (bytes, bytearray)):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"{where}.content[{j}] must be a text part {{'type': 'text', 'text': str}} "
                                 f"(images and audio are not supported)")
            texts.append(part["text"])
        return "".join(texts)
    raise TypeError(f"{where}.content must be a str or a list of text parts, got {type(content).__name__}")


def normalize_messages(messages: Sequence[Message]) -> list[dict[str, str]]:
    """Checked messages as {"role", "content"} dicts of str (TypeError/ValueError naming the message)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...}")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise TypeError(f"{where} must be a dict with 'role' and 'content', got {type(message).__name__}")
        role = message.get("role")
        if role not in ROLES:
            raise ValueError(f"{where}.role must be one of {list(ROLES)}, got {role!r}")
        out.append({"role": role, "content": _text_content(message.get("content", ""), where)})
    return out


@functools.lru_cache(maxsize=8)
def _compiled(template: str) -> Any:
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ChatTemplateError(f"the chat template refused the messages: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template)
    except TemplateError as exc:
        raise ChatTemplateError(f"the chat template does not compile: {exc}") from None


def render_chat(template: str | None, messages: Sequence[Message], add_generation_prompt: bool = True,
                **variables: Any) -> str:
    """The prompt text for `messages`; `add_generation_prompt` opens the assistant's turn."""
    if template is None:
        raise ChatTemplateError("the model has no chat template (tokenizer_config.json 'chat_template')")
    from jinja2 import TemplateError

    checked = normalize_messages(messages)
    try:
        return str(_compiled(template).render(messages=checked, add_generation_prompt=add_generation_prompt,
                                              **variables))
    except TemplateError as exc:
        raise ChatTemplateError(f"the chat template failed: {exc}") from None
