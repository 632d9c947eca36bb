"""Gateway replicas in `asyncrl run` (`gateway.replicas` > 1): the driver's gateway is replica g0, and
g1 ... are Ray actors, each serving the same store and the same engines on a port of its own.

The driver spreads the rollouts it opens over the replicas (`SpreadLifecycle`): each opens every N-th,
so that replica renders, routes and records all of that rollout's calls (gateway/replicas.py). An
episode's OpenAI client calls its rollout's base_url: the driver's replica without a socket, the others
over HTTP. A replacement engine joining, or a dead one leaving, reaches every replica (`FanOutRouting`).
A replica actor that dies takes its rollouts in flight with it (they end as the episodes' timeouts or
errors, each in one account); the others serve on, and the driver opens no more rollouts there.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from asyncrl.configs.gateway import is_loopback
from asyncrl.configs.schema import RunConfig
from asyncrl.lifecycle import RolloutLifecycle

from .lifecycle import InProcessLifecycle
from .pool import Routing
from .spread import SpreadLifecycle

START_TIMEOUT_S = 120.0
"""Longest a replica actor may take to start serving (it loads the tokenizer and the app)."""


def replica_name(index: int) -> str:
    return f"g{index}"


@dataclass
class Gateways:
    """A run's gateways as the loop sees them."""

    own: InProcessLifecycle
    """The driver's gateway (its service, URL and app: the episodes' in-process transport)."""
    episodes: RolloutLifecycle
    """What episodes open and end rollouts with: the driver's gateway, or every replica in turn."""
    routing: Routing
    """Where engines join and leave: the driver's pool, and every replica's."""
    replicas: GatewayReplicas | None = None

    def summary(self) -> dict | None:
        """Rollouts opened per replica, and the replicas lost (None: one gateway)."""
        if not isinstance(self.episodes, SpreadLifecycle):
            return None
        return {"opened": dict(self.episodes.opened), "lost": sorted(self.episodes.lost)}

    def watch(self, on_lost: Callable[[str, str], None]) -> None:
        """Call `on_lost(replica id, why)` once for each replica taken out of the rotation."""
        if isinstance(self.episodes, SpreadLifecycle):
            self.episodes.on_lost = on_lost


async def start_gateways(
    stack: contextlib.AsyncExitStack, config: RunConfig, store: Any, engines: list, tokenizer: Any, *, store_at: tuple[str, str]
) -> Gateways:
    """The driver's gateway over `engines`, and with `gateway.replicas` > 1 the replica actors beside it,
    which open the same store (`store_at`: its address and namespace); `stack` stops them all."""
    from .serving import InProcessGateway

    if config.gateway.replicas == 1:
        served = InProcessGateway(config, store, engines, tokenizer)
        own = await stack.enter_async_context(served)
        return Gateways(own, own, served.service.pool)
    secret = secrets.token_bytes(32)
    served = InProcessGateway(config, store, engines, tokenizer, replica_id=replica_name(0), secret=secret)
    own = await stack.enter_async_context(served)
    replicas = GatewayReplicas(config, store_at, tokenizer, engines, secret)
    stack.push_async_callback(replicas.stop)
    urls = await replicas.start()
    assert served.service.replicas is not None
    spread = SpreadLifecycle(own, served.service.replicas, urls, served.service.credentials.run_token, config.loop.max_inflight)
    stack.push_async_callback(spread.aclose)
    replicas.watch(spread.lose)
    return Gateways(own, spread, FanOutRouting(served.service.pool, replicas.actors), replicas)


