"""mesh/models/gguf_header.py against gguf-py's own reader: the same tensors (names, types, shapes, bytes) and
scalar metadata from a file gguf-py's writer made, and precise refusals of what is not a GGUF file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, GGUFWriter

from mesh.models.gguf_header import GgufError, SkippedArray, read_header, tensor_data


def write_file(path: Path) -> None:
    rng = np.random.default_rng(0)
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_rope_freq_base(10000.0)
    writer.add_string("general.name", "tiny ✓")
    writer.add_token_list([f"tok{i}" for i in range(300)])
    writer.add_token_scores([float(i) for i in range(300)])
    writer.add_bool("tokenizer.ggml.add_bos_token", True)
    writer.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((4, 64)).astype(np.float16))
    writer.add_tensor("i32", np.arange(7, dtype=np.int32))
    q8 = rng.integers(0, 255, (6, 2 * 34), dtype=np.uint8)          # 6 rows of two Q8_0 blocks (64 weights)
    writer.add_tensor("q8", q8, raw_dtype=T.Q8_0)
    bf16 = rng.integers(0, 2 ** 16, (2, 32), dtype=np.uint16).view(np.uint8)
    writer.add_tensor("bf16", bf16, raw_dtype=T.BF16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_the_header_and_tensors_equal_gguf_pys_reader(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    write_file(path)
    header, theirs = read_header(path), GGUFReader(str(path))
    assert header.version == 3
    assert header.string("general.architecture") == "llama" and header.string("general.name") == "tiny ✓"
    assert header.metadata["llama.block_count"] == 2 and header.metadata["llama.rope.freq_base"] == 10000.0
    assert header.metadata["tokenizer.ggml.add_bos_token"] is True
    assert header.metadata["tokenizer.ggml.tokens"] == SkippedArray(8, 300)
    assert header.metadata["tokenizer.ggml.scores"] == SkippedArray(6, 300)
    assert [t.name for t in header.tensors] == [t.name for t in theirs.tensors]
    mapped = np.memmap(path, np.uint8, "c")
    for mine, their in zip(header.tensors, theirs.tensors, strict=True):
        assert T(mine.qtype) == their.tensor_type
        assert mine.dims == tuple(their.shape.tolist()) and mine.n_elements == their.n_elements
        assert (mine.offset, mine.nbytes) == (their.data_offset, their.n_bytes)
        data = tensor_data(mapped, mine)
        assert data.dtype == their.data.dtype and data.shape == their.data.shape
        assert np.array_equal(data.view(np.uint8), np.asarray(their.data).view(np.uint8))
    assert tensor_data(mapped, header.tensors[0]).shape == (3, 5)


def test_what_is_not_a_gguf_file_is_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(GgufError, match=r"x\.gguf: not a GGUF file"):
        read_header(path)
    path.write_bytes(b"GGUF" + (9).to_bytes(4, "little"))
    with pytest.raises(GgufError, match="GGUF version 9"):
        read_header(path)
    good = tmp_path / "good.gguf"
    write_file(good)
    path.write_bytes(good.read_bytes()[:200])
    with pytest.raises(GgufError, match="ends early"):
        read_header(path)
    with pytest.raises(GgufError, match="no string 'general.nothing'"):
        read_header(good).string("general.nothing")
