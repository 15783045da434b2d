"""End-to-end benchmark of the engine on a device: the numbers a user of it sees, where the kernel
benchmark (bench/kernel_rooflines.py) times each op alone.

Per preset (random weights in the real checkpoints' shapes, `pocketllm.models.cached_checkpoint`),
on one backend, dtype and device:

- prefill: TTFT of one 512-token prompt, as prompt tokens/s (serial path);
- batch-1 decode: TPOT over 64 greedy tokens of one 32-token prompt (serial path), and 1 / TPOT;
- batched decode: 8 such requests at once through the batch scheduler (max_batch_size 8), generated
  tokens / wall time.

Each measurement runs once untimed first (Triton compiles each specialisation on first use), and
on CUDA the device is synchronised around every timed call. `--smoke` runs the tiny preset with a
few tokens on the torch backend on CPU: a CI check of the code paths; its timings mean nothing.
Writes e2e.json and e2e.md to --out (default: $OUT, else bench/results/), after each preset.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pocketllm.bench.report import machine_info
from pocketllm.bench.workloads import Workload, summarize
from pocketllm.config import BACKENDS, DTYPES, Backend, DTypeName, EngineArgs
from pocketllm.llm import LLM
from pocketllm.models import cached_checkpoint
from pocketllm.outputs import GenerationResult
from pocketllm.sampling import SamplingParams

BATCH = 8
PROMPT = 32  # decode prompt


@dataclass(frozen=True)
class Size:
    """How many tokens each measurement uses."""

    prefill_tokens: int
    decode_tokens: int


SIZES = {"full": Size(512, 64), "smoke": Size(32, 4)}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def _timed(llm: LLM, device: str, prompts: list[list[int]],
           params: list[SamplingParams]) -> tuple[list[GenerationResult], float]:
    """(results, wall seconds) of the second of two identical runs: the first compiles and warms up."""
    llm.generate(prompts, params)
    _sync(device)
    start = time.perf_counter()
    results = llm.generate(prompts, params)
    _sync(device)
    wall = time.perf_counter() - start
    assert isinstance(results, list)
    for result in results:
        if result.finish_reason != "length" or result.ttft_s is None or result.total_time_s is None:
            raise RuntimeError(f"request {result.request_id} ended {result.finish_reason!r} ({result.error})")
    return results, wall


def measure(preset: str, backend: Backend, dtype: DTypeName, device: str, size: Size,
            seed: int = 0) -> dict[str, Any]:
    """Prefill, batch-1 decode and batched decode of one preset."""
    path = cached_checkpoint(preset, seed)

    def engine(**options: Any) -> LLM:
        return LLM(EngineArgs(model=str(path), backend=backend, dtype=dtype, device=device,
                              max_seq_len=size.prefill_tokens + PROMPT + size.decode_tokens, backend_options=options))

    greedy = SamplingParams(max_tokens=size.decode_tokens, temperature=0.0, ignore_eos=True)
    rng = np.random.default_rng(seed)
    with engine(enable_batching=False) as llm:
        vocab = llm.model_config.vocab_size
        prefill_prompt = rng.integers(0, vocab, size.prefill_tokens).tolist()
        decode_prompts = [rng.integers(0, vocab, PROMPT).tolist() for _ in range(BATCH)]
        (prefilled,), _ = _timed(llm, device, [prefill_prompt],
                                 [SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)])
        (decoded,), _ = _timed(llm, device, decode_prompts[:1], [greedy])
    workload = Workload("decode_8", decode_prompts, [size.decode_tokens] * BATCH)
    with engine(enable_batching=True, max_batch_size=BATCH) as llm:
        results, wall = _timed(llm, device, workload.prompts, workload.params())
    batched = summarize(workload, "pocketllm", "batched", BATCH, wall,
                        [(r.ttft_s or 0.0, r.total_time_s or 0.0, len(r.token_ids)) for r in results])
    assert prefilled.ttft_s is not None and decoded.ttft_s is not None and decoded.total_time_s is not None
    tpot = (decoded.total_time_s - decoded.ttft_s) / (size.decode_tokens - 1)
    return {"preset": preset, "prefill_tokens": size.prefill_tokens, "prefill_ttft_s": prefilled.ttft_s,
            "prefill_tokens_per_s": size.prefill_tokens / prefilled.ttft_s, "decode_tokens": size.decode_tokens,
            "decode_1_ttft_s": decoded.ttft_s, "decode_1_tpot_s": tpot, "decode_1_tokens_per_s": 1 / tpot,
            "batched_requests": BATCH, "batched_wall_s": batched.wall_s,
            "batched_tokens_per_s": batched.tokens_per_s, "batched_tpot_mean_s": batched.tpot_mean_s}


def markdown(report: dict[str, Any]) -> str:
    """One row per preset."""
    lines = [f"# End-to-end: {report['backend']} backend, {report['dtype']}, {report['device_name']}", "",
             "| preset | prefill tok/s (TTFT ms) | batch-1 decode tok/s (TPOT ms) | batched 8 tok/s |",
             "|---|---|---|---|"]
    for m in report["models"]:
        lines.append(f"| {m['preset']} | {m['prefill_tokens_per_s']:.0f} ({1e3 * m['prefill_ttft_s']:.1f}) | "
                     f"{m['decode_1_tokens_per_s']:.1f} ({1e3 * m['decode_1_tpot_s']:.2f}) | "
                     f"{m['batched_tokens_per_s']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", nargs="+", default=["qwen3-0.6b", "qwen3.5-0.8b"])
    parser.add_argument("--backend", choices=BACKENDS, default="triton")
    parser.add_argument("--dtype", choices=list(DTYPES), default="bfloat16" if cuda else "float32")
    parser.add_argument("--device", default="cuda" if cuda else "cpu")
    parser.add_argument("--smoke", action="store_true", help="tiny preset, few tokens, torch backend on CPU")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or Path(__file__).parent / "results"))
    args = parser.parse_args(argv)
    if args.smoke:
        args.preset, args.backend, args.dtype, args.device = ["tiny"], "torch", "float32", "cpu"
    size = SIZES["smoke" if args.smoke else "full"]
    device_name = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu"
    report: dict[str, Any] = {"machine": machine_info(), "device_name": device_name, "backend": args.backend,
                              "dtype": args.dtype, "device": args.device, "size": asdict(size), "models": []}
    args.out.mkdir(parents=True, exist_ok=True)
    for preset in args.preset:
        report["models"].append(measure(preset, args.backend, args.dtype, args.device, size))
        (args.out / "e2e.json").write_text(json.dumps(report, indent=2) + "\n")
        (args.out / "e2e.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
