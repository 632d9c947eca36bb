"""Token streaming from the engines to the gateway's pool: a real embedded engine, in process, behind
`engine_app` over HTTP, and in a Ray worker; `EnginePool.stream` routing, failing over before the first
delta (never after), deadlines, abandonment, and leaving early, which aborts the engine's request."""

from __future__ import annotations

import asyncio
import sys

import pytest
from conftest import make_tiny_model
from gateway_helpers import ScriptedEngine
from test_engine_front import check_stream_close_aborts, check_stream_matches_generate, record_aborts, wait_for
from test_gateway_auth import EngineServer

from asyncrl.configs.schema import EmbeddedRolloutConfig, GatewayConfig
from asyncrl.gateway.engines import EngineFailure, HttpEngine, LocalEngine, RayEngine
from asyncrl.gateway.pool import Abandoned, EnginePool, GenerationTimeout
from asyncrl.records import GenerationResult, RequestError, SamplingParams, TokenDelta
from asyncrl.rollout import EmbeddedEngine

PROMPT = [5, 17, 33, 9]
SAMPLED = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=7)
LONG = SamplingParams(temperature=1.0, max_tokens=120, seed=3)  # far longer than any test reads (max_model_len 128)


@pytest.fixture(scope="module")
def model():
    """No EOS: every request runs to max_tokens unless aborted."""
    return make_tiny_model("glm_moe_dsa", eos_token_id=None, seed=1)


def new_engine(model, engine_id: str = "e0", **options) -> EmbeddedEngine:
    return EmbeddedEngine(model, EmbeddedRolloutConfig(**{"max_num_seqs": 4, "torch_threads": 1, **options}), engine_id=engine_id)


def new_pool(*handles, **config) -> EnginePool:
    pool = EnginePool(GatewayConfig(**config))
    for handle in handles:
        pool.add_local(handle)
    return pool


async def collect(stream) -> tuple[list[TokenDelta], GenerationResult]:
    *deltas, result = [item async for item in stream]
    assert all(isinstance(d, TokenDelta) and d.token_ids for d in deltas) and isinstance(result, GenerationResult)
    return deltas, result


