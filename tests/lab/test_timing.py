"""pocketllm.lab.timing and the roofline of launches.py: each formula on a shape worked out here by
hand, the bench on CPU (quick shapes under the interpreter, real shapes for torch), its errors and
its JSON."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from pocketllm.kernels._triton import INTERPRETED
from pocketllm.lab.launches import REAL, call_cost, model_steps, op_calls
from pocketllm.lab.timing import (
    DEVICE_PEAKS,
    BenchRow,
    _measure,
    add_parser,
    bench,
    bench_op,
    device_peaks,
    main,
    run,
)

BF16, FP32, I64 = 2, 4, 8  # bytes an element


def empty(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


def index(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def test_linear_reads_the_weight_once():
    m, k, n = 3, 64, 32
    cost = call_cost("linear", (empty(m, k), empty(n, k)))
    assert cost.bytes == BF16 * (m * k + n * k + m * n)
    assert cost.flops == 2 * m * n * k
    assert call_cost("prefill_linear", (empty(m, k), empty(n, k))) == cost


def test_decode_attention_reads_only_the_cached_positions():
    heads, kv_heads, d, slots, max_len = 4, 2, 16, 4, 100
    seq_lens = (10, 30)
    q = empty(len(seq_lens), heads, d)
    cache = empty(slots, max_len, kv_heads, d)
    cost = call_cost("decode_attention", (q, cache, cache, index(2, 0), index(*seq_lens), 0.25))
    keys = 10 + 30
    assert cost.bytes == 2 * q.numel() * BF16 + 2 * keys * kv_heads * d * BF16 + 2 * 2 * I64
    assert cost.flops == sum(4 * heads * d * n for n in seq_lens)


def test_prefill_attention_is_causal_over_cached_and_new_keys():
    heads, kv_heads, d = 4, 2, 16
    starts, lengths = (0, 5), (3, 4)
    tokens = sum(lengths)
    q, cache = empty(tokens, heads, d), empty(2, 64, kv_heads, d)
    cost = call_cost("prefill_attention", (q, cache, cache, index(0, 1), index(*starts), index(0, 3, 7), 0.25))
    # Row j of a sequence cached up to s sees s + j + 1 keys: 1 + 2 + 3, then 6 + 7 + 8 + 9.
    seen = sum(s + j + 1 for s, n in zip(starts, lengths) for j in range(n))
    assert seen == 36
    read = (0 + 3) + (5 + 4)  # positions of K and V each sequence reads
    assert cost.flops == 4 * heads * d * seen
    assert cost.bytes == 2 * tokens * heads * d * BF16 + 2 * read * kv_heads * d * BF16 + (2 + 2 + 3) * I64


def test_gated_delta_rule_costs_seven_state_products_per_token_and_head():
    tokens, k_heads, v_heads, dk, dv, slots = 5, 1, 2, 8, 4, 3
    q, k, v = empty(tokens, k_heads, dk), empty(tokens, k_heads, dk), empty(tokens, v_heads, dv)
    g, beta = empty(tokens, v_heads, dtype=torch.float32), empty(tokens, v_heads, dtype=torch.float32)
    states = empty(slots, v_heads, dk, dv, dtype=torch.float32)
    cost = call_cost("gated_delta_prefill", (q, k, v, g, beta, states, index(1, 2), index(0, 0), index(0, 2, 5)))
    inputs = (2 * tokens * k_heads * dk + tokens * v_heads * dv) * BF16 + 2 * tokens * v_heads * FP32
    state = 2 * (2 * v_heads * dk * dv * FP32)  # two sequences' states, read and written
    assert cost.bytes == inputs + tokens * v_heads * dv * BF16 + state + (2 + 2 + 3) * I64
    assert cost.flops == tokens * v_heads * 7 * dk * dv
    decode = call_cost("gated_delta_decode", (q[:2], k[:2], v[:2], g[:2], beta[:2], states, index(1, 2)))
    assert decode.flops == 2 * v_heads * 7 * dk * dv


def test_elementwise_ops_read_and_write_each_element_once():
    rows, hidden, inter = 6, 64, 96
    x = empty(rows, hidden)
    assert call_cost("rms_norm", (x, empty(hidden), 1e-6)).bytes == (2 * rows * hidden + hidden) * BF16
    silu = call_cost("silu_and_mul", (empty(rows, 2 * inter),))
    assert silu.bytes == (rows * 2 * inter + rows * inter) * BF16 and silu.flops == 5 * rows * inter
    channels, width, slots = 48, 4, 2
    conv = call_cost("conv1d_decode", (empty(rows, channels), empty(channels, width),
                                      empty(slots, channels, width - 1), index(*range(rows))))
    assert conv.flops == (2 * width + 4) * rows * channels
    assert conv.bytes == (2 * rows * channels + channels * width + 2 * rows * channels * (width - 1)) * BF16 \
        + rows * I64


def test_real_decode_attention_reads_4096_positions_not_the_cache():
    step = next(s for s in model_steps(REAL) if s.name == "qwen3-0.6b decode b1")
    (call,) = op_calls("decode_attention", step)
    q, k_cache = call.args()[:2]
    kv_heads, d = k_cache.shape[2], k_cache.shape[3]
    assert call_cost("decode_attention", call.args()).bytes == 2 * q.numel() * BF16 + 2 * 4096 * kv_heads * d * BF16 \
        + 2 * I64


def test_peaks_by_device_name_most_specific_first():
    assert device_peaks("NVIDIA H200").bandwidth == 4.8e12
    assert device_peaks("NVIDIA H100 PCIe").bandwidth == 2.0e12
    assert device_peaks("NVIDIA L40S").name == "L40S"
    assert device_peaks("Tesla T4") is None


def test_gpu_rates_against_the_peaks():
    row = BenchRow("linear", "c", "", "triton", bytes=4_800_000, flops=989_000_000_000, bound="compute",
                   bound_us=1000.0)
    _measure(row, 2000.0, "do_bench", DEVICE_PEAKS[0])  # an H200, 2 ms
    assert row.gbps == pytest.approx(2.4) and row.pct_bw == pytest.approx(0.05)
    assert row.tflops == pytest.approx(494.5) and row.pct_flops == pytest.approx(50)
    assert row.pct_bound == pytest.approx(50)


@pytest.mark.skipif(not INTERPRETED, reason="the interpreter is off here")
def test_quick_bench_times_triton_under_the_interpreter_beside_torch():
    report = bench(["silu_and_mul"], "triton", vs=["ref"], device="cpu", quick=True)
    assert "Triton interpreter" in " ".join(report.notes) and "not GPU timings" in " ".join(report.notes)
    rows = report.rows
    assert [row.impl for row in rows[:2]] == ["triton", "ref"] and len(rows) % 2 == 0
    assert all(row.time_us and row.bound_us > 0 and row.bytes > 0 for row in rows)
    assert {row.timer for row in rows[::2]} == {"interpreter"} and {row.timer for row in rows[1::2]} == {"perf_counter"}
    assert all(row.max_diff is not None and row.max_diff < 1e-5 and row.speedup for row in rows[1::2])
    assert len({row.call for row in rows}) == len(rows) // 2  # identical calls measured once
    assert "| silu_and_mul " in report.markdown()


@pytest.mark.skipif(not INTERPRETED, reason="the interpreter is off here")
def test_real_shapes_on_cpu_run_torch_and_leave_triton_to_quick():
    rows = bench_op("rms_norm_gated", "triton", vs=["ref"], device="cpu")
    assert len(rows) == 6 and rows[0].call.startswith("qwen3.5-0.8b decode b1")
    triton_rows, ref_rows = rows[::2], rows[1::2]
    assert all(row.timer == "not run" and row.time_us is None and "--quick" in row.note for row in triton_rows)
    assert all(row.timer == "perf_counter" and row.time_us for row in ref_rows)
    assert all(row.bound_us > 0 and row.bound == "memory" for row in rows)


def test_unknown_op_or_implementation_names_the_allowed_values(capsys):
    with pytest.raises(ValueError, match="unknown op 'layer_norm'; choose from rms_norm, rope_write_kv"):
        bench_op("layer_norm")
    with pytest.raises(ValueError, match=r"one of \('ref', 'own_order', 'triton'\)"):
        bench_op("rms_norm", "fused")
    with pytest.raises(SystemExit) as exit_info:
        main(["layer_norm"])
    assert exit_info.value.code == 2 and "invalid choice: 'layer_norm'" in capsys.readouterr().err
    assert main(["rms_norm", "--vs", "nope"]) == 2
    assert "implementation of rms_norm must be one of ('ref', 'own_order', 'triton')" in capsys.readouterr().err
    assert main(["rms_norm", "--device", "gpu"]) == 2
    assert "--device must be 'cpu' or 'cuda[:index]', got 'gpu'" in capsys.readouterr().err


@pytest.mark.skipif(not INTERPRETED, reason="the interpreter is off here")
def test_json_report_and_a_variant_given_by_import_path(tmp_path, capsys):
    path = tmp_path / "out" / "bench.json"
    spec = "pocketllm.kernels.rms_norm_gated:rms_norm_gated_ref"
    assert main(["rms_norm_gated", "--quick", "--impl", spec, "--vs", "triton", "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    assert report["device"].startswith("cpu") and report["peaks"]["name"] == "H200" and report["interpreted"]
    assert [row["impl"] for row in report["rows"][:2]] == [spec, "triton"]
    assert all(row["time_us"] > 0 for row in report["rows"])
    assert f"| {spec} " in capsys.readouterr().out


def test_add_parser_wires_the_bench_command():
    parser = argparse.ArgumentParser(prog="pocketllm")
    lab = parser.add_subparsers(dest="command").add_parser("lab").add_subparsers(dest="lab_command")
    add_parser(lab)
    args = parser.parse_args(["lab", "bench", "linear", "sample", "--impl", "ref", "--vs", "triton", "--quick"])
    assert args.func is run and args.ops == ["linear", "sample"] and args.impl == "ref" and args.vs == ["triton"]
    assert args.quick and args.json is None
