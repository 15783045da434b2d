"""What several op test files share: random inputs, the independent float64 formulas that more than
one op is checked against, the shapes and inputs of the op families with a prefill and a decode op
(attention, the gated delta rule, the causal conv1d), the split-invariance harness and the
sampling rows. One op's own helpers stay in its test file (tests/kernels/test_<op>.py)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from kernel_impls import DEVICE

# -- random inputs ---------------------------------------------------------------------------------

DTYPES = (torch.float32, torch.float16)  # what the kernel tests run in on DEVICE (bf16: the `gpu` tests)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape, seed: int, dtype=torch.float32) -> torch.Tensor:
    """N(0, 1) on the CPU, in `dtype`."""
    return torch.randn(*shape, generator=gen(seed)).to(dtype)


def randn_on(*shape: int, seed: int, dtype: torch.dtype = torch.float32, device: str = DEVICE,
             scale: float = 1.0) -> torch.Tensor:
    """N(0, scale^2) on `device` (the kernel tests' DEVICE unless given), in `dtype`."""
    return (scale * torch.randn(*shape, generator=gen(seed))).to(device=device, dtype=dtype)


def as_long(values: list[int], device: str | None = None) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def cu_seqlens(lengths: list[int]) -> torch.Tensor:
    return as_long([0] + lengths).cumsum(0)


def assert_rows_invariant(fn, x: torch.Tensor, row_counts) -> None:
    """fn on the first m rows gives bit for bit the first m rows of fn on all rows."""
    full = fn(x)
    for m in row_counts:
        assert torch.equal(fn(x[:m]), full[:m]), f"rows 0..{m} differ from the same rows of the full batch"


@pytest.fixture(params=[1, 2], ids=lambda n: f"{n}thread")
def threads(request):
    """Run the test body at the given torch (and BLAS) thread count, then restore it."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.fixture(params=["on", "off"], ids=lambda mode: f"pairing-{mode}")
def lane_pairing(request):
    """Run the test body with the C++ packed tiles taking two lanes at once, or one (a choice of speed
    that each CPU makes for itself: kernels/cpu/lanes.h), so that both forms are tested on every CPU;
    then let the CPU choose again."""
    from pocketllm.kernels.cpu.extension import load_extension

    module = load_extension()
    if module is None:
        pytest.skip("the C++ CPU kernels cannot be built here")
    module.set_lane_pairing(request.param)
    assert module.lane_pairing() == (request.param == "on")
    yield request.param
    module.set_lane_pairing("auto")


# -- independent float64 formulas ------------------------------------------------------------------

# Tolerances of each op against its float64 formula, per input dtype.
FORMULA_TOL = {
    "rms_norm": {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
                 torch.bfloat16: dict(atol=2e-2, rtol=2e-2)},
    "rope_table": {torch.float32: dict(atol=1e-4, rtol=0)},
    "rope": {torch.float32: dict(atol=1e-4, rtol=1e-5), torch.float16: dict(atol=1e-2, rtol=5e-3)},
    "attention": {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=4e-3, rtol=4e-3)},
    "decode_vs_prefill": {torch.float32: dict(atol=1e-6, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)},
    "silu_and_mul": {torch.float32: dict(atol=1e-6, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)},
    "linear": {torch.float32: dict(atol=1e-4, rtol=1e-5), torch.float16: dict(atol=3e-2, rtol=1e-2),
               torch.bfloat16: dict(atol=2e-1, rtol=2e-2)},
}

# (num_heads, num_kv_heads, head_dim): GQA ratios 1, 2, 4 and head dims 16, 32, 24.
FORMULA_HEAD_CONFIGS = [(4, 4, 16), (4, 2, 32), (8, 2, 24), (3, 3, 24), (8, 2, 16)]


def rms_normalised(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) over the last axis, in float64."""
    xd = x.double()
    return xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + eps)


