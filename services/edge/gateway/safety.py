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
is stopped.  An optional classifier service (services/edge/gateway/classifier.py) is asked about each input.

Rules read folded text (services/edge/gateway/textfold.py: compatibility forms, accents, zero-width characters
and Latin look-alikes folded, lower case, white space runs as one space).  Input rules read every text
of the request that reaches the model (services/edge/surfaces/model_inputs.py), each alone and all of them
run together, so a word split across two messages is caught too.  Output rules hold back logprobs
with the text they belong to: a token's logprob goes out once its text has (services/edge/surfaces/choices.py),
and a top_logprobs alternative that would complete a match is dropped.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

from mesh.files import WatchedFile
from services.edge.gateway.textfold import fold
from services.edge.metrics import CONTENT_FILTERED

DEFAULT_WINDOW = 64
CONVERSATION = ("messages", "instructions", "input")     # services/edge/surfaces/model_inputs.py's field names
MAX_WINDOW = 4096


@dataclass(frozen=True)
class Rule:
    category: str
    pattern: re.Pattern[str]


@dataclass(frozen=True)
class Found:
    """A rule's match, as offsets into the text as written (not folded)."""

    rule: Rule
    start: int
    end: int


@dataclass(frozen=True)
class ContentPolicy:
    input: tuple[Rule, ...] = ()
    output: tuple[Rule, ...] = ()
    window: int = DEFAULT_WINDOW

    def first_match(self, text: str, rules: tuple[Rule, ...]) -> Found | None:
        """The rule whose match in folded `text` starts first (ties: the rule listed first)."""
        if not rules:
            return None
        folded, where = fold(text)
        best: tuple[Rule, re.Match[str]] | None = None
        for rule in rules:
            m = rule.pattern.search(folded)
            if m is not None and (best is None or m.start() < best[1].start()):
                best = (rule, m)
        if best is None:
            return None
        rule, m = best
        return Found(rule, where[m.start()], where[m.end() - 1] + 1)

    def blocked_input(self, texts: Sequence[tuple[str, str]]) -> tuple[str, str] | None:
        """(category, field) of the first input rule that a text matches, alone or run together with
        the others (a word split across messages), or None."""
        if not self.input:
            return None
        # The conversation's texts run together, as the model reads them one after another (a word split
        # across two messages); not the other fields (stop sequences are a list, not one text).
        talk = [t for f, t in texts if f.startswith(CONVERSATION)]
        together = [("messages", "".join(talk)), ("messages", " ".join(talk))] if len(talk) > 1 else []
        for field, text in [*texts, *together]:
            found = self.first_match(text, self.input)
            if found is not None:
                CONTENT_FILTERED.labels("input", found.rule.category).inc()
                return found.rule.category, field
        return None

    def check_input(self, texts: Sequence[str]) -> str | None:
        """The category of the first input rule `texts` match, or None."""
        found = self.blocked_input([("", t) for t in texts])
        return found[0] if found is not None else None


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
    category that blocked the output (None while clean); once blocked, nothing more is released.
    `released` counts the characters given out so far (logprobs follow it: services/edge/surfaces/choices.py)."""

    def __init__(self, policy: ContentPolicy):
        self.policy = policy
        self.held = ""          # not yet released
        self.tail = ""          # the last `window` characters released, for matches that began there
        self.blocked: str | None = None
        self.fed = 0            # characters fed
        self.released = 0       # characters released

    def _scan(self, final: bool) -> str:
        text = self.tail + self.held
        found = self.policy.first_match(text, self.policy.output)
        if found is not None and found.end > len(self.tail):
            self.blocked = found.rule.category
            CONTENT_FILTERED.labels("output", found.rule.category).inc()
            release = self.held[:max(0, found.start - len(self.tail))]
            self.held = ""
            self.released += len(release)
            return release
        keep = 0 if final else self.policy.window
        cut = max(0, len(self.held) - keep)
        release, self.held = self.held[:cut], self.held[cut:]
        self.tail = (self.tail + release)[-self.policy.window:]
        self.released += len(release)
        return release

    def feed(self, text: str) -> str:
        if self.blocked is not None:
            return ""
        self.held += text
        self.fed += len(text)
        return self._scan(final=False) if self.policy.output else self._flush()

    def finish(self) -> str:
        """The text still held, at the end of the choice (or "" when it was blocked)."""
        if self.blocked is not None:
            return ""
        return self._scan(final=True) if self.policy.output else self._flush()

    def completes_match(self, before: str, candidate: str) -> bool:
        """Whether `candidate`, written after the text fed so far and then `before`, would complete an
        output rule's match (a top_logprobs alternative that must not be shown)."""
        if not self.policy.output:
            return False
        context = self.tail + self.held + before
        found = self.policy.first_match(context + candidate, self.policy.output)
        return found is not None and found.end > len(context)

    def _flush(self) -> str:
        release, self.held = self.held, ""
        self.released += len(release)
        return release
