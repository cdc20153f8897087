"""`python -m services.router --replica-id ID --tokenizer ADDR... --engine ID=ADDR ... [--cache ADDR]`"""

from __future__ import annotations

import argparse
import logging
import os

from mesh.apikeys import load_keys
from mesh.discovery import Endpoint, load_endpoints, parse_endpoint
from mesh.envargs import apply_env
from mesh.grpcutil import Service
from mesh.ratelimit import Rate, parse_rate
from mesh.service import Advertised, add_service_flags, run_service, serve_grpc
from services.router.config import RouterConfig
from services.router.failover import Evaluation, load_evaluations
from services.router.policies import POLICIES
from services.router.server import RouterServicer

log = logging.getLogger("router")


def parse(argv: list[str] | None = None) -> RouterConfig:
    p = argparse.ArgumentParser(prog="python -m services.router")
    add_service_flags(p, "router", port=50051)
    p.add_argument("--tokenizer", action="append", default=[], metavar="HOST:PORT[,HOST:PORT...]",
                   help="a tokenizer replica; repeat (or comma-separate) for several: calls go to them in turn, "
                        "each behind its own breaker (default 127.0.0.1:50052)")
    p.add_argument("--cache", default="")
    p.add_argument("--engine", action="append", default=[], help="ID=HOST:PORT; repeat for each engine")
    p.add_argument("--expect-engines", type=int, default=0, metavar="N",
                   help="not ready until N engines have been healthy at once (default: every --engine; "
                        "1 with Consul)")
    p.add_argument("--discovery-file", default="", metavar="JSON",
                   help="static discovery from a file: a JSON list of {service, replica_id, address, region}")
    p.add_argument("--region", default="local")
    p.add_argument("--policy", choices=sorted(POLICIES), default=RouterConfig.policy, metavar="POLICY",
                   help="round_robin|least_load|balancing[+region][+prefix][+session] (default %(default)s)")
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus /metrics on this port; 0: off")
    p.add_argument("--fallback", action="append", default=[], metavar="MODEL=NEXT:CONFIDENCE",
                   help="level-3 failover: when MODEL has no usable replica, serve NEXT (degraded, with that "
                        "confidence); repeat to chain")
    d = RouterConfig
    p.add_argument("--latency-degrade-p95-ms", type=float, default=0.0, metavar="MS",
                   help="level 3 by latency: while a model's P95 time to first token (interactive requests) stays "
                        "over MS, send a share of its interactive requests to its --fallback; 0 (default): off")
    p.add_argument("--latency-degrade-window", type=float, default=d.latency_degrade_window_s, metavar="S",
                   help="the sliding window the P95 is measured over (default %(default)s s)")
    p.add_argument("--latency-degrade-min-samples", type=int, default=d.latency_degrade_min_samples, metavar="N",
                   help="no verdict on fewer first tokens in the window (default %(default)s)")
    p.add_argument("--latency-degrade-after", type=float, default=d.latency_degrade_after_s, metavar="S",
                   help="degrade once the P95 has stayed over target this long (default %(default)s s)")
    p.add_argument("--latency-degrade-share", type=float, default=d.latency_degrade_share, metavar="F",
                   help="the share of interactive requests sent to the fallback meanwhile (default %(default)s)")
    p.add_argument("--latency-degrade-recover", type=float, default=d.latency_degrade_recover, metavar="F",
                   help="stop once the P95 is at or below F x the target (default %(default)s)")
    p.add_argument("--fallback-eval", action="append", default=[], metavar="JSON",
                   help="an offline evaluation of a fallback against its primary, {primary, fallback, agreement, "
                        "samples} (or a list): evidence for degraded answers' confidence; repeatable")
    p.add_argument("--fallback-shadow-share", type=float, default=0.0, metavar="F",
                   help="mirror this share of a model's requests to its fallback and count agreement, the run-time "
                        "evidence for degraded answers' confidence (default 0: off)")
    p.add_argument("--confidence-prior-samples", type=float, default=d.confidence_prior_samples, metavar="K",
                   help="the --fallback confidence weighs as K comparisons against measured agreement "
                        "(default %(default)s)")
    p.add_argument("--p99-target-ms", type=float, default=0.0,
                   help="open a replica's breaker when its P99 time to first token exceeds this; 0: off")
    p.add_argument("--stall-timeout", type=float, default=RouterConfig.stall_timeout_s,
                   help="seconds without a token before a stream moves to another replica")
    p.add_argument("--default-model", default="smollm2-135m")
    p.add_argument("--default-version", action="append", default=[], metavar="MODEL=VERSION",
                   help="the version unpinned requests go to (default: the lowest served)")
    p.add_argument("--rate-limit", default=os.environ.get("INFERMESH_RATE_LIMIT", ""),
                   help="requests per API key for native gRPC callers, e.g. 5/s (the edge's setting); "
                        "keys: INFERMESH_API_KEYS, admin keys: INFERMESH_ADMIN_KEYS")
    p.add_argument("--token-limit", default=os.environ.get("INFERMESH_TOKEN_LIMIT", ""),
                   help="prompt + completion tokens per API key for native gRPC callers, per minute unless a "
                        "unit is given (the edge's setting; the edge's own calls are not charged again)")
    p.add_argument("--max-queued", type=int, default=0,
                   help="shed a replica (UNAVAILABLE + retry-after) once this many requests wait at it; "
                        "0 (default): only when its queue is at the engine's own bound (its --max-waiting)")
    p.add_argument("--prefix-sharing", choices=("tenant", "global"), default="tenant",
                   help="tenant: a prompt's cached KV blocks serve only its own tenant (no caller learns "
                        "another's prompts from cache hits); global: every caller shares them (one tenant, "
                        "or prompts that are no secret)")
    p.add_argument("--auth-failure-limit", default="10/m", help="failed keys per peer address (default %(default)s)")
    apply_env(p, "INFERMESH_ROUTER")
    a = p.parse_args(argv)
    fallbacks = []
    for spec in a.fallback:
        model, sep, rest = spec.partition("=")
        nxt, colon, confidence = rest.rpartition(":")
        try:
            fallbacks.append((model, nxt, float(confidence)))
        except ValueError:
            p.error(f"--fallback {spec!r} must look like MODEL=NEXT:CONFIDENCE (e.g. m=m-int8:0.8)")
        if not sep or not colon or not model or not nxt:
            p.error(f"--fallback {spec!r} must look like MODEL=NEXT:CONFIDENCE")
    defaults = []
    for spec in a.default_version:
        model, sep, version = spec.partition("=")
        if not sep or not model or not version:
            p.error(f"--default-version {spec!r} must look like MODEL=VERSION")
        defaults.append((model, version))
    try:
        rate_limit, auth_failure_limit = parse_rate(a.rate_limit), parse_rate(a.auth_failure_limit, default_unit="m")
        token_limit = parse_rate(a.token_limit, default_unit="m")
    except ValueError as exc:
        p.error(str(exc))
    evaluations = []
    for path in a.fallback_eval:
        try:
            evaluations += load_evaluations(path)
        except ValueError as exc:
            p.error(str(exc))
    engines = tuple(parse_endpoint("engine", spec) for spec in a.engine)
    if a.discovery_file:
        try:
            engines += tuple(e for e in load_endpoints(a.discovery_file) if e.service == "engine")
        except ValueError as exc:
            p.error(str(exc))
    try:
        return _config(a, engines, tuple(fallbacks), tuple(defaults), tuple(evaluations), rate_limit,
                       auth_failure_limit, token_limit)
    except ValueError as exc:            # RouterConfig's checks: the flags are wrong, say which (exit 2)
        p.error(str(exc))


