"""The start-up probe: an engine on the torch backend checks, on its own weights, that its
row-wise ops are batch invariant on this machine, and says so loudly when they are not."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import pocketllm.llm
from pocketllm import LLM, EngineArgs
from pocketllm.kernels import torch_ops
from pocketllm.kernels.gated_delta_prefill import gated_delta_prefill_recurrent
from pocketllm.kernels.linear import linear_fixed_order, linear_ref, linear_row_invariant
from pocketllm.kernels.prefill_linear import prefill_linear_row_invariant
from pocketllm.kernels.probe import PROBE_PREFILL_ROWS, PROBE_ROWS, ROLL, GatedDeltaProbe, probe_row_invariance


@pytest.mark.parametrize("exact,linear,prefill_linear", [
    (None, linear_fixed_order, linear_fixed_order),  # the default: the C++ kernel
    (False, linear_row_invariant, prefill_linear_row_invariant),  # the MKL tiles
])
@pytest.mark.parametrize("variant", ["untied_gqa4_bias", "qwen3.5_mm_untied"])
def test_engine_probes_every_weight_shape_and_reports_invariant(checkpoint_dir, variant, exact, linear,
                                                                 prefill_linear):
    llm = LLM(EngineArgs(model=str(checkpoint_dir(variant)), max_seq_len=64,
                         backend_options={"exact_positions": exact}))
    report = llm.invariance_report
    assert llm.model.ops.linear is linear, "the probe must test the linears the engine runs"
    assert llm.model.ops.prefill_linear is prefill_linear
    *body, lm_head = llm.model.linear_weights()
    assert {f"linear {k}->{n}" for n, k in {tuple(w.shape) for w in [*body, lm_head]}} <= set(report.checks)
    assert {f"prefill_linear {k}->{n}" for n, k in {tuple(w.shape) for w in body}} <= set(report.checks)
    assert report.ok, report.summary()
    assert llm.capabilities.batch_invariant is True
    assert report.threads == torch.get_num_threads()


def _ops_with(**changes):
    return dataclasses.replace(torch_ops(), **changes)


def _probe(ops, weights, hidden=48, vocab=300):
    return probe_row_invariance(ops.linear, ops.prefill_linear, ops.rms_norm, ops.silu_and_mul, ops.sample,
                                weights, torch.randn(vocab, hidden), hidden, vocab, torch.float32)


def _count_dependent(op):
    """Wraps a row-wise op so that its result depends on the row count (as a BLAS kernel switch
    would): rows of a one-row call are computed in float64."""
    def wrapped(x, *args):
        if x.shape[0] == 1:
            return op(x.double(), *(a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                                    for a in args)).to(x.dtype)
        return op(x, *args)
    return wrapped


def _position_dependent_norm(x, weight, eps):
    """An RMSNorm whose last row takes another code path (a remainder loop, say)."""
    out = torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)
    out[-1] = (x[-1].double() * torch.rsqrt(x[-1].double().pow(2).mean() + eps) * weight.double()).to(x.dtype)
    return out


@pytest.mark.parametrize("field", ["linear", "prefill_linear"])
def test_probe_finds_a_row_count_dependent_linear(field):
    weights = [torch.randn(300, 48), torch.randn(48, 96)]
    assert _probe(torch_ops(), weights).ok
    report = _probe(_ops_with(**{field: _count_dependent(F.linear)}), weights)
    assert not report.ok
    assert any(f.startswith(f"{field} 48->300") for f in report.failures), report.failures


def test_probe_with_exact_positions_finds_prefill_rows_that_differ_from_decode_rows():
    """With exact positions the probe compares a row prefilled with the same row decoded: a
    prefill_linear that rounds its rows one ulp apart (row invariant itself) fails that check only."""
    weights = [torch.randn(300, 48), torch.randn(48, 96)]
    exact = torch_ops(exact_positions=True)

    def probe(ops):
        return probe_row_invariance(ops.linear, ops.prefill_linear, ops.rms_norm, ops.silu_and_mul, ops.sample,
                                    weights, torch.randn(300, 48), 48, 300, torch.float32, exact_positions=True)

    assert probe(exact).ok
    report = probe(dataclasses.replace(exact, prefill_linear=lambda x, w, b=None: torch.nextafter(
        linear_row_invariant(x, w, b), torch.tensor(float("inf")))))
    assert report.failures and all("prefill rows differ from the same rows decoded" in f for f in report.failures)


@pytest.mark.parametrize("overrides", [None, {"gated_delta_prefill": "ref", "gated_delta_decode": "ref"}],
                         ids=["recurrent", "replay"])
def test_probe_cuts_the_gated_delta_rule_on_a_hybrid(checkpoint_dir, overrides):
    llm = LLM(EngineArgs(model=str(checkpoint_dir("qwen3.5")), max_seq_len=64, op_overrides=overrides,
                         backend_options={"exact_positions": True}))
    assert "gated_delta_prefill cuts" in llm.invariance_report.checks
    assert llm.invariance_report.ok, llm.invariance_report.summary()


def _first_row_nudged(op):
    """The op with the first row of every piece scaled by 1 + 2^-20 (tests/planted.py): a cut
    changes a position's bits."""
    def nudged(q, k, v, g, beta, states, slot_ids, start_positions, cu_seqlens, replay=None):
        out = op(q, k, v, g, beta, states, slot_ids, start_positions, cu_seqlens, replay)
        out[cu_seqlens[:-1]] = out[cu_seqlens[:-1]] * (1.0 + 2.0**-20)
        return out
    return nudged


