"""`pocketllm` command line: demo, generate, make-checkpoint, bench, lab, serve."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, cast

from .command_line import OneLineParser, one_line, run_command
from .config import DTYPES, EngineArgs
from .llm import LLM
from .models import PRESETS, cached_checkpoint, write_checkpoint
from .outputs import GenerationResult
from .sampling import SamplingParams


def _token_list(text: str) -> list[int]:
    items = text.split(",")
    try:
        if any(not item.strip() for item in items):
            raise ValueError("empty item")
        return [int(item) for item in items]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-tokens must be comma-separated ints with no empty item, "
                                         f"got {text!r}") from None


DEMO_PROMPTS = ["The quick brown fox", "Once upon a time", "pocketllm", "1, 2, 3,", "Hello, world!",
                "A slot is a block table with one block", "Bitwise the same", "Qwen"]


def _demo_params(count: int) -> list[SamplingParams]:
    """A mix of greedy and seeded sampling, so the equality check covers the sampler too."""
    mix: list[dict[str, Any]] = [dict(temperature=0.0), dict(temperature=0.8, seed=1),
                                 dict(temperature=1.0, top_k=20, seed=2), dict(temperature=0.7, top_p=0.9, seed=3)]
    return [SamplingParams(max_tokens=16, ignore_eos=True, **mix[i % len(mix)]) for i in range(count)]


def _demo_encode(llm: LLM, text: str) -> list[int]:
    """The checkpoint's tokenizer when the `tokenizers` package is installed; otherwise the UTF-8
    bytes, which is what the presets' byte-level tokenizer would give."""
    if llm.tokenizer is not None:
        return llm.tokenizer.encode(text, add_special_tokens=False).ids
    return list(text.encode("utf-8"))


def _demo_text(result: GenerationResult) -> str:
    if result.text is not None:
        return result.text
    return bytes(t for t in result.token_ids if t < 256).decode("utf-8", errors="replace")


def cmd_demo(args: argparse.Namespace) -> int:
    """Serial run, then the same requests through the batch scheduler: a table, and the check
    that every request's tokens and logprobs are bitwise the same in both."""
    from tqdm import tqdm

    path = cached_checkpoint(args.preset)
    print(f"checkpoint: {path} (random weights, preset {args.preset!r}: expect gibberish text)")
    params = _demo_params(len(DEMO_PROMPTS))
    common: dict[str, Any] = dict(model=str(path), max_seq_len=256)
    size = args.tensor_parallel_size
    # Sharded, the batched engine is also checked against a single process: on the fixed-order kernels,
    # whose columns do not depend on how many columns a rank's product holds (the default where they build).
    options: dict[str, Any] = {"exact_positions": True, "tree_reduction": True} if size > 1 else {}
    if size > 1:
        print(f"batched engine: tensor_parallel_size={size}; serial engine: one process")
    serial_llm = LLM(EngineArgs(**common, backend_options=options))
    if serial_llm.invariance_report is not None:
        print(f"start-up probe: {serial_llm.invariance_report.summary()}")
    prompts = [_demo_encode(serial_llm, text) for text in DEMO_PROMPTS]
    start = time.perf_counter()
    serial = [serial_llm.generate(prompt_tokens=p, sampling_params=sp)
              for p, sp in tqdm(list(zip(prompts, params)), desc="serial", unit="req")]
    serial_s = time.perf_counter() - start
    with LLM(EngineArgs(**common, tensor_parallel_size=size,
                        backend_options={**options, "enable_batching": True, "max_batch_size": 4})) as llm:
        scheduler = llm.scheduler
        assert scheduler is not None  # enable_batching
        bar = tqdm(total=len(DEMO_PROMPTS), desc="batched", unit="req")
        start = time.perf_counter()
        ids = [scheduler.submit_request(p, sp, callback=lambda result: bar.update())
               for p, sp in zip(prompts, params)]
        batched = [scheduler.poll_result(i, timeout_ms=None) for i in ids]
        batched_s = time.perf_counter() - start
        bar.close()
        stats = scheduler.get_stats()
    same = [s.token_ids == b.token_ids and s.logprobs == b.logprobs for s, b in zip(serial, batched)]
    print(f"\n{'prompt':<40} {'sampling':<22} {'ttft ms':>8} {'same':>5}  continuation")
    for prompt, sp, s, b, ok in zip(DEMO_PROMPTS, params, serial, batched, same):
        sampling = "greedy" if sp.greedy else f"T={sp.temperature} k={sp.top_k} p={sp.top_p}"
        ttft_ms = 1000 * cast(float, b.ttft_s)  # None only for a request that failed before its first token
        print(f"{prompt:<40} {sampling:<22} {ttft_ms:>8.1f} {'yes' if ok else 'NO':>5}  {_demo_text(s)!r:.60}")
    tokens = sum(len(r.token_ids) for r in serial)
    print(f"\nserial : {tokens} tokens in {serial_s:.2f} s = {tokens / serial_s:.1f} tokens/s")
    print(f"batched: {tokens} tokens in {batched_s:.2f} s = {tokens / batched_s:.1f} tokens/s "
          f"(4 slots; TTFT p50 {1000 * stats.ttft_p50_s:.1f} ms, p99 {1000 * stats.ttft_p99_s:.1f} ms)")
    print(f"batched == serial, bitwise (tokens and logprobs): {sum(same)}/{len(same)} requests")
    return 0 if all(same) else 1


