"""compose/: the Dockerfile, docker-compose.yml and the Kubernetes manifests, checked offline.

- `docker-compose config` parses the compose file as Compose 1.29 does (skipped without the binary).
- Every infermesh container's command and INFERMESH_* variables are checked against the argparse parser
  of the service it runs (captured from the service's own `parse()`), so a flag renamed in code
  cannot leave a deployment file behind; ports, addresses and health checks must agree with
  infermesh/launcher.py and the README (with docs/architecture.md), and with each other (router -> tokenizer/cache,
  edge -> router, Prometheus targets, Services -> container ports, probes -> service ports).
- At least two routers and two tokenizers, the edge naming every router and each router every
  tokenizer; the cache's --cold-dir and --sessions-dir on a volume (a PVC on Kubernetes).
- kubernetes-validate checks every manifest against Kubernetes' own schema (strict: unknown fields
  fail), for a pinned Kubernetes version, from schemas shipped in the package (no network).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import re
import shutil
import subprocess
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from infermesh import launcher
from mesh import envargs
from mesh.envargs import apply_env, env_name

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[2]
DEPLOY_DIR = ROOT / "compose"
COMPOSE_FILE = DEPLOY_DIR / "docker-compose.yml"
K8S_DIR = DEPLOY_DIR / "k8s"
KUBERNETES_VERSION = "1.31.0"        # the oldest we promise; mixed-protocol LoadBalancers need 1.26+

# The module each service runs (ENTRYPOINT is `python -m`), and its variable prefix.
PREFIXES = {"services.cache": "INFERMESH_CACHE", "services.tokenizer": "INFERMESH_TOKENIZER",
            "services.engine": "INFERMESH_ENGINE", "services.router": "INFERMESH_ROUTER",
            "services.edge": "INFERMESH_EDGE"}
# Variables read outside the parsers (auth, model store, discovery client, OpenTelemetry).
OTHER_VARIABLES = {"INFERMESH_HOME", "INFERMESH_API_KEYS", "INFERMESH_API_KEYS_FILE", "INFERMESH_ADMIN_KEYS",
                   "INFERMESH_ADMIN_KEYS_FILE", "INFERMESH_RATE_LIMIT", "CONSUL_HTTP_ADDR", "CONSUL_HTTP_TOKEN",
                   "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_TRACES_EXPORTER", "OTEL_SERVICE_NAME",
                   "OTEL_RESOURCE_ATTRIBUTES", "INFERMESH_MESH_TLS_DIR"}
# The ports `infermesh up` uses (port offset 0); engine i adds i to the engine ports.
PORTS = {"services.cache": (launcher.CACHE_PORT, launcher.CACHE_METRICS_PORT),
         "services.tokenizer": (launcher.TOKENIZER_PORT, launcher.TOKENIZER_METRICS_PORT),
         "services.router": (launcher.ROUTER_PORT, launcher.ROUTER_METRICS_PORT),
         "services.engine": (launcher.ENGINE_BASE_PORT, launcher.ENGINE_METRICS_BASE_PORT)}
# Replica i >= 1 of a router or tokenizer (`infermesh up --routers N --tokenizers N`) adds i to these
# metrics ports.  A container has its own network, so compose replicas keep the gRPC port (like the
# engines) and differ only in the metrics port they publish on the host's loopback.
REPLICA_METRICS_BASE = {"services.router": launcher.ROUTER_METRICS_BASE_PORT,
                        "services.tokenizer": launcher.TOKENIZER_METRICS_BASE_PORT}


def launcher_metrics_port(module: str, i: int) -> int:
    """The metrics port `infermesh up` gives replica i of `module` (engine i: ENGINE_METRICS_BASE_PORT + i)."""
    port, metrics = PORTS[module]
    if module == "services.engine":
        return metrics + i
    return metrics if i == 0 else REPLICA_METRICS_BASE[module] + i


def addresses(values: list[str] | str) -> list[str]:
    """A repeatable address flag's value (repeated, comma-separated, or both) as one list."""
    items = [values] if isinstance(values, str) else values
    return [a.strip() for item in items for a in item.split(",") if a.strip()]


# --- the services' own parsers -------------------------------------------------------------------

class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        super().__init__()
        self.parser = parser


class _Refused(Exception):
    pass


