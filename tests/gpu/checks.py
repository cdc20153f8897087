"""The GPU checks, importable: each returns a Verdict.  bench/gpu_check.py runs them as a script (with
the throughput table) on a lent GPU; tests/gpu/test_checks.py runs them as pytest tests.

No network and no model files: models are built with random weights from configs (the SmolLM2-135M
config, a Llama-style 1.1B one shaped like TinyLlama, and a tiny one for the CPU), the same weights
handed to transformers and to our engine.  On a CPU, set TRITON_INTERPRET=1 before the Triton
kernels are first imported (the script and the tests do).

1. fp32 parity: our engine's greedy tokens for a concurrent batch of ragged prompts equal
   transformers' `generate` for each prompt alone (TF32 off).  A divergence is reported with
   transformers' own top-2 margin at that point; only exact equality passes.
2. bf16 logits: along our bf16 engine's greedy path, its logits against transformers' fp32 logits
   for the same tokens; passes when our mean error per position stays within 2x (+0.05) of
   transformers' own bf16 error against fp32.
3. The Triton decode kernel against the torch path (fp32: 1e-4; bf16: 2e-2) and the float64
   definition, on ragged batches (lengths 1 .. 4,096, block-boundary lengths, scattered blocks).
4. No host synchronisation inside a step (CUDA only): CUDA's sync debug mode turns any into an error.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch

from services.engine.core.request import SamplingParams
from services.engine.core.scheduler import SchedulerConfig
from services.engine.engine import Engine
from services.engine.runtime.model_runner import ModelRunner
from services.engine.runtime.plan import decide

CONFIGS: dict[str, dict[str, Any]] = {
    # SmolLM2-135M-Instruct's own config.json (the shapes; the weights are random).
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                         rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True),
    # A Llama-style 1.1B (TinyLlama's shapes): 22 layers, GQA 32/4, 32k vocabulary, untied head.
    "llama-1.1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                       num_attention_heads=32, num_key_value_heads=4, head_dim=64, max_position_embeddings=2048,
                       rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False),
    # --smoke: small enough for the CPU and Triton's interpreter.
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                 rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True),
}


class Verdict(NamedTuple):
    check: str
    ok: bool
    detail: str


class Model:
    """One random-weight model: its folder (config.json only), transformers' copy, and its weights."""

    def __init__(self, name: str, device: torch.device, folder: Path, seed: int = 0):
        from transformers import LlamaConfig, LlamaForCausalLM

        self.name = name
        self.device = device
        self.folder = folder / name
        self.folder.mkdir(parents=True, exist_ok=True)
        # eos None: nothing stops early; every run generates exactly the tokens asked for.
        self.config = LlamaConfig(**CONFIGS[name], eos_token_id=None, bos_token_id=None, pad_token_id=0)
        self.config.save_pretrained(self.folder)
        torch.manual_seed(seed)
        with torch.device(device):
            self.hf32 = LlamaForCausalLM(self.config).eval()                   # fp32, transformers' init
        self.hf16: Any = None

    def hf_bf16(self) -> Any:
        if self.hf16 is None:
            import copy

            self.hf16 = copy.deepcopy(self.hf32).to(torch.bfloat16).eval()
        return self.hf16

    def release_hf(self) -> None:
        self.hf32 = self.hf16 = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def weights(self) -> dict[str, torch.Tensor]:
        return dict(self.hf32.state_dict())

    def runner(self, dtype: str, graphs: str, max_batch: int, kv_bytes: int, matmul: str = "fused",
               attention: str = "triton") -> ModelRunner:
        """Our ModelRunner on the same weights: "exact" keeps transformers' separate GEMMs (fp32 parity);
        "fused", the CUDA default, fuses q/k/v and gate/up."""
        plan = decide(device=self.device.type, dtype=dtype, graphs=graphs, matmul=matmul, attention=attention)
        return ModelRunner(self.folder, plan, kv_cache_bytes=kv_bytes, block_size=16, max_batch=max_batch,
                           weights=self.weights())


