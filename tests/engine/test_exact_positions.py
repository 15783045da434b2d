"""Exact positions (`backend_options["exact_positions"]`): a position's logprobs are bitwise the same
whether it was decoded, prefilled inside a piece of any length cut anywhere, or scored, so a
generation's logprobs equal the logprobs of scoring the same sequence (`prompt_logprobs`).

Checked on the model's forward (Hypothesis: random sequences, random cuts, every position decoded
as well) and on the engine (generate, then score prompt + output, serial and batched, with prefix
reuse and swap preemption), on the torch backend at a realistic width and the triton backend
(interpreted here) at a tiny one. Negative controls, defects planted by construction (tests/planted.py)
so that they fail on every machine: a decode attention whose rows round differently from prefilled
ones (the defect of decoding through the split-KV merge) on either backend, a prefill attention whose
pieces round their first row differently (a cut changes the bits), and an RMSNorm whose reduction is
blocked by the token count (the trap that makes a scoring pass and a decode step disagree). With the
option off, the paths still agree to the reference tolerance (whether they differ in the bits is
the machine's business, so nothing asserts it)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import budget
from hypothesis import given, settings
from hypothesis import strategies as st

from pocketllm import LLM, EngineArgs, SamplingParams, write_checkpoint
from pocketllm.kernels import IMPLEMENTATIONS
from pocketllm.kernels.decode_attention import decode_attention_split_kv
from pocketllm.kernels.rms_norm import rms_norm_ref
from pocketllm.runner import SequenceInput
from pocketllm.sampling import MAX_LOGPROBS
from pocketllm.testing.planted import (
    decode_attention_nudged,
    decode_attention_triton_nudged,
    prefill_attention_first_row_nudged,
)

SCORE = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=MAX_LOGPROBS)


@pytest.fixture(scope="module")
def wide_checkpoint(tmp_path_factory):
    """The `small` preset's width (hidden 512, vocab 32000) in two layers: realistic row sizes for
    the BLAS, quick forwards."""
    return write_checkpoint(tmp_path_factory.mktemp("wide"), "small", seed=4, num_hidden_layers=2)


def _engine(path, backend: str = "torch", exact: bool | None = True, batched: bool = False,
            overrides: dict | None = None, **options) -> LLM:
    return LLM(EngineArgs(model=str(path), max_seq_len=256, backend=backend, op_overrides=overrides, backend_options={
        "exact_positions": exact, "enable_batching": batched, "background_thread": False, **options}))


def _scores(llm: LLM, tokens: list[int], cuts: list[int]) -> list:
    """The scores (logprob and top alternatives of the next token) of positions 0 .. len - 2 of
    `tokens`, prefilled in slot 0 in pieces ending at `cuts` (then at the end), or, for cuts None,
    position 0 prefilled and every later position a decode row."""
    run, pieces, scores = llm.runner.run, [], []
    if cuts is None:
        pieces = [(0, 1, False)] + [(p, p + 1, True) for p in range(1, len(tokens) - 1)]
    else:
        bounds = [0] + cuts + [len(tokens) - 1]
        pieces = [(lo, hi, False) for lo, hi in zip(bounds, bounds[1:]) if hi > lo]
    for lo, hi, decode in pieces:
        seq = SequenceInput(0, lo, tokens[lo:hi], SCORE, seed=0, decode=decode, sample=False,
                            targets=tokens[lo + 1:hi + 1])
        scores += run([seq])[0].scores
    return scores


def _mismatch(llm: LLM, tokens: list[int], cuts: list[int]) -> str | None:
    """Where the pieces, the whole sequence and the decode steps disagree (None: nowhere)."""
    whole = _scores(llm, tokens, [])
    for name, other in ((f"cut at {cuts}", _scores(llm, tokens, cuts)), ("decoded", _scores(llm, tokens, None))):
        for position, (a, b) in enumerate(zip(whole, other)):
            if a != b:
                return f"position {position}, {name}: {b.logprob!r} vs one piece {a.logprob!r}"
    return None


sequences = st.integers(2, 90).flatmap(lambda n: st.tuples(
    st.lists(st.integers(0, 255), min_size=n, max_size=n),
    st.lists(st.integers(1, n - 1), max_size=4, unique=True).map(sorted)))


@pytest.mark.slow
@settings(max_examples=budget(0.3))
@given(case=sequences)
def test_positions_are_exact_on_the_torch_backend_at_a_realistic_width(wide_checkpoint, case):
    tokens, cuts = case
    llm = _engine_cache(wide_checkpoint, "torch")
    assert _mismatch(llm, tokens, cuts) is None


@pytest.mark.slow
@settings(max_examples=budget(0.1))
@given(case=st.integers(2, 12).flatmap(lambda n: st.tuples(
    st.lists(st.integers(0, 255), min_size=n, max_size=n),
    st.lists(st.integers(1, n - 1), max_size=2, unique=True).map(sorted))))
def test_positions_are_exact_on_the_triton_backend(tiny_checkpoint, case):
    tokens, cuts = case
    assert _mismatch(_engine_cache(tiny_checkpoint, "triton"), tokens, cuts) is None


_ENGINES: dict = {}


def _engine_cache(path, backend: str) -> LLM:
    """One engine per checkpoint and backend for all of a property's examples."""
    key = (str(path), backend)
    if key not in _ENGINES:
        _ENGINES[key] = _engine(path, backend)
    return _ENGINES[key]


