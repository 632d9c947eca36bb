"""The CUDA paths, wherever a GPU is present (marker `gpu`; skipped on CPU machines): the learner on the GPU
takes the CPU learner's step, two FSDP learner ranks (NCCL) take the one-rank step, the embedded engine on
the GPU samples with transformers' log-probs, and `asyncrl run` trains with both on GPUs. scripts/gpu_smoke.sh
runs these on a lent GPU machine. The FSDP and run tests also run on the CPU (marker `slow`), so their set-up
is checked where no GPU is."""

from __future__ import annotations

import pytest
import torch

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_cuda
def test_the_learner_on_cuda_takes_the_cpu_learners_step():
    from test_learner_dp import batch, config

    from asyncrl.learner.rl import RLLearner

    cpu, gpu = RLLearner.from_config(config(1, device="cpu")), RLLearner.from_config(config(1, device="cuda"))
    assert gpu.device.type == "cuda"
    one, two = cpu.train_step(batch()), gpu.train_step(batch())
    assert two.loss == pytest.approx(one.loss, rel=1e-3)
    gap = max(
        float((a - b.cpu()).abs().max()) for a, b in zip(cpu.model.state_dict().values(), gpu.model.state_dict().values(), strict=True)
    )
    assert gap < 1e-4


@pytest.mark.gpu
@needs_cuda
def test_the_embedded_engine_on_cuda_matches_transformers():
    from conftest import run_to_completion
    from families import tiny_family_model
    from test_engine_numerics import PROMPTS, assert_matches_hf

    from asyncrl.configs.schema import EmbeddedRolloutConfig
    from asyncrl.records import SamplingParams
    from asyncrl.rollout import EmbeddedEngine

    for family in ("llama", "gpt2"):
        model = tiny_family_model(family)
        engine = EmbeddedEngine(model, EmbeddedRolloutConfig(max_num_seqs=4, device="cuda"))
        assert engine.device.type == "cuda"
        results = run_to_completion(engine, [(p, SamplingParams(temperature=1.0, max_tokens=8, seed=2)) for p in PROMPTS])
        assert_matches_hf(model, results)
        engine.shutdown()


def _fsdp_rank(rank: int, port: int, device: str, results) -> None:
    """One rank of `test_two_fsdp_ranks_take_the_one_rank_step_on_the_device`, in a process of its own."""
    import io
    import os

    import torch.distributed as dist
    from test_learner_dp import batch, config

    from asyncrl.learner.distributed import join_group
    from asyncrl.learner.rl import RLLearner

    if device == "cuda":  # two ranks on one GPU: NCCL allows it through its network transport, a host id each
        os.environ["NCCL_HOSTID"] = f"asyncrl-fsdp-rank{rank}"
    join_group(("127.0.0.1", port), rank, 2, torch.device(device))
    learner = RLLearner.from_config(config(2, "fsdp", device=device))
    step = learner.train_step(batch())
    learner.gather_weights()  # every rank: a collective
    if rank == 0:  # the weights as bytes: a queued tensor is shared through this process, which is about to exit
        weights = io.BytesIO()
        torch.save(learner.state_dict_for_push(), weights)
        results.put((step.loss, step.grad_norm, weights.getvalue(), learner.held_bytes()))
    dist.destroy_process_group()


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=[pytest.mark.gpu, needs_cuda]), pytest.param("cpu", marks=pytest.mark.slow)])
def test_two_fsdp_ranks_take_the_one_rank_step_on_the_device(device):
    """The sharded learner without Ray (the lent GPU machine has none): two torch processes form the group
    (NCCL on one GPU, gloo on the CPU) and take the step one learner takes."""
    import io
    import socket

    import torch.multiprocessing as mp
    from test_learner_dp import batch, config

    from asyncrl.learner.rl import RLLearner

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = mp.get_context("spawn")
    results = context.Queue()
    ranks = [context.Process(target=_fsdp_rank, args=(rank, port, device, results)) for rank in range(2)]
    for process in ranks:
        process.start()
    alone = RLLearner.from_config(config(1, device=device))
    one = alone.train_step(batch())
    loss, grad_norm, saved, held = results.get(timeout=600)
    weights = torch.load(io.BytesIO(saved), weights_only=True)
    for process in ranks:
        process.join(timeout=60)
    assert [process.exitcode for process in ranks] == [0, 0]
    assert loss == pytest.approx(one.loss, rel=1e-5) and grad_norm == pytest.approx(one.grad_norm, rel=1e-4)
    expected = alone.state_dict_for_push()
    assert weights.keys() == expected.keys()
    assert max(float((weights[n] - expected[n]).abs().max()) for n in expected) < (1e-5 if device == "cpu" else 1e-4)
    assert 0.45 < held / alone.held_bytes() < 0.55  # rank 0 holds about half the weights and moments


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=[pytest.mark.gpu, needs_cuda]), pytest.param("cpu", marks=pytest.mark.slow)])
def test_asyncrl_run_with_learner_and_engine_on_the_device(tmp_path, device):
    import json

    pytest.importorskip("ray", reason="a machine without Ray (the lent GPU machine: scripts/gpu_smoke.sh --offline)")
    pytest.importorskip("fastapi", reason="a machine without the gateway's dependencies")

    from loop_helpers import TINY

    from asyncrl.cli import main

    # EchoEnv: a task whose groups a random tiny policy tells apart, so the loop has advantages to step on.
    overrides = [*TINY, f"runs_dir={tmp_path}", "name=gpu", "loop.mode=sync", "loop.steps=3", "loop.eval_every=1000", "eval.num_problems=4",
                 'tasks.mix={echo: {env: "replay_envs:EchoEnv"}}', f"learner.device={device}", f"rollout.device={device}"]  # fmt: skip
    if device == "cuda" and torch.cuda.device_count() < 2:  # each asks for a whole GPU by default; on one, they share it by asking
        overrides += ["learner.gpus_per_rank=0.5", "rollout.gpus_per_worker=0.5"]
    assert main(["run", "quickstart", *overrides]) == 0
    summary = json.loads((tmp_path / "gpu" / "summary.json").read_text())
    assert summary["balanced"] and summary["version"] == 3
    assert summary["engine_versions"] == [3]
    # weight_transport auto: CUDA IPC where the learner and the engine share the one GPU
    expected = "object_store" if device == "cpu" else "cuda_ipc" if torch.cuda.device_count() < 2 else "broadcast"
    assert summary["weight_transport"] == expected


