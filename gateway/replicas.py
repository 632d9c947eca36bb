"""Gateway replicas: several gateways over one store and the same engines, each rollout served by one of them.

The replica that opens a rollout is its home: the rollout id ends in `~<replica id>`, and the open
answer's `base_url` is the home's, so an agent that uses it talks to the home directly. The home holds
the rollout's conversation in memory (the exact tokens of every turn, which keep later turns
token-exact and on one branch), so every call of a rollout is served there. A call that reaches another
replica (agents behind one address, a load balancer) is forwarded to the home as it came, a stream
relayed as it is sampled (`Forwarding`); so are the lifecycle calls on a rollout (finish, abort, info),
which then also wake the home's requests in flight. Engines are chosen by the home alone, so a
rollout's turns stay on one engine whichever replica the agent called.

Replicas find each other in the store (`ReplicaDirectory`): each announces its URL every third of
`gateway.replica_ttl_s`. A home whose announcement lapsed, or that refuses connections, is taken as
dead: its rollouts' calls are then served where they land, from what the store holds. Their next turn
starts a fresh branch (a fork, which sample assembly handles), so nothing recorded is lost or trained
twice; what the dead home had in flight ends with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Any

import httpx

from .store import ReplicaDirectory

log = logging.getLogger(__name__)

SEPARATOR = "~"
"""Between a rollout id's own part and its home replica's id."""
CONNECT_TIMEOUT_S = 2.0
"""A home that takes longer to accept a connection is taken as dead."""
REPLICA_ID = re.compile(r"[A-Za-z0-9_-]{1,32}")
FORWARDED = b"x-asyncrl-forwarded-by"
"""Set on a forwarded call: it is served where it arrives, never forwarded again."""
_HOP_BY_HOP = {b"host", b"connection", b"keep-alive", b"transfer-encoding", b"content-length", b"upgrade", b"te", b"trailer"}
_KEYED_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/tokens/generate")
"""Routes whose rollout is named by the key a call carries."""
_LIFECYCLE = re.compile(r"^/rollouts/([^/]+)(?:/(?:finish|abort))?/?$")
"""Routes whose rollout is named in the path."""


def home_of(rollout_id: str) -> str | None:
    """The replica a rollout id names as its home (None: opened by a gateway without replicas)."""
    _, separator, home = rollout_id.rpartition(SEPARATOR)
    return home if separator else None


def check_replica_id(replica_id: str) -> str:
    if not REPLICA_ID.fullmatch(replica_id):
        raise ValueError(f"gateway.replica_id {replica_id!r}: use 1-32 letters, digits, '_' or '-'")
    return replica_id


class ReplicaSet:
    """This gateway's place among its replicas: its id and URL, and where the others answer."""

    def __init__(
        self, directory: ReplicaDirectory, replica_id: str, ttl_s: float, *,
        exclusive: bool = True, clock: Callable[[], float] = time.monotonic,
    ) -> None:  # fmt: skip
        """`exclusive`: refuse to start while another live gateway announces `replica_id` (replicas a user starts);
        False: take the id over (a run's own replicas, whose earlier process may have died without withdrawing)."""
        self.directory, self.id, self.ttl_s, self._clock = directory, check_replica_id(replica_id), ttl_s, clock
        self.exclusive = exclusive
        self.url: str | None = None
        """Where this replica answers (set by `start`, once its server listens)."""
        self.peers: dict[str, str] = {}
        """Replica id -> URL of the live replicas, as of the last announcement (this one included)."""
        self._lost: dict[str, float] = {}
        """Replicas that refused a connection -> until when they count as dead."""
        self.forwarded = 0
        """Calls relayed to their home so far."""
        self._client: httpx.AsyncClient | None = None

    @property
    def client(self) -> httpx.AsyncClient:
        """The HTTP client calls are forwarded with (made on first use, on the serving event loop)."""
        if self._client is None:
            # No read timeout: the home holds each call to its own deadline (gateway.request_timeout_s).
            timeout = httpx.Timeout(None, connect=CONNECT_TIMEOUT_S)
            self._client = httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=None, keepalive_expiry=4.0))
        return self._client

    def rollout_id(self, own_part: str) -> str:
        """The id of a rollout this replica opens (it is the rollout's home)."""
        return f"{own_part}{SEPARATOR}{self.id}"

    @property
    def base_url(self) -> str | None:
        """The OpenAI base URL agents of this replica's rollouts call."""
        return f"{self.url}/v1" if self.url else None

    def home_url(self, rollout_id: str) -> str | None:
        """The URL to forward a call on `rollout_id` to; None: serve it here (it is ours, or its home is dead)."""
        home = home_of(rollout_id)
        if home is None or home == self.id or self._lost.get(home, 0.0) > self._clock():
            return None
        return self.peers.get(home)

    def health(self) -> dict:
        """This replica's part of the gateway's /health."""
        return {"replica": self.id, "replicas": sorted(self.peers), "forwarded": self.forwarded}

    def lost(self, replica_id: str) -> None:
        """`replica_id` refused a connection: serve its rollouts here for the next ttl."""
        self._lost[replica_id] = self._clock() + self.ttl_s

    def announce(self) -> None:
        """Announce this replica once and read who else is live (a blocking store call)."""
        assert self.url is not None, "start() the replica set first"
        self.directory.announce_replica(self.id, self.url, self.ttl_s)
        self.peers = self.directory.replicas()

    async def start(self, url: str, io: Callable[..., Awaitable[Any]]) -> None:
        """Announce `url` before the first rollout is opened here, so every replica can forward to it."""
        taken = await io(self.directory.replicas)
        if self.exclusive and taken.get(self.id, url) != url:
            raise ValueError(
                f"gateway.replica_id {self.id!r} is already announced by the live gateway at {taken[self.id]}; give each replica its "
                "own (a gateway that died without stopping holds its id until gateway.replica_ttl_s has passed)"
            )
        self.url = url.rstrip("/")
        await io(self.announce)

    async def run(self, io: Callable[..., Awaitable[Any]]) -> None:
        """Announce every third of the ttl until cancelled; a failed announcement is logged and retried."""
        while True:
            await asyncio.sleep(self.ttl_s / 3)
            try:
                await io(self.announce)
            except Exception as error:  # the store is down: the others take this replica as dead meanwhile
                log.warning("gateway replica %s could not announce itself: %s", self.id, error)

    async def withdraw(self, io: Callable[..., Awaitable[Any]]) -> None:
        try:
            await io(self.directory.withdraw_replica, self.id)
        except Exception as error:  # its announcement lapses after the ttl anyway
            log.warning("gateway replica %s could not withdraw itself: %s", self.id, error)
        if self._client is not None:
            await self._client.aclose()
            self._client = None


