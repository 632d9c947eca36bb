"""The broadcast push (`asyncrl/weight_transfer.py`, `sched/weight_push.py`): the bucket layout, the choice
of transport, and a real gloo group of a LearnerActor and RolloutWorkers, which must end up serving exactly
what the object-store path serves, survive an engine's death, and start a replacement."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch
from conftest import SMALL_SHAPE, load_from_object_store

from asyncrl.configs.schema import EmbeddedRolloutConfig, LearnerConfig, MTPConfig, PolicyConfig, RunConfig, TinyModelConfig
from asyncrl.records import Batch, SamplingParams
from asyncrl.weight_transfer import ALIGN, Layout, pack, resolve_transport, unpack


def test_a_layout_packs_every_dtype_into_aligned_buckets_and_unpacks_the_same_tensors():
    tensors = {
        "embed": torch.randn(7, 5, dtype=torch.bfloat16),
        "norm": torch.randn(3),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "mask": torch.tensor([True, False, True]),
        "ids": torch.arange(11),
        "big": torch.randn(40),  # 160 bytes: over the bucket limit, so alone in its bucket
        "transposed": torch.randn(4, 6).t(),  # not contiguous
    }
    layout = Layout.plan(tensors.items(), bucket_bytes=128)
    assert len(layout.bucket_sizes) > 2 and all(slot.offset % ALIGN == 0 for slot in layout.slots)
    assert [slot.name for slot in layout.in_bucket(layout.slots[5].bucket)] == ["big"]
    assert layout.total_bytes == sum(t.numel() * t.element_size() for t in tensors.values())
    received: dict[str, torch.Tensor] = {}
    for bucket in range(len(layout.bucket_sizes)):
        buffer = pack(layout, bucket, tensors, torch.device("cpu"))
        received.update(unpack(layout, bucket, buffer.clone()))
    assert received.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert received[name].dtype == tensor.dtype and torch.equal(received[name], tensor), name


def test_pack_refuses_a_tensor_that_no_longer_matches_the_layout():
    layout = Layout.plan([("w", torch.zeros(4))])
    with pytest.raises(ValueError, match=r"weight w is torch.float32 \(5,\)"):
        pack(layout, 0, {"w": torch.zeros(5)}, torch.device("cpu"))


CPU = {"type": "cpu", "uuid": None}


def gpu(uuid: str) -> dict:
    return {"type": "cuda", "uuid": uuid}


@pytest.mark.parametrize(
    ("wanted", "learner", "engines", "chosen"),
    [
        ("auto", CPU, [CPU, CPU], ("object_store", None)),
        ("auto", gpu("a"), [gpu("b"), gpu("c")], ("broadcast", "nccl")),
        ("auto", gpu("a"), [gpu("a"), gpu("a")], ("cuda_ipc", None)),  # every engine on the learner's GPU
        ("auto", gpu("a"), [gpu("a"), gpu("b")], ("object_store", None)),  # some share it: NCCL cannot, IPC cannot reach b
        ("cuda_ipc", gpu("a"), [gpu("a")], ("cuda_ipc", None)),
        ("auto", gpu("a"), [CPU], ("object_store", None)),
        ("broadcast", CPU, [CPU], ("broadcast", "gloo")),
        ("broadcast", gpu("a"), [CPU], ("broadcast", "gloo")),
        ("object_store", gpu("a"), [gpu("b")], ("object_store", None)),
    ],
)
def test_the_transport_follows_the_devices(wanted, learner, engines, chosen):
    assert resolve_transport(wanted, learner, engines) == chosen


def test_broadcast_is_refused_where_two_ranks_share_a_gpu_and_cuda_ipc_where_an_engine_does_not():
    with pytest.raises(ValueError, match=r"rollout\.weight_transport=broadcast: the learner and an engine"):
        resolve_transport("broadcast", gpu("a"), [gpu("b"), gpu("a")])
    with pytest.raises(ValueError, match=r"rollout\.weight_transport=cuda_ipc: every engine must be on the learner's GPU"):
        resolve_transport("cuda_ipc", gpu("a"), [gpu("a"), gpu("b")])
    with pytest.raises(ValueError, match=r"rollout\.weight_transport=cuda_ipc"):
        resolve_transport("cuda_ipc", CPU, [CPU])


@pytest.mark.slow  # one Ray start plus four actor processes importing torch
def test_a_gloo_broadcast_serves_what_the_object_store_serves_and_survives_a_dead_engine(ray_session):
    import ray

    from asyncrl.learner.actor import create_learner
    from asyncrl.policy.checkpoint import build_policy
    from asyncrl.rollout.worker import WorkerLauncher, create_workers
    from asyncrl.sched.supervision import RaySupervisor
    from asyncrl.sched.weight_push import DirectPush, direct_transport
    from asyncrl.sched.workers import RayWorkers

    config = RunConfig(
        policy=PolicyConfig(tiny=TinyModelConfig(arch="qwen3", **SMALL_SHAPE), mtp=MTPConfig(enabled=False)),
        rollout=EmbeddedRolloutConfig(num_workers=2, cpus_per_worker=0.25, max_num_seqs=4, weight_transport="broadcast"),
        learner=LearnerConfig(group_size=2, lr=5e-2, num_cpus=0.25),
    )  # fmt: skip
    model, _, _ = build_policy(config.policy, config.seed)
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=3)
    prompt = [5, 6, 7]

    class Routing:
        def __init__(self) -> None:
            self.joined: asyncio.Queue[str] = asyncio.Queue()

        def add_local(self, handle) -> None:
            self.joined.put_nowait(handle.engine_id)

        def remove_local(self, engine_id: str, reason: str) -> None:
            pass

    async def step(learner) -> int:
        from test_learner_actor import to_sample

        results = [ray.get(witnesses[0].generate.remote(prompt, dataclasses.replace(params, seed=s))) for s in (1, 2)]
        batch = Batch([[to_sample(results[0], "a", 1.0), to_sample(results[1], "b", 0.0)]])
        result = await asyncio.wrap_future(learner.train_step.remote(batch).future())
        return result.version

    async def scenario() -> None:
        learner = create_learner(config)
        workers = RayWorkers(WorkerLauncher(model, config.rollout), "b", 2)
        await workers.ready()
        assert await direct_transport("auto", learner, workers.actors) is None  # all on CPU
        transport, backend = await direct_transport("broadcast", learner, workers.actors)
        assert (transport, backend) == ("broadcast", "gloo")

        version = await step(learner)
        assert await workers.push(DirectPush(learner, transport, backend), version) == [version, version]
        load_from_object_store(witnesses, learner, version)  # the object-store path, for comparison
        served = [ray.get(w.generate.remote(prompt, params)) for w in [*workers.actors, *witnesses]]
        assert all(r.versions == [version] * len(r.token_ids) for r in served)
        assert all(r.token_ids == served[-1].token_ids and r.logprobs == served[-1].logprobs for r in served)
        first_group = workers.pusher.generation

        routing = Routing()
        supervisor = RaySupervisor(workers)
        supervisor.attach(routing)
        ray.kill(workers.actors[0])
        replacement = await asyncio.wait_for(routing.joined.get(), timeout=300)
        assert replacement.startswith("b-0-r")
        # It started from the learner's weights through the object store, at their version.
        assert await workers.versions() == [version, version]

        version = await step(learner)
        assert await workers.push(DirectPush(learner, transport, backend), version) == [version, version]
        assert workers.pusher.generation == first_group + 1  # a new group, with the replacement in it
        load_from_object_store(witnesses, learner, version)
        served = [ray.get(w.generate.remote(prompt, params)) for w in [*workers.actors, *witnesses]]
        assert all(r.token_ids == served[-1].token_ids and r.logprobs == served[-1].logprobs for r in served)

        # An engine that died just before a push is left out of it (its watcher replaces it meanwhile, and
        # the replacement may or may not have joined by the time of the push).
        ray.kill(workers.actors[0])
        version = await step(learner)
        versions = await workers.push(DirectPush(learner, transport, backend), version)
        assert versions in ([version], [version, version])
        await supervisor.close()
        for actor in [*workers.actors, learner]:
            ray.kill(actor)

    witnesses = create_workers(model, config.rollout.model_copy(update={"num_workers": 1}), name_prefix="witness")
    asyncio.run(scenario())
