"""Engines as the gateway sees them: one small handle interface over three ways to reach an engine.

- `LocalEngine`: an engine object in the gateway's own process (`EmbeddedEngine`, or anything with
  its `generate` / `health` verbs, and `score` to score).
- `RayEngine`: a `RolloutWorker` actor (`rollout/worker.py`), by handle or by name.
- `HttpEngine`: an engine in another process that serves `engine_app(engine)` (four routes:
  `POST /generate`, `POST /generate_stream`, `POST /score`, `GET /health`). Remote engines announce themselves to the gateway with
  `POST /engines/register` and keep themselves alive with `POST /engines/{id}/heartbeat`, both with the
  gateway's engine token and the lease the registration returned (`Announcement` does this).

Handles keep the engine's own error split: `RequestError` is the request's fault (the client gets a
400), `EngineFailure` is the engine's (the gateway may retry the same prompt tokens elsewhere).
`ScoringUnsupported` is an engine that has no `score` (vLLM): another engine may have one.

`stream` is `generate` as it comes: TokenDeltas, then the GenerationResult; closing the iterator early
aborts the request on the engine (in process, by cancelling the Ray task, or by closing the HTTP
response). It is optional: for a handle or engine without one, `streamed` and `LocalEngine` send the
whole completion as one delta.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, Protocol, runtime_checkable

import httpx

from asyncrl.records import GenerationResult, RequestError, SamplingParams, ScoreResult, TokenDelta

Streamed = AsyncGenerator[TokenDelta | GenerationResult, None]
"""What `stream` yields: TokenDeltas, then the GenerationResult."""


class EngineFailure(RuntimeError):
    """The engine could not answer this request (died, unreachable, failed its batch); another may."""


class ScoringUnsupported(EngineFailure):
    """The engine cannot score token sequences (the vLLM engine); another engine may."""


@runtime_checkable
class EngineHandle(Protocol):
    """What the pool calls. A handle may also have `stream(prompt_token_ids, sampling, session_id) -> Streamed`
    (the three here do); `streamed` calls it, or falls back to `generate` for a handle without one."""

    engine_id: str

    async def generate(self, prompt_token_ids: list[int], sampling: SamplingParams, session_id: str) -> GenerationResult: ...

    async def score(self, sequences: list[list[int]], temperature: float) -> ScoreResult: ...

    async def health(self) -> dict: ...


class LocalEngine:
    """An in-process engine; the gateway's heartbeat loop asks it for its health."""

    def __init__(self, engine: Any, engine_id: str | None = None) -> None:
        self.engine = engine
        self.engine_id = engine_id or engine.engine_id

    async def generate(self, prompt_token_ids, sampling, session_id):
        return await self.engine.generate(prompt_token_ids, sampling, session_id=session_id)

    def stream(self, prompt_token_ids, sampling, session_id) -> Streamed:
        stream = getattr(self.engine, "stream", None)
        if stream is None:
            return _whole(lambda: self.generate(prompt_token_ids, sampling, session_id))
        return stream(prompt_token_ids, sampling, session_id=session_id)

    async def score(self, sequences, temperature) -> ScoreResult:
        score = getattr(self.engine, "score", None)
        if score is None:
            raise ScoringUnsupported(f"engine {self.engine_id} ({type(self.engine).__name__}) has no score verb")
        try:
            return await score(sequences, temperature)
        except NotImplementedError as error:
            raise ScoringUnsupported(str(error)) from None

    async def health(self) -> dict:
        return self.engine.health()


