"""The gateway's HTTP face: FastAPI routes over `GatewayService`, and the error contract.

Every refusal is an OpenAI-shaped error body (`{"error": {"message", "type", "code"}}`) with a 4xx
status whose message says what is wrong: a request can be refused, never crash the gateway. 5xx
statuses mean the gateway's side failed (no engine, store down, timeout; 501: no engine here can
score), never the request. 4xx answers carry `x-should-retry: false`, which the `openai` client
honours, so an agent does not re-send a request that cannot succeed (it would otherwise retry 409s).

Who may call what (`auth`): the lifecycle and scoring routes take the run token, the engine routes
the engine token, the OpenAI and token-generation routes a rollout key; /health, /v1/models and the
OpenAPI schema are open. With `gateway.auth: false` (loopback only) the two tokens are not checked.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.exceptions import HTTPException as StarletteHTTPException

from asyncrl.configs.schema import GatewayConfig
from asyncrl.records import RequestError

from . import anthropic, anthropic_route, api, streaming
from .auth import refusal
from .conversation import ConversationError
from .engines import EngineFailure, ScoringUnsupported, connect
from .errors import GatewayError
from .lean_route import LeanJSONRoute, anthropic_key, rollout_key
from .pool import Abandoned, EngineUnavailable, GenerationTimeout
from .registry import EngineIdTaken, RegistryFull
from .replicas import Forwarding
from .service import GatewayService
from .store import RolloutClosed, StoreError, UnknownRollout
from .toolcalls import MessageError

log = logging.getLogger(__name__)

# exception type -> (status, code); the first match in this order wins.
_ERRORS: list[tuple[type[Exception], int, str]] = [
    (UnknownRollout, 404, "rollout_not_found"),
    (RolloutClosed, 409, "rollout_closed"),
    (Abandoned, 409, "rollout_closed"),
    (StoreError, 400, "invalid_request"),
    (RequestError, 400, "invalid_request"),
    (MessageError, 400, "invalid_messages"),
    (ConversationError, 400, "too_many_branches"),
    (EngineIdTaken, 409, "engine_id_taken"),
    (RegistryFull, 409, "too_many_engines"),
    (ScoringUnsupported, 501, "scoring_unsupported"),  # a well-formed request no engine here can serve
    (EngineUnavailable, 503, "engine_unavailable"),
    (EngineFailure, 503, "engine_failed"),  # mid-stream, after tokens went out (nothing is retried then)
    (GenerationTimeout, 504, "timeout"),
]


ANTHROPIC_PATHS = "/v1/messages"
"""Routes whose errors take Anthropic's shape ({"type": "error", "error": {"type", "message"}})."""


def error_response(status: int, code: str, message: str, path: str = "") -> JSONResponse:
    headers = {"x-should-retry": "false"} if status < 500 else None
    if path.startswith(ANTHROPIC_PATHS):
        return JSONResponse(anthropic.error_body(status, message), status, headers=headers)
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "code": code, "param": None}}, status, headers=headers)


def classify(error: BaseException) -> tuple[int, str, str]:
    """(status, code, message) of an error, as the handlers below answer it (for streams that already started)."""
    if isinstance(error, GatewayError):
        return error.status, error.code, str(error)
    for kind, status, code in _ERRORS:
        if isinstance(error, kind):
            return status, code, str(error)
    return 500, "internal_error", f"the gateway failed: {type(error).__name__}: {error}"