def angles(head_dim: int, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """[T, D/2] float64 angles pos * theta^(-2i/D)."""
    i = torch.arange(head_dim // 2, dtype=torch.float64)
    inv_freq = theta ** (-2.0 * i / head_dim)
    return positions.double()[:, None] * inv_freq[None, :]


def rope_reference(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate each pair (x[i], x[i + D/2]) as the complex number x[i] + j x[i + D/2] by its angle."""
    half = x.shape[-1] // 2
    z = torch.complex(x[..., :half].double(), x[..., half:].double())
    rot = torch.polar(torch.ones(1, dtype=torch.float64), angles(x.shape[-1], positions, theta))
    z = z * rot[:, None, :]
    return torch.cat([z.real, z.imag], dim=-1)


def random_cache(slots: int, max_len: int, kv_heads: int, d: int, dtype, seed: int):
    """A cache filled with random values everywhere, so reading past a sequence's end shows."""
    return (randn(slots, max_len, kv_heads, d, seed=seed, dtype=dtype),
            randn(slots, max_len, kv_heads, d, seed=seed + 1, dtype=dtype))


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
                        scale: float) -> torch.Tensor:
    """q [n, Hq, D] at positions start.., k/v [start + n, Hkv, D]: per-head softmax attention in
    float64, KV heads repeated so query head h reads KV head h // (Hq / Hkv), causal mask."""
    n, num_heads, _ = q.shape
    length = k.shape[0]
    group = num_heads // k.shape[1]
    k_rep = k.double().repeat_interleave(group, dim=1)
    v_rep = v.double().repeat_interleave(group, dim=1)
    out = torch.zeros(q.shape, dtype=torch.float64)
    causal = torch.arange(length)[None, :] <= (start + torch.arange(n))[:, None]  # key j visible to query i
    for h in range(num_heads):
        scores = (q[:, h].double() @ k_rep[:, h].T) * scale  # [n, length]
        scores = scores.masked_fill(~causal, -math.inf)
        out[:, h] = torch.softmax(scores, dim=-1) @ v_rep[:, h]
    return out


# -- attention (prefill_attention, decode_attention) -----------------------------------------------

# The torch backend's fused attention: (num_heads, num_kv_heads, head_dim) with GQA ratios 1, 2, 4, 8;
# odd head dims; the Qwen3-0.6B and Qwen3.5-0.8B attention shapes last.
FUSED_HEAD_CONFIGS = [(4, 4, 16), (4, 2, 24), (8, 2, 40), (8, 1, 8), (16, 8, 128), (8, 2, 256)]
FUSED_SLOTS, FUSED_MAX_LEN = 5, 150


def fused_cache(num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return (randn(FUSED_SLOTS, FUSED_MAX_LEN, num_kv_heads, head_dim, seed=1, dtype=dtype),
            randn(FUSED_SLOTS, FUSED_MAX_LEN, num_kv_heads, head_dim, seed=2, dtype=dtype))


# The kernels: sequence lengths of one call, and (num_heads, num_kv_heads, head_dim) with GQA ratios 1,
# 2, 4, head dims 32, 64, 128, the odd 24 and 16. The `gpu` tests: Qwen3-8B-like heads.
ATTENTION_LENGTHS = (1, 2, 17, 63, 64, 65, 130)
KERNEL_HEAD_CONFIGS = [(2, 2, 32), (4, 2, 64), (4, 1, 128), (4, 2, 24), (8, 2, 16)]
GPU_HEADS = dict(num_heads=32, num_kv_heads=8, head_dim=128)


def kv_cache(num_slots: int, max_len: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
             seed: int, device: str = DEVICE) -> tuple[torch.Tensor, torch.Tensor]:
    """Random K and V caches [slots, max_len, Hkv, D]."""
    generator = gen(seed)
    shape = (num_slots, max_len, num_kv_heads, head_dim)
    return (torch.randn(shape, generator=generator).to(device=device, dtype=dtype),
            torch.randn(shape, generator=generator).to(device=device, dtype=dtype))


def poison_past(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: list[int], ends: list[int]) -> None:
    """NaN in every cache position at or past a sequence's end: any read of one shows in the output."""
    for slot, end in zip(slots, ends):
        k_cache[slot, end:] = float("nan")
        v_cache[slot, end:] = float("nan")


# -- the gated delta rule (gated_delta_prefill, gated_delta_decode) --------------------------------


def delta_rule_oracle(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, token by token in float64: q/k [n, Hk, Dk], v [n, Hv, Dv], g/beta [n, Hv],
    state [Hv, Dk, Dv] -> (out [n, Hv, Dv], final state).

    Written from the published model definition (transformers' Qwen3.5 modeling code): per value
    head h (reading key head h // (Hv / Hk), as transformers' repeat_interleave does), with q, k
    L2-normalised (eps 1e-6 under the root) and q scaled by Dk^-1/2:
        S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - (exp(g_t) S_{t-1})^T k_t)^T,   o_t = S_t^T q_t.
    """
    n, key_heads, dim_k = q.shape
    v_heads = v.shape[1]
    out = torch.zeros(n, v_heads, v.shape[2], dtype=torch.float64)
    final = torch.zeros(state.shape, dtype=torch.float64)
    for h in range(v_heads):
        kh = h // (v_heads // key_heads)
        s = state[h].double()
        for t in range(n):
            qt, kt = q[t, kh].double(), k[t, kh].double()
            qt = qt / torch.sqrt(qt @ qt + 1e-6) / dim_k ** 0.5
            kt = kt / torch.sqrt(kt @ kt + 1e-6)
            decayed = torch.exp(g[t, h].double()) * s
            s = decayed + beta[t, h].double() * torch.outer(kt, v[t, h].double() - decayed.T @ kt)
            out[t, h] = s.T @ qt
        final[h] = s
    return out, final


def gdn_oracle_inputs(tokens: int, heads: tuple[int, int, int, int], dtype: torch.dtype, seed: int,
                      tiny_qk: bool = True) -> tuple[torch.Tensor, ...]:
    """q, k [T, Hk, Dk] and v [T, Hv, Dv] in `dtype`, with `tiny_qk` every 7th token's q and k of
    norm ~1e-3 (where the l2norm's eps shows); g (log decay) in (-inf, 0], from long memory (head 0:
    decay ~0.998 a token, so a 64-token chunk's initial state still counts) to short; beta in
    (0, 1); g and beta fp32 as the model makes them."""
    key_heads, v_heads, dim_k, dim_v = heads
    generator = gen(seed)
    small = torch.where((torch.arange(tokens) % 7 == 3) & tiny_qk, 1e-3 / dim_k ** 0.5, 1.0)[:, None, None]
    q = (small * torch.randn(tokens, key_heads, dim_k, generator=generator)).to(dtype)
    k = (small * torch.randn(tokens, key_heads, dim_k, generator=generator)).to(dtype)
    v = torch.randn(tokens, v_heads, dim_v, generator=generator).to(dtype)
    memory = torch.linspace(6.0, 1.0, v_heads)  # decay logit per head
    g = F.logsigmoid(memory + torch.randn(tokens, v_heads, generator=generator))
    beta = torch.sigmoid(torch.randn(tokens, v_heads, generator=generator))
    return q, k, v, g, beta


def gdn_oracle_states(slots: int, heads: tuple[int, int, int, int], seed: int) -> torch.Tensor:
    _, v_heads, dim_k, dim_v = heads
    return 0.3 * torch.randn(slots, v_heads, dim_k, dim_v, generator=gen(seed))


# Oracle heads (Hk, Hv, Dk, Dv): GQA 2 (value head h reads key head h // 2) and one key head per value
# head; Dk != Dv so a transposed state layout cannot pass.
GDN_HEADS = [(2, 4, 16, 8), (2, 2, 24, 16)]
# Kernel heads (Hk, Hv, Dk, Dv): GQA ratios 1 and 2, odd Dk 24, Dv 48 (two prefill Dv blocks, the last
# partial); the `gpu` tests' Qwen3.5 sizes.
GDN_KERNEL_HEADS = [(2, 2, 32, 32), (1, 2, 16, 24), (1, 1, 24, 48)]
QWEN35_HEADS = (16, 32, 128, 128)


def gdn_inputs(tokens: int, key_heads: int, v_heads: int, dim_k: int, dim_v: int, dtype: torch.dtype, seed: int,
               device: str = DEVICE) -> tuple[torch.Tensor, ...]:
    """q/k/v as strided views of one fused [T, ...] projection (as the model makes them), g in
    (-inf, 0] with many decays near 1, beta in (0, 1)."""
    generator = gen(seed)
    qk = key_heads * dim_k
    fused = torch.randn(tokens, 2 * qk + v_heads * dim_v, generator=generator).to(device=device, dtype=dtype)
    q, k, v = fused.split([qk, qk, v_heads * dim_v], dim=-1)
    g = F.logsigmoid(2.0 + 2.0 * torch.randn(tokens, v_heads, generator=generator)).to(device)
    beta = torch.sigmoid(torch.randn(tokens, v_heads, generator=generator)).to(device)
    return (q.reshape(tokens, key_heads, dim_k), k.reshape(tokens, key_heads, dim_k),
            v.reshape(tokens, v_heads, dim_v), g, beta)


def gdn_states(num_slots: int, v_heads: int, dim_k: int, dim_v: int, seed: int, device: str = DEVICE) -> torch.Tensor:
    return (0.3 * torch.randn(num_slots, v_heads, dim_k, dim_v, generator=gen(seed))).to(device)


def gdn_prefill(fn, inputs, states: torch.Tensor, slots: list[int], starts: list[int], lengths: list[int]):
    """Run a prefill launcher on a copy of `states`; returns (out, new states)."""
    device = states.device
    states = states.clone()
    cu = as_long([0] + lengths, device).cumsum(0)
    out = fn(*inputs, states, as_long(slots, device), as_long(starts, device), cu)
    return out, states


def rows(inputs, lo: int, hi: int):
    return tuple(x[lo:hi] for x in inputs)


# -- the causal conv1d (conv1d_prefill, conv1d_decode) ---------------------------------------------


def conv_oracle(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence in float64: x [n, C], weight [C, K], state [C, K - 1] (oldest input first) ->
    (silu(conv) [n, C], new state [C, K - 1]), as transformers' causal_conv1d_update: a depthwise
    F.conv1d (cross-correlation, so tap K - 1 meets the newest input) over [state, x] unpadded."""
    channels, kernel = weight.shape
    window = torch.cat([state.double(), x.double().T], dim=1)  # [C, K - 1 + n]
    out = F.conv1d(window[None], weight.double()[:, None, :], groups=channels)[0]  # [C, n]
    return F.silu(out).T, window[:, window.shape[1] - (kernel - 1):]


def conv_oracle_inputs(tokens: int, channels: int, kernel: int, slots: int, dtype: torch.dtype,
                       seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, C], weight [C, K] ~ N(0, 0.5) and nonzero slot states [slots, C, K - 1], all in `dtype`."""
    generator = gen(seed)
    x = torch.randn(tokens, channels, generator=generator).to(dtype)
    weight = (0.5 * torch.randn(channels, kernel, generator=generator)).to(dtype)
    states = torch.randn(slots, channels, kernel - 1, generator=generator).to(dtype)
    return x, weight, states


CONV_SLOTS = 8
GPU_CHANNELS = 8192


def conv_cu(lens: list[int], device: str = DEVICE) -> torch.Tensor:
    return torch.tensor([0] + lens, device=device).cumsum(0)


def conv_inputs(tokens: int, channels: int, kernel: int, dtype: torch.dtype, seed: int, device: str = DEVICE,
                slots: int = CONV_SLOTS):
    """x [T, C] as a column slice of a wider projection (row stride != C, as the model's fused
    projections give it), weight [C, K] and random conv states (continued sequences) with slot 0
    zeroed (a new request)."""
    x = randn_on(tokens, channels + 9, seed=seed, dtype=dtype, device=device)[:, 3:3 + channels]
    weight = randn_on(channels, kernel, seed=seed + 1, dtype=dtype, device=device, scale=0.5)
    states = randn_on(slots, channels, kernel - 1, seed=seed + 2, dtype=dtype, device=device)
    states[0] = 0
    return x, weight, states


# -- split invariance of the prefill ops -----------------------------------------------------------
# A sequence that already holds tokens in its slot (start 64, 128, or off the grid) is prefilled in
# one call, then again in pieces cut at absolute positions (192, ...), each piece continuing from the
# state the previous one left and sharing its call with an unrelated sequence. The outputs and the
# final slot state must be torch.equal.

SLOT, OTHER_SLOT, OTHER_LEN = 1, 2, 5


def device_long(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=DEVICE)


def split_run(call, inputs: tuple[torch.Tensor, ...], state: torch.Tensor, start: int, cuts: list[int]):
    """(whole output, whole state, pieces output, pieces state): `call(inputs, state, slots, starts,
    lengths)` once for positions start.. and once per piece between the absolute `cuts`, each piece
    after an unrelated sequence of OTHER_LEN tokens (the last OTHER_LEN rows of `inputs`)."""
    length = inputs[0].shape[0] - OTHER_LEN
    prompt = tuple(x[:length] for x in inputs)
    other = tuple(x[length:] for x in inputs)
    whole_state = state.clone()
    whole = call(prompt, whole_state, [SLOT], [start], [length])
    bounds = [start] + [c for c in cuts if start < c < start + length] + [start + length]
    assert len(bounds) > 2, "no cut inside the prompt"
    piece_state = state.clone()
    pieces = []
    for lo, hi in zip(bounds, bounds[1:]):
        batch = tuple(torch.cat([a, b[lo - start:hi - start]]) for a, b in zip(other, prompt))
        out = call(batch, piece_state, [OTHER_SLOT, SLOT], [7, lo], [OTHER_LEN, hi - lo])
        pieces.append(out[OTHER_LEN:])
    return whole, whole_state[SLOT], torch.cat(pieces), piece_state[SLOT]


def assert_split_invariant(result) -> None:
    whole, whole_state, pieces, piece_state = result
    assert torch.equal(pieces, whole)
    assert torch.equal(piece_state, whole_state)


# -- sampling ---------------------------------------------------------------------------------------


def as_int64(seed: int) -> int:
    """A seed in [0, 2^64) as the int64 with the same bits (how the engine passes seeds)."""
    return seed - 2**64 if seed >= 2**63 else seed


# One batch of every kind of row, for the reference and the invariance tests of `sample`:
# (temperature, top_k, top_p, seed, position).
MIXED_ROWS = [
    (0.0, 0, 1.0, 1, 0),  # greedy
    (1.0, 0, 1.0, 2, 5),  # plain
    (0.7, 5, 1.0, 3, 17),  # top-k
    (1.3, 0, 0.8, 4, 2),  # top-p
    (0.5, 3, 0.5, 2**64 - 1, 1000),  # top-k + top-p, the largest seed
    (2.5, 0, 1.0, 0, 63),  # hot, seed 0
    (0.0, 7, 0.3, 9, 9),  # greedy whatever top-k / top-p say
    (1.0, 1, 1.0, 10, 4),  # top_k 1
    (0.9, 10**6, 0.95, 15, 2**31),  # top_k >= V, a position past 2^31
]
