"""`python -m services.engine --replica-id ID --port P --model NAME[=FOLDER] [--dtype ...] [--cache ADDR]`"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
from concurrent.futures import ThreadPoolExecutor

# Tensors of 2 MB and more in transparent huge pages (torch's allocator reads this once, at its first
# allocation): weights and the KV cache are streamed every step, and with 4 KB pages a GEMV waits on TLB
# misses (Qwen2.5-0.5B's Q8_0 LM head at one row, 2 threads of a Sapphire Rapids: 24 GB/s read against 15-19).
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import torch  # noqa: E402 - after the allocator's setting

from mesh.envargs import apply_env
from mesh.grpcutil import Service
from mesh.models import served_model
from mesh.ratelimit import parse_rate
from mesh.service import Advertised, add_service_flags, run_service, serve_grpc
from services.engine.config import DEVICES, DTYPES, GRAPH_MODES, KV_DTYPES, EngineConfig
from services.engine.core import speculate
from services.engine.core.scheduler import SchedulerConfig
from services.engine.engine import Engine
from services.engine.rpcs.remote_cache import RemoteCache, kv_version
from services.engine.rpcs.server import EngineServicer, add_to
from services.engine.runtime import kv_transfer, plan
from services.engine.runtime.draft_model import DraftModel, check_compatible
from services.engine.runtime.grammar_limits import GrammarLimits
from services.engine.runtime.kv_transfer import Outbox
from services.engine.runtime.model_runner import ModelRunner

log = logging.getLogger("engine")


def parse(argv: list[str] | None = None) -> EngineConfig:
    p = argparse.ArgumentParser(prog="python -m services.engine")
    add_service_flags(p, "engine", port=50060)
    p.add_argument("--model", default="default", help="NAME or NAME=FOLDER")
    p.add_argument("--model-version", default="1")
    p.add_argument("--region", default="local")
    p.add_argument("--dtype", choices=DTYPES, default="auto")
    p.add_argument("--device", choices=DEVICES, default="auto")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads; 0: torch's default")
    p.add_argument("--kv-cache-mb", type=int, default=EngineConfig.kv_cache_mb)
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default="auto",
                   help="what the KV cache holds; auto: float16 where the fused CPU ops attend (twice the tokens "
                        "per MB), else the model's dtype")
    p.add_argument("--block-size", type=int, default=EngineConfig.block_size)
    p.add_argument("--max-batched-tokens", type=int, default=EngineConfig.max_batched_tokens)
    p.add_argument("--max-running", type=int, default=EngineConfig.max_running)
    p.add_argument("--fair-scheduling", choices=("on", "off"), default="on",
                   help="weighted fair queuing between tenants by tokens served (tier weights); off: first come, "
                        "first served within a class (default %(default)s)")
    p.add_argument("--fair-slowdown", type=float, default=EngineConfig.fair_slowdown, metavar="X",
                   help="with fair scheduling, cap a step's rows while a light tenant (all its requests within its "
                        "share of the rows) is active, so that it decodes at most X times slower than its share of "
                        "the engine (from the decode step times measured); 0: no cap (default %(default)s)")
    p.add_argument("--lora-roots", default="", metavar="DIR[,DIR]",
                   help="LoRA adapters are loaded from under these folders only (symlinks resolved; a path "
                        "outside is INVALID_ARGUMENT); empty: from any folder this process can read")
    p.add_argument("--max-waiting", type=int, default=EngineConfig.max_waiting,
                   help="requests queued beyond the running batch before refusing (RESOURCE_EXHAUSTED); the "
                        "router sheds this replica only when its queue is here (default %(default)s)")
    p.add_argument("--speculate", type=int, default=EngineConfig.speculate, metavar="N",
                   help="speculative decoding: up to N draft tokens per request and step, verified in the step "
                        "(output unchanged); -1 auto: 3 on the CPU (4 with --draft-model), off on a GPU; 0 off")
    p.add_argument("--speculate-rows", type=int, default=0, metavar="ROWS",
                   help="draft only while a step's rows (decode rows + drafts) stay within ROWS; 0 auto: the "
                        "plan's small-batch range (16 with --draft-model, where the speed-up is measured)")
    p.add_argument("--draft-model", default="", metavar="NAME[=FOLDER]",
                   help="a smaller model with the same tokenizer that drafts the speculative tokens in this engine "
                        "(speculative sampling: the output's distribution unchanged), instead of prompt lookup; "
                        "drafting stops at the batch sizes where it is measured not to pay")
    p.add_argument("--cuda-graphs", choices=GRAPH_MODES, default="auto",
                   help="auto: on a GPU, capture pure-decode steps as CUDA graphs for batch sizes up to "
                        "--max-running (cuda), else off; off: launch every kernel from Python; eager: the "
                        "graphs' padded buffers without capture")
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus /metrics on this port; 0: off")
    p.add_argument("--cache", default="", metavar="HOST:PORT",
                   help="the shared KV-cache service: load prompt blocks other engines computed (default: none)")
    p.add_argument("--cache-tenant", default=EngineConfig.cache_tenant,
                   help="SLA class of the blocks this engine publishes (premium, standard, batch)")
    p.add_argument("--cache-timeout", type=float, default=EngineConfig.cache_timeout_s,
                   help="seconds to fetch one request's blocks before recomputing them")
    p.add_argument("--grammar-cache-mb", type=int, default=EngineConfig.grammar_cache_mb, metavar="MB",
                   help="memory for compiled structured-output grammars, by their real size (least recently used "
                        "dropped first); 0 auto: an eighth of --kv-cache-mb, between 64 and 512")
    p.add_argument("--grammar-compile-rate", default=str(EngineConfig.grammar_compile_rate), metavar="N/s|m|h",
                   help="new grammars compiled per tenant (cached ones do not count); past it RESOURCE_EXHAUSTED "
                        "with retry-after; 0: no limit (default %(default)s)")
    p.add_argument("--grammar-compiles", type=int, default=EngineConfig.grammar_compiles, metavar="N",
                   help="grammar compiles running at once, all tenants together, each in its own process; "
                        f"beyond, up to {GrammarLimits.queue} wait for a slot (one --grammar-compile-timeout-s at "
                        "most), then "
                        "RESOURCE_EXHAUSTED with retry-after (default %(default)s)")
    p.add_argument("--grammar-compile-timeout-s", type=float, default=EngineConfig.grammar_compile_timeout_s,
                   metavar="S", help="a grammar compile still running after S seconds is stopped and its "
                                     "constraint refused (INVALID_ARGUMENT), from then on at once")
    apply_env(p, "INFERMESH_ENGINE")
    a = p.parse_args(argv)
    name, folder = served_model(a.model)
    draft_name, draft_folder = served_model(a.draft_model) if a.draft_model else ("", "")
    try:
        compile_rate = parse_rate(a.grammar_compile_rate, default_unit="m")
        return EngineConfig(model_path=folder, model=name, model_version=a.model_version,
                            replica_id=a.replica_id, region=a.region, host=a.host, port=a.port,
                            dtype=a.dtype, device=a.device, threads=a.threads, kv_cache_mb=a.kv_cache_mb,
                            kv_dtype=a.kv_dtype,
                            block_size=a.block_size, max_batched_tokens=a.max_batched_tokens,
                            max_running=a.max_running, max_waiting=a.max_waiting, cuda_graphs=a.cuda_graphs,
                            fair_scheduling=a.fair_scheduling == "on", fair_slowdown=a.fair_slowdown,
                            speculate=a.speculate, speculate_rows=a.speculate_rows,
                            draft_model_path=draft_folder, draft_model=draft_name,
                            metrics_port=a.metrics_port, lora_roots=tuple(r for r in a.lora_roots.split(",") if r),
                            discovery=a.discovery, advertise=a.advertise, tls_dir=a.tls_dir, cache=a.cache,
                            cache_tenant=a.cache_tenant, cache_timeout_s=a.cache_timeout,
                            grammar_cache_mb=a.grammar_cache_mb, grammar_compile_rate=compile_rate,
                            grammar_compiles=a.grammar_compiles, grammar_compile_timeout_s=a.grammar_compile_timeout_s)
    except ValueError as exc:
        p.error(str(exc))


async def serve(config: EngineConfig) -> None:
    # One thread runs every parallel torch region of this process: tuning, loading and every step.
    # OpenMP keeps a worker team per thread that starts parallel work, and a second team (the model
    # loaded here, stepped there) made decode steps ~2x slower on 2 cores: the teams compete.
    step_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-step")
    runner = await asyncio.get_running_loop().run_in_executor(step_thread, load, config)
    draft = await asyncio.get_running_loop().run_in_executor(step_thread, load_draft, config, runner)
    remote, outbox = shared_cache(config, runner)
    limits = SchedulerConfig(max_batched_tokens=config.max_batched_tokens, max_running=config.max_running,
                             fair=config.fair_scheduling, fair_slowdown=config.fair_slowdown)
    speculation = speculate.for_plan(runner.plan, config.speculate, config.speculate_rows, draft=draft is not None)
    engine = Engine(runner, config.max_waiting, limits, outbox, speculation, version=config.model_version,
                    grammar_limits=grammar_limits(config), draft=draft)
    servicer = EngineServicer(engine, config, remote, step_thread)
    service = Service("meshpb.v1.Engine", config.host, config.port)
    add_to(service, servicer)
    servicer.set_serving = service.ready
    servicer.start()
    log.info("engine %s serving %s (%d KV blocks of %d tokens%s) at %s%s", config.replica_id, config.model,
             runner.num_blocks, runner.block_size,
             f"; up to {speculation.max_draft} draft tokens "
             f"{'from ' + config.draft_model if draft is not None else 'by prompt lookup'} while steps have at most "
             f"{speculation.max_rows} rows" if speculation.max_draft else "", service.address,
             f"; shared KV cache {remote.address} as {config.model}@{remote.version}" if remote is not None else "")
    await serve_grpc("engine", config, service, metrics_port=config.metrics_port,
                     on_stop=servicer.close, advertised=Advertised(config.model, config.model_version, config.region),
                     on_announced=lambda withdraw: setattr(servicer, "withdraw", withdraw))


def grammar_limits(config: EngineConfig) -> GrammarLimits:
    return GrammarLimits(cache_bytes=config.grammar_cache_bytes, compile_rate=config.grammar_compile_rate,
                         compiles=config.grammar_compiles, compile_timeout_s=config.grammar_compile_timeout_s)


def load(config: EngineConfig) -> ModelRunner:
    """The plan (measured on this machine, tune.py) and the model, on the engine's step thread."""
    if config.threads:
        torch.set_num_threads(config.threads)
    execution = plan.for_config(config)
    log.info("engine %s runs %s", config.replica_id, execution)
    return ModelRunner(config.model_path, execution, kv_cache_bytes=config.kv_cache_mb << 20,
                       block_size=config.block_size, max_batch=config.max_running)


