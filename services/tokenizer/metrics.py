"""Prometheus metrics of the tokenizer (served on --metrics-port).  Requests by status and their
durations are counted for every service by mesh.telemetry.server_span."""

from __future__ import annotations

from prometheus_client import Counter

TOKENS = Counter("infermesh_tokenizer_tokens_total", "Token ids produced, by method (chat_template, encode)",
                 ["method"])
