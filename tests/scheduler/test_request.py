"""Request and validate_prompt on their own: what a request feeds the runner at each stage, when
it finishes and why, what its slot holds afterwards, and which prompts are refused."""

from __future__ import annotations

import pytest

from pocketllm.outputs import GenerationResult
from pocketllm.runner import SequenceOutput, TokenLogprob
from pocketllm.sampling import SamplingParams
from pocketllm.scheduler.policy import PrefillPolicy
from pocketllm.scheduler.request import Request, RequestStatus, validate_prompt

EOS = (9, 10)


def _request(max_tokens: int = 4, stop=(), ignore_eos: bool = False) -> Request:
    params = SamplingParams(max_tokens=max_tokens, stop_token_ids=stop, ignore_eos=ignore_eos, seed=5)
    request = Request(7, [1, 2, 3], params, seed=5, eos_token_ids=EOS)
    request.slot = 2
    return request


def test_inputs_at_each_stage():
    """Prefill feeds the prompt from position 0; each decode feeds the last token at the number of
    tokens already cached (the prompt and every generated token but the last)."""
    request = _request()
    assert request.status is RequestStatus.WAITING and not request.finished
    assert request.num_cached == 0 and request.held_tokens() == [] and request.prefilling
    prefill = request.prefill_input(PrefillPolicy())
    assert (prefill.slot, prefill.start, prefill.token_ids, prefill.seed) == (2, 0, [1, 2, 3], 5)
    assert prefill.params is request.params and prefill.sample and not prefill.decode
    request.advance(prefill, SequenceOutput(TokenLogprob(40, -1.5)))
    assert request.num_cached == 3 and not request.prefilling
    decode = request.decode_input()
    assert (decode.slot, decode.start, decode.token_ids, decode.seed) == (2, 3, [40], 5)
    request.append(TokenLogprob(41, -0.5))
    decode = request.decode_input()
    assert (decode.start, decode.token_ids) == (4, [41])
    assert request.num_cached == 4 and request.held_tokens() == [1, 2, 3, 40]


def test_length_finish_and_result():
    request = _request(max_tokens=2)
    request.advance(request.prefill_input(PrefillPolicy()), SequenceOutput(TokenLogprob(40, -1.5)))
    assert not request.finished and request.first_token_time is not None
    first_time = request.first_token_time
    request.append(TokenLogprob(41, -0.25))
    assert request.finished and request.status is RequestStatus.FINISHED
    assert request.finish_reason == "length" and request.error is None
    assert request.first_token_time == first_time and request.finish_time >= first_time
    result = request.result()
    assert isinstance(result, GenerationResult)
    assert (result.request_id, result.prompt_tokens, result.token_ids, result.logprobs) == (7, [1, 2, 3], [40, 41],
                                                                                            [-1.5, -0.25])
    assert (result.finish_reason, result.error, result.seed) == ("length", None, 5)
    assert result.ttft_s == first_time - request.submit_time and result.ttft_s >= 0
    assert result.total_time_s == request.finish_time - request.submit_time
    assert request.held_tokens() == [1, 2, 3, 40]


@pytest.mark.parametrize("token,ignore_eos,stops", [(9, False, True), (10, False, True), (9, True, False),
                                                    (33, True, True), (33, False, True), (34, False, False)])
def test_stop_tokens_and_eos(token, ignore_eos, stops):
    """EOS ids stop a request unless ignore_eos; its own stop ids always do; the stop token is kept."""
    request = _request(max_tokens=5, stop=(33,), ignore_eos=ignore_eos)
    request.append(TokenLogprob(token, -1.0))
    assert request.finished is stops
    assert request.finish_reason == ("stop" if stops else None)
    assert request.token_ids == [token]


def test_unfinished_result_has_no_times():
    request = _request()
    result = request.result()
    assert result.ttft_s is None and result.total_time_s is None and result.finish_reason is None
    request.finish("error", "boom")
    assert request.result().error == "boom" and request.result().finish_reason == "error"
    assert request.result().ttft_s is None and request.result().total_time_s is not None


