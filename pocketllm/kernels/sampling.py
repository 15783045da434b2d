"""Per-row sampling: greedy, or seeded Gumbel-max with temperature, top-k and top-p.

Randomness is counter-based: the noise for vocabulary entry v of a row is a hash of
(request seed, position of the token being sampled, v). No generator state is shared between
rows or steps, so a request samples the same token whatever batch it runs in, and a kernel can
reproduce the noise bit for bit from integers alone.

The hash is a 32-bit integer mixer evaluated in int64 arithmetic whose every intermediate stays
below 2^63 (multiplications are split into 16-bit halves), so it never relies on overflow.
"""

import torch

MASK32 = 0xFFFFFFFF
_MUL_A = 0x7FEB352D
_MUL_B = 0x846CA68B
_POSITION_SALT = 0x9E3779B9


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """(x * constant) mod 2^32 for x in [0, 2^32), without int64 overflow."""
    low = x * (constant & 0xFFFF)
    high = ((x * (constant >> 16)) & 0xFFFF) << 16
    return (low + high) & MASK32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective avalanche mixer on 32-bit values held in an int64 tensor."""
    x = x ^ (x >> 16)
    x = _mul32(x, _MUL_A)
    x = x ^ (x >> 15)
    x = _mul32(x, _MUL_B)
    return x ^ (x >> 16)


def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One 32-bit key per row from its 64-bit seed and position, both int64 [B] (seeds may be
    given as their two's-complement int64 view)."""
    seed_lo = seeds & MASK32
    seed_hi = (seeds >> 32) & MASK32
    return mix32(seed_lo ^ mix32(seed_hi ^ mix32((positions & MASK32) ^ _POSITION_SALT)))


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] fp32 uniforms in (0, 1), a pure function of (seed, position, vocab index)."""
    vocab = torch.arange(vocab_size, dtype=torch.int64, device=seeds.device)
    bits = mix32(row_keys(seeds, positions)[:, None] ^ mix32(vocab)[None, :])
    return ((bits >> 8).float() + 0.5) * (1.0 / (1 << 24))


def allowed_mask(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[B, V] bool: the top-k tokens (k = 0: all), then the smallest prefix, in descending
    probability order, whose probability mass reaches top_p (the first token always stays)."""
    values, order = scaled.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(scaled.shape[-1], device=scaled.device)[None, :]
    keep = (top_k[:, None] <= 0) | (rank < top_k[:, None])
    probs = torch.softmax(values.masked_fill(~keep, float("-inf")), dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    keep &= (mass_before < top_p[:, None]) | (rank == 0) | (top_p[:, None] >= 1.0)
    return torch.zeros_like(keep).scatter(-1, order, keep)


def sample_ref(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
               seeds: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V]; temperature/top_p fp32 [B]; top_k/seeds/positions int64 [B].

    Returns (tokens int64 [B], logprobs fp32 [B]) where logprob is the log-softmax of the raw
    logits at the chosen token. temperature 0 means greedy (argmax, first index on ties).
    """
    logits = logits.float()
    logprobs = torch.log_softmax(logits, dim=-1)
    tokens = logits.argmax(dim=-1)
    sampled_rows = temperature > 0
    if bool(sampled_rows.any()):
        scaled = logits / torch.where(sampled_rows, temperature, 1.0)[:, None]
        gumbel = -torch.log(-torch.log(uniform_noise(seeds, positions, logits.shape[-1])))
        if bool(((top_k > 0) | (top_p < 1.0)).any()):
            scaled = scaled.masked_fill(~allowed_mask(scaled, top_k, top_p), float("-inf"))
        tokens = torch.where(sampled_rows, (scaled + gumbel).argmax(dim=-1), tokens)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)