def test_probe_finds_a_cut_dependent_gated_delta_rule():
    exact = torch_ops(exact_positions=True)
    weights = [torch.randn(300, 48), torch.randn(48, 96)]

    def probe(op):
        return probe_row_invariance(exact.linear, exact.prefill_linear, exact.rms_norm, exact.silu_and_mul,
                                    exact.sample, weights, torch.randn(300, 48), 48, 300, torch.float32,
                                    exact_positions=True,
                                    gated_delta=GatedDeltaProbe(op, 1, 2, 16, 8, replay=False))

    assert exact.gated_delta_prefill is gated_delta_prefill_recurrent
    assert probe(exact.gated_delta_prefill).ok
    report = probe(_first_row_nudged(exact.gated_delta_prefill))
    assert report.failures == ("gated_delta_prefill: a sequence cut into pieces differs from the same sequence "
                               "in one piece",)


def test_probe_finds_a_position_dependent_norm():
    report = _probe(_ops_with(rms_norm=_position_dependent_norm), [torch.randn(300, 48)])
    assert not report.ok and any(f.startswith("rms_norm") for f in report.failures), report.failures


def test_probe_finds_a_batch_dependent_sampler():
    sample = torch_ops().sample

    def batch_dependent(logits, *rest):
        """Logprobs from a log-softmax whose reduction order changes with the batch: modelled by
        a relative perturbation of one part in 10^6 in batches of more than one row."""
        tokens, logprobs = sample(logits, *rest)
        return tokens, logprobs * (1 + 1e-6 * (logits.shape[0] > 1))

    report = _probe(_ops_with(sample=batch_dependent), [torch.randn(300, 48)])
    assert not report.ok and any(f.startswith("sample") for f in report.failures), report.failures


def test_probe_verdict_on_one_gemm_per_batch_matches_this_blas():
    """The plain reference linear (one BLAS call per batch) is what the tiles replace; whether it is
    row invariant is the host BLAS's choice, so the test computes the truth on this machine (a row
    alone and the batch rolled, at the probe's row counts) and the probe's verdict must match it —
    on a CPU whose BLAS switches kernels here the probe must fail, on one that does not it must pass."""
    weight = torch.randn(512, 256)

    def keeps_rows(rows: int) -> bool:
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
        full = linear_ref(x, weight)
        return (torch.equal(linear_ref(x[:1], weight), full[:1])
                and torch.equal(linear_ref(x.roll(ROLL, 0), weight), full.roll(ROLL, 0)))

    truth = keeps_rows(PROBE_ROWS) and keeps_rows(PROBE_PREFILL_ROWS)
    report = _probe(_ops_with(linear=linear_ref, prefill_linear=linear_ref), [weight], hidden=256)
    linear_failures = [f for f in report.failures if "linear" in f]
    assert (not linear_failures) == truth, report.summary()


def test_failed_probe_warns_and_clears_the_capability(tiny_checkpoint, monkeypatch):
    real = pocketllm.llm.probe_row_invariance

    def failing(*args, **kwargs):
        return dataclasses.replace(real(*args, **kwargs), ok=False, failures=("linear 64->256: injected",))

    monkeypatch.setattr(pocketllm.llm, "probe_row_invariance", failing)
    with pytest.warns(RuntimeWarning, match="may depend on the batch.*injected"):
        llm = LLM(EngineArgs(model=str(tiny_checkpoint), max_seq_len=64))
    assert llm.capabilities.batch_invariant is False


@pytest.mark.parametrize("options,backend,expected", [
    ({"batch_invariant": False}, "torch", False),
    ({"invariance_probe": False}, "torch", True),
    ({}, "triton", True),
])
def test_capability_without_probe(tiny_checkpoint, options, backend, expected):
    """No probe runs when invariance is switched off, when the user opts out, or on the triton
    backend (its kernels use fixed tiles and never ask a BLAS)."""
    llm = LLM(EngineArgs(model=str(tiny_checkpoint), backend=backend, max_seq_len=64, backend_options=options))
    assert llm.invariance_report is None
    assert llm.capabilities.batch_invariant is expected


def test_probe_finds_a_misaligned_weight_where_the_kernel_cares():
    """Under the MKL tiles weights are the engine's own 64-byte-aligned copies; a matrix sitting at
    another offset (as a tensor read in place from a file can) is reported. The C++ kernels load
    unaligned throughout, so the same matrix passes there (the tree's shards are views of a matrix)."""
    storage = torch.randn(300 * 48 + 1)
    misaligned = storage[1:].view(300, 48)
    assert misaligned.data_ptr() % 64
    report = _probe(_ops_with(linear=linear_row_invariant, prefill_linear=prefill_linear_row_invariant), [misaligned])
    assert not report.ok and any("64-byte boundary" in f for f in report.failures), report.failures
    report = _probe(_ops_with(linear=linear_fixed_order, prefill_linear=linear_fixed_order), [misaligned])
    assert report.ok, report.failures


@pytest.mark.parametrize("exact", [None, False], ids=["cpp", "mkl_tiles"])
def test_loaded_weights_are_aligned(checkpoint_dir, exact):
    """Every matrix the loader keeps starts on a 64-byte boundary. Under the MKL tiles so does every
    matrix multiplied, the tree's shards included (copies there); the C++ kernels, which load
    unaligned, multiply the shards as views of their matrix."""
    llm = LLM(EngineArgs(model=str(checkpoint_dir("qwen3.5_mm_untied")), max_seq_len=32,
                         backend_options={"exact_positions": exact, "tree_reduction": True}))
    weights = llm.model.linear_weights()
    assert all(w.untyped_storage().data_ptr() % 64 == 0 for w in weights)
    views = [w for w in weights if w.data_ptr() != w.untyped_storage().data_ptr()]
    assert (views == []) == (exact is False)
    if exact is False:
        assert all(w.data_ptr() % 64 == 0 for w in weights)
