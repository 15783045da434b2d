"""pocketllm.lab.compile: capture of launches, Triton's specialisation, resource parsing and limits.

The tests run with the interpreter on, so whatever needs the real compiler runs in a subprocess with
TRITON_INTERPRET=0: one probe script for the capture and the test kernels, and `compile_kernels`
itself for a real op. The full compile (every op, sm_80 and sm_90) takes minutes and runs as
`python -m pocketllm.lab.compile` on its own.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pocketllm.kernels import Ops
from pocketllm.kernels._triton import HAS_TRITON, INTERPRETED
from pocketllm.lab.compile import (
    OPS,
    TARGETS,
    KernelReport,
    Usage,
    add_parser,
    capture,
    check_fit,
    compile_kernels,
    format_table,
    main,
    parse_resource_usage,
    run,
)

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")

DUMP = """
Resource usage:
 Common:
  GLOBAL:11 CONSTANT[4]:8
 Function _helper:
  REG:8 STACK:0 SHARED:0 LOCAL:0 CONSTANT[0]:356 TEXTURE:0 SURFACE:0 SAMPLER:0
 Function _my_kernel:
  REG:168 STACK:24 SHARED:1024 LOCAL:8 CONSTANT[0]:416 TEXTURE:0 SURFACE:0 SAMPLER:0
