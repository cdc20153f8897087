"""bench/soak.py's processes (pid, memory) and its summary: requests per kind and per tenant, completed,
retryable errors by cause, lost, p99 latency during and outside faults, and each process's memory at the
start and the end (the processes that lived through the whole soak: growth must stay under MAX_GROWTH)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

from bench.soak_calls import TENANTS, Outcome, Soak

MAX_GROWTH = 0.10
PROCESSES = ("edge-0", "router-0", "router-1", "tokenizer-0", "tokenizer-1", "cache-0", "engine-0", "engine-1")
BASE_PORTS = {("engine", 0): 50060, ("engine", 1): 50061, ("router", 0): 50051, ("router", 1): 50031,
              ("tokenizer", 0): 50052, ("tokenizer", 1): 50041, ("cache", 0): 50053}
Memory = dict[str, tuple[int | None, float]]


def pid_of(name: str, offset: int) -> int | None:
    kind, index = name.rsplit("-", 1)
    if kind == "edge":
        pattern = "services.edge --replica-id edge-0"
    else:
        pattern = f"services.{kind} --replica-id {name} --port {BASE_PORTS[(kind, int(index))] + offset}"
    out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()
    return int(out[0]) if len(out) == 1 else None


def rss_mib(pid: int | None) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def memory(offset: int) -> Memory:
    return {name: (pid, rss_mib(pid)) for name in PROCESSES for pid in [pid_of(name, offset)]}


def percentile(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]


def row(label: str, mine: list[Outcome]) -> dict[str, Any]:
    """Counts and p99 latencies of `mine`; a batch line's latency (its batch's, creation to completion) only in
    its own row."""
    errors: dict[str, int] = {}
    for o in mine:
        if o.result.startswith("error:"):
            errors[o.result[6:]] = errors.get(o.result[6:], 0) + 1
    lost = [o.result[5:] for o in mine if o.result.startswith("lost:")]
    return {"kind": label, "requests": len(mine), "completed": sum(o.result == "completed" for o in mine),
            "errors": errors, "lost": len(lost), "lost_why": sorted(set(lost))[:5],
            "p99_during_faults_s": percentile([o.end - o.start for o in mine if o.during_fault], 99),
            "p99_otherwise_s": percentile([o.end - o.start for o in mine if not o.during_fault and
                                           (label == "batch-line" or o.kind != "batch-line")], 99)}


def lost_detail(soak: Soak, o: Outcome, recovery_s: float) -> dict[str, Any]:
    """A lost request: its kind, tenant, when (s from the first request) and the faults begun while it ran or
    in the --recovery-seconds before."""
    zero = min(x.start for x in soak.outcomes)
    faults = [f"{fault} at {t - zero:.0f} s" for t, fault in soak.faults if o.start - recovery_s <= t <= o.end]
    return {"kind": o.kind, "tenant": o.tenant, "start_s": round(o.start - zero, 1), "end_s": round(o.end - zero, 1),
            "why": o.result[5:], "faults": faults}


def table(title: str, rows: list[dict[str, Any]]) -> None:
    print(f"| {title} | requests | completed | errors (retryable) | lost | p99 during faults | p99 otherwise |")
    print("|---|---:|---:|---|---:|---:|---:|")
    for r in rows:
        errs = ", ".join(f"{k}: {v}" for k, v in sorted(r["errors"].items())) or "0"
        print(f"| {r['kind']} | {r['requests']} | {r['completed']} | {errs} | {r['lost']} | "
              f"{r['p99_during_faults_s']:.2f} s | {r['p99_otherwise_s']:.2f} s |")


def report(soak: Soak, kinds: list[str], rate: float, cap: float, before: Memory, after: Memory,
           recovery_s: float) -> dict[str, Any]:
    for o in soak.outcomes:
        # batch lines run from their batch's creation to the end: "during faults" says nothing of them
        o.during_fault = o.kind != "batch-line" and any(t <= o.end and o.start <= t + recovery_s
                                                        for t, _ in soak.faults)
    rows = [row(kind, [o for o in soak.outcomes if o.kind == kind]) for kind in kinds]
    rows.append(row("all", soak.outcomes))
    tenants = [row(f"{t.name} ({t.tier}, weight {t.weight:g})", [o for o in soak.outcomes if o.tenant == t.name])
               for t in TENANTS]
    tally: dict[str, int] = {}
    for _, fault in soak.faults:
        action, name = fault.split()
        key = f"{action} {name.rsplit('-', 1)[0]}"
        tally[key] = tally.get(key, 0) + 1
    print(f"\ncapacity {cap:.2f} req/s fault free; offered {rate:.2f} req/s ({rate / cap:.0%}); "
          f"{len(soak.faults)} faults: " + ", ".join(f"{k} x{v}" for k, v in sorted(tally.items())))
    table("traffic", rows)
    lost = [lost_detail(soak, o, recovery_s) for o in soak.outcomes if o.result.startswith("lost:")]
    for d in lost:
        print(f"  lost: {d}")
    print()
    table("tenant", tenants)
    print("\n| process | RSS at start (MiB) | RSS at end (MiB) | growth | restarted |")
    print("|---|---:|---:|---:|---|")
    memory_rows, memory_ok = {}, True
    for name in PROCESSES:
        (pid0, rss0), (pid1, rss1) = before[name], after[name]
        restarted = pid0 != pid1
        growth = (rss1 - rss0) / rss0 if not restarted else float("nan")
        memory_ok = memory_ok and (restarted or growth < MAX_GROWTH)
        memory_rows[name] = {"start_mib": round(rss0, 1), "end_mib": round(rss1, 1), "restarted": restarted,
                             "growth": None if restarted else round(growth, 4)}
        print(f"| {name} | {rss0:.0f} | {rss1:.0f} | {'-' if restarted else f'{growth:+.1%}'} | "
              f"{'yes' if restarted else 'no'} |")
    if not memory_ok:
        print(f"MEMORY: a process that lived through the soak grew by {MAX_GROWTH:.0%} or more")
    return {"capacity_rps": cap, "offered_rps": rate, "faults": [f for _, f in soak.faults], "rows": rows,
            "tenants": tenants, "lost": lost, "memory": memory_rows, "memory_ok": memory_ok}
