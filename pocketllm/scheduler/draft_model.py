"""`speculative={"method": "draft_model", "model": DIR, ...}`: a smaller checkpoint with the target's
vocabulary drafts greedily, in a slot cache of its own (slot i drafts for the request in the
target's slot i), run by the same engine. It only proposes: the verify step decides (runner.py).

Each step, the decode rows whose requests were allowed drafts (`Speculation.pending`) become verify
pieces: one forward of the draft model brings each request's draft slot up to its tokens and drafts
the first token (a piece of what the slot lacks, greedy), then one decode forward per further draft,
all such requests batched. After the verify, a slot holds the request's tokens up to the last draft
that was accepted and fed, so the next step's piece starts there; a slot that another request wrote
since is prefilled again from position 0.
"""

from __future__ import annotations

import logging

import torch

from ..cache import SlotCache
from ..config import EngineArgs
from ..models import build_model
from ..models.registry import read_config
from ..op_table import op_table
from ..runner import ModelRunner, SequenceInput
from ..sampling import SamplingParams
from .execute import Work
from .request import Request

logger = logging.getLogger("pocketllm.scheduler.batch_scheduler")
GREEDY = SamplingParams(max_tokens=1, temperature=0.0)


def draft_args(target: EngineArgs, path: str) -> EngineArgs:
    """The draft model's engine arguments: the target's backend, dtypes, device and slots."""
    return EngineArgs(model=path, backend=target.backend, dtype=target.dtype, device=target.device,
                      max_seq_len=target.max_seq_len, backend_options=target.backend_options,
                      weight_dtype=target.weight_dtype, bf16_product=target.bf16_product)


class Drafting:
    """What every model that drafts in the step shares: its slots' owners, and turning decode rows
    into verify pieces (`fill`); a subclass says how its drafts are made (`_draft`)."""

    owner: list[int | None]  # per slot: the request it drafts for

    def fill(self, work: Work) -> Work:
        """`work` with the decode rows of requests allowed drafts turned into verify pieces (a failed
        draft forward only costs the drafts: the rows stay decode rows)."""
        asked = [(i, request) for i, (request, seq) in enumerate(work)
                 if seq.decode and request.speculation is not None and request.speculation.pending]
        if not asked:
            return work
        try:
            drafts = self._draft([request for _, request in asked])
        except Exception:
            logger.exception("the draft forward failed; these requests decode without drafts")
            drafts = [[] for _ in asked]
        filled = list(work)
        for (i, request), tokens in zip(asked, drafts):
            assert request.speculation is not None
            request.speculation.pending = 0
            if tokens:
                filled[i] = (request, request.verify_input(tokens))
        return filled

    def _draft(self, requests: list[Request]) -> list[list[int]]:
        raise NotImplementedError

    def _owned(self, request: Request) -> bool:
        """Whether the request's slot still holds what it wrote there; it owns the slot from now on."""
        slot = request.assigned_slot
        mine = self.owner[slot] == request.request_id
        self.owner[slot] = request.request_id
        return mine


class DraftModel(Drafting):
    """The draft checkpoint loaded beside the target, with `num_slots` slots of its own.
    ValueError naming the field for a draft the engine cannot use: another vocabulary size, or
    Gated DeltaNet layers (a draft's state would have to roll back with the target's; not yet)."""

    def __init__(self, target: EngineArgs, path: str, vocab_size: int) -> None:
        args = draft_args(target, path)
        cfg = read_config(path)
        if cfg.vocab_size != vocab_size:
            raise ValueError(f"speculative['model'] {path!r} has vocab_size {cfg.vocab_size}, the target model "
                             f"{vocab_size}: a draft model must share the target's vocabulary")
        if any(kind != "full_attention" for kind in cfg.layer_types):
            raise ValueError(f"speculative['model'] {path!r} has Gated DeltaNet layers: draft models with "
                             f"recurrent states are not supported yet (use an attention-only one, e.g. Qwen3)")
        self.device = torch.device(args.device)
        model = build_model(path, cfg, op_table(args), args.torch_dtype, self.device, args.max_seq_len,
                            weight_dtype=args.torch_weight_dtype)
        self.cache = SlotCache(args.max_batch_size, args.max_seq_len, model.cache_specs(), args.torch_dtype,
                               self.device)
        self.runner = ModelRunner(model, self.cache, self.device)
        self.owner = [None] * args.max_batch_size

    def _draft(self, requests: list[Request]) -> list[list[int]]:
        """Each request's greedy drafts, as many as its `pending` allows."""
        seqs = []
        for request in requests:
            speculation, slot = request.speculation, request.assigned_slot
            assert speculation is not None
            if not self._owned(request):  # written for another request since
                speculation.draft_cached = 0
            tokens = request.prompt_tokens + request.token_ids
            start = min(speculation.draft_cached, len(tokens) - 1)
            seqs.append(SequenceInput(slot, start, tokens[start:], GREEDY, 0, decode=len(tokens) - start == 1))
        drafts: list[list[int]] = [[] for _ in requests]
        active = list(range(len(requests)))
        while active:
            outputs = self.runner.run([seqs[i] for i in active])
            for i, output in zip(active, outputs):
                assert output.sampled is not None
                drafts[i].append(output.sampled.token)
                seqs[i] = SequenceInput(seqs[i].slot, seqs[i].start + len(seqs[i].token_ids), [output.sampled.token],
                                        GREEDY, 0, decode=True)
            active = [i for i in active if len(drafts[i]) < requests[i].speculation.pending]  # type: ignore[union-attr]
        for request, tokens in zip(requests, drafts):  # fed: the request's tokens, then every draft but the last
            assert request.speculation is not None
            request.speculation.draft_cached = len(request.prompt_tokens) + len(request.token_ids) + len(tokens) - 1
        return drafts
