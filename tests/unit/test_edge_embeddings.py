"""POST /v1/embeddings bodies (services/edge/surfaces/embeddings.py) and the vectors' shaping; the model's pooling mode
(mesh/models/folder.py)."""

from __future__ import annotations

import base64
import json
import math
import struct
from pathlib import Path
from typing import Any

import pytest

from mesh.models.folder import pooling_mode
from services.edge.errors import ApiError
from services.edge.surfaces.embeddings import MAX_INPUTS, encoded, parse_embeddings, shaped


def test_every_input_shape_openai_takes() -> None:
    assert parse_embeddings({"model": "m", "input": "hello"}).inputs == ("hello",)
    assert parse_embeddings({"model": "m", "input": ["a", "b"]}).inputs == ("a", "b")
    assert parse_embeddings({"model": "m", "input": [1, 2, 3]}).inputs == ((1, 2, 3),)
    assert parse_embeddings({"model": "m", "input": [[1, 2], [3]]}).inputs == ((1, 2), (3,))
    request = parse_embeddings({"model": "m", "input": "x", "encoding_format": "base64", "dimensions": 8,
                                "user": "u"})
    assert request.base64 and request.dimensions == 8
    assert not parse_embeddings({"model": "m", "input": "x", "encoding_format": "float"}).base64


@pytest.mark.parametrize("body, param", [
    ({"input": "x"}, "model"),
    ({"model": "m"}, "input"),
    ({"model": "m", "input": ""}, "input[0]"),
    ({"model": "m", "input": []}, "input"),
    ({"model": "m", "input": [[]]}, "input[0]"),
    ({"model": "m", "input": ["a", 3]}, "input[1]"),
    ({"model": "m", "input": [[1, -2]]}, "input[0]"),
    ({"model": "m", "input": [[1, True]]}, "input[0]"),
    ({"model": "m", "input": {"text": "x"}}, "input"),
    ({"model": "m", "input": ["a"] * (MAX_INPUTS + 1)}, "input"),
    ({"model": "m", "input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"model": "m", "input": "x", "dimensions": 0}, "dimensions"),
    ({"model": "m", "input": "x", "pooling": "cls"}, "pooling"),
])
def test_refused_naming_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as err:
        parse_embeddings(body)
    assert err.value.status == 400 and err.value.param == param, err.value.message


def test_vectors_are_truncated_then_scaled_to_length_one() -> None:
    assert shaped([3.0, 4.0], None) == [0.6, 0.8]
    assert shaped([3.0, 4.0, 12.0], 2) == [0.6, 0.8]
    assert shaped([0.0, 0.0], None) == [0.0, 0.0]
    with pytest.raises(ApiError, match="'dimensions' 3 is more than the model's 2"):
        shaped([1.0, 1.0], 3)
    raw = base64.b64decode(encoded([0.6, 0.8], True))
    assert [round(v, 6) for v in struct.unpack("<2f", raw)] == [0.6, 0.8]
    assert encoded([0.6, 0.8], False) == [0.6, 0.8]
    assert math.isclose(math.hypot(*shaped([1.0, 2.0, 2.0], None)), 1.0)


def test_the_models_own_pooling_config_else_the_mean(tmp_path: Path) -> None:
    assert pooling_mode(tmp_path) == "mean"
    (tmp_path / "1_Pooling").mkdir()
    config = tmp_path / "1_Pooling" / "config.json"
    for key, mode in (("pooling_mode_cls_token", "cls"), ("pooling_mode_lasttoken", "last"),
                      ("pooling_mode_mean_tokens", "mean")):
        config.write_text(json.dumps({"word_embedding_dimension": 8, key: True}))
        assert pooling_mode(tmp_path) == mode
    config.write_text("not json")
    assert pooling_mode(tmp_path) == "mean"
