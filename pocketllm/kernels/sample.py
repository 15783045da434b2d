"""Per-row sampling: greedy, or seeded Gumbel-max with temperature, top-k and top-p.

Randomness is counter-based: the noise for vocabulary entry v of a row is a hash of
(request seed, position of the token being sampled, v). No generator state is shared between
rows or steps, so a request samples the same token whatever batch it runs in, and a kernel can
reproduce the noise bit for bit from integers alone.

The draw, exactly. mix is the lowbias32 integer mixer on 32-bit values (x ^= x >> 16;
x *= 0x7FEB352D; x ^= x >> 15; x *= 0x846CA68B; x ^= x >> 16; products mod 2^32). For a row with
64-bit seed s and position p, key = mix(s_lo ^ mix(s_hi ^ mix(p ^ 0x9E3779B9))) (s_lo, s_hi: the
low and high 32 bits of s), and entry v's uniform is u_v = ((mix(key ^ mix(v)) >> 8) + 0.5) / 2^24,
rounded to fp32 and capped at 1 - 2^-24 (the largest 24-bit draw rounds to 1.0 in fp32, whose
Gumbel noise would be infinite).
The token is the first argmax, over the entries that top-k and top-p allow, of
logits_v / temperature - log(-log(u_v)) (Gumbel-max). The position is the index of the token
being sampled in its sequence: after a prompt of n tokens, the first generated token has
position n, the next n + 1.

The hash is evaluated in int64 arithmetic whose every intermediate stays below 2^63
(multiplications are split into 16-bit halves), so it never relies on overflow.

`sample_triton` is the Triton kernel: one program per row, the same hash in uint32 arithmetic,
top-k / top-p as thresholds found by a search over sort keys instead of a sort.
"""

from typing import Any, Protocol

import torch

from ._cases import ROWS, no_shared, randn
from ._triton import kernel_device_ok, tl, triton
from .pointwise import elementwise_invariant
from .spec import Call, Cost, Layout, OpSpec, Step, size


