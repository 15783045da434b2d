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
from typing import Any

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


def _patch_language_once_per_launch() -> None:
    """Interpreted, Triton patches its language module again at every call a kernel makes to a
    `@triton.jit` function (`tl.sum`, `tl.max` and our own helpers are such functions): a scan of
    the module of about 2 ms that patches nothing new after the first call, and over half of an
    interpreted engine step. Here a launch patches once per module of the functions it calls; each
    call then runs the interpreter's rewritten function as before. Where the interpreter's internals
    are not the ones this was written against (Triton 3.x), nothing is changed."""
    from triton.runtime import interpreter as module

    interpreter: Any = module
    names = ("GridExecutor", "InterpretedFunction", "InterpreterError", "_patch_lang")
    if not all(hasattr(interpreter, name) for name in names) or not hasattr(interpreter.InterpretedFunction, "rewrite"):
        return
    launcher, function, error = interpreter.GridExecutor, interpreter.InterpretedFunction, interpreter.InterpreterError
    launch = launcher.__call__
    patched: set[int] = set()  # ids of the globals of the functions whose language this launch patched

    def launch_grid(self: Any, *args: Any, **kwargs: Any) -> Any:
        patched.clear()
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched.clear()

    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        if id(self.fn.__globals__) not in patched:
            interpreter._patch_lang(self.fn)
            patched.add(id(self.fn.__globals__))
        try:
            return self.rewrite()(*args, **kwargs)
        except Exception as e:
            raise error(repr(e)) from e

    launcher.__call__, function.__call__ = launch_grid, call


def _cache_numpy_dtypes() -> None:
    """Interpreted, every `tl` operation asks Triton for the numpy dtype of its result, and Triton
    builds a table of 17 dtypes to answer each time: about a twentieth of an interpreted engine step.
    Here each element type's answer is kept after Triton first gives it (pointers, which have no hash,
    get Triton's answer for any pointer); the answers are Triton's own. Where the interpreter's
    internals are not the ones this was written against (Triton 3.x), nothing is changed."""
    from triton.runtime import interpreter as module

    interpreter: Any = module
    original = getattr(interpreter, "_get_np_dtype", None)
    if original is None or not all(hasattr(tl, name) for name in ("block_type", "pointer_type", "int8")):
        return
    pointer = original(tl.pointer_type(tl.int8))
    table: dict[Any, Any] = {}

    def numpy_dtype(tt_dtype: Any) -> Any:
        element = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        if isinstance(element, tl.pointer_type):
            return pointer
        found = table.get(element)
        if found is None:
            found = table[element] = original(element)
        return found

    interpreter._get_np_dtype = numpy_dtype


def _plain_shape(shape: Any) -> tuple[int, ...] | None:
    """A block type's shape as Triton takes it (a list or `tl.tuple` of ints or constexprs) as plain
    ints, or None for anything else (Triton's own checks then see it, and refuse what they refuse)."""
    values = shape.values if isinstance(shape, tl.tuple) else shape
    if type(values) is not list:
        return None
    plain = tuple(v.value if type(v) is tl.constexpr else v for v in values)
    return plain if all(type(v) is int for v in plain) else None


def _share_type_objects() -> None:
    """Interpreted, every `tl` operation builds its result's type anew: a block type unwraps and
    validates its shape and formats its name, a tensor wraps each dimension in a constexpr, and a
    binary operation compares its operands' shapes dimension by dimension to broadcast them. That is
    about a third of an interpreted Gated DeltaNet prefill. Here a block type or tensor of a shape seen
    before shares the objects Triton built for it the first time (nothing changes them after
    construction; a shape Triton refuses is never kept, so it is refused every time), and operands of
    one shape pass through the broadcast unchanged, as Triton's broadcast returns them. Where Triton's
    types are not the ones this was written against (Triton 3.x), nothing is changed."""
    from triton.language import semantic as module

    semantic: Any = module
    probe = tl.block_type(tl.float32, [2, 4])
    if not (hasattr(semantic, "TritonSemantic") and isinstance(getattr(probe, "shape", None), tl.tuple)
            and hasattr(probe.shape, "values") and hasattr(probe, "numel") and hasattr(probe, "name")):
        return
    block_init, tensor_init = tl.block_type.__init__, tl.tensor.__init__
    broadcast = semantic.TritonSemantic.broadcast_impl_value
    block_parts: dict[tuple[str, tuple[int, ...]], tuple[Any, Any, Any]] = {}
    tensor_parts: dict[tuple[int, ...], tuple[Any, Any]] = {}

    def shared_block_init(self: Any, element_ty: Any, shape: Any) -> None:
        plain = _plain_shape(shape)
        key = None if plain is None else (str(element_ty), plain)  # the name is formatted from str(element_ty)
        parts = block_parts.get(key) if key is not None else None
        if parts is None:
            block_init(self, element_ty, shape)
            if key is not None:
                block_parts[key] = (self.shape, self.numel, self.name)
            return
        self.element_ty = element_ty
        self.shape, self.numel, self.name = parts

    def shared_tensor_init(self: Any, handle: Any, type: Any) -> None:
        plain = tuple(type.shape.values) if type.is_block() else ()
        parts = tensor_parts.get(plain)
        if parts is None:
            tensor_init(self, handle, type)
            tensor_parts[plain] = (self.shape, self.numel)
            return
        self.handle, self.type, self.dtype = handle, type, type.scalar
        self.shape, self.numel = parts

    def broadcast_values(self: Any, lhs: Any, rhs: Any) -> Any:
        left, right = lhs.type, rhs.type
        if left.is_block() and right.is_block() and left.shape.values == right.shape.values:
            return lhs, rhs
        return broadcast(self, lhs, rhs)

    shared: Any
    for shared, own in ((shared_block_init, block_init), (shared_tensor_init, tensor_init),
                        (broadcast_values, broadcast)):
        shared.__wrapped__ = own  # Triton's own, for inspect.unwrap
    tl.block_type.__init__, tl.tensor.__init__ = shared_block_init, shared_tensor_init
    semantic.TritonSemantic.broadcast_impl_value = broadcast_values


if INTERPRETED and HAS_TRITON:
    _patch_language_once_per_launch()
    _cache_numpy_dtypes()
    _share_type_objects()


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
