"""A FastAPI route for the gateway's hot path: a JSON body and the rollout key in, a Response out.

FastAPI's generic request handling (body parsing by content type, dependency solving, validation
through its own field layer, response encoding) took ~35 µs of the ~50 µs a FastAPI route costs
per request, more than rendering a prompt. `LeanJSONRoute` is declared like any route, so the
OpenAPI schema, the middleware and the exception handlers are FastAPI's own, but its ASGI app does
only what its endpoint needs: read the body, validate it with the body model in one pass (JSON
included), read the bearer key, call the endpoint, send its Response. Refusals are the same
exceptions FastAPI raises (a RequestValidationError for a bad body), so the app's handlers answer
them as on every other route.
"""

from __future__ import annotations

import inspect
from typing import Any

from fastapi import Depends
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ValidationError
from starlette.requests import HTTPConnection

bearer = HTTPBearer(auto_error=False, description="the rollout's api_key from POST /rollouts")
api_key_header = APIKeyHeader(name="x-api-key", auto_error=False, description="the rollout's api_key, as the Anthropic SDK sends it")


async def rollout_key(credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> str | None:
    """The rollout key from `Authorization: Bearer <key>`, or None (the service answers 401)."""
    # async: FastAPI runs a plain `def` dependency on a worker thread, a thread hop per request.
    return credentials.credentials if credentials else None


async def anthropic_key(
    api_key: str | None = Depends(api_key_header), credentials: HTTPAuthorizationCredentials | None = Depends(bearer)
) -> str | None:
    """The rollout key from `x-api-key` (the Anthropic SDK's `api_key`) or `Authorization: Bearer` (its `auth_token`)."""
    return api_key or (credentials.credentials if credentials else None)


async def _scope_key(dependency, scope) -> str | None:
    connection = HTTPConnection(scope)
    credentials = await bearer(connection)
    if dependency is anthropic_key:
        return await anthropic_key(await api_key_header(connection), credentials)
    return await rollout_key(credentials)


class LeanJSONRoute(APIRoute):
    """A route whose endpoint is `async def endpoint(body: SomeModel, key = Depends(rollout_key)) -> Response`
    (or `Depends(anthropic_key)`); the Response may be any ASGI app (a stream)."""

    def __init__(self, path: str, endpoint: Any, **kwargs: Any) -> None:
        super().__init__(path, endpoint, **kwargs)
        params = list(inspect.signature(endpoint, eval_str=True).parameters.values())
        shape_ok = (
            len(params) == 2
            and inspect.isclass(params[0].annotation)
            and issubclass(params[0].annotation, BaseModel)
            and getattr(params[1].default, "dependency", None) in (rollout_key, anthropic_key)
        )
        if not shape_ok:  # anything else would be silently skipped by the lean app below
            raise TypeError(f"LeanJSONRoute {path}: the endpoint must take (body: BaseModel, key=Depends(rollout_key))")
        self.app = _lean_app(endpoint, params[0].annotation, params[1].default.dependency)


def _lean_app(endpoint, model: type[BaseModel], key_dependency):
    async def app(scope, receive, send) -> None:
        body = await _read_body(receive)
        if body is None:
            return  # the client left; there is nobody to answer
        request = _validated(model, _content_type(scope), body)
        key = await _scope_key(key_dependency, scope)
        response = await endpoint(request, key)
        await response(scope, receive, send)

    return app


async def _read_body(receive) -> bytes | None:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def _content_type(scope) -> str:
    for name, value in scope["headers"]:
        if name == b"content-type":
            return value.decode("latin-1").partition(";")[0].strip().lower()
    return ""


def _validated(model: type[BaseModel], content_type: str, body: bytes) -> BaseModel:
    # As FastAPI: only a JSON content type is read as JSON.
    if not (content_type == "application/json" or (content_type.startswith("application/") and content_type.endswith("+json"))):
        problem = {"type": "content_type", "loc": ("body",), "msg": "send the body as JSON with Content-Type: application/json"}
        raise RequestValidationError([problem])
    try:
        return model.model_validate_json(body)
    except ValidationError as error:
        raise RequestValidationError(error.errors(include_url=False)) from None
