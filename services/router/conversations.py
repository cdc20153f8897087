"""The router's ForgetConversation RPC: delete a stored conversation of the caller's tenant (a session, or
a stored response of the edge's Responses API, whose id is its session id).  A mixin of RouterServicer
(services/router/server.py), which holds the callers and the session-store client."""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from mesh.errors import InvalidArgument
from mesh.grpcutil import rpc_errors
from mesh.request_limits import name_problem
from meshpb.v1 import router_pb2
from services.router.sessions import session_key

if TYPE_CHECKING:
    from services.router.callers import Callers
    from services.router.upstream import Sessions


class ConversationRPCs:
    callers: Callers
    sessions: Sessions

    @rpc_errors
    async def ForgetConversation(self, request: router_pb2.ForgetConversationRequest,
                                 context: grpc.aio.ServicerContext) -> router_pb2.ForgetConversationResponse:
        caller = self.callers.caller(context, request.tenant)
        refused = name_problem("session_id", request.session_id)
        if refused or not request.session_id:
            raise InvalidArgument(refused or "session_id is empty")
        found = await self.sessions.forget(session_key(caller.tenant, request.session_id))
        return router_pb2.ForgetConversationResponse(found=found)
