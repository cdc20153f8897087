"""TLS session tickets kept between HTTP/3 connections, so a client resumes and sends 0-RTT early data.

Tickets are single use (the edge accepts each once): `take` removes the one it returns, and every
connection brings a fresh one back (`put`).
"""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path
from typing import Any

from aioquic.tls import CipherSuite, SessionTicket

from mesh.files import write_atomic


def _ticket_to_json(t: SessionTicket) -> dict[str, Any]:
    return {
        "age_add": t.age_add, "cipher_suite": int(t.cipher_suite),
        "not_valid_after": t.not_valid_after.isoformat(), "not_valid_before": t.not_valid_before.isoformat(),
        "resumption_secret": t.resumption_secret.hex(), "server_name": t.server_name, "ticket": t.ticket.hex(),
        "max_early_data_size": t.max_early_data_size,
        "other_extensions": [[kind, data.hex()] for kind, data in t.other_extensions],
    }


def _ticket_from_json(d: dict[str, Any]) -> SessionTicket:
    return SessionTicket(
        age_add=int(d["age_add"]), cipher_suite=CipherSuite(d["cipher_suite"]),
        not_valid_after=datetime.datetime.fromisoformat(d["not_valid_after"]),
        not_valid_before=datetime.datetime.fromisoformat(d["not_valid_before"]),
        resumption_secret=bytes.fromhex(d["resumption_secret"]), server_name=str(d["server_name"]),
        ticket=bytes.fromhex(d["ticket"]), max_early_data_size=d["max_early_data_size"],
        other_extensions=[(int(kind), bytes.fromhex(data)) for kind, data in d["other_extensions"]],
    )


class TicketStore:
    """Session tickets per server, in memory and optionally in a JSON file (mode 0600).

    The file lets separate processes (`infermesh chat --http3` runs) resume. It holds
    resumption secrets, which decrypt what was sent with them: it is written owner-only.
    A missing or unreadable file is an empty store; the CLI must never fail over a cache.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None, max_servers: int = 64) -> None:
        self.path = Path(path).expanduser() if path is not None else None
        self._max = max_servers
        self._tickets: dict[str, SessionTicket] = {}
        if self.path is not None:
            try:
                raw = json.loads(self.path.read_text())
                self._tickets = {key: _ticket_from_json(d) for key, d in raw.items()}
            except (OSError, ValueError, KeyError, TypeError):
                self._tickets = {}

    def take(self, key: str) -> SessionTicket | None:
        """Remove and return the ticket for `key` if it is still valid: tickets are single use."""
        ticket = self._tickets.pop(key, None)
        if ticket is not None:
            self._save()
        return ticket if ticket is not None and ticket.is_valid else None

    def put(self, key: str, ticket: SessionTicket) -> None:
        self._tickets.pop(key, None)
        self._tickets[key] = ticket  # most recent last, so the oldest server goes first
        while len(self._tickets) > self._max:
            self._tickets.pop(next(iter(self._tickets)))
        self._save()

    def _save(self) -> None:
        if self.path is None:
            return
        text = json.dumps({key: _ticket_to_json(t) for key, t in self._tickets.items() if t.is_valid})
        try:
            write_atomic(self.path, text, 0o600)
        except OSError:
            pass  # resuming is an optimisation; losing a ticket costs one round trip
