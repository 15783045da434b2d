"""Interpreted, a launch patches Triton's language once per module of the functions its kernel
calls (pocketllm.kernels._triton), not at every call, each element type's numpy dtype is looked up
once, and block types and tensors of a shape seen before share Triton's objects for it: the kernels'
results are unchanged."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch
from kernel_cases import gdn_inputs, gdn_states

from pocketllm.kernels._triton import HAS_TRITON, INTERPRETED, tl, triton

pytestmark = pytest.mark.skipif(not (HAS_TRITON and INTERPRETED), reason="the Triton interpreter's patching only")


@triton.jit
def _halve(x):
    return x * 0.5


@triton.jit
def _sums_kernel(x_ptr, out_ptr, ROWS: tl.constexpr, COLS: tl.constexpr):
    """out[r] = sum(x[r]) / 2, one `tl.sum` (a jit function of triton.language.standard) and one
    `_halve` (this module's) per row."""
    cols = tl.arange(0, COLS)
    for r in range(ROWS):
        tl.store(out_ptr + r, _halve(tl.sum(tl.load(x_ptr + r * COLS + cols), axis=0)))


def test_a_launch_patches_the_language_once_per_module(monkeypatch):
    from triton.runtime import interpreter

    patched = []
    original = interpreter._patch_lang
    monkeypatch.setattr(interpreter, "_patch_lang", lambda fn: patched.append(fn.__module__) or original(fn))
    x = torch.arange(6 * 8, dtype=torch.float32).reshape(6, 8)
    out = torch.empty(6)
    for _ in range(2):  # each launch patches afresh
        _sums_kernel[(1,)](x, out, ROWS=6, COLS=8)
    assert torch.equal(out, x.sum(dim=1) / 2)
    # Per launch: the kernel's module, then once each the modules of tl.sum and _halve (this one:
    # patched by the launch already, its globals are the kernel's), not 6 + 6 more times.
    assert patched == [__name__, "triton.language.standard", __name__] * 2


# How the interpreter stores each element type in numpy: bf16 as its 16 bits, fp8 as its 8, pointers as
# 64-bit addresses (Triton's documented table, written out here independently of the cache).
STORED_AS = {"int1": np.bool_, "int8": np.int8, "uint8": np.uint8, "int16": np.int16, "uint16": np.uint16,
             "int32": np.int32, "uint32": np.uint32, "int64": np.int64, "uint64": np.uint64,
             "float16": np.float16, "float32": np.float32, "float64": np.float64, "bfloat16": np.uint16,
             "float8e5": np.uint8, "float8e4nv": np.uint8, "float8e4b15": np.uint8}


def test_the_cached_numpy_dtypes_are_the_interpreters():
    from triton.runtime import interpreter

    assert interpreter._get_np_dtype.__module__ == "pocketllm.kernels._triton"  # the cache is installed
    for _ in range(2):  # the first answer is Triton's; the second comes from the cache
        for name, stored in STORED_AS.items():
            element = getattr(tl, name)
            assert interpreter._get_np_dtype(element) == np.dtype(stored), name
            assert interpreter._get_np_dtype(tl.block_type(element, [2, 4])) == np.dtype(stored), name
            for pointer in (tl.pointer_type(element), tl.block_type(tl.pointer_type(element), [8])):
                assert interpreter._get_np_dtype(pointer) == np.dtype(np.uint64), name


@triton.jit
def _widen_kernel(x_ptr, out_ptr, N: tl.constexpr):
    offsets = tl.arange(0, N)
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets).to(tl.float32) * 2.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.int16, torch.int64])
def test_kernels_still_load_every_element_type(dtype):
    """Each element type through the cached table: loaded, widened to fp32, doubled, stored."""
    x = torch.arange(-8, 8).to(dtype)
    out = torch.empty(16)
    _widen_kernel[(1,)](x, out, N=16)
    assert torch.equal(out, x.float() * 2)


def _triton_own(monkeypatch) -> None:
    """Triton's own type constructors and broadcast in place of the shared ones, for this test."""
    from triton.language import semantic

    for owner in (tl.block_type, tl.tensor):
        monkeypatch.setattr(owner, "__init__", inspect.unwrap(owner.__init__))
    broadcast = semantic.TritonSemantic.broadcast_impl_value
    monkeypatch.setattr(semantic.TritonSemantic, "broadcast_impl_value", inspect.unwrap(broadcast))


@pytest.mark.parametrize("shape", [[2, 4], [8], [tl.constexpr(4), 16], tl.tuple([2, 8])])
def test_a_shared_block_type_is_the_one_triton_builds(shape):
    assert tl.block_type.__init__.__module__ == "pocketllm.kernels._triton"  # the sharing is installed
    shared = [tl.block_type(tl.float32, shape) for _ in range(2)]  # the second from what the first kept
    own = object.__new__(tl.block_type)
    inspect.unwrap(tl.block_type.__init__)(own, tl.float32, shape)
    for block in shared:
        assert (block.element_ty, list(block.shape), block.numel, block.name) == \
            (own.element_ty, list(own.shape), own.numel, own.name)
        assert block == own
    other = tl.block_type(tl.int32, shape)  # same shape, another element type: its own name
    assert other.element_ty == tl.int32 and other.name != shared[0].name and other != own


def _outcome(init, shape) -> str:
    try:
        init(object.__new__(tl.block_type), tl.float32, shape)
    except Exception as error:  # noqa: BLE001 - the outcome compared is the error's type
        return type(error).__name__
    return "built"


def test_what_triton_refuses_is_refused_every_time():
    """Shapes Triton refuses (not a power of 2, no dimension, given as another kind of sequence),
    each also after the same dimensions were built as a list: the same outcome as Triton's own."""
    own = inspect.unwrap(tl.block_type.__init__)
    shapes = [[4, 8], [3, 4], [], (4, 8), [4.0, 8], [tl.constexpr(3)]]
    expected = [_outcome(own, shape) for shape in shapes]
    assert expected[0] == "built" and expected[1:3] == ["ValueError", "TypeError"]
    for _ in range(2):
        assert [_outcome(tl.block_type.__init__, shape) for shape in shapes] == expected


def test_a_gated_delta_prefill_has_the_bits_of_tritons_own_types(monkeypatch):
    """A kernel of many shapes, broadcasts and element types (the chunked Gated DeltaNet prefill, two
    sequences, one of them past a chunk): the same bits with the shared objects and with Triton's own."""
    from pocketllm.kernels.gated_delta_prefill import gated_delta_prefill_triton

    inputs = gdn_inputs(70, 1, 2, 16, 8, torch.float32, seed=3, device="cpu")
    slots, starts, cu = (torch.tensor(values) for values in ([0, 1], [0, 5], [0, 66, 70]))

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        states = gdn_states(2, 2, 16, 8, seed=4, device="cpu")
        return gated_delta_prefill_triton(*inputs, states, slots, starts, cu), states

    shared = run()
    _triton_own(monkeypatch)
    own = run()
    assert all(torch.equal(a, b) for a, b in zip(shared, own))