class RayEngine:
    """A `RolloutWorker` actor. Ray re-raises a task's RequestError as an instance of RequestError,
    so refusals still reach the client as 400s; any other Ray error means the actor is gone.

    `generate` calls of one event-loop turn go out in one `submit` call, and their results come back
    in `collect` calls, each bringing whatever finished since the last: a Ray call per request cost
    the driver ~0.1 ms of CPU each, a tenth of its time with hundreds of rollouts in flight. Streams
    and scoring are a call each."""

    def __init__(self, actor: Any, engine_id: str) -> None:
        self.actor, self.engine_id = actor, engine_id
        self.caller = uuid.uuid4().hex  # this handle's outbox on the worker (a new one on each event loop)
        self._keys = itertools.count()
        self._waiting: dict[int, asyncio.Future] = {}
        self._outgoing: list[tuple[int, list[int], dict, str]] = []
        self._collector: asyncio.Task | None = None
        self._submitting: set[asyncio.Task] = set()
        self._loop: asyncio.AbstractEventLoop | None = None

    async def generate(self, prompt_token_ids, sampling, session_id):
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            # A handle used from a new event loop (one at a time) starts afresh there, with an outbox of
            # its own, so a collect left pending from the old loop takes none of the new loop's results.
            self._loop, self._waiting, self._outgoing, self._collector = loop, {}, [], None
            self.caller = uuid.uuid4().hex
        key, future = next(self._keys), loop.create_future()
        self._waiting[key] = future
        if not self._outgoing:
            loop.call_soon(self._submit)
        self._outgoing.append((key, prompt_token_ids, dataclasses.asdict(sampling), session_id))
        if self._collector is None or self._collector.done():
            self._collector = loop.create_task(self._collect())
        try:
            return await future
        finally:
            self._waiting.pop(key, None)  # a caller that left drops its result when it comes

    def _submit(self) -> None:
        batch, self._outgoing = self._outgoing, []
        try:
            with _ray_errors():
                submitted = self.actor.submit.remote(self.caller, batch)
        except EngineFailure as error:
            self._fail([key for key, *_ in batch], error)
            return
        assert self._loop is not None
        task = self._loop.create_task(self._submitted(submitted, [key for key, *_ in batch]))
        self._submitting.add(task)
        task.add_done_callback(self._submitting.discard)

    async def _submitted(self, submitted: Any, keys: list[int]) -> None:
        try:
            with _ray_errors():
                await submitted
        except EngineFailure as error:
            self._fail(keys, error)

    async def _collect(self) -> None:
        while self._waiting:
            try:
                with _ray_errors():
                    outcomes = await self.actor.collect.remote(self.caller)
            except EngineFailure as error:
                self._fail(list(self._waiting), error)
                return
            for key, result, refusal, failure in outcomes:
                future = self._waiting.get(key)
                if future is None or future.done():
                    continue
                if result is not None:
                    future.set_result(result)
                elif refusal is not None:
                    future.set_exception(RequestError(refusal))
                else:
                    future.set_exception(EngineFailure(f"engine {self.engine_id}: {failure}"))

    def _fail(self, keys: list[int], error: BaseException) -> None:
        for key in keys:
            future = self._waiting.get(key)
            if future is not None and not future.done():
                future.set_exception(EngineFailure(str(error)))

    async def stream(self, prompt_token_ids, sampling, session_id) -> Streamed:
        import ray

        with _ray_errors():
            refs = self.actor.stream.options(num_returns="streaming").remote(prompt_token_ids, dataclasses.asdict(sampling), session_id)
        ended = False
        try:
            while not ended:
                with _ray_errors():
                    item = await (await refs.__anext__())
                ended = isinstance(item, GenerationResult)
                yield item
        except StopAsyncIteration:
            raise EngineFailure(f"engine {self.engine_id}'s stream ended without a result") from None
        finally:
            if not ended:  # the worker's generator leaves with CancelledError, which aborts the request
                ray.cancel(refs)

    async def score(self, sequences, temperature) -> ScoreResult:
        return await self._call("score", sequences, temperature)

    async def _call(self, method: str, *args):
        with _ray_errors():
            return await getattr(self.actor, method).remote(*args)

    async def health(self) -> dict:
        return await self.actor.health.remote()