def _counting_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """An RMSNorm whose reduction is split in blocks chosen from the token count (as a kernel that
    sizes its blocks from the batch would): one row alone sums its squares in one pass, several
    rows in two halves."""
    if x.shape[0] == 1:
        return rms_norm_ref(x, weight, eps)
    half = x.shape[-1] // 2
    squares = x.float().pow(2)
    mean = (squares[..., :half].sum(-1, keepdim=True) + squares[..., half:].sum(-1, keepdim=True)) / x.shape[-1]
    return weight * (x.float() * torch.rsqrt(mean + eps)).to(x.dtype)


def _control_case(backend: str, wide_checkpoint, tiny_checkpoint) -> tuple:
    """(checkpoint, tokens) of the controls: the realistic width on torch, the tiny one (interpreted) on triton."""
    path, length = (wide_checkpoint, 70) if backend == "torch" else (tiny_checkpoint, 12)
    return path, [(7 * i + 3) % 256 for i in range(length)]


@pytest.mark.parametrize("backend,overrides,kind", [
    ("torch", {"decode_attention": decode_attention_nudged}, "decoded"),
    ("torch", {"prefill_attention": prefill_attention_first_row_nudged}, "cut at"),
    pytest.param("triton", {"decode_attention": decode_attention_triton_nudged}, "decoded", marks=pytest.mark.slow),
    ("torch", {"rms_norm": _counting_rms_norm}, "decoded"),
], ids=["decode_attention_nudged", "prefill_first_row_nudged", "triton_decode_attention_nudged",
        "rms_norm_blocked_by_token_count"])
def test_the_checks_fail_when_one_path_rounds_differently(wide_checkpoint, tiny_checkpoint, backend, overrides,
                                                          kind):
    """Negative controls: with exact positions on and one path planted to round differently, the
    same comparison finds a differing position, of the kind the defect makes (the cut is compared
    first, so a decode defect shows as "decoded" only if the cut agreed)."""
    path, tokens = _control_case(backend, wide_checkpoint, tiny_checkpoint)
    llm = _engine(path, backend, overrides=overrides)
    mismatch = _mismatch(llm, tokens, [len(tokens) // 2])
    assert mismatch is not None and f", {kind}" in mismatch, mismatch


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.slow)])
def test_without_exact_positions_the_paths_agree_to_tolerance(wide_checkpoint, tiny_checkpoint, backend):
    """exact_positions=False (the split-KV decode on triton) is a working engine: decoded and cut
    positions score within tolerance of one piece. Their bits may or may not differ."""
    path, tokens = _control_case(backend, wide_checkpoint, tiny_checkpoint)
    llm = _engine(path, backend, exact=False)
    assert not llm.capabilities.exact_positions
    if backend == "triton":
        assert llm.runner.model.ops.decode_attention is decode_attention_split_kv
    whole = [score.logprob for score in _scores(llm, tokens, [])]
    for cuts in ([len(tokens) // 2], None):
        assert [score.logprob for score in _scores(llm, tokens, cuts)] == pytest.approx(whole, abs=1e-4)


def _generation_and_score(llm: LLM, prompts, params):
    """Each prompt generated, then prompt + output scored: (generated, scored) logprobs and top-k."""
    generated = llm.generate(prompts, params)
    scored = llm.generate([p + g.token_ids for p, g in zip(prompts, generated)], [SCORE] * len(prompts))
    pairs = []
    for prompt, g, s in zip(prompts, generated, scored):
        n = len(prompt)  # generated token i sits at position n + i of the scored sequence
        pairs.append(((g.logprobs, g.top_logprobs),
                      (s.prompt_logprobs[n:], [top[:3] for top in s.prompt_top_logprobs[n:]])))
    return pairs


def _workload(vocab: int):
    prompts = [[(11 * i + j) % vocab for i in range(length)] for j, length in enumerate((70, 5, 130))]
    prompts.append(prompts[0][:64] + [1, 2, 3])  # waits for a slot, then reuses the first's 64 positions
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3),
              SamplingParams(max_tokens=9, seed=3, temperature=0.9, ignore_eos=True, logprobs=3),
              SamplingParams(max_tokens=6, seed=4, top_k=20, ignore_eos=True, logprobs=3),
              SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=3)]
    return prompts, params


