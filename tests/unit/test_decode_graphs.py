"""Decode-graph bookkeeping: the batch-size buckets, the bucket a batch lands in, and the static
buffers' padding.  (Which graph mode runs is the ExecutionPlan's: tests/unit/test_plan.py.)"""

from __future__ import annotations

import pytest
import torch

from services.engine.runtime import decode_graphs
from services.engine.runtime.decode_graphs import DecodeGraphs


@pytest.mark.parametrize("max_batch,expected", [
    (1, [1]),
    (2, [1, 2]),
    (3, [1, 2, 3]),
    (8, [1, 2, 4, 8]),
    (50, [1, 2, 4, 8, 16, 24, 32, 40, 48, 50]),
    (64, [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]),
])
def test_buckets_end_at_max_batch(max_batch: int, expected: list[int]) -> None:
    assert decode_graphs.buckets(max_batch) == expected


def test_buckets_beyond_the_table_end_with_max_batch() -> None:
    sizes = decode_graphs.buckets(300)
    assert sizes[-2:] == [256, 300] and sizes == sorted(set(sizes))


class _NoModel:
    """DecodeGraphs only touches the model in _forward; capture=False never calls it here."""

    needs_decode_mask = False


def graphs(max_batch: int) -> DecodeGraphs:
    kv = [(torch.zeros(5, 4, 1, 8), torch.zeros(5, 4, 1, 8))]
    return DecodeGraphs(_NoModel(), kv, block_size=4, max_context=32, scratch_block=4, max_batch=max_batch,
                        device=torch.device("cpu"), capture=False)


def test_bucket_is_the_smallest_that_holds_the_batch() -> None:
    g = graphs(50)
    assert g.max_batch == 50 and g.width == 8
    assert [g.bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17, 24, 25, 48, 49, 50)] == \
        [1, 2, 4, 4, 8, 8, 16, 16, 24, 24, 32, 48, 50, 50]
    with pytest.raises(ValueError, match="over the largest bucket"):
        g.bucket(51)


def test_static_buffers_start_as_padding() -> None:
    """Before any step every row is a padding row: scratch block, length 1, slot 0 of scratch."""
    g = graphs(8)
    assert g.tables.shape == (8, 8) and bool((g.tables == 4).all())
    assert g.lens.tolist() == [1] * 8 and g.slots.tolist() == [16] * 8 and g.rows.tolist() == list(range(8))
    assert g.replays == 0 and not g.graphs


def test_max_batch_must_be_positive() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        graphs(0)
