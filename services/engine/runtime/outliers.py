"""Whether a GGUF model's repacked products (the `ggufr` matmul kind) keep the coarse blocks' outliers as floats,
decided by measuring the model itself when its runner is built.

The repacked products quantize activations to int8 per 32 elements, as llama.cpp does.  Where a hidden state
has outlier channels (SmolLM2's do: one element of a block 5-40x its row's root mean square), that element
sets the block's scale and the other 31 lose most of their bits; kept as a float (meshkernels/cpu_gguf_r16.cpp,
kind + OUTLIERS), SmolLM2's mean |d logprob| against float32 goes from 0.034 to 0.015.  It costs 5-12% of a
step's time (the outliers' products and the rows' statistics), so it is on only where it matters: the runner
continues the openings of three fixed texts greedily (with it on), scores those tokens with it off and on (one
prefill each) and keeps it on where their log-probs differ by more than THRESHOLD on average, the plain
products' error being most of that difference (measured 0.031 / 0.017 / 0.011 for SmolLM2 / Qwen2.5-0.5B /
1.5B, whose plain errors against float32 are 0.034 / 0.014 / 0.010: on, off, off).
INFERMESH_GGUF_OUTLIERS=on|off overrides the measurement (auto, the default, measures).  The measured difference
is cached under $INFERMESH_HOME/plans/ per model file (size and modification time), execution plan, kernel source
and build, as the matmul tuning is: the probe costs 0.6-4.4 s of a start (SmolLM2 to Qwen2.5-1.5B, 2 cores),
paid once per machine and model.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mesh.files import exclusive_lock, write_atomic
from mesh.models import home
from meshkernels import cpu_ops
from services.engine.core.block_manager import BlockTable
from services.engine.core.request import SamplingParams
from services.engine.core.scheduler import Chunk
from services.engine.runtime import tune
from services.engine.runtime.models.linear import GgufRepackedLinear

ModelRunner = Any       # services/engine/runtime/model_runner.py's, which imports this module

log = logging.getLogger(__name__)

VERSION = 1             # of the probe (its texts, lengths, scoring): part of the cache key
THRESHOLD = 0.02        # the quality bar (mean |d logprob| against float32): above it, the outliers stay floats
SETTINGS = ("auto", "on", "off")
OPENING = 24            # tokens of each text the model continues
GENERATE = 32           # greedy tokens it continues them with
TEXTS = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based ink and a screw press adapted from wine making. Within fifty years, "
    "presses were running in more than two hundred European cities, and the price of books fell sharply.",
    "To make a simple tomato sauce, warm olive oil in a wide pan, add sliced garlic and cook it until it "
    "smells sweet but has not browned. Pour in crushed tomatoes, season with salt, and let the sauce "
    "simmer gently for twenty minutes, stirring now and then, before tearing in a few basil leaves.",
    "def merge_sorted(a, b):\n    out = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n            out.append(a[i])\n            i += 1\n        else:\n"
    "            out.append(b[j])\n            j += 1\n    return out + a[i:] + b[j:]\n",
)


@dataclass
class _Text:
    """What ModelRunner reads of a request, for one probe text."""

    all_ids: list[int]
    prompt_ids: list[int]
    table: BlockTable
    draft: list[int] = field(default_factory=list)
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(prompt_logprobs=True, top_logprobs=5))
    adapter: None = None
    prompt_logprobs: list[Any] = field(default_factory=list)


def _switch(model: Any, linears: list[GgufRepackedLinear], on: bool) -> None:
    for linear in linears:
        linear.outliers = on
    if hasattr(model, "refresh_fused"):      # the one-call decode layers hold the kinds too
        model.refresh_fused()


def repacked_linears(model: Any) -> list[GgufRepackedLinear]:
    """Every GgufRepackedLinear the model's object graph holds (fused ones, split ones, the head), once each."""
    found: list[GgufRepackedLinear] = []
    seen: set[int] = set()

    def walk(obj: Any) -> None:
        if id(obj) in seen or isinstance(obj, (torch.Tensor, str, bytes, int, float, bool, type(None))):
            return
        seen.add(id(obj))
        if isinstance(obj, GgufRepackedLinear) and obj.kind is not None:
            found.append(obj)
        if isinstance(obj, dict):
            children: Any = obj.values()
        elif isinstance(obj, (list, tuple, set, frozenset)):
            children = obj
        elif not isinstance(obj, type) and type(obj).__module__.startswith("services.engine.runtime.models"):
            children = vars(obj).values() if hasattr(obj, "__dict__") else ()   # the model's own objects only
        else:
            children = ()
        for child in children:
            walk(child)

    walk(model)
    return found


def _tokens(runner: ModelRunner) -> list[list[int]]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(runner.folder / "tokenizer.json"))
    return [tokenizer.encode(text).ids for text in TEXTS]


