"""The data-parallel learner (learner/distributed.py): two Ray actors in a gloo group take the step one
learner takes on the same batch, and a checkpoint written by two ranks resumes under one."""

from __future__ import annotations

import random
from typing import Any

import pytest
from conftest import SMALL_SHAPE

from asyncrl.configs.schema import LearnerConfig, MTPConfig, OptimizerConfig, PolicyConfig, RunConfig, TinyModelConfig
from asyncrl.learner.batch import Row
from asyncrl.learner.distributed import shard_rows
from asyncrl.records import UNSAMPLED_VERSION, Batch, Sample

pytestmark = pytest.mark.slow  # a Ray start plus five learner processes importing torch


def config(
    ranks: int, sharding: str = "auto", *, tiny: TinyModelConfig | None = None, mtp: MTPConfig | None = None, **learner: Any
) -> RunConfig:
    """The tiny Qwen3 of SMALL_SHAPE without an MTP layer (or `tiny`, `mtp`), and a learner of `ranks` ranks
    (`learner`: other LearnerConfig fields)."""
    # The default lr, 1e-4; a quarter CPU each, so that three learners (five processes) fit the 2-CPU Ray.
    fields = {"group_size": 4, "num_cpus": 0.25, "micro_batch_tokens": 64, "num_ranks": ranks, "sharding": sharding, **learner}
    policy = PolicyConfig(tiny=tiny or TinyModelConfig(arch="qwen3", **SMALL_SHAPE), mtp=mtp or MTPConfig(enabled=False))
    return RunConfig(policy=policy, learner=LearnerConfig(**fields))


def batch() -> Batch:
    """Three groups of four with spread rewards and ragged lengths (rollout log-probs near the policy's)."""
    rng = random.Random(0)
    groups: list[list[Sample]] = []
    for group in range(3):
        groups.append([])
        for member in range(4):
            prompt, reply = [rng.randrange(3, 60) for _ in range(4)], [rng.randrange(3, 60) for _ in range(rng.randrange(3, 12))]
            groups[-1].append(Sample(
                token_ids=prompt + reply, loss_mask=[0] * len(prompt) + [1] * len(reply),
                logprobs=[0.0] * len(prompt) + [-4.0] * len(reply), versions=[UNSAMPLED_VERSION] * len(prompt) + [0] * len(reply),
                reward=float(member % 2 + group), group_id=f"g{group}", rollout_id=f"r{group}-{member}", status="ok", task="t",
            ))  # fmt: skip
    return Batch(groups)


def gap(a: dict, b: dict, prefix: str = "") -> float:
    """The largest |a - b| over the tensors of `a` whose names start with `prefix`."""
    return max(float((a[name].float() - b[name].float()).abs().max()) for name in a if name.startswith(prefix))


def resume_under_one_rank(sharded: Any, run: RunConfig, directory: str, weights: dict) -> Any:
    """A checkpoint of `sharded`, resumed by a one-rank learner of `run`, which then holds exactly `weights`."""
    import ray
    import torch

    from asyncrl.learner.actor import create_learner

    ray.get(sharded.save.remote(directory))
    resumed = create_learner(run, resume_from=directory)
    assert all(torch.equal(t, weights[name]) for name, t in ray.get(resumed.state.remote()).items())
    return resumed


def test_rows_are_split_by_tokens_deterministically_in_their_order():
    rows = [Row(token_ids=[0] * n, loss_mask=[], logprobs=[], advantage=1.0, temperatures=[]) for n in (9, 2, 7, 3, 3, 8)]
    shares = [shard_rows(rows, rank, 2) for rank in range(2)]
    # Longest first to the lighter rank: 9->0, 8->1, 7->1, 3->0, 3->0, 2->0 (a tie at 15 goes to rank 0); original order kept.
    assert [len(r.token_ids) for r in shares[0]] == [9, 2, 3, 3] and [len(r.token_ids) for r in shares[1]] == [7, 8]
    assert sorted(map(id, shares[0] + shares[1])) == sorted(map(id, rows))
    assert shard_rows(rows, 0, 1) == rows and shard_rows(rows, 0, 2) == shares[0]


