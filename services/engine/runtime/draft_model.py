"""Draft-model speculative decoding: a smaller model with the same tokenizer proposes each request's next
tokens, the engine's model verifies them in one batched step (speculative sampling's rule: draft_verify.py).

`infermesh up --model qwen15 --draft-model qwen05`: the draft runs in the engine's process, on its step
thread, with a KV cache of its own (its own paged blocks and prefix cache, keyed like the engine's by the
request's cache salt).  Proposing k tokens for the step's decode rows is k forward passes of the draft, all
the rows in each: the first computes what the draft's cache lacks of each request (its prompt the first
time, else the one or two tokens the last verification added), the others one drafted token each.  Every
drafted token is drawn from the draft's own distribution under the request's sampling parameters (a greedy
request's: its argmax), and that distribution is kept (Request.draft_q) for the verification, which keeps
or replaces each token so that the output is distributed as the engine's model alone would sample it.  So
a poor draft costs speed, never correctness; its KV being stale (a request resumed elsewhere, blocks the
shared cache imported for the engine only) costs a recomputation, no more.

After the verification the draft's cache holds the tokens that were kept; a rejected draft token's KV is
overwritten by the next proposal.  A request's draft state is dropped when it ends (Engine._finish).
Plain torch on top of ModelRunner; the scheduler decides who drafts and how many (Scheduler._propose).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from services.engine.core.block_manager import BlockManager, BlockTable
from services.engine.core.request import Request, SamplingParams
from services.engine.core.scheduler import Chunk
from services.engine.runtime import draft_verify, sampler
from services.engine.runtime.model_runner import ModelRunner

log = logging.getLogger(__name__)
PLAIN = SamplingParams()      # what the draft's runner reads of a request's sampling: no prompt logprobs, no pooling


@dataclass
class _State:
    table: BlockTable
    ids: list[int] = field(default_factory=list)    # the tokens whose KV the draft's cache holds, in order


@dataclass
class _View:
    """What ModelRunner reads of a request, for the draft's own cache: the request's tokens and the drafted
    ones appended so far, the draft's block table."""

    all_ids: list[int]
    prompt_ids: list[int]
    state: _State
    draft: list[int] = field(default_factory=list)
    sampling: SamplingParams = PLAIN
    adapter: None = None

    @property
    def table(self) -> BlockTable:
        return self.state.table


def check_compatible(target: ModelRunner, draft: ModelRunner) -> None:
    """A draft must speak the engine model's tokenizer: the same vocabulary (its embedding may be narrower)
    and end-of-sequence ids.  ValueError with what differs."""
    if draft.vocab_size > target.vocab_size:
        raise ValueError(f"the draft model's vocabulary ({draft.vocab_size}) is larger than the model's "
                         f"({target.vocab_size}): not the same tokenizer")
    if not set(draft.eos_token_ids) & set(target.eos_token_ids):
        raise ValueError(f"the draft model ends sequences with {sorted(draft.eos_token_ids)}, the model with "
                         f"{sorted(target.eos_token_ids)}: not the same tokenizer")
    mine, theirs = _vocabulary(target), _vocabulary(draft)
    if mine is not None and theirs is not None and mine != theirs:
        raise ValueError("the draft model's tokenizer.json vocabulary differs from the model's: drafts would be "
                         "other tokens' ids")


def _vocabulary(runner: ModelRunner) -> dict[str, int] | None:
    path = runner.folder / "tokenizer.json"
    if not path.is_file():
        return None
    model = json.loads(path.read_text()).get("model", {})
    vocab = model.get("vocab")
    return vocab if isinstance(vocab, dict) else None