def _continue(runner: ModelRunner, prompts: list[list[int]], tables: list[BlockTable]) -> list[list[int]]:
    """Each prompt and its greedy continuation of GENERATE tokens (one prefill, then a decode step a token)."""
    texts = [_Text(list(ids), list(ids), table, sampling=SamplingParams()) for ids, table in zip(prompts, tables,
                                                                                                strict=True)]
    chunks = [Chunk(text, 0, len(text.all_ids), True) for text in texts]     # type: ignore[arg-type]
    for _ in range(GENERATE):
        out = runner.run(chunks, greedy=True)       # token ids, or logits where the model has no greedy shortcut
        for text, token in zip(texts, (out.argmax(-1) if out.dim() == 2 else out).tolist(), strict=True):
            text.all_ids.append(int(token))
        chunks = [Chunk(text, len(text.all_ids) - 1, 1, True) for text in texts]   # type: ignore[arg-type]
    return [text.all_ids for text in texts]


def difference(runner: ModelRunner, linears: list[GgufRepackedLinear]) -> float | None:
    """Mean |d logprob| of the model's own greedy continuations of the texts' openings (made with the outliers
    on), scored with them off and on (one prefill each), as bench/quality.py scores float32 against a plan; None
    where the runner cannot score them here (too few KV blocks, no tokenizer it can read)."""
    try:
        texts = _tokens(runner)
    except Exception as exc:       # no tokenizer.json, or one the tokenizers package cannot read
        log.info("outlier probe skipped: %s", exc)
        return None
    prompts = [ids[:OPENING] for ids in texts if len(ids) > 1]
    length = OPENING + GENERATE + 1
    per = -(-length // runner.block_size)
    if not prompts or length > runner.max_context or per * len(prompts) > runner.num_blocks:
        return None
    tables = [BlockTable(list(range(i * per, (i + 1) * per))) for i in range(len(prompts))]
    _switch(runner.model, linears, True)
    full = _continue(runner, prompts, tables)
    scored: list[list[float]] = []
    for on in (False, True):
        _switch(runner.model, linears, on)
        probes = [_Text(ids, ids, table) for ids, table in zip(full, tables, strict=True)]
        runner.run([Chunk(probe, 0, len(probe.all_ids), True) for probe in probes])   # type: ignore[arg-type]
        scored.append([entry.logprob for probe, prompt in zip(probes, prompts, strict=True)
                       for entry in probe.prompt_logprobs[len(prompt):]])
    gaps = [abs(off - on) for off, on in zip(*scored, strict=True)]
    return sum(gaps) / len(gaps) if gaps else None


def decide(runner: ModelRunner) -> bool | None:
    """Set the runner's model's repacked products' outliers on or off (INFERMESH_GGUF_OUTLIERS, else measured);
    the choice, or None for a model without repacked products."""
    linears = repacked_linears(runner.model)
    if not linears:
        return None
    setting = os.environ.get("INFERMESH_GGUF_OUTLIERS", "auto").strip().lower() or "auto"
    if setting not in SETTINGS:
        raise ValueError(f"INFERMESH_GGUF_OUTLIERS must be one of {', '.join(SETTINGS)}, got {setting!r}")
    if setting == "auto":
        measured, source = (None, "") if runner.task == "embed" else _measured(runner, linears)
        on = measured is not None and measured > THRESHOLD
        log.info("%s: repacked products' outliers %s (mean |d logprob| between off and on %s, threshold %.3f)",
                 runner.folder.name, "kept as floats" if on else "quantized with their blocks",
                 "not measured" if measured is None else f"{measured:.4f}, {source}", THRESHOLD)
    else:
        on = setting == "on"
    _switch(runner.model, linears, on)
    return on


def cache_file(runner: ModelRunner) -> Path | None:
    """Where the probe's answer for this runner's model and plan is cached, or None for a model without a file of
    its own to key it by."""
    try:
        parts = [VERSION, str(Path(runner.folder).resolve()), tune.file_key(Path(runner.folder)), str(runner.plan),
                 cpu_ops.build_flags(), torch.__version__, cpu_ops.source_digests()]
    except OSError:
        return None
    key = hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]
    return home() / "plans" / f"outliers-{key}.json"


def _measured(runner: ModelRunner, linears: list[GgufRepackedLinear]) -> tuple[float | None, str]:
    """The probe's difference (cached, else measured and cached) and where it came from; None where it cannot be
    measured here (not cached: another start may)."""
    cache = cache_file(runner)
    if cache is None:
        return _probe(runner, linears), "measured"
    with exclusive_lock(cache.with_suffix(".lock")):    # engines starting together: one probes, the rest read
        try:
            return float(json.loads(cache.read_text())["difference"]), f"cached in {cache}"
        except FileNotFoundError:
            pass
        except (OSError, ValueError, KeyError, TypeError):
            log.warning("ignoring an unreadable outlier probe cache %s", cache)
        measured = _probe(runner, linears)
        if measured is not None:
            write_atomic(cache, json.dumps({"difference": measured, "model": runner.folder.name}).encode())
        return measured, "measured"


def _probe(runner: ModelRunner, linears: list[GgufRepackedLinear]) -> float | None:
    try:
        return difference(runner, linears)
    except Exception:            # the probe is a measurement: a model it cannot run keeps the plain products
        log.exception("%s: the outlier probe failed; repacked products' outliers stay quantized", runner.folder.name)
        return None


def keep(model: Any, on: bool | None) -> None:
    """A swapped-in model's repacked products follow the runner's decision (measuring again would write KV
    blocks that running requests hold)."""
    _switch(model, repacked_linears(model), bool(on))
