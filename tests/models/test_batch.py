"""ForwardBatch.build: the flattening every forward relies on, checked field by field on a mixed
batch written out by hand (lengths 3, 1, 2 after 0, 5 and 64 cached tokens, slots out of order)."""

from __future__ import annotations

import torch

from pocketllm.models import ForwardBatch


def test_build_flattens_sequences_in_order():
    batch = ForwardBatch.build([2, 0, 5], [0, 5, 64], [[11, 12, 13], [21], [31, 32]], False, "cpu")
    expected = {
        "input_ids": [11, 12, 13, 21, 31, 32],
        "positions": [0, 1, 2, 5, 64, 65],
        "token_slots": [2, 2, 2, 0, 5, 5],
        "slot_ids": [2, 0, 5],
        "start_positions": [0, 5, 64],
        "cu_seqlens": [0, 3, 4, 6],
        "logit_rows": [2, 3, 5],
    }
    for name, values in expected.items():
        tensor = getattr(batch, name)
        assert tensor.dtype == torch.int64 and tensor.device.type == "cpu", name
        assert tensor.tolist() == values, name
    assert batch.is_decode is False


def test_build_decode_rows():
    """Decode: one token per sequence at its start position; the flag is kept."""
    batch = ForwardBatch.build([1, 3], [7, 40], [[5], [6]], True, torch.device("cpu"))
    assert batch.is_decode is True
    assert batch.positions.tolist() == [7, 40] and batch.token_slots.tolist() == [1, 3]
    assert batch.cu_seqlens.tolist() == [0, 1, 2] and batch.logit_rows.tolist() == [0, 1]


def test_build_on_another_device_and_empty():
    """Every tensor is made on the requested device (meta stands in for a GPU), and index tensors
    stay int64 even for an empty batch."""
    batch = ForwardBatch.build([0], [3], [[4, 5]], False, "meta")
    for name in ("input_ids", "positions", "token_slots", "slot_ids", "start_positions", "cu_seqlens",
                 "logit_rows"):
        assert getattr(batch, name).device.type == "meta", name
    empty = ForwardBatch.build([], [], [], True, "cpu")
    assert all(getattr(empty, name).dtype == torch.int64 for name in ("input_ids", "positions", "slot_ids"))
    assert empty.cu_seqlens.tolist() == [0] and empty.input_ids.numel() == 0