def load_draft(config: EngineConfig, runner: ModelRunner) -> DraftModel | None:
    """The draft model (--draft-model), on the step thread: its own plan (measured for it here) and a KV
    budget of the engine's size; None without one.  ValueError when its tokenizer is not the model's."""
    if not config.draft_model_path:
        return None
    execution = plan.for_config(dataclasses.replace(config, model_path=config.draft_model_path))
    log.info("engine %s drafts with %s: %s", config.replica_id, config.draft_model, execution)
    draft = ModelRunner(config.draft_model_path, execution, kv_cache_bytes=config.kv_cache_mb << 20,
                        block_size=config.block_size, max_batch=config.max_running)
    check_compatible(runner, draft)
    return DraftModel(draft, runner.vocab_size)


def shared_cache(config: EngineConfig, runner: ModelRunner) -> tuple[RemoteCache | None, Outbox | None]:
    """The client of the shared KV cache and the outbox of computed blocks for it; (None, None) without one."""
    if not config.cache:
        return None, None
    kv_layout = kv_transfer.layout(runner.kv)
    remote = RemoteCache(config.cache, config.model, kv_version(config.model_version, kv_layout, runner.matmul),
                         kv_layout, config.cache_tenant, config.cache_timeout_s, pin=runner.device.type == "cuda")
    return remote, Outbox(config.cache_outbox_mb << 20)


def main(argv: list[str] | None = None) -> None:
    run_service("engine", parse(argv), serve)


if __name__ == "__main__":
    main()
