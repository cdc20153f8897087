"""Several choices for one request (`n`, and completions' list of prompts), and each choice's answer
as OpenAI shapes it (text, tool calls, logprobs).

Each choice is its own router call.  A prompt's first choice goes first; once it streams its first
token, its prompt's KV blocks are in that engine's prefix cache, and the prompt's other n-1 choices
start there (pinned to that replica): they prefill only the prompt's last, partial block, and their
`cached_tokens` show it.  A follower whose replica is gone by then goes wherever the router sends it.
With a seed, choice j of a prompt samples with seed + j, so the same request gives the same choices.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Any

import grpc

from mesh import tools
from mesh.chat import Message
from mesh.clients.router_client import Delta, GenerateSpec, TokenLogprob
from mesh.clients.router_pool import Routers
from mesh.tool_stream import CallFragment
from services.edge.errors import from_grpc
from services.edge.gateway.safety import NO_RULES, ContentPolicy, OutputGuard
from services.edge.surfaces.responses import LogprobFormatter

Piece = str | tools.ToolCall | CallFragment      # what a delta adds for the client (Choice.add)

_UNPIN = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND)


def specs(spec: GenerateSpec) -> list[GenerateSpec]:
    """One router call per choice, in choice order: prompt by prompt, n per prompt."""
    prompts = spec.prompts or (spec.prompt,)
    out = []
    for p, prompt in enumerate(prompts):
        for j in range(spec.n):
            index = p * spec.n + j
            seed = spec.sampling.seed
            sampling = spec.sampling if seed is None or not j else \
                dataclasses.replace(spec.sampling, seed=(seed + j) % (1 << 64))
            out.append(dataclasses.replace(spec, prompt=prompt, sampling=sampling, prompts=(), n=1,
                                           request_id=spec.request_id + (f"-{index}" if index else "")))
    return out


async def fan_out(router: Routers, calls: list[GenerateSpec], n: int, timeout: float | None,
                  running: dict[int, asyncio.Task[None]] | None = None) -> AsyncGenerator[tuple[int, Delta], None]:
    """(choice index, delta) as they come, from every choice's call (`specs`: n per prompt); a call's
    error is raised here (the other calls are then cancelled, as they are when the caller stops
    iterating or closes the generator).  `running` (when given) holds each choice's task: `stop`
    ends one choice's call alone (its deltas then end)."""
    queue: asyncio.Queue[tuple[int, Delta | BaseException | None]] = asyncio.Queue()
    tasks: list[asyncio.Task[None]] = []
    running = {} if running is None else running

    def start(index: int, call: GenerateSpec, unpin_on_failure: bool = False) -> None:
        task = asyncio.create_task(run(index, call, unpin_on_failure))
        tasks.append(task)
        running[index] = task

    async def run(index: int, call: GenerateSpec, unpin_on_failure: bool = False) -> None:
        sent = False
        try:
            async for d in router.generate(call, timeout=timeout):
                if not sent and index % n == 0:             # a leader: its prompt's other choices may start
                    replica = d.served_by.replica if d.served_by else ""
                    for j in range(1, n):
                        follower = calls[index + j]
                        pinned = follower.pinned_replica or replica
                        start(index + j, dataclasses.replace(follower, pinned_replica=pinned),
                              not follower.pinned_replica)
                sent = True
                await queue.put((index, d))
            await queue.put((index, None))
        except grpc.aio.AioRpcError as err:
            if unpin_on_failure and not sent and err.code() in _UNPIN:
                await run(index, calls[index])
            else:
                await queue.put((index, err))
        except asyncio.CancelledError:
            queue.put_nowait((index, None))          # stopped alone (`stop`): its stream has ended
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the reader, which raises it
            await queue.put((index, exc))

    for index in range(0, len(calls), n):
        start(index, calls[index])
    left = len(calls)
    try:
        while left:
            index, item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def stop(running: dict[int, asyncio.Task[None]], index: int) -> None:
    """End choice `index`'s router call (fan_out's `running`): its engine stops generating it."""
    task = running.get(index)
    if task is not None:
        task.cancel()


