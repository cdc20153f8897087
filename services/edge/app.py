"""The edge's ASGI application: one app behind both HTTP/1.1 and HTTP/3.

Routes: GET /health, GET /v1/models, POST /v1/chat/completions, POST /v1/completions, POST /v1/responses
(surfaces/responses_api.py), POST /v1/embeddings (surfaces/embeddings.py), POST /tokenize and POST /detokenize
(surfaces/tokenizing.py), /v1/files (batch/files_api.py) and /v1/batches (batch/batches_api.py; the lines run in
batch/runner.py),
GET|PUT /admin/models/{model}/routing and GET /admin/console (admin keys only), GET /metrics,
GET /openapi.json, and the web page (GET /, /static/app.js, /static/style.css: services/edge/console.py).
Bad requests are answered here, in OpenAI's error shape, and never reach the router.

Admission, in order: one Authorization header and bounded session/replica headers (400), failed
keys per client address (429), API key (401), request rate per caller (429), body size (413) and
read time (408), the signature of a key that must sign, every method (401: EdgeApp._signed), parsing
(400), requests in flight across all callers (503), token rate per caller (429); only then the router
(services/edge/surfaces/completions.py).  Slow, oversized or ambiguous HTTP/1.1 request heads are cut off by the
protocol (services/edge/transports/http11.py, services/edge/transports/request_heads.py).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable

import grpc
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from mesh.clients.router_pool import Routers
from services.edge.batch.batches_api import PREFIX as BATCHES_PREFIX
from services.edge.batch.batches_api import Batches
from services.edge.batch.files_api import PREFIX as FILES_PREFIX
from services.edge.batch.files_api import UPLOAD_BODY_BYTES, Files, FileStore
from services.edge.batch.lines import LineCaller, batch_caller
from services.edge.batch.runner import BatchRunner
from services.edge.config import EdgeConfig
from services.edge.console import FILES, Page
from services.edge.errors import ApiError, error_body, from_grpc, shown
from services.edge.gateway.admission import Admission
from services.edge.gateway.pipeline import Pipeline
from services.edge.metrics import REQUESTS, TENANT_REQUESTS
from services.edge.object_store import StoredObjects
from services.edge.surfaces import openapi, requests
from services.edge.surfaces.completions import Completions
from services.edge.surfaces.embeddings import Embeddings
from services.edge.surfaces.fields import parse_json
from services.edge.surfaces.lora_api import PATHS as LORA_PATHS
from services.edge.surfaces.lora_api import LoraApi
from services.edge.surfaces.responses_api import PREFIX as RESPONSES_PREFIX
from services.edge.surfaces.responses_api import Responses
from services.edge.surfaces.tokenizing import Tokenizing
from services.edge.transports.asgi import JSON_HEADERS, Message, Receive, Scope, Send, read_body, send_json

log = logging.getLogger(__name__)

# A route: (scope, lower-cased headers, receive, send) -> the status it answered.
Route = Callable[[Scope, dict[str, str], Receive, Send], Awaitable[int]]

ADMIN_PREFIX = "/admin/models/"
REPLICAS = "/admin/replicas"
CONSOLE = "/admin/console"
# No API key needed: the page's static files, liveness, Prometheus' scrape, the API's description.
PUBLIC = ("/health", "/metrics", "/openapi.json", *FILES)
BODILESS = ("GET", "HEAD", "DELETE", "OPTIONS")      # signed over an empty body
ROUTES = ("/health", "/v1/models", "/metrics", "/openapi.json", "/v1/chat/completions", "/v1/completions",
          "/v1/responses", "/v1/embeddings", "/tokenize", "/detokenize", "/v1/files", "/v1/batches", *LORA_PATHS,
          *FILES)


class EdgeApp:
    def __init__(self, config: EdgeConfig, router: Routers):
        self.config = config
        self.router = router
        self.admission = Admission(config)
        self.pipeline = Pipeline(config, router, self.admission)     # every surface's policies (pipeline.py)
        self.completions = Completions(config, router, self.pipeline)
        self.tokenizing = Tokenizing(config, router, self.pipeline)
        self.embeddings = Embeddings(config, router, self.pipeline)
        self.stored = StoredObjects(config.cache_service)     # responses, files, batches (object_store.py)
        self.responses = Responses(config, router, self.pipeline, self.stored)
        files = FileStore(self.stored)
        self.files = Files(files, self.admission, config.body_timeout_s)
        self.openapi = json.dumps(openapi.document(config)).encode()
        self.page = Page(router)
        self.lora = LoraApi(config, router, self.completions.cache.versions.invalidate)
        self.alt_svc = f'h3=":{config.http3_port}"; ma=86400'.encode() if config.http3_port else b""
        self._health_cache: tuple[float, bool] = (0.0, False)
        self.routes: dict[tuple[str, str], Route] = {
            ("GET", "/health"): self.health,
            ("GET", "/v1/models"): self.models,
            ("GET", "/metrics"): self.metrics,
            ("GET", "/openapi.json"): self.openapi_json,
            ("POST", "/v1/chat/completions"): self.completions.chat,
            ("POST", "/v1/completions"): self.completions.completions,
            ("POST", "/v1/embeddings"): self.embeddings.embeddings,
            ("POST", "/v1/responses"): self.responses.create,
            ("POST", "/tokenize"): self.tokenizing.tokenize,
            ("POST", "/detokenize"): self.tokenizing.detokenize,
            ("POST", LORA_PATHS[0]): self.lora.load,
            ("POST", LORA_PATHS[1]): self.lora.unload,
            ("GET", CONSOLE): self.page.console,
            **{("GET", path): self.page.static for path in FILES},
        }
        self.batch_runner = BatchRunner(self.stored, files, LineCaller(self.routes, self.admission),
                                        lambda run: batch_caller(self.admission, run), config.replica_id,
                                        config.batch_concurrency)
        self.batches = Batches(files, self.batch_runner, self.pipeline.read_json)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        scope["infermesh.t0"] = time.perf_counter()
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        method, path = scope["method"], scope["path"]
        route, admin = self._resolve(method, path)
        status = 500
        started = False

        async def tracked_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if self.alt_svc and scope.get("http_version") != "3":    # HTTP/3 on the UDP port
                    message = {**message, "headers": [*message.get("headers", []), (b"alt-svc", self.alt_svc)]}
            await send(message)

        try:
            route = self._admit(scope, headers, route, admin)
            status = await route(scope, headers, await self._signed(scope, headers, receive), tracked_send)
        except ApiError as exc:
            status = exc.status
            if not started:
                await send_json(tracked_send, exc.status, exc.body(), exc.retry_after_s, exc.close)
        except Exception:
            log.exception("%s %s failed", method, path)
            if not started:
                await send_json(tracked_send, 500, error_body("internal error", "server_error", None))
        finally:
            REQUESTS.labels("/admin" if admin else path if route else "other", str(status)).inc()
            who = scope.get("infermesh.caller")
            if who is not None:
                TENANT_REQUESTS.labels(who.label, who.tier.name, str(status)).inc()

    def _resolve(self, method: str, path: str) -> tuple[Route | None, bool]:
        """The handler of `method path` (None: there is none) and whether the path is an admin one."""
        route = self.routes.get((method, path))
        admin = (path.startswith(ADMIN_PREFIX) or path == REPLICAS or path.startswith(REPLICAS + "/")
                 or path == CONSOLE or path in LORA_PATHS)
        if path.startswith(RESPONSES_PREFIX) and method in ("GET", "DELETE"):
            route = self.responses.stored_response
        elif path == FILES_PREFIX or path.startswith(FILES_PREFIX + "/"):
            route = self.files.route
        elif path == BATCHES_PREFIX or path.startswith(BATCHES_PREFIX + "/"):
            route = self.batches.route
        elif path.startswith(ADMIN_PREFIX) and method in ("GET", "PUT"):
            route = self.admin
        elif method == "POST" and (path == REPLICAS or path.startswith(REPLICAS + "/")):
            route = self.replicas
        return route, admin

    def _admit(self, scope: Scope, headers: dict[str, str], route: Route | None, admin: bool) -> Route:
        """`route`, once the request may reach it (raises ApiError): sane headers, a route for it (404,
        405), the admin token on admin paths, elsewhere (not public) the caller's key, signature and rate."""
        method, path = scope["method"], scope["path"]
        requests.check_headers(scope.get("headers", []))
        if route is None:
            if path in ROUTES or admin:
                raise ApiError(405, f"method {shown(method)} is not allowed on {path}", code="method_not_allowed")
            raise ApiError(404, f"no route {shown(method)} {shown(path)}", kind="not_found_error", code=None)
        if admin:
            self.admission.check_admin(scope, headers)
        elif path not in PUBLIC:
            scope["infermesh.caller"] = caller = self.admission.authenticate(scope, headers)
            self.admission.limit_requests(caller)
        return route

    async def _signed(self, scope: Scope, headers: dict[str, str], receive: Receive) -> Receive:
        """The request's body stream, once a caller whose key must sign has signed this request, every method,
        with a body or not (401); the body is read here to check it, and handed on to the route as it came."""
        caller = scope.get("infermesh.caller")
        if caller is None or caller.signing_secret is None:
            return receive
        if scope["method"] in BODILESS:
            self.admission.check_signature(caller, scope, headers, b"")
            return receive
        limit = UPLOAD_BODY_BYTES if scope["path"] == FILES_PREFIX else self.config.max_body_bytes
        body = await read_body(receive, headers, limit, self.config.body_timeout_s)
        self.admission.check_signature(caller, scope, headers, body)
        given = False

        async def replay() -> Message:
            nonlocal given
            if given:
                return await receive()           # after the body: the client's disconnect, as before
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return replay

    # -- simple routes -----------------------------------------------------------------
    async def health(self, scope: Scope, headers: dict[str, str], receive: Receive, send: Send) -> int:
        if _verbose(scope):
            return await self._health_verbose(scope, headers, send)
        checked_at, ok = self._health_cache
        if time.monotonic() - checked_at > 0.5:
            ok = await self.router.healthy()
            self._health_cache = (time.monotonic(), ok)
        status = 200 if ok else 503
        await send_json(send, status, {"status": "ok" if ok else "unavailable"})
        return status

    async def _health_verbose(self, scope: Scope, headers: dict[str, str], send: Send) -> int:
        """`/health?verbose=1`: each service's state, as the router sees it.  When keys are set, a caller's
        key as for any API route: its signature (a key that must sign) and its request rate."""
        scope["infermesh.caller"] = caller = self.admission.authenticate(scope, headers)
        self.admission.check_signature(caller, scope, headers, b"")
        self.admission.limit_requests(caller)
        try:
            state = await self.router.state()
        except grpc.aio.AioRpcError as err:
            body = {"status": "unavailable", "edge": "serving",
                    "router": {"address": self.router.address, "state": f"unreachable: {err.code().name}"}}
            await send_json(send, 503, body)
            return 503
        ok = state["ready"]
        await send_json(send, 200 if ok else 503, {
            "status": "ok" if ok else "unavailable", "edge": "serving",
            "router": {"address": self.router.address, "state": "ready" if ok else "not ready",
                       "expected_engines": state["expected_engines"], "load_entropy": state["load_entropy"]},
            "tokenizer": state["tokenizer"], "engines": state["engines"],
            **({"routers": state["routers"]} if "routers" in state else {})})
        return 200 if ok else 503

    async def models(self, scope: Scope, headers: dict[str, str], receive: Receive, send: Send) -> int:
        try:
            cards = await self.router.models()
        except grpc.aio.AioRpcError as err:
            raise from_grpc(err) from None
        data = [{"id": c.name, "object": "model", "created": 0, "owned_by": "infermesh",
                 "version": c.version, "versions": list(c.versions), "replicas": c.replicas,
                 "max_context": c.max_context, "parent": c.parent or None} for c in cards]
        await send_json(send, 200, {"object": "list", "data": data})
        return 200

    async def metrics(self, scope: Scope, headers: dict[str, str], receive: Receive, send: Send) -> int:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", CONTENT_TYPE_LATEST.encode())]})
        await send({"type": "http.response.body", "body": generate_latest()})
        return 200

    async def openapi_json(self, scope: Scope, headers: dict[str, str], receive: Receive, send: Send) -> int:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [*JSON_HEADERS, (b"content-length", str(len(self.openapi)).encode())]})
        await send({"type": "http.response.body", "body": self.openapi})
        return 200

    # -- admin: model versions ---------------------------------------------------------
    async def admin(self, scope: Scope, headers: dict[str, str], receive: Receive, send: Send) -> int:
        """GET|PUT /admin/models/{model}/routing: the default version and canary shares.

        PUT body: {"default_version": "2"} and/or {"canary": {"3": 0.1}} (replaces the shares;
        {} ends a canary).  Requests already streaming finish on the version they started on."""
        model, _, tail = scope["path"][len(ADMIN_PREFIX):].partition("/")
        if model and tail.startswith("versions/") and scope["method"] == "PUT":
            return await self._load_version(model, tail.removeprefix("versions/"), headers, receive, send)
        if not model or tail != "routing":
            raise ApiError(404, f"no admin route {shown(scope['path'])}; use {ADMIN_PREFIX}MODEL/routing (GET, PUT) "
                           f"or {ADMIN_PREFIX}MODEL/versions/VERSION (PUT)", kind="not_found_error", code=None)
        try:
            if scope["method"] == "GET":
                routing = await self.router.model_routing(model)
            else:
                body = await read_body(receive, headers, self.config.max_body_bytes, self.config.body_timeout_s)
                default, canary, shadow = requests.parse_model_routing(parse_json(body))
                routing = await self.router.set_model_routing(model, default, canary, shadow=shadow)
                self.completions.cache.versions.invalidate()     # cached answers of the old default: misses
        except grpc.aio.AioRpcError as err:
            raise from_grpc(err) from None
        await send_json(send, 200, routing.as_dict())
        return 200


    async def replicas(self, scope: Scope, headers: dict[str, str], receive: Receive, send: Send) -> int:
        """POST /admin/replicas/{id}/drain: no new requests to the engine, its streams finish, then it
        leaves discovery (answers then).  POST /admin/replicas {"replica_id", "address", "region"}:
        add an engine at runtime (static discovery)."""
        tail = scope["path"][len(REPLICAS):].strip("/")
        try:
            if tail.endswith("/drain") and tail.count("/") == 1:
                replica = tail.removesuffix("/drain")
                finished = await self.router.drain_replica(replica)
                await send_json(send, 200, {"replica": replica, "drained": True, "finished": finished})
                return 200
            if tail:
                raise ApiError(404, f"no admin route {shown(scope['path'])}; use POST {REPLICAS}/ID/drain or "
                               f"POST {REPLICAS}", kind="not_found_error", code=None)
            body = parse_json(await read_body(receive, headers, self.config.max_body_bytes,
                                              self.config.body_timeout_s))
            fields = {k: body.get(k, "") for k in ("replica_id", "address", "region")}
            if set(body) - set(fields) or not all(isinstance(v, str) for v in fields.values()):
                raise ApiError(400, "give {\"replica_id\": ID, \"address\": \"HOST:PORT\"} and optionally "
                               "\"region\", all strings", "replica_id")
            await self.router.add_replica(fields["replica_id"], fields["address"], fields["region"])
        except grpc.aio.AioRpcError as err:
            raise from_grpc(err) from None
        await send_json(send, 200, {"replica": fields["replica_id"], "added": True})
        return 200

    async def _load_version(self, model: str, version: str, headers: dict[str, str], receive: Receive,
                            send: Send) -> int:
        """PUT /admin/models/{model}/versions/{version}, body {"source": FOLDER_OR_REGISTERED_NAME,
        "activate": true}: hot swap onto every replica (in-flight requests finish on the weights they
        started with); with activate (the default) the version becomes the model's default."""
        body = parse_json(await read_body(receive, headers, self.config.max_body_bytes, self.config.body_timeout_s))
        unknown = sorted(set(body) - {"source", "activate"})
        if unknown:
            raise ApiError(400, f"unrecognized field(s): {shown(', '.join(unknown))}; use source and activate",
                           unknown[0], code="unknown_parameter")
        source, activate = body.get("source", ""), body.get("activate", True)
        if not isinstance(source, str) or not isinstance(activate, bool) or not version or "/" in version:
            raise ApiError(400, "give {\"source\": FOLDER_OR_REGISTERED_NAME} (a string) and optionally "
                           "{\"activate\": false}, for /admin/models/MODEL/versions/VERSION", "source")
        if not source and not activate:
            raise ApiError(400, "nothing to do: give a source to load, or activate a loaded version", "source",
                           code="missing_required_parameter")
        try:
            loaded = await self.router.load_model_version(model, version, source, activate)
            self.completions.cache.versions.invalidate()
        except grpc.aio.AioRpcError as err:
            raise from_grpc(err) from None
        await send_json(send, 200, loaded.as_dict())
        return 200


def _verbose(scope: Scope) -> bool:
    query = scope.get("query_string", b"").decode("latin-1")
    return any(part in ("verbose", "verbose=1", "verbose=true") for part in query.split("&"))