def drive(runner: Any, prompts: list[list[int]], gen: int, max_tokens_step: int, keep_logits: bool = False
          ) -> tuple[dict[int, list[int]], dict[int, list[torch.Tensor]], dict[str, float]]:
    """All prompts as concurrent requests through our Engine, greedy, exactly `gen` tokens each.

    Returns tokens and (with keep_logits) the float32 logits of every sampled position per prompt,
    plus timings: wall, TTFT per request, time per output token per request."""
    logits_seen: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(prompts))}
    if keep_logits:
        run = runner.run

        def run_keeping(chunks: Any, greedy: bool = False) -> torch.Tensor:
            out = run(chunks, greedy=False)
            for row, chunk in enumerate(c for c in chunks if c.sample):
                logits_seen[int(chunk.request.request_id)].append(out[row].clone())
            return out

        runner.run = run_keeping
    try:
        engine = Engine(runner, max_waiting=100_000,
                        scheduler=SchedulerConfig(max_batched_tokens=max_tokens_step, max_running=runner_max(runner)))
        params = SamplingParams(max_tokens=gen, ignore_eos=True)
        tokens: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
        stamps: dict[int, list[float]] = {i: [] for i in range(len(prompts))}
        sync(runner)
        t0 = time.perf_counter()
        for i, p in enumerate(prompts):
            engine.add(engine.make_request(str(i), p, params))
        while engine.has_work():
            outs = engine.step()
            now = time.perf_counter()
            for out in outs:
                i = int(out.request_id)
                tokens[i].extend(out.new_ids)
                stamps[i].extend([now] * len(out.new_ids))
        wall = time.perf_counter() - t0
    finally:
        if keep_logits:
            del runner.run
    ttft = [s[0] - t0 for s in stamps.values() if s]
    tpot = [(s[-1] - s[0]) / (len(s) - 1) for s in stamps.values() if len(s) > 1]
    return tokens, logits_seen, {"wall": wall, "ttft_p50": statistics.median(ttft) if ttft else 0.0,
                                 "tpot": statistics.mean(tpot) if tpot else 0.0}


def runner_max(runner: Any) -> int:
    return runner.graphs.max_batch if runner.graphs is not None else 256


def sync(runner_or_device: Any) -> None:
    device = getattr(runner_or_device, "device", runner_or_device)
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def random_prompts(n: int, lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(n)]


# -- 1 and 2: parity -----------------------------------------------------------------------------
@torch.inference_mode()
def hf_greedy(hf: Any, prompt: list[int], gen: int) -> list[int]:
    ids = torch.tensor([prompt], device=hf.device)
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=gen, min_new_tokens=gen,
                      do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@torch.inference_mode()
def hf_logits(hf: Any, sequence: list[int], start: int) -> torch.Tensor:
    """transformers' float32 logits predicting positions start+1 .. end of `sequence` (teacher-forced)."""
    ids = torch.tensor([sequence], device=hf.device)
    return hf(ids).logits[0, start - 1: len(sequence) - 1].float().cpu()


def check_fp32_parity(model: Model, smoke: bool) -> Verdict:
    gen = 8 if smoke else 32
    lengths = [3, 17, 16, 33, 64] if smoke else [1, 5, 16, 17, 100, 255, 256, 600]
    prompts = random_prompts(len(lengths), lengths, model.config.vocab_size, seed=1)
    runner = model.runner("float32", "eager" if smoke else "cuda", max_batch=8, kv_bytes=256 << 20, matmul="exact")
    ours, _, _ = drive(runner, prompts, gen, max_tokens_step=512)
    del runner
    bad = []
    for i, p in enumerate(prompts):
        ref = hf_greedy(model.hf32, p, gen)
        if ours[i] != ref:
            at = next(j for j, (a, b) in enumerate(zip(ours[i], ref, strict=True)) if a != b)
            top2 = hf_logits(model.hf32, p + ref[:at + 1], len(p) + at)[-1].topk(2).values
            bad.append(f"prompt {i} ({len(p)} tokens) diverges at token {at}: ours {ours[i][at]}, transformers "
                       f"{ref[at]}, transformers' top-2 margin {float(top2[0] - top2[1]):.2e}")
    return Verdict(f"{model.name} fp32 greedy parity",
                   not bad, "; ".join(bad) or f"{len(prompts)} ragged prompts ({min(lengths)}-{max(lengths)} "
                   f"tokens) x {gen} tokens, run concurrently: equal to transformers generate, token for token")