@pytest.mark.gpu
@needs_cuda
def test_a_cuda_ipc_push_serves_what_the_object_store_serves(ray_session):
    """The learner and two engines on one GPU: one engine takes the push through CUDA IPC handles, the
    other through the object store, and both then sample the same tokens with the same log-probs."""
    import asyncio

    import ray
    from conftest import SMALL_SHAPE, load_from_object_store

    from asyncrl.configs.schema import EmbeddedRolloutConfig, LearnerConfig, MTPConfig, PolicyConfig, RunConfig, TinyModelConfig
    from asyncrl.learner.actor import create_learner
    from asyncrl.policy.checkpoint import build_policy
    from asyncrl.records import Batch, SamplingParams
    from asyncrl.rollout.worker import WorkerLauncher, create_workers
    from asyncrl.sched.weight_push import DirectPush, direct_transport
    from asyncrl.sched.workers import RayWorkers

    rollout = EmbeddedRolloutConfig(num_workers=1, cpus_per_worker=0.25, gpus_per_worker=0.3, device="cuda", max_num_seqs=4)
    config = RunConfig(
        policy=PolicyConfig(tiny=TinyModelConfig(arch="qwen3", **SMALL_SHAPE), mtp=MTPConfig(enabled=False)),
        rollout=rollout, learner=LearnerConfig(group_size=2, lr=5e-2, num_cpus=0.25, device="cuda", gpus_per_rank=0.3),
    )  # fmt: skip
    model, _, _ = build_policy(config.policy, config.seed)
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=3)
    prompt = [5, 6, 7]

    async def scenario() -> None:
        from test_learner_actor import to_sample

        learner = create_learner(config)
        workers = RayWorkers(WorkerLauncher(model, rollout), "ipc", 1)
        witness = create_workers(model, rollout, name_prefix="witness")
        await workers.ready()
        assert await direct_transport("auto", learner, workers.actors) == ("cuda_ipc", None)
        results = [ray.get(witness[0].generate.remote(prompt, SamplingParams(temperature=1.0, max_tokens=8, seed=s))) for s in (1, 2)]
        step = ray.get(learner.train_step.remote(Batch([[to_sample(results[0], "a", 1.0), to_sample(results[1], "b", 0.0)]])))
        version = step.version
        assert await workers.push(DirectPush(learner, "cuda_ipc"), version) == [version]
        load_from_object_store(witness, learner, version)
        served = [ray.get(w.generate.remote(prompt, params)) for w in [*workers.actors, *witness]]
        assert all(r.versions == [version] * len(r.token_ids) for r in served)
        assert served[0].token_ids == served[1].token_ids and served[0].logprobs == served[1].logprobs
        for actor in [*workers.actors, *witness, learner]:
            ray.kill(actor)

    asyncio.run(scenario())
