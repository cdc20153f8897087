"""kv_transfer: blocks out of and into a paged KV cache, their bytes, and the bounded outbox."""

from __future__ import annotations

import pytest
import torch

from services.engine.runtime import kv_transfer
from services.engine.runtime.kv_transfer import KVLayout, Outbox


def paged_kv(layers: int = 3, blocks: int = 6, dtype: torch.dtype = torch.float32
             ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    shape = (blocks, 4, 2, 8)                   # (num_blocks, block_size, kv_heads, head_dim)
    return [(torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype))
            for _ in range(layers)]


def test_layout_names_the_block_shape_and_size() -> None:
    lay = kv_transfer.layout(paged_kv())
    assert lay == KVLayout(torch.float32, (3, 2, 4, 2, 8))
    assert (lay.dtype_name, lay.block_size, lay.block_bytes) == ("float32", 4, 3 * 2 * 4 * 2 * 8 * 4)


def test_export_gathers_blocks_layer_by_layer_k_then_v() -> None:
    kv = paged_kv()
    exported = kv_transfer.export_blocks_async(kv, [4, 1])
    assert exported.ready is None                   # on the CPU the copy is complete at once
    out = exported.wait()
    assert out.shape == (2, 3, 2, 4, 2, 8) and out.is_contiguous() and out.device.type == "cpu"
    for layer, (k, v) in enumerate(kv):
        assert torch.equal(out[0, layer, 0], k[4]) and torch.equal(out[1, layer, 1], v[1])


def test_int64_parts_are_views_of_one_upload() -> None:
    ids, empty, slots = kv_transfer.int64_parts(torch.device("cpu"), [5, 6, 7], [], [40, 41])
    assert (ids.tolist(), empty.tolist(), slots.tolist()) == ([5, 6, 7], [], [40, 41])
    assert ids.dtype == torch.int64 and ids.untyped_storage().data_ptr() == slots.untyped_storage().data_ptr()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_survive_bytes_and_import_into_other_block_ids(dtype: torch.dtype) -> None:
    src, dst = paged_kv(dtype=dtype), [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in paged_kv(dtype=dtype)]
    exported = kv_transfer.export_blocks_async(src, [0, 5]).wait()
    lay = kv_transfer.layout(src)
    wire = [kv_transfer.to_bytes(block) for block in exported]
    assert [len(b) for b in wire] == [lay.block_bytes] * 2
    decoded = kv_transfer.from_bytes(wire, lay)
    assert decoded.dtype == dtype and torch.equal(decoded, exported)
    kv_transfer.import_blocks(dst, [(2, decoded[0]), (3, decoded[1])])
    for (k, v), (k2, v2) in zip(src, dst, strict=True):
        assert torch.equal(k2[2], k[0]) and torch.equal(v2[3], v[5])
        assert not k2[[0, 1, 4, 5]].any() and not v2[[0, 1, 4, 5]].any()   # no other block touched
    assert kv_transfer.from_bytes([], lay).shape == (0, *lay.shape)


def test_outbox_is_fifo_and_drops_the_oldest_beyond_its_budget() -> None:
    block = torch.zeros(1, 10, dtype=torch.uint8)      # 10 bytes a block
    box = Outbox(max_bytes=25)
    box.put([b"a"], block)
    box.put([b"b"], block)
    assert (len(box), box.dropped_blocks) == (2, 0)
    box.put([b"c", b"d"], torch.cat([block, block]))     # 40 bytes: a and b go
    assert (len(box), box.dropped_blocks, box.put_blocks) == (1, 2, 4)
    box.put([b"e", b"f", b"g"], torch.cat([block] * 3))  # 50, then 30: over alone, so it goes too
    assert (len(box), box.dropped_blocks) == (0, 7)
    box.put([b"h"], block)
    box.put([b"i"], block)
    box.put([b"j"], block)                                # 30 > 25: h goes
    taken = [box.take(), box.take(), box.take()]
    assert [t.hashes if t else None for t in taken] == [[b"i"], [b"j"], None]
    assert box.dropped_blocks == 8
    with pytest.raises(ValueError):
        Outbox(0)


def test_import_reads_consecutive_fetched_blocks_in_place_and_any_others_too() -> None:
    lay = KVLayout(torch.float32, (3, 2, 4, 2, 8))
    fetched = torch.randn(4, *lay.shape)
    rows = list(fetched)
    assert kv_transfer._stacked(rows[1:3]).data_ptr() == fetched[1].data_ptr()      # a view, no copy
    assert torch.equal(kv_transfer._stacked(rows[1:3]), fetched[1:3])
    shuffled = [rows[2], rows[0]]
    assert torch.equal(kv_transfer._stacked(shuffled), torch.stack(shuffled))       # a copy, still right
    dst = [(torch.zeros(6, 4, 2, 8), torch.zeros(6, 4, 2, 8)) for _ in range(3)]
    kv_transfer.import_blocks(dst, [(5, rows[2]), (1, rows[0])])
    assert torch.equal(dst[2][1][5], fetched[2, 2, 1]) and torch.equal(dst[0][0][1], fetched[0, 0, 0])