class Choice:
    """One choice's answer, built delta by delta: its text (tool calls read out of it when the request
    has tools), its logprobs, its final message."""

    def __init__(self, index: int, chat: bool, spec: GenerateSpec, prompt: str,
                 policy: ContentPolicy = NO_RULES):
        self.index = index
        self.chat = chat
        self.echo = prompt if spec.echo else ""
        self.prompt_only = spec.prompt_only       # echo with max_tokens 0: the generated token is dropped
        # Offsets count from the start of the prompt; with echo the prompt's own tokens come first.
        self.lp_start = 0 if spec.echo else len(prompt)
        self.lp = LogprobFormatter(chat, self.lp_start) if spec.sampling.logprobs else None
        self.prompt_logprobs: list[TokenLogprob] = []
        self.parser = tools.CallParser(_tools(spec)) if spec.tool_calls else None
        self.single = spec.tool_calls == "single"
        self.parts: list[str] = []
        self.logprobs: list[TokenLogprob] = []     # released: their text went out
        # Logprobs wait with the text they belong to: (characters fed to the thoughts' guard and to the answer's
        # once this delta's text was, its entry); they go out when both guards have released that many
        # characters (a thinking model's tokens are its thoughts' text: they must not spell what that guard hides).
        self.held_logprobs: list[tuple[int, int, TokenLogprob]] = []
        self.new_logprobs: list[TokenLogprob] = []  # released by the last delta (a stream's chunk)
        self.filtered = False                  # a top_logprobs alternative was dropped: never cached
        self.calls: list[tools.ToolCall] = []
        self.call_index: dict[str, int] = {}   # call id -> its index in tool_calls (streamed pieces name it)
        self.streamed: set[str] = set()         # calls whose arguments went out in pieces
        self.final: Delta | None = None
        self.started = False
        self.guard = OutputGuard(policy)       # output content rules (services/edge/gateway/safety.py)
        self.think_guard = OutputGuard(policy)  # the same rules over a reasoning model's thoughts
        self.reasoning: list[str] = []         # reasoning_content released so far
        self.new_reasoning = ""                # released by the last delta
        self.thoughts_shown = 0                # characters of reasoning_content given out (a block drops the rest)
        self.first: Delta | None = None
        self.generated = 0                     # token ids so far
        self.cut = False                       # its last chunk is out: later deltas are dropped
        self.stop_call: Callable[[], None] = lambda: None   # ends its router call (fan_out's `stop`)

    @property
    def blocked(self) -> bool:
        """The output rules stopped this choice (its final is then made here)."""
        return self.guard.blocked is not None or self.think_guard.blocked is not None

    def add(self, d: Delta) -> list[Piece]:
        """What this delta adds for the client: text pieces, pieces of tool calls' arguments and whole tool calls
        (none once blocked)."""
        if self.blocked:
            return []
        self.first = self.first or d
        self.generated += len(d.ids)
        self.prompt_logprobs.extend(d.prompt_logprobs)
        if d.finish_reason is not None:
            self.final = d
        self.new_logprobs = []
        if self.prompt_only:
            return []
        entries = self._screened(d.logprobs)
        # Answer text means the thoughts are over: what their guard still holds is released now, not at the end.
        thoughts_over = bool(self.final or d.text)
        self.new_reasoning = self.think_guard.feed(d.reasoning) + (self.think_guard.finish() if thoughts_over else "")
        text = self.guard.feed(d.text) + (self.guard.finish() if self.final else "")
        if self.new_reasoning and not self.blocked:
            self.reasoning.append(self.new_reasoning)
            self.thoughts_shown += len(self.new_reasoning)
        if self.blocked:                       # the rest of this choice is not generated
            self.final = dataclasses.replace(
                d, text="", finish_reason="content_filter", prompt_tokens=self.first.prompt_tokens,
                completion_tokens=self.generated, served_by=d.served_by or self.first.served_by)
        else:
            self.held_logprobs.extend((self.think_guard.fed, self.guard.fed, e) for e in entries)
        # Out go the entries whose delta's text all went out (at the end, all of them unless blocked);
        # the rest of a blocked choice's are dropped with its held text.
        done = self.final is not None and not self.blocked
        cut = len(self.held_logprobs) if done else next(
            (k for k, (thought, end, _) in enumerate(self.held_logprobs)
             if end > self.guard.released or thought > self.thoughts_shown), len(self.held_logprobs))
        self.new_logprobs = [e for _, _, e in self.held_logprobs[:cut]]
        self.held_logprobs = [] if self.blocked else self.held_logprobs[cut:]
        self.logprobs.extend(self.new_logprobs)
        pieces: list[Piece] = []
        if self.parser is None:
            pieces = [text] if text else []
        else:
            # A call cut by the rules is dropped whole: its partial markup is not text to give out.
            pieces = self.parser.feed(text) + (self.parser.finish() if done else [])
        kept: list[Piece] = []
        for p in pieces:
            if isinstance(p, tools.ToolCall | CallFragment):
                if self.single and self.calls:
                    continue
                self.call_index.setdefault(p.id, len(self.calls))
                if isinstance(p, tools.ToolCall):
                    self.calls.append(p)
            else:
                self.parts.append(p)
            kept.append(p)
        return kept

    def _screened(self, entries: Sequence[TokenLogprob]) -> list[TokenLogprob]:
        """Entries without the top_logprobs alternatives that would complete an output rule's match, in the
        answer or in the thoughts (an entry's token may be either's)."""
        if not self.guard.policy.output:
            return list(entries)
        out, before = [], ""
        for e in entries:
            top = tuple(t for t in e.top if t.token_id == e.token_id
                        or not (self.guard.completes_match(before, t.token)
                                or self.think_guard.completes_match(before, t.token)))
            if len(top) != len(e.top):
                self.filtered = True
                e = dataclasses.replace(e, top=top)
            out.append(e)
            before += e.token
        return out

    def stream_logprobs(self, d: Delta) -> dict[str, Any] | None:
        """The logprobs the last delta released (`add`), formatted once: completions' offsets run on."""
        entries = [] if self.prompt_only else self.new_logprobs
        return self.lp.format(entries) if self.lp and entries else None

    def echo_logprobs(self) -> dict[str, Any] | None:
        """The echoed prompt's logprobs, for the stream's first chunk of this choice."""
        return self.lp.format(self.prompt_logprobs) if self.lp and self.prompt_logprobs else None

    @property
    def finish_reason(self) -> str | None:
        if self.final is None:
            return None
        if self.prompt_only:
            return "length"
        if self.blocked:
            return "content_filter"
        # A call the token limit cut off is "length" (as OpenAI reports it): its arguments may be incomplete JSON,
        # which "tool_calls" would tell a client to run.
        cut = self.parser is not None and self.parser.unclosed and self.final.finish_reason == "length"
        return "tool_calls" if self.calls and not cut else self.final.finish_reason

    def body(self) -> dict[str, Any]:
        """The choice of a whole (not streamed) answer."""
        text = "".join(self.parts)
        choice: dict[str, Any] = {"index": self.index, "finish_reason": self.finish_reason,
                                  "logprobs": LogprobFormatter(self.chat, self.lp_start).format(
                                      self.prompt_logprobs + self.logprobs) if self.lp else None}
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text.strip() if self.calls else text}
            if self.reasoning:
                message["reasoning_content"] = "".join(self.reasoning)
            if self.calls:
                message["content"] = message["content"] or None
                message["tool_calls"] = [c.as_dict() for c in self.calls]
            choice["message"] = message
        else:
            choice["text"] = self.echo + text
        return choice

    def delta(self, pieces: Sequence[Piece]) -> dict[str, Any]:
        """A streamed chunk's `delta` (chat) for these pieces; the first carries the role.  A call's first
        piece carries its id, type and name, the next ones only their piece of its arguments (OpenAI's
        `function.arguments` deltas); a call that was not streamed comes whole."""
        delta: dict[str, Any] = {}
        if not self.started:
            delta["role"] = "assistant"
            self.started = True
        text = "".join(p for p in pieces if isinstance(p, str))
        if self.new_reasoning and not self.blocked:
            delta["reasoning_content"] = self.new_reasoning
        if text or not (pieces or "reasoning_content" in delta):
            delta["content"] = text
        self.streamed.update(p.id for p in pieces if isinstance(p, CallFragment))
        calls: list[dict[str, Any]] = []
        for p in pieces:
            if isinstance(p, CallFragment):
                head = {"id": p.id, "type": "function"} if p.first else {}
                name = {"name": p.name} if p.first else {}
                calls.append({"index": self.call_index[p.id], **head, "function": {**name, "arguments": p.arguments}})
            elif isinstance(p, tools.ToolCall) and p.id not in self.streamed:
                calls.append({"index": self.call_index[p.id], **p.as_dict()})
        if calls:
            delta["tool_calls"] = calls
        return delta


