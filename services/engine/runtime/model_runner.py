"""Owns the weights and the paged KV tensors; turns a scheduled batch into next-token logits.

On CUDA a step sends its integer inputs (token ids, positions, cache slots, block tables)
to the GPU as one copy from pinned host memory that does not wait for the GPU, replays a
captured CUDA graph for a pure-decode step (services/engine/runtime/decode_graphs.py), and waits for
the GPU once, at the end, to read the sampled tokens back.  The KV tensors hold one block
more than the block manager hands out: the scratch block that padded graph rows write into.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import mmap
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from mesh.heap import trim_heap
from mesh.models import eos_token_ids, task_of
from meshkernels import paged_attention
from services.engine.core.request import Request
from services.engine.core.scheduler import Chunk
from services.engine.runtime import kv_transfer, outliers
from services.engine.runtime.decode_graphs import DecodeGraphs, padded_tables
from services.engine.runtime.lora import Adapter
from services.engine.runtime.lora import grouped as lora_rows
from services.engine.runtime.models import ARCHITECTURES
from services.engine.runtime.models.attention import AttentionMetadata
from services.engine.runtime.models.config import load_weights
from services.engine.runtime.models.gguf_weights import Weight
from services.engine.runtime.plan import ExecutionPlan
from services.engine.runtime.sampler import token_logprob

log = logging.getLogger(__name__)


def kv_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A KV cache tensor of zeros.  On the CPU it lies in anonymous memory that the kernel zero-fills page by
    page as the cache first writes it: an engine starts without writing its whole KV budget (1-2 s of CPU
    a GiB) and holds only the pages its requests have used.  Under THP_MEM_ALLOC_ENABLE=1 (the engine's
    default: services/engine/__main__.py) those pages are 2 MB ones, as torch's allocator would take."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    memory = mmap.mmap(-1, max(1, count * dtype.itemsize))
    if os.environ.get("THP_MEM_ALLOC_ENABLE") == "1" and hasattr(mmap, "MADV_HUGEPAGE"):
        memory.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(memory, dtype=dtype, count=count).view(shape)      # the tensor keeps `memory`


def pooled_positions(pooling: str, start: int, n: int, prompt_len: int) -> range:
    """The prompt positions of a chunk (positions start .. start + n - 1) an embedding pools: every prompt
    token's ("mean"), the first's ("cls") or the last's ("last")."""
    end = min(start + n, prompt_len)
    if pooling == "cls":
        return range(0, 1) if start == 0 else range(0)
    if pooling == "last":
        return range(prompt_len - 1, prompt_len) if start < prompt_len <= start + n else range(0)
    return range(start, max(start, end))


class _ExtraRows:
    """Rows a step computes beyond its sampled ones: prompt tokens' logprobs (sampling.prompt_logprobs) and the
    rows an embedding pools (sampling.pooling)."""

    def __init__(self) -> None:
        self.prompt_rows: list[int] = []
        self.prompt_targets: list[tuple[Request, int]] = []
        self.pool_rows: list[int] = []
        self.pool_targets: list[Request] = []

    @property
    def rows(self) -> list[int]:
        return self.prompt_rows + self.pool_rows

    def add(self, req: Request, row: int, start: int, n: int) -> None:
        """A chunk's extra rows (its first row is `row`, its positions start .. start + n - 1)."""
        if req.sampling.prompt_logprobs:
            # Row p predicts prompt token p + 1; entries the request holds already (a preempted
            # request computes its prompt again) are not asked for twice.
            for p in range(max(start, len(req.prompt_logprobs) - 1), min(start + n, len(req.prompt_ids) - 1)):
                self.prompt_rows.append(row + p - start)
                self.prompt_targets.append((req, p + 1))
        if req.sampling.pooling:
            if start == 0:
                req.pooled, req.pooled_rows = None, 0      # (a preempted request computes its prompt again)
            pooled = pooled_positions(req.sampling.pooling, start, n, len(req.prompt_ids))
            self.pool_rows.extend(row + p - start for p in pooled)
            self.pool_targets.extend(req for _ in pooled)

    def take(self, runner: ModelRunner, hidden: torch.Tensor) -> None:
        """The extra rows' final hidden states (in `rows` order) into their requests."""
        if self.prompt_rows:
            runner.prompt_logprobs(hidden[:len(self.prompt_rows)], self.prompt_targets)
        if self.pool_rows:
            _pool(hidden[len(self.prompt_rows):], self.pool_targets)


def _pool(hidden: torch.Tensor, targets: Sequence[Request]) -> None:
    """Add each request's pooled rows (consecutive in `hidden`, in `targets` order) into its sum."""
    rows = hidden.float().cpu()
    first = 0
    for _, group in itertools.groupby(targets, key=id):
        members = list(group)
        req, count = members[0], len(members)
        total = rows[first:first + count].sum(dim=0)
        req.pooled = total if req.pooled is None else req.pooled + total
        req.pooled_rows += count
        first += count


