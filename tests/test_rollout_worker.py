"""The Ray rollout worker: generate and update_weights round-trip through a real local Ray session."""

from __future__ import annotations

import pytest
from conftest import make_tiny_model

from asyncrl.configs.schema import EmbeddedRolloutConfig
from asyncrl.records import RequestError, SamplingParams

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.slow  # one Ray start (~4 s) plus a worker process importing torch


def test_worker_generates_and_takes_new_weights(ray_session):
    from asyncrl.rollout.worker import create_workers

    model = make_tiny_model("qwen3", eos_token_id=None)
    config = EmbeddedRolloutConfig(num_workers=2, cpus_per_worker=0.5, max_num_seqs=4, retained_prefixes=1)
    workers = create_workers(model, config)
    params = SamplingParams(temperature=1.0, max_tokens=6, seed=9)

    first = ray.get([w.generate.remote([5, 6, 7], params) for w in workers])
    assert [len(r.token_ids) for r in first] == [6, 6]
    assert first[0].token_ids == first[1].token_ids  # same weights, same seed
    assert {r.engine_id for r in first} == {"rollout-0", "rollout-1"}

    new_weights = ray.put(make_tiny_model("qwen3", eos_token_id=None, seed=4).state_dict())
    assert ray.get([w.update_weights.remote(new_weights, 2) for w in workers]) == [2, 2]
    after = ray.get(workers[0].generate.remote([5, 6, 7], {"temperature": 1.0, "max_tokens": 6, "seed": 9}))
    assert after.versions == [2] * 6 and after.logprobs != first[0].logprobs
    assert ray.get(workers[1].version.remote()) == 2
    assert ray.get(workers[1].health.remote())["generated_tokens"] == 6

    with pytest.raises(RequestError, match="outside the vocabulary"):
        ray.get(workers[0].generate.remote([5, 999], params))
    assert len(ray.get(workers[0].generate.remote([5], params)).token_ids) == 6  # the worker carries on

    # Through the gateway's handle the refusal is the engine's message alone, not the actor's traceback.
    import asyncio

    from asyncrl.gateway.engines import RayEngine

    with pytest.raises(RequestError) as refused:
        asyncio.run(RayEngine(workers[0], "rollout-0").generate([5, 999], params, None))
    assert str(refused.value).startswith("token id 999 is outside the vocabulary") and "Traceback" not in str(refused.value)
    for worker in workers:
        ray.kill(worker)


def test_gateway_routes_openai_calls_to_ray_workers(ray_session, tmp_path):
    """The gateway over Ray engine handles: an unmodified OpenAI client, turns recorded with the worker's id."""
    from gateway_helpers import LiveGateway, make_service

    from asyncrl.gateway.engines import RayEngine
    from asyncrl.gateway.store import open_store
    from asyncrl.rollout.worker import create_workers

    model = make_tiny_model("qwen3", eos_token_id=None)
    workers = create_workers(model, EmbeddedRolloutConfig(num_workers=2, cpus_per_worker=0.5, max_num_seqs=4), name_prefix="gw")
    handles = [RayEngine(worker, f"gw-{i}") for i, worker in enumerate(workers)]
    store = open_store(tmp_path)
    with LiveGateway(make_service(store, handles)) as live:
        rollout_id, key = live.open()
        client = live.openai(key)
        for _ in range(2):
            reply = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "1+1"}], max_tokens=4)
            assert reply.choices[0].finish_reason == "length"
    turns = store.get(rollout_id).turns
    assert len(turns) == 2 and all(len(t.completion_token_ids) == 4 for t in turns)
    # Consistent hashing keeps every turn of a rollout on one engine.
    assert turns[0].engine_id == turns[1].engine_id and turns[0].engine_id in {"gw-0", "gw-1"}
    assert all(len(t.logprobs) == 4 and all(lp <= 0 for lp in t.logprobs) for t in turns)
