"""The gateway's engines: registered and heartbeated (`registry`), routed (`routing`), and called with
retries and deadlines, so that no request waits forever on an engine that died.

A request waits for the first of four things: its result; its engine leaving the registry (missed
heartbeats, or deregistered); the caller abandoning it (its rollout was finished or aborted); the
deadline. When the engine fails or leaves, the same prompt tokens go to another engine, up to
`engine_retries` times; with 0 retries the failure is reported at once. A streamed request (`stream`)
is retried the same way only until its first delta: after that the caller has passed tokens on, and
a failure is the caller's to report (EngineFailure). Scoring calls (prefill-only log-probs, no
rollout) go to the least loaded engine and fail over the same way.

Engines the gateway started itself (`add_local`) are heartbeated by its own loop, with the holder
secret of their registration; their ids are the gateway's, so no remote registration can take one,
even while it is expired. Remote engines (`register`) keep themselves alive: the gateway never
heartbeats them, so one that dies, or a registration nobody keeps up, expires.

Everything here runs on the gateway's event loop; the registry and router are not thread-safe.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator, Callable, Coroutine
from typing import Protocol

from asyncrl.configs.schema import GatewayConfig
from asyncrl.records import GenerationResult, RequestError, SamplingParams, ScoreResult, TokenDelta

from .engines import EngineFailure, EngineHandle, ScoringUnsupported, streamed
from .registry import EngineIdTaken, EngineRegistry, RegistryEvent
from .routing import NoEngineError, Router

log = logging.getLogger(__name__)


class EngineUnavailable(RuntimeError):
    """No engine could serve the request: none is registered, or every one failed it."""


class GenerationTimeout(TimeoutError):
    """The request's deadline passed before any engine answered."""


class Abandoned(RuntimeError):
    """The caller gave the request up while it ran (its rollout ended)."""


class Routing(Protocol):
    """Where the engines a run supervises join and leave: an `EnginePool`, or every gateway of the run at
    once (`FanOutRouting`, gateway/replica_actors.py). A worker group keeps it in step with its members."""

    def add_local(self, handle: EngineHandle) -> None:
        """Route new requests to this engine too (it already serves the current weights)."""
        ...

    def remove_local(self, engine_id: str, reason: str) -> None:
        """Route nothing more to this engine; requests waiting on it fail over to another."""
        ...


