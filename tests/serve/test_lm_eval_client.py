"""lm-evaluation-harness itself against the server, as a user runs it: `lm_eval.simple_evaluate` with
the `local-completions` model (loglikelihood and generate_until on /v1/completions, token-id prompts
in batches, tokenized by the checkpoint's tokenizer loaded by transformers from the model directory,
or by the server's /tokenize, which the harness detects when given no tokenizer) and the
`local-chat-completions` model (generate_until on /v1/chat/completions), on two small tasks written
here (JSONL data, YAML configs). What the harness records for each request equals the in-process
engine's: each loglikelihood the sum of the prompt logprobs of the continuation, bit for bit, with
the same greedy flag, and each generation the greedy text cut at the first stop string. Everything
is local: the hub is switched off, so nothing is downloaded."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from pocketllm import SamplingParams
from pocketllm.tokenizer import EOS_TOKEN, load_tokenizer

from .conftest import MAX_SEQ_LEN, MODEL

NEEDS = "lm-evaluation-harness's API models need lm-eval with its api extra (pip install 'lm-eval[api]')"
for _module in ("lm_eval", "aiohttp", "requests", "tenacity", "transformers"):
    pytest.importorskip(_module, reason=NEEDS)

SEED = 1234  # the seed the harness sends (TemplateAPI's default)
MAX_GEN_TOKS = 8
# The tiny random checkpoint repeats a prompt's last character: "?" stops a completion of a prompt
# ending in "?" at once, one ending in "=" runs to MAX_GEN_TOKS, as does a chat reply (a run of "\n"
# after the template's "assistant\n", which "Q:" does not stop).
UNTIL = ["?", "Q:"]
PAIRS = [(1, 2), (3, 4), (5, 6), (7, 8), (2, 2), (9, 1), (4, 4), (6, 3)]
# Multiple choice: the third choice continues the context's ":" as the model does (greedy).
MC_DOCS = [{"question": f"What is {a} plus {b}?", "choices": [f" {a + b}", f" {a + b + 1}", ":::"], "answer": i % 3}
           for i, (a, b) in enumerate(PAIRS)]
GEN_DOCS = [{"question": f"{a} plus {b} is" + ("?" if i % 2 else " ="), "answer": f" {a + b}"}
            for i, (a, b) in enumerate(PAIRS)]


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two tasks over JSONL files: `tiny_mc` (multiple_choice: loglikelihood requests) and `tiny_gen`
    (generate_until with a short `until` and `max_gen_toks`); datasets' cache stays in here too."""
    path = tmp_path_factory.mktemp("lm_eval_tasks")
    for name, docs in (("mc", MC_DOCS), ("gen", GEN_DOCS)):
        (path / f"{name}.jsonl").write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    dataset = lambda name: textwrap.dedent(f"""\
        dataset_path: json
        dataset_kwargs:
          data_files:
            test: {json.dumps(str(path / f"{name}.jsonl"))}
          cache_dir: {json.dumps(str(path / "datasets_cache"))}
        test_split: test
        """)  # noqa: E731
    (path / "tiny_mc.yaml").write_text("task: tiny_mc\n" + dataset("mc") + textwrap.dedent("""\
        output_type: multiple_choice
        doc_to_text: "Question: {{question}}\\nAnswer:"
        doc_to_choice: "{{choices}}"
        doc_to_target: answer
        target_delimiter: ""
        metric_list:
          - metric: acc
            aggregation: mean
            higher_is_better: true
        """))
    (path / "tiny_gen.yaml").write_text("task: tiny_gen\n" + dataset("gen") + textwrap.dedent(f"""\
        output_type: generate_until
        doc_to_text: "{{{{question}}}}"
        doc_to_target: answer
        generation_kwargs:
          until: {json.dumps(UNTIL)}
          max_gen_toks: {MAX_GEN_TOKS}
          do_sample: false
        metric_list:
          - metric: exact_match
            aggregation: mean
            higher_is_better: true
        """))
    return path


def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """The hub off for huggingface_hub, datasets and transformers: the environment for what imports
    them next, and the flags they read at import where an earlier test imported them already."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    for module, flag in (("huggingface_hub.constants", "HF_HUB_OFFLINE"), ("datasets.config", "HF_HUB_OFFLINE"),
                         ("datasets.config", "HF_DATASETS_OFFLINE")):
        if module in sys.modules and hasattr(sys.modules[module], flag):
            monkeypatch.setattr(sys.modules[module], flag, True)


def _evaluate(monkeypatch: pytest.MonkeyPatch, task_dir: Path, model: str, model_args: dict[str, Any],
              tasks: list[str], **options: Any) -> dict[str, Any]:
    """A full `simple_evaluate` run of `tasks` (8 documents each), every request's record kept;
    Python's, numpy's and torch's global seeds are left alone."""
    _offline(monkeypatch)
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    out = simple_evaluate(model=model, model_args=model_args, tasks=tasks, limit=8, log_samples=True,
                          task_manager=TaskManager(include_path=str(task_dir), include_defaults=False),
                          bootstrap_iters=0, random_seed=None, numpy_random_seed=None, torch_random_seed=None,
                          **options)
    assert out is not None
    assert sorted(out["samples"]) == sorted(tasks) and all(len(out["samples"][t]) == 8 for t in tasks)
    return out


