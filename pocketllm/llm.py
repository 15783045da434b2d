"""LLM: the user-facing engine. Loads a checkpoint and generates, serially or through the scheduler."""

from __future__ import annotations

import itertools
import logging
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar, overload

import torch

from .cache import RecurrentCacheSpec, SlotCache, cache_bytes, require_memory
from .chat import Message, load_chat_template, render_chat
from .config import EngineArgs
from .grammar import Grammars
from .kernels import Ops
from .kernels.backends import get_backend
from .kernels.gated_delta_prefill import needs_replay
from .kernels.probe import GatedDeltaProbe, ProbeReport, probe_row_invariance
from .launch import launched_rank, launched_workers, serve_launched_rank
from .models import build_model
from .models.registry import layer_specs, read_config
from .op_table import op_table
from .outputs import GenerationResult
from .parallel.pipeline import check_pipeline
from .parallel.shard import check_parallel
from .runner import ModelRunner
from .sampling import SamplingParams, params_for
from .scheduler import BatchScheduler, PrefillPolicy, Request, check_submission, is_array
from .scheduler.drafters import drafter_for
from .scheduler.policy import check_preemption_mode
from .scheduler.serial import run_serial
from .scheduler.slots import SlotManager
from .scheduler.speculation import check_speculative, speculation_for
from .scheduler.stream import TokenDelta
from .tokenizer import load_tokenizer
from .workers import ParallelCache, Workers, rank_parallel

if TYPE_CHECKING:
    from tokenizers import Tokenizer

logger = logging.getLogger(__name__)
T = TypeVar("T")

# One SamplingParams for all prompts, or one per prompt; None: the defaults.
ParamsArg = SamplingParams | Sequence[SamplingParams] | None


@dataclass(frozen=True)
class Capabilities:
    """What this engine instance can do; `supports_batch` is True when a batch scheduler runs.
    `batch_invariant` is True when outputs do not depend on what else is in flight: by construction
    on the triton backend, and on the torch backend when the start-up probe confirmed it here."""

    supports_batch: bool
    backend: str
    max_batch_size: int
    max_seq_len: int
    batch_invariant: bool
    cache_bytes: int  # size of the slot cache
    state_snapshot_bytes_per_slot: int  # most a slot's Gated DeltaNet state copies take (0: none kept)
    exact_positions: bool  # a position's bits are the same decoded, prefilled at any cut, or scored
    tensor_parallel_size: int = 1
    tree_reduction: bool = False  # row-parallel products summed in the fixed tree: the bits of every TP size


