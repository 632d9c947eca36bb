"""The Ray rollout worker: generate and load_weights round-trip through a real local Ray session."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from conftest import make_tiny_model
from loop_helpers import TINY

from asyncrl.configs.schema import EmbeddedRolloutConfig
from asyncrl.records import RequestError, SamplingParams

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.slow  # one Ray start (~4 s) plus a worker process importing torch


def test_worker_generates_and_takes_new_weights(ray_session):
    from asyncrl.rollout.worker import create_workers

    model = make_tiny_model("qwen3", eos_token_id=None)
    config = EmbeddedRolloutConfig(num_workers=2, cpus_per_worker=0.5, max_num_seqs=4)
    workers = create_workers(model, config)
    params = SamplingParams(temperature=1.0, max_tokens=6, seed=9)

    first = ray.get([w.generate.remote([5, 6, 7], params) for w in workers])
    assert [len(r.token_ids) for r in first] == [6, 6]
    assert first[0].token_ids == first[1].token_ids  # same weights, same seed
    assert {r.engine_id for r in first} == {"rollout-0", "rollout-1"}

    new_weights = ray.put(make_tiny_model("qwen3", eos_token_id=None, seed=4).state_dict())
    assert ray.get([w.load_weights.remote(new_weights, 2) for w in workers]) == [2, 2]
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


def test_one_handle_sends_a_turns_requests_together_and_gives_each_its_own_outcome(ray_session):
    """`RayEngine.generate`: the calls of one event-loop turn go to the worker in one `submit`, and
    `collect` brings each its result, or its own refusal, while the others are answered."""
    import asyncio

    from asyncrl.gateway.engines import EngineFailure, RayEngine
    from asyncrl.rollout.worker import create_workers

    (worker,) = create_workers(make_tiny_model("qwen3", eos_token_id=None), EmbeddedRolloutConfig(num_workers=1, max_num_seqs=4))
    prompts = [[5, 6, 7 + i % 3] for i in range(24)]
    params = [SamplingParams(temperature=1.0, max_tokens=3 + i % 5, seed=i) for i in range(24)]
    alone = ray.get([worker.generate.remote(p, s) for p, s in zip(prompts, params, strict=True)])

    batches = []

    class Submits:  # the worker's handle, noting the size of each submit
        def __init__(self, actor) -> None:
            self.actor = actor

        def __getattr__(self, name):
            return getattr(self.actor, name)

        @property
        def submit(self):
            remote = self.actor.submit.remote
            return type("Method", (), {"remote": staticmethod(lambda caller, batch: batches.append(len(batch)) or remote(caller, batch))})

    engine = RayEngine(Submits(worker), "rollout-0")

    async def together():
        calls = [engine.generate(p, s, f"s{i}") for i, (p, s) in enumerate(zip(prompts, params, strict=True))]
        calls.insert(7, engine.generate([5, 999], params[0], "refused"))
        outcomes = await asyncio.gather(*calls, return_exceptions=True)
        later = await engine.generate(prompts[0], params[0], "later")  # the collector comes back for a later call
        return outcomes, later

    outcomes, later = asyncio.run(together())
    refused = outcomes.pop(7)
    assert isinstance(refused, RequestError) and str(refused).startswith("token id 999 is outside the vocabulary")
    assert [r.token_ids for r in outcomes] == [r.token_ids for r in alone]  # each its own (seeded) sample
    assert [r.logprobs for r in outcomes] == [pytest.approx(r.logprobs, abs=1e-4) for r in alone]  # batched with others
    assert later.token_ids == alone[0].token_ids and batches == [25, 1]
    # The same handle from another event loop (the first one closed, its collect left pending on the worker).
    again = asyncio.run(engine.generate(prompts[1], params[1], "again"))
    assert again.token_ids == alone[1].token_ids and batches == [25, 1, 1]

    ray.kill(worker)
    # ray.kill returns before the process is gone: a call sent just after it may still be answered.
    with pytest.raises(ray.exceptions.RayActorError):
        for _ in range(600):
            ray.get(worker.health.remote())
            time.sleep(0.05)

    async def dead():
        engine = RayEngine(worker, "rollout-0")
        calls = (engine.generate(p, s, "s") for p, s in zip(prompts[:3], params[:3], strict=True))
        return await asyncio.gather(*calls, return_exceptions=True)

    assert all(isinstance(outcome, EngineFailure) for outcome in asyncio.run(dead()))


def test_gateway_routes_openai_calls_to_ray_workers(ray_session, tmp_path):
    """The gateway over Ray engine handles: an unmodified OpenAI client, turns recorded with the worker's id."""
    from gateway_helpers import LiveGateway, make_service

    from asyncrl.gateway.engines import RayEngine
    from asyncrl.gateway.store import open_store
    from asyncrl.rollout.worker import create_workers

    model = make_tiny_model("qwen3", eos_token_id=None)
    workers = create_workers(model, EmbeddedRolloutConfig(num_workers=2, cpus_per_worker=0.5, max_num_seqs=4), name_prefix="gw")
    # Built before the gateway watches them: on a busy machine an actor still building its engine misses
    # the gateway's heartbeat window and is out of routing when the first request comes.
    ray.get([worker.version.remote() for worker in workers])
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