@pytest.mark.parametrize("sharding", ["replicate", "fsdp"])
def test_two_ranks_take_the_one_rank_step_and_resume_under_one(ray_session, tmp_path, sharding):
    import ray
    import torch

    from asyncrl.learner.actor import create_learner

    same = batch()  # every learner is handed the same batch
    alone = create_learner(config(1))
    before = ray.get(alone.state.remote())
    one = ray.get(alone.train_step.remote(same))
    grouped = create_learner(config(2, sharding))
    two = ray.get(grouped.train_step.remote(same))
    assert one.stepped and two.stepped and one.version == two.version == 1
    # Each rank computed a share: the micro-batches of both add up; the step's figures are the whole batch's.
    assert two.metrics["micro_batches"] > one.metrics["micro_batches"] // 2
    assert two.metrics["computed_tokens"] == one.metrics["computed_tokens"]
    assert two.loss == pytest.approx(one.loss, rel=1e-6, abs=1e-9)
    assert two.grad_norm == pytest.approx(one.grad_norm, rel=1e-5)
    for key in ("ratio_mean", "logprob_gap_mean", "masked_token_frac"):
        assert two.metrics[key] == pytest.approx(one.metrics[key], rel=1e-6, abs=1e-9), key
    weights_one, weights_two = ray.get([alone.state.remote(), grouped.state.remote()])
    assert gap(weights_one, weights_two) < 1e-5 and gap(weights_one, before) > 100 * gap(weights_one, weights_two)
    # Replicated, each rank holds the whole weights and AdamW moments; sharded, about half of them.
    whole = ray.get(alone.usage.remote())["held_bytes"][0]
    held = ray.get(grouped.usage.remote())["held_bytes"]
    if sharding == "fsdp":
        assert len(held) == 2 and all(0.45 * whole < h < 0.55 * whole for h in held), (held, whole)
    else:
        assert held == [whole, whole]
    ray.kill(alone)  # its CPUs are the next learners'

    # Written by two ranks, resumed by one: the same weights, version and optimizer moments.
    ray.get(grouped.save.remote(str(tmp_path / "ckpt")))
    resumed = create_learner(config(1), resume_from=str(tmp_path / "ckpt"))
    assert ray.get(resumed.version.remote()) == 1
    weights_resumed = ray.get(resumed.state.remote())
    assert all(torch.equal(weights_resumed[name], weights_two[name]) for name in weights_two)
    # Written by one, resumed by two: the same again (for FSDP, each rank takes its shards of the whole state).
    ray.get(resumed.save.remote(str(tmp_path / "ckpt-one")))
    regrouped = create_learner(config(2, sharding), resume_from=str(tmp_path / "ckpt-one"))
    assert ray.get(regrouped.version.remote()) == 1
    assert all(torch.equal(t, weights_two[name]) for name, t in ray.get(regrouped.state.remote()).items())
    # All three take the same next step from there: the optimizer moments came back too.
    after = ray.get([learner.train_step.remote(same) for learner in (grouped, resumed, regrouped)])
    assert all(a.version == 2 for a in after)
    assert after[0].loss == pytest.approx(after[1].loss, rel=1e-5) == after[2].loss
    assert after[0].grad_norm == pytest.approx(after[1].grad_norm, rel=1e-5) == after[2].grad_norm
    stepped = ray.get([learner.state.remote() for learner in (grouped, resumed, regrouped)])
    assert max(gap(stepped[0], stepped[k]) for k in (1, 2)) < 1e-5
    # Every rank reads the driver's run-directory check back, or says which rank on which node did not.
    (tmp_path / "check").write_text("token")
    assert ray.get(grouped.reads.remote(str(tmp_path / "check"), "token")) == []
    unseen = ray.get(grouped.reads.remote(str(tmp_path / "check"), "another"))
    assert [entry.split(" (node ")[0] for entry in unseen] == ["learner rank 0", "learner rank 1"]
    for actor in (grouped, resumed, regrouped):
        ray.kill(actor)