"""


def test_parse_resource_usage_reads_the_named_function():
    assert parse_resource_usage(DUMP, "_my_kernel") == Usage(regs=168, stack=32, shared=1024)
    assert parse_resource_usage(DUMP, "_helper") == Usage(regs=8, stack=0, shared=0)
    with pytest.raises(ValueError, match="_other"):
        parse_resource_usage(DUMP, "_other")


def test_check_fit_against_the_target_limits():
    sm80, sm90 = TARGETS["sm_80"], TARGETS["sm_90"]
    assert check_fit(Usage(128, 0, 100_000), 4, sm80) == (True, "")
    ok, reason = check_fit(Usage(255, 16, 0), 4, sm80)
    assert not ok and "spills: 16 B" in reason
    assert check_fit(Usage(255, 16, 0), 4, sm80, allow_spills=True) == (True, "spills: 16 B of local memory per "
                                                                               "thread (allowed)")
    # 200 KB of shared memory fits an H100's block, not an A100's.
    assert check_fit(Usage(64, 0, 200_000), 4, sm90)[0]
    ok, reason = check_fit(Usage(64, 0, 200_000), 4, sm80)
    assert not ok and "shared memory 200000 B > 166912 B" in reason
    # 255 registers (allocated as 256) x 256 threads fill the register file; 512 threads do not fit.
    assert check_fit(Usage(255, 0, 0), 8, sm80)[0]
    ok, reason = check_fit(Usage(129, 0, 0), 16, sm80)
    assert not ok and "129 registers x 512 threads > 65536" in reason


def test_table_has_a_row_per_report_and_marks_failures():
    reports = [KernelReport("rms_norm", "_rms_norm_kernel", "qwen3 decode", "sm_80", 24, 0, 16, 4, True, ""),
               KernelReport("sample", "_sample_kernel", "qwen3 decode", "sm_90", None, None, None, 8, False,
                            "compile error: CompilationError: boom")]
    lines = format_table(reports).splitlines()
    assert len(lines) == 4 and lines[0].startswith("| target")
    assert "| ok " in lines[2] and "24" in lines[2]
    assert "FAIL: compile error: CompilationError: boom" in lines[3] and "| -  " in lines[3]


def test_every_op_with_a_triton_kernel_has_launch_configurations():
    assert set(OPS) == {field.name for field in dataclasses.fields(Ops)} - {"embedding"}


def test_unknown_op_or_target_is_refused_naming_the_allowed_values(capsys):
    with pytest.raises(ValueError, match="unknown target 'sm_70'; choose from sm_80, sm_90"):
        compile_kernels(["sm_70"])
    with pytest.raises(SystemExit) as exit_info:
        main(["--target", "sm_80,sm_75", "rms_norm"])
    assert exit_info.value.code == 2 and "unknown target 'sm_75'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["rms_norm", "layer_norm"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "unknown op 'layer_norm'; choose from rms_norm, rope_write_kv" in err


@pytest.mark.skipif(not INTERPRETED, reason="the interpreter is off here")
def test_capture_refuses_interpreted_kernels():
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=0"), capture():
        pass


PROBE = '''
import json

import torch

from pocketllm.kernels import get_ops
from pocketllm.kernels._triton import tl, triton
from pocketllm.lab.compile import TARGETS, Launch, capture, compile_launches, specialize


@triton.jit(do_not_specialize=["m"])
def scale_kernel(x_ptr, out_ptr, n, m, alpha, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n * m
    tl.store(out_ptr + offs, (tl.load(x_ptr + offs, mask=mask) * alpha).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def spill_kernel(x_ptr, out_ptr, ROWS: tl.constexpr, COLS: tl.constexpr):
    """Every element of the tile stays live until the total is known: 512 floats per thread of one warp."""
    offs = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    x = tl.load(x_ptr + offs)
    tl.store(out_ptr + offs, x / tl.sum(tl.sum(x, 1), 0))


@triton.jit
def shared_kernel(a_ptr, b_ptr, c_ptr, K, BLOCK: tl.constexpr):
    """A pipelined dot product: each stage buffers two 32 KB fp16 tiles in shared memory."""
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK, BLOCK], tl.float32)
    for k in range(0, K, BLOCK):
        a = tl.load(a_ptr + offs[:, None] * K + k + offs[None, :])
        b = tl.load(b_ptr + (k + offs[:, None]) * BLOCK + offs[None, :])
        acc += tl.dot(a, b)
    tl.store(c_ptr + offs[:, None] * BLOCK + offs[None, :], acc)


def describe(launch):
    spec = specialize(launch, TARGETS["sm_80"])
    return {"signature": spec.source.signature, "num_warps": spec.options.num_warps, "key": spec.key,
            "constants": {str(k[0]): v for k, v in spec.source.constants.items()},
            "attrs": {str(k[0]): v for k, v in spec.source.attrs.items()}}


x = torch.empty(2048)
out = torch.empty(2049, dtype=torch.bfloat16)[1:]  # 2 bytes off alignment
a, b = torch.empty(128, 1024, dtype=torch.float16), torch.empty(1024, 128, dtype=torch.float16)
with capture() as recorded:
    scale_kernel[(16,)](x, out, 1024, 16, 0.5, BLOCK=128, num_warps=2)
    scale_kernel[(16,)](torch.empty(2048), out, 1024, 16, 0.5, BLOCK=128, num_warps=2)
    scale_kernel[(16,)](x, out, 1, 16, 0.5, BLOCK=128, num_warps=2)
    spill_kernel[(1,)](x, x, ROWS=256, COLS=64, num_warps=1)
    shared_kernel[(1,)](a, b, torch.empty(128, 128), 1024, BLOCK=128, num_warps=8, num_stages=6)
launches = [Launch("test", f"launch {i}", *launch) for i, launch in enumerate(recorded)]

ops = get_ops("triton")
with capture() as linear_launches:
    ops.linear(torch.empty(3, 64), torch.empty(32, 64))
try:
    ops.linear(torch.empty(3, 64), torch.empty(32, 64))
    refused = ""
except RuntimeError as exc:
    refused = str(exc)

print(json.dumps({
    "scale": describe(launches[0]), "scale_again": describe(launches[1]), "scale_n1": describe(launches[2]),
    "reports": [vars(r) for r in compile_launches(launches, TARGETS["sm_80"])],
    "linear_kwargs": {k: v for k, v in linear_launches[0][2].items() if k.startswith(("BLOCK", "HOST"))},
    "refused_outside_capture": refused,
}))
'''


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The probe script's findings, run once with the compiler (TRITON_INTERPRET=0)."""
    tmp = tmp_path_factory.mktemp("lab_probe")
    script = tmp / "probe.py"
    script.write_text(PROBE)
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1", "TRITON_CACHE_DIR": str(tmp),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.slow
@needs_triton
def test_signature_and_constexprs_follow_tritons_specialisation(probe):
    scale = probe["scale"]
    assert scale["signature"] == {"x_ptr": "*fp32", "out_ptr": "*bf16", "n": "i32", "m": "i32", "alpha": "fp32",
                                  "BLOCK": "constexpr"}
    assert scale["constants"] == {"5": 128} and scale["num_warps"] == 2
    # Divisible by 16: the aligned pointer and n; not the misaligned pointer, nor m (do_not_specialize).
    divisible = {arg for arg, attrs in scale["attrs"].items() if ["tt.divisibility", 16] in attrs}
    assert divisible == {"0", "2"}
    # Another tensor of the same dtype and alignment is the same specialisation; n == 1 is a constant.
    assert probe["scale_again"]["key"] == scale["key"]
    assert probe["scale_n1"]["signature"]["n"] == "constexpr" and probe["scale_n1"]["constants"]["2"] == 1