def check_bf16_logits(model: Model, smoke: bool) -> Verdict:
    gen = 8 if smoke else 24
    lengths = [5, 20, 33] if smoke else [7, 64, 129, 300]
    prompts = random_prompts(len(lengths), lengths, model.config.vocab_size, seed=2)
    runner = model.runner("bfloat16", "eager" if smoke else "cuda", max_batch=8, kv_bytes=256 << 20)
    ours, logits, _ = drive(runner, prompts, gen, max_tokens_step=512, keep_logits=True)
    del runner
    hf16 = model.hf_bf16()
    ours_err, hf_err, agree, total = [], [], 0, 0
    for i, p in enumerate(prompts):
        seq = p + ours[i]
        ref = hf_logits(model.hf32, seq, len(p))                           # (gen, V) fp32 truth
        theirs = hf_logits(hf16, seq, len(p))                              # transformers in bf16
        mine = torch.stack(logits[i])                                      # (gen, V) ours in bf16
        ours_err += (mine - ref).abs().amax(dim=-1).tolist()
        hf_err += (theirs - ref).abs().amax(dim=-1).tolist()
        agree += int((mine.argmax(-1) == ref.argmax(-1)).sum())
        total += len(ours[i])
    mean_ours, mean_hf = statistics.mean(ours_err), statistics.mean(hf_err)
    ok = mean_ours <= 2.0 * mean_hf + 0.05
    return Verdict(f"{model.name} bf16 logits", ok,
                   f"max |logit error| vs transformers fp32 per position: ours bf16 mean {mean_ours:.4f} "
                   f"(worst {max(ours_err):.4f}), transformers bf16 mean {mean_hf:.4f} (worst {max(hf_err):.4f}); "
                   f"greedy agreement with fp32 {agree}/{total}")


def check_no_sync(model: Model) -> Verdict:
    """Every step of a short mixed run (prefill chunks, graph-replayed decode steps) queues its work
    without one host synchronisation: CUDA's sync debug mode turns any into an error."""
    name = "no host sync inside a step"
    runner = model.runner("bfloat16", "cuda", max_batch=8, kv_bytes=128 << 20)
    prompts = random_prompts(5, [3, 40, 17], model.config.vocab_size, seed=3)
    drive(runner, prompts, 4, max_tokens_step=32)                         # warm: cuBLAS handles, kernels
    steps = {"n": 0}

    def strict_run(chunks: Any, greedy: bool = False) -> torch.Tensor:
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = runner.launch(chunks, greedy)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        steps["n"] += 1
        return out.cpu()

    runner.run = strict_run  # type: ignore[method-assign]
    try:
        drive(runner, prompts, 6, max_tokens_step=32)                     # 32 tokens a step: chunked prefill
    except RuntimeError as exc:
        return Verdict(name, False, f"{exc}".splitlines()[0])
    replays = runner.graphs.replays if runner.graphs is not None else 0
    return Verdict(name, True, f"{steps['n']} steps (chunked prefill, mixed, {replays} graph decode steps) under "
                   "torch.cuda.set_sync_debug_mode('error'); the one wait is reading the sampled ids back")


