"""A mixture of experts' router: (topk_ids, topk_weights) from router logits, per token.

`route`: softmax over the experts in fp32, the K largest probabilities with ties broken by the
lower expert index (a stable sort on (-probability, index)), optionally renormalised to sum to one
(`norm_topk_prob`). Rank k = 0 is the most probable expert. The experts themselves: `moe`.
"""

import torch

from .pointwise import elementwise_invariant


def route(router_logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (topk_ids [T, K] int64, topk_weights [T, K] fp32), rank 0 first.

    Softmax in fp32 (exp per element by one code path, the row sum in a fixed column order), the
    top K by a stable descending sort, so equal probabilities rank by the lower expert index; with
    `normalize`, the K weights divided by their sum (added in rank order). Every step is per row,
    so a token's routing depends only on its own logits."""
    logits = router_logits.float()
    shifted = logits - logits.max(dim=-1, keepdim=True).values
    exp = elementwise_invariant(torch.exp, shifted)
    probs = exp / _sum_columns(exp)
    weights, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, ids = weights[:, :top_k], ids[:, :top_k]
    if normalize:
        weights = weights / _sum_columns(weights)
    return ids, weights


def _sum_columns(values: torch.Tensor) -> torch.Tensor:
    """[T, K] -> [T, 1]: the K columns added left to right."""
    total = values[:, :1].clone()
    for k in range(1, values.shape[1]):
        total = total + values[:, k:k + 1]
    return total