class EnginePool:
    def __init__(self, config: GatewayConfig, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.registry = EngineRegistry(config.heartbeat_timeout_s, clock=clock)
        self.router = Router(vnodes=config.route_vnodes, load_factor=config.route_load_factor)
        self.registry.subscribe(self.router.apply)
        self.registry.subscribe(self._on_event)
        self._polled: dict[str, tuple[EngineHandle, float]] = {}
        self._holders: dict[str, str] = {}
        """Holder secrets of the polled engines' registrations."""
        # Per engine: wake-up futures of the requests waiting on it, resolved when it leaves.
        self._waiting: dict[str, set[asyncio.Future]] = {}

    # --- membership ---------------------------------------------------------------------------

    def add_local(self, handle: EngineHandle, capacity: float = 1.0) -> None:
        """An engine the gateway heartbeats itself (in-process or a Ray actor it started)."""
        info = self.registry.register(handle.engine_id, handle, capacity, holder=self._holders.get(handle.engine_id))
        self._polled[handle.engine_id] = (handle, capacity)
        self._holders[handle.engine_id] = info.holder

    def remove_local(self, engine_id: str, reason: str = "removed") -> None:
        """Stop heartbeating an engine `add_local` added and take it out of routing (its id is free then)."""
        self._polled.pop(engine_id, None)
        self._holders.pop(engine_id, None)
        self.registry.deregister(engine_id, reason)

    def register(self, handle: EngineHandle, capacity: float = 1.0, health: dict | None = None, *, holder: str | None = None) -> str:
        """A remote engine that sends its own heartbeats; returns the holder secret of its registration
        (re-registering a live id takes it). Raises EngineIdTaken, RegistryFull, ValueError."""
        if handle.engine_id in self._polled:
            raise EngineIdTaken(f"engine id {handle.engine_id!r} belongs to an engine this gateway runs itself; pick another engine_id")
        return self.registry.register(handle.engine_id, handle, capacity, health, holder=holder).holder

    def heartbeat(self, engine_id: str, health: dict | None = None, *, holder: str | None) -> bool:
        """A remote engine's heartbeat, with its holder secret (EngineIdTaken otherwise)."""
        return self.registry.heartbeat(engine_id, health, holder=holder)

    def leave(self, engine_id: str, holder: str | None) -> bool:
        """A remote engine deregistering itself, with its holder secret."""
        return self.registry.leave(engine_id, holder)

    def _on_event(self, event: RegistryEvent) -> None:
        if event.kind == "deregistered":
            reason = f"engine {event.engine.id} left the gateway ({event.reason})"
            for wake in self._waiting.pop(event.engine.id, ()):
                if not wake.done():
                    wake.set_result(reason)
            log.warning(reason)

    async def run_heartbeats(self) -> None:
        """Ask the engines this gateway owns for their health, forever; silence lets them expire."""
        while True:
            await self.poll_once()
            await asyncio.sleep(self.config.heartbeat_interval_s)

    async def poll_once(self) -> None:
        polled = list(self._polled.items())
        reports = await asyncio.gather(
            *(asyncio.wait_for(handle.health(), self.config.heartbeat_interval_s) for _, (handle, _) in polled),
            return_exceptions=True,
        )
        for (engine_id, (handle, capacity)), health in zip(polled, reports, strict=True):
            if isinstance(health, BaseException) or not health.get("alive", True):
                continue  # no heartbeat: after heartbeat_timeout_s the registry drops the engine
            if self._polled.get(engine_id, (None,))[0] is not handle:
                continue  # removed (or replaced) while its health was asked
            try:
                if not self.registry.heartbeat(engine_id, health, holder=self._holders[engine_id]):
                    self._holders[engine_id] = self.registry.register(engine_id, handle, capacity, health).holder  # it came back
            except EngineIdTaken:
                # `register` keeps polled ids out of remote hands, so this is a bug elsewhere; the
                # gateway's heartbeats must never keep alive an entry that points somewhere else.
                log.error("engine id %s is held by a registration this gateway did not make; not heartbeating it", engine_id)
        self.registry.expire()

    def describe(self) -> list[dict]:
        return [{"engine_id": e.id, "capacity": e.capacity, "in_flight": e.in_flight, "health": e.health} for e in self.registry.alive()]

    # --- requests -----------------------------------------------------------------------------

    async def generate(
        self,
        key: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        *,
        route_key: str | None = None,
        deadline: float,
        abandon: set[asyncio.Future] | None = None,
    ) -> tuple[GenerationResult, int]:
        """(result, retries used). `key` is the engine's session (a rollout id: its turns share the engine's
        retained KV); `route_key` (default `key`) picks the engine on the ring (a rollout's GRPO group id:
        its members share the engine that holds their prompt). `deadline` is on the event loop's clock; a
        future put in `abandon` and resolved with a reason gives the request up. Raises RequestError,
        EngineUnavailable, GenerationTimeout, Abandoned."""

        async def call(handle: EngineHandle, engine_id: str) -> GenerationResult:
            return _completed(await handle.generate(prompt_token_ids, sampling, key), engine_id)

        home = route_key or key
        route = lambda failed: self.router.route(home, self.registry.loads(), exclude=failed)  # noqa: E731
        return await self._with_retries(route, call, "generating", deadline, abandon)

    async def stream(
        self,
        key: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        *,
        route_key: str | None = None,
        deadline: float,
        abandon: set[asyncio.Future] | None = None,
    ) -> AsyncGenerator[TokenDelta | GenerationResult, None]:
        """`generate`, as it comes: TokenDeltas, then the GenerationResult (`timings["retries"]` set). Routed,
        retried, timed out and abandoned as `generate` is, except that a failure after the first delta is not
        retried (the caller has passed those tokens on): it raises EngineFailure. Leaving early (`aclose`)
        aborts the request."""
        failed: list[str] = []
        errors: list[str] = []
        while True:
            try:
                engine_id = self.router.route(route_key or key, self.registry.loads(), exclude=failed)
            except NoEngineError as error:
                tried = f"; failed here: {'; '.join(errors)}" if errors else ""
                raise EngineUnavailable(f"no engine can take the request ({error}){tried}") from None
            sent = 0
            with self.registry.acquire(engine_id) as lease:
                attempt = self._attempt_stream(lease.info.handle, engine_id, key, prompt_token_ids, sampling, deadline, abandon)
                try:
                    async with contextlib.aclosing(attempt):
                        async for item in attempt:
                            if isinstance(item, GenerationResult):
                                item.timings = {**item.timings, "retries": float(len(failed))}
                            else:
                                sent += len(item.token_ids)
                            yield item
                    return
                except EngineFailure as error:
                    if sent:
                        raise EngineFailure(f"engine {engine_id} failed after streaming {sent} tokens: {error}") from None
                    failed.append(engine_id)
                    errors.append(f"{engine_id}: {error}")
            if len(failed) > self.config.engine_retries:
                raise EngineUnavailable(
                    f"engine failed while generating ({'; '.join(errors)}); "
                    f"gave up after {len(failed) - 1} retries (gateway.engine_retries={self.config.engine_retries})"
                )

    async def _attempt_stream(
        self, handle: EngineHandle, engine_id: str, key: str, prompt_token_ids: list[int], sampling: SamplingParams,
        deadline: float, abandon: set[asyncio.Future] | None,
    ) -> AsyncGenerator[TokenDelta | GenerationResult, None]:  # fmt: skip
        """One engine's stream until its result, the engine leaving, `abandon` or the deadline (as `_attempt`).
        A pump task reads the engine's stream into an inbox that the interruptions also post to, so waiting for
        the next item costs no task of its own; deltas that piled up while the caller was busy go as one."""
        loop = asyncio.get_running_loop()
        inbox = _Inbox()
        wake = loop.create_future()
        wake.add_done_callback(inbox.interrupt)
        timer = loop.call_at(deadline, inbox.post, _Interrupted(None))
        watchers = self._waiting.setdefault(engine_id, set())
        watchers.add(wake)
        if abandon is not None:
            abandon.add(wake)
        pump = asyncio.ensure_future(_pump(handle, prompt_token_ids, sampling, key, inbox))
        try:
            while True:
                item = await inbox.next()
                if isinstance(item, TokenDelta):
                    item.engine_id = engine_id
                    yield item
                elif isinstance(item, GenerationResult):
                    yield _completed(item, engine_id)
                    return
                elif isinstance(item, _Interrupted):
                    if item.reason is None:
                        raise GenerationTimeout(f"no answer within gateway.request_timeout_s={self.config.request_timeout_s}")
                    if item.reason.startswith("engine "):
                        raise EngineFailure(item.reason)
                    raise Abandoned(item.reason)
                elif isinstance(item, (RequestError, EngineFailure)):
                    raise item
                else:  # a handle that died in its own way: the engine, not the request, failed
                    raise EngineFailure(f"{type(item).__name__}: {item}")
        finally:
            timer.cancel()
            watchers.discard(wake)
            if abandon is not None:
                abandon.discard(wake)
            if not pump.done():
                pump.cancel()  # inside the engine's stream, which aborts the request
                await asyncio.wait([pump])

    def context_tokens(self) -> int | None:
        """The longest sequence (prompt + completion) every live engine takes, from their health
        reports' `max_model_len`; None when none reports one."""
        lengths = [e.health.get("max_model_len") for e in self.registry.alive()]
        known = [n for n in lengths if isinstance(n, int) and n > 0]
        return min(known) if known else None

    async def score(self, sequences: list[list[int]], temperature: float, *, deadline: float) -> tuple[ScoreResult, int]:
        """(scores, retries used) from the least loaded engine: scoring keeps no KV cache worth
        routing to. Raises RequestError, ScoringUnsupported (no engine can score), EngineUnavailable,
        GenerationTimeout."""

        async def call(handle: EngineHandle, engine_id: str) -> ScoreResult:
            result = await handle.score(sequences, temperature)
            return dataclasses.replace(result, engine_id=result.engine_id or engine_id)  # its own id, as generate reports

        route = lambda failed: self.router.least_loaded(self.registry.loads(), exclude=failed)  # noqa: E731
        return await self._with_retries(route, call, "scoring", deadline, None)

    async def _with_retries(self, route, call, doing: str, deadline: float, abandon) -> tuple:
        """`call(handle, engine_id)` on the engine `route(excluded ids)` picks, again on another engine
        after an EngineFailure, up to `engine_retries` times. An engine that cannot do this at all
        (ScoringUnsupported) is skipped without using a retry; when no other is left, that is the error."""
        failed: list[str] = []
        unable: list[str] = []
        errors: list[str] = []
        while True:
            try:
                engine_id = route(failed + unable)
            except NoEngineError as error:
                if unable and not failed:
                    raise ScoringUnsupported(f"no engine of this gateway can serve the request ({'; '.join(errors)})") from None
                tried = f"; failed here: {'; '.join(errors)}" if errors else ""
                raise EngineUnavailable(f"no engine can take the request ({error}){tried}") from None
            with self.registry.acquire(engine_id) as lease:
                try:
                    result = await self._attempt(call(lease.info.handle, engine_id), engine_id, deadline, abandon)
                    return result, len(failed)
                except ScoringUnsupported as error:
                    unable.append(engine_id)
                    errors.append(f"{engine_id}: {error}")
                    continue
                except EngineFailure as error:
                    failed.append(engine_id)
                    errors.append(f"{engine_id}: {error}")
            if len(failed) > self.config.engine_retries:
                raise EngineUnavailable(
                    f"engine failed while {doing} ({'; '.join(errors)}); "
                    f"gave up after {len(failed) - 1} retries (gateway.engine_retries={self.config.engine_retries})"
                )

    async def _attempt(self, call: Coroutine, engine_id: str, deadline: float, abandon):
        loop = asyncio.get_running_loop()
        task = asyncio.ensure_future(call)
        wake = loop.create_future()
        watchers = self._waiting.setdefault(engine_id, set())
        watchers.add(wake)
        if abandon is not None:
            abandon.add(wake)
        try:
            done, _ = await asyncio.wait((task, wake), timeout=max(0.0, deadline - loop.time()), return_when=asyncio.FIRST_COMPLETED)
        finally:
            watchers.discard(wake)
            if abandon is not None:
                abandon.discard(wake)
            if not task.done():
                task.cancel()  # an in-process engine aborts the request; a remote one stops waiting
        if task in done:
            return _checked(task)
        if wake in done:
            reason = wake.result()
            if reason.startswith("engine "):
                raise EngineFailure(reason)
            raise Abandoned(reason)
        raise GenerationTimeout(f"no answer within gateway.request_timeout_s={self.config.request_timeout_s}")


@dataclasses.dataclass
class _Interrupted:
    """Posted to a stream's inbox: the reason its wait future was resolved with, None for the deadline."""

    reason: str | None


class _Inbox:
    """What a stream's reader waits for: the engine's items, what the engine's stream raised, interruptions."""

    def __init__(self) -> None:
        self._items: collections.deque = collections.deque()
        self._arrived = asyncio.Event()

    def post(self, item: object) -> None:
        self._items.append(item)
        self._arrived.set()

    def interrupt(self, wake: asyncio.Future) -> None:
        """`wake` was resolved with a reason: the engine left, or the caller gave the request up."""
        if not wake.cancelled():
            self.post(_Interrupted(wake.result()))

    async def next(self) -> object:
        """The oldest item, waiting for one; deltas that piled up behind each other come out as one."""
        while not self._items:
            self._arrived.clear()
            await self._arrived.wait()
        item = self._items.popleft()
        if not (isinstance(item, TokenDelta) and self._items and isinstance(self._items[0], TokenDelta)):
            return item
        merged = TokenDelta([], [], [])
        merged.extend(item)
        while self._items and isinstance(self._items[0], TokenDelta):
            merged.extend(self._items.popleft())
        return merged


async def _pump(handle: EngineHandle, prompt_token_ids: list[int], sampling: SamplingParams, key: str, inbox: _Inbox) -> None:
    """An engine's stream into `inbox`, up to its result; what it raised goes there too."""
    try:
        items = streamed(handle, prompt_token_ids, sampling, key)
        async with contextlib.aclosing(items):
            async for item in items:
                inbox.post(item)
                if isinstance(item, GenerationResult):
                    return
        inbox.post(EngineFailure("the engine's stream ended without a result"))
    except Exception as error:  # the reader decides what it means
        inbox.post(error)


def _checked(task: asyncio.Future):
    try:
        return task.result()
    except (RequestError, EngineFailure):
        raise
    except Exception as error:  # a handle that died in its own way: the engine, not the request, failed
        raise EngineFailure(f"{type(error).__name__}: {error}") from None


def _completed(result: GenerationResult, engine_id: str) -> GenerationResult:
    if result.finish_reason in ("error", "abort"):
        raise EngineFailure(f"engine {engine_id} ended the request with {result.finish_reason}: {result.error or ''}")
    return result
