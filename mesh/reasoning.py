"""Reasoning between think tags (Qwen3, DeepSeek-R1 style templates): the answer's text split, as it streams,
into its reasoning (`reasoning_content`) and its content.  Pure.

Such a model writes `<think>thoughts</think>answer`; a template that opens `<think>` in the prompt itself
(DeepSeek-R1's generation prompt) has the answer start inside it.  The tags are dropped, and so is the
whitespace right after each (the templates put newlines there).  A tag split across deltas is held back
until it is whole or cannot be one.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def reasoning_format(think_tags: bool, rendered_prompt: str) -> str:
    """The tokenizer's EncodeResponse.reasoning for a prompt rendered by a template with (or without) think
    tags: "think_open" when the prompt leaves a <think> open, "think" otherwise, "" for no reasoning format."""
    if not think_tags:
        return ""
    tail = rendered_prompt.rstrip()
    last_open, last_close = tail.rfind(OPEN), tail.rfind(CLOSE)
    return "think_open" if last_open >= 0 and last_open > last_close and tail.endswith(OPEN) else "think"


class ThinkSplitter:
    """`push(text) -> (reasoning, content)` as text arrives; `finish()` releases what was held back."""

    def __init__(self, reasoning_format: str):
        self.enabled = bool(reasoning_format)
        self.state = "reasoning" if reasoning_format == "think_open" else "start"
        self.held = ""                   # text that may be the start of a tag
        self.strip = self.state == "reasoning"

    def push(self, text: str) -> tuple[str, str]:
        if not self.enabled:
            return "", text
        self.held += text
        reasoning: list[str] = []
        content: list[str] = []
        while self.held:
            if self.strip:
                self.held = self.held.lstrip()
                if not self.held:
                    break
                self.strip = False
            if self.state == "start":                # only a <think> at the very start opens reasoning
                stripped = self.held.lstrip()
                if stripped.startswith(OPEN):
                    self.held, self.state, self.strip = stripped[len(OPEN):], "reasoning", True
                    continue
                if OPEN.startswith(stripped):
                    break                            # maybe the tag, still arriving
                self.state = "content"
            if self.state == "content":
                content.append(self.held)
                self.held = ""
                break
            end = self.held.find(CLOSE)              # in reasoning
            if end >= 0:
                reasoning.append(self.held[:end])
                self.held, self.state, self.strip = self.held[end + len(CLOSE):], "content", True
                continue
            keep = _partial_tail(self.held, CLOSE)
            reasoning.append(self.held[:len(self.held) - keep])
            self.held = self.held[len(self.held) - keep:]
            break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """The end of the answer: what was held back (an unclosed reasoning stays reasoning)."""
        held, self.held = self.held, ""
        if not self.enabled or not held:
            return "", ""
        return (held, "") if self.state == "reasoning" else ("", held)


def _partial_tail(text: str, tag: str) -> int:
    """How many characters at the end of `text` could begin `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
