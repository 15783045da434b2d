"""Engine-level checks of `pocketllm lab check`: the invariance property, and greedy parity against
`transformers`.

The property is the contract itself, with a variant installed through `op_overrides`: random
workloads (`pocketllm.testing.strategies`) through the batch scheduler, every request's tokens and
logprobs `==` its cold serial run (`pocketllm.testing.assert_batch_invariant`, which the engine
tests run too). Needs `hypothesis` (and `transformers` for parity): the `dev` extra.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch
from hypothesis import HealthCheck, Phase, given, settings

from ..config import Backend, EngineArgs
from ..kernels.backends import DEFAULT_BACKEND
from ..kernels.registry import ImplSpec
from ..llm import LLM
from ..models import cached_checkpoint
from ..sampling import SamplingParams
from ..testing.assertions import assert_batch_invariant
from ..testing.engines import Engines
from ..testing.strategies import Workload, workloads


@contextmanager
def quiet_engine() -> Iterator[None]:
    """The engine's logs and warnings held back while the lab drives it: a variant that breaks
    every step would have each failed forward logged with its traceback, and each engine's
    start-up probe warn, hundreds of lines, where the verdict says what failed first."""
    package_logger = logging.getLogger("pocketllm")
    level = package_logger.level
    package_logger.setLevel(logging.CRITICAL + 1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            yield
    finally:
        package_logger.setLevel(level)


def engine_property(overrides: Mapping[str, ImplSpec], preset: str, examples: int,
                    backend: Backend = DEFAULT_BACKEND) -> str | None:
    """Run the invariance property on `preset` with `overrides` installed; None when it holds,
    else the shrunk counterexample."""
    path = cached_checkpoint(preset)
    engines = Engines(path, engine_args={"backend": backend, "op_overrides": dict(overrides)})
    vocab = engines.serial.model_config.vocab_size
    failure: list[str] = []

    # No "explain" phase: it reruns the shrunk example with each part varied, for notes the verdict
    # does not print, and took most of a failing check's time.
    @settings(max_examples=examples, deadline=None, database=None, derandomize=True, report_multiple_bugs=False,
              suppress_health_check=list(HealthCheck), phases=(Phase.explicit, Phase.reuse, Phase.generate,
                                                               Phase.shrink))
    @given(workload=workloads(min(vocab, 256), max_prompt=40, max_jobs=8))
    def holds(workload: Workload) -> None:
        try:
            assert_batch_invariant(engines, workload)
        except AssertionError as exc:  # a mismatch, a serial run that failed, a request left without a result
            failure[:] = [f"max_batch_size {workload.max_batch_size}, {len(workload.jobs)} jobs: "
                          f"{str(exc).splitlines()[0]} {_first_detail(str(exc))}"]
            raise

    try:
        holds()
    except AssertionError:
        return failure[-1] if failure else "the property failed"
    finally:
        engines.close()
    return None


def _first_detail(message: str) -> str:
    """The first "- ..." line of an assertion's message (the first request that differs), if any."""
    return next((line[2:] for line in message.splitlines() if line.startswith("- ")), "")


@torch.inference_mode()
def greedy_parity(overrides: Mapping[str, ImplSpec], preset: str, prompts: int = 3, new_tokens: int = 16,
                  backend: Backend = DEFAULT_BACKEND) -> str | None:
    """Greedy tokens of pocketllm (fp32, `overrides` installed) == transformers' (eager, fp32)
    on `prompts` random prompts; None when all agree, else the first divergence."""
    import transformers

    path = cached_checkpoint(preset)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    hf.eval()
    llm = LLM(EngineArgs(model=str(path), max_seq_len=128, backend=backend, op_overrides=dict(overrides)))
    gen = torch.Generator().manual_seed(0)
    config = transformers.GenerationConfig(do_sample=False, max_new_tokens=new_tokens, eos_token_id=None,
                                           pad_token_id=0)
    hf.generation_config.eos_token_id = None
    for length in (1, 9, 70)[:prompts]:
        prompt = torch.randint(0, llm.model_config.vocab_size, (length,), generator=gen).tolist()
        want = hf.generate(torch.tensor([prompt]), generation_config=config)[0, length:].tolist()
        result = llm.generate(prompt_tokens=prompt, sampling_params=SamplingParams(
            max_tokens=new_tokens, temperature=0.0, ignore_eos=True))
        if result.finish_reason != "length":
            return f"prompt of {length} tokens: the run ended {result.finish_reason}: {result.error}"
        got = result.token_ids
        if got != want:
            at = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
            return f"prompt of {length} tokens: token {at} is {got[at]}, transformers gives {want[at]}"
    return None
