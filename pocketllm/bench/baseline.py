"""The transformers baseline: the same checkpoint through `generate`, one at a time and in
static, left-padded batches. Needs `transformers` (`pocketllm[baseline]`)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from .workloads import Run, Sample, Workload, summarize

PAD_ID = 0  # transformers static batches: left padding, masked out


def load_transformers(path: Path, dtype: torch.dtype = torch.float32) -> Any:
    """The same checkpoint as a transformers model (in `dtype`, eval), warmed up; None when
    transformers is not installed."""
    try:
        import transformers
    except ImportError:
        return None
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
    _static_batch(model, [[1] * 16, [1] * 8], 4)
    return model


class _FirstTokenClock:
    """A generate() streamer noting when the first new tokens arrive (its first put() is the prompt)."""

    def __init__(self) -> None:
        self.puts = 0
        self.first_token_time = 0.0

    def put(self, value: torch.Tensor) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first_token_time = time.perf_counter()

    def end(self) -> None:
        pass


def _static_batch(model: Any, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    """One left-padded greedy batch, `new_tokens` for every row: when its first tokens came, and the
    tokens each row generated."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[PAD_ID] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    clock = _FirstTokenClock()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=PAD_ID, streamer=clock)
    if out.shape[1] != width + new_tokens:
        raise RuntimeError(f"transformers generated {out.shape[1] - width} tokens, planned {new_tokens}")
    return clock.first_token_time, out[:, width:].tolist()


def timed_generate(model: Any, prompt: list[int], new_tokens: int) -> tuple[float, float, list[int]]:
    """(TTFT, total time) in seconds of one greedy request generating exactly `new_tokens`, and its tokens."""
    start = time.perf_counter()
    first, tokens = _static_batch(model, [prompt], new_tokens)
    return first - start, time.perf_counter() - start, tokens[0]


def run_transformers(model: Any, workload: Workload, batch_size: int) -> Run:
    """Static batching in submission order (batch 1: one request at a time). A batch runs until its
    longest request is done; only the tokens each request asked for are counted."""
    samples: list[Sample] = []
    start = time.perf_counter()
    for i in range(0, len(workload.prompts), batch_size):
        lens = workload.output_lens[i:i + batch_size]
        first = _static_batch(model, workload.prompts[i:i + batch_size], max(lens))[0] - start
        done = time.perf_counter() - start
        samples += [(first, done, n) for n in lens]
    wall = time.perf_counter() - start
    return summarize(workload, "transformers", "static", batch_size, wall, samples)


def static_efficiency(workload: Workload, batch_size: int) -> float:
    """Useful tokens / tokens a static batching of the workload generates (it pads to the longest)."""
    lens = workload.output_lens
    computed = sum(max(lens[i:i + batch_size]) * len(lens[i:i + batch_size]) for i in range(0, len(lens), batch_size))
    return sum(lens) / computed
