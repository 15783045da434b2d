"""Ranks started by torchrun (`pocketllm.launch`): two torchrun invocations over the loopback address
stand for two hosts; every rank runs one script, rank 0's engine gives the bits of one process, and
every process exits when rank 0 closes the engine."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from pocketllm import LLM, EngineArgs, SamplingParams
from pocketllm.launch import launched_rank

SCRIPT = textwrap.dedent("""
    import json, sys
    from pocketllm import LLM, EngineArgs, SamplingParams

    model, out, size, layout = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    sizes = {"pipeline_parallel_size": size} if layout == "pipeline" else {"tensor_parallel_size": size}
    llm = LLM(EngineArgs(model=model, max_seq_len=128, enable_expert_parallel=layout == "expert",
                         backend_options={"enable_batching": True}, **sizes))
    # only rank 0 gets here: the other ranks served it inside LLM(...) and exited when it closed
    results = llm.generate(json.loads(sys.argv[5]), [SamplingParams(**p) for p in json.loads(sys.argv[6])])
    llm.close()
    with open(out, "w") as handle:
        json.dump([[r.token_ids, r.logprobs] for r in results], handle)
""")
PROMPTS = [[3, 1, 4, 1, 5], [(7 * i) % 256 for i in range(40)], [2, 7]]
PARAMS = [{"max_tokens": 6, "temperature": 0.0, "logprobs": 1, "ignore_eos": True},
          {"max_tokens": 6, "temperature": 0.9, "seed": 4, "logprobs": 1, "ignore_eos": True},
          {"max_tokens": 6, "temperature": 0.7, "seed": 5, "logprobs": 1, "ignore_eos": True}]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _two_hosts(tmp_path, model, per_host: int, layout: str = "tensor") -> list:
    """Run SCRIPT as two torchrun invocations of `per_host` ranks each (the c10d rendezvous on the
    loopback address): rank 0's results; every process must exit 0 within the bound."""
    script, out = tmp_path / "script.py", tmp_path / "out.json"
    script.write_text(SCRIPT)
    endpoint = f"127.0.0.1:{_free_port()}"
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", str(per_host),
               "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "pocketllm-test",
               "--max-restarts", "0", str(script), str(model), str(out), str(2 * per_host), layout,
               json.dumps(PROMPTS), json.dumps(PARAMS)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    hosts = [subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    try:
        logs = [host.communicate(timeout=300)[0] for host in hosts]
    finally:
        for host in hosts:
            host.kill()
    assert [host.returncode for host in hosts] == [0, 0], "\n".join(logs)
    return json.loads(out.read_text())


def _one_process(model) -> list:
    with LLM(EngineArgs(model=str(model), max_seq_len=128)) as llm:
        results = [llm.generate(prompt_tokens=p, sampling_params=SamplingParams(**params))
                   for p, params in zip(PROMPTS, PARAMS)]
    return [[r.token_ids, r.logprobs] for r in results]


@pytest.mark.slow
def test_two_torchrun_hosts_give_the_bits_of_one_process(checkpoint_dir, tmp_path):
    """TP=2 as one rank on each of two "hosts" (Gloo over the loopback address), every request's
    tokens and logprobs equal to one process's serial run."""
    model = checkpoint_dir("tiny")
    assert _two_hosts(tmp_path, model, per_host=1) == _one_process(model)


@pytest.mark.slow  # four ranks on two cores, each its own interpreter
@pytest.mark.parametrize("variant,layout", [("tiny", "tensor"), ("qwen3-moe", "expert"), ("qwen3.5", "pipeline")])
def test_two_torchrun_hosts_of_two_ranks_give_the_bits_of_one_process(checkpoint_dir, tmp_path, variant, layout):
    """TP=4 (EP=4 on the mixture of experts; four pipeline stages on the hybrid) as two ranks on each of
    two "hosts"."""
    model = checkpoint_dir(variant)
    assert _two_hosts(tmp_path, model, per_host=2, layout=layout) == _one_process(model)


def test_a_torchrun_world_of_another_size_is_refused_naming_both(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2, but torchrun started 3 processes"):
        launched_rank(2)
    assert launched_rank(1) is None
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    assert launched_rank(2) is None
