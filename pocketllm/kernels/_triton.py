"""Import Triton for the kernel modules, in interpreter mode when no CUDA device is present.

TRITON_INTERPRET must be set before `triton` is first imported, so every kernel module takes
`triton` and `tl` from here. Where Triton is not installed (it is a Linux x86_64 dependency), a
stand-in lets the modules import, so the torch backend runs anywhere; launching a kernel then
raises a clear error.
"""

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is absent
    HAS_TRITON = False

    class _Missing:
        """Accepts `@triton.jit` and `tl.constexpr` annotations; anything else is an error."""

        constexpr = object

        @staticmethod
        def jit(fn=None, **_kwargs):
            return fn if fn is not None else (lambda f: f)

        def __getattr__(self, name: str):
            raise RuntimeError(f"triton is not installed, so triton.{name} is unavailable; use backend='torch'")

    triton = tl = _Missing()

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
_recording = False  # see recording_launches


@contextmanager
def recording_launches() -> Iterator[None]:
    """For `pocketllm.lab.compile`, which records launches to compile them for a GPU target and runs
    nothing: meanwhile launchers accept CPU tensors with the interpreter off, and make their
    device-dependent choices (tile sizes, ...) for CUDA, the device the launches are compiled for."""
    global _recording
    previous, _recording = _recording, True
    try:
        yield
    finally:
        _recording = previous


def launch_device_type(tensor: torch.Tensor) -> str:
    """The device type a launcher tunes its launch for: the tensor's, or "cuda" while launches are
    recorded (see `recording_launches`)."""
    return "cuda" if _recording else tensor.device.type


def kernel_device_ok(tensor: torch.Tensor) -> None:
    """Kernels run on CUDA tensors, or on CPU tensors under the interpreter (or while launches are
    only recorded, see `recording_launches`)."""
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed; use backend='torch'")
    if tensor.device.type == "cpu" and not INTERPRETED and not _recording:
        raise RuntimeError("a Triton kernel got CPU tensors but the interpreter is off; "
                           "import pocketllm before triton, or use device='cuda'")