def test_fsdp_ranks_with_unequal_micro_batch_counts_and_checkpointing_take_the_one_rank_step(ray_session):
    import ray

    from asyncrl.learner.actor import create_learner
    from asyncrl.learner.batch import micro_batches, to_rows
    from asyncrl.learner.selection import select
    from asyncrl.learner.shaping import advantages_for

    # One long rollout and seven short ones: the long one fills rank 0 alone; rank 1's short ones, two to a
    # micro-batch, make more micro-batches than rank 0 has, so rank 0 runs empty passes to match.
    groups: list[list[Sample]] = [[], []]
    for i in range(8):
        reply = 56 if i == 0 else 6
        groups[i // 4].append(Sample(
            token_ids=[5 + i] * (4 + reply), loss_mask=[0] * 4 + [1] * reply, logprobs=[0.0] * 4 + [-4.0] * reply,
            versions=[UNSAMPLED_VERSION] * 4 + [0] * reply, reward=float(i % 2), group_id=f"g{i // 4}", rollout_id=f"r{i}",
            status="ok", task="t",
        ))  # fmt: skip
    uneven = Batch(groups)
    selection = select(uneven.groups, current_version=0, max_staleness=4, group_size=4, crash_statuses=["env_crash"])
    rows = to_rows(selection.batch, advantages_for(selection, True))
    counts = [len(micro_batches(shard_rows(rows, rank, 2), 0, 20)) for rank in range(2)]
    assert counts[0] < counts[1], counts

    alone = create_learner(config(1, micro_batch_tokens=20))
    # Sharded with activation checkpointing and the head run 4 positions at a time too: a checkpointed layer, and
    # each checkpointed chunk of the head, gathers its shards again for the recompute.
    sharded = create_learner(config(2, "fsdp", micro_batch_tokens=20, gradient_checkpointing=True, logits_chunk_tokens=4))
    one, two = ray.get([alone.train_step.remote(uneven), sharded.train_step.remote(uneven)])
    assert two.metrics["micro_batches"] == sum(counts)  # the empty passes are no micro-batches of the step
    assert two.loss == pytest.approx(one.loss, rel=1e-6) and two.grad_norm == pytest.approx(one.grad_norm, rel=1e-5)
    weights_one, weights_two = ray.get([alone.state.remote(), sharded.state.remote()])
    assert gap(weights_one, weights_two) < 1e-5
    for actor in (alone, sharded):
        ray.kill(actor)


def test_fsdp_takes_the_one_rank_step_on_the_moe_policy_with_its_frozen_indexer(ray_session):
    """The tiny GLM-5 shape: MoE experts (some get no token), the DSA indexer frozen (learner.freeze_indexer)."""
    import ray

    from asyncrl.learner.actor import create_learner

    def run(ranks: int, sharding: str) -> RunConfig:
        return config(ranks, sharding, tiny=TinyModelConfig(arch="glm_moe_dsa"))

    alone, sharded = create_learner(run(1, "replicate")), create_learner(run(2, "fsdp"))
    one, two = ray.get([alone.train_step.remote(batch()), sharded.train_step.remote(batch())])
    assert two.loss == pytest.approx(one.loss, rel=1e-6) and two.grad_norm == pytest.approx(one.grad_norm, rel=1e-5)
    weights_one, weights_two = ray.get([alone.state.remote(), sharded.state.remote()])
    assert weights_one.keys() == weights_two.keys()
    assert gap(weights_one, weights_two) < 1e-5
    for actor in (alone, sharded):
        ray.kill(actor)


