"""The Gated DeltaNet ops of the torch backend (`torch_ops()`) against oracles written from the
published model definition (transformers' Qwen3.5 modeling code), not from pocketllm's code.

- gated delta rule: the token-by-token recurrence in float64, one value head at a time; the
  prefill's chunked (UT-transform) form must agree with it, whatever the chunk alignment;
- causal conv1d: `F.conv1d` with groups = channels over [prior state, inputs] in float64, then
  SiLU; the new state is the last K - 1 columns of that window;
- RMSNorms: x / sqrt(mean(x^2) + eps) * weight (Qwen3RMSNorm; Qwen3.5 folds its (1 + weight) in at
  load time), and the gated one of Gated DeltaNet, normalised before it is gated by silu(gate).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_tolerances import assert_close

from pocketllm.kernels import torch_ops
from pocketllm.models.qwen3_5 import offset_norm

OPS = torch_ops()
pytestmark = pytest.mark.usefixtures("single_torch_thread")  # many tiny ops: threads only add spin-waiting


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _as_long(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def _cu_seqlens(lengths: list[int]) -> torch.Tensor:
    return _as_long([0] + lengths).cumsum(0)


# -- gated delta rule -----------------------------------------------------------------------------


def _delta_rule_oracle(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, token by token in float64: q/k [n, Hk, Dk], v [n, Hv, Dv], g/beta [n, Hv],
    state [Hv, Dk, Dv] -> (out [n, Hv, Dv], final state).

    Per value head h (reading key head h // (Hv / Hk), as transformers' repeat_interleave does),
    with q, k L2-normalised (eps 1e-6 under the root) and q scaled by Dk^-1/2:
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


def _gdn_inputs(tokens: int, heads: tuple[int, int, int, int], dtype: torch.dtype, seed: int,
                tiny_qk: bool = True) -> tuple[torch.Tensor, ...]:
    """q, k [T, Hk, Dk] and v [T, Hv, Dv] in `dtype`, with `tiny_qk` every 7th token's q and k of
    norm ~1e-3 (where the l2norm's eps shows); g (log decay) in (-inf, 0], from long memory (head 0:
    decay ~0.998 a token, so a 64-token chunk's initial state still counts) to short; beta in
    (0, 1); g and beta fp32 as the model makes them."""
    key_heads, v_heads, dim_k, dim_v = heads
    gen = _gen(seed)
    small = torch.where((torch.arange(tokens) % 7 == 3) & tiny_qk, 1e-3 / dim_k ** 0.5, 1.0)[:, None, None]
    q = (small * torch.randn(tokens, key_heads, dim_k, generator=gen)).to(dtype)
    k = (small * torch.randn(tokens, key_heads, dim_k, generator=gen)).to(dtype)
    v = torch.randn(tokens, v_heads, dim_v, generator=gen).to(dtype)
    memory = torch.linspace(6.0, 1.0, v_heads)  # decay logit per head
    g = F.logsigmoid(memory + torch.randn(tokens, v_heads, generator=gen))
    beta = torch.sigmoid(torch.randn(tokens, v_heads, generator=gen))
    return q, k, v, g, beta


def _gdn_states(slots: int, heads: tuple[int, int, int, int], seed: int) -> torch.Tensor:
    _, v_heads, dim_k, dim_v = heads
    return 0.3 * torch.randn(slots, v_heads, dim_k, dim_v, generator=_gen(seed))


# (Hk, Hv, Dk, Dv): GQA 2 (value head h reads key head h // 2) and one key head per value head; Dk != Dv
# so a transposed state layout cannot pass.
GDN_HEADS = [(2, 4, 16, 8), (2, 2, 24, 16)]
# One prefill call: (slot, start, length); lengths 1, 63, 64, 65, 130 around the 64-token chunk, starts
# on and off the absolute chunk grid; the start-0 sequence of slot 1 begins from a zero state.
GDN_SEQS = [(3, 5, 130), (1, 0, 63), (5, 64, 64), (2, 100, 1), (4, 1, 65)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("heads", GDN_HEADS, ids=str)
def test_gated_delta_prefill_matches_recurrence(heads: tuple[int, int, int, int], dtype: torch.dtype):
    """Five packed sequences: each one's outputs and the final state written to its slot equal
    the token-by-token recurrence from the slot's initial state; other slots are untouched."""
    lengths = [n for _, _, n in GDN_SEQS]
    q, k, v, g, beta = _gdn_inputs(sum(lengths), heads, dtype, seed=sum(heads))
    states = _gdn_states(6, heads, seed=1)
    states[1] = 0.0
    before = states.clone()
    out = OPS.gated_delta_prefill(q, k, v, g, beta, states, _as_long([s for s, _, _ in GDN_SEQS]),
                                  _as_long([st for _, st, _ in GDN_SEQS]), _cu_seqlens(lengths))
    assert out.shape == v.shape and out.dtype == dtype
    cu = _cu_seqlens(lengths).tolist()
    for i, (slot, _, _) in enumerate(GDN_SEQS):
        lo, hi = cu[i], cu[i + 1]
        expected, final = _delta_rule_oracle(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], before[slot])
        assert_close(out[lo:hi], expected, dtype)
        assert_close(states[slot], final, torch.float32)
    assert torch.equal(states[0], before[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_gated_delta_decode_matches_recurrence(dtype: torch.dtype):
    """Four decode steps of three sequences (slots out of order, GQA 2): every step's outputs and
    the slots' states follow the recurrence; the unused slot is untouched."""
    heads, slots, steps = GDN_HEADS[0], [2, 0, 3], 4
    states = _gdn_states(4, heads, seed=2)
    before = states.clone()
    tokens = [_gdn_inputs(len(slots), heads, dtype, seed=10 + step) for step in range(steps)]
    outs = [OPS.gated_delta_decode(*token, states, _as_long(slots)) for token in tokens]
    for b, slot in enumerate(slots):
        q, k, v, g, beta = (torch.stack([token[j][b] for token in tokens]) for j in range(5))
        expected, final = _delta_rule_oracle(q, k, v, g, beta, before[slot])
        assert_close(torch.stack([out[b] for out in outs]), expected, dtype)
        assert_close(states[slot], final, torch.float32)
    assert torch.equal(states[1], before[1])


@pytest.mark.parametrize("start,length", [(0, 130), (37, 65), (64, 1)])
def test_gated_delta_prefill_equals_token_by_token_decode(start: int, length: int):
    """Prefilling a sequence (fp32) gives, within tolerance, the outputs and state of decoding its
    tokens one at a time from the same initial state."""
    heads = GDN_HEADS[0]
    q, k, v, g, beta = _gdn_inputs(length, heads, torch.float32, seed=length)
    prefill_states = _gdn_states(2, heads, seed=3)
    decode_states = prefill_states.clone()
    prefilled = OPS.gated_delta_prefill(q, k, v, g, beta, prefill_states, _as_long([1]), _as_long([start]),
                                        _cu_seqlens([length]))
    decoded = torch.cat([OPS.gated_delta_decode(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1],
                                                decode_states, _as_long([1])) for t in range(length)])
    assert_close(prefilled, decoded)
    assert_close(prefill_states, decode_states)


def test_gated_delta_prefill_limits_of_the_rule():
    """Two closed forms that need no oracle: with beta = 0 the state only decays, so
    o_t = exp(g_1 + ... + g_t) S_0^T q_t and the final state is exp(sum g) S_0; with g = 0, beta = 1
    and q = k the delta rule overwrites the value stored at k, so o_t = v_t / sqrt(Dk)."""
    heads = GDN_HEADS[1]  # one key head per value head: q and k index the value heads directly
    dim_k = heads[2]
    q, k, v, g, beta = _gdn_inputs(130, heads, torch.float32, seed=4, tiny_qk=False)
    states = _gdn_states(1, heads, seed=5)
    initial = states[0].double()
    out = OPS.gated_delta_prefill(q, k, v, g, torch.zeros_like(beta), states, _as_long([0]), _as_long([3]),
                                  _cu_seqlens([130]))
    unit_q = q.double() / q.double().norm(dim=-1, keepdim=True) / dim_k ** 0.5
    expected = torch.einsum("thk,hkv->thv", unit_q, initial) * g.double().cumsum(0).exp()[..., None]
    assert_close(out, expected, torch.float32)
    assert_close(states[0], initial * g.double().sum(0).exp()[:, None, None], torch.float32)
    out = OPS.gated_delta_prefill(k, k, v, torch.zeros_like(g), torch.ones_like(beta), states, _as_long([0]),
                                  _as_long([3]), _cu_seqlens([130]))
    assert_close(out, v.double() / dim_k ** 0.5, torch.float32)


# -- causal conv1d ---------------------------------------------------------------------------------


def _conv_oracle(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence in float64: x [n, C], weight [C, K], state [C, K - 1] (oldest input first) ->
    (silu(conv) [n, C], new state [C, K - 1]), as transformers' causal_conv1d_update: a depthwise
    F.conv1d (cross-correlation, so tap K - 1 meets the newest input) over [state, x] unpadded."""
    channels, kernel = weight.shape
    window = torch.cat([state.double(), x.double().T], dim=1)  # [C, K - 1 + n]
    out = F.conv1d(window[None], weight.double()[:, None, :], groups=channels)[0]  # [C, n]
    return F.silu(out).T, window[:, window.shape[1] - (kernel - 1):]


def _conv_inputs(tokens: int, channels: int, kernel: int, slots: int, dtype: torch.dtype,
                 seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, C], weight [C, K] ~ N(0, 0.5) and nonzero slot states [slots, C, K - 1], all in `dtype`."""
    gen = _gen(seed)
    x = torch.randn(tokens, channels, generator=gen).to(dtype)
    weight = (0.5 * torch.randn(channels, kernel, generator=gen)).to(dtype)
    states = torch.randn(slots, channels, kernel - 1, generator=gen).to(dtype)
    return x, weight, states


# One prefill call: (slot, length); lengths 1 and 2 are shorter than K - 1 = 3, so part of the old state
# stays in the new one; slot 2 starts from zeros (a new request).
CONV_SEQS = [(4, 17), (2, 1), (0, 2), (5, 65), (1, 3), (3, 5)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kernel", [2, 3, 4])
def test_conv1d_prefill_then_decode_matches_convolution(kernel: int, dtype: torch.dtype):
    """Six packed sequences continue their slots' states, then decode three tokens each: every
    output and each slot's final state (bitwise: it holds inputs) equal the direct convolution of
    the whole [prior state, prompt, decoded tokens] window; the unused slot 6 is untouched."""
    lengths, slots, steps, channels = [n for _, n in CONV_SEQS], [s for s, _ in CONV_SEQS], 3, 12
    x, weight, states = _conv_inputs(sum(lengths) + steps * len(slots), channels, kernel, 7, dtype, seed=kernel)
    states[2] = 0
    before = states.clone()
    prompt, decoded = x[:sum(lengths)], x[sum(lengths):].reshape(steps, len(slots), channels)
    out = OPS.conv1d_prefill(prompt, weight, states, _as_long(slots), _cu_seqlens(lengths))
    step_outs = [OPS.conv1d_decode(decoded[step], weight, states, _as_long(slots)) for step in range(steps)]
    assert out.shape == prompt.shape and out.dtype == dtype
    cu = _cu_seqlens(lengths).tolist()
    for i, slot in enumerate(slots):
        inputs = torch.cat([prompt[cu[i]:cu[i + 1]], decoded[:, i]])
        expected, final = _conv_oracle(inputs, weight, before[slot])
        assert_close(torch.cat([out[cu[i]:cu[i + 1]], torch.stack([o[i] for o in step_outs])]), expected, dtype)
        assert torch.equal(states[slot].double(), final)
    assert torch.equal(states[6], before[6])


@pytest.mark.parametrize("kernel", [2, 4])
def test_conv1d_decode_matches_convolution(kernel: int):
    """Decode alone, from nonzero states of slots out of order: one convolution step each."""
    x, weight, states = _conv_inputs(3, 10, kernel, 4, torch.float32, seed=20 + kernel)
    slots = [3, 0, 2]
    before = states.clone()
    out = OPS.conv1d_decode(x, weight, states, _as_long(slots))
    for b, slot in enumerate(slots):
        expected, final = _conv_oracle(x[b:b + 1], weight, before[slot])
        assert_close(out[b:b + 1], expected, torch.float32)
        assert torch.equal(states[slot].double(), final)
    assert torch.equal(states[1], before[1])


# -- RMSNorms --------------------------------------------------------------------------------------


def _rms_normalised(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) over the last axis, in float64."""
    xd = x.double()
    return xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_rms_norm_matches_definition(dtype: torch.dtype):
    """Qwen3RMSNorm: weight * x / sqrt(mean(x^2) + eps), the weight used as given (no offset)."""
    gen = _gen(30)
    x = (3.0 * torch.randn(5, 3, 40, generator=gen)).to(dtype)
    weight = (1.0 + 0.5 * torch.randn(40, generator=gen)).to(dtype)
    eps = 0.5  # large enough to show where it enters
    out = OPS.rms_norm(x, weight, eps)
    assert out.dtype == dtype and out.shape == x.shape
    assert_close(out, _rms_normalised(x, eps) * weight.double(), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_qwen3_5_norm_is_the_offset_weight(dtype: torch.dtype):
    """Qwen3_5RMSNorm scales by (1 + weight) with weight zero-centred; the engine folds the 1 in
    at load (`offset_norm`) and then runs the plain rms_norm: together they give the definition."""
    gen = _gen(31)
    x = (3.0 * torch.randn(6, 64, generator=gen)).to(dtype)
    weight = (0.1 * torch.randn(64, generator=gen)).to(dtype)
    out = OPS.rms_norm(x, offset_norm(weight), 1e-6)
    assert_close(out, _rms_normalised(x, 1e-6) * (1.0 + weight.double()), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_rms_norm_gated_matches_definition(dtype: torch.dtype):
    """Qwen3_5RMSNormGated: weight * x / sqrt(mean(x^2) + eps) * silu(gate), normalised before the
    gate (the gate does not enter the mean), weight used as given, over each head's last axis."""
    gen = _gen(32)
    x = (3.0 * torch.randn(7, 2, 24, generator=gen)).to(dtype)
    gate = (2.0 * torch.randn(7, 2, 24, generator=gen)).to(dtype)
    weight = (1.0 + 0.5 * torch.randn(24, generator=gen)).to(dtype)
    eps = 0.25
    out = OPS.rms_norm_gated(x, gate, weight, eps)
    assert out.dtype == dtype and out.shape == x.shape
    expected = _rms_normalised(x, eps) * weight.double() * F.silu(gate.double())
    assert_close(out, expected, dtype)
