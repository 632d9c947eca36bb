"""The learner as a Ray actor: it trains on what real rollout workers sampled, and its weights,
pushed through the object store, are what those workers sample with next."""

from __future__ import annotations

import pytest
import torch
from conftest import SMALL_SHAPE

from asyncrl.configs.schema import EmbeddedRolloutConfig, LearnerConfig, MTPConfig, PolicyConfig, RunConfig, TinyModelConfig
from asyncrl.policy.checkpoint import build_policy
from asyncrl.records import UNSAMPLED_VERSION, Batch, Sample, SamplingParams, due_after_step

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.slow  # one Ray start (~4 s) plus three actor processes importing torch

PROMPT = [5, 6, 7]


def to_sample(result, rollout: str, reward: float) -> Sample:
    n = len(result.token_ids)
    return Sample(
        token_ids=PROMPT + result.token_ids, loss_mask=[0] * len(PROMPT) + [1] * n,
        logprobs=[0.0] * len(PROMPT) + result.logprobs, versions=[UNSAMPLED_VERSION] * len(PROMPT) + result.versions,
        reward=reward, group_id="g", rollout_id=rollout, status="ok",
    )  # fmt: skip


def test_learner_actor_trains_and_pushes_to_rollout_workers(ray_session):
    from asyncrl.learner.actor import create_learner
    from asyncrl.rollout.worker import create_workers

    config = RunConfig(
        policy=PolicyConfig(tiny=TinyModelConfig(arch="qwen3", **SMALL_SHAPE), mtp=MTPConfig(enabled=False)),
        rollout=EmbeddedRolloutConfig(num_workers=2, cpus_per_worker=0.5, max_num_seqs=4),
        learner=LearnerConfig(group_size=2, lr=1e-2, num_cpus=0.5),
    )  # fmt: skip
    model, _, _ = build_policy(config.policy, config.seed)  # the learner builds the same weights
    workers = create_workers(model, config.rollout)
    learner = create_learner(config)

    params = [SamplingParams(temperature=1.0, max_tokens=5, seed=s) for s in (1, 2)]
    first = ray.get([w.generate.remote(PROMPT, p) for w, p in zip(workers, params, strict=True)])
    assert all(r.versions == [0] * len(r.token_ids) for r in first)
    step = ray.get(learner.train_step.remote(Batch([[to_sample(first[0], "a", 1.0), to_sample(first[1], "b", 0.0)]])))
    due = due_after_step(0, step.version, push_every=config.learner.push_every, checkpoint_every=config.learner.checkpoint_every)
    assert step.version == 1 and due.push and step.ledger["trained"] == 2
    # The engine's log-probs are the learner's own: every ratio 1, nothing masked.
    assert step.metrics["masked_token_frac"] == 0.0 and step.metrics["abs_logp_diff"] < 1e-4

    weights = learner.state.remote()  # one ObjectRef every worker loads
    assert ray.get([w.load_weights.remote(weights, step.version) for w in workers]) == [1, 1]
    after = ray.get([w.generate.remote(PROMPT, p) for w, p in zip(workers, params, strict=True)])
    assert all(r.versions == [1] * len(r.token_ids) for r in after)

    # What the workers now sample with are the learner's new weights, not the old ones.
    model.load_state_dict(ray.get(learner.state.remote()))
    for result in after:
        ids = torch.tensor([PROMPT + result.token_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0, len(PROMPT) - 1 : -1], dim=-1)
        expected = logp.gather(-1, ids[0, len(PROMPT) :, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(result.logprobs), expected, atol=1e-4, rtol=1e-4)
    assert ray.get(learner.version.remote()) == 1
    for actor in [*workers, learner]:
        ray.kill(actor)
