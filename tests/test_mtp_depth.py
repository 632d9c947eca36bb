"""The MTP layer unrolled to several depths with per-depth weights (L_MTP = sum_k lambda_k CE_k): the loss
against a hand computation, its config, and SFT and RL steps at depth 3."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_model

from asyncrl.configs.loader import ConfigError, load_config
from asyncrl.configs.schema import LearnerConfig, MTPConfig, RunConfig, TinyModelConfig
from asyncrl.jobs.sft import demo_stream
from asyncrl.learner.rl import RLLearner
from asyncrl.learner.sft import train_step
from asyncrl.policy.checkpoint import build_policy
from asyncrl.policy.mtp import build_mtp, combine_depths, mtp_logits, mtp_loss, policy_hidden_and_logits
from asyncrl.policy.tokenizer import build_tokenizer
from asyncrl.records import UNSAMPLED_VERSION, Batch, Sample

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # losses compared to 1e-5, on one thread

SMALL = dict(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, moe_intermediate_size=16)
WEIGHTS = [0.5, 0.3, 0.2]


def hand_weighted_loss(model, mtp, rows: list[tuple[list[int], list[int]]], weights: list[float], num_tokens: float | None = None):
    """sum_k lambda_k CE_k from `mtp_logits`, one unpadded row at a time, reading the targets by index:
    depth k's logits at position i predict token i+k+1. CE_k is a token mean over the rows (or a sum
    over `num_tokens`, the count the training step divides every depth by)."""
    sums, counts = [0.0] * len(weights), [0] * len(weights)
    for token_ids, loss_mask in rows:
        ids = torch.tensor([token_ids])
        with torch.no_grad():
            depths = mtp_logits(model, mtp, policy_hidden_and_logits(model, ids)[0], ids, None, len(weights))
        for k, logits in enumerate(depths, start=1):
            for i in range(len(token_ids) - k - 1):
                if loss_mask[i + k + 1]:
                    sums[k - 1] -= torch.log_softmax(logits[0, i].double(), -1)[token_ids[i + k + 1]].item()
                    counts[k - 1] += 1
    return sum(w * s / (num_tokens if num_tokens is not None else c) for w, s, c in zip(weights, sums, counts, strict=True))


@pytest.mark.parametrize("arch", ["glm_moe_dsa", "qwen3"])
def test_depth_3_loss_is_the_weighted_sum_of_the_per_depth_cross_entropies(arch):
    model = make_tiny_model(arch)
    mtp = build_mtp(model, seed=1).eval()
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(20, 100, (3, 12), generator=generator)
    mask = (torch.rand(3, 12, generator=generator) < 0.7).float()
    rows = [(ids[b].tolist(), mask[b].tolist()) for b in range(3)]
    with torch.no_grad():
        hidden = policy_hidden_and_logits(model, ids)[0]
        weighted = mtp_loss(model, mtp, hidden, ids, None, mask, 3, depth_weights=WEIGHTS)
        mean = mtp_loss(model, mtp, hidden, ids, None, mask, 3)
        last_only = mtp_loss(model, mtp, hidden, ids, None, mask, 3, depth_weights=[0.0, 0.0, 1.0])
    assert weighted.item() == pytest.approx(hand_weighted_loss(model, mtp, rows, WEIGHTS), rel=1e-5)
    # No weights is the old mean over depths, i.e. 1/D each.
    assert mean.item() == pytest.approx(hand_weighted_loss(model, mtp, rows, [1 / 3] * 3), rel=1e-5)
    assert last_only.item() == pytest.approx(hand_weighted_loss(model, mtp, rows, [0.0, 0.0, 1.0]), rel=1e-5)
    assert abs(weighted.item() - mean.item()) > 1e-3  # the weights change the loss


def test_combine_depths_refuses_a_weight_count_unlike_the_depth_count():
    with pytest.raises(ValueError, match="2 depth weights for 3 depths"):
        combine_depths([torch.tensor(1.0)] * 3, [0.5, 0.5])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["policy.mtp.depth_weights=[0.5,0.3]"], "policy.mtp: depth_weights has 2 entries, train_depth is 1"),
        (["policy.mtp.train_depth=2", "policy.mtp.depth_weights=[0.5,0.3,0.2]"], "policy.mtp: depth_weights has 3 entries"),
        (["policy.mtp.train_depth=3", "policy.mtp.depth_weights=[1,-1,0]"], "policy.mtp.depth_weights.1: Input should be greater than"),
        (["policy.mtp.train_depth=2", "policy.mtp.depth_weights=[0,0]"], "policy.mtp: depth_weights must not all be 0"),
    ],
)
def test_depth_weights_are_validated_against_train_depth(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        load_config("quickstart", overrides)


def test_the_glm5_preset_unrolls_three_depths_and_the_others_one():
    glm5 = load_config("glm5").policy.mtp
    assert (glm5.train_depth, glm5.weights_per_depth()) == (3, [1 / 3] * 3)
    assert load_config("quickstart").policy.mtp.weights_per_depth() == [1.0]
    custom = load_config("glm5", ["policy.mtp.depth_weights=[1.0,0.5,0.25]"]).policy.mtp
    assert custom.weights_per_depth() == [1.0, 0.5, 0.25]
    # Back to one depth with the preset's default weights: no stale weight list to contradict it.
    assert load_config("glm5", ["policy.mtp.train_depth=1"]).policy.mtp.weights_per_depth() == [1.0]


@pytest.mark.parametrize("pack_length", [None, 64])
def test_an_sft_step_at_depth_3_trains_the_weighted_loss(pack_length):
    mtp_config = MTPConfig(train_depth=3, depth_weights=WEIGHTS)
    config = RunConfig(policy={"tiny": TinyModelConfig(arch="qwen3", **SMALL), "mtp": mtp_config})
    tok = build_tokenizer()
    demos = demo_stream(config, tok, seed=1).batch(8)
    model, _, mtp = build_policy(config.policy, seed=0)
    num_targets = float(sum(sum(d.loss_mask[1:]) for d in demos))
    expected = hand_weighted_loss(model, mtp.eval(), [(d.token_ids, d.loss_mask) for d in demos], WEIGHTS, num_targets)
    _, aux, _ = train_step(config, model, mtp, demos, tok.pad_token_id, pack_length)
    # Padded or packed (targets in another conversation dropped), the step's MTP loss is the weighted sum.
    assert aux == pytest.approx(expected, rel=1e-4)
    assert mtp.eh_proj.weight.grad is not None and mtp.eh_proj.weight.grad.abs().sum() > 0


def rl_sample(model, rollout: str, reward: float, completion: list[int]) -> Sample:
    token_ids = [3, 4, 5, *completion]
    loss_mask = [0, 0, 0] + [1] * len(completion)
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([token_ids])).logits[0, :-1], -1)
    logprobs = [0.0] + [logp[j - 1, t].item() if m else 0.0 for j, (t, m) in enumerate(zip(token_ids, loss_mask, strict=True)) if j]
    versions = [0 if m else UNSAMPLED_VERSION for m in loss_mask]
    return Sample(token_ids, loss_mask, logprobs, versions, reward, "g", rollout, "ok")


def test_an_rl_step_at_depth_3_trains_the_weighted_loss():
    model = make_tiny_model("qwen3")
    mtp = build_mtp(model, seed=1)
    config = LearnerConfig(group_size=2, lr=1e-3, weight_decay=0.0, mtp_loss_weight=0.5)
    learner = RLLearner(config, model, build_tokenizer(), mtp, mtp_depth_weights=WEIGHTS)
    samples = [rl_sample(model, "a", 1.0, [10, 11, 12, 13, 14, 15]), rl_sample(model, "b", 0.0, [20, 21, 22, 23])]
    trainable = float(sum(sum(s.loss_mask[1:]) for s in samples))
    expected = hand_weighted_loss(model, mtp, [(s.token_ids, s.loss_mask) for s in samples], WEIGHTS, trainable)
    before = mtp.eh_proj.weight.detach().clone()
    step = learner.train_step(Batch([samples]))
    assert step.metrics["mtp_loss"] == pytest.approx(expected, rel=1e-4)
    assert not torch.equal(mtp.eh_proj.weight, before)


def test_the_rl_learner_takes_its_depth_weights_from_the_run_config():
    run = RunConfig(
        policy={"tiny": TinyModelConfig(arch="qwen3", **SMALL), "mtp": MTPConfig(train_depth=3)},
        learner=LearnerConfig(mtp_loss_weight=0.5),
    )
    learner = RLLearner.from_config(run)
    assert learner.mtp_depth_weights == pytest.approx([1 / 3] * 3)