def _cut(text: str, stops: list[str]) -> str:
    """`text` up to the first occurrence of any stop string (the server's stop, as the harness asks)."""
    return text[:min((i for i in (text.find(s) for s in stops) if i >= 0), default=len(text))]


def _full_and_cut(samples: list[dict[str, Any]], fulls: list[str], stops: list[str]) -> list[tuple[str, str]]:
    """Each generation the harness recorded equals the in-process greedy text cut at the first stop
    string; (full, cut) of each, for the checks that a run covers what it should."""
    wants = [_cut(full, stops) for full in fulls]
    assert [s["resps"] for s in samples] == [[[want]] for want in wants]
    return list(zip(fulls, wants))


@pytest.mark.parametrize("tokenizer", ["model_dir", "server"])
def test_local_completions_loglikelihood_and_generate_until(monkeypatch, task_dir, base_url, serial,
                                                            serve_checkpoint, tokenizer):
    """`tokenizer`: "model_dir", the checkpoint's tokenizer loaded by transformers (a local model's
    usual setup); "server", none given: the harness finds /tokenizer_info and /tokenize on the server
    and tokenizes there. Token-id prompts either way (tokenized_requests, the default), in batches."""
    model_args = {"base_url": f"{base_url}/v1/completions", "model": MODEL, "tokenized_requests": True,
                  "max_length": MAX_SEQ_LEN, "batch_size": 4}
    if tokenizer == "model_dir":
        model_args |= {"tokenizer": str(serve_checkpoint), "tokenizer_backend": "huggingface"}
    out = _evaluate(monkeypatch, task_dir, "local-completions", model_args, ["tiny_mc", "tiny_gen"])
    tok = load_tokenizer(serve_checkpoint, required=True)
    encode = lambda text: tok.encode(text, add_special_tokens=False).ids  # noqa: E731

    correct = []
    for sample in out["samples"]["tiny_mc"]:
        assert len(sample["arguments"]) == len(sample["doc"]["choices"])
        wants = []
        for context, continuation in sample["arguments"]:
            # The harness's _encode_pair: the whole text encoded, the context's tokens split off.
            ctx = encode(context)
            cont = encode(context + continuation)[len(ctx):]
            scored = serial.generate(ctx + cont, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1,
                                                                seed=SEED))
            greedy = all(top[0][0] == token for top, token in zip(scored.prompt_top_logprobs[len(ctx):], cont))
            wants.append((sum(scored.prompt_logprobs[len(ctx):]), greedy))
        assert [tuple(r) for [r] in sample["resps"]] == wants
        correct.append(max(range(len(wants)), key=lambda i: wants[i][0]) == sample["target"])
    assert any(greedy for s in out["samples"]["tiny_mc"] for [(_, greedy)] in s["resps"])
    assert out["results"]["tiny_mc"]["acc,none"] == sum(correct) / len(correct)

    samples = out["samples"]["tiny_gen"]
    stops = [*UNTIL, EOS_TOKEN]  # the harness adds the tokenizer's EOS text to `until`
    fulls = [serial.generate(encode(s["arguments"][0][0]),
                             SamplingParams(max_tokens=MAX_GEN_TOKS, temperature=0, seed=SEED)).text
             for s in samples]
    runs = _full_and_cut(samples, fulls, stops)
    # Both ends covered: a generation a stop string ended at once, and one that ran to max_gen_toks.
    assert any(full and not cut for full, cut in runs) and any(cut and cut == full for full, cut in runs), runs
    assert "exact_match,none" in out["results"]["tiny_gen"]


def test_local_chat_completions_generate_until(monkeypatch, task_dir, base_url, serial):
    model_args = {"base_url": f"{base_url}/v1/chat/completions", "model": MODEL, "max_length": MAX_SEQ_LEN}
    out = _evaluate(monkeypatch, task_dir, "local-chat-completions", model_args, ["tiny_gen"],
                    apply_chat_template=True)
    samples = out["samples"]["tiny_gen"]
    conversations = []
    for sample in samples:
        # The request's messages, as the harness posts them (JSON of the chat history).
        messages = json.loads(sample["arguments"][0][0][0])
        assert messages == [{"role": "user", "content": sample["doc"]["question"]}]
        conversations.append(messages)
    results = serial.chat(conversations, SamplingParams(max_tokens=MAX_GEN_TOKS, temperature=0, seed=SEED))
    # No tokenizer here, so no EOS text joins the stop strings (the harness warns); EOS still ends a reply.
    runs = _full_and_cut(samples, [r.text for r in results], UNTIL)
    assert all(cut for _, cut in runs), runs  # text to compare, not empty replies