@pytest.mark.parametrize("batched", [False, True], ids=["serial", "batched"])
def test_generated_logprobs_equal_the_scores_of_the_same_sequence(wide_checkpoint, batched):
    """torch backend: every generated token's logprob and top 3 equal those of scoring prompt +
    output, serial and batched (4 requests in 2 slots: two wait, one of them reusing a prefix)."""
    prompts, params = _workload(32000)
    llm = _engine(wide_checkpoint, batched=batched, max_batch_size=2, prefill_chunk_size=64,
                  state_snapshot_interval=64)
    for generated, scored in _generation_and_score(llm, prompts, params):
        assert generated == scored
    if batched:
        assert llm.scheduler.get_stats().prefix_hits >= 1


@pytest.mark.slow
def test_triton_generated_logprobs_equal_the_scores(tiny_checkpoint):
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    params = [SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=3),
              SamplingParams(max_tokens=3, seed=1, ignore_eos=True, logprobs=3)]
    llm = _engine(tiny_checkpoint, "triton", exact=None, batched=True)
    assert llm.capabilities.exact_positions
    for generated, scored in _generation_and_score(llm, prompts, params):
        assert generated == scored


def test_swapped_requests_still_score_as_they_generated(wide_checkpoint):
    """Batched with every request swapped out once mid-generation: the same equality."""
    prompts, params = _workload(32000)
    llm = _engine(wide_checkpoint, batched=True, max_batch_size=4, prefill_chunk_size=64, state_snapshot_interval=64)
    s = llm.scheduler
    ids = [s.submit_request(p, sp) for p, sp in zip(prompts, params)]
    for step in range(200):
        if step == 5:
            for i in ids:
                s.preempt(i)
        if not s.step():
            break
    assert s.get_stats().preemptions == len(ids)
    results = [s.poll_result(i, None) for i in ids]
    scored = llm.generate([p + r.token_ids for p, r in zip(prompts, results)], [SCORE] * len(prompts))
    for prompt, r, sc in zip(prompts, results, scored):
        assert r.logprobs == sc.prompt_logprobs[len(prompt):]


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.slow)])
def test_the_next_turn_reuses_the_previous_answer(tiny_checkpoint, backend):
    """Turn 2 extends turn 1's prompt and answer (torch: 100 + 40 tokens): with exact positions it
    reuses every position turn 1's slot holds (139, the decoded ones among them; an attention-only
    model reuses to the token) and gets the bits of a cold run; without, only the grid below the
    prompt's end (64)."""
    path, prompt_len, answer = tiny_checkpoint, *((100, 40) if backend == "torch" else (70, 2))
    greedy = lambda n: SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)  # noqa: E731
    prompt = [(5 * i + 1) % 200 for i in range(prompt_len)]
    reused = {}
    for exact in (True, False):
        llm = _engine(path, backend, exact=exact, batched=True, max_batch_size=2, prefill_chunk_size=64,
                      state_snapshot_interval=64)
        first = llm.generate(prompt, greedy(answer))
        second_prompt = prompt + first.token_ids + [7] * 3
        second = llm.generate(second_prompt, greedy(3))
        reused[exact] = llm.scheduler.get_stats().prefix_tokens_reused
        cold = _engine(path, backend, exact=exact).generate(second_prompt, greedy(3))
        assert (second.token_ids, second.logprobs) == (cold.token_ids, cold.logprobs)
    assert reused == {True: prompt_len + answer - 1, False: prompt_len // 64 * 64}


def test_prompts_are_cut_where_the_budget_runs_out_and_keep_their_bits(tiny_checkpoint, monkeypatch):
    """With exact positions a piece that does not fit is cut at the step's budget (starts off the
    64-grid), and every request still equals its cold serial run in one piece (no cuts at all)."""
    from tests.scheduler.harness import RunRecorder

    prompts = [[(13 * i + j) % 250 for i in range(length)] for j, length in enumerate((150, 90, 7, 200))]
    params = [SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=2),
              SamplingParams(max_tokens=4, seed=2, ignore_eos=True)] * 2
    cold = _engine(tiny_checkpoint, prefill_chunk_size=0, state_snapshot_interval=0)
    expected = [_outputs(cold.generate(p, sp)) for p, sp in zip(prompts, params)]
    llm = _engine(tiny_checkpoint, batched=True, max_batch_size=3, max_num_batched_tokens=66)
    recorder = RunRecorder(llm, monkeypatch)
    assert [_outputs(r) for r in llm.generate(prompts, params)] == expected
    starts = [start for part in recorder.prefills() for _, start, _ in part]
    assert any(start % 64 for start in starts), starts


