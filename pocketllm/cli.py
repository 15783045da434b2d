"""`pocketllm` command line: demo, generate, make-checkpoint."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from .config import DTYPES, EngineArgs
from .llm import LLM
from .models import PRESETS, write_checkpoint
from .sampling import SamplingParams


def default_cache_dir() -> Path:
    return Path(os.environ.get("POCKETLLM_CACHE", Path.home() / ".cache" / "pocketllm"))


def embedded_checkpoint(preset: str = "tiny", seed: int = 0) -> Path:
    """The demo's checkpoint: written once into the cache directory, reused afterwards."""
    path = default_cache_dir() / f"{preset}-seed{seed}"
    if not (path / "config.json").is_file():
        write_checkpoint(path, preset, seed=seed)
    return path


def _token_list(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-tokens must be comma-separated ints, got {text!r}") from None


def cmd_demo(args: argparse.Namespace) -> int:
    path = embedded_checkpoint(args.preset)
    print(f"checkpoint: {path} (random weights, preset {args.preset!r})")
    llm = LLM(EngineArgs(model=str(path), max_seq_len=256, backend_options={"max_batch_size": 4}))
    prompts = [[1, 2, 3], [10, 20, 30, 40, 50], [7], [100, 101, 102, 103, 104, 105, 106]]
    params = [SamplingParams(max_tokens=12, temperature=0.0), SamplingParams(max_tokens=12, temperature=0.8, seed=1),
              SamplingParams(max_tokens=12, temperature=1.0, top_k=20, seed=2),
              SamplingParams(max_tokens=12, temperature=0.7, top_p=0.9, seed=3)]
    start = time.perf_counter()
    results = llm.generate(prompt_tokens=prompts, sampling_params=params)
    elapsed = time.perf_counter() - start
    print(f"{'id':>3} {'prompt':>7} {'gen':>4} {'finish':>7} {'ttft ms':>8}  tokens")
    for r in results:
        print(f"{r.request_id:>3} {len(r.prompt_tokens):>7} {len(r.token_ids):>4} {r.finish_reason:>7} "
              f"{1000 * r.ttft_s:>8.1f}  {r.token_ids}")
    generated = sum(len(r.token_ids) for r in results)
    print(f"{generated} tokens in {elapsed:.2f} s ({generated / elapsed:.1f} tokens/s, backend torch, cpu)")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    llm = LLM(EngineArgs(model=args.model, dtype=args.dtype, device=args.device, max_seq_len=args.max_seq_len))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed)
    result = llm.generate(prompt_tokens=args.prompt_tokens, sampling_params=params)
    print(",".join(str(t) for t in result.token_ids))
    print(f"finish_reason={result.finish_reason} seed={result.seed} ttft={1000 * result.ttft_s:.1f}ms "
          f"total={1000 * result.total_time_s:.1f}ms", file=sys.stderr)
    return 0 if result.finish_reason in ("stop", "length") else 1


def cmd_make_checkpoint(args: argparse.Namespace) -> int:
    path = write_checkpoint(args.directory, args.preset, seed=args.seed, multimodal=args.multimodal)
    layout = " in the multimodal layout" if args.multimodal else ""
    print(f"wrote {args.preset!r} checkpoint (seed {args.seed}){layout} to {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pocketllm", description="A small inference engine for Qwen-family models.")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="generate from an embedded random-weight checkpoint")
    demo.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    demo.set_defaults(func=cmd_demo)

    gen = sub.add_parser("generate", help="generate token ids from a checkpoint directory")
    gen.add_argument("--model", required=True, help="Hugging Face model directory (config.json + safetensors)")
    gen.add_argument("--prompt-tokens", required=True, type=_token_list, help="comma-separated token ids, e.g. 1,2,3")
    gen.add_argument("--max-tokens", type=int, default=16)
    gen.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=0, help="0 = no top-k filter")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    gen.add_argument("--device", default="cpu")
    gen.add_argument("--max-seq-len", type=int, default=4096)
    gen.set_defaults(func=cmd_generate)

    make = sub.add_parser("make-checkpoint", help="write a random-weight checkpoint in Hugging Face format")
    make.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--multimodal", action="store_true",
                      help="Qwen3.5 presets: write the Qwen3_5ForConditionalGeneration layout")
    make.add_argument("directory", help="output directory")
    make.set_defaults(func=cmd_make_checkpoint)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError, FileNotFoundError) as exc:  # CheckpointError is a ValueError
        print(f"pocketllm {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
