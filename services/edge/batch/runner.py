"""Running batches (services/edge/batch/batches_api.py takes them in): each line through the edge's own route for
the batch's endpoint, as its tenant, in the engines' batch scheduling class, `concurrency` lines at a time.

State lives in the cache service's object store (services/edge/object_store.py), so a batch outlives a restart
of any service: its record (kind "batch", id `batch_...`), and its results so far in parts of PART_LINES
lines (ids `batch_....r0`, `.r1`, ...), written at most every PERSIST_S while it runs.  The edge running a
batch holds a lease on it (renewed with each write); every SCAN_S each edge looks for batches in progress
whose lease ran out (their edge died) and takes them over, running the lines with no result yet (a line
whose result was not written yet runs again: at least once, and its result appears once).  A lease of an
earlier process with this edge's replica id is taken at once (this edge restarted).

A line answered 429, 503, 502, 504 or 408 (a rate, the mesh busy or restarting) is tried again after its
Retry-After (or 1, 2, 4 ... 30 s) until the batch expires or is cancelled; a 500 three times; any other
answer is its result.  Cancelling stops the lines under way (their gRPC calls are cancelled, so the engines
abort them); lines not run are reported in the error file as `batch_cancelled` (or `batch_expired` past the
completion window), so every input line has one result line.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from services.edge.batch.files_api import FileStore
from services.edge.batch.jsonl import nonblank
from services.edge.errors import ApiError
from services.edge.gateway.tenants import AuthenticatedCaller
from services.edge.metrics import BATCH_LINES
from services.edge.object_store import StoredObjects

log = logging.getLogger(__name__)

KIND = "batch"
PART_LINES = 32
PERSIST_S = 1.0
LEASE_S = 30.0
SCAN_S = 10.0
FINISH_RETRY_S = 60.0                  # a batch's finish tried again every FINISH_INTERVAL_S while the store is down
FINISH_INTERVAL_S = 1.0
TTL_S = 30 * 86400.0
RETRIED = (408, 429, 502, 503, 504)
SERVER_ERROR_TRIES = 3
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")

# (caller, url, body) -> (status, answer body, retry-after seconds): one request through the edge's route.
LineCall = Callable[[AuthenticatedCaller, str, dict[str, Any]], Awaitable[tuple[int, dict[str, Any], int]]]


@dataclasses.dataclass
class Line:
    custom_id: str
    url: str
    body: dict[str, Any]


def parse_lines(content: bytes) -> list[Line]:
    """An input file already checked at creation (batches_api.check_lines): its requests in order."""
    out = []
    for _, raw in nonblank(content.decode("utf-8")):
        item = json.loads(raw)
        out.append(Line(item["custom_id"], item["url"], item["body"]))
    return out


class BatchRunner:
    def __init__(self, stored: StoredObjects, files: FileStore, call: LineCall,
                 caller_of: Callable[[dict[str, Any]], AuthenticatedCaller], replica_id: str, concurrency: int):
        self.stored, self.files, self.call, self.caller_of = stored, files, call, caller_of
        self.replica_id, self.concurrency = replica_id, concurrency
        self.owner = f"{replica_id}/{uuid.uuid4().hex[:12]}"
        self.running: dict[str, asyncio.Task[None]] = {}
        self.stops: dict[str, asyncio.Event] = {}
        self._scanner: asyncio.Task[None] | None = None

    # -- records ------------------------------------------------------------------------------
    async def record(self, tenant: str, bid: str) -> dict[str, Any] | None:
        value = await self.stored.get(tenant, KIND, bid)
        return json.loads(value) if value is not None else None

    async def put(self, tenant: str, record: dict[str, Any]) -> None:
        await self.stored.put(tenant, KIND, record["id"], json.dumps(record).encode(), TTL_S)

    # -- starting, stopping -------------------------------------------------------------------
    def start(self) -> None:
        """Take over batches left running (by a dead edge, or this one before a restart), now and every SCAN_S."""
        self._scanner = asyncio.create_task(self._scan_forever())

    async def close(self) -> None:
        """Stop running (each batch's results so far are written and its lease given up, so the next edge
        to scan takes it over at once)."""
        tasks = [t for t in (self._scanner, *self.running.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def launch(self, tenant: str, record: dict[str, Any]) -> None:
        """Run a batch this edge holds the lease of (just created, or taken over)."""
        bid = record["id"]
        self.stops[bid] = asyncio.Event()
        self.running[bid] = asyncio.create_task(self._run(tenant, record))
        self.running[bid].add_done_callback(lambda _: (self.running.pop(bid, None), self.stops.pop(bid, None)))

    def cancel(self, bid: str) -> None:
        """Stop a batch running here (its record already says cancelling)."""
        if bid in self.stops:
            self.stops[bid].set()

    def lease(self, record: dict[str, Any]) -> None:
        record["_run"].update(owner=self.owner, lease_until=time.time() + LEASE_S)

    async def _scan_forever(self) -> None:
        while True:
            try:
                await self.scan()
            except ApiError as exc:
                log.warning("batch scan: %s", exc.message)
            except Exception:
                log.exception("batch scan failed")
            await asyncio.sleep(SCAN_S)

    async def scan(self) -> int:
        """Take over the batches in progress whose lease ran out; how many were taken."""
        taken = 0
        for tenant, bid in await self.stored.keys(None, KIND):
            if "." in bid or bid in self.running:
                continue
            record = await self.record(tenant, bid)
            if record is None or record["status"] not in ACTIVE or not self._claimable(record["_run"]):
                continue
            self.lease(record)
            await self.put(tenant, record)
            log.info("batch %s of %s: taken over (%s)", bid, tenant, record["status"])
            self.launch(tenant, record)
            taken += 1
        return taken

    def _claimable(self, run: dict[str, Any]) -> bool:
        owner = str(run.get("owner", ""))
        earlier_self = owner.startswith(f"{self.replica_id}/") and owner != self.owner
        return earlier_self or float(run.get("lease_until", 0)) < time.time()

    # -- one batch --------------------------------------------------------------------------------
    async def _run(self, tenant: str, record: dict[str, Any]) -> None:
        bid, stop = record["id"], self.stops[record["id"]]
        progress = Progress(self, tenant, record)
        try:
            content = await self.files.content(tenant, record["input_file_id"])
            if content is None:
                await progress.fail("input_file_missing", "the input file was deleted or expired before the batch ran")
                return
            lines = await asyncio.to_thread(parse_lines, content)      # seconds for a large file: not on the loop
            await progress.load(len(lines))
            if record["status"] in ("validating", "in_progress"):
                record["status"] = "in_progress"
                record["in_progress_at"] = record["in_progress_at"] or int(time.time())
                pending = deque(i for i in range(len(lines)) if i not in progress.results)
                caller = self.caller_of(record["_run"])
                workers = [asyncio.create_task(self._work(caller, lines, pending, progress, stop))
                           for _ in range(min(self.concurrency, len(pending)) or 1)]
                writer = asyncio.create_task(progress.keep_writing(stop))
                try:
                    await asyncio.gather(*workers)
                finally:
                    writer.cancel()
                    for worker in workers:
                        worker.cancel()
                    await asyncio.gather(writer, *workers, return_exceptions=True)
            await self._finish(progress, lines)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await asyncio.shield(progress.write(release=True))
            raise
        except Exception:
            log.exception("batch %s failed", bid)
            with contextlib.suppress(Exception):
                await progress.write(release=True)

    async def _finish(self, progress: Progress, lines: list[Line]) -> None:
        """progress.finish, tried again every FINISH_INTERVAL_S for up to FINISH_RETRY_S while the object store is
        unreachable (the cache service restarting): the results are in memory, and giving up would leave the batch
        to wait for its lease to run out and another scan."""
        deadline = time.monotonic() + FINISH_RETRY_S
        while True:
            try:
                await progress.finish(lines)
                return
            except ApiError as exc:
                if exc.status != 503 or time.monotonic() > deadline:
                    raise
                log.warning("batch %s: not finished yet (%s); trying again", progress.record["id"], exc.message)
                await asyncio.sleep(FINISH_INTERVAL_S)

    async def _work(self, caller: AuthenticatedCaller, lines: list[Line], pending: deque[int], progress: Progress,
                    stop: asyncio.Event) -> None:
        while pending and not stop.is_set() and not progress.expired():
            i = pending.popleft()
            line = lines[i]
            task = asyncio.create_task(self._answer(caller, line, progress))
            halt = asyncio.create_task(stop.wait())
            done, _ = await asyncio.wait({task, halt}, return_when=asyncio.FIRST_COMPLETED)
            halt.cancel()
            if task not in done:
                task.cancel()                  # cancelled: the gRPC call goes, the engine aborts the request
                await asyncio.gather(task, return_exceptions=True)
                return
            status, body = task.result()
            progress.add(i, line, status, body)

    async def _answer(self, caller: AuthenticatedCaller, line: Line, progress: Progress) -> tuple[int, dict[str, Any]]:
        attempt, server_errors = 0, 0
        while True:
            status, body, retry_after = await self.call(caller, line.url, line.body)
            server_errors += status == 500
            if status not in RETRIED and not (status == 500 and server_errors < SERVER_ERROR_TRIES):
                return status, body
            if retry_after < 0 or progress.expired():      # errors.DO_NOT_RETRY: it cannot pass as it is
                return status, body
            BATCH_LINES.labels("retried").inc()
            await asyncio.sleep(retry_after or min(30, 2 ** attempt))
            attempt += 1


class Progress:
    """One batch's results and its record's counts, written to the store (batched, at most every PERSIST_S)."""

    def __init__(self, runner: BatchRunner, tenant: str, record: dict[str, Any]):
        self.runner, self.tenant, self.record = runner, tenant, record
        self.results: dict[int, dict[str, Any]] = {}       # line -> {"ok": bool, "line": the output line}
        self.ok = 0                                        # of the results, those answered 2xx
        self.dirty: set[int] = set()                       # parts to write
        self.parts = 0

    def expired(self) -> bool:
        return time.time() >= self.record["expires_at"]

    async def load(self, lines: int) -> None:
        self.parts = (lines + PART_LINES - 1) // PART_LINES
        for k in range(self.parts):
            value = await self.runner.stored.get(self.tenant, KIND, f"{self.record['id']}.r{k}")
            if value is not None:
                self.results.update({int(i): r for i, r in json.loads(value).items()})
        self.ok = sum(1 for r in self.results.values() if r["ok"])
        self._count(lines)

    def add(self, i: int, line: Line, status: int, body: dict[str, Any]) -> None:
        request_id = body.get("id", "") if status < 400 else ""
        out = {"id": f"batch_req_{uuid.uuid4().hex[:24]}", "custom_id": line.custom_id,
               "response": {"status_code": status, "request_id": request_id, "body": body}, "error": None}
        self.results[i] = {"ok": status < 400, "line": out}
        self.ok += status < 400
        self.dirty.add(i // PART_LINES)
        self._count(self.record["request_counts"]["total"])
        BATCH_LINES.labels("completed" if status < 400 else "failed").inc()

    def _count(self, total: int) -> None:
        self.record["request_counts"] = {"total": total, "completed": self.ok, "failed": len(self.results) - self.ok}

    async def keep_writing(self, stop: asyncio.Event) -> None:
        while True:
            await asyncio.sleep(PERSIST_S)
            try:
                await self.write()
            except ApiError as exc:         # the store restarting: the results stay here, written next time
                log.warning("batch %s: progress not written (%s)", self.record["id"], exc.message)
            if self.record["status"] == "cancelling":
                stop.set()

    async def write(self, release: bool = False) -> None:
        """The changed parts, then the record (its lease renewed, or given up); a cancel written by another
        edge meanwhile is kept."""
        bid = self.record["id"]
        for k in sorted(self.dirty):
            lines = range(k * PART_LINES, (k + 1) * PART_LINES)
            part = {str(i): self.results[i] for i in lines if i in self.results}
            await self.runner.stored.put(self.tenant, KIND, f"{bid}.r{k}", json.dumps(part).encode(), TTL_S)
            self.dirty.discard(k)
        stored = await self.runner.record(self.tenant, bid)
        if stored is not None and stored["status"] == "cancelling" and self.record["status"] in ("in_progress",
                                                                                                  "validating"):
            self.record.update(status="cancelling", cancelling_at=stored["cancelling_at"])
        self.runner.lease(self.record)
        if release:
            self.record["_run"]["lease_until"] = 0
        await self.runner.put(self.tenant, self.record)

    async def fail(self, code: str, message: str) -> None:
        self.record.update(status="failed", failed_at=int(time.time()),
                           errors={"object": "list", "data": [{"code": code, "message": message, "param": None,
                                                               "line": None}]})
        await self.runner.put(self.tenant, self.record)

    async def finish(self, lines: list[Line]) -> None:
        """Results into the output and error files, then the record's final status."""
        await self.write()
        record, now = self.record, int(time.time())
        ending = "cancelled" if record["status"] == "cancelling" else "expired" if self.expired() else "completed"
        if record["status"] != "finalizing":
            record.update(status="finalizing", finalizing_at=now)
            await self.runner.put(self.tenant, record)
        ok, failed = await asyncio.to_thread(_result_files, lines, self.results, ending)   # up to 50,000 lines
        bid = record["id"]
        if ok and not record.get("output_file_id"):
            meta = await self.runner.files.save(self.tenant, f"{bid}_output.jsonl", "batch_output", ok)
            record["output_file_id"] = meta["id"]
        if failed and not record.get("error_file_id"):
            meta = await self.runner.files.save(self.tenant, f"{bid}_error.jsonl", "batch_output", failed)
            record["error_file_id"] = meta["id"]
        record.update(status=ending, **{f"{ending}_at": now})
        record["_run"]["lease_until"] = 0
        await self.runner.put(self.tenant, record)
        for k in range(self.parts):
            await self.runner.stored.delete(self.tenant, KIND, f"{bid}.r{k}")
        log.info("batch %s of %s %s: %s", bid, self.tenant, ending, record["request_counts"])



def _result_files(lines: list[Line], results: dict[int, dict[str, Any]], ending: str) -> tuple[bytes, bytes]:
    """The output and error files' bytes: a line each, in input order; a line with no result is an error line."""
    code = {"cancelled": "batch_cancelled", "expired": "batch_expired"}.get(ending, "not_run")
    ok: list[str] = []
    failed: list[str] = []
    for i, line in enumerate(lines):
        result = results.get(i)
        if result is None:
            result = {"ok": False, "line": {"id": f"batch_req_{uuid.uuid4().hex[:24]}", "custom_id": line.custom_id,
                                            "response": None, "error": {"code": code, "message":
                                            f"the batch was {ending} before this request ran"}}}
        (ok if result["ok"] else failed).append(json.dumps(result["line"]) + "\n")
    return "".join(ok).encode(), "".join(failed).encode()