class BodyLimit:
    """Refuses bodies over `max_bytes` with 413 before anything parses them (declared or streamed)."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"0")
        too_big = f"request body exceeds gateway.max_body_bytes ({self.max_bytes} bytes)"
        path = scope.get("path", "")
        if not declared.isdigit():
            return await error_response(400, "invalid_request", "invalid Content-Length header", path)(scope, receive, send)
        if int(declared) > self.max_bytes:
            return await error_response(413, "body_too_large", too_big, path)(scope, receive, send)
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise _TooLarge(too_big)
            return message

        try:
            await self.app(scope, limited, send)
        except _TooLarge as error:
            await error_response(413, "body_too_large", error.detail, path)(scope, receive, send)


class _TooLarge(HTTPException):
    # An HTTPException, because FastAPI turns any other error while reading a body into a vague 400.
    def __init__(self, message: str) -> None:
        super().__init__(413, message)


def settle_heap() -> None:
    """Move everything alive at start-up (torch, transformers, the tokenizer: ~380k objects) out of the
    garbage collector's reach. Otherwise each full collection walks them all, stopping the event loop
    for 0.1-0.6 s with requests waiting (the gateway's p99); later ones scan what requests created."""
    gc.collect()
    gc.freeze()


def run_loop(main: Coroutine) -> Any:
    """`asyncio.run(main)` on uvloop where it is installed (`uvicorn[standard]`), else the stdlib loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


GRACEFUL_SHUTDOWN_S = 5
"""After SIGTERM or Ctrl-C, requests still running get this long; then the gateway exits regardless."""


def gateway_server(app: Any, config: GatewayConfig, *, host: str | None = None, port: int | None = None, **options: Any):
    """The uvicorn server every gateway runs on: `config`'s address (or `host`/`port`), its keep-alive, and
    an exit within GRACEFUL_SHUTDOWN_S of a stop signal however many requests are in flight."""
    import uvicorn

    options.setdefault("log_level", "warning")
    return uvicorn.Server(uvicorn.Config(
        app, host=config.host if host is None else host, port=config.port if port is None else port,
        timeout_keep_alive=config.keep_alive_s, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, **options,
    ))  # fmt: skip


_RUN_BEARER = HTTPBearer(auto_error=False, scheme_name="RunToken", description="the run token (`asyncrl token CONFIG`)")
_ENGINE_BEARER = HTTPBearer(auto_error=False, scheme_name="EngineToken", description="the engine token (`asyncrl token CONFIG --engine`)")


def _token_checks(service: GatewayService) -> tuple[Any, Any]:
    """(run token check, engine token check): route dependencies that answer 401 saying which token is needed."""

    def check(needed: str, scheme: HTTPBearer, valid):
        async def dependency(credentials: HTTPAuthorizationCredentials | None = Depends(scheme)) -> None:
            presented = credentials.credentials if credentials else None
            if service.config.auth and not valid(presented):
                raise GatewayError(401, f"{needed}_token_required", refusal(needed, presented))

        return Depends(dependency)

    return (
        check("run", _RUN_BEARER, service.credentials.is_run_token),
        check("engine", _ENGINE_BEARER, service.credentials.is_engine_token),
    )


def create_app(service: GatewayService, *, heartbeats: bool = True) -> FastAPI:
    """The gateway app. With `heartbeats`, its lifespan runs the pool's heartbeat loop."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        task = asyncio.create_task(service.pool.run_heartbeats()) if heartbeats else None
        try:
            yield
        finally:
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            await service.background.drain(GRACEFUL_SHUTDOWN_S)  # turns still being recorded, before the store closes

    app = FastAPI(title="asyncrl TITO gateway", version="1", lifespan=lifespan, responses={
        400: {"model": api.ErrorResponse}, 401: {"model": api.ErrorResponse}, 409: {"model": api.ErrorResponse},
    })  # fmt: skip
    if service.replicas is not None:
        app.add_middleware(Forwarding, replicas=service.replicas)  # inside the body limit (the last added is outermost)
    app.add_middleware(BodyLimit, max_bytes=service.config.max_body_bytes)
    _install_errors(app)
    run_token, engine_token = _token_checks(service)

    # The hot path: FastAPI's generic request handling (dependency solving, validation, response
    # encoding) cost as much as the gateway's own work on a call, so these routes are declared as
    # usual (the OpenAPI schema is FastAPI's own) but answered by a `LeanJSONRoute`.
    openai_error, anthropic_error = streaming.openai_error_event(classify), anthropic_route.error_event(classify)

    async def chat_completions(request: api.ChatCompletionRequest, key: str | None = Depends(rollout_key)) -> Any:
        if not request.stream:
            return JSONResponse(await service.chat(key, request))
        turn = await service.begin_chat(key, request)
        return streaming.EventStream(streaming.chat_events(service, turn, request), openai_error, lambda: service.drop(turn))

    async def completions(request: api.CompletionRequest, key: str | None = Depends(rollout_key)) -> Any:
        if not request.stream:
            return JSONResponse(await service.complete(key, request))
        if request.logprobs is not None:
            raise GatewayError(400, "invalid_request", "logprobs with stream=true is not supported on /v1/completions; send one of them")
        turn = await service.begin_text(key, request)
        return streaming.EventStream(streaming.completion_events(service, turn, request), openai_error, lambda: service.drop(turn))

    async def messages(request: anthropic.MessagesRequest, key: str | None = Depends(anthropic_key)) -> Any:
        answer = await anthropic_route.create_message(service, key, request, anthropic_error)
        return answer if isinstance(answer, streaming.EventStream) else JSONResponse(answer)

    async def count_tokens(request: anthropic.CountTokensRequest, key: str | None = Depends(anthropic_key)) -> JSONResponse:
        return JSONResponse(await anthropic_route.count_tokens(service, key, request))

    routes: list[tuple[str, Callable[..., Any], str]] = [
        ("/v1/chat/completions", chat_completions, "openai"), ("/v1/completions", completions, "openai"),
        ("/v1/messages", messages, "anthropic"), ("/v1/messages/count_tokens", count_tokens, "anthropic"),
    ]  # fmt: skip
    for path, endpoint, tag in routes:
        app.router.add_api_route(
            path, endpoint, methods=["POST"], tags=[tag], response_class=JSONResponse, route_class_override=LeanJSONRoute
        )

    @app.get("/v1/models", tags=["openai"])
    async def models() -> dict:
        return {"object": "list", "data": [{"id": service.model_name, "object": "model", "created": 0, "owned_by": "asyncrl"}]}

    @app.post("/v1/tokens/generate", tags=["tokens"])
    async def tokens_generate(request: api.TokenGenerateRequest, key: str | None = Depends(rollout_key)) -> api.TokenGenerateResponse:
        return await service.generate_tokens(key, request)

    @app.post("/v1/tokens/score", tags=["tokens"], dependencies=[run_token])
    async def tokens_score(request: api.TokenScoreRequest) -> api.TokenScoreResponse:
        return await service.score_tokens(request)

    @app.post("/rollouts", tags=["lifecycle"], dependencies=[run_token])
    async def open_rollout(request: api.OpenRolloutRequest) -> api.OpenRolloutResponse:
        return await service.rollouts.open(request)

    @app.post("/rollouts/{rollout_id}/finish", tags=["lifecycle"], dependencies=[run_token])
    async def finish_rollout(rollout_id: str, request: api.FinishRolloutRequest) -> api.RolloutInfo:
        return await service.rollouts.finish(rollout_id, request)

    @app.post("/rollouts/{rollout_id}/abort", tags=["lifecycle"], dependencies=[run_token])
    async def abort_rollout(rollout_id: str, request: api.AbortRolloutRequest | None = None) -> api.RolloutInfo:
        return await service.rollouts.abort(rollout_id, request or api.AbortRolloutRequest())

    @app.get("/rollouts/{rollout_id}", tags=["lifecycle"], dependencies=[run_token])
    async def get_rollout(rollout_id: str) -> api.RolloutInfo:
        return await service.rollouts.info(rollout_id)

    @app.post("/engines/register", tags=["engines"], dependencies=[engine_token])
    async def register_engine(request: api.RegisterEngineRequest) -> api.RegisterEngineResponse:
        try:
            handle = connect(request.address, request.engine_id)
        except ValueError as error:
            raise GatewayError(400, "invalid_engine", str(error)) from None
        lease = service.pool.register(handle, request.capacity, request.health, holder=request.lease)
        return api.RegisterEngineResponse(registered=True, lease=lease)

    @app.get("/engines/replicas", tags=["engines"], dependencies=[engine_token])
    async def gateway_replicas() -> dict:
        """Replica id -> URL of this gateway's live replicas (itself included); engines announce themselves to each."""
        return {"replicas": dict(service.replicas.peers) if service.replicas else {}}

    @app.post("/engines/{engine_id}/heartbeat", tags=["engines"], dependencies=[engine_token])
    async def engine_heartbeat(engine_id: str, request: api.HeartbeatRequest) -> api.HeartbeatResponse:
        return api.HeartbeatResponse(registered=service.pool.heartbeat(engine_id, request.health, holder=request.lease))

    @app.post("/engines/{engine_id}/deregister", tags=["engines"], dependencies=[engine_token])
    async def deregister_engine(engine_id: str, request: api.DeregisterEngineRequest) -> api.DeregisterEngineResponse:
        return api.DeregisterEngineResponse(deregistered=service.pool.leave(engine_id, request.lease))

    @app.get("/health", tags=["status"])
    async def health() -> dict:
        return service.health()

    return app


def _install_errors(app: FastAPI) -> None:
    # One handler per type: handlers for Exception itself run in Starlette's outermost middleware,
    # which logs the error as a crash and re-raises it; these answer and are done.
    def answer(status: int, code: str):
        async def handler(request: Request, error: Exception) -> JSONResponse:
            return error_response(status, code, str(error), request.url.path)

        return handler

    for kind, status, code in _ERRORS:
        app.add_exception_handler(kind, answer(status, code))

    @app.exception_handler(GatewayError)
    async def gateway_error(request: Request, error: GatewayError) -> JSONResponse:
        return error_response(error.status, error.code, str(error), request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}.get(error.status_code, "http_error")
        return error_response(error.status_code, code, str(error.detail), request.url.path)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        problems = []
        for problem in error.errors():
            where = ".".join(str(p) for p in problem.get("loc", ()) if p != "body") or "body"
            problems.append(f"{where}: {problem.get('msg', 'invalid')}")
        return error_response(400, "invalid_request", "; ".join(problems[:10]) or "invalid request", request.url.path)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception) -> JSONResponse:
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return error_response(500, "internal_error", f"the gateway failed: {type(error).__name__}: {error}", request.url.path)