@pytest.mark.slow
@needs_triton
def test_distinct_specialisations_compile_once_each(probe):
    reports = probe["reports"]
    assert [r["kernel"] for r in reports] == ["scale_kernel", "scale_kernel", "spill_kernel", "shared_kernel"]
    assert reports[0]["shape"] == "launch 0 (+1)" and reports[0]["ok"] and reports[0]["reason"] == ""
    assert reports[1]["shape"] == "launch 2"


@pytest.mark.slow
@needs_triton
def test_spilling_kernel_fails_with_the_reason(probe):
    spill = probe["reports"][2]
    assert not spill["ok"] and spill["stack"] > 0
    assert spill["reason"].startswith("spills: ")


@pytest.mark.slow
@needs_triton
def test_oversized_shared_memory_fails_with_the_reason(probe):
    shared = probe["reports"][3]
    assert not shared["ok"] and shared["shared"] > TARGETS["sm_80"].max_shared and shared["stack"] == 0
    assert f"> {TARGETS['sm_80'].max_shared} B" in shared["reason"]


@pytest.mark.slow
@needs_triton
def test_recorded_launchers_take_the_cuda_path(probe):
    assert probe["linear_kwargs"] == {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "HOST_DOT": False}
    assert "interpreter is off" in probe["refused_outside_capture"]


@pytest.mark.slow
@needs_triton
def test_real_op_compiles_for_sm_80_end_to_end(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    reports = compile_kernels(["sm_80"], ["rms_norm_gated"])
    assert reports and {r.kernel for r in reports} == {"_rms_norm_gated_kernel"}
    assert all(r.ok and r.target == "sm_80" and r.regs and r.stack == 0 for r in reports), reports
    assert reports[0].shape.startswith("qwen3.5-0.8b decode b1")


def test_add_parser_wires_the_compile_command():
    parser = argparse.ArgumentParser(prog="pocketllm")
    lab = parser.add_subparsers(dest="command").add_parser("lab").add_subparsers(dest="lab_command")
    add_parser(lab)
    args = parser.parse_args(["lab", "compile", "--target", "sm_80", "--allow-spills", "rms_norm", "sample"])
    assert args.func is run and args.target == ["sm_80"] and args.ops == ["rms_norm", "sample"] and args.allow_spills


@pytest.mark.parametrize("regs, shared, warps, target, blocks", [
    (255, 0, 4, "sm_80", 2),        # 256 registers x 128 threads: two blocks fill the 65,536-register file
    (32, 98304, 8, "sm_80", 1),     # 96 KB (+1 KB reserved) of the SM's 164 KB: one block
    (32, 98304, 8, "sm_90", 2),     # of sm_90's 228 KB: two
    (24, 16, 4, "sm_80", 16),       # limited by the 64 warp slots: 16 blocks of 4 warps
    (16, 0, 1, "sm_90", 32),        # limited by 32 blocks per SM
])
def test_occupancy_follows_the_tightest_limit(regs, shared, warps, target, blocks):
    from pocketllm.lab.compile import TARGETS, occupancy

    assert occupancy(regs, shared, warps, TARGETS[target]) == (blocks, blocks * warps / 64)
