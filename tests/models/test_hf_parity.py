"""pocketllm's Qwen3 forward against Hugging Face transformers (eager attention, fp32) on every
checkpoint variant: prefill logits, decode logits (teacher-forced) and greedy generation."""

from __future__ import annotations

import pytest
import torch
from helpers import CHECKPOINT_VARIANTS

from pocketllm import LLM, EngineArgs, SamplingParams
from pocketllm.models import ForwardBatch

transformers = pytest.importorskip("transformers")

ATOL = 1e-4
PROMPT_LENGTHS = (1, 7, 33, 70)
NEW_TOKENS = 24


@pytest.fixture(scope="module", params=list(CHECKPOINT_VARIANTS))
def models(request, checkpoint_dir):
    """(pocketllm engine, transformers model) for one variant, loaded once per module."""
    path = checkpoint_dir(request.param)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    hf.eval()
    hf.generation_config.eos_token_id = None  # generate() merges this in even when told eos_token_id=None
    llm = LLM(EngineArgs(model=str(path), max_seq_len=256))
    return llm, hf


def _prompt(llm: LLM, length: int) -> list[int]:
    gen = torch.Generator().manual_seed(1000 + length)
    return torch.randint(0, llm.model_config.vocab_size, (length,), generator=gen).tolist()


@torch.inference_mode()
def _hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), vocab] fp32 logits of every position."""
    return hf(torch.tensor([tokens])).logits[0].float()


@torch.inference_mode()
def _hf_greedy(hf, prompt: list[int]) -> list[int]:
    config = transformers.GenerationConfig(do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=None,
                                           pad_token_id=0)
    out = hf.generate(torch.tensor([prompt]), generation_config=config)[0, len(prompt):].tolist()
    assert len(out) == NEW_TOKENS
    return out


@torch.inference_mode()
def _forward(llm: LLM, slots, starts, new_tokens, is_decode: bool) -> torch.Tensor:
    batch = ForwardBatch.build(slots, starts, new_tokens, is_decode, "cpu")
    return llm.model.forward(batch, llm.cache)


@pytest.mark.parametrize("length", PROMPT_LENGTHS)
def test_prefill_last_logits_match_transformers(models, length):
    """Last-token logits of a prefill equal transformers' within 1e-4."""
    llm, hf = models
    prompt = _prompt(llm, length)
    slot = llm.slots.allocate()
    try:
        logits = _forward(llm, [slot], [0], [prompt], False)[0]
    finally:
        llm.slots.free(slot, [])
    torch.testing.assert_close(logits, _hf_logits(hf, prompt)[-1], atol=ATOL, rtol=0)


def test_varlen_and_chunked_prefill_match_transformers(models):
    """Several prompts in one varlen prefill, and a prompt prefilled in two chunks (the second
    behind a cached prefix), each give transformers' last-token logits."""
    llm, hf = models
    prompts = [_prompt(llm, n) for n in PROMPT_LENGTHS]
    slots = [llm.slots.allocate() for _ in prompts]
    try:
        logits = _forward(llm, slots, [0] * len(prompts), prompts, False)
        for row, prompt in zip(logits, prompts):
            torch.testing.assert_close(row, _hf_logits(hf, prompt)[-1], atol=ATOL, rtol=0)
        long = prompts[-1]
        _forward(llm, [slots[0]], [0], [long[:29]], False)
        chunked = _forward(llm, [slots[0]], [29], [long[29:]], False)[0]
        torch.testing.assert_close(chunked, _hf_logits(hf, long)[-1], atol=ATOL, rtol=0)
    finally:
        for slot in slots:
            llm.slots.free(slot, [])


@pytest.mark.parametrize("length,end_with_eos", [(n, False) for n in PROMPT_LENGTHS] + [(7, True)])
def test_greedy_generation_matches_transformers(models, length, end_with_eos):
    """24 greedy tokens with ignore_eos equal transformers' generate(do_sample=False) token for
    token (also for a prompt ending in EOS, whose continuation tends to repeat it)."""
    llm, hf = models
    prompt = _prompt(llm, length)
    if end_with_eos:
        prompt[-1] = llm.model_config.eos_token_ids[0]
    result = llm.generate(prompt, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    assert result.error is None and result.finish_reason == "length"
    assert result.token_ids == _hf_greedy(hf, prompt)


@pytest.mark.parametrize("length", [1, 33])
def test_decode_logits_match_transformers_teacher_forced(models, length):
    """Feeding transformers' greedy continuation one token at a time through pocketllm's decode
    path gives, at every step, transformers' logits at that position of the full sequence; the
    logprobs pocketllm reports along its own greedy run are their log-softmax."""
    llm, hf = models
    prompt = _prompt(llm, length)
    continuation = _hf_greedy(hf, prompt)
    reference = _hf_logits(hf, prompt + continuation)
    slot = llm.slots.allocate()
    try:
        steps = [_forward(llm, [slot], [0], [prompt], False)[0]]
        for i, token in enumerate(continuation[:-1]):
            steps.append(_forward(llm, [slot], [length + i], [[token]], True)[0])
    finally:
        llm.slots.free(slot, [])
    for i, logits in enumerate(steps):
        torch.testing.assert_close(logits, reference[length - 1 + i], atol=ATOL, rtol=0, msg=f"step {i}")

    result = llm.generate(prompt, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    assert result.token_ids == continuation
    expected = torch.log_softmax(reference[length - 1:].double(), dim=-1)
    for i, (token, logprob) in enumerate(zip(result.token_ids, result.logprobs)):
        assert logprob == pytest.approx(float(expected[i, token]), abs=ATOL), i
