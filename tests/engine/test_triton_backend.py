"""The triton backend end to end: same model, same scheduler, every hot op a Triton kernel.

On CPU the kernels run under the Triton interpreter, so shapes stay tiny; the GPU tests repeat
the checks in bf16 (and fp32) at realistic sizes. The batched == serial property on this backend
is in test_invariance.py."""

from __future__ import annotations

import random

import pytest
import torch

from pocketllm import LLM, EngineArgs, SamplingParams, write_checkpoint

MAX_SEQ_LEN = 64


def hf_greedy(path, prompt: list[int], steps: int, device: str = "cpu", dtype=torch.float32) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation="eager").to(device)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt], device=device), max_new_tokens=steps, do_sample=False,
                             min_new_tokens=steps)
    return out[0, len(prompt):].tolist()


def random_workload(seed: int, count: int, vocab: int, max_prompt: int, max_tokens: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(1, max_prompt))] for _ in range(count)]
    params = [SamplingParams(max_tokens=rng.randint(1, max_tokens), temperature=rng.choice([0.0, 0.9]),
                             top_k=rng.choice([0, 7]), top_p=rng.choice([1.0, 0.8]), seed=rng.randrange(2**64))
              for _ in range(count)]
    return prompts, params


def assert_batched_equals_serial(path, prompts, params, device: str, dtype: str, max_batch_size: int,
                                 max_seq_len: int) -> None:
    common = dict(model=str(path), backend="triton", device=device, dtype=dtype, max_seq_len=max_seq_len)
    serial = LLM(EngineArgs(**common)).generate(prompt_tokens=prompts, sampling_params=params)
    options = {"enable_batching": True, "max_batch_size": max_batch_size, "background_thread": False}
    with LLM(EngineArgs(**common, backend_options=options)) as llm:
        batched = llm.generate(prompt_tokens=prompts, sampling_params=params)
    for s, b in zip(serial, batched):
        assert s.finish_reason in ("stop", "length") and b.finish_reason == s.finish_reason, (s.error, b.error)
        assert b.token_ids == s.token_ids and b.logprobs == s.logprobs


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["tiny", "untied_gqa4_bias"])
def test_triton_greedy_tokens_match_transformers(checkpoint_dir, variant):
    """Greedy tokens of the triton backend (interpreted) equal transformers' for 20 steps."""
    path = checkpoint_dir(variant)
    llm = LLM(EngineArgs(model=str(path), backend="triton", max_seq_len=MAX_SEQ_LEN))
    for prompt in ([5], list(range(3, 40, 2))):
        result = llm.generate(prompt_tokens=prompt,
                              sampling_params=SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
        assert result.error is None
        assert result.token_ids == hf_greedy(path, prompt, 20)


def test_triton_logits_match_torch_backend(tiny_checkpoint):
    """Both backends agree on the logprobs of the same greedy continuation, within fp32 tolerance."""
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompt = [9, 8, 7, 6, 5, 4, 3, 2, 1, 200, 100]
    results = {backend: LLM(EngineArgs(model=str(tiny_checkpoint), backend=backend, max_seq_len=MAX_SEQ_LEN))
               .generate(prompt_tokens=prompt, sampling_params=params) for backend in ("torch", "triton")}
    assert results["triton"].token_ids == results["torch"].token_ids
    torch.testing.assert_close(torch.tensor(results["triton"].logprobs), torch.tensor(results["torch"].logprobs),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_triton_qwen3_5_greedy_matches_transformers(checkpoint_dir):
    """Qwen3.5 (Gated DeltaNet kernels, gated attention) on the interpreted triton backend:
    greedy tokens equal transformers' for 12 steps, from a prompt crossing a 64-token chunk."""
    from transformers import AutoModelForCausalLM

    path = checkpoint_dir("qwen3.5")
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager")
    hf.generation_config.eos_token_id = None
    llm = LLM(EngineArgs(model=str(path), backend="triton", max_seq_len=96))
    prompt = list(range(3, 70))
    result = llm.generate(prompt_tokens=prompt, sampling_params=SamplingParams(max_tokens=12, temperature=0.0,
                                                                               ignore_eos=True))
    with torch.no_grad():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False)
    assert result.token_ids == expected[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def gpu_checkpoint(tmp_path_factory):
    """A 12-layer, 1024-wide random Qwen3 (about 190M parameters with the 32k vocabulary)."""
    return write_checkpoint(tmp_path_factory.mktemp("gpu_ckpt"), "small", seed=3, init_std=0.05,
                            hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
                            num_attention_heads=16, num_key_value_heads=4, head_dim=128)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gpu_batched_equals_serial(gpu_checkpoint, dtype):
    """On CUDA, real sizes: 24 mixed requests through 8 slots equal their serial runs bitwise."""
    prompts, params = random_workload(7, count=24, vocab=32000, max_prompt=700, max_tokens=40)
    assert_batched_equals_serial(gpu_checkpoint, prompts, params, "cuda", dtype, max_batch_size=8,
                                 max_seq_len=1024)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gpu_qwen3_5_batched_equals_serial(tmp_path, dtype):
    """On CUDA: a Qwen3.5 hybrid at realistic width, 16 mixed requests through 4 slots, bitwise."""
    path = write_checkpoint(tmp_path / "q35", "qwen3.5-small", seed=5, init_std=0.05)
    prompts, params = random_workload(11, count=16, vocab=32000, max_prompt=300, max_tokens=24)
    assert_batched_equals_serial(path, prompts, params, "cuda", dtype, max_batch_size=4, max_seq_len=512)


@pytest.mark.gpu
def test_gpu_greedy_matches_transformers_fp32(gpu_checkpoint, monkeypatch):
    """On CUDA in fp32 (IEEE dots), the triton backend's greedy tokens equal transformers'."""
    prompt = list(range(100, 400))
    llm = LLM(EngineArgs(model=str(gpu_checkpoint), backend="triton", device="cuda", max_seq_len=512))
    result = llm.generate(prompt_tokens=prompt, sampling_params=SamplingParams(max_tokens=24, temperature=0.0,
                                                                               ignore_eos=True))
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)  # restored after the test
    assert result.token_ids == hf_greedy(gpu_checkpoint, prompt, 24, device="cuda")

