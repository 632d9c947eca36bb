"""The engine front (`rollout/front.py`) over a small fake core, and the scenarios every engine runs.

The fake core emits one token per step, its value the version of the weights serving, so each test
can read off exactly which weights produced what. The `check_*` scenarios at the end take a real
engine; `tests/test_engine.py` runs them on the embedded engine, `tests/test_vllm_engine.py` on vLLM.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from dataclasses import dataclass, field

import pytest

from asyncrl.records import GenerationResult, TokenDelta
from asyncrl.rollout.front import EngineFront


@dataclass(eq=False)
class FakeRequest:
    id: str
    max_tokens: int
    tokens: list[int] = field(default_factory=list)


class FakeEngine(EngineFront):
    """The real front over a fake core: each admitted request gains one token per `advance` (the serving
    version) until it has `max_tokens`. Its prompts are `FakeRequest`s already (`make_request` takes them as
    they are), so a test names each request and its length."""

    def __init__(self) -> None:
        self.version = 0
        self.running: dict[str, FakeRequest] = {}
        self.loaded: list[int] = []  # versions, in the order their weights were loaded
        self.threads: set[str] = set()  # threads that ran a core verb
        super().__init__(name="front-test")

    def make_request(self, prompt_token_ids, sampling=None, session_id=None) -> FakeRequest:
        return prompt_token_ids

    def admit(self, requests: list[FakeRequest]) -> None:
        self.threads.add(threading.current_thread().name)
        self.running.update((r.id, r) for r in requests)

    def cancel(self, request_ids: set[str], error: str | None = None) -> list[GenerationResult]:
        return [self._result(self.running.pop(i), "abort", error) for i in sorted(request_ids) if i in self.running]

    def advance(self) -> list[GenerationResult]:
        self.threads.add(threading.current_thread().name)
        finished = []
        for request in list(self.running.values()):
            request.tokens.append(self.version)
            if len(request.tokens) == request.max_tokens:
                finished.append(self._result(self.running.pop(request.id), "length"))
        return finished

    def busy(self) -> bool:
        return bool(self.running)

    def sampled(self, request: FakeRequest) -> tuple[list[int], list[float], list[int], None]:
        return request.tokens, [0.0] * len(request.tokens), request.tokens, None

    def load_weights(self, weights, version: int) -> None:
        if weights == "bad":
            raise ValueError("refused: bad weights")
        self.version = version
        self.loaded.append(version)

    def _result(self, request: FakeRequest, reason, error=None) -> GenerationResult:
        return GenerationResult(
            request.id, [], list(request.tokens), [0.0] * len(request.tokens), list(request.tokens), reason, error=error
        )


def new_front() -> tuple[FakeEngine, FakeEngine]:
    """The front and its core, one object (named twice so a test reads which side it exercises)."""
    engine = FakeEngine()
    return engine, engine


def wait_for(condition, timeout_s: float = 30.0) -> None:
    """Wait until `condition()` holds (a state another thread reaches), failing after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


def record_aborts(core) -> list[GenerationResult]:
    """Watch a core's `cancel` (the front calls it on its stepping thread): the list gets every result it ends."""
    aborted: list[GenerationResult] = []
    cancel = core.cancel

    def recording(request_ids, error=None):
        results = cancel(request_ids, error)
        aborted.extend(results)
        return results

    core.cancel = recording
    return aborted


def in_thread(function, *args) -> tuple[threading.Thread, list]:
    """Run `function(*args)` on a new thread; the list receives its return value or exception."""
    outcome: list = []

    def run() -> None:
        try:
            outcome.append(function(*args))
        except Exception as error:
            outcome.append(error)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


# --- the front over a fake core -----------------------------------------------------------------


def test_stepping_by_hand_delivers_results_to_callbacks():
    front, core = new_front()
    got = []
    front.add_request(FakeRequest("a", 2), on_finish=got.append)
    front.add_request(FakeRequest("b", 3))
    assert front.queued == 2 and front.has_unfinished()
    assert front.step() == [] and front.queued == 0
    (a,) = front.step()
    assert a.request_id == "a" and got == [a] and front.has_unfinished()
    (b,) = front.step()
    assert b.request_id == "b" and b.token_ids == [0, 0, 0] and not front.has_unfinished()
    assert core.threads == {threading.current_thread().name}  # not serving: no thread of its own