class GatewayReplica:
    """A Ray actor serving one more gateway over the run's store and engines (`start` returns its URL)."""

    def __init__(
        self, config: RunConfig, store_at: tuple[str, str], tokenizer: Any, engines: list[tuple[Any, str]], secret: bytes, replica_id: str
    ) -> None:
        from .engines import RayEngine
        from .pool import EnginePool
        from .replicas import ReplicaSet
        from .service import GatewayService
        from .store import open_store

        self.config = config
        address, namespace = store_at
        self.store = store = open_store(address, namespace=namespace, visibility_timeout_s=config.store.visibility_timeout_s)
        pool = EnginePool(config.gateway)
        for actor, engine_id in engines:
            pool.add_local(RayEngine(actor, engine_id))
        replicas = ReplicaSet(store, replica_id, config.gateway.replica_ttl_s, exclusive=False)  # the run's own id
        self.service = GatewayService(
            store, tokenizer, pool, config.gateway, config.rollout.sampling, model_name=config.name, secret=secret, replicas=replicas
        )
        self._stack = contextlib.AsyncExitStack()
        self._serving: asyncio.Task | None = None

    async def start(self) -> str:
        import ray

        from .app import create_app, gateway_server
        from .replicas import advertised_url, announced

        host = self.config.gateway.host
        if not self.config.cluster.is_local and is_loopback(host):
            host = ray.util.get_node_ip_address()  # the driver and the agents are on other nodes
        server = gateway_server(create_app(self.service), self.config.gateway, host=host, port=0)
        self._serving = asyncio.create_task(server.serve())
        self._server = server
        while not server.started:
            if self._serving.done():
                self._serving.result()
                raise RuntimeError("the gateway replica stopped during start-up")
            await asyncio.sleep(0.02)
        bound, port = server.servers[0].sockets[0].getsockname()[:2]
        url = advertised_url(None, bound, port)
        await self._stack.enter_async_context(announced(self.service.replicas, url, self.service.io))
        return url

    def add_local(self, actor: Any, engine_id: str) -> None:
        from .engines import RayEngine

        self.service.pool.add_local(RayEngine(actor, engine_id))

    def remove_local(self, engine_id: str, reason: str) -> None:
        self.service.pool.remove_local(engine_id, reason)

    def health(self) -> dict:
        return self.service.health()

    async def watch(self) -> None:
        """Never returns: a caller awaiting it hears that this actor died as soon as Ray knows (its node was
        lost, say, where connections to it would only time out)."""
        await asyncio.Event().wait()

    def usage(self) -> dict:
        """This replica's process CPU time so far and its Ray node (`asyncrl/jobs/usage.py`)."""
        import ray

        return {"process_cpu_s": time.process_time(), "node_id": ray.get_runtime_context().get_node_id()}

    async def stop(self) -> None:
        await self._stack.aclose()
        if self._serving is not None:
            self._server.should_exit = True
            await asyncio.gather(self._serving, return_exceptions=True)
        self.service.close()
        self.store.close()


class GatewayReplicas:
    """The replica actors beside the driver's gateway: started, told of engine changes, stopped."""

    def __init__(self, config: RunConfig, store_at: tuple[str, str], tokenizer: Any, engines: list, secret: bytes) -> None:
        import ray

        actor_class = ray.remote(GatewayReplica)
        handles = [(engine.actor, engine.engine_id) for engine in engines]
        # num_cpus=0: a replica is I/O and the tokenizer, and must not take a CPU an engine or the learner
        # was sized for; SPREAD puts replicas on different nodes where there are several.
        options: dict[str, Any] = dict(num_cpus=0, scheduling_strategy="SPREAD", max_concurrency=1000)
        if config.cluster.gateway_labels:
            options["label_selector"] = dict(config.cluster.gateway_labels)
        self.ids = [replica_name(i) for i in range(1, config.gateway.replicas)]
        self.actors: list[Any] = [
            actor_class.options(name=f"{config.name}-gateway-{rid}", **options).remote(config, store_at, tokenizer, handles, secret, rid)
            for rid in self.ids
        ]  # named, so `ray list actors` and the dashboard show which run's replica each is
        self.urls: dict[str, str] = {}
        self._watching: list[asyncio.Future] = []

    async def start(self) -> dict[str, str]:
        """Replica id -> URL, once every replica serves."""
        urls = await asyncio.wait_for(asyncio.gather(*(actor.start.remote() for actor in self.actors)), START_TIMEOUT_S)
        self.urls = dict(zip(self.ids, urls, strict=True))
        return self.urls

    def watch(self, on_death: Callable[[str, BaseException], None]) -> None:
        """Call `on_death(replica id, error)` when Ray finds a replica's actor dead (until `stop`)."""

        async def supervise(replica_id: str, actor: Any) -> None:
            try:
                await actor.watch.remote()
            except Exception as error:  # RayActorError: the actor, or its node, is gone
                on_death(replica_id, error)

        self._watching = [asyncio.ensure_future(supervise(rid, actor)) for rid, actor in zip(self.ids, self.actors, strict=True)]

    async def usage(self) -> dict[str, dict]:
        """Replica id -> `GatewayReplica.usage` of each replica that answers."""
        answers = await asyncio.gather(*(actor.usage.remote() for actor in self.actors), return_exceptions=True)
        return {rid: answer for rid, answer in zip(self.ids, answers, strict=True) if isinstance(answer, dict)}

    async def stop(self) -> None:
        import ray

        for watching in self._watching:
            watching.cancel()
        stops = [actor.stop.remote() for actor in self.actors]
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.gather(*stops, return_exceptions=True), 30)
        for actor in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(actor)


class FanOutRouting:
    """`Routing` for the driver's gateway and every replica actor: an engine joins or leaves all of them."""

    def __init__(self, own: Routing, actors: list) -> None:
        self.own, self.actors = own, actors

    def add_local(self, handle: Any) -> None:
        self.own.add_local(handle)
        for actor in self.actors:
            actor.add_local.remote(handle.actor, handle.engine_id)  # in order per actor; a dead replica just misses it

    def remove_local(self, engine_id: str, reason: str) -> None:
        self.own.remove_local(engine_id, reason)
        for actor in self.actors:
            actor.remove_local.remote(engine_id, reason)
