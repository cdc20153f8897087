"""End to end: two versions of a model side by side, pinned and canary routing, the admin API."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.e2e.conftest import OFFSET, Mesh, json_call, running_mesh

pytestmark = pytest.mark.e2e

ADMIN_KEY = "admin-test-key"


@pytest.fixture(scope="module")
def versions_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    log = tmp_path_factory.mktemp("versions") / "infermesh-up.log"
    args = ["--engines", "2", "--version", "1", "--version", "2", "--kv-cache-mb", "64"]
    with running_mesh(args, OFFSET + 100, log, env={"INFERMESH_ADMIN_KEYS": ADMIN_KEY}) as m:
        yield m


def call(mesh: Mesh, method: str, path: str, body: dict[str, Any] | None = None, key: str = ADMIN_KEY
         ) -> tuple[int, dict[str, Any]]:
    return json_call(mesh, method, path, body, key)


def served(client: openai.OpenAI, model: str = "smollm2-135m", **extra: Any) -> str:
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=2, temperature=0, **extra)
    return str(reply.model_extra["infermesh"]["model_version"])  # type: ignore[index]


@pytest.fixture(scope="module")
def client(versions_mesh: Mesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{versions_mesh.http}/v1", api_key="unused", max_retries=0, timeout=300)


def test_models_list_both_versions_and_the_first_is_default(versions_mesh: Mesh, client: openai.OpenAI) -> None:
    status, body = call(versions_mesh, "GET", "/v1/models")
    assert status == 200
    (card,) = body["data"]
    assert card["versions"] == ["1", "2"] and card["version"] == "1"
    assert {served(client) for _ in range(4)} == {"1"}


def test_pinned_version_by_name_and_by_header(client: openai.OpenAI) -> None:
    assert served(client, "smollm2-135m@2") == "2"
    assert served(client, extra_headers={"x-infermesh-model-version": "2"}) == "2"
    with pytest.raises(openai.NotFoundError, match="version '7'"):
        served(client, "smollm2-135m@7")


def test_admin_api_needs_the_admin_key(versions_mesh: Mesh) -> None:
    status, body = call(versions_mesh, "GET", "/admin/models/smollm2-135m/routing", key="wrong")
    assert status == 401 and body["error"]["code"] == "invalid_admin_key"
    status, body = call(versions_mesh, "PUT", "/admin/models/smollm2-135m/routing", {"default_version": "9"})
    assert status == 400 and "version '9'" in body["error"]["message"]


def test_canary_split_and_default_switch(versions_mesh: Mesh, client: openai.OpenAI) -> None:
    status, body = call(versions_mesh, "PUT", "/admin/models/smollm2-135m/routing", {"canary": {"2": 0.5}})
    assert status == 200 and body == {"model": "smollm2-135m", "default_version": "1", "canary": {"2": 0.5},
                                      "versions": ["1", "2"]}
    versions = [served(client) for _ in range(24)]
    assert set(versions) == {"1", "2"}                    # a 50% canary: P(all one side) = 2 * 2^-24
    # A session sticks to one version while the canary runs.
    sticky = {served(client, extra_headers={"x-session-id": "canary-session"}) for _ in range(4)}
    assert len(sticky) == 1
    status, body = call(versions_mesh, "PUT", "/admin/models/smollm2-135m/routing",
                        {"default_version": "2", "canary": {}})
    assert status == 200 and body["default_version"] == "2" and body["canary"] == {}
    assert {served(client) for _ in range(4)} == {"2"}
    call(versions_mesh, "PUT", "/admin/models/smollm2-135m/routing", {"default_version": "1"})


def test_in_flight_request_finishes_on_its_version(versions_mesh: Mesh, client: openai.OpenAI) -> None:
    call(versions_mesh, "PUT", "/admin/models/smollm2-135m/routing", {"default_version": "1", "canary": {}})
    stream = client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": "Count."}],
                                            max_tokens=48, temperature=0, stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    first = next(chunks)
    switched = threading.Event()

    def switch() -> None:
        call(versions_mesh, "PUT", "/admin/models/smollm2-135m/routing", {"default_version": "2"})
        switched.set()

    threading.Thread(target=switch).start()
    assert switched.wait(60)
    rest = list(chunks)
    metas = [c.model_extra.get("infermesh") for c in [first, *rest] if c.model_extra.get("infermesh")]
    assert metas and all(m["model_version"] == "1" for m in metas)
    assert sum(1 for c in [first, *rest] if c.choices and c.choices[0].delta.content) > 1
    assert served(client) == "2"
    call(versions_mesh, "PUT", "/admin/models/smollm2-135m/routing", {"default_version": "1"})