def test_generate_serves_on_the_stepping_thread_and_a_cancelled_caller_aborts():
    front, core = new_front()

    async def scenario():
        result = await front.generate(FakeRequest("a", 3))
        task = asyncio.create_task(front.generate(FakeRequest("long", 10**9)))
        await asyncio.sleep(0)  # submitted
        wait_for(lambda: "long" in core.running)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return result

    result = asyncio.run(scenario())
    wait_for(lambda: not core.running)  # the abort reached the core
    front.stop()
    assert result.token_ids == [0, 0, 0] and result.finish_reason == "length"
    assert core.threads == {"front-test"}


def test_a_caller_whose_event_loop_closed_costs_nobody_else_their_result():
    front, _ = new_front()
    ids = itertools.count()
    check_closed_caller(front, lambda: front.generate(FakeRequest(f"r{next(ids)}", 3)))
    front.stop()


def test_a_failing_callback_costs_nobody_else_their_result():
    front, _ = new_front()
    got = []

    def fail(result):
        raise RuntimeError("a broken caller")

    front.add_request(FakeRequest("a", 1), on_finish=fail)
    front.add_request(FakeRequest("b", 1), on_finish=got.append)
    assert [r.request_id for r in front.step()] == ["a", "b"]
    assert [r.request_id for r in got] == ["b"]


def test_the_idle_stepping_thread_leaves_and_the_next_request_restarts_it():
    front, core = new_front()
    first = asyncio.run(front.generate(FakeRequest("a", 2)))
    wait_for(lambda: front._thread is None)
    assert front.alive
    front.update_weights("w", 4)  # applied by the caller: nobody is stepping
    assert core.loaded == [4] and core.threads == {"front-test"}
    again = asyncio.run(front.generate(FakeRequest("b", 2)))
    front.stop()
    assert first.token_ids == [0, 0] and again.token_ids == [4, 4]


def test_weights_pushed_mid_request_serve_from_the_next_step():
    front, core = new_front()
    front.add_request(FakeRequest("a", 4))
    front.step()
    front.step()
    front.update_weights("w", 1)
    assert core.version == 1
    front.step()
    (result,) = front.step()
    assert result.token_ids == [0, 0, 1, 1]


def test_weights_the_core_refuses_raise_for_their_caller_and_the_old_ones_stay():
    front, core = new_front()
    with pytest.raises(ValueError, match="refused: bad weights"):
        front.update_weights("bad", 3)
    front.start()
    asyncio.run(front.generate(FakeRequest("warm", 1)))
    with front._step_lock:  # the stepping thread is alive now: it is the one that applies the push
        front.add_request(FakeRequest("a", 2))
        thread, outcome = in_thread(front.update_weights, "bad", 3)
        wait_for(lambda: front._push is not None)
    thread.join()
    front.stop()
    assert isinstance(outcome[0], ValueError) and core.version == 0 and core.loaded == []


def test_a_push_replaced_before_it_was_applied_returns_when_the_newer_one_is():
    front, core = new_front()
    front.start()
    front.add_request(FakeRequest("long", 10**9))
    with front._step_lock:  # no step, so no push is applied, until both are queued
        older, older_outcome = in_thread(front.update_weights, "w1", 1)
        wait_for(lambda: front._push is not None)
        newer, newer_outcome = in_thread(front.update_weights, "w2", 2)
        wait_for(lambda: front._push is not None and front._push.replaced)
    older.join()
    newer.join()
    front.close("done")
    assert older_outcome == [None] and newer_outcome == [None]
    assert core.loaded == [2]


def test_a_push_from_a_callback_on_the_stepping_thread_is_applied_at_the_next_step():
    front, core = new_front()

    def push_on_finish(result):
        front.update_weights("w", 9)  # would deadlock if it waited for the thread it runs on

    async def scenario():
        front.add_request(FakeRequest("a", 1), on_finish=push_on_finish)  # not serving yet: both start in one step
        return await front.generate(FakeRequest("b", 3))

    result = asyncio.run(scenario())
    front.stop()
    assert result.token_ids == [0, 9, 9] and core.loaded == [9]


