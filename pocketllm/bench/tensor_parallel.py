"""Tensor parallelism benchmark (`pocketllm bench --tensor-parallel`): tokens/s at one process and at
two ranks, what the fixed reduction tree costs, and the bytes a rank moves per decode step.

Engines on one random-weight checkpoint, each running the same batched workload (requests of
`prompt` tokens generating `new` tokens each, all submitted at once): one process with one product
per row-parallel matrix (no tree) and with the tree, TP=2 with the tree and with a plain all-reduce;
on a mixture-of-experts preset also EP=2 (whole experts per rank) with and without the tree. Every
engine runs the fixed-order kernels (`exact_positions`), which the guarantee across sizes rests on;
the report says whether each configuration's outputs equal one process with the tree bit for bit,
and what rank 0 put into collectives in one decode step of the whole batch (a run of 3 tokens per
request less a run of 2). On a CPU the ranks share its cores (each rank gets cores / size threads),
so TP=2 is not expected to be faster there; on a machine with several GPUs pass `--device cuda`.
Default presets: the MoE small ones; `--quick`: the tiny MoE preset, a smoke test whose timings mean
little. Writes tensor_parallel.json and tensor_parallel.md.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..config import DTypeName, EngineArgs
from ..llm import LLM
from ..models import cached_checkpoint
from ..models.registry import read_config
from ..sampling import SamplingParams
from .report import load_average, machine_info, save_report

# (name, size, tree, expert parallel)
CONFIGS = (("TP=1, no tree", 1, False, False), ("TP=1, tree", 1, True, False), ("TP=2, tree", 2, True, False),
           ("TP=2, plain all-reduce", 2, False, False))
EXPERT_CONFIGS = (("EP=2, tree", 2, True, True), ("EP=2, plain all-reduce", 2, False, True))


@dataclass(frozen=True)
class Workload:
    requests: int
    prompt: int
    new: int
    sizes: tuple[int, ...] = (1, 2)
    device: str = "cpu"
    dtype: DTypeName = "float32"  # the rows' (EngineArgs.dtype): under bf16 or fp16 the tree rounds to it


PRESETS = {"quick": ("qwen3-moe-tiny",), "full": ("qwen3-moe-small", "qwen3.5-moe-small")}
WORKLOADS = {"quick": Workload(2, 8, 4), "full": Workload(8, 64, 32)}


def _sent(llm: LLM, prompts: list[list[int]], tokens: int) -> int:
    """Bytes rank 0 put into collectives during one batched greedy generate of `tokens` per request
    (greedy: a sampled token would move the experts' routes, so the bytes, from run to run)."""
    sent = llm.model.tp.sent_bytes  # type: ignore[attr-defined]  # pocketllm's decoder models have one
    llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
    return llm.model.tp.sent_bytes - sent  # type: ignore[attr-defined]


def run_config(path: str, size: int, tree: bool, expert_parallel: bool, workload: Workload,
               prompts: list[list[int]], cores: int) -> dict[str, Any]:
    """One configuration's tokens/s, bytes per decode step and outputs."""
    device = workload.device
    torch.set_num_threads(max(1, cores // size if device == "cpu" else cores))  # the workers take this count
    started = time.perf_counter()
    llm = LLM(EngineArgs(model=path, device=device, dtype=workload.dtype,
                         max_seq_len=workload.prompt + workload.new + 8, tensor_parallel_size=size,
                         enable_expert_parallel=expert_parallel,
                         backend_options={"enable_batching": True, "max_batch_size": len(prompts),
                                          "exact_positions": True, "tree_reduction": tree}))
    load_s = time.perf_counter() - started
    params = SamplingParams(max_tokens=workload.new, temperature=0.8, seed=1, ignore_eos=True)
    try:
        llm.generate(prompts[:1], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
        started = time.perf_counter()
        results = llm.generate(prompts, params)
        elapsed = time.perf_counter() - started
        decode_bytes = _sent(llm, prompts, 3) - _sent(llm, prompts, 2)  # the prompts' reuse is the same in both
    finally:
        llm.close()
    tokens = sum(len(r.token_ids) for r in results)
    return {"tensor_parallel_size": size, "tree": tree, "expert_parallel": expert_parallel,
            "threads_per_rank": torch.get_num_threads(), "load_s": load_s, "seconds": elapsed, "tokens": tokens,
            "tokens_per_s": tokens / elapsed, "bytes_per_decode_step": decode_bytes,
            "outputs": [(r.token_ids, r.logprobs) for r in results]}


def measure_preset(preset: str, workload: Workload) -> dict[str, Any]:
    """Every configuration of `workload.sizes` on `preset` (the EP ones on a mixture of experts)."""
    path = str(cached_checkpoint(preset))
    cores = os.cpu_count() or 1
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 200, (workload.prompt,), generator=generator).tolist()
               for _ in range(workload.requests)]
    experts = EXPERT_CONFIGS if read_config(path).num_experts else ()
    configs: dict[str, Any] = {}
    for name, size, tree, expert_parallel in (c for c in CONFIGS + experts if c[1] in workload.sizes):
        print(f"{preset}, {name}: running", flush=True)
        row = run_config(path, size, tree, expert_parallel, workload, prompts, cores)
        configs[name] = row
        print(f"{preset}, {name}: {row['tokens_per_s']:.1f} tokens/s ({row['threads_per_rank']} threads per rank, "
              f"loaded in {row['load_s']:.1f} s)", flush=True)
    reference = configs["TP=1, tree"]["outputs"] if "TP=1, tree" in configs else None  # sizes without 1
    for row in configs.values():
        outputs = row.pop("outputs")
        row["same_as_tree"] = None if reference is None else outputs == reference
    return {"preset": preset, "configs": configs}


def markdown(report: dict[str, Any]) -> str:
    machine, workload = report["machine"], report["workload"]
    lines = [f"# Tensor parallelism: {workload['requests']} requests x ({workload['prompt']} in, "
             f"{workload['new']} out), {workload['device']}, {workload.get('dtype', 'float32')}", "",
             f"Machine: {machine.get('processor', '?')}, {machine.get('cpu_count', '?')} cores; load average at "
             f"the end {machine.get('load_average_1min_at_end')}", "",
             "| preset | configuration | threads/rank | tokens/s | vs TP=1 no tree | bitwise = TP=1 tree | "
             "KiB sent per decode step (rank 0) |", "|---|---|---|---|---|---|---|"]
    for model in report["models"]:
        base = model["configs"].get("TP=1, no tree", {}).get("tokens_per_s")
        for name, row in model["configs"].items():
            same = {None: "not run", True: "yes", False: "no"}[row["same_as_tree"]]
            ratio = f"{row['tokens_per_s'] / base:.2f}x" if base else "not run"
            lines.append(f"| {model['preset']} | {name} | {row['threads_per_rank']} | {row['tokens_per_s']:.1f} | "
                         f"{ratio} | {same} | {row['bytes_per_decode_step'] / 1024:.1f} |")
    return "\n".join(lines) + "\n"


def run(out: Path, quick: bool, presets: tuple[str, ...] | None = None, workload: Workload | None = None) -> str:
    """Measure each preset (the size's, or `presets`) and write the report; returns its table."""
    workload = workload or WORKLOADS["quick" if quick else "full"]
    models = [measure_preset(preset, workload) for preset in (presets or PRESETS["quick" if quick else "full"])]
    machine = machine_info()
    machine["load_average_1min_at_end"] = load_average()
    report = {"machine": machine, "workload": vars(workload) | {"sizes": list(workload.sizes)}, "models": models}
    text = markdown(report)
    save_report(out, "tensor_parallel", report, text)
    return text