@contextlib.contextmanager
def _ray_errors():
    """Ray's errors in the handle's split: RequestError, ScoringUnsupported, or EngineFailure (the actor is gone)."""
    import ray

    try:
        yield
    except RequestError as error:
        # Ray's re-raised instance prints the actor's traceback; the client gets the refusal only.
        raise RequestError(str(getattr(error, "cause", error))) from None
    except NotImplementedError as error:  # checked before RayError: Ray's instance is both
        raise ScoringUnsupported(str(getattr(error, "cause", error))) from None
    except ray.exceptions.RayError as error:
        raise EngineFailure(f"Ray actor failed: {type(error).__name__}: {error}") from None


class HttpEngine:
    """An engine behind `engine_app`, reached over HTTP."""

    def __init__(self, url: str, engine_id: str) -> None:
        self.url, self.engine_id = url.rstrip("/"), engine_id
        # No client-side timeout: the gateway's own deadline and heartbeat window bound every call.
        self._client = httpx.AsyncClient(base_url=self.url, timeout=None)

    async def generate(self, prompt_token_ids, sampling, session_id):
        body = {"prompt_token_ids": list(prompt_token_ids), "sampling": dataclasses.asdict(sampling), "session_id": session_id}
        return GenerationResult(**await self._post("/generate", body))

    async def stream(self, prompt_token_ids, sampling, session_id) -> Streamed:
        """Newline-delimited JSON from `POST /generate_stream`; closing this closes the response, which aborts the request."""
        body = {"prompt_token_ids": list(prompt_token_ids), "sampling": dataclasses.asdict(sampling), "session_id": session_id}
        try:
            async with self._client.stream("POST", "/generate_stream", json=body) as response:
                if response.status_code != 200:
                    await response.aread()
                    self._raise_for(response)
                async for line in response.aiter_lines():
                    if line:
                        item = _decoded(json.loads(line))
                        yield item
                        if isinstance(item, GenerationResult):
                            return
        except httpx.HTTPError as error:
            raise EngineFailure(f"{self.url} failed mid-stream: {type(error).__name__}: {error}") from None
        raise EngineFailure(f"{self.url} ended the stream without a result")

    async def score(self, sequences, temperature) -> ScoreResult:
        return ScoreResult(**await self._post("/score", {"sequences": sequences, "temperature": temperature}))

    async def _post(self, path: str, body: dict) -> dict:
        try:
            response = await self._client.post(path, json=body)
        except httpx.HTTPError as error:
            raise EngineFailure(f"{self.url} unreachable: {type(error).__name__}: {error}") from None
        if response.status_code != 200:
            self._raise_for(response)
        return response.json()

    def _raise_for(self, response: httpx.Response) -> None:
        if response.status_code == 400:
            raise RequestError(response.json().get("detail", response.text))
        if response.status_code == 501:
            raise ScoringUnsupported(response.json().get("detail", response.text))
        raise EngineFailure(f"{self.url} answered HTTP {response.status_code}: {response.text[:200]}")

    async def health(self) -> dict:
        response = await self._client.get("/health")
        response.raise_for_status()
        return response.json()

    async def aclose(self) -> None:
        await self._client.aclose()


def streamed(handle: Any, prompt_token_ids: list[int], sampling: SamplingParams, session_id: str) -> Streamed:
    """`handle.stream`, or for a handle without one (a test double), its `generate` as one delta."""
    stream = getattr(handle, "stream", None)
    if stream is None:
        return _whole(lambda: handle.generate(prompt_token_ids, sampling, session_id))
    return stream(prompt_token_ids, sampling, session_id)


async def _whole(generate: Callable[[], Awaitable[GenerationResult]]) -> Streamed:
    """A whole completion as a stream. A failed one sends no delta: nothing reached the caller, so the
    gateway may still retry it elsewhere."""
    result = await generate()
    if result.token_ids and result.finish_reason not in ("error", "abort"):
        kv_versions = None if result.kv_versions is None else list(result.kv_versions)
        yield TokenDelta(list(result.token_ids), list(result.logprobs), list(result.versions), kv_versions=kv_versions)
    yield result


