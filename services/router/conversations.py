"""The router's conversation RPCs: ForgetConversation deletes a stored conversation of the caller's tenant (a
session, or a stored response of the edge's Responses API, whose id is its session id); StoreTurn appends a
turn whose Generate left the storing to its caller (the edge stores what its output rules released).  A mixin
of RouterServicer (services/router/server.py), which holds the callers and the session-store client."""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from mesh.errors import InvalidArgument
from mesh.grpcutil import rpc_errors
from mesh.request_limits import name_problem
from services.router import wire
from services.router.sessions import merge, session_key

if TYPE_CHECKING:
    from services.router.callers import Callers
    from services.router.upstream import Sessions


class ConversationRPCs:
    callers: Callers
    sessions: Sessions

    @rpc_errors
    async def ForgetConversation(self, request: wire.ForgetConversationRequest,
                                 context: grpc.aio.ServicerContext) -> wire.ForgetConversationResponse:
        caller = self.callers.caller(context, request.tenant)
        refused = name_problem("session_id", request.session_id)
        if refused or not request.session_id:
            raise InvalidArgument(refused or "session_id is empty")
        found = await self.sessions.forget(session_key(caller.tenant, request.session_id))
        return wire.forgotten(found)

    @rpc_errors
    async def StoreTurn(self, request: wire.StoreTurnRequest,
                        context: grpc.aio.ServicerContext) -> wire.StoreTurnResponse:
        """The turn stored as Generate stores it: the conversation it continued (history_from's, stored again
        under session_id), the request's new messages, then the answer as the caller gave it out."""
        turn = wire.stored_turn(request)
        caller = self.callers.caller(context, turn.tenant)
        for what, value in (("session_id", turn.session_id), ("history_from", turn.history_from)):
            refused = name_problem(what, value)
            if refused:
                raise InvalidArgument(refused)
        if not turn.session_id:
            raise InvalidArgument("session_id is empty")
        if turn.answer.role != "assistant":
            raise InvalidArgument("answer.role must be 'assistant'")
        session = session_key(caller.tenant, turn.session_id)
        history, branched = await self.sessions.continued(caller.tenant, turn.history_from, session, True)
        _, new = merge(history, turn.messages)
        await self.sessions.remember_turn(session, history, branched, new, turn.answer)
        return wire.turn_stored()
