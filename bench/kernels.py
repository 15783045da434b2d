"""Each Triton kernel vs its torch reference and the nearest torch.nn.functional equivalent.

On a CUDA device: bf16 at serving sizes, timed with triton.testing.do_bench; reports time,
achieved GB/s and % of the device's peak HBM bandwidth (memory-bound ops), TFLOP/s and the ratio
to torch.matmul (matmul). `--smoke` runs the same code paths on tiny fp32 shapes under the Triton
interpreter on CPU (a CI check that the benchmark itself works; its timings mean nothing).
Writes kernels.json and kernels.md to --out (default: $OUT, else bench/results/).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from pocketllm.kernels import _triton
from pocketllm.kernels.conv1d_decode import conv1d_decode_ref, conv1d_decode_triton
from pocketllm.kernels.conv1d_prefill import conv1d_prefill_ref, conv1d_prefill_triton
from pocketllm.kernels.decode_attention import decode_attention_ref, decode_attention_triton
from pocketllm.kernels.gated_delta_decode import gated_delta_decode_ref, gated_delta_decode_triton
from pocketllm.kernels.gated_delta_prefill import gated_delta_prefill_ref, gated_delta_prefill_triton
from pocketllm.kernels.linear import linear_ref, linear_triton
from pocketllm.kernels.prefill_attention import prefill_attention_ref, prefill_attention_triton
from pocketllm.kernels.rms_norm import rms_norm_ref, rms_norm_triton
from pocketllm.kernels.rms_norm_gated import rms_norm_gated_ref, rms_norm_gated_triton
from pocketllm.kernels.rope import rope_table
from pocketllm.kernels.rope_write_kv import rope_write_kv_ref, rope_write_kv_triton
from pocketllm.kernels.sample import sample_ref, sample_triton
from pocketllm.kernels.silu_and_mul import silu_and_mul_ref, silu_and_mul_triton

# Peak HBM bandwidth (bytes/s) and dense bf16 tensor throughput (FLOP/s) by device name fragment.
DEVICE_PEAKS = {"H200": (4.8e12, 989e12), "H100": (3.35e12, 989e12), "A100": (2.04e12, 312e12),
                "L40S": (0.864e12, 362e12), "L4": (0.3e12, 121e12)}


@dataclass
class Case:
    name: str
    shape: str
    kernel: Callable[[], object]
    baselines: dict[str, Callable[[], object]]
    bytes_moved: float = 0.0
    flops: float = 0.0
    reset: Callable[[], object] | None = None  # stateful ops: restore the state before the error check


def time_ms(fn: Callable[[], object], smoke: bool) -> float:
    if smoke:
        start = time.perf_counter()
        fn()
        return 1000 * (time.perf_counter() - start)
    return float(_triton.triton.testing.do_bench(fn, warmup=25, rep=100))


def max_abs_error(kernel_out: object, reference_out: object) -> float:
    """Largest elementwise difference of the first output (tokens for the sampler)."""
    first = lambda out: out[0] if isinstance(out, tuple) else out  # noqa: E731
    return (first(kernel_out).float() - first(reference_out).float()).abs().max().item()


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def make_cases(device: str, dtype: torch.dtype, smoke: bool) -> list[Case]:
    g = torch.Generator(device="cpu").manual_seed(0)

    def g_cpu(seed: int) -> torch.Generator:
        return torch.Generator(device="cpu").manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    cases = []
    # -- decode attention: the memory-bound heart of serving ---------------------------------------
    for batch, context in ([(2, 150)] if smoke else [(8, 4096), (32, 4096), (8, 16384)]):
        hq, hkv, d = (4, 2, 32) if smoke else (32, 8, 128)
        k_cache, v_cache = rand(batch, context, hkv, d), rand(batch, context, hkv, d)
        q = rand(batch, hq, d)
        slots = torch.arange(batch, device=device)
        lens = torch.full((batch,), context, device=device)
        padded_q = q[:, :, None, :]
        keys, values = k_cache.transpose(1, 2), v_cache.transpose(1, 2)
        split = 64 if smoke else 256
        cases.append(Case(
            "decode_attention", f"B={batch} ctx={context} Hq={hq} Hkv={hkv} D={d}",
            lambda q=q, k=k_cache, v=v_cache, s=slots, n=lens, split=split: decode_attention_triton(
                q, k, v, s, n, d ** -0.5, split_size=split),
            {"reference": lambda q=q, k=k_cache, v=v_cache, s=slots, n=lens: decode_attention_ref(q, k, v, s, n, d ** -0.5),
             "F.sdpa": lambda q=padded_q, k=keys, v=values: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)},
            bytes_moved=nbytes(k_cache, v_cache, q, q)))
    # -- prefill attention ------------------------------------------------------------------------
    for batch, length in ([(2, 20)] if smoke else [(4, 1024), (1, 4096)]):
        hq, hkv, d = (4, 2, 32) if smoke else (32, 8, 128)
        k_cache, v_cache = rand(batch, length, hkv, d), rand(batch, length, hkv, d)
        q = rand(batch * length, hq, d)
        slots = torch.arange(batch, device=device)
        starts = torch.zeros(batch, dtype=torch.int64, device=device)
        cu = torch.arange(0, batch * length + 1, length, device=device)
        dense_q = q.view(batch, length, hq, d).transpose(1, 2)
        keys, values = k_cache.transpose(1, 2), v_cache.transpose(1, 2)
        cases.append(Case(
            "prefill_attention", f"B={batch} len={length} Hq={hq} Hkv={hkv} D={d}",
            lambda q=q, k=k_cache, v=v_cache, s=slots, st=starts, cu=cu: prefill_attention_triton(
                q, k, v, s, st, cu, d ** -0.5),
            {"reference": lambda q=q, k=k_cache, v=v_cache, s=slots, st=starts, cu=cu: prefill_attention_ref(
                q, k, v, s, st, cu, d ** -0.5),
             "F.sdpa": lambda q=dense_q, k=keys, v=values: F.scaled_dot_product_attention(
                 q, k, v, is_causal=True, enable_gqa=True)},
            flops=2 * 2 * batch * hq * d * length * length / 2))
    # -- matmul -------------------------------------------------------------------------------------
    for m, k, n in ([(5, 48, 33)] if smoke else [(1, 4096, 4096), (8, 4096, 4096), (256, 4096, 4096),
                                                   (4096, 4096, 4096), (4096, 4096, 12288)]):
        x, w = rand(m, k), rand(n, k)
        cases.append(Case("linear", f"M={m} K={k} N={n}", lambda x=x, w=w: linear_triton(x, w),
                          {"reference": lambda x=x, w=w: linear_ref(x, w), "torch.matmul": lambda x=x, w=w: x @ w.T},
                          bytes_moved=nbytes(x, w) + m * n * x.element_size(), flops=2 * m * n * k))
    # -- row-wise ops ------------------------------------------------------------------------------
    rows, hidden = (7, 64) if smoke else (4096, 4096)
    x, weight = rand(rows, hidden), rand(hidden)
    cases.append(Case("rms_norm", f"{rows}x{hidden}", lambda: rms_norm_triton(x, weight, 1e-6),
                      {"reference": lambda: rms_norm_ref(x, weight, 1e-6),
                       "F.rms_norm": lambda: F.rms_norm(x, (hidden,), weight, 1e-6)},
                      bytes_moved=2 * nbytes(x)))
    inter = 96 if smoke else 11008
    gate_up = rand(rows, 2 * inter)
    gate, up = gate_up.chunk(2, dim=-1)
    cases.append(Case("silu_and_mul", f"{rows}x{2 * inter}", lambda: silu_and_mul_triton(gate_up),
                      {"reference": lambda: silu_and_mul_ref(gate_up), "F.silu*up": lambda: F.silu(gate) * up},
                      bytes_moved=1.5 * nbytes(gate_up)))
    # -- rope + K/V write --------------------------------------------------------------------------
    tokens, hq, hkv, d = (9, 4, 2, 32) if smoke else (4096, 32, 8, 128)
    q, k, v = rand(tokens, hq, d), rand(tokens, hkv, d), rand(tokens, hkv, d)
    cos, sin = rope_table(d, tokens, 1e6, device=device)
    positions = torch.arange(tokens, device=device)
    slots = torch.zeros(tokens, dtype=torch.int64, device=device)
    k_cache = torch.zeros(1, tokens, hkv, d, device=device, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    cases.append(Case("rope_write_kv", f"T={tokens} Hq={hq} Hkv={hkv} D={d}",
                      lambda: rope_write_kv_triton(q, k, v, positions, cos, sin, k_cache, v_cache, slots),
                      {"reference": lambda: rope_write_kv_ref(q, k, v, positions, cos, sin, k_cache, v_cache, slots)},
                      bytes_moved=2 * nbytes(q, k, v) + nbytes(k)))
    # -- Gated DeltaNet (Qwen3.5) -------------------------------------------------------------------
    seqs, length = (2, 70) if smoke else (8, 512)
    hk, hv, dk, dv, width = (1, 2, 16, 16, 4) if smoke else (16, 32, 128, 128, 4)
    conv_dim = 2 * hk * dk + hv * dv
    gd_tokens = seqs * length
    gd_slots = torch.arange(seqs, device=device)
    gd_starts = torch.zeros(seqs, dtype=torch.int64, device=device)
    gd_cu = torch.arange(0, gd_tokens + 1, length, device=device)
    gd_x, gd_conv_w = rand(gd_tokens, conv_dim), rand(conv_dim, width)
    gd_conv_states = torch.zeros(seqs, conv_dim, width - 1, device=device, dtype=dtype)
    cases.append(Case("conv1d_prefill", f"T={gd_tokens} C={conv_dim} K={width}",
                      lambda: conv1d_prefill_triton(gd_x, gd_conv_w, gd_conv_states, gd_slots, gd_cu),
                      {"reference": lambda: conv1d_prefill_ref(gd_x, gd_conv_w, gd_conv_states, gd_slots, gd_cu)},
                      bytes_moved=2 * nbytes(gd_x), reset=gd_conv_states.zero_))
    gd_x1 = rand(seqs, conv_dim)
    cases.append(Case("conv1d_decode", f"B={seqs} C={conv_dim} K={width}",
                      lambda: conv1d_decode_triton(gd_x1, gd_conv_w, gd_conv_states, gd_slots),
                      {"reference": lambda: conv1d_decode_ref(gd_x1, gd_conv_w, gd_conv_states, gd_slots)},
                      bytes_moved=2 * nbytes(gd_x1) + 2 * nbytes(gd_conv_states), reset=gd_conv_states.zero_))
    gd_q, gd_k, gd_v = rand(gd_tokens, hk, dk), rand(gd_tokens, hk, dk), rand(gd_tokens, hv, dv)
    gd_decay = -torch.rand(gd_tokens, hv, generator=g_cpu(1)).to(device)
    gd_beta = torch.rand(gd_tokens, hv, generator=g_cpu(2)).to(device)
    gd_states = torch.zeros(seqs, hv, dk, dv, device=device)
    cases.append(Case("gated_delta_prefill", f"B={seqs} len={length} Hk={hk} Hv={hv} Dk={dk} Dv={dv}",
                      lambda: gated_delta_prefill_triton(gd_q, gd_k, gd_v, gd_decay, gd_beta, gd_states, gd_slots, gd_starts, gd_cu),
                      {"reference": lambda: gated_delta_prefill_ref(gd_q, gd_k, gd_v, gd_decay, gd_beta, gd_states, gd_slots, gd_starts, gd_cu)},
                      flops=2 * 2 * gd_tokens * hv * dk * dv, reset=gd_states.zero_))
    q1, k1, v1, g1, b1 = gd_q[:seqs], gd_k[:seqs], gd_v[:seqs], gd_decay[:seqs], gd_beta[:seqs]
    cases.append(Case("gated_delta_decode", f"B={seqs} Hv={hv} Dk={dk} Dv={dv}",
                      lambda: gated_delta_decode_triton(q1, k1, v1, g1, b1, gd_states, gd_slots),
                      {"reference": lambda: gated_delta_decode_ref(q1, k1, v1, g1, b1, gd_states, gd_slots)},
                      bytes_moved=2 * nbytes(gd_states), reset=gd_states.zero_))
    o, z, norm_w = rand(gd_tokens, hv, dv), rand(gd_tokens, hv, dv), rand(dv)
    cases.append(Case("rms_norm_gated", f"{gd_tokens}x{hv}x{dv}", lambda: rms_norm_gated_triton(o, z, norm_w, 1e-6),
                      {"reference": lambda: rms_norm_gated_ref(o, z, norm_w, 1e-6)}, bytes_moved=3 * nbytes(o)))
    # -- sampling ----------------------------------------------------------------------------------
    batch, vocab = (3, 300) if smoke else (64, 151936)
    logits = torch.randn(batch, vocab, generator=g).to(device)
    temperature = torch.full((batch,), 0.8, device=device)
    top_k = torch.full((batch,), 50, dtype=torch.int64, device=device)
    top_p = torch.full((batch,), 0.9, device=device)
    seeds = torch.arange(batch, dtype=torch.int64, device=device)
    pos = torch.full((batch,), 7, dtype=torch.int64, device=device)
    cases.append(Case("sample (top-k 50, top-p 0.9)", f"B={batch} V={vocab}",
                      lambda: sample_triton(logits, temperature, top_k, top_p, seeds, pos),
                      {"reference": lambda: sample_ref(logits, temperature, top_k, top_p, seeds, pos)},
                      bytes_moved=nbytes(logits)))
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny fp32 shapes under the interpreter (CPU)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or Path(__file__).parent / "results"))
    parser.add_argument("--peak-gbps", type=float, default=None, help="override the device's peak bandwidth")
    args = parser.parse_args()

    cuda = torch.cuda.is_available() and not args.smoke
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    name = torch.cuda.get_device_name() if cuda else platform.processor() or platform.machine()
    peak_bw, peak_flops = next((v for key, v in DEVICE_PEAKS.items() if key in name), (None, None))
    if args.peak_gbps:
        peak_bw = args.peak_gbps * 1e9
    rows = []
    for case in make_cases(device, dtype, smoke=not cuda):
        kernel_ms = time_ms(case.kernel, not cuda)
        outputs = []
        for fn in (case.kernel, case.baselines["reference"]):
            if case.reset:
                case.reset()
            outputs.append(fn())
        error = max_abs_error(*outputs)
        row = {"op": case.name, "shape": case.shape, "kernel_ms": kernel_ms, "max_abs_err_vs_reference": error,
               "baselines_ms": {label: time_ms(fn, not cuda) for label, fn in case.baselines.items()}}
        if case.bytes_moved:
            row["GB/s"] = case.bytes_moved / kernel_ms / 1e6
            row["%peak_bw"] = 100 * case.bytes_moved / (kernel_ms / 1000) / peak_bw if peak_bw else None
        if case.flops:
            row["TFLOP/s"] = case.flops / kernel_ms / 1e9
        if case.name == "linear":
            row["vs_torch.matmul"] = row["baselines_ms"]["torch.matmul"] / kernel_ms
        rows.append(row)
        print(json.dumps(row))
    report = {"device": name, "dtype": str(dtype), "interpreted": _triton.INTERPRETED,
              "peak_bandwidth_Bps": peak_bw, "peak_bf16_flops": peak_flops, "torch": torch.__version__,
              "triton": getattr(_triton.triton, "__version__", None), "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kernels.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [f"Device: {name}, {dtype}, torch {torch.__version__}" + (" (interpreter smoke run)" if not cuda else ""),
             "", "| op | shape | kernel ms | baselines ms | GB/s | % peak BW | TFLOP/s | vs torch.matmul | max err |",
             "|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    for r in rows:
        base = ", ".join(f"{k} {v:.3f}" for k, v in r["baselines_ms"].items())
        lines.append(f"| {r['op']} | {r['shape']} | {r['kernel_ms']:.3f} | {base} | {fmt(r.get('GB/s'), '.0f')} | "
                     f"{fmt(r.get('%peak_bw'), '.0f')} | {fmt(r.get('TFLOP/s'), '.1f')} | "
                     f"{fmt(r.get('vs_torch.matmul'), '.2f')} | {r['max_abs_err_vs_reference']:.2g} |")
    (args.out / "kernels.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