# -- 3: the kernel ---------------------------------------------------------------------------------
@torch.inference_mode()
def check_kernel(device: torch.device, smoke: bool) -> Verdict:
    from meshkernels import paged_attention as pa
    from meshkernels import paged_attention_triton as pt

    notes, ok = [], True
    shapes = [(3, 9, 64), (4, 32, 64)] if not smoke else [(2, 4, 16), (3, 9, 24)]
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
        for kv_heads, heads, d in shapes:
            g = torch.Generator().manual_seed(kv_heads * 100 + heads)
            bs = 16
            if smoke:
                lens = [1, 16, 17, 40]
            else:
                lens = [1, 15, 16, 17, 255, 256, 1000, 4096] + torch.randint(1, 2048, (56,), generator=g).tolist()
            need = [-(-n // bs) for n in lens]
            blocks = sum(need) + 8
            perm = torch.randperm(blocks, generator=g).tolist()            # scattered, non-contiguous blocks
            tables, at = [], 0
            for n in need:
                tables.append(perm[at:at + n])
                at += n
            width = max(need) + 3
            k = torch.randn(blocks, bs, kv_heads, d, generator=g).to(device, dtype)
            v = torch.randn(blocks, bs, kv_heads, d, generator=g).to(device, dtype)
            q = torch.randn(len(lens), heads, d, generator=g).to(device, dtype)
            t = torch.tensor([r + [r[0]] * (width - len(r)) for r in tables], device=device)
            n = torch.tensor(lens, device=device)
            scale = d ** -0.5
            got = pt.decode(q, k, v, t, n, scale).float()
            ref = pa.decode(q.float(), k.float(), v.float(), t, n, scale).float()
            err = float((got - ref).abs().max())
            split = pt.decode(q[:3], k, v, t[:3], n[:3], scale, splits=5).float()      # split-K, forced
            err = max(err, float((split - ref[:3]).abs().max()))
            worst64 = 0.0
            q_cpu, k_cpu, v_cpu = q.float().cpu(), k.float().cpu(), v.float().cpu()
            for i in range(0, len(lens), max(1, len(lens) // 6)):     # a few rows against float64 math
                exact = pa._reference(q_cpu[i:i + 1], k_cpu, v_cpu, tables[i], lens[i] - 1, scale)
                worst64 = max(worst64, float((got[i:i + 1].cpu() - exact).abs().max()))
            good = err <= tol and worst64 <= tol
            ok &= good
            notes.append(f"{str(dtype)[6:]} {heads}/{kv_heads} heads d{d}, {len(lens)} rows {min(lens)}-{max(lens)} "
                         f"tokens: max err {err:.1e} vs torch, {worst64:.1e} vs fp64")
    if device.type == "cuda" and not smoke:
        notes.append(kernel_speed(device))
    return Verdict("Triton paged decode kernel", ok, "; ".join(notes))


def kernel_speed(device: torch.device) -> str:
    import triton.testing

    from meshkernels import paged_attention as pa
    from meshkernels import paged_attention_triton as pt

    kv_heads, heads, d, bs, b, ctx = 4, 32, 64, 16, 64, 1024
    nblocks = b * ctx // bs
    k = torch.randn(nblocks, bs, kv_heads, d, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(b, heads, d, device=device, dtype=torch.bfloat16)
    t = torch.randperm(nblocks, device=device).view(b, ctx // bs)
    n = torch.full((b,), ctx, device=device)
    triton_ms = triton.testing.do_bench(lambda: pt.decode(q, k, v, t, n, d ** -0.5))
    torch_ms = triton.testing.do_bench(lambda: pa.decode(q, k, v, t, n, d ** -0.5))
    moved = 2 * b * ctx * kv_heads * d * 2
    # One 4,096-token stream: split-K (auto) against one program per KV head.
    long_t, long_n = t[:4].reshape(1, -1), torch.full((1,), 4 * ctx, device=device)
    auto = pt.num_splits(1, kv_heads, long_t.shape[1], pt.multiprocessors(device))
    split_ms = triton.testing.do_bench(lambda: pt.decode(q[:1], k, v, long_t, long_n, d ** -0.5))
    whole_ms = triton.testing.do_bench(lambda: pt.decode(q[:1], k, v, long_t, long_n, d ** -0.5, splits=1))
    return (f"speed at 64 x 1,024-token contexts (bf16, 32/4 heads): Triton {triton_ms * 1e3:.0f} us "
            f"({moved / triton_ms / 1e6:.0f} GB/s of K/V), torch gather+SDPA {torch_ms * 1e3:.0f} us; "
            f"1 x 4,096 tokens: {auto} splits {split_ms * 1e3:.0f} us, unsplit {whole_ms * 1e3:.0f} us")
