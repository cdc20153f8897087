"""Stop strings on streamed text: emit what cannot start a stop string, hold back the rest."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class StopResult(NamedTuple):
    text: str       # safe to emit now
    stopped: bool   # a stop string matched; the stream ends here (the stop string is not emitted)


class StopMatcher:
    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self._held = ""

    def push(self, delta: str) -> StopResult:
        if not self.stops:
            return StopResult(delta, False)
        text = self._held + delta
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self._held = ""
            return StopResult(text[:cut], True)
        # Hold back the longest tail that is a proper prefix of some stop string.
        keep = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(text)), keep, -1):
                if text.endswith(s[:n]):
                    keep = n
                    break
        self._held = text[len(text) - keep:] if keep else ""
        return StopResult(text[: len(text) - keep], False)

    def flush(self) -> str:
        """At the end of the stream, whatever was held back is ordinary text."""
        held, self._held = self._held, ""
        return held
