"""How the router records its routing decisions: the ServedBy of a reply, span attributes, failover metrics
and console events for degraded requests (dispatch.py's)."""

from __future__ import annotations

from typing import Any

from mesh.adapters import served_version
from mesh.clients.values import ServedBy
from services.router import metrics
from services.router.events import RECENT
from services.router.failover import Plan
from services.router.lora import Lora
from services.router.replicas import Replica


def served_by(replica: Replica, plan: Plan, lora: Lora | None = None) -> ServedBy:
    """Who answers (the value a router client reads too; wire.py converts); with a LoRA adapter (run on
    `plan.model`, its base), the adapter's name and version."""
    model, version = plan.model, replica.model_version
    if lora is not None:
        model, version = lora.name, served_version(version, lora.path)
    return ServedBy(replica.replica_id, model, version, replica.region, plan.degraded, plan.confidence,
                    plan.confidence_source if plan.degraded else "", plan.degraded_by)


def decision_attributes(replica: Replica, plan: Plan, reason: str, failover_attempts: int | None) -> dict[str, Any]:
    """The routing decision as span attributes (router.generate and router.attempt)."""
    attrs: dict[str, Any] = {"replica": replica.replica_id, "model_version": replica.model_version,
                             "served_model": plan.model, "region": replica.region, "reason": reason,
                             "degraded": plan.degraded, "confidence": plan.confidence}
    if plan.degraded:
        attrs.update(degraded_by=plan.degraded_by, confidence_source=plan.confidence_source)
    if failover_attempts is not None:
        attrs["failover_attempts"] = failover_attempts
    return attrs


def record_fallback(model: str, plan: Plan) -> None:
    if plan.degraded:
        metrics.FAILOVER.labels("3").inc()
        RECENT.record("degraded", model, "", f"to {plan.model} ({plan.degraded_by}): {plan.why}")


def count_degraded(model: str, plan: Plan) -> None:
    if plan.degraded:
        metrics.DEGRADED.labels(model, plan.model, plan.degraded_by or "capacity").inc()