class Sample(Protocol):
    """logits [B, V]; temperature/top_p fp32 [B]; top_k/seeds/positions int64 [B]
    -> (tokens int64 [B], logprobs fp32 [B])."""

    def __call__(self, logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 seeds: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


MASK32 = 0xFFFFFFFF
_MUL_A = 0x7FEB352D
_MUL_B = 0x846CA68B
_POSITION_SALT = 0x9E3779B9
MAX_UNIFORM = 1.0 - 2.0**-24  # the largest fp32 below 1


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
    return (((bits >> 8).float() + 0.5) * (1.0 / (1 << 24))).clamp(max=MAX_UNIFORM)


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
        gumbel = -elementwise_invariant(torch.log, -elementwise_invariant(torch.log, uniform_noise(
            seeds, positions, logits.shape[-1])))
        if bool(((top_k > 0) | (top_p < 1.0)).any()):
            scaled = scaled.masked_fill(~allowed_mask(scaled, top_k, top_p), float("-inf"))
        tokens = torch.where(sampled_rows, (scaled + gumbel).argmax(dim=-1), tokens)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


# -- Triton ------------------------------------------------------------------------------------------

BLOCK_V = 1024  # vocabulary chunk of every pass; a constant, so a row's reduction order never changes


@triton.jit
def _mix32_u32(x, MUL_A: tl.constexpr, MUL_B: tl.constexpr):
    """mix32 on uint32 values, whose multiplication wraps modulo 2^32 natively."""
    x = x ^ (x >> 16)
    x = x * tl.full([], MUL_A, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full([], MUL_B, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def _load_scaled(row_ptr, start, vocab, temperature, BLOCK: tl.constexpr):
    """One chunk of a row: (indices, in-range mask, logits / temperature, sort keys).

    The division is IEEE round-to-nearest (div_rn), as torch's `logits / temperature`. The sort key
    is the fp32 bit pattern made order-preserving as a signed int32 (negative values get their
    magnitude bits flipped), so comparing keys compares the scaled logits; keys span
    [-2^31, 2^31 - 1]."""
    offs = start + tl.arange(0, BLOCK)
    mask = offs < vocab
    x = tl.load(row_ptr + offs, mask=mask, other=float("-inf")).to(tl.float32)
    z = tl.div_rn(x, temperature)
    bits = z.to(tl.int32, bitcast=True)
    return offs, mask, z, tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _search_pass(row_ptr, vocab, temperature, z_max, kept_key, base, step, MASS: tl.constexpr,
                 BLOCK: tl.constexpr):
    """[16] statistics at the candidates c_j = base + j * step (lanes j >= 1 are used): the number of
    tokens with key > c_j or, with MASS, the unnormalised softmax(logits / T) mass of the tokens
    with key >= kept_key and key > c_j. Counts are exact in fp32 (V < 2^24)."""
    j = tl.arange(0, 16)
    candidates = tl.maximum(base + j.to(tl.int64) * step, -(2**31)).to(tl.int32)
    stats = tl.zeros([16], tl.float32)
    for start in range(0, vocab, BLOCK):
        _, mask, z, key = _load_scaled(row_ptr, start, vocab, temperature, BLOCK)
        kept = mask & (key >= kept_key)
        weight = tl.where(kept, 1.0, 0.0)
        if MASS:
            weight = tl.where(kept, tl.exp(z - z_max), 0.0)
        stats += tl.sum(tl.where(key[None, :] > candidates[:, None], weight[None, :], 0.0), axis=1)
    return stats


@triton.jit
def _search(row_ptr, vocab, temperature, z_max, kept_key, bound, MASS: tl.constexpr, BLOCK: tl.constexpr):
    """The largest s in [-2^31 - 1, 2^31 - 2] with stat(s) >= bound, stat as in `_search_pass` (it is
    non-increasing in s): 8 passes, each splitting the remaining 2^32 / 16^i keys 16 ways."""
    j = tl.arange(0, 16)
    base = tl.full([], -(2**31) - 1, tl.int64)
    step = tl.full([], 2**28, tl.int64)
    for _ in range(8):
        stats = _search_pass(row_ptr, vocab, temperature, z_max, kept_key, base, step, MASS, BLOCK)
        base += tl.sum(((stats >= bound) & (j > 0)).to(tl.int64), axis=0) * step
        step = step >> 4
    return base


@triton.jit
def _sample_kernel(logits_ptr, row_stride, temperature_ptr, top_k_ptr, top_p_ptr, seeds_ptr, positions_ptr,
                   tokens_ptr, logprobs_ptr, noise_ptr, allowed_ptr, vocab,
                   MUL_A: tl.constexpr, MUL_B: tl.constexpr, POSITION_SALT: tl.constexpr, MAX_UNIFORM: tl.constexpr,
                   DEBUG: tl.constexpr, BLOCK: tl.constexpr):
    """Program b samples row b; see `sample_triton`."""
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * row_stride
    temperature = tl.load(temperature_ptr + row)

    # Max and first argmax of the raw logits, then their sum of exponentials for the logprob.
    m = tl.full([], float("-inf"), tl.float32)
    token = tl.full([], 0, tl.int32)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
        block_max = tl.max(x, axis=0)
        block_arg = tl.min(tl.where(x == block_max, offs, vocab), axis=0)
        token = tl.where(block_max > m, block_arg, token)
        m = tl.maximum(m, block_max)
    sum_exp = tl.full([], 0.0, tl.float32)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
        sum_exp += tl.sum(tl.exp(x - m), axis=0)

    if temperature > 0.0:
        top_k = tl.load(top_k_ptr + row)
        top_p = tl.load(top_p_ptr + row)
        z_max = tl.div_rn(m, temperature)  # the largest scaled logit: division is monotone
        z_max_bits = z_max.to(tl.int32, bitcast=True)
        z_max_key = tl.where(z_max_bits >= 0, z_max_bits, z_max_bits ^ 0x7FFFFFFF).to(tl.int64)

        # Top-k keeps key >= the k-th largest key = 1 + the largest s with count(key > s) >= k.
        kept_key = tl.full([], -(2**31), tl.int64)  # the smallest key: everything kept
        if (top_k > 0) & (top_k < vocab):
            kept_key = _search(row_ptr, vocab, temperature, z_max, kept_key, top_k.to(tl.float32), False, BLOCK) + 1
        # Top-p keeps a top-k token iff the top-k mass of the tokens above it is < top_p * total:
        # key >= 1 + the largest s whose mass above is still >= top_p * total.
        threshold = kept_key
        if top_p < 1.0:
            total = tl.full([], 0.0, tl.float32)
            for start in range(0, vocab, BLOCK):
                _, mask, z, key = _load_scaled(row_ptr, start, vocab, temperature, BLOCK)
                total += tl.sum(tl.where(mask & (key >= kept_key), tl.exp(z - z_max), 0.0), axis=0)
            top_p_key = _search(row_ptr, vocab, temperature, z_max, kept_key, top_p * total, True, BLOCK) + 1
            threshold = tl.maximum(threshold, top_p_key)
        threshold = tl.minimum(threshold, z_max_key)  # the most likely token is always allowed

        # Gumbel-max over the allowed tokens with the reference's noise, a hash of (seed, position, index).
        seed = tl.load(seeds_ptr + row)
        position = tl.load(positions_ptr + row)
        row_key = _mix32_u32(position.to(tl.uint32) ^ tl.full([], POSITION_SALT, tl.uint32), MUL_A, MUL_B)
        row_key = _mix32_u32((seed >> 32).to(tl.uint32) ^ row_key, MUL_A, MUL_B)
        row_key = _mix32_u32(seed.to(tl.uint32) ^ row_key, MUL_A, MUL_B)
        best = tl.full([], float("-inf"), tl.float32)
        token = tl.full([], 0, tl.int32)
        for start in range(0, vocab, BLOCK):
            offs, mask, z, key = _load_scaled(row_ptr, start, vocab, temperature, BLOCK)
            bits = _mix32_u32(row_key ^ _mix32_u32(offs.to(tl.uint32), MUL_A, MUL_B), MUL_A, MUL_B)
            uniform = tl.minimum(((bits >> 8).to(tl.float32) + 0.5) * (1.0 / (1 << 24)), MAX_UNIFORM)
            allowed = mask & (key >= threshold)
            score = tl.where(allowed, z + -tl.log(-tl.log(uniform)), float("-inf"))
            block_max = tl.max(score, axis=0)
            block_arg = tl.min(tl.where(score == block_max, offs, vocab), axis=0)
            token = tl.where(block_max > best, block_arg, token)
            best = tl.maximum(best, block_max)
            if DEBUG:
                tl.store(noise_ptr + row * vocab + offs, uniform, mask=mask)
                tl.store(allowed_ptr + row * vocab + offs, allowed.to(tl.int8), mask=mask)

    logit = tl.load(row_ptr + token).to(tl.float32)
    tl.store(tokens_ptr + row, token.to(tl.int64))
    tl.store(logprobs_ptr + row, logit - m - tl.log(sum_exp))


def _launch_sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   seeds: torch.Tensor, positions: torch.Tensor, debug: bool
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Runs the kernel: (tokens, logprobs, uniforms, allowed). With `debug`, the last two are [B, V]
    and hold, for each sampled row, the noise and allowed mask the kernel used (greedy rows: zeros)."""
    kernel_device_ok(logits)
    rows, vocab = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    device = logits.device
    tokens = torch.empty(rows, dtype=torch.int64, device=device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=device)
    debug_shape = (rows, vocab) if debug else (1, 1)
    noise = torch.zeros(debug_shape, dtype=torch.float32, device=device)
    allowed = torch.zeros(debug_shape, dtype=torch.int8, device=device)
    if rows:
        def column(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
            return values.to(device=device, dtype=dtype).contiguous()

        _sample_kernel[(rows,)](
            logits, logits.stride(0), column(temperature, torch.float32), column(top_k, torch.int64),
            column(top_p, torch.float32), column(seeds, torch.int64), column(positions, torch.int64),
            tokens, logprobs, noise, allowed, vocab,
            MUL_A=_MUL_A, MUL_B=_MUL_B, POSITION_SALT=_POSITION_SALT, MAX_UNIFORM=MAX_UNIFORM, DEBUG=debug,
            BLOCK=BLOCK_V, num_warps=8)
    return tokens, logprobs, noise, allowed.bool()


def sample_triton(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  seeds: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample_ref` in one launch, one program per row: (tokens int64 [B], logprobs fp32 [B]).

    Invariant by construction: program b reads only row b and its own parameters and walks the
    vocabulary in fixed BLOCK_V chunks, in the same order in every pass, so each reduction has the
    same shape and order whatever B is and whatever the other rows ask for; the noise is the
    reference's 32-bit hash, bit for bit, and logits / T is IEEE-rounded like torch's.

    No sort: top-k and top-p are thresholds on the order-preserving int32 key of logits / T, each
    found exactly by an 8-pass 16-way search over the 2^32 keys. Top-k keeps key >= the k-th
    largest key; top-p keeps the top-k tokens whose strictly-larger top-k mass is < top_p of the
    top-k total. Both keep whole tie classes: where tokens share the boundary value (the k-th
    largest, or the last value top-p keeps) the kernel keeps all of them while the reference's
    stable sort keeps the lower indices first. Without ties at the boundary the allowed sets agree,
    except where a cumulative top-p mass is within fp32 rounding of top_p.
    """
    tokens, logprobs, _, _ = _launch_sample(logits, temperature, top_k, top_p, seeds, positions, debug=False)
    return tokens, logprobs


# -- declaration -------------------------------------------------------------------------------------


def _case_tokens(gen: torch.Generator, n: int, dims: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    choice = torch.randint(0, 4, (n,), generator=gen)
    return {"logits": randn(gen, n, dims["vocab"], dtype=dtype, scale=3.0),
            "temperature": torch.tensor([0.0, 0.7, 1.0, 1.3])[choice],
            "top_k": torch.tensor([0, 5, 0, 50])[choice], "top_p": torch.tensor([1.0, 1.0, 0.8, 0.95])[choice],
            "seeds": torch.randint(0, 2**62, (n,), generator=gen), "positions": torch.randint(0, 4096, (n,),
                                                                                               generator=gen)}


def _launches(step: Step) -> list[Call]:
    rows = step.sequences

    def full(value: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.full((rows,), value, dtype=dtype, device=step.device)

    def args() -> tuple[Any, ...]:
        logits = step.tensor(rows, step.cfg.vocab_size, dtype=torch.float32)  # the model's logits are fp32
        return (logits, full(0.8), full(50, torch.int64), full(0.9), torch.arange(rows, device=step.device),
                step.batch.positions[step.batch.logit_rows] + 1)

    return [Call(step.name, args)]


def _cost(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
          seeds: torch.Tensor, positions: torch.Tensor) -> Cost:
    """Reads the logits once and the per-row parameters, writes a token (int64) and a logprob (fp32)
    a row; ~5 FLOPs a logit (temperature, softmax's exp and sum, the noise's log, the comparison).
    Extra passes for top-k/top-p are the implementation's choice, not counted."""
    rows = logits.shape[0]
    return Cost(size(logits, temperature, top_k, top_p, seeds, positions) + rows * (8 + 4), 5 * logits.numel())


OP = OpSpec("sample", Sample, {"ref": sample_ref, "triton": sample_triton}, order=80,
            cases=Layout(_case_tokens, None, no_shared,
                         [({"vocab": v}, members) for v in (7, 300) for members in ROWS]),
            launches=_launches, cost=_cost)
