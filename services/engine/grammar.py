"""Structured output: a request's constraint compiled to a grammar, and the token masks that hold it.

xgrammar does the work (bench/grammar.py measured it against llguidance on this model's vocabulary:
filling the masks of 16 constrained rows took about a tenth of the time; the README gives the
figures).  Compiled grammars are cached by constraint, so the JSON schema an application sends with
every request is compiled once.  Compiling runs off the step thread (the server calls `matcher`
in a worker thread before adding the request); the step thread only fills and applies masks.

A constrained request's output is the constraint's prefix, then a text the grammar accepts, then
its suffix, then an end-of-sequence token: once the grammar is complete only the end-of-sequence
ids are allowed, so the request ends with finish_reason "stop".
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mesh import tools
from mesh.constraints import Constraint
from mesh.errors import InvalidArgument
from meshpb.v1 import common_pb2

CACHE_SIZE = 256                 # compiled grammars kept, least recently used dropped first


class Matcher:
    """One request's position in its grammar."""

    def __init__(self, compiled: Any, cached: bool = False):
        import xgrammar as xgr
        self._m = xgr.GrammarMatcher(compiled)
        self.cached = cached                 # the grammar was compiled before (for the metrics)

    def accept(self, token: int) -> bool:
        return bool(self._m.accept_token(token))

    @property
    def done(self) -> bool:
        """The grammar is complete and its end-of-sequence token was accepted."""
        return bool(self._m.is_terminated())

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)


class Grammars:
    """Compiles constraints for one model's vocabulary (its tokenizer, its end-of-sequence ids)."""

    def __init__(self, folder: str | Path, vocab_size: int, eos_token_ids: Collection[int]):
        self.folder = Path(folder)
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._compiler: Any = None
        self._cache: OrderedDict[Constraint, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.compiles = 0            # cache misses
        self.hits = 0

    def _get_compiler(self) -> Any:
        if self._compiler is None:
            import xgrammar as xgr
            from transformers import AutoTokenizer
            tokenizer = AutoTokenizer.from_pretrained(self.folder)
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.eos_token_ids)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler

    def compile(self, c: Constraint) -> Any:
        """The constraint's compiled grammar (cached).  InvalidArgument when it does not compile."""
        return self._compile(c)[0]

    def _compile(self, c: Constraint) -> tuple[Any, bool]:
        """(compiled grammar, whether it was cached)."""
        with self._lock:
            compiled = self._cache.get(c)
            if compiled is not None:
                self._cache.move_to_end(c)
                self.hits += 1
                return compiled, True
            compiler = self._get_compiler()
            try:
                compiled = compiler.compile_grammar(_grammar(c))
            except InvalidArgument:
                raise
            except Exception as exc:       # xgrammar reports a bad schema / regex / grammar this way
                raise InvalidArgument(f"the {c.kind} constraint cannot be compiled: {_first_line(exc)}") from None
            self.compiles += 1
            self._cache[c] = compiled
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
            return compiled, False

    def matcher(self, c: Constraint, replay: Sequence[int] = ()) -> Matcher:
        """A matcher at the grammar's start, advanced over `replay` (tokens streamed before a failover)."""
        compiled, cached = self._compile(c)
        m = Matcher(compiled, cached)
        for i, token in enumerate(replay):
            if not m.accept(token):
                raise InvalidArgument(f"resumed token {i} (id {token}) does not follow the request's "
                                      f"{c.kind} constraint")
        return m


def constraint_from_pb(c: common_pb2.Constraint) -> Constraint:
    """The native request's Constraint message (meshpb.v1 SamplingParams.constraint)."""
    kind = c.WhichOneof("kind")
    if kind is None:
        raise InvalidArgument("constraint names no kind: set json_schema, json_object, regex, grammar or tool_calls")
    return Constraint(kind, "" if kind == "json_object" else getattr(c, kind), c.prefix, c.suffix)


def _grammar(c: Constraint) -> Any:
    import xgrammar as xgr
    if c.kind == "json_schema":
        body = xgr.Grammar.from_json_schema(c.text, any_whitespace=False, strict_mode=True)
    elif c.kind == "json_object":
        body = xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
    elif c.kind == "regex":
        body = xgr.Grammar.from_regex(c.text)
    elif c.kind == "tool_calls":
        tools.check(c.text, [])
        body = xgr.Grammar.from_structural_tag(json.dumps(tools.structural_tag(c.text)))
    else:
        body = xgr.Grammar.from_ebnf(c.text)
    parts = [body]
    if c.prefix:
        parts.insert(0, xgr.Grammar.from_ebnf(f"root ::= {_literal(c.prefix)}"))
    if c.suffix:
        parts.append(xgr.Grammar.from_ebnf(f"root ::= {_literal(c.suffix)}"))
    return xgr.Grammar.concat(*parts) if len(parts) > 1 else body


def _literal(text: str) -> str:
    """An EBNF string literal for `text` (JSON's escapes are the grammar's)."""
    return json.dumps(text, ensure_ascii=False)


def _first_line(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return text[-1][:300] if text else type(exc).__name__


def apply_masks(scores: torch.Tensor, logits: torch.Tensor, rows: Sequence[tuple[int, Matcher]]) -> None:
    """Mask, in place, the rows of `scores` that a grammar constrains: every token the row's matcher does
    not accept next becomes -inf.  One bitmask for the batch, filled row by row, unpacked and applied at
    once (numpy's unpackbits: several times faster on the CPU than xgrammar's own apply).  A row left
    with no token at all (min_tokens banning the end-of-sequence token a complete grammar needs) is
    masked from its unprocessed logits instead: the grammar wins."""
    if not rows:
        return
    import xgrammar as xgr
    vocab = scores.shape[-1]
    bitmask = xgr.allocate_token_bitmask(len(rows), vocab)
    for i, (_, m) in enumerate(rows):
        m.fill(bitmask, i)
    # Bit j of 32-bit word w is token 32w + j: little-endian bytes, least significant bit first.
    words = bitmask.numpy().astype("<i4", copy=False)
    bits = np.unpackbits(words.view(np.uint8), axis=-1, bitorder="little")[:, :vocab]
    banned = torch.from_numpy(bits.view(np.bool_)).logical_not_()
    index = [r for r, _ in rows]
    picked = scores[index].masked_fill_(banned, float("-inf"))
    for i in torch.isneginf(picked).all(dim=1).nonzero().flatten().tolist():
        picked[i] = logits[index[i]].masked_fill(banned[i], float("-inf"))
    scores[index] = picked
