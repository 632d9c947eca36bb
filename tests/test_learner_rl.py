"""The RL learner end to end on hand-built samples and a tiny dense policy.

The objectives' exact values are tested in test_objectives.py and the drop/fill rules in
test_selection-style tests of `select`; here the question is whether the learner wires them
together: the right tokens get gradient, the ledger adds up, skipping and micro-batching change
nothing but cost, and a saved learner resumes where it stopped.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_model

from asyncrl.configs.schema import LearnerConfig
from asyncrl.learner.rl import RLLearner, sampled_logprobs
from asyncrl.policy.mtp import build_mtp
from asyncrl.policy.token_logprobs import trainable_logprobs_and_entropy
from asyncrl.policy.tokenizer import build_tokenizer
from asyncrl.records import UNSAMPLED_VERSION, Batch, Sample, due_after_step

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # forwards compared to 1e-4, on one thread

PROMPT = [3, 4, 5]


def make_learner(mtp: bool = False, *, seed: int = 0, temperature: float = 1.0, **config) -> RLLearner:
    model = make_tiny_model("qwen3", seed=seed)
    config = LearnerConfig(**{"group_size": 2, "lr": 1e-3, "weight_decay": 0.0, **config})
    mtp_layer = build_mtp(model, seed=1) if mtp else None
    return RLLearner(config, model, build_tokenizer(), mtp_layer, sampling_temperature=temperature)


def model_logprobs(learner: RLLearner, token_ids: list[int], temperature: float = 1.0) -> list[float]:
    """The policy's current log-prob of every token given the ones before it (0.0 for token 0)."""
    with torch.no_grad():
        logits = learner.model(input_ids=torch.tensor([token_ids])).logits
        return [0.0, *sampled_logprobs(logits, torch.tensor([token_ids]), temperature)[0].tolist()]


def sample(
    learner: RLLearner, rollout: str, group: str, reward: float, completion: list[int], *,
    env: list[int] = (), more: list[int] = (), version: int = 0, status: str = "ok", temperature: float = 1.0,
) -> Sample:  # fmt: skip
    """PROMPT, a sampled completion, optional environment tokens and a second sampled turn; the
    rollout log-probs are the policy's own (ratio 1) unless a test edits them."""
    token_ids = PROMPT + completion + list(env) + list(more)
    loss_mask = [0] * len(PROMPT) + [1] * len(completion) + [0] * len(env) + [1] * len(more)
    logprobs = [lp if m else 0.0 for lp, m in zip(model_logprobs(learner, token_ids, temperature), loss_mask, strict=True)]
    versions = [version if m else UNSAMPLED_VERSION for m in loss_mask]
    return Sample(token_ids, loss_mask, logprobs, versions, reward, group, rollout, status)


def capture_hidden(monkeypatch) -> list[torch.Tensor]:
    """The final hidden states [B, T, H] each scoring pass hands the head, kept with their gradient after backward:
    position j-1's gradient is what token j's log-prob sends back."""
    captured: list[torch.Tensor] = []

    def keep(head, hidden, *args, **kwargs):
        hidden.retain_grad()
        captured.append(hidden)
        return trainable_logprobs_and_entropy(head, hidden, *args, **kwargs)

    monkeypatch.setattr("asyncrl.learner.sharding.trainable_logprobs_and_entropy", keep)
    return captured


def test_positive_advantage_rises_and_negative_falls():
    learner = make_learner()
    good = sample(learner, "a", "g", 1.0, [10, 11, 12])
    bad = sample(learner, "b", "g", 0.0, [20, 21, 22])
    before = [sum(model_logprobs(learner, s.token_ids)[3:]) for s in (good, bad)]
    step = learner.train_step(Batch([[good, bad]]))
    after = [sum(model_logprobs(learner, s.token_ids)[3:]) for s in (good, bad)]
    assert step.stepped and step.version == learner.version == 1
    assert after[0] > before[0] and after[1] < before[1]
    # On-policy samples: every ratio is 1 and nothing is masked.
    assert step.metrics["masked_token_frac"] == 0.0
    assert step.metrics["ratio_min"] == pytest.approx(1.0, abs=1e-5) and step.metrics["ratio_max"] == pytest.approx(1.0, abs=1e-5)
    assert step.metrics["abs_logp_diff"] == pytest.approx(0.0, abs=1e-5)
    assert step.metrics["trainable_tokens"] == 6 and step.metrics["computed_tokens"] == 12