def _config(a: argparse.Namespace, engines: tuple[Endpoint, ...], fallbacks: tuple[tuple[str, str, float], ...],
            defaults: tuple[tuple[str, str], ...], evaluations: tuple[Evaluation, ...], rate_limit: Rate | None,
            auth_failure_limit: Rate | None, token_limit: Rate | None = None) -> RouterConfig:
    return RouterConfig(tokenizer=",".join(a.tokenizer) or "127.0.0.1:50052", engines=engines, cache=a.cache,
                        replica_id=a.replica_id,
                        host=a.host, port=a.port, region=a.region, policy=a.policy,
                        default_model=a.default_model, default_versions=defaults,
                        discovery=a.discovery, metrics_port=a.metrics_port, fallbacks=fallbacks,
                        p99_target_ms=a.p99_target_ms, stall_timeout_s=a.stall_timeout, advertise=a.advertise,
                        expect_engines=a.expect_engines,
                        tls_dir=a.tls_dir, api_key_digests=load_keys(),
                        admin_key_digests=load_keys(variable="INFERMESH_ADMIN_KEYS"), rate_limit=rate_limit,
                        auth_failure_limit=auth_failure_limit, token_limit=token_limit,
                        prefix_sharing=a.prefix_sharing,
                        max_queued=a.max_queued, latency_degrade_p95_ms=a.latency_degrade_p95_ms,
                        latency_degrade_window_s=a.latency_degrade_window,
                        latency_degrade_min_samples=a.latency_degrade_min_samples,
                        latency_degrade_after_s=a.latency_degrade_after, latency_degrade_share=a.latency_degrade_share,
                        latency_degrade_recover=a.latency_degrade_recover, fallback_evals=evaluations,
                        fallback_shadow_share=a.fallback_shadow_share,
                        confidence_prior_samples=a.confidence_prior_samples)


async def serve(config: RouterConfig) -> None:
    service = Service("meshpb.v1.Router", config.host, config.port)
    servicer = RouterServicer(config)
    servicer.add_to(service.server)
    # The router sets its own readiness: SERVING only while the tokenizer and an engine are healthy.
    await servicer.start(report_ready=service.ready)
    log.info("router %s on %s, %d engine(s), policy %s", config.replica_id, service.address,
             len(config.engines), config.policy)
    await serve_grpc("router", config, service, metrics_port=config.metrics_port, ready=False,
                     on_stop=servicer.close, advertised=Advertised(region=config.region))


def main(argv: list[str] | None = None) -> None:
    run_service("router", parse(argv), serve)


if __name__ == "__main__":
    main()
