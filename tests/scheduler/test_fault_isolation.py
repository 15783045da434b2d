"""Fault isolation: a failure while computing one request (an op that raises, non-finite output,
out of memory for an oversized prompt) ends that request with "error"; its batch-mates finish
with tokens and logprobs bitwise equal to their serial run, and every slot is free afterwards."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pocketllm import LLM, EngineArgs, SamplingParams
from pocketllm.runner import non_finite_rows

from .faults import SeedFault, SlotFault, fault_seed, install

MAX_SEQ_LEN = 64
PROMPTS = [[5, 6, 7], [1, 2, 3, 4, 9, 9, 9, 9, 9, 9, 9], [8], [3, 1, 4, 1, 5]]
PARAMS = [SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
          SamplingParams(max_tokens=6, temperature=0.9, seed=11, ignore_eos=True),
          SamplingParams(max_tokens=4, temperature=1.0, top_k=20, seed=12, ignore_eos=True),
          SamplingParams(max_tokens=5, temperature=0.7, top_p=0.9, seed=13, ignore_eos=True)]
VICTIM = 1  # submitted second: slot 1, and the longest prompt
FAULTS = {
    "prefill-raise": dict(phase="prefill", kind="raise", slot=VICTIM),
    "prefill-nan": dict(phase="prefill", kind="nan", slot=VICTIM),
    "prefill-oom": dict(phase="prefill", kind="oom", oom_len=len(PROMPTS[VICTIM]) - 1),
    "decode-raise": dict(phase="decode", kind="raise", slot=VICTIM, min_len=len(PROMPTS[VICTIM]) + 2),
    "decode-nan": dict(phase="decode", kind="nan", slot=VICTIM, min_len=len(PROMPTS[VICTIM]) + 2),
}


def _args(path, batched: bool) -> EngineArgs:
    return EngineArgs(model=str(path), max_seq_len=MAX_SEQ_LEN,
                      backend_options={"enable_batching": batched, "max_batch_size": len(PROMPTS),
                                       "background_thread": False})


@pytest.fixture(scope="module")
def serial_runs(checkpoint_dir):
    """variant -> the serial results of PROMPTS/PARAMS on an engine without faults."""
    runs = {}

    def get(variant: str):
        if variant not in runs:
            llm = LLM(_args(checkpoint_dir(variant), batched=False))
            runs[variant] = [llm.generate(p, sp) for p, sp in zip(PROMPTS, PARAMS)]
        return runs[variant]

    return get


@pytest.mark.parametrize("variant", ["tiny", "qwen3.5"])
@pytest.mark.parametrize("fault_name", sorted(FAULTS))
def test_one_failing_request_leaves_its_batch_mates_exact(checkpoint_dir, serial_runs, monkeypatch, drain,
                                                          variant, fault_name):
    """All four requests share each prefill and decode forward; the fault strikes the victim's rows
    only. The victim ends "error" with a message (keeping the tokens it had), the others equal their
    serial runs bitwise, the scheduler counts one error and frees every slot."""
    serial = serial_runs(variant)
    fault = SlotFault(**FAULTS[fault_name])
    install(monkeypatch, fault.edit)
    with LLM(_args(checkpoint_dir(variant), batched=True)) as llm:
        s = llm.scheduler
        ids = [s.submit_request(p, sp) for p, sp in zip(PROMPTS, PARAMS)]
        drain(s)
        results = [s.poll_result(rid) for rid in ids]
        assert fault.strikes > 0
        victim = results[VICTIM]
        assert victim.finish_reason == "error" and victim.error
        expected_tokens = 0 if fault.phase == "prefill" else fault.min_len - len(PROMPTS[VICTIM])
        assert victim.token_ids == serial[VICTIM].token_ids[:expected_tokens]
        if fault.kind == "nan":
            assert "non-finite" in victim.error
        for i, (got, want) in enumerate(zip(results, serial)):
            if i != VICTIM:
                assert got.finish_reason == want.finish_reason == "length", i
                assert (got.token_ids, got.logprobs) == (want.token_ids, want.logprobs), i
        assert llm.slots.num_free == len(PROMPTS)
        stats = s.get_stats()
        assert (stats.errored, stats.finished, stats.running, stats.waiting) == (1, len(PROMPTS) - 1, 0, 0)
        assert llm.slots.held_tokens(VICTIM) == []  # a failed request's slot claims no contents


def test_sampler_fault_after_a_recurrent_forward_restores_states(checkpoint_dir, serial_runs, monkeypatch, drain):
    """The sampler fails (after the whole Qwen3.5 forward has advanced every slot's Gated DeltaNet
    state) for one request's second token: the batch is rerun request by request from restored
    states, so the others still equal their serial runs."""
    serial = serial_runs("qwen3.5")
    fault = SeedFault()
    install(monkeypatch, fault.edit)
    params = list(PARAMS)
    position = len(PROMPTS[VICTIM]) + 1
    params[VICTIM] = SamplingParams(max_tokens=6, temperature=0.9, seed=fault_seed(0, 1, position), ignore_eos=True)
    with LLM(_args(checkpoint_dir("qwen3.5"), batched=True)) as llm:
        s = llm.scheduler
        ids = [s.submit_request(p, sp) for p, sp in zip(PROMPTS, params)]
        drain(s)
        results = [s.poll_result(rid) for rid in ids]
    assert fault.strikes == 2  # batched, then alone
    assert results[VICTIM].finish_reason == "error" and len(results[VICTIM].token_ids) == 1
    for i, (got, want) in enumerate(zip(results, serial)):
        if i != VICTIM:
            assert (got.token_ids, got.logprobs) == (want.token_ids, want.logprobs), i


def test_non_finite_logits_end_a_serial_request_with_error(tiny_checkpoint, monkeypatch):
    """Serial mode too: NaN logits end the request with "error", not token 0 with a NaN logprob;
    the next request is served normally."""
    fault = SlotFault(phase="decode", kind="nan", slot=0, min_len=4)
    install(monkeypatch, fault.edit)
    llm = LLM(_args(tiny_checkpoint, batched=False))
    result = llm.generate([1, 2], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert result.finish_reason == "error" and "non-finite" in result.error
    assert len(result.token_ids) == 2 and all(lp == lp for lp in result.logprobs)  # no NaN logprob
    fault.phase = "none"
    ok = llm.generate([1, 2], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert ok.finish_reason == "length" and ok.token_ids[:2] == result.token_ids
    assert llm.slots.num_free == llm.cache.num_slots


def test_non_finite_rows_are_found_and_finite_rows_whose_sum_overflows_are_not():
    """The check of a step's logits names every row holding a NaN, +inf or -inf (one of each, and a
    row with +inf and -inf, whose sum is NaN), and passes rows of finite logits whose sum overflows to
    inf, which a check of the sums alone would fail."""
    logits = torch.randn(7, 300)
    assert non_finite_rows(logits) == []
    logits[1, 5], logits[2, 0], logits[4, 299] = float("nan"), float("inf"), float("-inf")
    logits[6, 3], logits[6, 7] = float("inf"), float("-inf")
    logits[0, :2] = 3.0e38  # finite, and its row's sum is +inf in fp32
    assert torch.isinf(logits[0].sum())
    assert non_finite_rows(logits) == [1, 2, 4, 6]
    assert non_finite_rows(logits[[0, 3, 5]]) == []


def test_keyboard_interrupt_in_a_forward_propagates_and_loses_no_request(tiny_checkpoint, monkeypatch, drain):
    """An exception that is not an Exception (KeyboardInterrupt) inside a forward propagates from
    step(); the requests of that forward end "error", their slots are free, the others go on."""
    class Interrupt:
        armed = False

        def edit(self, ops):
            real = ops.decode_attention

            def decode_attention(*args):
                if self.armed:
                    raise KeyboardInterrupt
                return real(*args)

            return dataclasses.replace(ops, decode_attention=decode_attention)

    interrupt = Interrupt()
    install(monkeypatch, interrupt.edit)
    with LLM(_args(tiny_checkpoint, batched=True)) as llm:
        s = llm.scheduler
        first = [s.submit_request(p, sp) for p, sp in zip(PROMPTS[:2], PARAMS[:2])]
        s.step()  # prefill only
        interrupt.armed = True
        with pytest.raises(KeyboardInterrupt):
            s.step()  # the decode of `first` is interrupted
        interrupt.armed = False
        late = s.submit_request(PROMPTS[2], PARAMS[2])
        drain(s)
        assert [s.poll_result(rid).finish_reason for rid in first] == ["error", "error"]
        assert s.poll_result(late).finish_reason == "length"
        assert llm.slots.num_free == len(PROMPTS)
