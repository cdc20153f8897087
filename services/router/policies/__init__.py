"""Balancing policies: pure code that takes replica state and `now` and returns a choice.

A dict registry: the router's config names one of these.
"""

from __future__ import annotations

from services.router.policies.round_robin import RoundRobin

POLICIES = {"round_robin": RoundRobin}
