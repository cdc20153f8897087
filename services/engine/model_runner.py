"""Owns the weights and the paged KV tensors; turns a scheduled batch into next-token logits."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from kernels import paged_attention
from mesh import model_store
from services.engine.models import ARCHITECTURES
from services.engine.models.llama import AttentionPlan, load_weights
from services.engine.scheduler import Chunk


class ModelRunner:
    def __init__(self, folder: str | Path, dtype: str = "float32", device: str = "cpu",
                 kv_cache_bytes: int = 1 << 30, block_size: int = 16, matmul: str = "exact"):
        import json

        self.folder = Path(folder)
        self.device = torch.device(device)
        self.dtype: torch.dtype = getattr(torch, dtype)
        model_type = json.loads((self.folder / "config.json").read_text()).get("model_type")
        if model_type not in ARCHITECTURES:
            raise ValueError(f"{self.folder}: model_type {model_type!r} is not one of {', '.join(ARCHITECTURES)}")
        config_cls, model_cls = ARCHITECTURES[model_type]
        self.config = config_cls.from_folder(self.folder)
        self.matmul = matmul
        self.model = model_cls(self.config, load_weights(self.folder), self.dtype, self.device, matmul)
        self.max_context = self.config.max_position
        self.vocab_size = self.config.vocab_size
        self.eos_token_ids = model_store.eos_token_ids(self.folder)
        self.block_size = block_size
        c = self.config
        # K and V, every layer, one block: the unit the KV budget is counted in.
        self.block_bytes = 2 * c.num_layers * block_size * c.num_kv_heads * c.head_dim * self.dtype.itemsize
        self.num_blocks = max(1, kv_cache_bytes // self.block_bytes)
        shape = (self.num_blocks, block_size, c.num_kv_heads, c.head_dim)
        self.kv = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                    torch.zeros(shape, dtype=self.dtype, device=self.device)) for _ in range(c.num_layers)]

    def _slots(self, blocks: Sequence[int], start: int, n: int) -> list[int]:
        bs = self.block_size
        return [blocks[p // bs] * bs + p % bs for p in range(start, start + n)]

    @torch.inference_mode()
    def run(self, chunks: Sequence[Chunk], greedy: bool = False) -> torch.Tensor:
        """Compute every chunk.  For the chunks with sample=True, in order, return (S, V) float32
        logits, or with greedy=True (S,) argmax token ids when the model has a faster way to them."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decode_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[tuple[int, int, int, torch.Tensor]] = []
        logits_rows: list[int] = []
        for chunk in chunks:
            req, start, n = chunk.request, chunk.start, chunk.num_tokens
            row = len(ids)
            ids.extend(req.all_ids[start:start + n])
            positions.extend(range(start, start + n))
            slots.extend(self._slots(req.table.blocks, start, n))
            if n == 1 and start > 0:
                decode_rows.append(row)
                decode_tables.append(req.table.blocks[: -(-(start + 1) // self.block_size)])
                decode_lens.append(start + 1)
            else:
                table = torch.tensor(req.table.blocks, dtype=torch.int64, device=self.device)
                prefills.append((row, n, start, table))
            if chunk.sample:
                logits_rows.append(row + n - 1)
        width = max((len(t) for t in decode_tables), default=0)
        tables = lens = mask = None
        if decode_rows:
            tables = torch.tensor([t + [t[0]] * (width - len(t)) for t in decode_tables], dtype=torch.int64,
                                  device=self.device)
            lens = torch.tensor(decode_lens, dtype=torch.int64, device=self.device)
            if not getattr(self.model, "fused", False):    # the fused decode op masks by length itself
                mask = paged_attention.decode_mask(tables, lens, self.block_size, self.dtype)
        plan = AttentionPlan(
            slots=torch.tensor(slots, dtype=torch.int64, device=self.device),
            decode_rows=torch.tensor(decode_rows, dtype=torch.int64, device=self.device) if decode_rows else None,
            decode_tables=tables, decode_lens=lens, decode_mask=mask, prefills=tuple(prefills),
        )
        hidden = self.model.forward(
            torch.tensor(ids, dtype=torch.int64, device=self.device),
            torch.tensor(positions, dtype=torch.int64, device=self.device),
            plan, self.kv, torch.tensor(logits_rows, dtype=torch.int64, device=self.device))
        if greedy and hidden.shape[0]:
            tokens = self.model.greedy(hidden)
            if tokens is not None:
                return tokens.cpu()
        return self.model.logits(hidden).cpu()