def joined(deltas: list[TokenDelta]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def key_routed_to(pool: EnginePool, engine_id: str) -> str:
    return next(k for k in (f"rollout-{i}" for i in range(10_000)) if pool.router.route(k, pool.registry.loads()) == engine_id)


# --- the embedded engine ------------------------------------------------------------------------


def test_an_embedded_engine_streams_exactly_what_it_generates(model):
    engine = new_engine(model)
    try:
        check_stream_matches_generate(engine, PROMPT, SAMPLED)
        check_stream_matches_generate(engine, PROMPT, SamplingParams(temperature=0, max_tokens=9))
    finally:
        engine.shutdown()


def test_a_speculative_engine_streams_exactly_what_it_generates():
    from asyncrl.policy.mtp import build_mtp

    model = make_tiny_model("qwen3", eos_token_id=None, config_overrides={"vocab_size": 8})
    config = EmbeddedRolloutConfig(mtp_drafting=True, mtp_draft_tokens=3, torch_threads=1)
    engine = EmbeddedEngine(model, config, mtp=build_mtp(model, seed=1).eval())
    try:
        check_stream_matches_generate(engine, [5, 1, 3, 6], SamplingParams(temperature=0, max_tokens=24))
        assert engine.health()["mtp_accept_len"] > 1.0  # steps that emitted several tokens were streamed
    finally:
        engine.shutdown()


def test_leaving_an_embedded_stream_early_aborts_the_request(model):
    engine = new_engine(model)
    try:
        check_stream_close_aborts(engine, PROMPT, LONG)
    finally:
        engine.shutdown()


def test_bad_input_is_refused_before_anything_streams(model):
    engine = new_engine(model)
    with pytest.raises(RequestError, match="outside the vocabulary"):
        engine.stream([5, 10**6], SAMPLED)
    assert engine.health()["waiting"] == 0


def test_health_reports_max_model_len_and_the_pool_reads_the_context_from_it(model):
    engines = [new_engine(model, "e0"), new_engine(model, "e1", max_model_len=96)]
    assert [e.health()["max_model_len"] for e in engines] == [128, 96]

    async def scenario() -> tuple[int | None, int | None]:
        pool = new_pool(*(LocalEngine(e) for e in engines))
        before = pool.context_tokens()
        await pool.poll_once()
        return before, pool.context_tokens()

    assert asyncio.run(scenario()) == (None, 96)  # what every live engine takes


# --- the pool -----------------------------------------------------------------------------------


def test_the_pool_streams_what_it_generates_and_records_no_retries(model):
    engine = new_engine(model)

    async def scenario():
        pool = new_pool(LocalEngine(engine))
        deadline = asyncio.get_running_loop().time() + 60
        # Two rollouts: a second turn of one would reuse the first's KV cache, computed in another batch shape.
        expected, _ = await pool.generate("r1", PROMPT, SAMPLED, deadline=deadline)
        deltas, result = await collect(pool.stream("r2", PROMPT, SAMPLED, deadline=deadline))
        return expected, deltas, result, pool.registry.loads()

    try:
        expected, deltas, result, loads = asyncio.run(scenario())
    finally:
        engine.shutdown()
    assert joined(deltas) == result.token_ids == expected.token_ids and result.logprobs == expected.logprobs
    assert result.timings["retries"] == 0.0 and result.engine_id == "e0"
    assert loads == {"e0": 0}  # the lease went back


def test_a_handle_without_a_stream_of_its_own_sends_the_completion_as_one_delta():
    async def scenario():
        pool = new_pool(ScriptedEngine(lambda prompt: "hello there"))
        return await collect(pool.stream("r", [5, 6], SAMPLED, deadline=asyncio.get_running_loop().time() + 60))

    (delta,), result = asyncio.run(scenario())
    assert delta.token_ids == result.token_ids and result.token_ids


def test_a_stream_whose_engine_fails_before_the_first_delta_goes_to_another(model):
    engine = new_engine(model)

    async def scenario():
        pool = new_pool(LocalEngine(engine), engine_retries=1)
        # Registered, then gone: nothing listens on its port. The most capacity makes it many rollouts' home.
        gone = HttpEngine("http://127.0.0.1:9", "gone")
        pool.register(gone, capacity=64.0)
        key = key_routed_to(pool, "gone")
        deltas, result = await collect(pool.stream(key, PROMPT, SAMPLED, deadline=asyncio.get_running_loop().time() + 60))
        await gone.aclose()
        return deltas, result

    try:
        deltas, result = asyncio.run(scenario())
    finally:
        engine.shutdown()
    assert result.engine_id == "e0" and result.timings["retries"] == 1.0 and joined(deltas) == result.token_ids


def test_a_stream_whose_engine_fails_after_the_first_delta_is_not_retried(model):
    dying, spare = new_engine(model, "dying"), new_engine(model, "spare")

    async def scenario():
        pool = new_pool(LocalEngine(dying), LocalEngine(spare), engine_retries=3)
        stream = pool.stream(key_routed_to(pool, "dying"), PROMPT, LONG, deadline=asyncio.get_running_loop().time() + 60)
        first = await anext(stream)
        dying.close("engine shut down")  # its unfinished requests end with "abort"
        with pytest.raises(EngineFailure, match=r"engine dying failed after streaming \d+ tokens: .*abort: engine shut down"):
            async for _ in stream:
                pass
        return first

    try:
        assert asyncio.run(scenario()).token_ids
        assert spare.health()["generated_tokens"] == 0  # the caller had sent tokens on: nobody tried again
    finally:
        spare.shutdown()


def test_leaving_a_pool_stream_early_aborts_the_request_and_returns_the_lease(model):
    engine = new_engine(model)
    aborted = record_aborts(engine)

    async def scenario():
        pool = new_pool(LocalEngine(engine))
        stream = pool.stream("r", PROMPT, LONG, deadline=asyncio.get_running_loop().time() + 60)
        first = await anext(stream)
        await stream.aclose()
        return first, pool.registry.loads()

    try:
        first, loads = asyncio.run(scenario())
        wait_for(lambda: aborted and engine.health()["running"] == 0)
    finally:
        engine.shutdown()
    (result,) = aborted
    assert result.finish_reason == "abort" and result.token_ids[: len(first.token_ids)] == first.token_ids
    assert loads == {"e0": 0}


@pytest.mark.parametrize("interruption", ["deadline", "abandon"])
def test_a_stream_past_its_deadline_or_abandoned_raises_and_aborts(model, interruption):
    engine = new_engine(model)
    aborted = record_aborts(engine)

    async def scenario():
        pool = new_pool(LocalEngine(engine))
        loop = asyncio.get_running_loop()
        abandon: set[asyncio.Future] = set()
        deadline = loop.time() + (0.05 if interruption == "deadline" else 60)
        with engine._step_lock:  # the engine cannot step: nothing streams before the interruption
            stream = pool.stream("r", PROMPT, LONG, deadline=deadline, abandon=abandon)
            if interruption == "abandon":
                loop.call_soon(lambda: [wake.set_result("rollout r was finished") for wake in abandon])
            with pytest.raises(GenerationTimeout if interruption == "deadline" else Abandoned):
                await anext(stream)
        return abandon

    try:
        assert asyncio.run(scenario()) == set()
        wait_for(lambda: aborted and engine.health()["running"] == 0 and engine.health()["waiting"] == 0)
    finally:
        engine.shutdown()
    assert [r.finish_reason for r in aborted] == ["abort"]


def test_bad_input_through_the_pool_is_a_request_error_and_not_retried(model):
    engine = new_engine(model)

    async def scenario():
        pool = new_pool(LocalEngine(engine), engine_retries=2)
        with pytest.raises(RequestError, match="outside the vocabulary"):
            await anext(pool.stream("r", [5, 10**6], SAMPLED, deadline=asyncio.get_running_loop().time() + 60))

    asyncio.run(scenario())


# --- an engine over HTTP ------------------------------------------------------------------------


def test_an_engine_over_http_streams_what_it_generates_and_a_closed_response_aborts(model):
    engine = new_engine(model)
    try:
        with EngineServer(engine) as address:

            async def scenario():
                remote = HttpEngine(address, "remote")
                try:
                    expected = await remote.generate(PROMPT, SAMPLED, "s1")  # two sessions: no KV reuse between them
                    deltas, result = await collect(remote.stream(PROMPT, SAMPLED, "s2"))
                    with pytest.raises(RequestError, match="outside the vocabulary"):
                        await anext(remote.stream([5, 10**6], SAMPLED, "s"))
                    stream = remote.stream(PROMPT, LONG, "s")
                    first = await anext(stream)
                    await stream.aclose()
                    return expected, deltas, result, first
                finally:
                    await remote.aclose()

            aborted = record_aborts(engine)
            expected, deltas, result, first = asyncio.run(scenario())
            wait_for(lambda: aborted and engine.health()["running"] == 0)
    finally:
        engine.shutdown()
    assert joined(deltas) == result.token_ids == expected.token_ids and result.logprobs == expected.logprobs
    assert result.versions == expected.versions and result.finish_reason == "length"
    (cut,) = aborted
    assert cut.finish_reason == "abort" and cut.token_ids[: len(first.token_ids)] == first.token_ids


# --- a Ray worker -------------------------------------------------------------------------------


@pytest.mark.slow  # one Ray start plus a worker process importing torch
def test_a_ray_worker_streams_what_it_generates_and_a_cancelled_stream_aborts(ray_session, model):
    import ray

    from asyncrl.rollout.worker import create_workers

    # The spies run inside the actor: their code goes by value, as the worker cannot import the tests.
    ray.cloudpickle.register_pickle_by_value(sys.modules["test_engine_front"])
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    (worker,) = create_workers(model, EmbeddedRolloutConfig(num_workers=1, cpus_per_worker=0.5, max_num_seqs=4), name_prefix="stream")
    ray.get(worker.__ray_call__.remote(_install_abort_spy))
    handle = RayEngine(worker, "stream-0")
    local = new_engine(model, "local")

    async def scenario():
        expected = await handle.generate(PROMPT, SAMPLED, "s1")
        deltas, result = await collect(handle.stream(PROMPT, SAMPLED, "s2"))
        with pytest.raises(RequestError, match="outside the vocabulary") as refused:
            await anext(handle.stream([5, 10**6], SAMPLED, "s"))
        assert "Traceback" not in str(refused.value)
        stream = handle.stream(PROMPT, LONG, "s")
        first = await anext(stream)
        await stream.aclose()
        return expected, deltas, result, first

    try:
        expected, deltas, result, first = asyncio.run(scenario())
        assert joined(deltas) == result.token_ids == expected.token_ids and result.logprobs == expected.logprobs
        wait_for(lambda: ray.get(worker.__ray_call__.remote(_aborted)) and ray.get(worker.health.remote())["running"] == 0, 120)
        ((reason, tokens),) = ray.get(worker.__ray_call__.remote(_aborted))
        assert reason == "abort" and tokens[: len(first.token_ids)] == first.token_ids

        ray.kill(worker)  # a dead worker fails before the first delta: the stream goes elsewhere

        async def failover():
            pool = new_pool(handle, LocalEngine(local), engine_retries=1)
            deadline = asyncio.get_running_loop().time() + 60
            return await collect(pool.stream(key_routed_to(pool, "stream-0"), PROMPT, SAMPLED, deadline=deadline))

        deltas, result = asyncio.run(failover())
        assert result.engine_id == "local" and result.timings["retries"] == 1.0 and result.token_ids == expected.token_ids
    finally:
        ray.kill(worker)
        local.shutdown()


def _install_abort_spy(worker) -> None:
    worker.engine.aborted_for_test = record_aborts(worker.engine)


def _aborted(worker) -> list[tuple[str, list[int]]]:
    return [(r.finish_reason, r.token_ids) for r in worker.engine.aborted_for_test]
