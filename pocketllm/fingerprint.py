"""The bits fingerprint: a short name for everything that decides a response's bits, as OpenAI's
`system_fingerprint` ("fp_" + 10 hex digits). Two engines with the same fingerprint answer the
same request (token ids, sampling parameters, seed) with the same tokens and logprobs, bit for bit.

    bits_fingerprint(llm)              # "fp_3f2a9c01be"; hashes the checkpoint's files once
    bits_settings(llm)                 # what it covers, but the checkpoint

What it covers: the package and torch versions, the backend and device, dtype and weight dtype,
the implementation of every op (the op table), the instruction set the C++ linear kernel runs and
ATen's, batch invariance, exact positions and the tree reduction, and a SHA-256 of the checkpoint's
files (config, generation config, tokenizer, tokenizer config, every safetensors file). Left out,
because they change no bit: the model's path and served name, the batch size, the scheduler's other
options, serial or batched mode, and the tensor-parallel size where the tree reduction is on (every
size adds in the same order; without the tree the size is included). Without exact positions a
position's bits depend on where its prompt was cut, so the cut grid (prefill_chunk_size and
state_snapshot_interval) is included then.
"""

from __future__ import annotations

import hashlib
import json
import platform
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .kernels import IMPLEMENTATIONS, Ops
from .kernels._triton import HAS_TRITON, triton
from .kernels.cpu.extension import load_extension
from .models.loader import checkpoint_files
from .op_table import FIXED_ORDER, op_table
from .tokenizer import TOKENIZER_CONFIG_FILE, TOKENIZER_FILE
from .version import __version__

if TYPE_CHECKING:
    from .llm import LLM

# The checkpoint's files besides its safetensors files that decide what a request runs.
METADATA_FILES = ("config.json", "generation_config.json", TOKENIZER_FILE, TOKENIZER_CONFIG_FILE)
BLOCK_BYTES = 1 << 20  # files are hashed in blocks of 1 MiB: a checkpoint's files can be large
FINGERPRINT_HEX_DIGITS = 10


def checkpoint_digest(model_dir: str | Path) -> str:
    """SHA-256 (hex) of the checkpoint's files: each one's name and size, then its bytes, read in
    blocks of BLOCK_BYTES; the metadata files that exist, then the safetensors files in load order."""
    path = Path(model_dir)
    files = [path / name for name in METADATA_FILES if (path / name).is_file()] + checkpoint_files(path)
    digest = hashlib.sha256()
    buffer = bytearray(BLOCK_BYTES)
    view = memoryview(buffer)
    for file in files:
        digest.update(f"{file.name}\0{file.stat().st_size}\0".encode())
        with open(file, "rb") as stream:
            while count := stream.readinto(buffer):
                digest.update(view[:count])
    return digest.hexdigest()


def implementation_name(op: str, fn: Any) -> str:
    """The name an op's implementation is registered under, else its module and qualified name."""
    name = next((name for name, impl in IMPLEMENTATIONS[op].items() if impl is fn), None)
    return name or f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"


def _instruction_sets(ops: Ops) -> dict[str, str | None]:
    """The C++ linear kernel's variant (None when linear runs another implementation) and ATen's
    CPU capability (its own vectorized kernels: softmax, the sampler's ops, MKL's tiles)."""
    linear = {IMPLEMENTATIONS["linear"][name]: name for name in FIXED_ORDER}.get(ops.linear)
    variant = None
    if linear == "fixed_order":
        module = load_extension()  # already built: the engine runs it
        variant = module.best_variant() if module is not None else None
    elif linear is not None:
        variant = "avx2"
    return {"linear_variant": variant, "aten": torch.backends.cpu.get_cpu_capability(), "machine": platform.machine()}


def bits_settings(llm: LLM) -> dict[str, Any]:
    """What decides the bits of `llm`'s responses, the checkpoint aside (see the module)."""
    args, caps = llm.args, llm.capabilities
    ops = op_table(args)
    device = llm.device
    settings: dict[str, Any] = {
        "pocketllm": __version__, "torch": torch.__version__, "backend": args.backend,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
        "dtype": str(args.torch_dtype), "weight_dtype": str(args.torch_weight_dtype),
        "ops": {f.name: implementation_name(f.name, getattr(ops, f.name)) for f in fields(ops)},
        "batch_invariant": caps.batch_invariant, "exact_positions": caps.exact_positions,
        "tree_reduction": caps.tree_reduction}
    if device.type == "cpu":
        settings["instruction_sets"] = _instruction_sets(ops)
    if args.backend == "triton" and HAS_TRITON:
        settings["triton"] = triton.__version__
    if not caps.tree_reduction:  # one product per rank and a plain all-reduce: the size and layout decide the sums
        settings["tensor_parallel_size"] = caps.tensor_parallel_size
        settings["enable_expert_parallel"] = args.enable_expert_parallel
    if not caps.exact_positions:  # a position's bits depend on the piece that computed it
        policy = llm.scheduler.policy if llm.scheduler is not None else llm.policy  # configure() may change it
        settings["prompt_cuts"] = [policy.chunk_size, policy.snapshot_interval]
    return settings


def bits_fingerprint(llm: LLM, digest: str | None = None) -> str:
    """`llm`'s fingerprint: "fp_" + 10 hex digits of a SHA-256 over `bits_settings` and the
    checkpoint's digest (`digest`, else `checkpoint_digest` of its model directory, read now)."""
    digest = digest if digest is not None else checkpoint_digest(llm.args.model)
    text = json.dumps({**bits_settings(llm), "checkpoint": digest}, sort_keys=True)
    return "fp_" + hashlib.sha256(text.encode()).hexdigest()[:FINGERPRINT_HEX_DIGITS]