class DraftModel:
    def __init__(self, runner: ModelRunner, width: int):
        """runner: the draft's model and KV cache; width: the engine model's logits width (the draft's
        probabilities are padded to it)."""
        self.runner = runner
        self.width = width
        self.blocks = BlockManager(runner.num_blocks, runner.block_size, namespace=b"draft")
        self._states: dict[str, _State] = {}
        self.seconds = 0.0            # the last proposal's time (the engine's speed-up measurement)

    def release(self, request_id: str) -> None:
        """The request ended: its draft blocks go back."""
        state = self._states.pop(request_id, None)
        if state is not None:
            self.blocks.free_table(state.table)

    def propose(self, pairs: Sequence[tuple[Request, int]]) -> list[list[int]]:
        """Up to k drafted tokens for each (request, k), in order; their draft probabilities in each request's
        draft_q ((k, width), None for a greedy request: its drafts are the draft's argmax).  A request whose
        draft blocks are not there gets none.  A draft model that fails proposes nothing this step (logged,
        its state of these requests dropped): the requests go on without drafts, none of them fails."""
        try:
            return self._propose(pairs)
        except Exception:              # any failure of the draft's forward: speculation is an optimization
            log.exception("the draft model failed; this step runs without drafts")
            for req, _ in pairs:
                req.draft_q = None
                self.release(req.request_id)
            self.seconds = 0.0
            return [[] for _ in pairs]

    def _propose(self, pairs: Sequence[tuple[Request, int]]) -> list[list[int]]:
        started = time.perf_counter()
        live: list[tuple[Request, int, _View]] = []
        out: dict[int, list[int]] = {}
        qs: dict[int, list[torch.Tensor]] = {}
        for req, k in pairs:
            view = self._view(req, k)
            if view is not None:
                live.append((req, k, view))
                out[id(req)], qs[id(req)] = [], []
        for depth in range(max((k for _, k, _ in live), default=0)):
            rows = [(req, view) for req, k, view in live if k > depth]
            chunks = []
            for _, view in rows:
                start = len(view.state.ids)
                chunks.append(Chunk(view, start, len(view.all_ids) - start, True))   # type: ignore[arg-type]
                view.state.ids = list(view.all_ids)
            tokens, probs = self._sample(chunks, rows)
            for (req, view), token, q in zip(rows, tokens, probs, strict=True):
                view.all_ids.append(token)
                out[id(req)].append(token)
                if q is not None:
                    qs[id(req)].append(q)
        for req, _, _ in live:
            req.draft_q = torch.stack(qs[id(req)]) if qs[id(req)] else None
        self.seconds = time.perf_counter() - started
        return [out.get(id(req), []) for req, _ in pairs]

    def _view(self, req: Request, k: int) -> _View | None:
        """The request's view for this proposal, its draft state caught up on what is still valid: the tokens
        its cache holds that the request still has (a rejected draft's are not)."""
        state = self._states.get(req.request_id)
        ids = req.all_ids
        if len(ids) + k - 1 > self.runner.max_context:
            return None
        if state is None:
            if not self.blocks.can_allocate(ids, salt=req.cache_salt):
                return None
            table, cached = self.blocks.allocate(ids, salt=req.cache_salt)
            state = self._states[req.request_id] = _State(table, list(ids[:cached]))
        valid = 0
        limit = min(len(state.ids), len(ids) - 1)        # the last token is always fed: its logits draw the first
        while valid < limit and state.ids[valid] == ids[valid]:
            valid += 1
        state.ids = state.ids[:valid]
        self.blocks.commit(state.table, ids, valid)       # full blocks of the request's own tokens: reusable
        if not self.blocks.can_grow(state.table, len(ids) + k - 1):
            return None
        self.blocks.grow(state.table, len(ids) + k - 1)
        return _View(list(ids), req.prompt_ids, state)

    def _sample(self, chunks: list[Chunk], rows: list[tuple[Request, _View]]
                ) -> tuple[list[int], list[torch.Tensor | None]]:
        """One forward pass of the draft: each row's drafted token and, unless greedy, the distribution it was
        drawn from (padded to the engine model's width)."""
        params = [req.sampling for req, _ in rows]
        greedy = all(p.greedy for p in params)
        logits = self.runner.run(chunks, greedy=greedy)
        if logits.dim() == 1:
            return logits.tolist(), [None] * len(rows)
        tokens: list[int] = []
        probs: list[torch.Tensor | None] = []
        dist = sampler.distributions(logits.float(), params)
        ids = torch.arange(dist.shape[1])
        for (req, view), p, row in zip(rows, params, dist, strict=True):
            if p.greedy:
                tokens.append(int(torch.argmax(row)))
                probs.append(None)
                continue
            position = len(view.all_ids) - len(req.all_ids) + req.num_generated
            tokens.append(sampler.inverse_cdf(ids, row, draft_verify.draft_uniform(p.seed, position)))
            probs.append(torch.nn.functional.pad(row, (0, self.width - row.shape[0])))
        return tokens, probs
