"""The engine front: what every rollout engine is around its core, written once.

An engine core (the embedded engine's batcher, or the wrapper around vLLM's `LLMEngine`) is
single-threaded: one thread runs it, one step at a time. `EngineFront` is everything around it, the
same for both engines, and the engine interface itself: an engine subclasses it and supplies the
core's verbs (`EngineCore`, the abstract methods), and callers use the front's.

- an inbox and a set of aborts that any thread may fill (`add_request`, `abort`), handed to the core
  at the start of a step, so the core never sees another thread;
- the weight-swap handshake (`update_weights`): a push is applied between two steps by whoever
  steps next (the core's `load_weights`), and its caller returns once the new weights serve, or
  with the core's refusal;
- jobs that run on the stepping thread between two steps (`call`: the embedded engine's scoring);
- while serving, a background stepping thread that runs while there is work and leaves after
  `IDLE_EXIT_S` without any (the next request starts a new one); not serving, the owner steps by hand;
- `generate`: a request as an awaitable, its result settled from the stepping thread onto the
  caller's event loop, which may have closed meanwhile;
- `stream`: a request as an async iterator of what each step sampled for it (`TokenDelta`), then its
  result. The stepping thread wakes the caller's loop once for whatever arrived while it was not
  looking, so a caller that falls behind gets several steps in one delta, not one wake-up per token;
- finished results handed to each request's callback; a failing callback costs nobody else theirs.

The core's verbs are called on the stepping thread only, or under the step lock by a caller when no
thread steps; `make_request` and `prepare_weights` run on the caller's thread, so bad input is refused
there, before anything is queued.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from asyncrl.records import GenerationResult, SamplingParams, TokenDelta

log = logging.getLogger(__name__)

IDLE_EXIT_S = 0.25
"""Seconds without work after which the background stepping thread exits (the next request restarts it)."""

T = TypeVar("T")


@dataclass(eq=False)
class _Push:
    """One `update_weights` call, from queued to settled."""

    weights: Any
    version: int
    replaced: list[_Push] = field(default_factory=list)  # earlier pushes it superseded: their callers wait for it
    done: bool = False
    error: Exception | None = None

    def settle(self, error: Exception | None) -> None:
        self.done, self.error = True, error
        for earlier in self.replaced:  # their weights never served; the refusal, if any, is this caller's
            earlier.done = True


class EngineCore(ABC):
    """What an engine supplies: its core's verbs, which `EngineFront` calls on the stepping thread (or under the
    step lock when no thread steps); `make_request` and `prepare_weights` on the caller's thread."""

    @abstractmethod
    def make_request(self, prompt_token_ids: list[int], sampling: SamplingParams | dict | None, session_id: str | None) -> Any:
        """A request of this core's (with an `id`), from a prompt and sampling options (a dict over the
        engine's defaults); bad input raises RequestError. `session_id` groups the turns of one rollout."""

    @abstractmethod
    def admit(self, requests: list) -> None:
        """Take requests from the inbox; they run from the next `advance`."""

    @abstractmethod
    def cancel(self, request_ids: set[str], error: str | None = None) -> list[GenerationResult]:
        """Finish these requests with reason "abort" (ids it does not hold are ignored); their results."""

    @abstractmethod
    def advance(self) -> list[GenerationResult]:
        """One engine iteration over the admitted requests; the results of those it finished."""

    @abstractmethod
    def busy(self) -> bool:
        """Whether admitted requests are unfinished."""

    @abstractmethod
    def sampled(self, request) -> tuple[list[int], list[float], list[int], list[int] | None]:
        """An unfinished request's tokens, log-probs, versions and KV versions (None: not recorded) so far (only
        appended to: `stream` reads what is new)."""

    @abstractmethod
    def load_weights(self, weights: Any, version: int) -> None:
        """Serve `weights` as `version` from now on; raising refuses them, and the old weights stay."""

    def prepare_weights(self, state_dict: dict) -> Any:
        """What `load_weights` takes, from a pushed state dict, on the caller's thread; raising refuses
        the push before anything is queued. As they are, unless the engine says otherwise."""
        return state_dict


