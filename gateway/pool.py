"""The gateway's engines: registered and heartbeated (`registry`), routed (`routing`), and called with
retries and deadlines, so that no request waits forever on an engine that died.

A request waits for the first of four things: its result; its engine leaving the registry (missed
heartbeats, or deregistered); the caller abandoning it (its rollout was finished or aborted); the
deadline. When the engine fails or leaves, the same prompt tokens go to another engine, up to
`engine_retries` times; with 0 retries the failure is reported at once. Scoring calls (prefill-only
log-probs, no rollout) go to the least loaded engine and fail over the same way.

Engines the gateway started itself (`add_local`) are heartbeated by its own loop, with the holder
secret of their registration; their ids are the gateway's, so no remote registration can take one,
even while it is expired. Remote engines (`register`) keep themselves alive: the gateway never
heartbeats them, so one that dies, or a registration nobody keeps up, expires.

Everything here runs on the gateway's event loop; the registry and router are not thread-safe.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine

from asyncrl.configs.schema import GatewayConfig
from asyncrl.records import GenerationResult, RequestError, SamplingParams, ScoreResult, TokenDelta

from .engines import EngineFailure, EngineHandle, ScoringUnsupported
from .registry import EngineIdTaken, EngineRegistry, RegistryEvent
from .routing import NoEngineError, Router

log = logging.getLogger(__name__)


class EngineUnavailable(RuntimeError):
    """No engine could serve the request: none is registered, or every one failed it."""


class GenerationTimeout(TimeoutError):
    """The request's deadline passed before any engine answered."""


class Abandoned(RuntimeError):
    """The caller gave the request up while it ran (its rollout ended)."""


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

    def remove_local(self, engine_id: str, reason: str = "removed") -> bool:
        """Stop heartbeating an engine `add_local` added and take it out of routing (its id is free then)."""
        self._polled.pop(engine_id, None)
        self._holders.pop(engine_id, None)
        return self.registry.deregister(engine_id, reason)

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
        deadline: float,
        abandon: set[asyncio.Future] | None = None,
    ) -> tuple[GenerationResult, int]:
        """(result, retries used). `key` routes (a rollout id: its turns share an engine's KV cache);
        `deadline` is on the event loop's clock; a future put in `abandon` and resolved with a reason
        gives the request up. Raises RequestError, EngineUnavailable, GenerationTimeout, Abandoned."""

        async def call(handle: EngineHandle, engine_id: str) -> GenerationResult:
            return _completed(await handle.generate(prompt_token_ids, sampling, key), engine_id)

        route = lambda failed: self.router.route(key, self.registry.loads(), exclude=failed)  # noqa: E731
        return await self._with_retries(route, call, "generating", deadline, abandon)

    async def stream(
        self,
        key: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        *,
        deadline: float,
        abandon: set[asyncio.Future] | None = None,
    ) -> AsyncIterator[TokenDelta | GenerationResult]:
        """`generate`, as it comes: TokenDeltas, then the GenerationResult. Leaving early (`aclose`) aborts the
        request. Raises as `generate` does."""
        result, retries = await self.generate(key, prompt_token_ids, sampling, deadline=deadline, abandon=abandon)
        yield TokenDelta(list(result.token_ids), list(result.logprobs), list(result.versions))
        result.timings = {**result.timings, "retries": float(retries)}
        yield result

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
