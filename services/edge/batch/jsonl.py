"""A batch input file's lines as JSON (services/edge/batch/files_api.py at upload, batches_api.py at creation,
batch_runner.py when it runs), and the upload's multipart form.

Meant to run off the event loop (asyncio.to_thread): a 32 MiB file is millions of lines, seconds of CPU, and
every other request of the edge would wait for them.  Each line is bounded in JSON nesting (MAX_DEPTH: a
line nested deeper is refused naming it, never a RecursionError), and a file in requests (MAX_LINES, as
OpenAI's batch input: checking stops at the first line past it).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from email import policy
from email.parser import BytesHeaderParser, BytesParser, HeaderParser
from typing import Any

from services.edge.errors import ApiError

MAX_LINES = 50_000
MAX_DEPTH = 128                # a request's JSON nesting: far above any chat body's, well below the parser's limit
BLOCK_CHARS = 1 << 16
_TEXT_ENCODINGS = ("", "7bit", "8bit", "binary")


class LineProblem(ValueError):
    """Why a line is not a JSON value a batch can take."""


def nonblank(text: str) -> Iterator[tuple[int, str]]:
    """(line number from 1, line) of each line that is not blank (lines as str.splitlines cuts them).  Cut a
    block of about BLOCK_CHARS at a time: one splitlines over millions of lines holds the GIL for a second,
    and the event loop's thread with it."""
    number, start = 0, 0
    while start < len(text):
        end = text.find("\n", start + BLOCK_CHARS)
        end = len(text) if end < 0 else end + 1
        for raw in text[start:end].splitlines():
            number += 1
            if raw.strip():
                yield number, raw
        start = end


def load_line(raw: str) -> Any:
    """The line's JSON value; LineProblem when it is not JSON or is nested deeper than MAX_DEPTH."""
    try:
        value = json.loads(raw)
    except RecursionError:
        raise LineProblem(f"it is nested more than {MAX_DEPTH} levels deep") from None
    except ValueError:
        raise LineProblem("it is not JSON") from None
    # Only a line with more brackets than the bound can be nested past it: the rest costs a count, no walk.
    if raw.count("[") + raw.count("{") > MAX_DEPTH and depth(value) > MAX_DEPTH:
        raise LineProblem(f"it is nested more than {MAX_DEPTH} levels deep")
    return value


def depth(value: Any) -> int:
    """How deep lists and objects nest in a parsed JSON value (a scalar: 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, level)
        stack.extend((c, level + 1) for c in children if isinstance(c, dict | list))
    return deepest


def parse_form(content_type: str, raw: bytes) -> dict[str, tuple[str | None, bytes]]:
    """multipart/form-data: field name -> (its filename or None, its bytes).  The parts are found with bytes
    searches (the email package's parser takes seconds over a 32 MiB file); each part's headers are read by
    the email package, and a part in a transfer encoding (base64, quoted-printable) is decoded by it."""
    if not content_type.lower().startswith("multipart/form-data") or "boundary=" not in content_type:
        raise ApiError(400, "send the upload as multipart/form-data with fields 'file' and 'purpose'", "file")
    head = HeaderParser(policy=policy.HTTP).parsestr(f"Content-Type: {content_type}\r\n\r\n")
    boundary = head.get_boundary()
    if not boundary:
        raise ApiError(400, "the multipart body did not parse; send fields 'file' and 'purpose'", "file")
    form: dict[str, tuple[str | None, bytes]] = {}
    for headers, payload in _parts(raw, b"--" + boundary.encode("latin-1", "replace")):
        part = BytesHeaderParser(policy=policy.HTTP).parsebytes(headers)
        name = part.get_param("name", header="content-disposition")
        if str(part.get("content-transfer-encoding", "")).strip().lower() not in _TEXT_ENCODINGS:
            decoded = BytesParser(policy=policy.HTTP).parsebytes(headers + payload).get_payload(decode=True)
            payload = decoded if isinstance(decoded, bytes) else b""
        if isinstance(name, str):
            form[name] = (part.get_filename(), payload)
    if not form:
        raise ApiError(400, "the multipart body did not parse; send fields 'file' and 'purpose'", "file")
    return form


def _parts(raw: bytes, delimiter: bytes) -> Iterator[tuple[bytes, bytes]]:
    """(header block with its blank line, payload) of each part between the delimiter lines (RFC 2046; lines
    may end in CRLF or LF).  A part cut off before the next delimiter, or without a header block, is left out."""
    if raw.startswith(delimiter):
        start = 0
    elif (found := raw.find(b"\n" + delimiter)) >= 0:
        start = found + 1
    else:
        return
    while raw[start + len(delimiter):start + len(delimiter) + 2] != b"--":     # not the closing delimiter
        line_end = raw.find(b"\n", start + len(delimiter))
        end = raw.find(b"\n" + delimiter, line_end + 1) if line_end >= 0 else -1
        if end < 0:
            return
        part = raw[line_end + 1:end - 1] if raw[end - 1:end] == b"\r" else raw[line_end + 1:end]
        crlf, lf = part.find(b"\r\n\r\n"), part.find(b"\n\n")
        if lf >= 0 and (crlf < 0 or lf < crlf):
            yield part[:lf + 2], part[lf + 2:]
        elif crlf >= 0:
            yield part[:crlf + 4], part[crlf + 4:]
        start = end + 1
