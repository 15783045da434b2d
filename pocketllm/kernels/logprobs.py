"""Scoring: the log-probability of a given token at each row, and the row's top-k alternatives.

What a prompt position scores (`SamplingParams.prompt_logprobs`) and the alternatives of a generated
token (`SamplingParams.logprobs`). A row's logprob is the log-softmax of its raw logits at the token,
computed exactly as `sample` computes the logprob of the token it samples (the same log-softmax in
the reference, the same chunked max and sum of exponentials in the kernel), so scoring a sequence
gives the logprobs its generation reported wherever the logits are the same.

The alternatives are ranked by logprob, ties broken by the lower token id, so they are a function
of the row alone: the first k of a row's top-K are its top-k for any K >= k, and a request asking
for 2 gets the same two whatever the rows beside it ask for.
"""

from typing import Any, Protocol

import torch

from ._cases import ROWS, randn
from ._triton import kernel_device_ok, tl, triton
from .sample import BLOCK_V
from .spec import Call, Cost, Layout, OpSpec, Step, size


class Logprobs(Protocol):
    """logits [R, V]; tokens int64 [R]; num_top >= 0 -> (logprobs fp32 [R] at each row's
    token, top_ids int64 [R, num_top], top_logprobs fp32 [R, num_top]: best first, ties by id)."""

    def __call__(self, logits: torch.Tensor, tokens: torch.Tensor,
                 num_top: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


def logprobs_ref(logits: torch.Tensor, tokens: torch.Tensor,
                 num_top: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The log-softmax of each row (as `sample_ref`), read at `tokens` and at its num_top best."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(-1, tokens[:, None]).squeeze(-1)
    rows = logprobs.shape[0]
    top_ids = torch.empty(rows, num_top, dtype=torch.int64, device=logits.device)
    if num_top:
        # topk's values are the num_top largest, but which of several equal values it returns is
        # unspecified: rank every entry at least the num_top-th largest by (value, then id).
        floor = logprobs.topk(num_top, dim=-1).values[:, -1:]
        for row in range(rows):
            ids = (logprobs[row] >= floor[row]).nonzero().squeeze(-1)  # ascending ids
            order = logprobs[row, ids].sort(descending=True, stable=True).indices
            top_ids[row] = ids[order[:num_top]]
    return chosen, top_ids, logprobs.gather(-1, top_ids)


# -- Triton ------------------------------------------------------------------------------------------


@triton.jit
def _logprobs_kernel(logits_ptr, row_stride, tokens_ptr, logprobs_ptr, top_ids_ptr, top_logprobs_ptr, vocab,
                     num_top, BLOCK: tl.constexpr):
    """Program r scores row r: the max and sum of exponentials in `sample`'s passes and order, then
    one pass per alternative for the best entry ranked after the previous one."""
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * row_stride
    m = tl.full([], float("-inf"), tl.float32)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
        m = tl.maximum(m, tl.max(x, axis=0))
    sum_exp = tl.full([], 0.0, tl.float32)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
        sum_exp += tl.sum(tl.exp(x - m), axis=0)
    log_sum = tl.log(sum_exp)
    token = tl.load(tokens_ptr + row)
    tl.store(logprobs_ptr + row, tl.load(row_ptr + token).to(tl.float32) - m - log_sum)

    # Alternatives in the order (logprob descending, id ascending): each pass takes the best entry
    # strictly after the previous one in that order.
    previous = tl.full([], float("inf"), tl.float32)
    previous_id = tl.full([], -1, tl.int64)
    for j in range(0, num_top):
        best = tl.full([], float("-inf"), tl.float32)
        best_id = tl.full([], vocab, tl.int64)
        for start in range(0, vocab, BLOCK):
            offs = start + tl.arange(0, BLOCK).to(tl.int64)
            x = tl.load(row_ptr + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
            value = x - m - log_sum
            after = (offs < vocab) & ((value < previous) | ((value == previous) & (offs > previous_id)))
            value = tl.where(after, value, float("-inf"))
            block_best = tl.max(value, axis=0)
            block_id = tl.min(tl.where(after & (value == block_best), offs, vocab), axis=0)
            better = (block_best > best) | ((block_best == best) & (block_id < best_id))
            best_id = tl.where(better, block_id, best_id)
            best = tl.maximum(best, block_best)
        tl.store(top_ids_ptr + row * num_top + j, best_id)
        tl.store(top_logprobs_ptr + row * num_top + j, best)
        previous, previous_id = best, best_id


def logprobs_triton(logits: torch.Tensor, tokens: torch.Tensor,
                    num_top: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`logprobs_ref` in one launch, one program per row, each walking the vocabulary in `sample`'s
    fixed BLOCK_V chunks: a row's results never depend on the rows beside it, and its logprob has
    the bits `sample_triton` reports for the same token."""
    kernel_device_ok(logits)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    rows, vocab = logits.shape
    device = logits.device
    chosen = torch.empty(rows, dtype=torch.float32, device=device)
    top_ids = torch.empty(rows, num_top, dtype=torch.int64, device=device)
    top_logprobs = torch.empty(rows, num_top, dtype=torch.float32, device=device)
    if rows:
        _logprobs_kernel[(rows,)](logits, logits.stride(0), tokens.to(device=device, dtype=torch.int64).contiguous(),
                                  chosen, top_ids, top_logprobs, vocab, num_top, BLOCK=BLOCK_V, num_warps=8)
    return chosen, top_ids, top_logprobs


# -- declaration -------------------------------------------------------------------------------------


def _case_tokens(gen: torch.Generator, n: int, dims: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    logits = randn(gen, n, dims["vocab"], dtype=dtype, scale=3.0)
    logits[:, ::7] = logits.max(dim=-1, keepdim=True).values  # ties at the top of every row
    return {"logits": logits, "tokens": torch.randint(0, dims["vocab"], (n,), generator=gen)}


def _launches(step: Step) -> list[Call]:
    rows = step.tokens

    def args() -> tuple[Any, ...]:
        logits = step.tensor(rows, step.cfg.vocab_size, dtype=torch.float32)  # the model's logits are fp32
        return logits, torch.zeros(rows, dtype=torch.int64, device=step.device), 5

    return [Call(step.name, args)]


def _cost(logits: torch.Tensor, tokens: torch.Tensor, num_top: int) -> Cost:
    """Reads the logits once for the logprob (the kernel's extra passes are its choice, not counted)
    and writes a logprob and num_top (id, logprob) pairs a row; ~3 FLOPs a logit."""
    rows = logits.shape[0]
    return Cost(size(logits, tokens) + rows * (4 + 12 * num_top), 3 * logits.numel())


OP = OpSpec("logprobs", Logprobs, {"ref": logprobs_ref, "triton": logprobs_triton}, order=85,
            cases=Layout(_case_tokens, None, lambda gen, dims, dtype: {"num_top": dims["num_top"]},
                         [({"vocab": v, "num_top": k}, members) for v, k in ((7, 3), (300, 5), (300, 0))
                          for members in ROWS]),
            launches=_launches, cost=_cost)