def service_parser(module: str) -> tuple[argparse.ArgumentParser, str | None]:
    """(parser, env prefix or None): the parser `python -m MODULE` builds, stopped before it parses;
    the prefix is what the module passes to apply_env (None: it reads no INFERMESH_<SERVICE>_* variables).
    The environment of this test process is not applied."""
    main = importlib.import_module(f"{module}.__main__")
    prefixes: list[str] = []

    def record(parser: argparse.ArgumentParser, prefix: str, env: Mapping[str, str] | None = None) -> None:
        prefixes.append(prefix)

    def capture(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        raise _Captured(self)

    with contextlib.ExitStack() as patches:
        patches.enter_context(mock.patch.object(argparse.ArgumentParser, "parse_args", capture))
        patches.enter_context(mock.patch.object(envargs, "apply_env", record))
        if hasattr(main, "apply_env"):
            patches.enter_context(mock.patch.object(main, "apply_env", record))
        try:
            main.parse([])
        except _Captured as caught:
            parser = caught.parser
        else:
            raise AssertionError(f"{module}.__main__.parse() did not parse arguments")

    def refuse(message: str) -> None:
        raise _Refused(message)

    parser.error = refuse  # type: ignore[method-assign,assignment]
    parser.allow_abbrev = False        # a deployment file spells flags out in full
    return parser, (prefixes[0] if prefixes else None)


def flag_variables(parser: argparse.ArgumentParser, prefix: str) -> set[str]:
    return {env_name(prefix, a) for a in parser._actions
            if a.option_strings and not isinstance(a, argparse._HelpAction)}


def effective(module: str, argv: list[str], env: Mapping[str, str], where: str) -> argparse.Namespace:
    """What the service would run with: its INFERMESH_* variables, then its command line (which wins),
    validated by its own parser.  Fails on a flag or variable the service does not know."""
    parser, prefix = service_parser(module)
    own = {k: v for k, v in env.items() if k.startswith("INFERMESH_") and k not in OTHER_VARIABLES}
    unknown = {k for k in env if not k.startswith(("INFERMESH_", "OTEL_", "CONSUL_"))}
    assert not unknown, f"{where}: variables no infermesh process reads: {sorted(unknown)}"
    for key in sorted(set(env) - set(own)):
        assert key in OTHER_VARIABLES, f"{where}: {key} is not a variable infermesh reads"
    if own:
        assert prefix is not None, f"{where}: {module} reads no INFERMESH_* flag variables, but sets {sorted(own)}"
        foreign = {k for k in own if not k.startswith(prefix + "_")}
        assert not foreign, f"{where}: {sorted(foreign)} belong to another service, not {module} ({prefix}_*)"
        unknown = set(own) - flag_variables(parser, prefix)
        assert not unknown, (f"{where}: {sorted(unknown)} match no flag of {module}; known: "
                             f"{sorted(flag_variables(parser, prefix))}")
        try:
            apply_env(parser, prefix, {k: v for k, v in own.items() if v is not None})
        except _Refused as exc:
            pytest.fail(f"{where}: {exc}")
    try:
        return parser.parse_args(argv)
    except _Refused as exc:
        pytest.fail(f"{where}: `python -m {module} {' '.join(argv)}`: {exc}")


def test_the_parser_capture_sees_every_service() -> None:
    for module, prefix in PREFIXES.items():
        parser, applied = service_parser(module)
        assert "--replica-id" in parser._option_string_actions
        assert applied in (prefix, None), f"{module} applies {applied}, expected {prefix}"
    engine, prefix = service_parser("services.engine")
    assert prefix == "INFERMESH_ENGINE" and "INFERMESH_ENGINE_KV_CACHE_MB" in flag_variables(engine, prefix)
    with pytest.raises(_Refused):
        engine.parse_args(["--no-such-flag"])


def test_the_readme_states_the_launchers_ports() -> None:
    # The services' table is README.md's "What runs"; the router's metrics port, docs/architecture.md's "Router".
    readme = (ROOT / "README.md").read_text() + (ROOT / "docs" / "architecture.md").read_text()
    for text in (f"TCP {launcher.HTTP_PORT}", f"UDP {launcher.HTTP3_PORT}", f"gRPC {launcher.ROUTER_PORT}",
                 f"gRPC {launcher.TOKENIZER_PORT}", f"gRPC {launcher.CACHE_PORT}",
                 f"gRPC {launcher.ENGINE_BASE_PORT}+N, metrics {launcher.ENGINE_METRICS_BASE_PORT}+N",
                 f"port {launcher.ROUTER_METRICS_PORT}"):
        assert text in readme, f"neither README.md nor docs/architecture.md says {text!r} (launcher ports)"


# --- Dockerfile ----------------------------------------------------------------------------------

def dockerfile_stages() -> dict[str, list[str]]:
    text = (DEPLOY_DIR / "Dockerfile").read_text().replace("\\\n", " ")
    stages: dict[str, list[str]] = {}
    current: list[str] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.match(r"FROM\s+\S+\s+AS\s+(\S+)", line, re.I)
        if m:
            current = stages.setdefault(m.group(1), [])
        current.append(line)
    return stages


def test_dockerfile_builds_stubs_once_and_has_cpu_and_cuda_targets() -> None:
    stages = dockerfile_stages()
    assert {"wheel", "cpu", "cuda"} <= set(stages)
    wheel = "\n".join(stages["wheel"])
    assert "grpcio-tools" in wheel and "python proto/generate.py" in wheel
    torch_version = re.search(r"^TORCH_VERSION \?= (\S+)", (ROOT / "Makefile").read_text(), re.M)
    assert torch_version is not None
    for target, index in (("cpu", "https://download.pytorch.org/whl/cpu"), ("cuda", "https://download.pytorch.org/whl/cu")):
        lines = stages[target]
        text = "\n".join(lines)
        assert f"ARG TORCH_VERSION={torch_version.group(1)}" in text, f"{target}: torch pinned as in the Makefile"
        assert f"ARG TORCH_INDEX={index}" in text
        assert "COPY --from=wheel" in text
        assert re.search(r'if \[ "\$PULL_MODEL" = "1" \]; then infermesh model pull default', text)
        users = [line.split()[1] for line in lines if line.startswith("USER ")]
        assert users and users[-1] not in ("root", "0"), f"{target} must run as a non-root user"
        assert 'ENTRYPOINT ["python", "-m"]' in lines
        assert "INFERMESH_HOME=/var/lib/infermesh" in text
    assert stages["cuda"][0] == "FROM ${CUDA_IMAGE} AS cuda"
    assert re.search(r"^ARG CUDA_IMAGE=nvidia/cuda:\S+$", (DEPLOY_DIR / "Dockerfile").read_text(), re.M)
    for line in (line for lines in stages.values() for line in lines):
        if line.startswith("COPY ") and "--from" not in line:
            for source in line.split()[1:-1]:
                assert (ROOT / source).exists(), f"Dockerfile copies {source}, which is not in the repository"


# --- docker-compose.yml ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE_FILE.read_text())
    assert isinstance(data, dict)
    return data


def compose_infermesh(compose: dict[str, Any]) -> Iterator[tuple[str, str, list[str], dict[str, str]]]:
    """(compose service, module, flags, environment) for every infermesh container."""
    for name, service in compose["services"].items():
        command = service.get("command") or []
        if command and command[0] in PREFIXES:
            env = {k: str(v) for k, v in (service.get("environment") or {}).items()}
            yield name, command[0], [str(a) for a in command[1:]], env


def test_docker_compose_parses_it() -> None:
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip("docker-compose is not installed (Debian: apt-get install docker-compose); "
                    "the structural checks below still ran")
    env = {**os.environ, "INFERMESH_API_KEYS": "test-key"}
    done = subprocess.run([binary, "-f", str(COMPOSE_FILE), "config", "-q"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    # Without API keys the edge (bound to 0.0.0.0) must not start: compose refuses the file.
    env.pop("INFERMESH_API_KEYS")
    done = subprocess.run([binary, "-f", str(COMPOSE_FILE), "config", "-q"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode != 0 and "set INFERMESH_API_KEYS" in done.stderr


def test_compose_format_and_services(compose: dict[str, Any]) -> None:
    assert compose["version"] == "3.8"
    services = compose["services"]
    assert {"consul", "cache", "tokenizer-a", "tokenizer-b", "router-a", "router-b", "edge", "prometheus",
            "grafana", "otel-collector", "jaeger"} <= set(services)
    assert services["consul"]["image"].startswith("hashicorp/consul:")
    modules = [module for _, module, _, _ in compose_infermesh(compose)]
    assert sorted(set(modules)) == sorted(PREFIXES) and modules.count("services.engine") >= 2


def test_compose_services_use_real_flags_and_the_launchers_ports(compose: dict[str, Any]) -> None:
    services = compose["services"]
    replicas: dict[str, list[tuple[str, argparse.Namespace]]] = {}
    config: dict[str, argparse.Namespace] = {}
    for name, module, argv, env in compose_infermesh(compose):
        a = effective(module, argv, env, f"docker-compose.yml service {name}")
        config[name] = a
        service = services[name]
        check = service["healthcheck"]["test"]
        assert check[:4] == ["CMD", "python", "-m", "mesh.healthcheck"], f"{name}: healthcheck"
        if module == "services.edge":
            assert (a.http_port, a.http3_port) == (launcher.HTTP_PORT, launcher.HTTP3_PORT)
            assert a.host == "0.0.0.0"
            assert check[4] == f"http://127.0.0.1:{a.http_port}/health"
            assert {f"{a.http_port}:{a.http_port}/tcp", f"{a.http3_port}:{a.http3_port}/udp"} <= set(service["ports"])
            assert env["INFERMESH_API_KEYS"] == "${INFERMESH_API_KEYS:?set INFERMESH_API_KEYS}"
            continue
        assert a.host == "0.0.0.0" and a.advertise == name, f"{name}: binds 0.0.0.0 and advertises its name"
        assert a.discovery == "consul" and env["CONSUL_HTTP_ADDR"] == "consul:8500"
        assert service["depends_on"]["consul"]["condition"] == "service_healthy"
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4317" and env["OTEL_SERVICE_NAME"]
        assert check[4] == f"127.0.0.1:{a.port}", f"{name}: healthcheck probes its own port"
        assert f"127.0.0.1:{a.metrics_port}:{a.metrics_port}" in service["ports"], f"{name}: metrics on loopback"
        replicas.setdefault(module, []).append((name, a))
    # Replica i (in metrics-port order) has the launcher's gRPC port and replica i's metrics port.
    for module, found in replicas.items():
        for i, (name, a) in enumerate(sorted(found, key=lambda r: (r[1].metrics_port != PORTS[module][1],
                                                                   r[1].metrics_port))):
            assert (a.port, a.metrics_port) == (PORTS[module][0], launcher_metrics_port(module, i)), \
                f"{name}: the launcher's ports (replica {i})"
    regions = {a.region for _, a in replicas["services.engine"]}
    assert {"a", "b"} <= regions
    tokenizers = [f"{name}:{a.port}" for name, a in replicas["services.tokenizer"]]
    for name, router in replicas["services.router"]:
        assert router.region == "a" and not router.engine and not router.discovery_file, "engines come from Consul"
        assert sorted(addresses(router.tokenizer)) == sorted(tokenizers), f"{name}: every tokenizer"
        assert router.cache == f"cache:{config['cache'].port}"
        for dependency in ("cache", *(t for t, _ in replicas["services.tokenizer"])):
            assert services[name]["depends_on"][dependency]["condition"] == "service_healthy", name
    routers = [name for name, _ in replicas["services.router"]]
    assert sorted(addresses(config["edge"].router)) == sorted(f"{name}:{config[name].port}" for name in routers)
    for name in routers:
        assert services["edge"]["depends_on"][name]["condition"] == "service_healthy"
    cache_mounts = [v.split(":")[1] for v in services["cache"]["volumes"]]
    assert config["cache"].cold_dir in cache_mounts, "the cold tier lives on a volume"


def test_compose_services_talk_mutual_tls_and_only_the_edge_is_public(compose: dict[str, Any]) -> None:
    services, secrets, networks = compose["services"], compose["secrets"], compose["networks"]
    assert networks["mesh"]["internal"] is True
    for name, module, argv, env in compose_infermesh(compose):
        a = effective(module, argv, env, name)
        kind = module.removeprefix("services.")
        assert a.tls_dir == "/run/secrets", f"{name}: --tls-dir is where its secrets are mounted"
        mounted = {s["target"]: s["source"] for s in services[name]["secrets"]}
        assert mounted == {"ca.crt": "mesh-ca", "tls.crt": f"{kind}-cert", "tls.key": f"{kind}-key"}, name
        assert env["INFERMESH_MESH_TLS_DIR"] == "/run/secrets", f"{name}: its healthcheck presents the certificate"
        assert "mesh" in services[name]["networks"]
        assert ("public" in services[name]["networks"]) == (module == "services.edge"), f"{name}: only the edge"
        if module != "services.edge":
            assert all(str(p).startswith("127.0.0.1:") for p in services[name].get("ports", [])), name
    for source in secrets.values():
        assert source["file"].startswith("./mesh-ca/"), "python -m mesh.pki compose/mesh-ca makes them"
    consul = services["consul"]
    assert {s["target"] for s in consul["secrets"]} == {"ca.crt", "tls.crt", "tls.key"}
    assert "cert_file" in " ".join(consul["command"]), "Consul's gRPC checks present a mesh certificate"
    assert all("public" not in (s.get("networks") or []) for n, s in services.items() if n != "edge")


def _under(path: str, mounts: list[str]) -> bool:
    return any(path == m or path.startswith(m.rstrip("/") + "/") for m in mounts)


def test_compose_runs_two_routers_and_two_tokenizers(compose: dict[str, Any]) -> None:
    """Two of each stateless hop behind the edge, wired to each other by name; the cache's state on a volume."""
    services = compose["services"]
    config = {name: (module, effective(module, argv, env, name))
              for name, module, argv, env in compose_infermesh(compose)}
    by_module: dict[str, list[str]] = {}
    for name, (module, _) in config.items():
        by_module.setdefault(module, []).append(name)
    routers, tokenizers = by_module["services.router"], by_module["services.tokenizer"]
    assert len(routers) >= 2 and len(tokenizers) >= 2, f"routers {routers}, tokenizers {tokenizers}"
    for names in (routers, tokenizers):
        assert len({config[n][1].replica_id for n in names}) == len(names), f"{names}: one replica id each"
    edge = config["edge"][1]
    assert sorted(addresses(edge.router)) == sorted(f"{r}:{config[r][1].port}" for r in routers), \
        "the edge names every router"
    for router in routers:
        assert sorted(addresses(config[router][1].tokenizer)) == sorted(
            f"{t}:{config[t][1].port}" for t in tokenizers), f"{router} names every tokenizer"
    cache = config["cache"][1]
    named = [v.split(":")[1] for v in services["cache"]["volumes"] if not v.startswith((".", "/"))]
    assert cache.sessions_dir and _under(cache.sessions_dir, named), "--sessions-dir on a named volume"
    assert cache.cold_dir and _under(cache.cold_dir, named), "--cold-dir on a named volume"
    # The mesh CA's --host list (the file's header and compose/README.md): every name the mesh dials.
    dialed = sorted(n for n, (module, _) in config.items() if module != "services.edge")
    header = "\n".join(line for line in COMPOSE_FILE.read_text().splitlines() if line.startswith("#"))
    readme = (DEPLOY_DIR / "README.md").read_text()
    for where, text in (("docker-compose.yml", header), ("compose/README.md", readme)):
        assert sorted(re.findall(r"--host (\S+)", text)) == dialed, f"{where}: mesh.pki --host for {dialed}"


def test_compose_observability_files_exist_and_are_scraped(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for name, service in services.items():
        for volume in service.get("volumes") or []:
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (DEPLOY_DIR / source).exists(), f"{name} mounts {source}, which does not exist"
    prometheus = yaml.safe_load((DEPLOY_DIR / "prometheus.yml").read_text())
    targets = {t for job in prometheus["scrape_configs"] for sc in job.get("static_configs", [])
               for t in sc["targets"]}
    for name, module, argv, env in compose_infermesh(compose):
        a = effective(module, argv, env, name)
        port = a.http_port if module == "services.edge" else a.metrics_port
        assert f"127.0.0.1:{port}" in targets, f"compose/prometheus.yml does not scrape {name} (127.0.0.1:{port})"
    collector = " ".join(services["otel-collector"]["command"])
    assert "0.0.0.0:4317" in collector and "jaeger:4317" in collector


# --- Kubernetes ----------------------------------------------------------------------------------

def k8s_files() -> list[Path]:
    return sorted(p for p in K8S_DIR.rglob("*.yaml") if p.name != "kustomization.yaml")


@pytest.fixture(scope="module")
def manifests() -> list[tuple[Path, dict[str, Any]]]:
    return [(path, doc) for path in k8s_files() for doc in yaml.safe_load_all(path.read_text()) if doc]


def test_kubernetes_validate_every_manifest(manifests: list[tuple[Path, dict[str, Any]]]) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    failures = []
    for path, doc in manifests:
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except Exception as exc:        # ValidationError, SchemaNotFoundError: both carry .message
            failures.append(f"{path.relative_to(ROOT)} {doc.get('kind')}/{doc.get('metadata', {}).get('name')}: "
                            f"{getattr(exc, 'message', exc)}")
    assert not failures, "\n".join(failures)


def test_kustomizations_list_every_manifest() -> None:
    for kustomization in K8S_DIR.rglob("kustomization.yaml"):
        listed = yaml.safe_load(kustomization.read_text())["resources"]
        here = {p.name for p in kustomization.parent.glob("*.yaml") if p.name != "kustomization.yaml"}
        files = {r for r in listed if not r.endswith("/")}
        assert files == here, f"{kustomization.relative_to(ROOT)} lists {sorted(files)}, the folder has {sorted(here)}"
        for r in listed:
            assert (kustomization.parent / r).exists(), r


def _by_kind(manifests: list[tuple[Path, dict[str, Any]]], *kinds: str) -> list[dict[str, Any]]:
    return [doc for _, doc in manifests if doc["kind"] in kinds]


def _matches(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _container_env(container: dict[str, Any], config_maps: dict[str, dict[str, str]]) -> dict[str, str | None]:
    env: dict[str, str | None] = {}
    for source in container.get("envFrom") or []:
        env.update(config_maps[source["configMapRef"]["name"]])
    for item in container.get("env") or []:
        env[item["name"]] = item.get("value")            # None: from a field, a secret or a key
    return env


def test_kubernetes_infermesh_containers(manifests: list[tuple[Path, dict[str, Any]]]) -> None:
    config_maps = {d["metadata"]["name"]: d.get("data", {}) for d in _by_kind(manifests, "ConfigMap")}
    seen: dict[str, list[str]] = {}
    for workload in _by_kind(manifests, "Deployment", "StatefulSet"):
        name = workload["metadata"]["name"]
        pod = workload["spec"]["template"]
        assert _matches(workload["spec"]["selector"]["matchLabels"], pod["metadata"]["labels"]), name
        for container in pod["spec"]["containers"]:
            args = container.get("args") or []
            if not args or args[0] not in PREFIXES:
                continue
            module = args[0]
            seen.setdefault(module, []).append(name)
            env = _container_env(container, config_maps)
            # Variables that only feed $(NAME) expansions in args are Kubernetes', not the service's.
            for expanded in re.findall(r"\$\((\w+)\)", " ".join(args)):
                assert expanded in env, f"{name}: args use $({expanded}), which the container does not define"
                del env[expanded]
            where = f"k8s {workload['kind']}/{name}"
            prefix = PREFIXES[module]
            for key in env:
                owner = next((m for m, p in PREFIXES.items() if key.startswith(p + "_")), None)
                if key in OTHER_VARIABLES:
                    continue
                assert owner is not None, f"{where}: {key} is no variable infermesh reads"
                # The shared ConfigMap carries every service's settings; each must be a real flag.
                assert key in flag_variables(*_parser_and_prefix(owner)), f"{where}: {key} matches no flag of {owner}"
            names_only = {k for k, v in env.items() if v is None}
            a = effective(module, args[1:], {k: v for k, v in env.items() if v is not None and
                                             (k in OTHER_VARIABLES or k.startswith(prefix + "_"))}, where)
            values = {k: v for k, v in env.items() if v is not None}
            ports = {p.get("name"): p for p in container["ports"]}
            numbers = {p["containerPort"] for p in container["ports"]}
            resources = container.get("resources", {})
            assert {"cpu", "memory"} <= set(resources.get("requests", {})), f"{where}: resource requests"
            assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
            # Mutual TLS: the kind's Secret mounted where --tls-dir points, readable through fsGroup.
            kind = module.removeprefix("services.")
            secrets = {v["name"]: v["secret"]["secretName"] for v in pod["spec"].get("volumes", []) if "secret" in v}
            mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
            assert a.tls_dir and secrets.get(mounts.get(a.tls_dir, "")) == f"infermesh-mesh-{kind}", \
                f"{where}: --tls-dir {a.tls_dir!r} is the infermesh-mesh-{kind} Secret"
            assert pod["spec"]["securityContext"]["fsGroup"] == pod["spec"]["securityContext"]["runAsUser"]
            if module == "services.edge":
                assert a.host == "0.0.0.0" and addresses(a.router) == [f"router:{launcher.ROUTER_PORT}"]
                assert (a.http_port, a.http3_port) == (launcher.HTTP_PORT, launcher.HTTP3_PORT)
                assert ports["http"]["containerPort"] == a.http_port
                assert ports["http3"] == {"name": "http3", "containerPort": a.http3_port, "protocol": "UDP"}
                assert "INFERMESH_API_KEYS" in names_only, "the edge takes its keys from a Secret"
                continue
            port, metrics = PORTS[module]
            assert a.host == "0.0.0.0" and a.discovery == "consul", where
            assert values["CONSUL_HTTP_ADDR"] == "consul:8500"
            assert a.port == port and a.metrics_port == metrics, f"{where}: the launcher's ports"
            assert {a.port, a.metrics_port} <= numbers
            fields = {i["name"]: i.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
                      for i in container.get("env") or []}
            assert fields.get(f"{prefix}_ADVERTISE") == "status.podIP", f"{where}: registers its pod IP"
            assert fields.get(f"{prefix}_REPLICA_ID") == "metadata.name", f"{where}: one replica id per pod"
            # Kubernetes' native gRPC probe cannot present a client certificate: mesh.healthcheck does.
            probes = [container.get(p) for p in ("readinessProbe", "livenessProbe", "startupProbe")]
            commands = [p["exec"]["command"] for p in probes if p and "exec" in p]
            assert commands and all(c == ["python", "-m", "mesh.healthcheck", f"127.0.0.1:{a.port}"]
                                    for c in commands), f"{where}: mesh.healthcheck probes on {a.port}"
            assert "exec" in container["readinessProbe"], f"{where}: readiness by the gRPC health service"
            assert values["INFERMESH_MESH_TLS_DIR"] == a.tls_dir, f"{where}: the probes present its certificate"
            if module == "services.engine":
                assert a.region in ("a", "b")
            if module == "services.cache":
                mounts = {m["mountPath"] for m in container["volumeMounts"]}
                claims = {c["metadata"]["name"] for c in workload["spec"]["volumeClaimTemplates"]}
                assert workload["kind"] == "StatefulSet" and a.cold_dir in mounts and claims
            if module == "services.router":
                assert addresses(a.tokenizer) == [f"tokenizer:{launcher.TOKENIZER_PORT}"]
                assert a.cache == f"cache:{launcher.CACHE_PORT}" and a.region == "a"
    assert sorted(seen) == sorted(PREFIXES)
    assert len(seen["services.engine"]) >= 3, "engine-a, engine-b and the GPU variant"


def test_kubernetes_runs_two_routers_and_two_tokenizers(manifests: list[tuple[Path, dict[str, Any]]]) -> None:
    """Two router and two tokenizer pods; the edges follow every router pod (Consul), the routers reach
    the tokenizers through a Service over both; the cache's sessions and cold tier on its claim."""
    config_maps = {d["metadata"]["name"]: d.get("data", {}) for d in _by_kind(manifests, "ConfigMap")}
    workloads = _by_kind(manifests, "Deployment", "StatefulSet")
    services = {s["metadata"]["name"]: s for s in _by_kind(manifests, "Service")}

    def runs(module: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        return [(w, c) for w in workloads for c in w["spec"]["template"]["spec"]["containers"]
                if (c.get("args") or [""])[0] == module]

    def pods_behind(address: str, module: str) -> int:
        host = address.rpartition(":")[0]
        assert host in services, f"{address}: not a Service of these manifests"
        selector = services[host]["spec"]["selector"]
        return sum(w["spec"].get("replicas", 1) for w, _ in runs(module)
                   if _matches(selector, w["spec"]["template"]["metadata"]["labels"]))

    for module in ("services.router", "services.tokenizer"):
        found = runs(module)
        assert all(w["kind"] == "Deployment" for w, _ in found), f"{module}: stateless, a Deployment"
        assert sum(w["spec"].get("replicas", 1) for w, _ in found) >= 2, f"{module}: at least two pods"
    ((_, edge),) = runs("services.edge")
    parser, _ = service_parser("services.edge")
    a = parser.parse_args(edge["args"][1:])
    assert a.discovery == "consul", "a Service pins the edge's one connection: it follows each router pod in Consul"
    assert sum(pods_behind(r, "services.router") for r in addresses(a.router)) >= 2, "the edge names both routers"
    env = _container_env(edge, config_maps)
    fields = {i["name"]: i.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for i in edge["env"]}
    assert "CONSUL_HTTP_ADDR" in env and fields.get("INFERMESH_EDGE_ADVERTISE") == "status.podIP"
    for _, router in runs("services.router"):
        tokenizer = _container_env(router, config_maps)["INFERMESH_ROUTER_TOKENIZER"]
        assert tokenizer and sum(pods_behind(t, "services.tokenizer") for t in addresses(tokenizer)) >= 2, \
            "the routers reach both tokenizers"
    ((cache, container),) = runs("services.cache")
    env = _container_env(container, config_maps)
    claims = {c["metadata"]["name"] for c in cache["spec"].get("volumeClaimTemplates", [])}
    claimed = [m["mountPath"] for m in container["volumeMounts"] if m["name"] in claims]
    assert cache["kind"] == "StatefulSet" and claimed
    for variable in ("INFERMESH_CACHE_SESSIONS_DIR", "INFERMESH_CACHE_COLD_DIR"):
        assert env.get(variable) and _under(str(env[variable]), claimed), f"{variable} on the cache's claim"


def test_kubernetes_network_policies_expose_only_the_edge(manifests: list[tuple[Path, dict[str, Any]]]) -> None:
    policies = {d["metadata"]["name"]: d["spec"] for d in _by_kind(manifests, "NetworkPolicy")}
    deny = policies.pop("default-deny-ingress")
    assert deny["podSelector"] == {} and deny["policyTypes"] == ["Ingress"] and not deny.get("ingress")
    callers: dict[str, set[str]] = {}
    for name, spec in policies.items():
        assert spec["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": name}, name
        for rule in spec["ingress"]:
            if "from" not in rule:               # from anywhere: only the edge's public ports
                assert name == "edge", f"NetworkPolicy {name} lets anyone in"
                assert {(p["port"], p["protocol"]) for p in rule["ports"]} == {
                    (launcher.HTTP_PORT, "TCP"), (launcher.HTTP3_PORT, "UDP")}
                continue
            for peer in rule["from"]:
                if "podSelector" in peer:
                    labels = peer["podSelector"]["matchLabels"]
                    callers.setdefault(name, set()).add(labels.get("app.kubernetes.io/name", "any infermesh pod"))
                else:
                    assert "ipBlock" not in peer, f"NetworkPolicy {name}: no address ranges"
    assert callers == {"router": {"edge", "consul"}, "tokenizer": {"router", "consul"},
                       "cache": {"router", "engine", "consul"}, "engine": {"router", "consul"},
                       "consul": {"any infermesh pod"}}


def _parser_and_prefix(module: str) -> tuple[argparse.ArgumentParser, str]:
    parser, prefix = service_parser(module)
    assert prefix is not None, f"{module} reads no INFERMESH_* variables"
    return parser, prefix


def test_kubernetes_wiring(manifests: list[tuple[Path, dict[str, Any]]]) -> None:
    workloads = _by_kind(manifests, "Deployment", "StatefulSet")
    pods = {w["metadata"]["name"]: w["spec"]["template"] for w in workloads}
    # No two workloads claim each other's pods.
    for w in workloads:
        for other, pod in pods.items():
            if other != w["metadata"]["name"]:
                assert not _matches(w["spec"]["selector"]["matchLabels"], pod["metadata"]["labels"]), \
                    f"{w['metadata']['name']}'s selector also matches {other}'s pods"
    for service in _by_kind(manifests, "Service"):
        name = service["metadata"]["name"]
        selected = [p for p in pods.values() if _matches(service["spec"]["selector"], p["metadata"]["labels"])]
        assert selected, f"Service {name} selects no pods"
        for port in service["spec"]["ports"]:
            for pod in selected:
                container_ports = [p for c in pod["spec"]["containers"] for p in c.get("ports", [])]
                target = port.get("targetPort", port["port"])
                found = [p for p in container_ports if target in (p.get("name"), p["containerPort"])]
                assert found, f"Service {name} port {port['name']} has no target {target!r}"
                assert found[0].get("protocol", "TCP") == port.get("protocol", "TCP")
    edge = next(s for s in _by_kind(manifests, "Service") if s["metadata"]["name"] == "edge")
    assert {(p["port"], p["protocol"]) for p in edge["spec"]["ports"]} == {(launcher.HTTP_PORT, "TCP"),
                                                                          (launcher.HTTP3_PORT, "UDP")}
    (pdb,) = _by_kind(manifests, "PodDisruptionBudget")
    selector = pdb["spec"]["selector"]["matchLabels"]
    protected = [n for n, p in pods.items() if _matches(selector, p["metadata"]["labels"])]
    assert {"engine-a", "engine-b"} <= set(protected) and all(n.startswith("engine") for n in protected)
    gpu = pods["engine-gpu"]["spec"]["containers"][0]["resources"]
    assert gpu["limits"]["nvidia.com/gpu"] == 1
    (hpa,) = _by_kind(manifests, "HorizontalPodAutoscaler")
    target = hpa["spec"]["scaleTargetRef"]
    assert target["kind"] == "Deployment" and target["name"] in pods
    (metric,) = hpa["spec"]["metrics"]
    metric_name = metric["pods"]["metric"]["name"]
    assert f'"{metric_name}"' in (ROOT / "services" / "engine" / "metrics.py").read_text(), "an engine metric"
    adapter = next(d for d in _by_kind(manifests, "ConfigMap") if d["metadata"]["name"].endswith("prometheus-adapter"))
    rules = yaml.safe_load(adapter["data"]["config.yaml"])["rules"]
    assert any(r["name"]["as"] == metric_name and metric_name in r["seriesQuery"] for r in rules)
    consul = next(w for w in workloads if w["metadata"]["name"] == "consul")
    assert consul["kind"] == "StatefulSet"