class ModelRunner:
    def __init__(self, folder: str | Path, plan: ExecutionPlan, kv_cache_bytes: int = 1 << 30, block_size: int = 16,
                 max_batch: int = 256, weights: dict[str, Weight] | None = None):
        """Follows `plan` (services/engine/runtime/plan.py): the device, dtype, matmul kind and kernels the model
        runs, and how pure-decode steps run (graphs "cuda": replayed from CUDA graphs captured now, for
        batches up to max_batch; "eager": the same padded static buffers without capture; "off": like
        any other step).  weights: the model's tensors by their Hugging Face names, instead of the
        folder's files (the folder still gives config.json and the end-of-sequence ids)."""
        self.folder = Path(folder)
        self.task = task_of(self.folder)    # "embed": an embedding model, serving pooled requests only
        self.plan = plan
        self.device = torch.device(plan.device)
        self.dtype: torch.dtype = plan.torch_dtype
        self.kv_dtype: torch.dtype = plan.kv_torch_dtype
        self.matmul = plan.matmul
        model_type = json.loads((self.folder / "config.json").read_text()).get("model_type")
        if model_type not in ARCHITECTURES:
            raise ValueError(f"{self.folder}: model_type {model_type!r} is not one of {', '.join(ARCHITECTURES)}")
        config_cls, model_cls = ARCHITECTURES[model_type]
        self.config = config_cls.from_folder(self.folder)
        self.model = model_cls(self.config, weights if weights is not None else load_weights(self.folder), plan)
        self.max_context = self.model.max_context
        self.vocab_size = self.config.vocab_size
        self.eos_token_ids = eos_token_ids(self.folder)
        self.block_size = block_size
        c = self.config
        # K and V, every layer, one block: the unit the KV budget is counted in.
        self.block_bytes = 2 * c.num_layers * block_size * c.num_kv_heads * c.head_dim * self.kv_dtype.itemsize
        self.num_blocks = max(1, kv_cache_bytes // self.block_bytes)
        self.scratch_block = self.num_blocks        # never handed out: padded rows write here
        shape = (self.num_blocks + 1, block_size, c.num_kv_heads, c.head_dim)
        self.kv = [(kv_zeros(shape, self.kv_dtype, self.device), kv_zeros(shape, self.kv_dtype, self.device))
                   for _ in range(c.num_layers)]
        self.graphs: DecodeGraphs | None = None
        if plan.graphs != "off":
            try:
                self.graphs = DecodeGraphs(self.model, self.kv, block_size, self.max_context, self.scratch_block,
                                           max_batch, self.device, capture=plan.graphs == "cuda")
            except RuntimeError as exc:
                if plan.graphs != "cuda":
                    raise
                # Slower, still right: serve with every kernel launched from Python rather than not at all.
                log.warning("CUDA graph capture failed (%s); decode steps launch their kernels one by one", exc)
                torch.cuda.synchronize(self.device)
        # ggufr's outlier channels as floats where measuring this model says they matter (runtime/outliers.py)
        self.outliers = outliers.decide(self)
        # Loading's temporaries (the file's blocks before repacking, the tuner's trial kinds) back to the system:
        # glibc keeps freed heap pages (the 0.5B loaded after tuning: 1008 -> 744 MB; from a cached plan 756 -> 721).
        trim_heap()

    def use_model(self, model: Any) -> None:
        """Run `model` from now on (a hot swap: services/engine/runtime/versions.py); decode graphs follow it."""
        self.model = model
        outliers.keep(model, self.outliers)     # the model's decision, not measured again: requests hold KV blocks
        if self.graphs is not None:
            self.graphs = DecodeGraphs(model, self.kv, self.block_size, self.max_context, self.scratch_block,
                                       self.graphs.max_batch, self.device, capture=self.plan.graphs == "cuda")

    def _slots(self, blocks: Sequence[int], start: int, n: int) -> list[int]:
        bs = self.block_size
        return [blocks[p // bs] * bs + p % bs for p in range(start, start + n)]

    def _decode_table(self, blocks: Sequence[int], start: int) -> Sequence[int]:
        """The blocks a decode row at position `start` attends: those holding positions 0 .. start."""
        return blocks[: -(-(start + 1) // self.block_size)]

    def run(self, chunks: Sequence[Chunk], greedy: bool = False) -> torch.Tensor:
        """Compute every chunk.  For the chunks with sample=True, in order, return (S, V) float32
        logits, or with greedy=True (S,) argmax token ids, on the CPU: the step's one wait for the GPU.
        A chunk with drafts gives 1 + draft rows: its last real token's, then each draft token's."""
        return self.launch(chunks, greedy).cpu()

    @torch.inference_mode()
    def launch(self, chunks: Sequence[Chunk], greedy: bool = False) -> torch.Tensor:
        """run() without reading the result back: every kernel and copy is queued, none waited for
        (tests/gpu checks that with CUDA's sync debug mode)."""
        # A pure-decode step: every chunk one token that is sampled (a one-token prefill chunk that
        # does not reach the prompt's end samples nothing, so it takes the eager path).
        if self.graphs is not None and chunks and len(chunks) <= self.graphs.max_batch and not self.model.dynamic \
                and all(c.num_tokens == 1 and c.start > 0 and c.sample and not c.draft and c.request.adapter is None
                        for c in chunks):
            return self._run_graph(chunks, greedy)
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decode_rows: list[int] = []
        decode_tables: list[Sequence[int]] = []
        decode_lens: list[int] = []
        prefill_spans: list[tuple[int, int, int]] = []
        prefill_tables: list[list[int]] = []
        logits_rows: list[int] = []
        lengths: list[int] = []          # dynamic NTK RoPE: the sequence length each row is rotated at
        extra = _ExtraRows()
        adapters: list[Adapter | None] = []     # each row's LoRA adapter (None: the base model)
        limit = self.config.max_position
        for chunk in chunks:
            req, start, n = chunk.request, chunk.start, chunk.num_tokens
            row = len(ids)
            ids.extend(req.all_ids[start:start + n - chunk.draft])
            ids.extend(req.draft[:chunk.draft])
            positions.extend(range(start, start + n))
            slots.extend(self._slots(req.table.blocks, start, n))
            if self.model.dynamic:       # as transformers' generate: the prompt at its length, later tokens at p + 1
                prompt = len(req.prompt_ids)
                lengths.extend(max(limit, prompt if p < prompt else p + 1) for p in range(start, start + n))
            if start > 0 and (n == 1 or chunk.draft):
                # A decode row, or a decode row and its drafts: each a decode row of its own, attending
                # the positions before it (written to the cache before any row attends).
                for i in range(n):
                    decode_rows.append(row + i)
                    decode_tables.append(self._decode_table(req.table.blocks, start + i))
                    decode_lens.append(start + i + 1)
            else:
                prefill_spans.append((row, n, start))
                prefill_tables.append(req.table.blocks)
            if chunk.sample:
                logits_rows.extend(range(row + n - 1 - chunk.draft, row + n))
            extra.add(req, row, start, n)
            adapters.extend([req.adapter] * n)
        width = max((len(t) for t in decode_tables), default=0)
        flat_tables = padded_tables(decode_tables, width)
        t_ids, t_positions, t_slots, t_rows, t_drows, t_dlens, t_dtables, *t_ptables = kv_transfer.int64_parts(
            self.device, ids, positions, slots, logits_rows + extra.rows, decode_rows, decode_lens, flat_tables,
            *prefill_tables)
        tables = lens = mask = None
        if decode_rows:
            tables = t_dtables.view(len(decode_rows), width)
            lens = t_dlens
            if self.model.needs_decode_mask:
                mask = paged_attention.decode_mask(tables, lens, self.block_size, self.dtype)
        meta = AttentionMetadata(
            slots=t_slots, decode_rows=t_drows if decode_rows else None, decode_tables=tables, decode_lens=lens,
            decode_mask=mask,
            prefills=tuple((row, n, start, table) for (row, n, start), table in zip(prefill_spans, t_ptables,
                                                                                    strict=True)),
        )
        rope_lengths = torch.tensor(lengths, dtype=torch.int64, device=self.device) if lengths else None
        lora = lora_rows(adapters, self.device, kernel=self.plan.ops == "cpu")
        hidden = self.model.forward(t_ids, t_positions, meta, self.kv, t_rows, rope_lengths,
                                    **({"lora": lora} if lora is not None else {}))
        if extra.rows:
            extra.take(self, hidden[len(logits_rows):])
            hidden = hidden[:len(logits_rows)]
        if greedy and hidden.shape[0]:
            tokens = self.model.greedy(hidden)
            if tokens is None and self.device.type != "cpu":
                tokens = self.model.logits(hidden).argmax(dim=-1)   # on the device: only ids come back
            if tokens is not None:
                return tokens
        return self.model.logits(hidden)

    PROMPT_LOGITS_ROWS = 256         # full-vocabulary logits computed at a time for prompt logprobs

    def prompt_logprobs(self, hidden: torch.Tensor, targets: Sequence[tuple[Request, int]]) -> None:
        """Append each target's logprob (and its top alternatives) to its request's prompt_logprobs."""
        for i in range(0, len(targets), self.PROMPT_LOGITS_ROWS):
            logits = self.model.logits(hidden[i:i + self.PROMPT_LOGITS_ROWS]).cpu()
            for row, (req, k) in enumerate(targets[i:i + self.PROMPT_LOGITS_ROWS]):
                req.prompt_logprobs.append(token_logprob(logits[row], req.prompt_ids[k], req.sampling.top_logprobs))

    def _run_graph(self, chunks: Sequence[Chunk], greedy: bool) -> torch.Tensor:
        assert self.graphs is not None
        ids, positions, slots, tables = [], [], [], []
        for chunk in chunks:
            req, start = chunk.request, chunk.start
            ids.append(req.all_ids[start])
            positions.append(start)
            slots.extend(self._slots(req.table.blocks, start, 1))
            tables.append(self._decode_table(req.table.blocks, start))
        return self.graphs.launch(ids, positions, slots, tables, greedy)
