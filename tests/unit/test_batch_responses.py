"""Issue 49: /v1/responses is a batch endpoint (OpenAI's Batch API takes it): a batch of Responses API lines runs
each through the edge's /v1/responses route, in the batch class, and its output file holds the responses."""

from __future__ import annotations

import asyncio
import json

from services.edge.batch.batches_api import ENDPOINTS
from tests.fakes.edge_router import FakeRouter, asgi, edge_app
from tests.unit.test_batches import content, settled, upload


def test_a_batch_of_responses_lines_runs_them_through_the_responses_route() -> None:
    async def main() -> None:
        router = FakeRouter()
        app = edge_app(router, response_cache_ttl_s=0)
        text = "".join(json.dumps({"custom_id": f"r-{i}", "method": "POST", "url": "/v1/responses",
                                   "body": {"model": "m", "input": f"hello {i}", "max_output_tokens": 4,
                                            "store": False}}) + "\n" for i in range(3)).encode()
        request = {"input_file_id": await upload(app, text), "endpoint": "/v1/responses", "completion_window": "24h"}
        status, _, raw = await asgi(app, "POST", "/v1/batches", json.dumps(request).encode())
        assert status == 200 and json.loads(raw)["endpoint"] == "/v1/responses", raw
        record = await settled(app, json.loads(raw)["id"])
        assert record["status"] == "completed" and record["request_counts"] == {"total": 3, "completed": 3,
                                                                               "failed": 0}
        out = await content(app, record["output_file_id"])
        assert [o["custom_id"] for o in out] == ["r-0", "r-1", "r-2"]
        for o in out:
            body = o["response"]["body"]
            assert o["response"]["status_code"] == 200 and body["object"] == "response"
            assert body["id"].startswith("resp") and o["response"]["request_id"] == body["id"]
            assert body["output"][0]["content"][0]["text"] == "Hi!"
        assert len(router.calls) == 3 and {c.priority for c in router.calls} == {"batch"}
        assert [c.messages[-1].content for c in router.calls] == ["hello 0", "hello 1", "hello 2"]

    asyncio.run(main())


def test_a_responses_line_in_a_chat_batch_is_named_and_the_openapi_lists_the_endpoint() -> None:
    async def main() -> None:
        app = edge_app(FakeRouter())
        text = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/responses",
                           "body": {"model": "m", "input": "hi"}}).encode() + b"\n"
        request = {"input_file_id": await upload(app, text), "endpoint": "/v1/chat/completions",
                   "completion_window": "24h"}
        _, _, raw = await asgi(app, "POST", "/v1/batches", json.dumps(request).encode())
        assert [(e["code"], e["line"]) for e in json.loads(raw)["errors"]["data"]] == [("invalid_url", 1)]
        _, _, raw = await asgi(app, "GET", "/openapi.json")
        schema = json.loads(raw)["components"]["schemas"]["BatchRequest"]["properties"]["endpoint"]
        assert schema["enum"] == list(ENDPOINTS) and "/v1/responses" in ENDPOINTS

    asyncio.run(main())
