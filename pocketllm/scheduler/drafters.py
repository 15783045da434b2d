"""The models that draft within a step, and which one an engine runs (`drafter_for`): a draft model
(draft_model.py) or, for `speculative={"method": "mtp", ...}`, the checkpoint's own
multi-token-prediction layer (models/mtp.py), greedily, in a slot cache of its own (slot i for the
request in the target's slot i).

The layer's position q holds the pair (token q + 1, the model's normed hidden state of position q),
as vLLM places it, and its output there predicts token q + 2. For a request of n tokens, whose
hidden states the model gave up to position n - 2 (`Speculation.observe`), one forward feeds the
pairs its slot lacks, up to q = n - 2, whose output drafts token n; each further draft feeds the
previous draft with the layer's own output in place of the model's hidden state. Only the pairs of
the model's hidden states stand afterwards (`draft_cached` = n - 1). A slot another request wrote
since, or positions whose hidden states the model never gave (a reused prefix), are fed from what
is there: the drafts may hit less, the output never changes.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..cache import SlotCache
from ..config import EngineArgs
from ..models.batch import ForwardBatch
from ..models.layers import DecoderModel
from ..models.mtp import MtpLayer
from ..models.protocol import Model
from .draft_model import Drafting, DraftModel
from .request import Request


class MtpDrafts(Drafting):
    """The MTP layer of the checkpoint at `path` beside `model` (which keeps its normed hidden states
    from now on), with `num_slots` slots of `max_seq_len` positions."""

    def __init__(self, path: str | Path, model: Model, num_slots: int, max_seq_len: int) -> None:
        if not isinstance(model, DecoderModel):
            raise ValueError("speculative method 'mtp' needs a model built from pocketllm's decoder blocks")
        self.layer = MtpLayer(path, model)
        model.keep_normed = True
        self.device = model.embed.device
        self.cache = SlotCache(num_slots, max_seq_len, self.layer.cache_specs(), model.dtype, self.device)
        self.owner = [None] * num_slots

    def _draft(self, requests: list[Request]) -> list[list[int]]:
        """Each request's greedy drafts, as many as its `pending` allows (none where the model's
        hidden state of position n - 2 is not at hand)."""
        drafts: list[list[int]] = [[] for _ in requests]
        pieces: list[tuple[int, int, list[int], torch.Tensor]] = []  # (request index, start, tokens, hidden)
        for i, request in enumerate(requests):
            speculation = request.speculation
            assert speculation is not None
            if not self._owned(request):
                speculation.draft_cached = 0
            tokens = request.prompt_tokens + request.token_ids
            last = len(tokens) - 2  # the latest position whose hidden state the model gave
            first = max(speculation.draft_cached, speculation.hidden_start)
            hidden = speculation.hidden_rows(first, last + 1) if first <= last else None
            if hidden is not None:
                pieces.append((i, first, tokens[first + 1:last + 2], hidden))
        while pieces:
            pieces.sort(key=lambda piece: len(piece[2]) != 1)  # decode rows first, as a ForwardBatch wants
            slots = [requests[i].assigned_slot for i, _, _, _ in pieces]
            batch = ForwardBatch.build(slots, [start for _, start, _, _ in pieces], [t for _, _, t, _ in pieces],
                                       [len(t) == 1 for _, _, t, _ in pieces], self.device)
            logits, normed = self.layer.forward(batch, self.cache, torch.cat([h for _, _, _, h in pieces]))
            ends = torch.cumsum(torch.tensor([len(t) for _, _, t, _ in pieces]), 0).tolist()
            following = []
            for (i, start, tokens, _), token, end in zip(pieces, logits.argmax(dim=-1).tolist(), ends):
                drafts[i].append(token)
                speculation = requests[i].speculation
                assert speculation is not None
                if len(drafts[i]) == 1:  # the pairs of the model's hidden states stand, up to here
                    speculation.draft_cached = start + len(tokens)
                    speculation.forget_hidden(speculation.draft_cached)
                if len(drafts[i]) < speculation.pending:
                    following.append((i, start + len(tokens), [token], normed[end - 1:end]))
            pieces = following
        return drafts


def drafter_for(args: EngineArgs, model: Model) -> Drafting | None:
    """The drafting model `args.speculative_config` asks for: a draft model, the MTP layer, or None
    (n-gram and custom drafts need no forward). ValueError for the MTP layer under tensor parallelism."""
    config = args.speculative_config
    if config is None or config.method not in ("draft_model", "mtp"):
        return None
    if config.method == "draft_model":
        assert config.model is not None  # checked with the config
        return DraftModel(args, config.model, model.cfg.vocab_size)
    if args.tensor_parallel_size > 1 or args.pipeline_parallel_size > 1:
        raise ValueError("speculative method 'mtp' runs in one process only (tensor_parallel_size and "
                         "pipeline_parallel_size 1), for now")
    return MtpDrafts(args.model, model, args.max_batch_size, args.max_seq_len)
