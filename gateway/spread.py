"""Opening a run's rollouts over its gateway replicas, and ending each at its home (`SpreadLifecycle`).

The driver spreads the rollouts it opens over the replicas (`gateway.replicas` > 1, `gateway/replica_actors.py`):
each opens every N-th, so that replica renders, routes and records all of that rollout's calls
(gateway/replicas.py). A replica that refuses connections is taken out of the rotation and its rollouts
end through the driver's own replica, which acts on the store alone.
"""

from __future__ import annotations

import errno
import itertools
import logging
from collections.abc import Callable
from typing import Any

import httpx2

from asyncrl.lifecycle import LifecycleRefused, Rollout, RolloutLifecycle

from .client import AsyncGatewayClient
from .replicas import ReplicaSet, home_of

log = logging.getLogger(__name__)

LIFECYCLE_TIMEOUT_S = 60.0
"""Longest a lifecycle call to another replica may take before it is tried elsewhere."""


class SpreadLifecycle:
    """A `RolloutLifecycle` that opens rollouts on the replicas in turn and ends each at its home.

    A replica that refuses connections (its actor died) is skipped for openings from then on, and its
    rollouts are finished or aborted through the driver's own replica, which acts on the store alone. One
    that is only slow (a timeout) opens this rollout elsewhere and keeps its turn. `connections`: the most
    lifecycle calls in flight to one replica (an episode holds at most one), so none waits for a connection."""

    def __init__(
        self, own: RolloutLifecycle, own_replicas: ReplicaSet, others: dict[str, str], token: str | None, connections: int
    ) -> None:
        """`own`, `own_replicas`: the driver's gateway's lifecycle and replica set; `others`: replica id -> URL."""
        import openai

        self.own, self.own_replicas = own, own_replicas
        self.lifecycles: dict[str, Any] = {own_replicas.id: own}
        # aiohttp's pool, as the episodes' OpenAI clients use: httpx's own polled every pooled socket per request.
        limits = httpx2.Limits(max_connections=connections, max_keepalive_connections=connections, keepalive_expiry=2.0)
        self._http = openai.DefaultAioHttpClient(timeout=LIFECYCLE_TIMEOUT_S, limits=limits)
        for replica_id, url in others.items():
            self.lifecycles[replica_id] = AsyncGatewayClient(url, token=token, timeout=LIFECYCLE_TIMEOUT_S, client=self._http)
        self._turn = itertools.count()
        self.lost: set[str] = set()
        self.opened = dict.fromkeys(self.lifecycles, 0)
        """Rollouts opened on each replica."""
        self.on_lost: Callable[[str, str], None] | None = None
        """Told of each replica taken out of the rotation (`Gateways.watch`)."""

    async def open_rollout(
        self, task: str = "", group_id: str = "", metadata: dict | None = None, *, evaluation: bool = False, sampled: bool = False
    ) -> Rollout:
        order = list(self.lifecycles)
        start = next(self._turn) % len(order)
        for replica in order[start:] + order[:start]:  # each replica once, from this opening's turn on
            if replica in self.lost:
                continue
            try:
                rollout = await self.lifecycles[replica].open_rollout(task, group_id, metadata, evaluation=evaluation, sampled=sampled)
            except (httpx2.TransportError, LifecycleRefused) as error:
                if isinstance(error, LifecycleRefused) and error.status < 500:
                    raise
                if _refused(error):
                    log.warning("gateway replica %s refused a connection (%s); opening elsewhere from now on", replica, _described(error))
                    self.lose(replica, error)
                else:
                    log.info("gateway replica %s did not open a rollout (%s); opening it on the next one", replica, _described(error))
                continue
            self.opened[replica] += 1
            return rollout
        raise LifecycleRefused(503, "no gateway replica could open a rollout")

    async def _at_home(self, rollout_id: str, verb: str, *args: Any) -> Any:
        home = home_of(rollout_id) or ""
        own = self.own
        lifecycle = self.lifecycles.get(home, own) if home not in self.lost else own
        try:
            return await getattr(lifecycle, verb)(rollout_id, *args)
        except httpx2.TransportError as error:
            if _refused(error):
                self.lose(home, error)
            log.warning("gateway replica %s did not answer (%s); ending rollout %s here", home, _described(error), rollout_id)
            return await getattr(own, verb)(rollout_id, *args)

    def lose(self, replica: str, error: BaseException) -> None:
        """`replica` is gone (it refused a connection, or Ray found its actor dead): open nothing more there,
        and let the driver's gateway serve its rollouts."""
        if replica in self.lost:
            return
        self.lost.add(replica)
        if self.on_lost is not None:
            self.on_lost(replica, _described(error))
        self.own_replicas.lost(replica)  # else the driver's gateway would forward to the dead one until its announcement lapses

    async def finish(self, rollout_id: str, reward: float, status: str = "ok", metrics: dict | None = None, reason: str = "") -> Any:
        return await self._at_home(rollout_id, "finish", reward, status, metrics, reason)

    async def abort(self, rollout_id: str, reason: str = "") -> Any:
        return await self._at_home(rollout_id, "abort", reason)

    async def aclose(self) -> None:
        await self._http.aclose()


def _refused(error: BaseException) -> bool:
    """Whether a call failed because nothing listens at the replica's address (it died): the aiohttp
    transport reports a refused connection as a ConnectTimeout, so the cause chain is read, not the class."""
    cause: BaseException | None = error
    while cause is not None:
        os_error = getattr(cause, "os_error", cause)  # aiohttp's ClientConnectorError wraps the OSError
        if isinstance(cause, httpx2.ConnectError) or (isinstance(os_error, OSError) and os_error.errno == errno.ECONNREFUSED):
            return True
        cause = cause.__cause__
    return False


def _described(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
