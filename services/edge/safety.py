"""Content safety: rules on what callers send (input) and what models answer (output).

The rules file (INFERMESH_CONTENT_POLICY, or the edge's --content-policy) is JSON, read again when
it changes:

    {"input":  [{"category": "violence", "pattern": "how to build a bomb"}],
     "output": [{"category": "secrets", "pattern": "BEGIN [A-Z ]*PRIVATE KEY"}],
     "window": 64}

Patterns are regular expressions, matched case-insensitively.  A blocked input is refused with 400
and code `content_filter` before it reaches a model.  Output is checked as it streams: the last
`window` characters of each choice are held back until more text follows, so a match up to `window`
characters long is caught even when the model produced it across several tokens, and none of it
reaches the client; the choice then ends with `finish_reason: "content_filter"` and its generation
is stopped.  An optional classifier service (services/edge/classifier.py) is asked about each input.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from mesh.files import WatchedFile
from services.edge.metrics import CONTENT_FILTERED

DEFAULT_WINDOW = 64
MAX_WINDOW = 4096


@dataclass(frozen=True)
class Rule:
    category: str
    pattern: re.Pattern[str]


@dataclass(frozen=True)
class ContentPolicy:
    input: tuple[Rule, ...] = ()
    output: tuple[Rule, ...] = ()
    window: int = DEFAULT_WINDOW

    def first_match(self, text: str, rules: tuple[Rule, ...]) -> tuple[Rule, re.Match[str]] | None:
        """The rule whose match starts first in `text` (ties: the rule listed first)."""
        best: tuple[Rule, re.Match[str]] | None = None
        for rule in rules:
            m = rule.pattern.search(text)
            if m is not None and (best is None or m.start() < best[1].start()):
                best = (rule, m)
        return best

    def check_input(self, texts: list[str]) -> str | None:
        """The category of the first input rule any of `texts` matches, or None."""
        for text in texts:
            found = self.first_match(text, self.input)
            if found is not None:
                CONTENT_FILTERED.labels("input", found[0].category).inc()
                return found[0].category
        return None


NO_RULES = ContentPolicy()


def parse_policy(text: str) -> ContentPolicy:
    """The rules file's JSON; ValueError names what is wrong."""
    raw = json.loads(text)
    if not isinstance(raw, dict) or set(raw) - {"input", "output", "window"}:
        raise ValueError("the content policy is a JSON object with \"input\", \"output\" (lists of "
                         "{\"category\", \"pattern\"}) and optionally \"window\"")
    window = raw.get("window", DEFAULT_WINDOW)
    if not isinstance(window, int) or not 1 <= window <= MAX_WINDOW:
        raise ValueError(f"content policy: window must be a whole number of characters, 1 to {MAX_WINDOW}")
    lists: dict[str, tuple[Rule, ...]] = {}
    for side in ("input", "output"):
        rules = raw.get(side, [])
        if not isinstance(rules, list):
            raise ValueError(f"content policy: {side!r} must be a list")
        out = []
        for i, rule in enumerate(rules):
            if (not isinstance(rule, dict) or set(rule) != {"category", "pattern"}
                    or not all(isinstance(v, str) and v for v in rule.values())):
                raise ValueError(f"content policy: {side}[{i}] must be {{\"category\": NAME, \"pattern\": REGEX}}")
            try:
                pattern = re.compile(rule["pattern"], re.IGNORECASE)
            except re.error as exc:
                raise ValueError(f"content policy: {side}[{i}] pattern {rule['pattern']!r}: {exc}") from None
            if pattern.search(""):
                raise ValueError(f"content policy: {side}[{i}] pattern {rule['pattern']!r} matches empty text")
            out.append(Rule(rule["category"][:64], pattern))
        lists[side] = tuple(out)
    return ContentPolicy(lists["input"], lists["output"], window)


class PolicySource:
    """The policy now in force: the file's last good version (no file: no rules)."""

    def __init__(self, path: str = ""):
        self._file = WatchedFile(path, parse_policy) if path else None

    def current(self) -> ContentPolicy:
        if self._file is None:
            return NO_RULES
        self._file.refresh()
        policy: ContentPolicy = self._file.value
        return policy


class OutputGuard:
    """One choice's output, checked as it streams.  `feed` returns the text now safe to send and the
    category that blocked the output (None while clean); once blocked, nothing more is released."""

    def __init__(self, policy: ContentPolicy):
        self.policy = policy
        self.held = ""          # not yet released
        self.tail = ""          # the last `window` characters released, for matches that began there
        self.blocked: str | None = None

    def _scan(self, final: bool) -> str:
        text = self.tail + self.held
        found = self.policy.first_match(text, self.policy.output)
        if found is not None and found[1].end() > len(self.tail):
            rule, m = found
            self.blocked = rule.category
            CONTENT_FILTERED.labels("output", rule.category).inc()
            release = self.held[:max(0, m.start() - len(self.tail))]
            self.held = ""
            return release
        keep = 0 if final else self.policy.window
        cut = max(0, len(self.held) - keep)
        release, self.held = self.held[:cut], self.held[cut:]
        self.tail = (self.tail + release)[-self.policy.window:]
        return release

    def feed(self, text: str) -> str:
        if self.blocked is not None:
            return ""
        self.held += text
        return self._scan(final=False) if self.policy.output else self._flush()

    def finish(self) -> str:
        """The text still held, at the end of the choice (or "" when it was blocked)."""
        if self.blocked is not None:
            return ""
        return self._scan(final=True) if self.policy.output else self._flush()

    def _flush(self) -> str:
        release, self.held = self.held, ""
        return release
