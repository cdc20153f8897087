"""Fuzzing the edge: schemathesis generates requests from a real mesh's own /openapi.json.

Valid requests (by the schema) and invalid ones go to the running mesh; every answer must not be a
5xx, must use a documented status and content type and match the documented response schema, and
an invalid request must be refused.  Generation is bounded (examples, and max_tokens clamped to a
few tokens) so the run stays around a minute on two CPUs.  A 503 with Retry-After is the mesh
shedding load (documented in docs/operations.md): the fuzz retries it after the wait, as the openai
package does, and fails on a 5xx that persists.
"""

from __future__ import annotations

import json
import time
import urllib.request
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from tests.e2e.conftest import Mesh

pytestmark = pytest.mark.e2e

MAX_TOKENS = 4          # per generated request: the model must not generate for ages on CPUs
# The routes that generate, and their length fields (the first is set when none is given).
GENERATING = {"/v1/chat/completions": ("max_tokens", "max_completion_tokens"), "/v1/completions": ("max_tokens",),
              "/v1/responses": ("max_output_tokens",)}
EXAMPLES = 100          # per generation mode, spread over the operations (about a minute in all)
RETRIES = 3             # of a 503 with Retry-After (load shed): a neighbour's load may slow grammar compiles
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          negative_data_rejection]


@pytest.fixture(scope="module")
def api(mesh: Mesh) -> Any:
    with urllib.request.urlopen(f"{mesh.http}/openapi.json", timeout=10) as reply:
        document = json.loads(reply.read())
    return schemathesis.openapi.from_dict(document)


@pytest.fixture(scope="module")
def served(mesh: Mesh) -> list[str]:
    with urllib.request.urlopen(f"{mesh.http}/v1/models", timeout=10) as reply:
        return [m["id"] for m in json.loads(reply.read())["data"]]


def clamp_max_tokens(case: Any) -> None:
    """Keep generation short without changing whether the request is valid: on a route that generates, a
    missing length field is set, and a valid one above MAX_TOKENS is lowered; an invalid value is left for the
    server to refuse."""
    body, names = case.body, GENERATING.get(case.path)
    if not isinstance(body, dict) or names is None:
        return
    if all(body.get(name) is None for name in names):
        body[names[0]] = MAX_TOKENS
    for name in names:
        value = body.get(name)
        if isinstance(value, int | float) and not isinstance(value, bool) and MAX_TOKENS < value <= 1 << 20:
            body[name] = MAX_TOKENS


def steer(case: Any, model: str | None, stream: bool) -> None:
    """Valid requests only: random model names all end in 404 and `stream` is rarely drawn, so
    sometimes name a served model and ask for a stream (both keep the request valid)."""
    body = case.body
    if not isinstance(body, dict):
        return
    if model is not None:
        body["model"] = model
    if stream:
        body["stream"] = True


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=["valid", "invalid"])
def test_fuzz_the_openapi_document(api: Any, served: list[str], mesh: Mesh, mode: GenerationMode) -> None:
    @given(case=api.as_strategy(generation_mode=mode), model=st.sampled_from([None, *served]),
           stream=st.booleans())
    @settings(max_examples=EXAMPLES, deadline=None, database=None, phases=[Phase.explicit, Phase.generate],
              suppress_health_check=list(HealthCheck))
    def fuzz(case: Any, model: str | None, stream: bool) -> None:
        if case.operation.method.upper() == "POST":
            clamp_max_tokens(case)
            if mode == GenerationMode.POSITIVE:
                steer(case, model, stream)
        response = case.call(base_url=mesh.http, timeout=120)
        for _ in range(RETRIES):
            wait = response.headers.get("retry-after") or ""
            wait = wait[0] if isinstance(wait, list) else wait      # schemathesis keeps each header's values
            if response.status_code != 503 or not wait.isdigit():
                break
            time.sleep(min(int(wait), 5))
            response = case.call(base_url=mesh.http, timeout=120)
        # An invalid body that is also over the edge's 1 MiB limit is refused by its size first: 413 is a
        # refusal too (schemathesis's list of refusals lacks it); the other checks still apply.
        refused_by_size = mode == GenerationMode.NEGATIVE and response.status_code == 413
        case.validate_response(response, checks=[c for c in CHECKS if not (refused_by_size and
                                                                        c is negative_data_rejection)],
                               transport_kwargs={"base_url": mesh.http, "timeout": 120})

    fuzz()
