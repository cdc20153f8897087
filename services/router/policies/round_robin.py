"""Round-robin over the eligible replicas."""

from __future__ import annotations

from collections.abc import Sequence

from services.router.replicas import Replica


class RoundRobin:
    def __init__(self) -> None:
        self._next = 0

    def pick(self, candidates: Sequence[Replica], now: float) -> Replica:
        """candidates: non-empty, in a stable order (the replica table's)."""
        if not candidates:
            raise ValueError("no candidates to pick from")
        choice = candidates[self._next % len(candidates)]
        self._next += 1
        return choice
