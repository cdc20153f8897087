"""services/edge/batch/jsonl.py: lines cut as str.splitlines cuts them (in blocks), JSON nesting bounded without
recursion, and the multipart form split with byte searches as the email package reads it."""

from __future__ import annotations

import json
from email import policy
from email.parser import BytesParser

import httpx
import pytest

from services.edge.batch import jsonl as batch_jsonl
from services.edge.batch.jsonl import MAX_DEPTH, LineProblem, depth, load_line, nonblank, parse_form
from services.edge.errors import ApiError


def test_lines_are_cut_as_splitlines_cuts_them_across_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(batch_jsonl, "BLOCK_CHARS", 7)
    text = "a\r\nbb\n\n  \ncccccccccccc\rd\u2028e\n\nf"
    expected = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    assert list(nonblank(text)) == expected and expected[-1] == (9, "f")
    assert list(nonblank("")) == [] and list(nonblank("x\n")) == [(1, "x")]


@pytest.mark.parametrize("levels", [MAX_DEPTH + 1, 900, 5_000])
def test_a_line_nested_past_the_bound_is_a_problem_not_a_recursion_error(levels: int) -> None:
    with pytest.raises(LineProblem, match=f"more than {MAX_DEPTH} levels"):
        load_line('{"a": ' + "[" * (levels - 1) + "]" * (levels - 1) + "}")


def test_depth_and_what_passes() -> None:
    assert depth(1) == 0 and depth([]) == 1 and depth({"a": [{"b": []}], "c": 1}) == 4
    line = json.dumps({"a": [[1]] * 500, "s": "[" * 10_000})      # many brackets, shallow: passes
    assert load_line(line)["s"] == "[" * 10_000
    assert load_line("[" * MAX_DEPTH + "]" * MAX_DEPTH) is not None
    with pytest.raises(LineProblem, match="not JSON"):
        load_line("{nope")


def _form(files: dict[str, tuple[str, bytes]], data: dict[str, str]) -> tuple[str, bytes]:
    request = httpx.Request("POST", "http://edge/v1/files", files=files, data=data)
    return request.headers["content-type"], request.read()


def _email_form(content_type: str, raw: bytes) -> dict[str, tuple[str | None, bytes]]:
    """What the edge read before: the email package's whole-message parser."""
    message = BytesParser(policy=policy.HTTP).parsebytes(b"Content-Type: " + content_type.encode() + b"\r\n\r\n" + raw)
    out: dict[str, tuple[str | None, bytes]] = {}
    for part in message.iter_parts():
        name, payload = part.get_param("name", header="content-disposition"), part.get_payload(decode=True)
        if isinstance(name, str) and isinstance(payload, bytes):
            out[name] = (part.get_filename(), payload)
    return out


@pytest.mark.parametrize("file", [
    ("in.jsonl", b'{"a": 1}\n{"b": 2}\n'), ("empty.jsonl", b""), ("\u00fcn\u00efcode.jsonl", b"x\r\n"),
    ("odd\"name.jsonl", b"\r\n--not-the-boundary\r\n\n\nx"),
])
def test_the_form_reads_as_the_email_package_read_it(file: tuple[str, bytes]) -> None:
    content_type, raw = _form({"file": file}, {"purpose": "batch"})
    assert parse_form(content_type, raw) == _email_form(content_type, raw)
    assert parse_form(content_type, raw)["file"][1] == file[1]


def test_lf_lines_a_preamble_and_a_transfer_encoding() -> None:
    raw = (b"preamble\n--B\nContent-Disposition: form-data; name=\"purpose\"\n\nbatch\n--B\n"
           b"Content-Disposition: form-data; name=\"file\"; filename=\"f\"\nContent-Transfer-Encoding: base64\n\n"
           b"eyJhIjoxfQo=\n--B--\n")
    assert parse_form("multipart/form-data; boundary=B", raw) == {"purpose": (None, b"batch"),
                                                                 "file": ("f", b'{"a":1}\n')}
    for content_type, body in (("application/json", b"{}"), ("multipart/form-data; boundary=B", b"no parts")):
        with pytest.raises(ApiError, match="multipart"):
            parse_form(content_type, body)