class EngineFront(EngineCore):
    """Request intake, aborts, weight pushes, jobs and the stepping thread around an engine's core verbs."""

    def __init__(self, name: str) -> None:
        """`name`: the stepping thread's, and the one errors give the engine. Called last by an engine's
        constructor, once its core can take requests."""
        self.name = name
        # Everything below is shared between callers and the stepping thread, guarded by _cv.
        self._cv = threading.Condition()
        self._inbox: list = []
        self._aborts: set[str] = set()
        self._jobs: list[Callable[[], None]] = []
        self._push: _Push | None = None
        self._callbacks: dict[str, Callable[[GenerationResult], None] | None] = {}  # every unfinished request
        self._streams: dict[str, tuple[Any, _Sink]] = {}  # the streamed ones among them: request, sink
        self._thread: threading.Thread | None = None
        self._serving = False
        self._stopping = False
        self._closed = False
        self._step_lock = threading.Lock()  # one step at a time, whoever steps
        self.busy_s = 0.0
        """Wall time the stepping thread has spent in steps; its share of a period is the engine's busy fraction."""

    # --- requests ------------------------------------------------------------------------------

    def add_request(
        self,
        prompt_token_ids: list[int],
        sampling: SamplingParams | dict | None = None,
        *,
        session_id: str | None = None,
        on_finish: Callable[[GenerationResult], None] | None = None,
    ) -> str:
        """Validate and queue a request; `on_finish` gets its result. Returns its id. Bad input raises
        RequestError here, and only here."""
        return self._submit(self.make_request(prompt_token_ids, sampling, session_id), on_finish)

    def _submit(self, request, on_finish: Callable[[GenerationResult], None] | None = None) -> str:
        with self._cv:
            if self._closed:
                raise RuntimeError(f"{self.name} is shut down")
            self._callbacks[request.id] = on_finish
            self._inbox.append(request)
            self._wake_locked()
        return request.id

    def abort(self, request_id: str) -> None:
        """Finish a request early with reason "abort" (at the next step)."""
        with self._cv:
            self._aborts.add(request_id)
            self._wake_locked()

    async def generate(
        self, prompt_token_ids: list[int], sampling: SamplingParams | dict | None = None, *, session_id: str | None = None
    ) -> GenerationResult:
        """Sample a completion, serving meanwhile; `session_id` enables prefix reuse across a rollout's
        turns. Bad input raises RequestError; a cancelled caller aborts the request."""
        request = self.make_request(prompt_token_ids, sampling, session_id)
        loop = asyncio.get_running_loop()
        done: asyncio.Future[GenerationResult] = loop.create_future()
        self._submit(request, on_finish=lambda result: _settle_soon(loop, done, result))
        self.start()
        try:
            return await done
        except asyncio.CancelledError:
            self.abort(request.id)
            raise

    def stream(
        self, prompt_token_ids: list[int], sampling: SamplingParams | dict | None = None, *, session_id: str | None = None
    ) -> AsyncGenerator[TokenDelta | GenerationResult, None]:
        """`generate`, as it comes: the tokens each step sampled (several steps in one delta when the caller
        was busy; a speculative step may add several tokens), then the result, which holds every token
        again. Bad input raises RequestError here, before anything is iterated; leaving early (`aclose`,
        a cancelled caller) aborts the request."""
        return self._stream(self.make_request(prompt_token_ids, sampling, session_id))

    async def _stream(self, request) -> AsyncGenerator[TokenDelta | GenerationResult, None]:
        sink = _Sink(asyncio.get_running_loop())
        with self._cv:
            self._streams[request.id] = (request, sink)
        try:
            self._submit(request, on_finish=sink.finish)
        except BaseException:
            with self._cv:
                self._streams.pop(request.id, None)
            raise
        self.start()
        finished = False
        try:
            while not finished:
                item = await sink.next()
                finished = isinstance(item, GenerationResult)
                yield item
        finally:
            if not finished:
                self.abort(request.id)

    async def call(self, job: Callable[[], T]) -> T:
        """Run `job` on the stepping thread between two steps (so it never overlaps a step or a weight
        swap, and no second thread runs the core) and return what it returns or raise what it raises."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[T] = loop.create_future()

        def run() -> None:
            try:
                result = job()
            except Exception as error:  # a failure of this call only
                _settle_soon(loop, done, error=error)
            else:
                _settle_soon(loop, done, result)

        with self._cv:
            if self._closed:
                raise RuntimeError(f"{self.name} is shut down")
            self._jobs.append(run)
            self._wake_locked()
        self.start()
        return await done

    def has_unfinished(self) -> bool:
        with self._cv:
            return bool(self._inbox) or self.busy()

    @property
    def queued(self) -> int:
        """Requests submitted and not yet handed to the core."""
        return len(self._inbox)

    # --- weights -------------------------------------------------------------------------------

    def update_weights(self, state_dict: dict, version: int) -> None:
        """Swap in new weights between two steps; tokens sampled afterwards carry `version`. Returns once
        they serve, or raises the engine's refusal (`prepare_weights`, `load_weights`).

        From the stepping thread itself (an `on_finish` callback) it only queues them for the start
        of the next step. When no thread steps, the caller applies them. A push that a newer one
        replaces before it was applied returns when the newer one is.
        """
        weights = self.prepare_weights(state_dict)
        with self._cv:
            if self._closed:
                raise RuntimeError(f"{self.name} is shut down")
            push = _Push(weights, version)
            if self._push is not None:
                push.replaced = [self._push, *self._push.replaced]
            self._push = push
            self._cv.notify_all()
            if threading.current_thread() is self._thread:
                return
            while not push.done and self._thread is not None:
                self._cv.wait()
        if not push.done:  # nobody steps; a thread started meanwhile waits for the step lock
            with self._step_lock:
                self._apply_push()
        if push.error is not None:
            raise push.error

    def _apply_push(self) -> None:
        with self._cv:
            push, self._push = self._push, None
        if push is None:
            return
        try:
            self.load_weights(push.weights, push.version)
        except Exception as error:
            outcome: Exception | None = error
        else:
            outcome = None
        with self._cv:
            push.settle(outcome)
            self._cv.notify_all()

    # --- stepping ------------------------------------------------------------------------------

    def step(self) -> list[GenerationResult]:
        """One iteration: pending weights, jobs, the inbox and aborts, then the core's `advance`.
        The stepping thread calls it; an engine that is not serving may call it by hand."""
        with self._step_lock:
            self._apply_push()
            with self._cv:
                jobs, self._jobs = self._jobs, []
            for job in jobs:
                job()
            with self._cv:
                inbox, self._inbox = self._inbox, []
                aborts, self._aborts = self._aborts, set()
            if inbox:
                self.admit(inbox)
            finished = self.cancel(aborts) if aborts else []
            finished += self.advance()
            if self._streams:
                self._publish(finished)
        # Outside the step lock: a callback may push weights, which a caller without a stepping thread applies itself.
        self._deliver(finished)
        return finished

    def _publish(self, finished: list[GenerationResult]) -> None:
        """Hand each unfinished streamed request's new tokens to its sink (the finished ones' go with their result)."""
        done = {result.request_id for result in finished}
        with self._cv:
            streams = [(request, sink) for request_id, (request, sink) in self._streams.items() if request_id not in done]
        for request, sink in streams:
            sink.take(*self.sampled(request))

    def _deliver(self, results: list[GenerationResult]) -> None:
        for result in results:
            with self._cv:
                on_finish = self._callbacks.pop(result.request_id, None)
                self._streams.pop(result.request_id, None)
            if on_finish is None:
                continue
            try:
                on_finish(result)
            except Exception:  # the caller's problem; the thread, and the other results, carry on
                log.exception("%s: the on_finish callback of %s failed", self.name, result.request_id)

    def _has_work_locked(self) -> bool:
        return bool(self._inbox or self._aborts or self._jobs or self._push) or self.busy()

    def _wake_locked(self) -> None:
        self._cv.notify_all()
        if self._serving and self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
            self._thread.start()

    def _leave_locked(self) -> None:
        if self._thread is threading.current_thread():
            self._thread = None
        self._cv.notify_all()  # a weight push waiting for this thread now applies itself

    def _loop(self) -> None:
        try:
            while True:
                with self._cv:
                    idle_until = time.monotonic() + IDLE_EXIT_S
                    while not self._stopping and not self._has_work_locked():
                        remaining = idle_until - time.monotonic()
                        if remaining <= 0:
                            # Leave when idle: a live thread that once ran torch ops keeps an OpenMP
                            # team, and two teams on a small CPU make libgomp stop spinning, which
                            # halved the speed of training beside an engine (SFT evaluation).
                            self._leave_locked()
                            return
                        self._cv.wait(remaining)
                    if self._stopping:
                        self._leave_locked()
                        return
                began = time.perf_counter()
                self.step()
                self.busy_s += time.perf_counter() - began
        finally:  # also when a step raised: the next request starts a new thread
            with self._cv:
                self._leave_locked()

    # --- serving -------------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        """Serving, or ready to: not stopped (a later `generate` would start a stopped front again) nor closed."""
        return not self._stopping and not self._closed

    def start(self) -> None:
        """Serve in the background: a stepping thread runs while there is work (idempotent)."""
        with self._cv:
            if self._closed:
                raise RuntimeError(f"{self.name} is shut down")
            self._serving, self._stopping = True, False
            if self._has_work_locked():
                self._wake_locked()

    def stop(self) -> None:
        """Stop the stepping thread after its current step; unfinished requests stay queued (a later
        request starts it again)."""
        with self._cv:
            self._serving, self._stopping = False, True
            thread = self._thread
            self._cv.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def close(self, message: str) -> None:
        """Stop for good: pending jobs run, unfinished requests end with "abort" and `message`, a
        pending weight push fails with it, and every later call raises RuntimeError."""
        with self._cv:
            self._closed = True
            push, self._push = self._push, None
            if push is not None:
                push.settle(RuntimeError(message))
                self._cv.notify_all()
        self.stop()
        with self._step_lock:
            with self._cv:
                jobs, self._jobs = self._jobs, []
                inbox, self._inbox = self._inbox, []
                unfinished = set(self._callbacks)
            for job in jobs:
                job()
            if inbox:
                self.admit(inbox)
            finished = self.cancel(unfinished, error=message) if unfinished else []
        self._deliver(finished)

    def shutdown(self) -> None:
        """Stop serving: the stepping thread stops after its current step (`stop`); an engine that holds
        resources of its own releases them too."""
        self.stop()


class _Sink:
    """What a streamed request sampled, from the stepping thread (`take`, `finish`) to its caller's loop (`next`)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.sent = 0  # tokens handed over so far; the stepping thread's
        self._lock = threading.Lock()
        self._delta = _empty_delta()
        self._result: GenerationResult | None = None
        self._woken = False  # a wake-up is on its way to the loop and the caller has not looked since
        self._arrived = asyncio.Event()  # the loop's

    def take(
        self, token_ids: list[int], logprobs: list[float], versions: list[int], kv_versions: list[int] | None,
        result: GenerationResult | None = None,
    ) -> None:  # fmt: skip
        """The request's tokens so far (and its result, once finished): queue what is new and wake the caller."""
        new = slice(self.sent, len(token_ids))
        self.sent = len(token_ids)
        with self._lock:
            self._delta.token_ids += token_ids[new]
            self._delta.logprobs += logprobs[new]
            self._delta.versions += versions[new]
            if kv_versions is None:
                self._delta.kv_versions = None
            elif self._delta.kv_versions is not None:
                self._delta.kv_versions += kv_versions[new]
            if result is not None:
                self._result = result
            if self._woken or not (self._delta.token_ids or self._result):
                return
            self._woken = True
        # RuntimeError: the caller's loop closed; nobody is listening, and the stepping thread must carry on.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self._arrived.set)

    def finish(self, result: GenerationResult) -> None:
        self.take(result.token_ids, result.logprobs, result.versions, result.kv_versions, result)

    async def next(self) -> TokenDelta | GenerationResult:
        """What arrived since the last call, waiting for it if nothing has: a delta, else the result."""
        while True:
            self._arrived.clear()
            with self._lock:
                self._woken = False
                if self._delta.token_ids:
                    delta, self._delta = self._delta, _empty_delta()
                    return delta
                if self._result is not None:
                    return self._result
            await self._arrived.wait()


def _empty_delta() -> TokenDelta:
    return TokenDelta([], [], [], kv_versions=[])


def _settle_soon(loop: asyncio.AbstractEventLoop, future: asyncio.Future, result=None, error: Exception | None = None) -> None:
    """Settle `future` from another thread, on its own event loop."""
    # RuntimeError: the caller's event loop is closed. Nobody is waiting, and the stepping thread must not die of it.
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(_settle, future, result, error)


def _settle(future: asyncio.Future, result, error: Exception | None) -> None:
    if future.done():  # the caller gave up
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