def _tools(spec: GenerateSpec) -> list[dict[str, Any]]:
    return json.loads(spec.tools) if spec.tools else []


def usage(choices: Sequence[Choice], n: int) -> dict[str, Any]:
    """OpenAI's usage: each prompt counted once (its first choice's), every choice's completion tokens."""
    leaders = [c.final for c in choices[::n] if c.final is not None]
    prompt = sum(f.prompt_tokens for f in leaders)
    completion = sum(c.final.completion_tokens for c in choices if c.final is not None and not c.prompt_only)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(f.cached_tokens for f in leaders)}}


def meta(choices: Sequence[Choice]) -> dict[str, Any] | None:
    """The `infermesh` object: the first choice's replica and version; with several choices, each one's
    replica and cached prompt tokens (the shared prefill shows there)."""
    first = choices[0].final
    out = first.served_by.as_dict() if first is not None and first.served_by else None
    if out is not None and len(choices) > 1:
        out["choices"] = [{"index": c.index, "replica": c.final.served_by.replica if c.final.served_by else "",
                           "cached_tokens": c.final.cached_tokens} for c in choices if c.final is not None]
    return out


async def store_turn(router: Routers, spec: GenerateSpec, choice: Choice) -> None:
    """Store the choice's turn as it went out (for a Generate with caller_stores_turn, whose router stores none):
    the text released, and its calls as calls."""
    text = "".join(choice.parts)
    calls = json.dumps([c.as_dict() for c in choice.calls]) if choice.calls else ""
    try:
        await router.store_turn(spec, Message("assistant", text.strip() if calls else text, tool_calls=calls))
    except grpc.aio.AioRpcError as err:
        raise from_grpc(err) from None
