"""bench/soak.py's Batch API traffic: every --batch-every seconds a tenant uploads a JSONL file of
--batch-lines chat requests (/v1/files, purpose batch) and creates a batch of it (/v1/batches, endpoint
/v1/chat/completions, completion_window 24h); chaos goes on meanwhile (a batch survives a restart of any
service: its state is in the cache service's object store, and its edge resumes it).

Counted as two kinds: `batch-create` (the upload and the create: completed with a batch id, or a retryable
error, tried again up to 5 times, or lost) and `batch-line` (each input line, once the soak's traffic ended
and every batch finished, waited for until --batch-grace seconds after the end): completed when the line has
exactly one result, HTTP 200, whose text equals the prompt's fault-free chat reference; lost otherwise; a
batch not finished by then is hung (its lines lost:hung).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench.soak_calls import MODEL, PROMPTS, TENANTS, Outcome, Soak, Tenant, _check_status, _Failed, bearer

TERMINAL = ("completed", "failed", "expired", "cancelled")


@dataclass
class Submitted:
    bid: str
    tenant: Tenant
    lines: dict[str, str]        # custom_id -> prompt
    created: float


@dataclass
class Batches:
    soak: Soak
    submitted: list[Submitted] = field(default_factory=list)
    hung: list[str] = field(default_factory=list)
    statuses: dict[str, str] = field(default_factory=dict)

    def jsonl(self, lines: dict[str, str]) -> bytes:
        return "".join(json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": {
            "model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": self.soak.a.max_tokens,
            "temperature": 0, "ignore_eos": True}}) + "\n" for cid, prompt in lines.items()).encode()

    async def every(self, stop_at: float, seed: int) -> None:
        """One batch every --batch-every seconds, from half that after the start, until `stop_at`."""
        rng, n = random.Random(seed), 0
        async with httpx.AsyncClient(timeout=self.soak.a.request_timeout) as client:
            await asyncio.sleep(self.soak.a.batch_every / 2)
            while time.monotonic() + 5 < stop_at:
                started = time.monotonic()
                await self.submit(client, rng.choice(TENANTS), rng, n)
                n += 1
                await asyncio.sleep(max(0.0, self.soak.a.batch_every - (time.monotonic() - started)))

    async def submit(self, client: httpx.AsyncClient, tenant: Tenant, rng: random.Random, n: int) -> None:
        lines = {f"b{n}-{i}": prompt for i, prompt in enumerate(rng.sample(PROMPTS, self.soak.a.batch_lines))}
        for _ in range(5):
            start = time.monotonic()
            result, bid = await self._create(client, tenant, lines)
            self.soak.outcomes.append(Outcome("batch-create", start, time.monotonic(), result, tenant.name))
            if bid:
                self.submitted.append(Submitted(bid, tenant, lines, time.monotonic()))
                print(f"[{time.strftime('%H:%M:%S')}] batch {bid} ({tenant.name}, {len(lines)} lines)", flush=True)
                return
            if not result.startswith("error:"):
                return
            await asyncio.sleep(2)

    async def _create(self, client: httpx.AsyncClient, tenant: Tenant, lines: dict[str, str]) -> tuple[str, str]:
        """(completed, batch id), or (error:... / lost:..., "")."""
        http = self.soak.http
        try:
            upload = await client.post(f"{http}/v1/files", headers=bearer(tenant), data={"purpose": "batch"},
                                       files={"file": ("soak.jsonl", self.jsonl(lines), "application/jsonl")})
            if upload.status_code != 200:
                _check_status(upload.status_code, upload.text, upload.headers)
            made = await client.post(f"{http}/v1/batches", headers=bearer(tenant), json={
                "input_file_id": upload.json()["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"})
            if made.status_code != 200:
                _check_status(made.status_code, made.text, made.headers)
            return "completed", str(made.json()["id"])
        except _Failed as exc:
            return str(exc), ""
        except (httpx.HTTPError, OSError) as exc:
            return f"lost:{type(exc).__name__}: {exc}", ""

    async def check(self, deadline: float) -> None:
        """Wait (until `deadline`) for every batch to finish, then count each of its lines."""
        async with httpx.AsyncClient(timeout=60) as client:
            for batch in self.submitted:
                record = await self._wait(client, batch, deadline)
                if record is None:
                    self.hung.append(batch.bid)
                    self._lines(batch, {cid: "lost:hung (batch not finished)" for cid in batch.lines})
                    continue
                self.statuses[batch.bid] = str(record["status"])
                if record["status"] != "completed":
                    self._lines(batch, {cid: f"lost:batch {record['status']}" for cid in batch.lines})
                    continue
                found: dict[str, list[dict[str, Any]]] = {}
                for key in ("output_file_id", "error_file_id"):
                    if record.get(key):
                        for result in await self._file(client, batch.tenant, record[key]):
                            found.setdefault(str(result.get("custom_id")), []).append(result)
                extra = sorted(set(found) - set(batch.lines))
                if extra:
                    print(f"  batch {batch.bid}: results for custom_ids not sent: {extra}")
                took = float(record.get("completed_at") or 0) - float(record.get("created_at") or 0)
                self._lines(batch, {cid: self._judge(prompt, found.get(cid, [])) for cid, prompt in
                                    batch.lines.items()}, took)

    def _judge(self, prompt: str, results: list[dict[str, Any]]) -> str:
        if len(results) != 1:
            return f"lost:{len(results)} results for the line"
        response = results[0].get("response") or {}
        if response.get("status_code") != 200:
            error = results[0].get("error") or (response.get("body") or {}).get("error")
            return f"lost:line answered {response.get('status_code')}: {str(error)[:120]}"
        choice = response["body"]["choices"][0]
        if choice.get("finish_reason") != "length":
            return f"lost:finish {choice.get('finish_reason')}"
        text, reference = choice["message"]["content"], self.soak.references[(prompt,)]
        return "completed" if text == reference else f"lost:text differs ({len(text)} vs {len(reference)} chars)"

    def _lines(self, batch: Submitted, results: dict[str, str], took: float | None = None) -> None:
        """Each line's outcome; its latency the batch's, from its creation to its completion (else: to now)."""
        end = time.monotonic() if took is None or took < 0 else batch.created + took
        self.soak.outcomes.extend(Outcome("batch-line", batch.created, end, result, batch.tenant.name)
                                  for result in results.values())

    async def _wait(self, client: httpx.AsyncClient, batch: Submitted, deadline: float) -> dict[str, Any] | None:
        while True:
            try:
                reply = await client.get(f"{self.soak.http}/v1/batches/{batch.bid}", headers=bearer(batch.tenant))
                if reply.status_code == 200 and reply.json()["status"] in TERMINAL:
                    return dict(reply.json())
            except (httpx.HTTPError, OSError):
                pass
            if time.monotonic() > deadline:
                return None
            await asyncio.sleep(2)

    async def _file(self, client: httpx.AsyncClient, tenant: Tenant, fid: str) -> list[dict[str, Any]]:
        reply = await client.get(f"{self.soak.http}/v1/files/{fid}/content", headers=bearer(tenant))
        reply.raise_for_status()
        return [json.loads(line) for line in reply.text.splitlines() if line.strip()]

    def summary(self) -> dict[str, Any]:
        return {"batches": len(self.submitted), "lines": sum(len(b.lines) for b in self.submitted),
                "statuses": {s: list(self.statuses.values()).count(s) for s in sorted(set(self.statuses.values()))},
                "hung": self.hung}