def test_result_lists_are_copies():
    request = _request()
    request.append(TokenLogprob(40, -1.0))
    result = request.result()
    result.token_ids.append(99)
    result.prompt_tokens.append(99)
    result.logprobs.append(0.0)
    assert request.token_ids == [40] and request.prompt_tokens == [1, 2, 3] and request.logprobs == [-1.0]


PARAMS = SamplingParams(max_tokens=4)


def test_validate_prompt_accepts_and_copies():
    prompt = (0, 5, 99)
    out = validate_prompt(prompt, PARAMS, vocab_size=100, max_seq_len=7)
    assert out == [0, 5, 99] and isinstance(out, list)
    assert validate_prompt([1, 2, 3], SamplingParams(max_tokens=4, stop_token_ids=(99,)), 100, 7) == [1, 2, 3]


NOT_INTS = r"prompt_tokens must be a list of ints, got {} \(a 1-D integer numpy array or torch tensor is accepted too\)"


@pytest.mark.parametrize("prompt,params,error,message", [
    ([1], None, TypeError, r"sampling_params must be a SamplingParams, got NoneType"),
    ([1], "greedy", TypeError, r"sampling_params must be a SamplingParams, got str"),
    ("abc", PARAMS, TypeError, NOT_INTS.format("str")),
    (b"ab", PARAMS, TypeError, NOT_INTS.format("bytes")),
    (5, PARAMS, TypeError, NOT_INTS.format("int")),
    ([], PARAMS, ValueError, r"prompt_tokens must not be empty"),
    ([1, 2.0], PARAMS, TypeError, r"prompt_tokens\[1\] must be an int, got float"),
    ([True], PARAMS, TypeError, r"prompt_tokens\[0\] must be an int, got bool"),
    ([1, 100], PARAMS, ValueError, r"prompt_tokens\[1\]=100 is outside the vocabulary \[0, 100\)"),
    ([-1], PARAMS, ValueError, r"prompt_tokens\[0\]=-1 is outside the vocabulary \[0, 100\)"),
    ([1], SamplingParams(stop_token_ids=(100,)), ValueError,
     r"stop_token_ids entry 100 is outside the vocabulary \[0, 100\)"),
    ([1, 2, 3, 4], PARAMS, ValueError, r"prompt length 4 \+ max_tokens 4 exceeds max_seq_len 7"),
])
def test_validate_prompt_refuses(prompt, params, error, message):
    with pytest.raises(error, match=f"^{message}$"):  # the whole message: nothing added around it
        validate_prompt(prompt, params, vocab_size=100, max_seq_len=7)


def test_a_long_prompt_is_fed_in_pieces_cut_on_the_policy_grid():
    """Pieces end at request-local multiples of the chunk size and of the snapshot interval; only
    the last one samples; a reused prefix starts the first piece at its end."""
    params = SamplingParams(max_tokens=2, seed=1)
    request = Request(1, list(range(300)), params, seed=1)
    request.slot = 0
    policy = PrefillPolicy(max_num_batched_tokens=1000, chunk_size=128, snapshot_interval=192)
    pieces = []
    while request.prefilling:
        piece = request.prefill_input(policy)
        pieces.append((piece.start, len(piece.token_ids), piece.sample))
        request.advance(piece, SequenceOutput(TokenLogprob(7, -1.0) if piece.sample else None))
    assert pieces == [(0, 128, False), (128, 64, False), (192, 64, False), (256, 44, True)]
    assert request.token_ids == [7] and request.num_cached == 300
    warm = Request(2, list(range(300)), params, seed=1)
    warm.slot, warm.num_prefilled = 1, 192
    assert (warm.prefill_input(policy).start, len(warm.prefill_input(policy).token_ids)) == (192, 64)