class LLM:
    """Load a Hugging Face checkpoint directory and generate from token ids, or from text when
    the directory has a tokenizer.json (`tokenizer`, loaded when `tokenizers` is installed).

    >>> llm = LLM(EngineArgs(model="ckpt", backend_options={"enable_batching": False}))
    >>> llm.generate(prompt_tokens=[1, 2, 3], sampling_params=SamplingParams(max_tokens=8))
    >>> llm.generate(prompts="Hello", sampling_params=SamplingParams(max_tokens=8)).text
    """

    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        self.device = torch.device(args.device)
        self.model_config = read_config(args.model)
        engine = args.options.engine
        self.policy = self._prefill_policy()  # its token budget is checked where it is spent: the scheduler
        self._check_memory()
        self.invariance_report: ProbeReport | None = None
        self.workers: Workers | None = None  # the other tensor-parallel ranks
        # With a scheduler thread, every forward runs there; building here would leave this
        # thread an idle OpenMP team that slows that thread's (see BatchScheduler._drive).
        engine_thread = engine.enable_batching and engine.background_thread
        batch_invariant = _on_own_thread(self._build) if engine_thread else self._build()
        self.tokenizer: Tokenizer | None = load_tokenizer(args.model)
        self.chat_template: str | None = load_chat_template(args.model)
        self._ids = itertools.count()
        # A position's bits are the same decoded, prefilled or scored: built for it, and invariant here.
        exact_positions = batch_invariant and self._exact_requested()
        if self.workers is not None:  # stopped after the scheduler (finalizers run newest first)
            weakref.finalize(self, self.workers.stop)
        check_preemption_mode(engine.preemption_mode, exact_positions)  # serial mode too: one configuration
        check_speculative(args.speculative_config, exact_positions)
        cfg = self.model_config
        self.grammars = Grammars(args.model, cfg.vocab_size, cfg.eos_token_ids, self.tokenizer)  # structured outputs
        self.scheduler: BatchScheduler | None = None
        if engine.enable_batching:
            self.scheduler = BatchScheduler(self.runner, self.cache, cfg.vocab_size, args.max_seq_len,
                                            cfg.eos_token_ids, engine.background_thread, engine.record_timeline,
                                            request_ids=self._ids, policy=self.policy, max_waiting=engine.max_waiting,
                                            max_swap_bytes=engine.max_swap_bytes, detokenize=self._detokenizer(),
                                            exact_positions=exact_positions, preemption_mode=engine.preemption_mode,
                                            grammars=self.grammars, speculative=args.speculative_config,
                                            drafter=self.drafter)
            weakref.finalize(self, self.scheduler.stop)
        # What the slots hold: the scheduler's manager when batched, one for the serial path else.
        self.slots = self.scheduler.slots if self.scheduler is not None else SlotManager(self.cache, self.policy)
        self.capabilities = Capabilities(self.scheduler is not None, args.backend, args.max_batch_size,
                                         args.max_seq_len, batch_invariant, self.cache.nbytes,
                                         self._snapshot_bytes_per_slot(), exact_positions,
                                         args.tensor_parallel_size, self.tree_reduction)

    def _detokenizer(self) -> Callable[[list[int]], str] | None:
        """token ids -> text as results show it (special tokens skipped), or None without a tokenizer."""
        tokenizer = self.tokenizer
        return None if tokenizer is None else lambda ids: tokenizer.decode(ids, skip_special_tokens=True)

    def _build(self) -> bool:
        """Model, cache and runner (with tensor parallelism: rank 0's shard, the workers started and
        joined), then the invariance check; returns whether outputs are batch invariant."""
        args = self.args
        ops = op_table(self.args)
        replay = self._replay_buffers(ops)
        size = args.tensor_parallel_size * args.pipeline_parallel_size  # processes
        tp, group = rank_parallel(args, ops, 0, self.model_config.num_hidden_layers)
        self.tree_reduction = tp.tree
        launched = launched_rank(size)  # under torchrun: every rank runs this program
        check_pipeline(self.model_config, args.pipeline_parallel_size, args.tensor_parallel_size)
        if size > 1:
            check_parallel(self.model_config, tp.size, tp.tree, self.device, tp.expert_parallel,
                           launched.local_size if launched is not None else size)
        if launched is not None and launched.rank > 0:
            serve_launched_rank(args, launched, replay)  # ends the process when rank 0 closes the engine
        if size > 1:  # starts loading beside this process
            self.workers = launched_workers(launched) if launched is not None else Workers.spawn(args, size, replay)
        try:
            self.model = build_model(args.model, self.model_config, ops, args.torch_dtype, self.device,
                                     args.max_seq_len, tp, args.torch_weight_dtype)
            specs = self.model.cache_specs()
            if self.workers is None:
                self.cache = SlotCache(args.max_batch_size, args.max_seq_len, specs, args.torch_dtype, self.device,
                                       replay=replay)
            else:
                self.workers.connect(group, self.device)
                self.cache = ParallelCache(args.max_batch_size, args.max_seq_len, specs, args.torch_dtype,
                                           self.device, replay, self.workers)
            self.runner = ModelRunner(self.model, self.cache, self.device, self.workers)
            self.drafter = drafter_for(args, self.model)  # a draft model or the MTP layer, on rank 0 only
            return self._check_invariance()
        except BaseException:
            if self.workers is not None:
                self.workers.stop()
            raise

    def _state_bytes(self, replay: bool = False) -> int:
        """Bytes of one slot's Gated DeltaNet states (`replay`: and replay buffers; 0: none)."""
        states = [s for s in layer_specs(self.model_config) if isinstance(s, RecurrentCacheSpec)]
        return cache_bytes(1, 0, list(states), self.args.torch_dtype, replay)

    def _prefill_policy(self) -> PrefillPolicy:
        """Cuts, budget and reuse from the options; no prefix reuse for a hybrid model that keeps
        no state snapshots."""
        engine = self.args.options.engine
        interval = engine.state_snapshot_interval
        reuse = engine.enable_prefix_reuse and (interval > 0 or not self._state_bytes())
        return PrefillPolicy(engine.max_num_batched_tokens, engine.prefill_chunk_size, interval, reuse,
                             engine.fine_snapshot_until)

    def _snapshot_bytes_per_slot(self) -> int:
        """The most one slot's state copies take: one per kept position below max_seq_len (with exact
        positions the fine ones too), and one where its last tenant ended."""
        batched = self.args.options.engine.enable_batching  # the serial path reuses nothing
        if not (self.policy.snapshot_interval and self.policy.prefix_reuse and batched):
            return 0
        exact = self._exact_requested()
        end = self._state_bytes(self._replay_buffers(op_table(self.args))) if exact else 0
        return self.policy.kept_positions(self.args.max_seq_len - 1, exact) * self._state_bytes() + end

    def _replay_buffers(self, ops: Ops) -> bool:
        """Whether Gated DeltaNet layers keep replay buffers: for exact positions, unless their op
        computes every position alike without them (the recurrent one)."""
        return self._exact_requested() and needs_replay(ops.gated_delta_prefill)

    def _exact_requested(self) -> bool:
        """Whether the op table and the cache are built for exact positions (`exact_positions`, or
        the backend's default): Gated DeltaNet layers then keep replay buffers."""
        options = self.args.options.backend
        return options.batch_invariant and get_backend(self.args.backend).exact(options.exact_positions,
                                                                                options.decode_per_row)

    def _check_invariance(self) -> bool:
        """Whether this engine keeps the invariance contract here. The triton kernels are invariant
        by construction; the torch backend's rests on the BLAS, so it is probed on the model's own
        shapes, and a failure is reported loudly instead of breaking the promise silently."""
        options = self.args.options.backend
        if not options.batch_invariant:
            return False
        if get_backend(self.args.backend).invariant_by_construction or not options.invariance_probe:
            return True
        ops = self.model.ops
        cfg = self.model_config
        *body, lm_head = self.model.linear_weights()
        exact = get_backend(self.args.backend).exact(options.exact_positions, options.decode_per_row)
        report = probe_row_invariance(ops.linear, ops.prefill_linear, ops.rms_norm, ops.silu_and_mul, ops.sample,
                                      body, lm_head, cfg.hidden_size, cfg.vocab_size, self.args.torch_dtype,
                                      exact_positions=exact,
                                      gated_delta=self._gated_delta_probe(),
                                      columns=self.args.tensor_parallel_size > 1)
        self.invariance_report = report
        if report.ok:
            logger.info("invariance probe: %s", report.summary())
        else:
            message = f"pocketllm: outputs may depend on the batch: {report.summary()}"
            logger.warning(message)
            warnings.warn(message, RuntimeWarning, stacklevel=3)
        return report.ok

    def _gated_delta_probe(self) -> GatedDeltaProbe | None:
        """The Gated DeltaNet op and head layout the probe checks exact replay on (None: no such layers)."""
        if not self.cache.has_states:
            return None
        cfg = self.model_config
        op = self.model.ops.gated_delta_prefill
        return GatedDeltaProbe(op, cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                               cfg.linear_value_head_dim, needs_replay(op))

    def _check_memory(self) -> None:
        """Refuse, before any weight is read, a cache (and rope tables, one row per position) larger
        than the device's available memory: ValueError naming max_seq_len and max_batch_size."""
        cfg, args = self.model_config, self.args
        slots = cache_bytes(args.max_batch_size, args.max_seq_len, layer_specs(cfg), args.torch_dtype,
                            self._replay_buffers(op_table(self.args)))
        rope = 2 * args.max_seq_len * cfg.rotary_dim * 4
        snapshots = args.max_batch_size * self._snapshot_bytes_per_slot()
        require_memory(slots + rope + snapshots, self.device,
                       f"a slot cache of max_batch_size={args.max_batch_size} slots x max_seq_len={args.max_seq_len} "
                       f"positions ({slots} bytes) with its rope tables ({rope} bytes) and state snapshots "
                       f"({snapshots} bytes, state_snapshot_interval={self.policy.snapshot_interval})")

    def close(self) -> None:
        """Stop the scheduler thread (if any; unfinished requests end as "cancelled"), then the
        tensor-parallel workers (if any)."""
        if self.scheduler is not None:
            self.scheduler.stop()
        if self.workers is not None:
            self.workers.stop()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def make_request(self, prompt_tokens: list[int], params: SamplingParams) -> Request:
        """A request with a fresh id for an already validated prompt."""
        return Request(next(self._ids), prompt_tokens, params, params.resolved_seed(), self.model_config.eos_token_ids,
                       grammar=self.grammars.state(params),
                       speculation=speculation_for(self.args.speculative_config, self.cache.has_states,
                                                   self.model_config.vocab_size))

    # -- generation ------------------------------------------------------------------------

    @overload
    def generate(self, prompt_tokens: Sequence[int], sampling_params: ParamsArg = None, *,
                 priority: int = 0) -> GenerationResult: ...
    @overload
    def generate(self, prompt_tokens: Sequence[Sequence[int]],
                 sampling_params: ParamsArg = None, *, priority: int = 0) -> list[GenerationResult]: ...
    @overload
    def generate(self, prompt_tokens: None = None,  # type: ignore[overload-overlap]  # a str is a Sequence[str] too
                 sampling_params: ParamsArg = None, *, prompts: str, priority: int = 0) -> GenerationResult: ...
    @overload
    def generate(self, prompt_tokens: None = None,
                 sampling_params: ParamsArg = None, *, prompts: Sequence[str],
                 priority: int = 0) -> list[GenerationResult]: ...
    def generate(self, prompt_tokens: Sequence[int] | Sequence[Sequence[int]] | None = None,
                 sampling_params: ParamsArg = None, *,
                 prompts: str | Sequence[str] | None = None,
                 priority: int = 0) -> GenerationResult | list[GenerationResult]:
        """One prompt -> one result; a list of prompts -> a list of results.

        A prompt is token ids (`prompt_tokens`: a list of ints, or a 1-D integer numpy array or torch
        tensor) or text (`prompts`, a str), not both: text goes through the model directory's
        tokenizer.json, no special tokens added. With a tokenizer, each result's `text` is its tokens decoded.
        `sampling_params` is one SamplingParams for all prompts or a list, one per prompt. Every
        prompt is validated before any is run, so a bad one raises without side effects.
        `priority` (batched mode): lower runs first and may preempt running requests of a higher
        value (see BatchScheduler.submit_request); the serial path runs prompts in order.
        """
        if prompts is not None:
            if prompt_tokens is not None:
                raise TypeError("pass either prompts (text) or prompt_tokens (token ids), not both")
            single = isinstance(prompts, str)
            token_prompts: list[Any] = self._encode([prompts] if isinstance(prompts, str) else prompts)
        elif prompt_tokens is None:
            raise TypeError("generate() needs prompt_tokens (token ids) or prompts (text)")
        elif isinstance(prompt_tokens, str):
            raise TypeError("prompt_tokens must be a list of ints, got str (text goes in prompts=)")
        else:
            single = is_array(prompt_tokens) or not (
                isinstance(prompt_tokens, Sequence) and len(prompt_tokens) > 0
                and (is_array(prompt_tokens[0]) or isinstance(prompt_tokens[0], Sequence)))
            token_prompts = [prompt_tokens] if single else list(prompt_tokens)
        params_list = params_for(sampling_params, len(token_prompts))
        if self.scheduler is not None:  # checked, stepped and decoded there, on this thread
            results = self.scheduler.generate(list(zip(token_prompts, params_list)), priority)
        else:
            cfg = self.model_config
            checked = [check_submission(p, sp, priority, cfg.vocab_size, self.args.max_seq_len, self.grammars)
                       for p, sp in zip(token_prompts, params_list)]
            results = [run_serial(self.runner, self.slots, self.policy, self.make_request(p, sp), self.drafter,
                                  self._detokenizer()) for p, sp in checked]
        return results[0] if single else results

    def stream(self, prompt_tokens: Sequence[int] | None = None, sampling_params: SamplingParams | None = None, *,
               prompt: str | None = None, priority: int = 0) -> Iterator[TokenDelta | GenerationResult]:
        """One prompt's tokens as they are sampled, then its result (batched mode; see
        BatchScheduler.stream: with a tokenizer, each delta carries the text it adds). Leaving the
        loop early cancels the request."""
        if self.scheduler is None:
            raise RuntimeError("stream() needs the batch scheduler: backend_options={'enable_batching': True}")
        tokens = self.prepare(prompt_tokens, prompt)
        yield from self.scheduler.stream(self.scheduler.submit_request(tokens, sampling_params, priority=priority))

    def prepare(self, prompt_tokens: Sequence[int] | None, prompt: str | None = None) -> Sequence[int]:
        """One prompt, token ids or text (encoded here), not both: what a submit takes (and checks)."""
        if (prompt is None) == (prompt_tokens is None):
            raise TypeError("pass one prompt: prompt_tokens (token ids) or prompt (text)")
        if prompt is not None:
            return self._encode([prompt])[0]
        assert prompt_tokens is not None
        return prompt_tokens

    def chat_prompt(self, messages: Sequence[Message], add_generation_prompt: bool = True,
                    template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
        """The token ids of `messages` rendered by the checkpoint's chat template (pocketllm.chat), with
        `template_kwargs` as more of its variables: the path `chat()` and the server's chat share."""
        text = render_chat(self.chat_template, messages, add_generation_prompt, **(template_kwargs or {}))
        return self._encode([text])[0]

    def chat(self, messages: Sequence[Message] | Sequence[Sequence[Message]],
             sampling_params: ParamsArg = None) -> GenerationResult | list[GenerationResult]:
        """Generate the assistant's reply to one conversation (a list of {"role", "content"}
        messages) or to each of a list of conversations; the result's `text` is the reply."""
        single = not messages or isinstance(messages[0], Mapping)  # [] is refused as one conversation
        conversations = [messages] if single else list(messages)
        prompts = [self.chat_prompt(conversation) for conversation in conversations]  # type: ignore[arg-type]
        results = self.generate(prompts, sampling_params)
        return results[0] if single else results

    def _encode(self, prompts: Sequence[str]) -> list[list[int]]:
        """Check text prompts, then encode them; loading the tokenizer here raises the reason
        when the model has none (no tokenizer.json, or tokenizers not installed)."""
        if isinstance(prompts, (bytes, bytearray)) or not isinstance(prompts, Sequence):
            raise TypeError(f"prompts must be a str or a list of str, got {type(prompts).__name__}")
        if not prompts:
            raise ValueError("prompts must not be empty")
        for i, text in enumerate(prompts):
            if not isinstance(text, str):
                raise TypeError(f"prompts[{i}] must be a str, got {type(text).__name__}")
            if not text:
                raise ValueError(f"prompts[{i}] must not be an empty string")
        if self.tokenizer is None:
            self.tokenizer = load_tokenizer(self.args.model, required=True)
        return [self.tokenizer.encode(text, add_special_tokens=False).ids for text in prompts]


def _on_own_thread(fn: Callable[[], T]) -> T:
    """fn() on a short-lived thread (its OpenMP team ends with it); its exception is raised here."""
    box: list[Any] = []

    def run() -> None:
        try:
            box.append((True, fn()))
        except BaseException as exc:  # handed to the caller, whatever it is
            box.append((False, exc))

    thread = threading.Thread(target=run, name="pocketllm-build")
    thread.start()
    thread.join()
    ok, value = box[0]
    if not ok:
        raise value
    return value
