"""ProbeVerdicts: a replica's health from its health probes, tolerant of one missed answer.

A probe missed on a CPU-saturated machine is not a dead replica: a healthy replica is only
marked unhealthy after `unhealthy_after` misses in a row (~2 s at the default interval), and an
unhealthy one is re-admitted on its first success.  Pure: takes the probe's answer, no I/O.
"""

from __future__ import annotations


class ProbeVerdicts:
    def __init__(self, unhealthy_after: int = 2):
        if unhealthy_after < 1:
            raise ValueError("unhealthy_after must be at least 1")
        self.unhealthy_after = unhealthy_after
        self._misses: dict[str, int] = {}      # replica id -> probes missed in a row

    def judge(self, replica_id: str, answered: bool, healthy: bool) -> bool:
        """The replica's health after a probe that `answered` (SERVING, and its info when needed),
        given its health so far."""
        misses = 0 if answered else self._misses.get(replica_id, 0) + 1
        self._misses[replica_id] = misses
        if not answered and healthy and misses < self.unhealthy_after:
            return True
        return answered

    def misses(self, replica_id: str) -> int:
        return self._misses.get(replica_id, 0)

    def forget(self, replica_id: str) -> None:
        """The replica left discovery (one that comes back starts afresh)."""
        self._misses.pop(replica_id, None)