def test_calls_run_on_the_stepping_thread_and_raise_for_their_caller():
    front, _ = new_front()

    def fails():
        raise KeyError("no such thing")

    async def scenario():
        where = await front.call(lambda: threading.current_thread().name)
        with pytest.raises(KeyError, match="no such thing"):
            await front.call(fails)
        return where

    assert asyncio.run(scenario()) == "front-test"
    front.stop()


def test_close_ends_unfinished_requests_and_refuses_what_comes_after():
    front, core = new_front()
    got = []
    front.add_request(FakeRequest("admitted", 10), on_finish=got.append)
    front.step()
    front.add_request(FakeRequest("queued", 10), on_finish=got.append)
    front.close("engine shut down")
    assert sorted((r.request_id, r.finish_reason, r.error) for r in got) == [
        ("admitted", "abort", "engine shut down"),
        ("queued", "abort", "engine shut down"),
    ]
    assert not front.alive and not core.running
    for call in (lambda: front.add_request(FakeRequest("late", 1)), lambda: front.update_weights("w", 1), front.start):
        with pytest.raises(RuntimeError, match="front-test is shut down"):
            call()


def test_close_fails_a_pending_weight_push():
    front, core = new_front()
    front.start()
    front.add_request(FakeRequest("long", 10**9))
    with front._step_lock:
        thread, outcome = in_thread(front.update_weights, "w", 1)
        wait_for(lambda: front._push is not None)
        closer, _ = in_thread(front.close, "engine shut down")
        wait_for(lambda: front._closed)
    thread.join()
    closer.join()
    assert isinstance(outcome[0], RuntimeError) and "engine shut down" in str(outcome[0]) and core.loaded == []


def test_stop_keeps_unfinished_requests_and_start_resumes_them():
    front, core = new_front()
    got = threading.Event()
    front.start()
    front.add_request(FakeRequest("a", 10**9))
    wait_for(lambda: core.running)
    front.stop()
    assert not front.alive and front._thread is None and "a" in core.running
    tokens = len(core.running["a"].tokens)
    front.add_request(FakeRequest("b", 2), on_finish=lambda r: got.set())
    front.start()
    assert got.wait(30) and front.alive and len(core.running["a"].tokens) > tokens
    front.stop()


def test_a_stream_that_falls_behind_gets_what_arrived_meanwhile_in_one_delta():
    front, core = new_front()

    async def scenario():
        stream = front.stream(FakeRequest("a", 50))
        first = await anext(stream)
        wait_for(lambda: "a" not in core.running)  # the loop is blocked here: every later step piles up
        return first, [item async for item in stream]

    first, (*rest, result) = asyncio.run(scenario())
    front.stop()
    # On a busy machine the first delta may already hold everything; what came later is one delta at most.
    assert isinstance(first, TokenDelta) and len(rest) <= 1 and all(isinstance(delta, TokenDelta) for delta in rest)
    streamed = first.token_ids + [t for delta in rest for t in delta.token_ids]
    assert result.finish_reason == "length" and len(streamed) == 50 and streamed == result.token_ids


def test_leaving_a_stream_early_aborts_its_request():
    front, core = new_front()
    aborted = record_aborts(core)

    async def scenario():
        stream = front.stream(FakeRequest("a", 10**9))
        delta = await anext(stream)
        await stream.aclose()
        return delta

    delta = asyncio.run(scenario())
    wait_for(lambda: not core.running)
    front.stop()
    (result,) = aborted
    assert result.finish_reason == "abort" and result.token_ids[: len(delta.token_ids)] == delta.token_ids


def test_close_ends_a_stream_with_its_tokens_and_an_abort():
    front, _ = new_front()

    async def scenario():
        stream = front.stream(FakeRequest("a", 10**9))
        first = await anext(stream)
        front.close("engine shut down")
        return first, [item async for item in stream]

    first, items = asyncio.run(scenario())
    result = items[-1]
    assert result.finish_reason == "abort" and result.error == "engine shut down"
    assert first.token_ids + [t for delta in items[:-1] for t in delta.token_ids] == result.token_ids
    assert not front._streams