def test_environment_tokens_get_exactly_zero_gradient(monkeypatch):
    learner = make_learner()
    env = [30, 31, 32]
    samples = [
        sample(learner, "a", "g", 1.0, [10, 11], env=env, more=[12, 13]),
        sample(learner, "b", "g", 0.0, [20, 21], env=env, more=[22, 23]),
    ]
    for s in samples:  # env tokens look on-policy (ratio 1): only the loss mask can keep them out
        s.logprobs = model_logprobs(learner, s.token_ids)
    hidden = capture_hidden(monkeypatch)
    learner.train_step(Batch([samples]))
    grad = hidden[0].grad  # [2, T, H]; row j-1 predicts token j
    env_positions = [j for j, m in enumerate(samples[0].loss_mask) if not m][1:]
    sampled_positions = [j for j, m in enumerate(samples[0].loss_mask) if m]
    for j in env_positions:
        assert torch.count_nonzero(grad[:, j - 1]) == 0, f"token {j} (mask 0) got gradient"
    for j in sampled_positions:
        assert grad[:, j - 1].abs().sum() > 0, f"sampled token {j} got no gradient"


@pytest.mark.parametrize("objective", ["icepop_grpo", "double_sided_is"])
def test_token_outside_the_ratio_mask_gets_exactly_zero_gradient(objective, monkeypatch):
    learner = make_learner(objective=objective)
    samples = [sample(learner, "a", "g", 1.0, [10, 11, 12]), sample(learner, "b", "g", 0.0, [20, 21, 22])]
    far = 4  # token 4 of rollout a: rollout log-prob 3 nats below the policy's, ratio e^3 = 20
    samples[0].logprobs[far] -= 3.0
    hidden = capture_hidden(monkeypatch)
    step = learner.train_step(Batch([samples]))
    grad = hidden[0].grad
    assert torch.count_nonzero(grad[0, far - 1]) == 0
    assert all(grad[0, j - 1].abs().sum() > 0 for j in (3, 5))
    assert step.metrics["masked_token_frac"] == pytest.approx(1 / 6)
    assert step.metrics["ratio_max"] == pytest.approx(torch.e**3, rel=1e-4)


def test_stale_and_crashed_rollouts_are_dropped_and_the_ledger_adds_up():
    learner = make_learner(group_size=4, max_staleness=2)
    learner.version = 5

    def group(name: str, **special: dict) -> list[Sample]:
        """Four rollouts with rewards 1, 0, 1, 0 sampled at version 5 unless `special[i]` says otherwise."""
        return [
            sample(learner, f"{name}{i}", name, i % 2 == 0, [10 + i, 11], **{"version": 5, **special.get(str(i), {})}) for i in range(4)
        ]

    batch = Batch([
        group("fresh", **{"0": {"version": 3}}),  # lag 2 = tau: kept
        group("crash", **{"3": {"status": "env_crash"}}),  # 3 of 4 survive: padded to 4
        group("stale", **{"0": {"version": 2}, "1": {"version": 1}}),  # lags 3 and 4: 2 of 4 left, dropped
        group("gone", **{"0": {"status": "aborted"}, "1": {"status": "error"}}),  # 2 of 4 left, dropped
    ])  # fmt: skip
    step = learner.train_step(batch)
    assert step.ledger == {
        "trained": 7,
        "dropped_stale": 2,
        "dropped_crash": 2,
        "dropped_group": 4,
        "dropped_overlong": 0,
        "dropped_no_signal": 0,
        "aborted": 1,
    }
    assert sum(step.ledger.values()) == step.metrics["rollouts"] == 16
    assert step.metrics["groups"] == 2 and step.padded == 1 and step.metrics["samples"] == 8
    assert step.staleness == {0: 13, 2: 1, 3: 1, 4: 1}
    assert step.version == 6


def test_all_equal_groups_are_counted_but_not_computed():
    learner = make_learner(group_size=2, push_every=1)  # every step that steps makes a push due
    informative = [sample(learner, "a", "g", 1.0, [10, 11, 12]), sample(learner, "b", "g", 0.0, [20])]
    solved = [sample(learner, "c", "h", 1.0, [12, 13, 14, 15]), sample(learner, "d", "h", 1.0, [12, 13, 14, 16])]
    step = learner.train_step(Batch([informative, solved]))
    assert step.ledger["trained"] == 4 and step.metrics["skipped_zero_adv"] == 2
    assert step.metrics["computed_trainable_tokens"] == 4 and step.metrics["trainable_tokens"] == 12
    assert step.metrics["computed_tokens"] == 10  # only the informative group ran through the model
    # On-policy, advantages +-1: loss = -(3 * 1 - 1 * 1) / 12. The skipped group's tokens stay in
    # the denominator, so the step is the one training on all four samples would take.
    assert step.loss == pytest.approx(-2 / 12, rel=1e-4)

    nothing = learner.train_step(Batch([solved]))
    due = due_after_step(step.version, nothing.version, push_every=1, checkpoint_every=learner.config.checkpoint_every)
    assert not nothing.stepped and nothing.version == 1 and nothing.ledger["trained"] == 2
    assert nothing.metrics["computed_tokens"] == 0 and nothing.grad_norm is None and not due.push


