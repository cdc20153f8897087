"""The optional content classifier hook (proto/meshpb/v1/safety.proto): every input the rules let
through is sent to the operator's ContentClassifier service before it reaches a model.

Fails closed: a classifier that does not answer within 2 s (or at all) gets
the request 503 with Retry-After, never an unchecked answer.
"""

from __future__ import annotations

import grpc

from mesh.grpcutil import channel
from meshpb.v1 import safety_pb2, safety_pb2_grpc
from services.edge.errors import ApiError
from services.edge.metrics import CONTENT_FILTERED


class Classifier:
    def __init__(self, address: str, timeout_s: float = 2.0):
        self.address, self.timeout_s = address, timeout_s
        self._channel = channel(address)
        self._stub = safety_pb2_grpc.ContentClassifierStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def check_input(self, texts: list[str], tenant: str) -> str | None:
        """The category the classifier blocked the input for, or None."""
        try:
            reply = await self._stub.Classify(safety_pb2.ClassifyRequest(
                texts=texts, direction=safety_pb2.CONTENT_DIRECTION_INPUT, tenant=tenant), timeout=self.timeout_s)
        except grpc.aio.AioRpcError as err:
            raise ApiError(503, f"the content classifier at {self.address} did not answer ({err.code().name}); "
                           "requests are not served unchecked: retry shortly", kind="service_unavailable",
                           code="classifier_unavailable", retry_after_s=1) from None
        if reply.blocked:
            category = reply.category[:64] or "classifier"
            CONTENT_FILTERED.labels("input", category).inc()
            return category
        return None
