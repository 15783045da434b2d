"""Tensor parallelism: tokens/s at TP=1 and TP=2, what the fixed reduction tree costs, and the bytes
a rank moves per decode step.

Four engines on one random-weight checkpoint, each running the same batched workload (requests of
`--prompt` tokens generating `--new` tokens each, all submitted at once): TP=1 with one product per
row-parallel matrix (no tree), TP=1 with the tree, TP=2 with the tree, TP=2 with a plain all-reduce;
on a mixture-of-experts preset also EP=2 (whole experts per rank) with and without the tree.
Every engine runs the fixed-order kernels (`exact_positions`), which the guarantee across sizes
rests on; the report says whether each configuration's outputs equal TP=1-with-tree's bit for bit,
and what rank 0 put into collectives per decode step of the whole batch (a run of 3 tokens per
request less a run of 2: one decode step). On a CPU the ranks share its cores (each rank gets
cores / size threads), so TP=2 is not expected to be faster here; on a machine with several GPUs
pass `--device cuda`.

    python bench/tensor_parallel.py [--preset small] [--requests 8] [--prompt 64] [--new 32] [--sizes 1 2]
                                    [--out bench/results]
Writes tensor_parallel.json and tensor_parallel.md; prints each configuration as it finishes.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import torch

from pocketllm import LLM, EngineArgs, SamplingParams
from pocketllm.bench.report import load_average, machine_info, save_report
from pocketllm.models import read_config
from pocketllm.models.presets import cached_checkpoint

# (name, size, tree, expert parallel)
CONFIGS = (("TP=1, no tree", 1, False, False), ("TP=1, tree", 1, True, False), ("TP=2, tree", 2, True, False),
           ("TP=2, plain all-reduce", 2, False, False))
EXPERT_CONFIGS = (("EP=2, tree", 2, True, True), ("EP=2, plain all-reduce", 2, False, True))


def _sent(llm: LLM, prompts: list[list[int]], tokens: int) -> int:
    """Bytes rank 0 put into collectives during one batched generate of `tokens` per request."""
    sent = llm.model.tp.sent_bytes
    llm.generate(prompts, SamplingParams(max_tokens=tokens, ignore_eos=True))
    return llm.model.tp.sent_bytes - sent


def run_config(path: str, size: int, tree: bool, expert_parallel: bool, device: str, prompts: list[list[int]],
               new: int, cores: int) -> dict[str, Any]:
    torch.set_num_threads(max(1, cores // size if device == "cpu" else cores))  # the workers take this count
    started = time.perf_counter()
    llm = LLM(EngineArgs(model=path, device=device, max_seq_len=len(prompts[0]) + new + 8, tensor_parallel_size=size,
                         enable_expert_parallel=expert_parallel,
                         backend_options={"enable_batching": True, "max_batch_size": len(prompts),
                                          "exact_positions": True, "tree_reduction": tree}))
    load_s = time.perf_counter() - started
    params = SamplingParams(max_tokens=new, temperature=0.8, seed=1, ignore_eos=True)
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


def markdown(report: dict[str, Any]) -> str:
    machine = report["machine"]
    lines = [f"# Tensor parallelism: {report['preset']}, {report['requests']} requests x "
             f"({report['prompt']} in, {report['new']} out), {report['device']}",
             "", f"Machine: {machine.get('processor', '?')}, {machine.get('cpu_count', '?')} cores; "
             f"load average at the end {report['load_average_1min_at_end']}", "",
             "| configuration | threads/rank | tokens/s | vs TP=1 no tree | bitwise = TP=1 tree | "
             "KiB sent per decode step (rank 0) |", "|---|---|---|---|---|---|"]
    base = report["configs"].get("TP=1, no tree", {}).get("tokens_per_s")
    for name, row in report["configs"].items():
        same = {None: "not run", True: "yes", False: "no"}[row["same_as_tree"]]
        ratio = f"{row['tokens_per_s'] / base:.2f}x" if base else "not run"
        lines.append(f"| {name} | {row['threads_per_rank']} | {row['tokens_per_s']:.1f} | {ratio} | {same} | "
                     f"{row['bytes_per_decode_step'] / 1024:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2], help="the tensor-parallel sizes to run")
    args = parser.parse_args()
    path = str(cached_checkpoint(args.preset))
    cores = os.cpu_count() or 1
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 200, (args.prompt,), generator=generator).tolist() for _ in range(args.requests)]
    configs: dict[str, Any] = {}
    experts = EXPERT_CONFIGS if read_config(path).num_experts else ()
    for name, size, tree, expert_parallel in (c for c in CONFIGS + experts if c[1] in args.sizes):
        print(f"{name}: running", flush=True)
        row = run_config(path, size, tree, expert_parallel, args.device, prompts, args.new, cores)
        configs[name] = row
        print(f"{name}: {row['tokens_per_s']:.1f} tokens/s ({row['threads_per_rank']} threads per rank, "
              f"loaded in {row['load_s']:.1f} s)", flush=True)
    reference = configs["TP=1, tree"]["outputs"] if "TP=1, tree" in configs else None  # --sizes without 1
    for row in configs.values():
        outputs = row.pop("outputs")
        row["same_as_tree"] = None if reference is None else outputs == reference
    report = {"machine": machine_info(), "preset": args.preset, "requests": args.requests, "prompt": args.prompt,
              "new": args.new, "device": args.device, "configs": configs,
              "load_average_1min_at_end": load_average()}
    text = markdown(report)
    save_report(args.out, "tensor_parallel", report, text)
    print(text)


if __name__ == "__main__":
    main()
