"""Request: one generation's state from submission to its single terminal state, and the checks
a submission passes before a request is made of it."""

from __future__ import annotations

import enum
import numbers
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..cache import SwappedSlot
from ..grammar import Grammars, GrammarState, check_grammar
from ..logits_processors import TokenHistory
from ..outputs import FinishReason, GenerationResult, TopLogprobs
from ..runner import SequenceInput, SequenceOutput, TokenLogprob
from ..sampling import SamplingParams
from .policy import PrefillPolicy
from .speculation import Speculation

if TYPE_CHECKING:
    from .stream import Subscriber


def is_array(value: Any) -> bool:
    """A numpy array or torch tensor (anything with ndim, dtype and tolist)."""
    return all(hasattr(value, name) for name in ("ndim", "dtype", "tolist")) and not isinstance(value, numbers.Number)


def _integer_dtype(dtype: Any) -> bool:
    if isinstance(dtype, torch.dtype):
        return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)
    return getattr(dtype, "kind", None) in ("i", "u")


def token_list(prompt_tokens: Any) -> list[int]:
    """One prompt as a list of Python ints: a sequence of ints, or a 1-D integer numpy array or
    torch tensor. TypeError naming what was given otherwise."""
    if is_array(prompt_tokens):
        if prompt_tokens.ndim != 1:
            raise TypeError(f"prompt_tokens as an array must be 1-D (one prompt), got {prompt_tokens.ndim}-D; "
                            "pass a list of 1-D prompts for several")
        if not _integer_dtype(prompt_tokens.dtype):
            raise TypeError(f"prompt_tokens as an array must have an integer dtype, got {prompt_tokens.dtype}")
        return prompt_tokens.tolist()
    if isinstance(prompt_tokens, (str, bytes, bytearray)) or not isinstance(prompt_tokens, Sequence):
        raise TypeError(f"prompt_tokens must be a list of ints, got {type(prompt_tokens).__name__} "
                        "(a 1-D integer numpy array or torch tensor is accepted too)")
    prompt = list(prompt_tokens)
    for i, token in enumerate(prompt):
        if not isinstance(token, numbers.Integral) or isinstance(token, bool):
            raise TypeError(f"prompt_tokens[{i}] must be an int, got {type(token).__name__}")
    return [int(token) for token in prompt]


def validate_prompt(prompt_tokens: Sequence[int], params: SamplingParams, vocab_size: int,
                    max_seq_len: int) -> list[int]:
    """Check one prompt and its sampling params against the model and cache; returns the prompt
    as a list of ints. Raises TypeError/ValueError naming the field and the allowed range."""
    if not isinstance(params, SamplingParams):
        raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
    prompt = token_list(prompt_tokens)
    if not prompt:
        raise ValueError("prompt_tokens must not be empty")
    for i, token in enumerate(prompt):
        if not 0 <= token < vocab_size:
            raise ValueError(f"prompt_tokens[{i}]={token} is outside the vocabulary [0, {vocab_size})")
    named = [("stop_token_ids", token) for token in params.stop_token_ids] + params.control_token_ids()
    for name, token in named:
        if token >= vocab_size:
            raise ValueError(f"{name} entry {token} is outside the vocabulary [0, {vocab_size})")
    if len(prompt) + params.max_tokens > max_seq_len:
        raise ValueError(
            f"prompt length {len(prompt)} + max_tokens {params.max_tokens} exceeds max_seq_len {max_seq_len}"
        )
    return prompt


