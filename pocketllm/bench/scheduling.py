"""Scheduling benchmark (`pocketllm bench --scheduling`): what prefix reuse and chunked prefill buy,
each measured on and off in one run, on random weights in the shapes of published checkpoints.

- shared_prefixes: `systems` system prompts of `system_len` tokens, `questions` short questions
  (8..32 tokens) after each, every request greedy for `new_tokens` tokens, all submitted at once
  in round-robin order over the system prompts. Reuse on: later questions take the system
  prompt's K/V (and Gated DeltaNet states) from a retained slot or copy them from a busy one.
  Reported: TTFT p50/p99 (from submission, queueing included), generated tokens/s over the wall
  time, prefix hits and reused tokens.
- long_prompt: `short` requests (16-token prompts) decode; once each has `warm_tokens` tokens a
  `long_len`-token prompt arrives. Chunking off (the prompt in one piece, an unbounded budget)
  stalls every running request for the whole prefill; on, each step runs at most one chunk.
  Reported: inter-token latency (ITL) of the short requests, p50/p99/max, from the slot timeline
  (the end of each forward that gave them a token), and the long prompt's TTFT.
- multi_turn: `conversations` chats of `turns` turns, all chats' turn t at once: turn t's prompt is
  turn t - 1's prompt and answer plus a `user_len`-token message; answers of `new_tokens` greedy
  tokens. With exact positions (on for this workload), the next turn can reuse the previous
  answer's decoded positions too. Reported per reuse setting: wall time, turn TTFT p50, tokens
  reused and prefill tokens run; every turn's tokens are checked equal with reuse on and off.

Both run the torch backend, float32, on the CPU unless --device says otherwise; the scheduler is
stepped on this thread. Writes scheduling.json, scheduling.md and (with matplotlib) scheduling.png.
`--quick` uses the tiny presets and small counts: a smoke test, its timings mean little.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..config import EngineArgs
from ..llm import LLM
from ..models import cached_checkpoint
from ..sampling import SamplingParams
from ..scheduler.stats import percentile
from .report import load_average, machine_info, save_report


@dataclass(frozen=True)
class Size:
    presets: tuple[str, ...]
    systems: int
    system_len: int
    questions: int
    new_tokens: int
    short: int
    warm_tokens: int
    short_tokens: int
    long_len: int
    chunk: int
    conversations: int
    turns: int
    user_len: int


SIZES = {"full": Size(("qwen3-0.6b", "qwen3.5-0.8b"), 8, 512, 4, 8, 4, 8, 48, 2048, 256, 4, 4, 32),
         "quick": Size(("tiny", "qwen3.5-tiny"), 3, 128, 2, 4, 2, 4, 16, 256, 64, 2, 4, 16)}
SLOTS = 8


def _engine(path: Path, max_seq_len: int, device: str, **options: Any) -> LLM:
    options = {"enable_batching": True, "background_thread": False, "record_timeline": True,
               "max_batch_size": SLOTS, **options}
    return LLM(EngineArgs(model=str(path), max_seq_len=max_seq_len, device=device, backend_options=options))


def _greedy(tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)


def shared_prefixes(path: Path, size: Size, reuse: bool, device: str, seed: int) -> dict[str, Any]:
    """One run of the shared-system-prompt workload; reuse on or off, everything else equal."""
    rng = np.random.default_rng(seed)
    with _engine(path, size.system_len + 64, device, enable_prefix_reuse=reuse, prefill_chunk_size=size.system_len,
                 state_snapshot_interval=size.system_len, max_num_batched_tokens=2 * size.system_len + SLOTS) as llm:
        vocab = llm.model_config.vocab_size
        systems = [rng.integers(0, vocab, size.system_len).tolist() for _ in range(size.systems)]
        prompts = [systems[s] + rng.integers(0, vocab, int(rng.integers(8, 33))).tolist()
                   for _ in range(size.questions) for s in range(size.systems)]
        llm.generate(prompt_tokens=[[1, 2, 3]], sampling_params=_greedy(2))  # warm-up
        scheduler = llm.scheduler
        assert scheduler is not None
        before = scheduler.get_stats()
        start = time.perf_counter()
        results = llm.generate(prompt_tokens=prompts, sampling_params=_greedy(size.new_tokens))
        wall = time.perf_counter() - start
        stats = scheduler.get_stats()
    ttfts = [r.ttft_s for r in results if r.ttft_s is not None]
    return {"prefix_reuse": reuse, "requests": len(prompts), "wall_s": wall,
            "tokens_per_s": sum(len(r.token_ids) for r in results) / wall,
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
            "prefix_hits": stats.prefix_hits - before.prefix_hits,
            "prefix_copies": stats.prefix_copies - before.prefix_copies,
            "prefix_tokens_reused": stats.prefix_tokens_reused - before.prefix_tokens_reused,
            "prefill_tokens_run": stats.prompt_tokens - before.prompt_tokens
                                  - (stats.prefix_tokens_reused - before.prefix_tokens_reused),
            "state_snapshot_bytes": stats.state_snapshot_bytes,
            "state_snapshot_bytes_per_slot_max": llm.capabilities.state_snapshot_bytes_per_slot}


def long_prompt(path: Path, size: Size, chunked: bool, device: str, seed: int) -> dict[str, Any]:
    """One run of the long-prompt-arrival workload; chunking on or off, everything else equal."""
    rng = np.random.default_rng(seed)
    max_seq_len = size.long_len + 64
    cuts = ({"prefill_chunk_size": size.chunk, "state_snapshot_interval": size.chunk,
             "max_num_batched_tokens": size.chunk + SLOTS} if chunked else
            {"prefill_chunk_size": 0, "state_snapshot_interval": 0, "max_num_batched_tokens": max_seq_len + SLOTS})
    with _engine(path, max_seq_len, device, **cuts) as llm:
        vocab = llm.model_config.vocab_size
        scheduler = llm.scheduler
        assert scheduler is not None and scheduler.timeline is not None
        llm.generate(prompt_tokens=[[1, 2, 3]], sampling_params=_greedy(2))  # warm-up
        scheduler.timeline.clear()
        shorts = [scheduler.submit_request(rng.integers(0, vocab, 16).tolist(), _greedy(size.short_tokens))
                  for _ in range(size.short)]
        for _ in range(size.warm_tokens):
            scheduler.step()
        long_id = scheduler.submit_request(rng.integers(0, vocab, size.long_len).tolist(), _greedy(2))
        while scheduler.has_work:
            scheduler.step()
        long_result = scheduler.poll_result(long_id, timeout_ms=None)
        for request_id in shorts:
            scheduler.poll_result(request_id)
        events = list(scheduler.timeline)
    gaps = []
    for request_id in shorts:
        # A forward gives a short request a token when it decodes it or ends its prompt.
        ends = sorted(e.end_s for e in events if e.request_id == request_id)
        gaps += [b - a for a, b in zip(ends, ends[1:])]
    after = min(e.start_s for e in events if e.request_id == long_id)  # the long prompt's first forward
    return {"chunked": chunked, "chunk": size.chunk if chunked else None, "long_prompt_tokens": size.long_len,
            "itl_p50_s": percentile(gaps, 50), "itl_p99_s": percentile(gaps, 99), "itl_max_s": max(gaps),
            "long_ttft_s": long_result.ttft_s,
            "itl_trace": [(round(e.end_s - after, 4), e.request_id) for e in events
                          if e.request_id in shorts and e.phase == "decode"]}


def multi_turn(path: Path, size: Size, reuse: bool, device: str, seed: int) -> dict[str, Any]:
    """One run of the multi-turn chat workload; reuse on or off, exact positions on in both."""
    rng = np.random.default_rng(seed)
    turn_len = size.user_len + size.new_tokens
    max_seq_len = size.system_len + size.turns * turn_len + 64
    with _engine(path, max_seq_len, device, enable_prefix_reuse=reuse, exact_positions=True,
                 prefill_chunk_size=64, state_snapshot_interval=64, max_num_batched_tokens=max_seq_len) as llm:
        vocab = llm.model_config.vocab_size
        scheduler = llm.scheduler
        assert scheduler is not None
        chats = [rng.integers(0, vocab, size.system_len).tolist() for _ in range(size.conversations)]
        llm.generate(prompt_tokens=[[1, 2, 3]], sampling_params=_greedy(2))  # warm-up
        before, ttfts, answers = scheduler.get_stats(), [], []
        start = time.perf_counter()
        for _ in range(size.turns):
            chats = [chat + rng.integers(0, vocab, size.user_len).tolist() for chat in chats]
            results = llm.generate(prompt_tokens=chats, sampling_params=_greedy(size.new_tokens))
            ttfts += [r.ttft_s for r in results if r.ttft_s is not None]
            answers.append([r.token_ids for r in results])
            chats = [chat + r.token_ids for chat, r in zip(chats, results)]
        wall = time.perf_counter() - start
        stats = scheduler.get_stats()
        exact = llm.capabilities.exact_positions
    reused = stats.prefix_tokens_reused - before.prefix_tokens_reused
    return {"prefix_reuse": reuse, "exact_positions": exact, "wall_s": wall, "ttft_p50_s": percentile(ttfts, 50),
            "prefix_tokens_reused": reused, "prefill_tokens_run": stats.prompt_tokens - before.prompt_tokens - reused,
            "answers": answers}


def run(out: Path, quick: bool, seed: int, device: str, plots: bool) -> str:
    """Both workloads on every preset of the size, on and off; writes the report, returns the Markdown."""
    size = SIZES["quick" if quick else "full"]
    machine = machine_info()
    models = []
    for preset in size.presets:
        path = cached_checkpoint(preset)
        models.append({"preset": preset,
                       "shared_prefixes": [shared_prefixes(path, size, reuse, device, seed) for reuse in (False, True)],
                       "long_prompt": [long_prompt(path, size, chunked, device, seed) for chunked in (False, True)],
                       "multi_turn": _multi_turn_pair(path, size, device, seed)})
    machine["load_average_1min_at_end"] = load_average()
    report = {"machine": machine, "size": asdict(size), "seed": seed, "device": device, "models": models}
    text = markdown(report)
    save_report(out, "scheduling", report, text)
    if plots:
        plot(models).savefig(out / "scheduling.png", dpi=120)
    return text


def _multi_turn_pair(path: Path, size: Size, device: str, seed: int) -> list[dict[str, Any]]:
    """The multi-turn workload with reuse off and on; the answers must agree token for token."""
    runs = [multi_turn(path, size, reuse, device, seed) for reuse in (False, True)]
    if runs[0]["answers"] != runs[1]["answers"]:
        raise AssertionError("multi_turn: the answers differ with prefix reuse on and off")
    for r in runs:
        del r["answers"]
    return runs


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def markdown(report: dict[str, Any]) -> str:
    size, machine, models = report["size"], report["machine"], report["models"]
    on_off = lambda flag: "on" if flag else "off"  # noqa: E731
    lines = [f"# Scheduling: prefix reuse and chunked prefill ({machine['processor']}, {machine['cpu_count']} CPUs, "
             f"torch {machine['torch']}, {report['device']})", "",
             f"shared_prefixes: {size['systems']} system prompts x {size['system_len']} tokens, {size['questions']} "
             f"questions each, {size['new_tokens']} new tokens, {SLOTS} slots, all submitted at once.", ""]
    lines += _table(["model", "reuse", "TTFT p50 s", "TTFT p99 s", "tokens/s", "hits (copies)", "tokens reused",
                     "snapshot bytes/slot max"],
                    [[m["preset"], on_off(r["prefix_reuse"]), f"{r['ttft_p50_s']:.3f}", f"{r['ttft_p99_s']:.3f}",
                      f"{r['tokens_per_s']:.1f}", f"{r['prefix_hits']} ({r['prefix_copies']})",
                      str(r["prefix_tokens_reused"]), str(r["state_snapshot_bytes_per_slot_max"])]
                     for m in models for r in m["shared_prefixes"]])
    lines += ["", f"long_prompt: {size['short']} short requests decoding, then a {size['long_len']}-token prompt "
                  f"arrives; inter-token latency of the short requests.", ""]
    lines += _table(["model", "chunking", "ITL p50 s", "ITL p99 s", "ITL max s", "long prompt TTFT s"],
                    [[m["preset"], f"on ({r['chunk']} tokens)" if r["chunked"] else "off", f"{r['itl_p50_s']:.3f}",
                      f"{r['itl_p99_s']:.3f}", f"{r['itl_max_s']:.3f}", f"{r['long_ttft_s']:.3f}"]
                     for m in models for r in m["long_prompt"]])
    lines += ["", f"multi_turn: {size['conversations']} conversations x {size['turns']} turns (system prompt "
                  f"{size['system_len']} tokens, {size['user_len']}-token messages, {size['new_tokens']}-token "
                  f"answers), exact positions requested; the answers are equal with reuse on and off.", ""]
    lines += _table(["model", "reuse", "exact positions", "wall s", "turn TTFT p50 s", "tokens reused",
                     "prefill tokens run"],
                    [[m["preset"], on_off(r["prefix_reuse"]), "yes" if r["exact_positions"] else "no",
                      f"{r['wall_s']:.2f}", f"{r['ttft_p50_s']:.3f}", str(r["prefix_tokens_reused"]),
                      str(r["prefill_tokens_run"])] for m in models for r in m["multi_turn"]])
    return "\n".join(lines) + "\n"


def plot(models: list[dict[str, Any]]):
    """Left: TTFT p50/p99 with reuse off and on; right: the short requests' token times around the
    long prompt's arrival (t = 0), chunking off and on."""
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    labels, p50, p99 = [], [], []
    for m in models:
        for r in m["shared_prefixes"]:
            labels.append(f"{m['preset']}\nreuse {'on' if r['prefix_reuse'] else 'off'}")
            p50.append(r["ttft_p50_s"])
            p99.append(r["ttft_p99_s"])
    x = np.arange(len(labels))
    left.bar(x - 0.2, p50, 0.4, label="TTFT p50")
    left.bar(x + 0.2, p99, 0.4, label="TTFT p99")
    left.set_xticks(x)
    left.set_xticklabels(labels, fontsize=8)
    left.set_ylabel("seconds")
    left.set_title("shared system prompts")
    left.legend()
    for m in models:
        for r in m["long_prompt"]:
            times = sorted({t for t, _ in r["itl_trace"]})
            gaps = np.diff(times)
            label = f"{m['preset']} chunking {'on' if r['chunked'] else 'off'}"
            right.plot(times[1:], gaps, marker=".", drawstyle="steps-pre", label=label)  # a gap spans its interval
    right.set_xlabel("seconds since the long prompt arrived")
    right.set_ylabel("gap between decode steps of the short requests (s)")
    right.set_title("a long prompt arrives while short requests decode")
    right.legend(fontsize=8)
    fig.tight_layout()
    return fig