@contextlib.asynccontextmanager
async def announced(replicas: ReplicaSet | None, url: str, io: Callable[..., Awaitable[Any]]) -> AsyncIterator[None]:
    """While inside, `replicas` (if any) announces this gateway at `url`; then it withdraws."""
    if replicas is None:
        yield
        return
    await replicas.start(url, io)
    task = asyncio.create_task(replicas.run(io))
    try:
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await replicas.withdraw(io)


def advertised_url(advertise_url: str | None, host: str, port: int) -> str:
    """Where others reach a gateway bound to host:port: `gateway.advertise_url`, else http://host:port with
    this machine's address for a wildcard host."""
    if advertise_url:
        return advertise_url.rstrip("/")
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostbyname(socket.gethostname())
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


def target_rollout(scope: Scope) -> str | None:
    """The rollout a call is about: from its path (lifecycle calls) or its key (generation calls)."""
    path = scope.get("path", "")
    named = _LIFECYCLE.match(path)
    if named:
        return named.group(1)
    if not path.startswith(_KEYED_PATHS):
        return None
    headers = dict(scope["headers"])
    key = headers.get(b"x-api-key") or headers.get(b"authorization", b"").removeprefix(b"Bearer ").removeprefix(b"bearer ")
    text = key.decode("latin-1").strip()
    return text[3:].rpartition(".")[0] or None if text.startswith("rk-") else None


class Forwarding:
    """ASGI middleware: a call on a rollout whose home is another live replica is served by the home.

    The body is read here first (the body limit outside this middleware bounds it), so a home that
    refuses the connection costs nothing: the call is served here instead. A home that fails after
    taking the call answers 503 (`replica_unavailable`, which clients retry; the retry finds it dead).
    A caller that leaves a relayed stream closes the connection to the home, which then ends the turn
    as it would for a caller of its own."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], replicas: ReplicaSet) -> None:
        self.app, self.replicas = app, replicas

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or any(name == FORWARDED for name, _ in scope["headers"]):
            return await self.app(scope, receive, send)
        rollout_id = target_rollout(scope)
        url = self.replicas.home_url(rollout_id) if rollout_id else None
        if url is None:
            return await self.app(scope, receive, send)
        body = await _body(receive)
        try:
            upstream = await self._send_upstream(url, scope, body)
        except (httpx.ConnectError, httpx.ConnectTimeout) as error:
            home = home_of(rollout_id or "") or ""
            log.warning("gateway replica %s at %s refused a connection (%s); serving its rollouts here", home, url, error)
            self.replicas.lost(home)
            return await self.app(scope, _replaying(body, receive), send)
        except httpx.TransportError as error:
            from .app import error_response

            message = f"the rollout's home gateway at {url} failed: {type(error).__name__}: {error}"
            return await error_response(503, "replica_unavailable", message, scope["path"])(scope, receive, send)
        self.replicas.forwarded += 1
        await _relay(upstream, receive, send)

    async def _send_upstream(self, url: str, scope: Scope, body: bytes) -> httpx.Response:
        headers = [(name, value) for name, value in scope["headers"] if name not in _HOP_BY_HOP]
        headers.append((FORWARDED, self.replicas.id.encode()))
        target = url + scope.get("raw_path", scope["path"].encode()).decode("latin-1")
        if scope.get("query_string"):
            target += "?" + scope["query_string"].decode("latin-1")
        client = self.replicas.client
        return await client.send(client.build_request(scope["method"], target, headers=headers, content=body), stream=True)


async def _body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def _replaying(body: bytes, receive: Receive) -> Receive:
    """`receive` for the app after this middleware already read the body."""
    sent = False

    async def replay() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _relay(upstream: httpx.Response, receive: Receive, send: Send) -> None:
    """The home's answer to the caller, chunk by chunk as the home sends it, until either side is done."""
    headers = [(name, value) for name, value in upstream.headers.raw if name.lower() not in _HOP_BY_HOP - {b"content-length"}]

    async def pump() -> None:
        await send({"type": "http.response.start", "status": upstream.status_code, "headers": headers})
        try:
            async for chunk in upstream.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except httpx.TransportError as error:  # the home died mid-answer; the caller sees the answer end early
            log.warning("a forwarded answer broke off: %s", error)
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def caller_left() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    relay, gone = asyncio.ensure_future(pump()), asyncio.ensure_future(caller_left())
    try:
        await asyncio.wait({relay, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (relay, gone):
            task.cancel()
        await asyncio.gather(relay, gone, return_exceptions=True)
        await upstream.aclose()  # a caller that left closes the home's connection: it ends the turn there
    if relay.done() and not relay.cancelled() and relay.exception() is not None:
        raise relay.exception()  # type: ignore[misc]