def _outputs(result) -> tuple:
    return result.token_ids, result.logprobs, result.top_logprobs, result.finish_reason


def test_capabilities_say_where_positions_are_exact(tiny_checkpoint, checkpoint_dir):
    """On by default on both backends (torch: where its C++ kernels build, as here), off by default
    with per-row decode, on a Gated DeltaNet hybrid too, never with invariance off."""
    default = _engine(tiny_checkpoint, exact=None)
    assert default.capabilities.exact_positions is True
    assert default.model.ops.linear is default.model.ops.prefill_linear is IMPLEMENTATIONS["linear"]["fixed_order"]
    assert _engine(tiny_checkpoint, exact=None, decode_per_row=True).capabilities.exact_positions is False
    assert _engine(tiny_checkpoint, exact=True).capabilities.exact_positions is True
    assert _engine(tiny_checkpoint, exact=True, batch_invariant=False).capabilities.exact_positions is False
    assert _engine(checkpoint_dir("qwen3.5"), exact=True).capabilities.exact_positions is True
    assert _engine(checkpoint_dir("qwen3.5"), exact=False).cache.replay == [None] * 4


def test_per_row_decode_needs_exact_positions_off(tiny_checkpoint):
    with pytest.raises(ValueError, match=r"decode_per_row'\]=True needs backend_options\['exact_positions'\]=False"):
        _engine(tiny_checkpoint, exact=True, decode_per_row=True)


def test_without_a_compiler_the_torch_default_is_the_mkl_tiles_after_a_warning(tmp_path):
    """Where the C++ kernels cannot be built, the torch backend warns once, naming why, and runs its
    MKL-tile configuration (exact positions off); batched output still equals serial output."""
    script = textwrap.dedent("""
        import warnings
        from pocketllm import LLM, EngineArgs, SamplingParams, write_checkpoint
        path = write_checkpoint("ckpt", "tiny", seed=0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            serial = LLM(EngineArgs(model=str(path), max_seq_len=128))
        batched = LLM(EngineArgs(model=str(path), max_seq_len=128, backend_options={"enable_batching": True}))
        params = SamplingParams(max_tokens=6, temperature=0.8, seed=3)
        prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
        together = batched.generate(prompts, params)
        alone = [serial.generate(p, params) for p in prompts]
        print(serial.capabilities.exact_positions, serial.model.ops.linear.__name__)
        print([(a.token_ids, a.logprobs) for a in alone] == [(t.token_ids, t.logprobs) for t in together])
        print([str(w.message) for w in caught if "C++ CPU kernels are unavailable" in str(w.message)])
        batched.close()
    """)
    env = dict(os.environ, CXX="/nonexistent/c++", POCKETLLM_EXTENSIONS_DIR=str(tmp_path / "ext"),
               PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300,
                            cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    exact, same, warned = result.stdout.splitlines()
    assert exact == "False linear_row_invariant" and same == "True"
    assert "no C++ compiler '/nonexistent/c++'" in warned and warned.count("unavailable") == 1, warned