# --- scenarios every engine runs ----------------------------------------------------------------


def check_closed_caller(front: EngineFront, generate) -> None:
    """Finished requests are handed back through their callers' event loops. When one caller's loop
    is gone, another finishing in the same step still gets its result. `generate()`: a coroutine
    of the engine's `generate` for one request; both calls' requests must finish in the same step."""

    def submit_and_leave() -> None:
        gone = asyncio.new_event_loop()
        task = gone.create_task(generate())
        gone.run_until_complete(asyncio.sleep(0))  # the task ran up to awaiting its result: submitted
        gone.close()
        assert not task.done()

    async def scenario():
        with front._step_lock:  # hold the engine so both requests are admitted in one step
            leaver = threading.Thread(target=submit_and_leave)
            leaver.start()
            leaver.join()
            live = asyncio.ensure_future(generate())
            await asyncio.sleep(0)  # submitted
            assert front.queued == 2
        return await asyncio.wait_for(live, 120)

    result = asyncio.run(scenario())
    assert result.token_ids and result.finish_reason in ("stop", "length")
    assert front.alive and not front.has_unfinished()


def check_idle_exit(engine, prompt: list[int], sampling, state_dict: dict, version: int) -> None:
    """The idle stepping thread leaves (an idle thread that once ran torch keeps an OpenMP team and
    slows a trainer in the same process); a weight push then is applied by its caller, and the next
    request starts a new thread and samples under the new version exactly what it did before."""
    first = asyncio.run(engine.generate(prompt, sampling))
    wait_for(lambda: engine._thread is None)
    assert engine.health()["alive"]
    engine.update_weights(state_dict, version)  # the same weights again, under a new version
    assert engine.health()["version"] == version
    again = asyncio.run(engine.generate(prompt, sampling))
    assert again.token_ids == first.token_ids and again.versions == [version] * len(first.token_ids)


def check_stream_matches_generate(engine, prompt: list[int], sampling) -> list[TokenDelta]:
    """A stream's deltas (none empty) concatenate to its result, and both are what `generate` returns for
    the same seed: tokens, log-probs and versions. Returns the deltas."""
    expected = asyncio.run(engine.generate(prompt, sampling))

    async def collect():
        return [item async for item in engine.stream(prompt, sampling)]

    *deltas, result = asyncio.run(collect())
    assert all(isinstance(d, TokenDelta) and d.token_ids for d in deltas) and isinstance(result, GenerationResult)
    for field_name in ("token_ids", "logprobs", "versions"):
        assert [x for d in deltas for x in getattr(d, field_name)] == getattr(result, field_name) == getattr(expected, field_name)
    assert result.finish_reason == expected.finish_reason and result.prompt_token_ids == expected.prompt_token_ids
    return deltas


def check_stream_close_aborts(engine, prompt: list[int], sampling) -> None:
    """Leaving a stream early, by `aclose` or by cancelling its reader, aborts the request at the engine's
    next step: the engine ends it with "abort" (the tokens so far kept) and no longer runs it.
    `sampling`: a request far longer than the test reads."""
    aborted = record_aborts(engine)

    async def close_early() -> list[int]:
        stream = engine.stream(prompt, sampling)
        first = await anext(stream)
        await stream.aclose()
        return first.token_ids

    async def cancel_reader() -> list[int]:
        got: list[int] = []
        reading = asyncio.Event()

        async def read():
            async for delta in engine.stream(prompt, sampling):
                got.extend(delta.token_ids)
                reading.set()

        reader = asyncio.create_task(read())
        await reading.wait()
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        return got

    for leave in (close_early, cancel_reader):
        streamed = asyncio.run(leave())
        wait_for(lambda: len(aborted) == 1 and engine.health()["running"] == 0)
        result = aborted.pop()
        # Only a request the engine still held comes back from cancel: it had not run to max_tokens.
        assert result.finish_reason == "abort" and result.token_ids[: len(streamed)] == streamed
