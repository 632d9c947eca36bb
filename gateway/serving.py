"""The driver's side of the TITO gateway: the gateway served on the driver's own event loop, and the
HTTP client every episode's OpenAI client shares.

`asyncrl run` (over its Ray rollout workers) and `asyncrl bench agentic` (over stub engines) both
serve the gateway this way, so the bench measures the same serving path as a run. `evaluation_gateway`
serves it the same way for held-out evaluation alone (the SFT warm start, the pipeline's matrix).
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from collections.abc import AsyncIterator

from asyncrl.configs.schema import RunConfig

from .lifecycle import InProcessLifecycle
from .replicas import advertised_url, announced


class InProcessGateway:
    """`async with InProcessGateway(...) as lifecycle`: uvicorn on this event loop, over `engines`
    (engine handles, `gateway/engines.py`); yields the lifecycle client that skips HTTP."""

    def __init__(
        self, config: RunConfig, store, engines: list, tokenizer, *, model_name: str | None = None,
        replica_id: str | None = None, secret: bytes | None = None,
    ) -> None:  # fmt: skip
        """`replica_id`: this gateway is one of several over `store` (gateway/replicas.py), all sharing `secret`."""
        from asyncrl.gateway.pool import EnginePool
        from asyncrl.gateway.service import GatewayService

        from .replicas import ReplicaSet

        pool = EnginePool(config.gateway)
        for engine in engines:
            pool.add_local(engine)
        name = model_name or config.name
        # The caller owns these replica ids (a run's): a process of its that died may not have withdrawn them.
        replicas = ReplicaSet(store, replica_id, config.gateway.replica_ttl_s, exclusive=False) if replica_id else None
        self.service = GatewayService(
            store, tokenizer, pool, config.gateway, config.rollout.sampling, model_name=name, secret=secret, replicas=replicas
        )
        self.config = config
        self._announced = contextlib.AsyncExitStack()

    async def __aenter__(self) -> InProcessLifecycle:
        from asyncrl.gateway.app import create_app, gateway_server

        self.server = gateway_server(create_app(self.service), self.config.gateway)
        self.task = asyncio.create_task(self.server.serve())
        while not self.server.started:
            if self.task.done():
                self.task.result()  # raises why it did not start
                raise RuntimeError("the gateway stopped during start-up")
            await asyncio.sleep(0.02)
        host, port = self.server.servers[0].sockets[0].getsockname()[:2]
        url = advertised_url(self.config.gateway.advertise_url, host, port)
        await self._announced.enter_async_context(announced(self.service.replicas, url, self.service.io))
        return InProcessLifecycle(self.service, url, app=self.server.config.app)

    async def __aexit__(self, *exc) -> None:
        await self._announced.aclose()  # the other replicas serve this one's rollouts from now on
        self.server.should_exit = True
        await asyncio.gather(self.task, return_exceptions=True)
        self.service.close()


EVALUATION_HEARTBEAT_TIMEOUT_S = 300.0
"""Seconds an evaluation gateway's engine may leave health checks unanswered before it is dropped."""


@contextlib.asynccontextmanager
async def evaluation_gateway(config: RunConfig, engines: list, tokenizer) -> AsyncIterator[InProcessLifecycle]:
    """An `InProcessGateway` on a free port for evaluation rollouts, which write no store: its store is
    a scratch one, deleted afterwards."""
    from asyncrl.gateway.store import open_store

    # Its one engine is busy by design (the whole held-out set at once) and may answer health checks late on
    # a machine shared with training: dropping it would fail every episode left, where an engine that dies
    # fails its calls by itself.
    timeout_s = max(config.gateway.heartbeat_timeout_s, EVALUATION_HEARTBEAT_TIMEOUT_S)
    served = config.model_copy(update={"gateway": config.gateway.model_copy(update={"port": 0, "heartbeat_timeout_s": timeout_s})})
    with tempfile.TemporaryDirectory(prefix="asyncrl-eval-") as directory:
        store = open_store(directory)
        try:
            async with InProcessGateway(served, store, engines, tokenizer) as lifecycle:
                yield lifecycle
        finally:
            store.close()


def episode_http_client(config: RunConfig, gateway: InProcessLifecycle | None = None):
    """One HTTP client for every episode's OpenAI client: into `gateway`'s app in this process, or over loopback.

    `loop.episode_transport: inprocess` (with the gateway at hand): requests go to the app through
    `InProcessTransport` (gateway/inprocess_transport.py), the same routes and recording code
    without sockets; with gateway replicas, only the calls to this process's replica, and the other
    replicas' rollouts (whose base_url is theirs) over aiohttp. `http`, or no gateway given: aiohttp's
    connection pool to the gateway's port.
    httpx's own pool checks every pooled socket (a select() call each) on every request, which capped
    it at ~16 connections and so throttled the engine's batches to 16; aiohttp keeps a free list (~1/3
    less driver CPU per episode, measured). One connection per episode in flight, so none queue here.
    Idle connections expire before uvicorn's 5 s keep-alive does: reusing one the server is closing at
    that moment fails the request (seen once in 37k episodes with equal expiries).
    """
    import httpx2
    import openai

    connections = config.loop.max_inflight
    limits = httpx2.Limits(max_connections=connections, max_keepalive_connections=connections, keepalive_expiry=2.0)
    if gateway is not None and gateway.app is not None and config.loop.episode_transport == "inprocess":
        from .inprocess_transport import InProcessHttpClient, InProcessTransport

        if config.gateway.replicas == 1:
            return InProcessHttpClient(gateway.app)
        # Rollouts opened on this process's replica without a socket, the other replicas' over HTTP.
        return openai.DefaultAioHttpClient(timeout=None, limits=limits, mounts={gateway.url: InProcessTransport(gateway.app)})
    return openai.DefaultAioHttpClient(timeout=None, limits=limits)
