"""`python -m services.tokenizer --replica-id ID --port P --model NAME[=PATH] ...`"""

from __future__ import annotations

import argparse
import logging

from mesh.envargs import apply_env
from mesh.grpcutil import REQUEST_MESSAGE_BYTES, Service
from mesh.models import served_model
from mesh.service import add_service_flags, run_service, serve_grpc
from services.tokenizer.config import TokenizerConfig
from services.tokenizer.limits import MAX_INPUT_BYTES, MAX_MESSAGES, InputLimits
from services.tokenizer.server import TokenizerServicer, add_to
from services.tokenizer.tokenizer import ModelTokenizer

log = logging.getLogger("tokenizer")


def parse(argv: list[str] | None = None) -> TokenizerConfig:
    p = argparse.ArgumentParser(prog="python -m services.tokenizer")
    add_service_flags(p, "tokenizer", port=50052)
    p.add_argument("--model", action="append", default=[], help="NAME or NAME=FOLDER; repeat for more")
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus /metrics on this port; 0: off")
    p.add_argument("--max-input-bytes", type=int, default=MAX_INPUT_BYTES,
                   help="larger prompts (or chats, all contents together) are refused before tokenizing")
    p.add_argument("--max-messages", type=int, default=MAX_MESSAGES, help="longer chats are refused")
    apply_env(p, "INFERMESH_TOKENIZER")
    a = p.parse_args(argv)
    models = tuple(served_model(spec) for spec in (a.model or ["default"]))
    return TokenizerConfig(replica_id=a.replica_id, host=a.host, port=a.port, models=models, discovery=a.discovery,
                           metrics_port=a.metrics_port, advertise=a.advertise, tls_dir=a.tls_dir,
                           limits=InputLimits(a.max_input_bytes, a.max_messages))


async def serve(config: TokenizerConfig) -> None:
    tokenizers = {name: ModelTokenizer(name, folder) for name, folder in config.models}
    # The largest valid request: the input limit's bytes, plus the messages' framing.
    service = Service("meshpb.v1.Tokenizer", config.host, config.port,
                      max_receive_bytes=max(REQUEST_MESSAGE_BYTES, 2 * config.limits.max_input_bytes))
    add_to(service, TokenizerServicer(tokenizers, default=config.models[0][0], limits=config.limits))
    log.info("tokenizer %s serving %s on %s", config.replica_id, ", ".join(tokenizers), service.address)
    await serve_grpc("tokenizer", config, service, metrics_port=config.metrics_port)


def main(argv: list[str] | None = None) -> None:
    run_service("tokenizer", parse(argv), serve)


if __name__ == "__main__":
    main()