NICENESS_PROBE = """
import json, os, sys
import ray
from asyncrl.configs.loader import load_config
from asyncrl.policy.checkpoint import build_policy
from asyncrl.rollout.worker import create_workers
from asyncrl.jobs.cluster import start_ray

os.nice(3)  # neither 0 nor Ray's 15: the actor must take its driver's, whatever it is
config = load_config("quickstart", sys.argv[1:])
assert start_ray(config)
model, _, _ = build_policy(config.policy, config.seed)
(worker,) = create_workers(model, config.rollout)
priority = lambda _: os.getpriority(os.PRIO_PROCESS, 0)
print(json.dumps({"driver": priority(None), "worker": ray.get(worker.__ray_call__.remote(priority))}))
ray.shutdown()
"""


def test_a_run_starts_its_rollout_workers_at_the_drivers_niceness():
    """Ray's core worker renices every actor process to its `worker_niceness` (15 by default), which
    starved engines on a busy machine until the gateway dropped them; `asyncrl run` starts Ray so that
    actors keep the driver's niceness. In a fresh process: this module's tests share one Ray."""
    probe = subprocess.run([sys.executable, "-c", NICENESS_PROBE, *TINY], capture_output=True, text=True, timeout=300)
    assert probe.returncode == 0, probe.stderr[-3000:]
    niceness = json.loads(probe.stdout.strip().splitlines()[-1])
    assert niceness == {"driver": 3, "worker": 3}


def test_a_dead_worker_leaves_routing_and_its_replacement_joins_serving_the_latest_push(ray_session):
    """`RayWorkers` (sched/workers.py) supervised by a `RaySupervisor` (sched/supervision.py) over real
    actors: a worker that dies leaves routing and pushes;
    its replacement joins routing only once it serves the latest push; a push whose weights died with
    the learner that made them fails without taking any worker out."""
    import asyncio

    from asyncrl.gateway.engines import RayEngine
    from asyncrl.rollout.worker import WorkerLauncher
    from asyncrl.sched.supervision import RaySupervisor
    from asyncrl.sched.workers import RayWorkers

    class Routing:
        def __init__(self) -> None:
            self.events: list[tuple[str, str]] = []
            self.joined = asyncio.Event()

        def add_local(self, handle) -> None:
            self.events.append(("join", handle.engine_id))
            self.joined.set()

        def remove_local(self, engine_id: str, reason: str) -> None:
            self.events.append(("leave", engine_id))

    @ray.remote
    class DyingLearner:
        def state(self) -> dict:
            import os

            os._exit(1)

    params = SamplingParams(temperature=1.0, max_tokens=6, seed=9)

    async def scenario() -> None:
        config = EmbeddedRolloutConfig(num_workers=2, cpus_per_worker=0.5, max_num_seqs=4)
        workers = RayWorkers(WorkerLauncher(make_tiny_model("qwen3", eos_token_id=None), config), "w", 2)
        await workers.ready()
        weights = ray.put(make_tiny_model("qwen3", eos_token_id=None, seed=4).state_dict())
        assert await workers.push(weights, 3) == [3, 3]
        routing = Routing()
        supervisor = RaySupervisor(workers)
        supervisor.attach(routing)
        try:
            ray.kill(workers.members["w-0"])
            await asyncio.wait_for(routing.joined.wait(), timeout=240)  # a guard against a hang only
            assert routing.events == [("leave", "w-0"), ("join", "w-0-r1")]
            (replaced,) = supervisor.replaced()
            assert (replaced["engine_id"], replaced["replacement"], replaced["version"]) == ("w-0", "w-0-r1", 3)
            assert set(workers.members) == {"w-1", "w-0-r1"} and await workers.versions() == [3, 3]
            # The replacement samples exactly what the survivor does: the pushed weights, not its initial ones.
            new, old = await asyncio.gather(*(RayEngine(workers.members[i], i).generate([5, 6, 7], params, "s") for i in ("w-0-r1", "w-1")))
            assert new.token_ids == old.token_ids and new.logprobs == old.logprobs and new.versions == [3] * 6

            with pytest.raises(ray.exceptions.RayActorError):
                await workers.push(DyingLearner.remote().state.remote(), 4)
            assert supervisor.serving() == 2 and supervisor.replaced() == [] and await workers.versions() == [3, 3]
            assert await workers.push(weights, 5) == [5, 5]
            supervisor.check()
        finally:
            await supervisor.close()
            for actor in workers.actors:
                ray.kill(actor)

    asyncio.run(scenario())


def test_a_learner_that_cannot_start_says_why(ray_session):
    import asyncio

    from asyncrl.sched.learners import RayLearner
    from asyncrl.sched.parts import LearnerDied

    class Unstartable:  # defined here: Ray ships it by value (this test module is not importable in a worker)
        """Fails in its constructor, as a learner does when its checkpoint is not on its node's disk."""

        def __init__(self, checkpoint: str) -> None:
            raise FileNotFoundError(f"no checkpoint at {checkpoint} on this node")

        def version(self) -> int:
            return 0

    learner = RayLearner(lambda checkpoint: ray.remote(num_cpus=0)(Unstartable).remote(checkpoint), "/shared/ckpt")
    message = r"the learner actor died: ActorDiedError: FileNotFoundError: no checkpoint at /shared/ckpt on this node$"
    with pytest.raises(LearnerDied, match=message):
        asyncio.run(learner.check())