def check_submission(prompt_tokens: Sequence[int], sampling: SamplingParams | None, priority: int, vocab_size: int,
                     max_seq_len: int, grammars: Grammars | None = None,
                     **callbacks: Callable[..., None] | None) -> tuple[list[int], SamplingParams]:
    """What a submission gives, every argument checked (TypeError/ValueError): the prompt as ints
    and its params (None: the defaults), whose structured output `grammars` compiles (GrammarError,
    or ImportError without xgrammar); `callbacks` must be callable or None."""
    sampling = sampling if sampling is not None else SamplingParams()
    prompt = validate_prompt(prompt_tokens, sampling, vocab_size, max_seq_len)
    check_grammar(grammars, sampling)
    for name, fn in callbacks.items():
        if fn is not None and not callable(fn):
            raise TypeError(f"{name} must be callable or None, got {type(fn).__name__}")
    if isinstance(priority, bool) or not isinstance(priority, int) or not -2**31 <= priority < 2**31:
        raise ValueError(f"priority must be an int in [-2**31, 2**31), got {priority!r}")
    return prompt, sampling


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: int
    prompt_tokens: list[int]
    params: SamplingParams
    seed: int
    eos_token_ids: tuple[int, ...] = ()
    status: RequestStatus = RequestStatus.WAITING
    slot: int | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str | None = None
    submit_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    cancel_requested: bool = False
    num_prefilled: int = 0  # tokens of `prefill_tokens` in the slot (reused or prefilled)
    priority: int = 0  # lower runs first
    swapped: SwappedSlot | None = None  # its slot's contents while preempted
    preempted_step: int = -1  # the step that last preempted it
    replayed: int = 0  # generated tokens its prefill runs again since a preemption by recompute
    preempt_requested: bool = False
    swap_reserved: int = 0  # bytes preempt() set aside for its swap
    in_flight: SequenceInput | None = None  # its input to the forward in progress
    subscriber: Subscriber | None = None  # who is told of its tokens and its result
    text: str | None = None  # its tokens decoded, once it has ended (when the engine detokenizes)
    top_logprobs: list[tuple[tuple[int, float], ...]] = field(default_factory=list)  # per generated token
    prompt_scores: list[TokenLogprob] = field(default_factory=list)  # prompt tokens 1.. (prompt_logprobs)
    grammar: GrammarState | None = None  # its structured output's matcher (params.structured_outputs)
    speculation: Speculation | None = None  # its drafts, when the engine speculates

    @property
    def order(self) -> tuple[int, int]:
        """Scheduling order: priority, then arrival (ids grow with submission)."""
        return self.priority, self.request_id

    @property
    def prefill_tokens(self) -> list[int]:
        """What its prefill runs: the prompt, and after a preemption by recompute the tokens it had
        generated by then (see `restart`)."""
        return self.prompt_tokens + self.token_ids[:self.replayed]

    @property
    def num_cached(self) -> int:
        """Tokens whose K/V are in the slot: `prefill_tokens` prefilled so far and, once that is
        done, every token generated after them but the last."""
        return self.num_prefilled + max(len(self.token_ids) - self.replayed - 1, 0)

    @property
    def cached_after_step(self) -> int:
        """`num_cached` once the forward in progress (if it has an input there) has succeeded:
        every position that input writes (a decode row or a prefill piece) is then cached."""
        seq = self.in_flight  # a verify piece: at most all of its positions
        return self.num_cached if seq is None else seq.start + len(seq.token_ids)

    @property
    def prefilling(self) -> bool:
        """Part of `prefill_tokens` is still to be prefilled."""
        return self.num_prefilled < len(self.prompt_tokens) + self.replayed

    @property
    def decoding(self) -> bool:
        """Its next input is a decode row: it has sampled and nothing is left to prefill."""
        return bool(self.token_ids) and not self.prefilling

    @property
    def assigned_slot(self) -> int:
        """`slot`, for a request that holds one (from admission until its slot is freed)."""
        assert self.slot is not None, f"request {self.request_id} holds no slot"
        return self.slot

    @property
    def scores_prompt(self) -> bool:
        return self.params.prompt_logprobs is not None

    def prefill_input(self, policy: PrefillPolicy, limit: int | None = None, keep: bool = False) -> SequenceInput:
        """The next piece of `prefill_tokens`, cut where `policy` says (and after `limit` tokens); it
        samples if it ends them, and a scoring request's piece scores each of its prompt rows against
        the prompt token after it. `keep`: the slot's states are kept at the policy's fine positions
        inside the piece."""
        start, tokens = self.num_prefilled, self.prefill_tokens
        end = policy.piece_end(start, len(tokens))
        if limit is not None:
            end = min(end, start + limit)
        targets = self.prompt_tokens[start + 1:end + 1] if self.scores_prompt else []
        sample = end == len(tokens)
        return SequenceInput(self.assigned_slot, start, tokens[start:end], self.params, self.seed, decode=False,
                             sample=sample, targets=targets, keeps=policy.keeps(start, end) if keep else (),
                             history=self.history() if sample else None, grammar=self.grammar if sample else None)

    def next_input(self, policy: PrefillPolicy) -> SequenceInput:
        """The next prefill piece while they last, then a decode row (or verify piece)."""
        return self.prefill_input(policy) if self.prefilling else self.decode_input()

    def decode_input(self, most_drafts: int | None = None) -> SequenceInput:
        """A decode row, or with speculation and a draft at hand a verify piece of the last token and
        up to `most_drafts` drafts (no more than the tokens it may still generate after the next).
        A request with structured outputs does not draft: its matcher takes each token once."""
        last, start, speculation = self.token_ids[-1], self.num_cached, self.speculation
        room = self.params.max_tokens - len(self.token_ids) - 1
        most = room if most_drafts is None else min(room, most_drafts)
        if speculation is not None:
            most, speculation.pending = speculation.most_drafts(start, most), 0
        drafts = [] if speculation is None or self.grammar is not None or most < 1 else \
            speculation.propose(self.prompt_tokens + self.token_ids, most)
        if drafts:
            return self.verify_input(drafts)
        return SequenceInput(self.assigned_slot, start, [last], self.params, self.seed,
                             decode=True, history=self.history(), grammar=self.grammar)

    def verify_input(self, drafts: Sequence[int]) -> SequenceInput:
        """A verify piece of its last token and `drafts` (see SequenceInput.drafts)."""
        start, speculation = self.num_cached, self.speculation
        assert speculation is not None, f"request {self.request_id} does not speculate"
        return SequenceInput(self.assigned_slot, start, [self.token_ids[-1], *drafts], self.params, self.seed,
                             keeps=speculation.keeps(start, len(drafts)), history=self.history(), drafts=tuple(drafts))

    def history(self) -> TokenHistory | None:
        """What its logits controls read when it samples next (None when it sets none): the live
        token lists, which grow only after the forward."""
        if not self.params.controls_logits:
            return None
        return TokenHistory(self.prompt_tokens, self.token_ids, self.stop_ids)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """The tokens that stop it: stop_token_ids, and EOS unless ignore_eos."""
        params = self.params
        return params.stop_token_ids if params.ignore_eos else params.stop_token_ids + self.eos_token_ids

    def advance(self, seq: SequenceInput, output: SequenceOutput) -> None:
        """Record a forward of `seq` that succeeded: the prompt advanced (its scores kept), a token
        was sampled, or both."""
        if not seq.decode and not seq.drafts:
            self.num_prefilled = seq.start + len(seq.token_ids)
        # A prefill run again after a recompute scores rows it scored before: those are kept as they were.
        self.prompt_scores += output.scores[max(len(self.prompt_scores) - seq.start, 0):]
        if output.sampled is not None:
            self.append(output.sampled)
        for sampled in output.accepted:  # a verify piece's: as many decode steps would have given them
            if not self.finished:
                self.append(sampled)
        if seq.drafts and self.speculation is not None:
            self.speculation.verified(seq.start, len(seq.drafts), len(output.accepted))
        if output.hidden is not None and self.speculation is not None:  # the rows of its tokens that stand
            self.speculation.observe(seq.start, output.hidden[:len(output.accepted) + 1 if seq.drafts else None])

    def restart(self) -> None:
        """Preempted by recompute, its slot freed: once readmitted, it prefills its prompt and every
        token generated so far, so the piece that ends them samples at the position (the sampler's
        seed) and, with exact positions, from the logits the next decode step would have had."""
        self.replayed, self.num_prefilled = len(self.token_ids), 0

    def append(self, sampled: TokenLogprob) -> None:
        """Record a sampled token and finish the request if it stops (a stop token, or the end of its
        grammar) or reaches max_tokens. Its grammar's matcher takes each token once: a preemption by
        recompute prefills the tokens it took again, and only the token sampled after them is new."""
        if self.first_token_time is None:
            self.first_token_time = time.perf_counter()
        token = sampled.token
        self.token_ids.append(token)
        self.logprobs.append(sampled.logprob)
        self.top_logprobs.append(sampled.top)
        if self.grammar is not None and not self.grammar.advance(self.token_ids):
            self.finish("error", f"the structured output's grammar refused token {token}")
        elif token in self.stop_ids or (self.grammar is not None and self.grammar.terminated):
            self.finish("stop")
        elif len(self.token_ids) >= self.params.max_tokens:
            self.finish("length")

    def finish(self, reason: FinishReason, error: str | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.error = error
        self.finish_time = time.perf_counter()

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def held_tokens(self) -> list[int]:
        """Token ids whose K/V the slot holds once this request leaves it."""
        return (self.prompt_tokens + self.token_ids)[: self.num_cached]

    def result(self) -> GenerationResult:
        params = self.params
        return GenerationResult(
            request_id=self.request_id,
            prompt_tokens=list(self.prompt_tokens),
            token_ids=list(self.token_ids),
            logprobs=list(self.logprobs),
            finish_reason=self.finish_reason,
            error=self.error,
            seed=self.seed,
            ttft_s=None if self.first_token_time is None else self.first_token_time - self.submit_time,
            total_time_s=None if self.finish_time is None else self.finish_time - self.submit_time,
            text=self.text,
            top_logprobs=None if params.logprobs is None else [list(top) for top in self.top_logprobs],
            prompt_logprobs=self.prompt_logprobs(),
            prompt_top_logprobs=self.prompt_top_logprobs(),
            spec_draft_tokens=0 if self.speculation is None else self.speculation.drafted,
            spec_accepted_tokens=0 if self.speculation is None else self.speculation.accepted,
        )

    def prompt_logprobs(self) -> list[float | None] | None:
        """The prompt's logprobs as results and token 0's delta give them (None for the first
        token), or None when it does not score its prompt."""
        return None if not self.scores_prompt else [None] + [s.logprob for s in self.prompt_scores]

    def prompt_top_logprobs(self) -> list[TopLogprobs | None] | None:
        """Each prompt position's best tokens (`prompt_logprobs` >= 1), as `prompt_logprobs`."""
        return None if not self.params.prompt_logprobs else [None] + [list(s.top) for s in self.prompt_scores]