def cmd_generate(args: argparse.Namespace) -> int:
    """stdout gets the output in the prompt's form (text for --prompt, token ids for --prompt-tokens);
    stderr gets the other form, where there is one, and the timings."""
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed)
    options = {"enable_batching": True, "background_thread": False} if args.stream else None
    llm = LLM(EngineArgs(model=args.model, dtype=args.dtype, device=args.device, max_seq_len=args.max_seq_len,
                         backend_options=options, tensor_parallel_size=args.tensor_parallel_size,
                         pipeline_parallel_size=args.pipeline_parallel_size,
                         enable_expert_parallel=args.enable_expert_parallel))
    with llm:
        if args.stream:
            result = _print_stream(llm, args, params)
        elif args.prompt is not None:
            result = llm.generate(prompts=args.prompt, sampling_params=params)
        else:
            result = llm.generate(prompt_tokens=args.prompt_tokens, sampling_params=params)
    token_ids = ",".join(str(t) for t in result.token_ids)
    if args.prompt is not None:
        if not args.stream:
            print(result.text)
        print(f"token_ids={token_ids}", file=sys.stderr)
    else:
        if not args.stream:
            print(token_ids)
        if result.text is not None:
            print(f"text={result.text!r}", file=sys.stderr)
    ttft = "-" if result.ttft_s is None else f"{1000 * result.ttft_s:.1f}ms"
    print(f"finish_reason={result.finish_reason} seed={result.seed} ttft={ttft} "
          f"total={1000 * (result.total_time_s or 0.0):.1f}ms cache={llm.capabilities.cache_bytes / 2**20:.1f}MiB",
          file=sys.stderr)
    if result.error is not None:
        print(f"pocketllm generate: error: {one_line(result.error)}", file=sys.stderr)
    return 0 if result.finish_reason in ("stop", "length") else 1


def _print_stream(llm: LLM, args: argparse.Namespace, params: SamplingParams) -> GenerationResult:
    """Print each token as it is sampled (its text for --prompt, its id otherwise); the result."""
    for item in llm.stream(args.prompt_tokens, params, prompt=args.prompt):
        if isinstance(item, GenerationResult):
            print(flush=True)
            return item
        piece = item.text if args.prompt is not None else f"{',' if item.index else ''}{item.token_id}"
        print(piece, end="", flush=True)
    raise AssertionError("a stream always ends with its result")


def cmd_make_checkpoint(args: argparse.Namespace) -> int:
    """Refuses a non-empty directory unless --force; with it, the earlier checkpoint's files go."""
    target = Path(args.directory)
    if target.exists() and not target.is_dir():
        raise ValueError(f"{target} exists and is not a directory")
    if target.is_dir() and any(target.iterdir()) and not args.force:
        raise ValueError(f"{target} is not empty; pass --force to replace the checkpoint files in it")
    path = write_checkpoint(args.directory, args.preset, seed=args.seed, multimodal=args.multimodal, mtp=args.mtp)
    layout = (" in the multimodal layout" if args.multimodal else "") + (" with its MTP layer" if args.mtp else "")
    print(f"wrote {args.preset!r} checkpoint (seed {args.seed}){layout} to {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="pocketllm", description="A small inference engine for Qwen-family models.")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="serial and batched generation on an embedded random checkpoint, "
                                       "with the batched == serial check")
    demo.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    demo.add_argument("--tensor-parallel-size", type=int, default=1,
                      help="shard the batched engine over this many processes (checked against one)")
    demo.set_defaults(func=cmd_demo)

    gen = sub.add_parser("generate", help="generate text or token ids from a checkpoint directory")
    gen.add_argument("--model", required=True, help="Hugging Face model directory (config.json + safetensors)")
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text (needs tokenizer.json in the model directory); prints text")
    prompt.add_argument("--prompt-tokens", type=_token_list, help="comma-separated token ids, e.g. 1,2,3")
    gen.add_argument("--max-tokens", type=int, default=16)
    gen.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=0, help="0 = no top-k filter")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    gen.add_argument("--device", default="cpu")
    gen.add_argument("--max-seq-len", type=int, default=4096)
    gen.add_argument("--stream", action="store_true", help="print each token as it is sampled")
    gen.add_argument("--tensor-parallel-size", type=int, default=1, help="shard the model over this many processes")
    gen.add_argument("--pipeline-parallel-size", type=int, default=1,
                     help="give each of this many processes a block of consecutive layers")
    gen.add_argument("--enable-expert-parallel", action="store_true",
                     help="mixture-of-experts models: each process holds whole experts (the same bits either way)")
    gen.set_defaults(func=cmd_generate)

    make = sub.add_parser("make-checkpoint", help="write a random-weight checkpoint in Hugging Face format")
    make.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--multimodal", action="store_true",
                      help="Qwen3.5 (and Qwen3.5-MoE) presets: write the ...ForConditionalGeneration layout")
    make.add_argument("--mtp", action="store_true",
                      help="Qwen3.5 presets: also write the multi-token-prediction layer (mtp.*), as published")
    make.add_argument("--force", action="store_true",
                      help="write into a non-empty directory, replacing an earlier checkpoint's files")
    make.add_argument("directory", help="output directory")
    make.set_defaults(func=cmd_make_checkpoint)

    bench = sub.add_parser("bench", help="throughput and latency benchmark (see `pocketllm bench --help`)",
                           add_help=False)
    bench.add_argument("bench_args", nargs=argparse.REMAINDER, help="arguments of the benchmark")

    from .lab.cli import add_parser as add_lab_parser
    from .serve.cli import add_parser as add_serve_parser

    add_lab_parser(sub)
    add_serve_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # the benchmark owns its arguments, --help included; its main runs in run_command
        from .bench import main as bench_main

        return bench_main(argv[1:])
    args = build_parser().parse_args(argv)
    return run_command(args.command, lambda: args.func(args))


if __name__ == "__main__":
    sys.exit(main())