def test_micro_batches_give_the_step_of_one_batch():
    # Whole rows: sharing the common prompt would put all four in one micro-batch (test_learner_prefix.py).
    one, many = make_learner(share_prefixes=False), make_learner(micro_batch_tokens=8, share_prefixes=False)
    batches = []
    for learner in (one, many):
        batches.append(Batch([
            [sample(learner, "a", "g", 1.0, [10, 11]), sample(learner, "b", "g", 0.0, [20, 21, 22, 23, 24, 25])],
            [sample(learner, "c", "h", 0.5, [12]), sample(learner, "d", "h", 0.0, [13, 14, 15])],
        ]))  # fmt: skip
    a, b = one.train_step(batches[0]), many.train_step(batches[1])
    assert a.metrics["micro_batches"] == 2 and b.metrics["micro_batches"] == 4  # the length buckets, then the token cap
    assert b.loss == pytest.approx(a.loss, abs=1e-6)
    for p, q in zip(one.model.parameters(), many.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("arch", ["qwen3", "glm_moe_dsa"])
def test_gradient_checkpointing_takes_the_same_step(arch):
    def learner(**config) -> RLLearner:
        model = make_tiny_model(arch)
        # Whole rows on both sides: this compares checkpointing alone (test_learner_prefix.py compares sharing).
        return RLLearner(LearnerConfig(group_size=2, lr=1e-3, weight_decay=0.0, share_prefixes=False, **config), model, build_tokenizer())

    plain, checkpointed = learner(), learner(gradient_checkpointing=True)
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in checkpointed.model.modules() if isinstance(m, GradientCheckpointingLayer)]
    assert layers and all(layer.training for layer in layers) and not any(m.training for m in checkpointed.model.model.norm.modules())
    recomputed = []
    # A submodule's hook fires again when the backward pass recomputes its layer.
    layers[0].input_layernorm.register_forward_hook(lambda *_: recomputed.append(torch.is_grad_enabled()))
    steps = []
    for one in (plain, checkpointed):
        batch = Batch([[sample(one, "a", "g", 1.0, [10, 11, 12]), sample(one, "b", "g", 0.0, [20, 21])],
                       [sample(one, "c", "h", 0.5, [12, 30]), sample(one, "d", "h", 0.0, [13, 14, 15, 16])]])  # fmt: skip
        steps.append(one.train_step(batch))
    assert recomputed.count(True) == 2  # the training forward, then its recomputation in the backward pass
    assert steps[1].loss == pytest.approx(steps[0].loss, abs=1e-7) and steps[1].grad_norm == pytest.approx(steps[0].grad_norm, rel=1e-6)
    for p, q in zip(plain.model.parameters(), checkpointed.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-7, rtol=1e-6)


def test_each_token_is_scored_at_its_own_sampling_temperature():
    learner = make_learner(temperature=1.0)
    hot = sample(learner, "a", "g", 1.0, [10, 11, 12], more=[13, 14], env=[40])
    cold = sample(learner, "b", "g", 0.0, [20, 21, 22])
    # Turn temperatures per token: 0.5 on the first turn, greedy (scored raw) on the second.
    prompt = [None] * len(PROMPT)
    hot.temperatures = prompt + [0.5] * 3 + [None] + [0.0] * 2
    at_half = model_logprobs(learner, hot.token_ids, 0.5)
    hot.logprobs = [0.0] * 3 + at_half[3:6] + [0.0] + hot.logprobs[7:]  # the second turn's are the raw ones
    step = learner.train_step(Batch([[hot, cold]]))
    assert step.metrics["computed_trainable_tokens"] == 8 and step.metrics["abs_logp_diff"] < 1e-6
    assert step.metrics["masked_token_frac"] == 0.0

    # The same log-probs scored at the run's temperature alone are off on the first turn.
    unrecorded = make_learner(temperature=1.0)
    hot.temperatures = None
    assert unrecorded.train_step(Batch([[hot, cold]])).metrics["abs_logp_diff"] > 1e-2