def test_fsdp_trains_the_mtp_layer_as_one_rank_does_and_checkpoints_it(ray_session, tmp_path):
    """The MTP layer shares the policy's embedding and head: sharded, its loss is computed inside the root's
    forward, where they are whole; pushed under "mtp.*" and written beside the policy as one rank does."""
    import ray

    from asyncrl.learner.actor import create_learner

    def run(ranks: int, sharding: str) -> RunConfig:
        return config(ranks, sharding, mtp=MTPConfig(train_depth=2), mtp_loss_weight=0.3)

    alone, sharded = create_learner(run(1, "replicate")), create_learner(run(2, "fsdp"))
    before = ray.get(alone.state.remote())
    one, two = ray.get([alone.train_step.remote(batch()), sharded.train_step.remote(batch())])
    assert one.metrics["mtp_loss"] > 0 and two.metrics["mtp_loss"] == pytest.approx(one.metrics["mtp_loss"], rel=1e-6)
    assert two.loss == pytest.approx(one.loss, rel=1e-6) and two.grad_norm == pytest.approx(one.grad_norm, rel=1e-5)
    weights_one, weights_two = ray.get([alone.state.remote(), sharded.state.remote()])
    assert weights_one.keys() == weights_two.keys() and any(name.startswith("mtp.") for name in weights_one)
    assert gap(weights_one, weights_two) < 1e-5 and gap(weights_one, before, "mtp.") > 1e-5  # it trained

    ray.kill(alone)
    resumed = resume_under_one_rank(sharded, run(1, "replicate"), str(tmp_path / "ckpt"), weights_two)
    after = ray.get([sharded.train_step.remote(batch()), resumed.train_step.remote(batch())])
    assert after[0].metrics["mtp_loss"] == pytest.approx(after[1].metrics["mtp_loss"], rel=1e-5)
    assert after[0].loss == pytest.approx(after[1].loss, rel=1e-5)
    for actor in (sharded, resumed):
        ray.kill(actor)


def test_a_sharded_checkpoint_of_fresh_moments_leaves_them_fresh(ray_session, tmp_path):
    """Before the first step (or after `reset_optimizer_on_push`) AdamW has no state. torch's full optimizer state
    dict would make one by stepping with zero gradients, moving AdamW's step count and so its bias correction:
    saving must not touch the live optimizer, and loading must not either."""
    import ray

    from asyncrl.learner.actor import create_learner

    alone, sharded = create_learner(config(1, lr=1e-3)), create_learner(config(2, "fsdp", lr=1e-3))
    ray.get(sharded.save.remote(str(tmp_path / "fresh")))
    resumed = create_learner(config(2, "fsdp", lr=1e-3), resume_from=str(tmp_path / "fresh"))
    ray.get([learner.train_step.remote(batch()) for learner in (alone, sharded, resumed)])
    weights = ray.get([learner.state.remote() for learner in (alone, sharded, resumed)])
    assert max(gap(weights[0], weights[k]) for k in (1, 2)) < 1e-5  # 2.6e-4 when the save stepped
    for actor in (alone, sharded, resumed):
        ray.kill(actor)


@pytest.mark.parametrize("optimizer", ["muon", "muon_split"])
def test_fsdp_takes_the_one_rank_muon_step_and_checkpoints_its_momentum(ray_session, tmp_path, optimizer):
    """Muon orthogonalizes whole matrices (per head under muon_split): sharded, each rank gathers them."""
    import ray

    from asyncrl.learner.actor import create_learner

    def run(ranks: int, sharding: str) -> RunConfig:
        return config(ranks, sharding, lr=1e-3, optimizer=OptimizerConfig(type=optimizer))

    alone, sharded = create_learner(run(1, "replicate")), create_learner(run(2, "fsdp"))
    before = ray.get(alone.state.remote())
    one, two = ray.get([alone.train_step.remote(batch()), sharded.train_step.remote(batch())])
    assert two.loss == pytest.approx(one.loss, rel=1e-6) and two.grad_norm == pytest.approx(one.grad_norm, rel=1e-5)
    weights_one, weights_two = ray.get([alone.state.remote(), sharded.state.remote()])
    assert gap(weights_one, weights_two) < 1e-5 and gap(weights_one, before) > 100 * gap(weights_one, weights_two)

    # Sharded checkpoint, one-rank resume: the momentum buffers came back, so the next steps agree.
    ray.kill(alone)
    resumed = resume_under_one_rank(sharded, run(1, "replicate"), str(tmp_path / "ckpt"), weights_two)
    after = ray.get([sharded.train_step.remote(batch()), resumed.train_step.remote(batch())])
    assert after[0].loss == pytest.approx(after[1].loss, rel=1e-5)
    stepped = ray.get([sharded.state.remote(), resumed.state.remote()])
    assert gap(stepped[0], stepped[1]) < 1e-5
    for actor in (sharded, resumed):
        ray.kill(actor)