def _encoded(item: TokenDelta | GenerationResult) -> bytes:
    """One line of `/generate_stream`."""
    kind = "result" if isinstance(item, GenerationResult) else "delta"
    return json.dumps({kind: dataclasses.asdict(item)}).encode() + b"\n"


def _decoded(chunk: dict) -> TokenDelta | GenerationResult:
    if "result" in chunk:
        return GenerationResult(**chunk["result"])
    return TokenDelta(**chunk["delta"])


def connect(address: str, engine_id: str) -> EngineHandle:
    """A handle from a registration address: `http(s)://host:port` (an `engine_app`) or
    `ray:[NAMESPACE/]ACTOR` (a named RolloutWorker in the Ray cluster this process is connected to)."""
    if address.startswith(("http://", "https://")):
        return HttpEngine(address, engine_id)
    if address.startswith("ray:"):
        import ray

        if not ray.is_initialized():
            raise ValueError("this gateway is not connected to a Ray cluster; it cannot reach ray: engines")
        namespace, _, name = address[4:].rpartition("/")
        try:
            return RayEngine(ray.get_actor(name, namespace=namespace or None), engine_id)
        except ValueError as error:
            raise ValueError(f"no Ray actor {address[4:]!r}: {error}") from None
    raise ValueError(f"engine address must start with http://, https:// or ray:, got {address!r}")


class AnnouncementRefused(RuntimeError):
    """The gateway refused a registration or heartbeat (wrong token, engine id held by another engine)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


class Announcement:
    """An engine's registration with a gateway, from the engine's side: `register`, then `heartbeat`
    at least every gateway.heartbeat_interval_s (`run` does both), `deregister` when it stops.

    `token` is the gateway's engine token. The lease the first registration returns proves this engine
    holds `engine_id`: it goes with every later call, and after the gateway dropped the engine (missed
    heartbeats) the next heartbeat registers again for a fresh one.

    Where the gateway has replicas (gateway/replicas.py), `run` also asks it for the others every
    REPLICAS_EVERY beats and announces the engine to each of them the same way (each gateway keeps its
    own registry and lease), so every replica can route its rollouts to this engine."""

    REPLICAS_EVERY = 10

    def __init__(
        self, gateway_url: str, engine_id: str, address: str, *, token: str | None,
        capacity: float = 1.0, health: Callable[[], dict] = dict, interval_s: float = 1.0,
    ) -> None:  # fmt: skip
        self.engine_id, self.address, self.capacity, self.health, self.interval_s = engine_id, address, capacity, health, interval_s
        self.url, self._token = gateway_url.rstrip("/"), token
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.AsyncClient(base_url=self.url, headers=headers, timeout=10.0)
        self.lease: str | None = None
        self.replicas: dict[str, Announcement] = {}
        """URL -> this engine's announcement to each other replica of the gateway."""

    async def register(self) -> None:
        body = {"engine_id": self.engine_id, "address": self.address, "capacity": self.capacity, "health": self.health()}
        self.lease = (await self._post("/engines/register", {**body, "lease": self.lease}))["lease"]

    async def heartbeat(self) -> None:
        if self.lease is not None:
            beat = await self._post(f"/engines/{self.engine_id}/heartbeat", {"lease": self.lease, "health": self.health()})
            if beat["registered"]:
                return
            self.lease = None  # the gateway dropped this engine: its old lease is void
        await self.register()

    async def deregister(self) -> None:
        for replica in self.replicas.values():
            with contextlib.suppress(httpx.HTTPError, AnnouncementRefused):  # gone already: it drops the engine itself
                await replica.deregister()
        if self.lease is not None:
            await self._post(f"/engines/{self.engine_id}/deregister", {"lease": self.lease})
            self.lease = None

    async def follow_replicas(self) -> None:
        """Ask the gateway for its replicas now: announce this engine to new ones, stop announcing to gone ones."""
        response = await self._http.get("/engines/replicas")
        if response.status_code != 200:
            return  # a gateway without that route: an older one
        urls = {url.rstrip("/") for url in response.json()["replicas"].values()} - {self.url}
        for url in set(self.replicas) - urls:
            await self.replicas.pop(url).aclose()
        for url in urls - set(self.replicas):
            self.replicas[url] = Announcement(
                url, self.engine_id, self.address, token=self._token, capacity=self.capacity, health=self.health, interval_s=self.interval_s
            )

    async def run(self) -> None:
        """Register and heartbeat until cancelled, at the gateway and at its replicas; a gateway that cannot
        be reached is tried again at the next beat."""
        for beat in itertools.count():
            with contextlib.suppress(httpx.HTTPError):  # the gateway restarted or is busy
                await self.heartbeat()
                if beat % self.REPLICAS_EVERY == 0:
                    await self.follow_replicas()
            for replica in list(self.replicas.values()):
                with contextlib.suppress(httpx.HTTPError):
                    await replica.heartbeat()
            await asyncio.sleep(self.interval_s)

    async def aclose(self) -> None:
        for replica in self.replicas.values():
            await replica.aclose()
        await self._http.aclose()

    async def _post(self, path: str, body: dict) -> dict:
        response = await self._http.post(path, json=body)
        if response.status_code != 200:
            try:
                message = response.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = response.text[:500]
            raise AnnouncementRefused(response.status_code, message)
        return response.json()


