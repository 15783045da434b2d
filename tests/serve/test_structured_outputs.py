"""Structured outputs through the server: OpenAI's `response_format` (json_object, json_schema) with the
`openai` client, vLLM's `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` and
`structured_outputs` as raw JSON; every answer follows its constraint and equals the serial engine's
bits with the same SamplingParams; bad constraints are a 400 naming the field."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from pocketllm import SamplingParams
from pocketllm.structured_outputs import StructuredOutputsParams

from .conftest import MODEL, ids_of

pytest.importorskip("xgrammar", reason="structured outputs need xgrammar (pip install 'pocketllm[structured]')")

AS_IDS = {"return_tokens_as_token_ids": True}
COLOUR = {"type": "object", "properties": {"c": {"type": "string", "enum": ["red", "green", "blue"]}},
          "required": ["c"]}
MESSAGES = [{"role": "user", "content": "pick one"}]
CLOSE_BIAS = {str(ord("}")): 8.0}  # ends a random-weight model's JSON object early


def _post(base_url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{base_url}{path}", json={"model": MODEL, **body}, timeout=60)


def test_chat_response_format_json_schema_equals_the_engine(client, serial):
    response_format = {"type": "json_schema", "json_schema": {"name": "colour", "schema": COLOUR, "strict": True}}
    response = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=40, temperature=0.9,
                                              seed=4, logprobs=True, response_format=response_format,
                                              extra_body=AS_IDS)
    choice = response.choices[0]
    want = serial.chat(MESSAGES, SamplingParams(max_tokens=40, temperature=0.9, seed=4,
                                                structured_outputs=StructuredOutputsParams(json=COLOUR)))
    assert json.loads(choice.message.content)["c"] in ("red", "green", "blue")
    assert choice.message.content == want.text and choice.finish_reason == "stop"
    assert ids_of([c.token for c in choice.logprobs.content]) == want.token_ids
    assert [c.logprob for c in choice.logprobs.content] == want.logprobs


def test_chat_response_format_json_object(client):
    response = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=40, temperature=1.0,
                                              seed=1, n=2, response_format={"type": "json_object"},
                                              logit_bias=CLOSE_BIAS)
    assert [isinstance(json.loads(c.message.content), dict) for c in response.choices] == [True, True]


# (vLLM's extra field, its value, what a valid output looks like)
GUIDED = [
    ("guided_json", COLOUR, lambda text: json.loads(text)["c"] in ("red", "green", "blue")),
    ("guided_json", json.dumps(COLOUR), lambda text: json.loads(text)["c"] in ("red", "green", "blue")),
    ("guided_regex", "[ab]{3}c", lambda text: re.fullmatch("[ab]{3}c", text) is not None),
    ("guided_choice", ["yes", "no", "maybe"], lambda text: text in ("yes", "no", "maybe")),
    ("guided_grammar", 'root ::= "x" [0-9] [0-9]?', lambda text: re.fullmatch("x[0-9]{1,2}", text) is not None),
    ("structured_outputs", {"regex": "[0-9]{4}"}, lambda text: re.fullmatch("[0-9]{4}", text) is not None),
]


@pytest.mark.parametrize(("field", "value", "valid"), GUIDED, ids=[f"{g[0]}-{i}" for i, g in enumerate(GUIDED)])
def test_vllm_fields_on_both_routes(base_url, field, value, valid):
    body = {field: value, "max_tokens": 40, "temperature": 1.0, "seed": 2}
    completion = _post(base_url, "/v1/completions", {**body, "prompt": [1, 2, 3], "n": 2}).json()
    chat = _post(base_url, "/v1/chat/completions", {**body, "messages": MESSAGES}).json()
    texts = [c["text"] for c in completion["choices"]] + [c["message"]["content"] for c in chat["choices"]]
    assert all(valid(text) for text in texts), texts
    assert {c["finish_reason"] for c in completion["choices"] + chat["choices"]} == {"stop"}


def test_completions_response_format_and_streaming(base_url, serial):
    body = {"prompt": [7, 8, 9], "max_tokens": 40, "temperature": 0.7, "seed": 3,
            "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": COLOUR}}}
    whole = _post(base_url, "/v1/completions", body).json()["choices"][0]
    with httpx.stream("POST", f"{base_url}/v1/completions", json={"model": MODEL, **body, "stream": True},
                      timeout=60) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    want = serial.generate([7, 8, 9], SamplingParams(max_tokens=40, temperature=0.7, seed=3,
                                                     structured_outputs={"json": COLOUR}))
    assert whole["text"] == "".join(c["choices"][0]["text"] for c in chunks) == want.text
    assert json.loads(want.text)["c"] in ("red", "green", "blue")


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
     "response_format", r"^response_format\.json_schema\.schema: xgrammar cannot compile it: "),
    ({"response_format": {"type": "json_schema"}}, "response_format", r"needs its json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": COLOUR}}},
     "response_format.json_schema.name", r"response_format\.json_schema\.name"),
    ({"response_format": {"type": "structural_tag"}}, "response_format.type", r"response_format\.type"),
    ({"guided_regex": "[ab"}, "guided_regex", r"^guided_regex: xgrammar cannot compile it: .*\["),
    ({"guided_grammar": "root ::= nothing"}, "guided_grammar", r"^guided_grammar: xgrammar cannot compile it"),
    ({"guided_json": "{not json"}, "guided_json", r"^guided_json must be a JSON schema"),
    ({"guided_choice": []}, "guided_choice", r"^guided_choice must be a non-empty list of strings"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs",
     r"structured_outputs must set exactly one of json, json_object, regex, choice, grammar; got regex and choice"),
    ({"structured_outputs": {"schema": {}}}, "structured_outputs", r"structured_outputs has no field 'schema'"),
    ({"structured_outputs": {"json": {"type": 5}}}, "structured_outputs",
     r"^structured_outputs\.json: xgrammar cannot compile it"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex",
     r"response_format and guided_regex both ask for structured output; set one of them"),
])
def test_bad_constraints_are_a_400_naming_the_field(base_url, body, param, message):
    for path, shape in (("/v1/chat/completions", {"messages": MESSAGES}), ("/v1/completions", {"prompt": "hi"})):
        response = _post(base_url, path, {**shape, **body, "max_tokens": 4})
        error = response.json()["error"]
        assert response.status_code == 400 and error["param"] == param, (path, error)
        assert re.search(message, error["message"]), error["message"]
        assert "/project/" not in error["message"]
    assert _post(base_url, "/v1/completions", {"prompt": "hi", "max_tokens": 2}).status_code == 200  # still serving
