"""Qwen3.5 hybrids (Gated DeltaNet + gated attention) against Hugging Face transformers, on
random-weight checkpoints of both layouts (text-only and the multimodal wrapper); the parity tests
also on the mixture-of-experts variants (Qwen3-MoE and Qwen3.5-MoE, fused and per-expert experts)."""

from __future__ import annotations

import logging

import pytest
import torch
from helpers import MOE_VARIANTS, QWEN3_5_VARIANTS, hf_model, prompt_of

from pocketllm import LLM, EngineArgs, SamplingParams
from pocketllm.models import ForwardBatch

PROMPT_LENGTHS = [1, 5, 64, 70]


# The parity tests below run on the mixture-of-experts variants too (tests/models/test_moe_families.py: the rest).
@pytest.fixture(scope="module", params=sorted(QWEN3_5_VARIANTS) + sorted(MOE_VARIANTS))
def pair(request, checkpoint_dir):
    path = checkpoint_dir(request.param)
    return path, hf_model(path), LLM(EngineArgs(model=str(path), max_seq_len=160))


@pytest.mark.parametrize("length", PROMPT_LENGTHS)
def test_prefill_and_decode_logits_match_transformers(pair, length):
    """Prefill logits and every decode step's logits (teacher-forced) match transformers."""
    path, hf, llm = pair
    prompt = prompt_of(length)
    continuation = prompt_of(length + 7)[:6]
    with torch.no_grad():
        reference = hf(input_ids=torch.tensor([prompt + continuation])).logits[0]
    slot = llm.slots.allocate()
    try:
        logits = [llm.model.forward(ForwardBatch.build([slot], [0], [prompt], False, "cpu"), llm.cache)[0]]
        for i, token in enumerate(continuation):
            batch = ForwardBatch.build([slot], [length + i], [[token]], True, "cpu")
            logits.append(llm.model.forward(batch, llm.cache)[0])
    finally:
        llm.slots.free(slot, [])
    expected = reference[length - 1:]
    torch.testing.assert_close(torch.stack(logits), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("length", [1, 33, 70])
def test_greedy_tokens_match_transformers(pair, length):
    """24 greedy tokens equal transformers' generate()."""
    _, hf, llm = pair
    prompt = prompt_of(length)
    with torch.no_grad():
        expected = hf.generate(input_ids=torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=24,
                               do_sample=False)[0, length:].tolist()
    result = llm.generate(prompt_tokens=prompt, sampling_params=SamplingParams(max_tokens=24, temperature=0.0,
                                                                               ignore_eos=True))
    assert result.token_ids == expected


def test_vision_and_mtp_tensors_are_skipped_with_one_log_line(checkpoint_dir, caplog):
    """The multimodal layout carries vision and MTP tensors: skipped by rule, said once."""
    path = checkpoint_dir("qwen3.5_mm_untied")
    with caplog.at_level(logging.INFO, logger="pocketllm.models.loader"):
        LLM(EngineArgs(model=str(path), max_seq_len=32))
    lines = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(lines) == 1 and "skipped 2 tensors" in lines[0]


def test_new_tenant_never_sees_previous_state(checkpoint_dir):
    """A request's output is the same in a fresh engine and in a slot that served others before:
    conv and recurrent states are zeroed when a request takes a slot."""
    path = checkpoint_dir("qwen3.5")
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    fresh = LLM(EngineArgs(model=str(path), max_seq_len=64)).generate(prompt_tokens=[7, 8, 9], sampling_params=params)
    used = LLM(EngineArgs(model=str(path), max_seq_len=64))
    used.generate(prompt_tokens=[[200, 100, 50, 25] * 5, [1] * 30], sampling_params=params)
    again = used.generate(prompt_tokens=[7, 8, 9], sampling_params=params)
    assert again.token_ids == fresh.token_ids and again.logprobs == fresh.logprobs


def test_split_prefill_at_chunk_boundary_is_bitwise(checkpoint_dir):
    """A prompt prefilled in one piece equals the same prompt prefilled in two pieces split at an
    absolute chunk boundary (64): logits of the last token and every layer's states, bitwise."""
    path = checkpoint_dir("qwen3.5")
    llm = LLM(EngineArgs(model=str(path), max_seq_len=160))
    prompt = prompt_of(100)
    one, two = llm.slots.allocate(), llm.slots.allocate()
    whole = llm.model.forward(ForwardBatch.build([one], [0], [prompt], False, "cpu"), llm.cache)
    llm.model.forward(ForwardBatch.build([two], [0], [prompt[:64]], False, "cpu"), llm.cache)
    pieces = llm.model.forward(ForwardBatch.build([two], [64], [prompt[64:]], False, "cpu"), llm.cache)
    assert torch.equal(whole, pieces)
    for state in llm.cache.recurrent + llm.cache.conv:
        if state is not None:
            assert torch.equal(state[one], state[two])
