"""An HTTP transport that hands each request to the gateway's ASGI app on this event loop: no socket.

Episodes that `asyncrl run` plays in its own process call the gateway it hosts there. Over loopback
HTTP, each call paid for an aiohttp request, two socket writes and reads, uvicorn's parsing and the
event loop's I/O wake-ups (most of the driver's CPU per rollout, docs/BENCHMARKS.md). Through this
transport the same OpenAI client calls the same app, so every request goes through the same routes,
validation, authentication and recording code as one that came over a socket.

Two behaviours of a socket are kept, because the gateway's accounting depends on them:

- A client that gives up (its episode cancelled or timed out) hangs up; it does not cancel the
  gateway's handler. The app runs in a task of its own, hears `http.disconnect` (a stream then
  aborts its engine request and records the turn as truncated) and finishes on its own.
- A streamed reply reaches the client as the app sends it, not when it ends.

An exception the app does not answer becomes a 500 response, as uvicorn would send.

`InProcessHttpClient` is the episodes' HTTP client over this transport. It also names the transport as
`direct`, so `asyncrl.episode_client.EpisodeClient` can hand it plain JSON posts without the OpenAI SDK's
request building.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Any

import httpx2
import openai

log = logging.getLogger(__name__)

Receive = Callable[[], Awaitable[dict]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[MutableMapping[str, Any], Receive, Send], Awaitable[None]]

CLIENT = ("127.0.0.1", 0)
"""The peer address the app sees: loopback, as for a local agent's socket."""


class InProcessTransport(httpx2.AsyncBaseTransport):
    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.running: set[asyncio.Task] = set()  # every handler until it finishes, its client gone or not

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        body = b"".join([chunk async for chunk in request.stream])  # type: ignore[union-attr]
        exchange = _Exchange(body)
        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": request.method,
            "scheme": request.url.scheme, "path": request.url.path, "raw_path": request.url.raw_path.split(b"?")[0],
            "query_string": request.url.query, "root_path": "", "client": CLIENT,
            "server": (request.url.host, request.url.port), "headers": [(k.lower(), v) for k, v in request.headers.raw],
        }  # fmt: skip
        handler = asyncio.ensure_future(self._serve(scope, exchange))
        self.running.add(handler)
        handler.add_done_callback(self.running.discard)
        try:
            await asyncio.shield(exchange.started)
        except asyncio.CancelledError:
            exchange.hang_up()
            raise
        status, headers = exchange.started.result()
        return httpx2.Response(status, headers=headers, stream=_Body(exchange))

    async def _serve(self, scope: dict, exchange: _Exchange) -> None:
        try:
            await self.app(scope, exchange.receive, exchange.send)
        except Exception:
            log.exception("the gateway app raised on %s %s", scope["method"], scope["path"])
            if not exchange.started.done():
                exchange.started.set_result((500, [(b"content-type", b"text/plain")]))
                exchange.chunks.put_nowait(b"Internal Server Error")
        finally:
            if not exchange.started.done():  # the app returned without answering
                exchange.started.set_result((500, []))
            exchange.chunks.put_nowait(None)

    async def aclose(self) -> None:
        """Wait for the handlers of clients that hung up (each ends its turn's record)."""
        await asyncio.gather(*self.running, return_exceptions=True)


class InProcessHttpClient(openai.DefaultAsyncHttpxClient):
    """The OpenAI client's HTTP client into `app` in this process (no timeouts: the episode has its own)."""

    def __init__(self, app: ASGIApp) -> None:
        self.direct = InProcessTransport(app)
        super().__init__(transport=self.direct, timeout=None)


class _Exchange:
    """One request's ASGI channel: the body in, the response start and its chunks out."""

    def __init__(self, body: bytes) -> None:
        self.body: bytes | None = body
        self.started: asyncio.Future[tuple[int, list]] = asyncio.get_running_loop().create_future()
        self.chunks: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.gone = asyncio.Event()

    def hang_up(self) -> None:
        self.gone.set()

    async def receive(self) -> dict:
        if self.body is not None:
            body, self.body = self.body, None
            return {"type": "http.request", "body": body, "more_body": False}
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: MutableMapping[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.started.set_result((message["status"], message.get("headers", [])))
        # After a hang-up the body goes nowhere, as uvicorn drops writes to a closed connection.
        elif message["type"] == "http.response.body" and message.get("body") and not self.gone.is_set():
            self.chunks.put_nowait(message["body"])


class _Body(httpx2.AsyncByteStream):
    def __init__(self, exchange: _Exchange) -> None:
        self.exchange = exchange

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while (chunk := await self.exchange.chunks.get()) is not None:
            yield chunk

    async def aclose(self) -> None:
        self.exchange.hang_up()