def engine_app(engine: Any):
    """A FastAPI app that serves one engine to gateways on other machines (see `HttpEngine`)."""
    from fastapi import Body, FastAPI, HTTPException
    from fastapi.responses import StreamingResponse

    class ClosingStream(StreamingResponse):
        """Closes its body however the response ends, so a client that left aborts the request now, not
        whenever the body's generator is collected."""

        async def __call__(self, scope, receive, send) -> None:
            try:
                await super().__call__(scope, receive, send)
            finally:
                await self.body_iterator.aclose()  # type: ignore[attr-defined]

    app = FastAPI(title="asyncrl engine")
    local = LocalEngine(engine, getattr(engine, "engine_id", "engine"))

    @app.post("/generate")
    async def generate(prompt_token_ids: list[int] = Body(...), sampling: dict = Body(...), session_id: str | None = Body(None)) -> dict:
        try:
            result = await engine.generate(prompt_token_ids, SamplingParams.from_dict(sampling), session_id=session_id)
        except RequestError as error:
            raise HTTPException(400, str(error)) from None
        return dataclasses.asdict(result)

    @app.post("/generate_stream")
    async def generate_stream(
        prompt_token_ids: list[int] = Body(...), sampling: dict = Body(...), session_id: str | None = Body(None)
    ) -> StreamingResponse:
        """`/generate` as newline-delimited JSON: `{"delta": TokenDelta}` lines, then `{"result": GenerationResult}`.
        A client that closes the response aborts the request."""
        try:
            items = local.stream(prompt_token_ids, SamplingParams.from_dict(sampling), session_id)
            first = await anext(items)  # bad input is a 400 before the response starts
        except RequestError as error:
            raise HTTPException(400, str(error)) from None

        async def lines() -> AsyncGenerator[bytes, None]:
            async with contextlib.aclosing(items):
                yield _encoded(first)
                async for item in items:
                    yield _encoded(item)

        return ClosingStream(lines(), media_type="application/x-ndjson")

    @app.post("/score")
    async def score(sequences: list[list[int]] = Body(...), temperature: float = Body(1.0)) -> dict:
        try:
            result = await engine.score(sequences, temperature)
        except RequestError as error:
            raise HTTPException(400, str(error)) from None
        except NotImplementedError as error:
            raise HTTPException(501, str(error)) from None
        return dataclasses.asdict(result)

    @app.get("/health")
    async def health() -> dict:
        return engine.health()

    return app
