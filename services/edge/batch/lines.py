"""One batch line through the edge's own route for it (services/edge/batch/runner.py runs them): the same
parsing, content policy, token reservation and router call as the request sent over HTTP, as the batch's
tenant in the batch scheduling class.  The line's request rate is its tier's, in a bucket of its own per
tenant (batch work does not spend the interactive requests' rate); its tokens come from the budget of the
interactive caller that created the batch, and it runs in one of the edge's batch places, waiting for one
when all are taken (services/edge/batch/admission.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from services.edge.batch.admission import BatchLineCaller, budget_bucket
from services.edge.errors import ApiError, error_body
from services.edge.gateway.admission import Admission
from services.edge.gateway.tenants import STANDARD, AuthenticatedCaller
from services.edge.metrics import TENANT_REQUESTS
from services.edge.transports.asgi import Message, Receive, Scope, Send

log = logging.getLogger(__name__)

Route = Callable[[Scope, dict[str, str], Receive, Send], Awaitable[int]]


def batch_caller(admission: Admission, run: dict[str, Any]) -> BatchLineCaller:
    """The caller a batch's lines run as: its tenant and tier (as the tiers file says now; the standard tier
    if the tier is gone), in the batch scheduling class, reserving tokens from its creator's budget."""
    tiers = admission.directory.tiers
    tier = tiers.get(run["tier"]) or tiers[STANDARD]
    budget = budget_bucket(run.get("budget"), run["tenant"], admission.directory.keys)
    return BatchLineCaller(("batch", run["tenant"]), run["tenant"], dataclasses.replace(tier, priority="batch"),
                           run["label"], budget=budget)


class LineCaller:
    def __init__(self, routes: dict[tuple[str, str], Route], admission: Admission):
        self.routes, self.admission = routes, admission

    async def __call__(self, caller: AuthenticatedCaller, url: str, body: dict[str, Any]
                       ) -> tuple[int, dict[str, Any], int]:
        """(status, the answer's JSON, its Retry-After seconds or errors.DO_NOT_RETRY)."""
        raw = json.dumps(body).encode()
        headers = {"content-type": "application/json", "content-length": str(len(raw))}
        scope: Scope = {"type": "http", "method": "POST", "path": url, "query_string": b"", "client": ("batch", 0),
                        "headers": [(k.encode(), v.encode()) for k, v in headers.items()],
                        "infermesh.caller": caller, "infermesh.t0": time.perf_counter()}
        sent: list[Message] = []
        delivered = False

        async def receive() -> Message:
            nonlocal delivered
            if delivered:
                await _forever()
            delivered = True
            return {"type": "http.request", "body": raw, "more_body": False}

        async def send(message: Message) -> None:
            sent.append(message)

        status = 500
        places = self.admission.batch_places
        await places.acquire(caller.tenant)              # waits for a batch place (never an interactive one)
        try:
            self.admission.limit_requests(caller)
            status = await self.routes[("POST", url)](scope, headers, receive, send)
        except ApiError as exc:
            status = exc.status
            return exc.status, exc.body(), exc.retry_after_s
        except Exception:
            log.exception("batch line %s failed", url)
            return 500, error_body("internal error", "server_error", None), 0
        finally:
            places.release(caller.tenant)
            TENANT_REQUESTS.labels(caller.label, caller.tier.name, str(status)).inc()
        payload = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
        try:
            return status, json.loads(payload), 0
        except ValueError:
            return 500, error_body("the answer was not JSON", "server_error", None), 0


async def _forever() -> None:
    await asyncio.Event().wait()