def test_learner_divides_logits_by_the_sampling_temperature():
    hot = make_learner(temperature=2.0)
    samples = [
        sample(hot, "a", "g", 1.0, [10, 11, 12], temperature=2.0),
        sample(hot, "b", "g", 0.0, [20, 21, 22], temperature=2.0),
    ]
    assert hot.train_step(Batch([samples])).metrics["abs_logp_diff"] == pytest.approx(0.0, abs=1e-5)
    cold = make_learner(temperature=1.0)
    assert cold.train_step(Batch([samples])).metrics["abs_logp_diff"] > 0.1


def test_push_due_every_k_steps_and_optional_optimizer_reset():
    learner = make_learner(push_every=2, reset_optimizer_on_push=True)
    batch = Batch([[sample(learner, "a", "g", 1.0, [10, 11]), sample(learner, "b", "g", 0.0, [20, 21])]])

    def push_due(before: int, after: int) -> bool:  # the loop's rule, which the learner's reset follows
        return due_after_step(before, after, push_every=2, checkpoint_every=learner.config.checkpoint_every).push

    first = learner.train_step(batch)
    assert not push_due(0, first.version) and len(learner.optimizer.state) > 0
    second = learner.train_step(batch)
    assert push_due(first.version, second.version) and second.version == 2 and len(learner.optimizer.state) == 0
    pushed = learner.state_dict_for_push()
    assert pushed.keys() == learner.model.state_dict().keys()
    name = next(iter(pushed))
    assert pushed[name].data_ptr() != learner.model.state_dict()[name].data_ptr()  # a copy, not the live weights


def test_push_carries_the_mtp_layer_it_trains_so_drafting_engines_follow():
    learner = make_learner(mtp=True, mtp_loss_weight=0.5)
    batch = Batch([[sample(learner, "a", "g", 1.0, [10, 11, 12]), sample(learner, "b", "g", 0.0, [20, 21, 22])]])
    learner.train_step(batch)
    pushed = learner.state_dict_for_push()
    mtp_keys = {k for k in pushed if k.startswith("mtp.")}
    assert {k.removeprefix("mtp.") for k in mtp_keys} == learner.mtp.state_dict().keys()
    assert pushed.keys() - mtp_keys == learner.model.state_dict().keys()
    name = next(iter(mtp_keys))
    torch.testing.assert_close(pushed[name], learner.mtp.state_dict()[name.removeprefix("mtp.")])
    # Without the MTP loss the layer never changes: nothing to push.
    frozen = make_learner(mtp=True, mtp_loss_weight=0.0)
    assert not any(k.startswith("mtp.") for k in frozen.state_dict_for_push())


def test_save_and_load_resume_version_weights_and_optimizer(tmp_path):
    learner = make_learner(mtp=True, mtp_loss_weight=0.5)
    batch = Batch([[sample(learner, "a", "g", 1.0, [10, 11, 12]), sample(learner, "b", "g", 0.0, [20, 21, 22])]])
    assert learner.train_step(batch).metrics["mtp_loss"] > 0
    learner.train_step(batch)
    learner.save(tmp_path / "ckpt")

    resumed = make_learner(mtp=True, mtp_loss_weight=0.5, seed=7)  # different weights until loaded
    resumed.load(tmp_path / "ckpt")
    assert resumed.version == 2
    for key, state in learner.optimizer.state_dict()["state"].items():
        torch.testing.assert_close(resumed.optimizer.state_dict()["state"][key]["exp_avg"], state["exp_avg"])
    learner.train_step(batch)
    resumed.train_step(batch)
    assert resumed.version == learner.version == 3
    for p, q in zip(learner.params, resumed.params, strict=True):
        torch.testing.assert_close(p, q)


def test_malformed_samples_are_refused():
    learner = make_learner()
    bad = sample(learner, "a", "g", 1.0, [10])
    bad.loss_mask[0] = 1
    with pytest.raises(ValueError, match="first token"):
        learner.train_step(Batch([[bad, sample(learner, "b", "g", 0.0, [11])]]))


def test_glm5_policy_trains_with_mtp_and_a_frozen_indexer():
    model = make_tiny_model("glm_moe_dsa")
    config = LearnerConfig(group_size=2, lr=1e-3, mtp_loss_weight=0.3)
    learner = RLLearner(config, model, build_tokenizer(), build_mtp(model, seed=1))
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    step = learner.train_step(Batch([[sample(learner, "a", "g", 1.0, [10, 11, 12]), sample(learner, "b", "g", 0.0, [20, 21])]]))
    assert step.stepped and step.metrics["mtp_loss"] > 0 and step.metrics["masked_token_frac"] == 0.0
    moved = {name for name, p in model.named_parameters() if not torch.equal(p, before[name])}
    indexer = {name for name in before if ".indexer." in name}
    assert indexer and not moved & indexer
    assert any("self_attn.q_a_proj" in name for name in moved)
