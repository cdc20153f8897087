"""Reasoning between think tags (mesh/reasoning.py): split the same however the text arrives."""

from __future__ import annotations

import pytest

from mesh.reasoning import ThinkSplitter, reasoning_format


def split(fmt: str, pieces: list[str]) -> tuple[str, str]:
    s = ThinkSplitter(fmt)
    thought, answer = "", ""
    for p in pieces:
        r, c = s.push(p)
        thought, answer = thought + r, answer + c
    r, c = s.finish()
    return thought + r, answer + c


@pytest.mark.parametrize("fmt, text, want", [
    ("think", "<think>\nLet me see.\n</think>\n\nBlue.", ("Let me see.\n", "Blue.")),
    ("think", "Blue, no thoughts.", ("", "Blue, no thoughts.")),
    ("think", "  <think>a</think>b", ("a", "b")),
    ("think", "The tag <think> mid-answer stays", ("", "The tag <think> mid-answer stays")),
    ("think", "<think>never closed", ("never closed", "")),
    ("think_open", "\nthoughts</think>\nanswer", ("thoughts", "answer")),
    ("think_open", "all thought", ("all thought", "")),
    ("", "<think>x</think>y", ("", "<think>x</think>y")),
    ("think", "<thin", ("", "<thin")),
    ("think", "<think>a</thin", ("a</thin", "")),
])
def test_the_split_is_the_same_whole_and_character_by_character(fmt: str, text: str, want: tuple[str, str]) -> None:
    assert split(fmt, [text]) == want
    assert split(fmt, list(text)) == want
    assert split(fmt, [text[:3], text[3:9], text[9:]]) == want


def test_the_format_follows_the_template_and_the_prompts_end() -> None:
    assert reasoning_format(False, "<|im_start|>assistant\n<think>\n") == ""
    assert reasoning_format(True, "<|im_start|>assistant\n") == "think"
    assert reasoning_format(True, "<|im_start|>assistant\n<think>\n") == "think_open"
    assert reasoning_format(True, "<|im_start|>assistant\n<think>\n\n</think>\n\n") == "think"