@pytest.mark.parametrize(
    ("sharding", "policy"),
    [("replicate", []), ("fsdp", ["policy.mtp.enabled=true", "learner.mtp_loss_weight=0.3"])],  # sharded: a trained MTP layer pushed
    ids=["replicate", "fsdp-mtp"],
)
def test_asyncrl_run_with_two_learner_ranks_then_resumed_with_one(tmp_path, sharding, policy):
    import json

    from loop_helpers import TINY

    from asyncrl.cli import main
    from asyncrl.sched.rundir import RunDir

    common = [*TINY, f"runs_dir={tmp_path}", "name=dp", "loop.mode=sync", "loop.eval_every=1000", "eval.num_problems=4",
              'tasks.mix={echo: {env: "replay_envs:EchoEnv"}}']  # fmt: skip
    common += policy
    assert main(["run", "quickstart", *common, "learner.num_ranks=2", f"learner.sharding={sharding}", "loop.steps=2"]) == 0
    run_dir = RunDir(tmp_path / "dp")
    assert run_dir.latest_checkpoint() is not None
    assert main(["run", "--resume", str(run_dir.path), "learner.num_ranks=1", "loop.steps=4"]) == 0
    summary = json.loads((run_dir.path / "summary.json").read_text())
    assert summary["balanced"] and summary["version"] == 4


def test_more_ranks_or_gpus_than_the_cluster_has_are_refused_before_any_actor_starts(ray_session):
    from asyncrl.configs import ConfigError, load_config
    from asyncrl.jobs.cluster import start_ray

    # The module's Ray has 2 CPUs and no GPU.
    with pytest.raises(ConfigError, match=r"need 5 CPUs \(rollout.num_workers x rollout.cpus_per_worker \+ learner.num_ranks x .*has 2"):
        start_ray(load_config("quickstart", ["learner.num_ranks=4", "learner.num_cpus=1", "rollout.cpus_per_worker=1"]))
    with pytest.raises(ConfigError, match=r"need 2 GPUs .*the Ray cluster has 0"):
        start_ray(
            load_config("quickstart", ["learner.device=cuda", "learner.num_ranks=2", "learner.num_cpus=0.5", "rollout.cpus_per_worker=0.5"])
        )
    assert start_ray(load_config("quickstart", ["learner.num_cpus=0.5", "rollout.cpus_per_worker=0.5"])) is False  # fits: the caller's Ray


def test_a_cuda_learner_without_a_gpu_is_refused_naming_the_key():
    import torch

    from asyncrl.configs import load_config
    from asyncrl.learner.rl import learner_device

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ValueError, match=r"learner.device=cuda: the learner's process sees no CUDA device"):
        learner_device(load_config("quickstart", ["learner.device=cuda"]))
    assert learner_device(load_config("quickstart", [])).type == "cpu"


def test_bad_samples_fail_a_data_parallel_step_as_they_fail_one_learner(ray_session):
    import ray

    from asyncrl.learner.actor import create_learner

    grouped = create_learner(config(2))
    bad = batch()
    first = bad.groups[0][0]
    bad.groups[0][0] = first.__class__(**{**vars(first), "loss_mask": first.loss_mask[:-1]})  # one mask entry short
    with pytest.raises(ray.exceptions.RayTaskError, match="loss_mask"):
        ray.get(grouped.train_step.remote(bad))
    # The group is intact: the next step takes place on every rank.
    assert ray.get(grouped.train_step.remote(batch())).stepped
    ray.kill(grouped)
