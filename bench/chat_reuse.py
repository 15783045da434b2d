"""A chat's second turn with default options: its time to first token with prefix reuse and
without, at real model shapes (random weights), and whether both give the same tokens and logprobs.

Turn 1: a `--first`-token prompt, `--answer` greedy tokens. Turn 2: turn 1's prompt and answer plus
a `--message`-token message, `--answer` tokens again, on the same batched engine (its slot still
holds turn 1). Each configuration runs `--repeats` conversations (new random tokens each), the
configurations interleaved; reported: the median turn-2 TTFT, the positions turn 2 reused, bits equal.

    python bench/chat_reuse.py [--presets qwen3-0.6b qwen3.5-0.8b] [--first 240] [--message 20]
                               [--answer 16] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from pocketllm import LLM, EngineArgs, SamplingParams
from pocketllm.machine import cpu_name
from pocketllm.models import cached_checkpoint


def second_turn(llm: LLM, generator: torch.Generator, first: int, message: int, answer: int) -> tuple:
    """(turn-2 TTFT in s, positions turn 2 reused, its tokens and logprobs) of one conversation."""
    greedy = SamplingParams(max_tokens=answer, temperature=0.0, ignore_eos=True)
    vocab = llm.model_config.vocab_size
    prompt = torch.randint(0, vocab, (first,), generator=generator).tolist()
    turn1 = llm.generate(prompt, greedy)
    follow = prompt + turn1.token_ids + torch.randint(0, vocab, (message,), generator=generator).tolist()
    assert llm.scheduler is not None
    before = llm.scheduler.get_stats().prefix_tokens_reused
    turn2 = llm.generate(follow, greedy)
    reused = llm.scheduler.get_stats().prefix_tokens_reused - before
    return turn2.ttft_s, reused, (turn2.token_ids, turn2.logprobs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["qwen3-0.6b", "qwen3.5-0.8b"])
    parser.add_argument("--first", type=int, default=240)
    parser.add_argument("--message", type=int, default=20)
    parser.add_argument("--answer", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"# {cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}", flush=True)
    print("| model | reuse | turn-2 TTFT (median) | positions reused | same tokens and logprobs |")
    print("|---|---|---|---|---|")
    for preset in args.presets:
        path = str(cached_checkpoint(preset))
        engines = {reuse: LLM(EngineArgs(model=path, max_seq_len=args.first + 2 * args.answer + args.message + 8,
                                         backend_options={"enable_batching": True, "enable_prefix_reuse": reuse}))
                   for reuse in (True, False)}
        runs: dict[bool, list[tuple]] = {True: [], False: []}
        for repeat in range(args.repeats):
            for reuse, llm in engines.items():  # the same conversation on both
                runs[reuse].append(second_turn(llm, torch.Generator().manual_seed(repeat), args.first,
                                               args.message, args.answer))
        same = [a[2] == b[2] for a, b in zip(runs[True], runs[False])]
        for reuse, rows in runs.items():
            ttft = statistics.median(r[0] for r in rows)
            print(f"| {preset} | {'on' if reuse else 'off'} | {ttft * 1e3:.0f} ms | {rows[0][1]} | "
                  f"{sum(same)} of {len(same)} |", flush=True)
        for llm in engines.values():
            llm.close()


if __name__ == "__main__":
    main()
