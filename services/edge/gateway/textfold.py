"""Text folded for content rules: the same word written another way reads the same.  Pure.

`fold(text)` returns the folded text and, for each of its characters, the index in `text` it came
from, so a match found in the folded text can be cut at the right place in what the client gets.
Folding, character by character:

- Unicode compatibility forms (NFKD): fullwidth `ｂｏｍｂ`, ligatures `ﬁ`, circled or styled letters
  read as plain ones; accents and other combining marks are dropped (`bómb` reads `bomb`);
- format characters (Unicode category Cf: zero-width space and joiners, soft hyphen, word joiner,
  byte-order mark, direction marks) are dropped: `bo\u200bmb` reads `bomb`;
- letters of Cyrillic and Greek that look like Latin ones read as those (`bоmb` with a Cyrillic о);
- lower case, and any run of white space is one space.

What it cannot do (docs/operations.md, "Content safety"): paraphrase, other languages, spelling out
(`b-o-m-b`, `b o m b`), digits for letters (`b0mb`), or text the model is asked to decode (base64, a
cipher).
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Sequence
from functools import lru_cache

# Look-alikes (after lower-casing) of Latin letters, from Cyrillic and Greek: the ones that render the
# same or nearly so in common fonts, upper-case shapes included (Н -> н reads as h, В -> в as b).
CONFUSABLES = str.maketrans({
    # Cyrillic
    "а": "a", "в": "b", "с": "c", "ԁ": "d", "е": "e", "ё": "e", "һ": "h", "н": "h", "і": "i", "ї": "i",
    "ј": "j", "к": "k", "ӏ": "l", "м": "m", "о": "o", "р": "p", "ԛ": "q", "ѕ": "s", "т": "t", "у": "y",
    "ү": "y", "ѡ": "w", "ԝ": "w", "х": "x", "ь": "b",
    # Greek
    "α": "a", "β": "b", "ϲ": "c", "ε": "e", "η": "n", "ι": "i", "ϳ": "j", "κ": "k", "ν": "v", "ο": "o",
    "ρ": "p", "τ": "t", "υ": "u", "χ": "x", "γ": "y", "ω": "w", "ζ": "z", "μ": "u",
    # Latin letters that stand in for others
    "ı": "i", "ȷ": "j", "ſ": "s",
})


@lru_cache(maxsize=4096)
def _char(c: str) -> str:
    """One character folded: "" for a format character or a combining mark."""
    if unicodedata.category(c) == "Cf":
        return ""
    out = []
    for d in unicodedata.normalize("NFKD", c.lower()):
        if unicodedata.combining(d) or unicodedata.category(d) in ("Mn", "Me", "Cf"):
            continue
        out.append(d.lower().translate(CONFUSABLES))
    return "".join(out)


# White space that folding changes: any but a single space (str.isspace's, \x1c-\x1f included).
_CHANGED_SPACE = re.compile(r"[^\S ]| {2}")


def fold(text: str) -> tuple[str, Sequence[int]]:
    """(folded text, for each folded character the index of the character of `text` it came from)."""
    if text.isascii() and not _CHANGED_SPACE.search(text):
        return text.lower(), range(len(text))      # the common case, one character for one (the guard's hot path)
    out: list[str] = []
    where: list[int] = []
    space = False
    for i, c in enumerate(text):
        if c.isspace():
            if not space:
                out.append(" ")
                where.append(i)
            space = True
            continue
        f = c.lower() if c.isascii() else _char(c)
        if not f:
            continue            # dropped: the white space around it still runs together
        space = False
        out.append(f)
        where.extend([i] * len(f))
    return "".join(out), where


def folded(text: str) -> str:
    return fold(text)[0]
