"""The RL learner's updates per batch, loss aggregation, schedule and gradient norms, on the tiny policy.

`learner.mini_batches` and `learner.epochs` split a batch into several optimizer updates whose pi_old is
scored before the first; the aggregation divides each update's loss by its own totals; the schedule
steps once per update and resumes with the optimizer.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_learner_rl import make_learner, sample

from asyncrl.configs.learner import LearnerConfig
from asyncrl.learner.schedule import lr_factor
from asyncrl.learner.shaping import overlong_penalty
from asyncrl.records import Batch

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def two_groups(learner):
    """Two GRPO groups of two on-policy samples each, completions of different lengths."""
    return [
        [sample(learner, "a", "g1", 1.0, [10, 11, 12]), sample(learner, "b", "g1", 0.0, [20, 21])],
        [sample(learner, "c", "g2", 0.0, [30, 31, 32, 33]), sample(learner, "d", "g2", 1.0, [40])],
    ]


def even_groups(learner):
    """Two GRPO groups whose samples have one length each (one micro-batch per group)."""
    return [
        [sample(learner, "a", "g1", 1.0, [10, 11, 12]), sample(learner, "b", "g1", 0.0, [20, 21, 22])],
        [sample(learner, "c", "g2", 0.0, [30, 31]), sample(learner, "d", "g2", 1.0, [40, 41])],
    ]


def weights(learner) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in learner.model.state_dict().items()}


def spy_objective(learner) -> list[dict[str, torch.Tensor | None]]:
    calls: list[dict[str, torch.Tensor | None]] = []
    objective = learner.objective

    def spy(logp, logp_rollout, advantages, mask, *, old=None):
        kept = {"logp": logp.detach().clone(), "old": None if old is None else old.clone(), "advantages": advantages.clone()}
        calls.append(kept)
        return objective(logp, logp_rollout, advantages, mask, old=old)

    learner.objective = spy
    return calls


def test_mini_batches_and_epochs_score_pi_old_once_before_the_first_update():
    learner = make_learner(objective="ppo", mini_batches=2, epochs=2, share_prefixes=False)
    calls = spy_objective(learner)
    step = learner.train_step(Batch(even_groups(learner)))
    assert step.metrics["updates"] == 4 and step.version == learner.version == 1  # one version per batch
    assert len(calls) == 4  # one micro-batch per update: group 1, group 2, group 1, group 2
    first, second, third, fourth = calls
    # Before any update the policy is pi_old: its log-probs are the first update's own.
    assert torch.allclose(first["old"], first["logp"], atol=1e-6)
    # Group 2 was scored before group 1's update moved the weights; its first update sees them moved.
    assert (second["old"] - second["logp"]).abs().max() > 1e-5
    # The second epoch reads the same pi_old, not a fresh scoring.
    assert torch.equal(third["old"], first["old"]) and torch.equal(fourth["old"], second["old"])


def test_one_update_spends_no_pass_on_pi_old():
    learner = make_learner(objective="ppo")
    calls = spy_objective(learner)
    learner.train_step(Batch(two_groups(learner)))
    assert [call["old"] for call in calls] == [None] * len(calls)  # the objective's default: its own log-probs, detached


def test_two_mini_batches_are_two_steps_of_one_group_each():
    """double_sided_is reads pi_rollout only, so an update per group is exactly a learner step per group."""
    config = {"objective": "double_sided_is", "share_prefixes": False}
    split, sequential = make_learner(mini_batches=2, **config), make_learner(**config)
    groups = two_groups(split)
    split.train_step(Batch(groups))
    for group in groups:
        sequential.train_step(Batch([group]))
    for name, tensor in weights(split).items():
        assert torch.allclose(tensor, weights(sequential)[name], atol=1e-6), name


def test_ppo_without_correction_is_grpo_on_policy():
    """On-policy samples: ppo's ratio to pi_old and icepop_grpo's ratio to pi_rollout are both 1."""
    ppo, icepop = make_learner(objective="ppo"), make_learner(objective="icepop_grpo")
    ppo.train_step(Batch(two_groups(ppo)))
    icepop.train_step(Batch(two_groups(icepop)))
    for name, tensor in weights(ppo).items():
        assert torch.allclose(tensor, weights(icepop)[name], atol=1e-6), name


@pytest.mark.parametrize(
    "aggregation, expected",
    [
        # Advantages +1 / -1 in both groups (std-normalised), completions of 3, 2, 4 and 1 tokens; at ratio 1
        # each token's loss is -A.
        ({"loss_aggregation": "token_mean"}, -(3 - 2 - 4 + 1) / 10),
        ({"loss_aggregation": "sequence_mean"}, -(1 - 1 - 1 + 1) / 4),
        ({"loss_aggregation": "constant", "loss_constant": 8}, -(3 - 2 - 4 + 1) / (4 * 8)),
    ],
)
def test_loss_aggregation_divides_by_the_steps_totals(aggregation, expected):
    learner = make_learner(normalize_adv_std=False, **aggregation)
    groups = two_groups(learner)
    for group in groups:  # rewards 1 and -1: advantages exactly +1 and -1 without the std
        group[1].reward = -1.0 if group[1].reward == 0.0 else group[1].reward
        group[0].reward = -1.0 if group[0].reward == 0.0 else group[0].reward
    step = learner.train_step(Batch(groups))
    assert step.loss == pytest.approx(expected, abs=1e-5)


def test_schedule_steps_per_update_and_resumes_with_the_optimizer(tmp_path):
    schedule = {"kind": "cosine", "warmup_steps": 2, "decay_steps": 6, "min_lr_ratio": 0.1}
    learner = make_learner(lr=1e-3, schedule=schedule)
    lrs = [learner.train_step(Batch(two_groups(learner))).metrics["lr"] for _ in range(3)]
    learner.save(tmp_path / "ckpt")
    resumed = make_learner(lr=1e-3, schedule=schedule)
    resumed.load(tmp_path / "ckpt")
    lrs.append(resumed.train_step(Batch(two_groups(resumed))).metrics["lr"])
    config = learner.config.schedule
    assert lrs == pytest.approx([1e-3 * lr_factor(config, s) for s in range(4)], rel=1e-9)
    assert lrs[0] == pytest.approx(5e-4) and lrs[1] == pytest.approx(1e-3)


def test_gradient_norms_before_and_after_clipping():
    learner = make_learner(grad_clip=1e-3)
    step = learner.train_step(Batch(two_groups(learner)))
    before, after = step.metrics["grad_norm_before_clip"], step.metrics["grad_norm_after_clip"]
    assert before == step.grad_norm and before > 1e-3 and after == pytest.approx(1e-3)


def test_a_state_saved_with_other_parameter_groups_is_refused_naming_the_setting(tmp_path):
    old = make_learner(no_decay=[])
    old.train_step(Batch(two_groups(old)))
    old.save(tmp_path / "ckpt")
    with pytest.raises(ValueError, match=r"learner\.no_decay: \[\]"):
        make_learner().load(tmp_path / "ckpt")
    make_learner(no_decay=[]).load(tmp_path / "ckpt")  # the setting it names resumes it


@pytest.mark.parametrize("length, expected", [(10, 0.0), (12, 0.0), (14, -0.5), (16, -1.0), (17, -1.0)])
def test_soft_overlong_penalty_values(length, expected):
    """DAPO with L_max 16 and a buffer of 4: 0 up to 12 tokens, a linear ramp to -1 at 16, -1 beyond."""
    config = LearnerConfig(overlong={"penalty_buffer": 4, "max_tokens": 16}).overlong
    assert overlong_penalty(length, config) == pytest.approx(expected)
    assert overlong_penalty(length, LearnerConfig().overlong) == 0.0  # off by default


def test_overlong_filter_trains_no_truncated_token_but_keeps_its_reward_in_the_group():
    learner = make_learner(overlong={"filter": True}, normalize_adv_std=False)
    groups = two_groups(learner)
    groups[0][0].truncated = True  # reward 1 in a group of rewards 1 and 0
    calls = spy_objective(learner)
    step = learner.train_step(Batch(groups))
    assert step.ledger["dropped_overlong"] == 1 and step.ledger["trained"] == 3
    assert step.metrics["overlong_filtered"] == 1 and step.metrics["trainable_tokens"] == 10 - 3
    # Its partner's advantage is still reward - group mean = 0 - 0.5: the truncated reward counted. The
    # truncated row itself, with nothing to train, is not run.
    advantages = torch.cat([c["advantages"] for c in calls])
    assert sorted(advantages.tolist()) == pytest.approx([-0.5, -0.5, 0.5])


def test_a_turn_that_hit_the_token_limit_makes_a_truncated_sample():
    from asyncrl.records import Trajectory, Turn
    from asyncrl.samples import trajectory_to_samples

    turns = [Turn("r", [1, 2], [3, 4], [-0.1, -0.2], [0, 0], finish_reason="length", index=0)]
    trajectory = Trajectory("r", turns=turns, status="ok", reward=1.0)
    assert trajectory_to_samples(trajectory)[0].truncated
    turns[0].finish_reason = "stop"
    assert not trajectory_to_samples(trajectory)[0].truncated


def test_kl_loss_term_starts_at_zero_and_grows_as_the_policy_leaves_its_start():
    with_kl, without = make_learner(kl={"coef": 0.5}), make_learner()
    first = with_kl.train_step(Batch(two_groups(with_kl)))
    without.train_step(Batch(two_groups(without)))
    # The reference is the starting policy: at the first step k3 and its gradient are exactly 0.
    assert first.metrics["kl"] == pytest.approx(0.0, abs=1e-9)
    for name, tensor in weights(with_kl).items():
        assert torch.allclose(tensor, weights(without)[name], atol=1e-7), name
    later = [with_kl.train_step(Batch(two_groups(with_kl))).metrics["kl"] for _ in range(3)]
    assert later[0] > 0 and later[-1] > later[0]
    assert make_learner().train_step(Batch(two_groups(without))).metrics["kl"] is None  # no reference kept


def test_kl_reward_penalty_shifts_each_samples_reward_by_its_summed_estimate():
    learner = make_learner(kl={"coef": 2.0, "estimator": "k1", "mode": "reward"}, normalize_adv_std=False)
    groups = two_groups(learner)
    # The engine's log-probs off the policy's (which the reference still is) by +0.1 a token on "a", -0.2 on "c".
    for shifted, shift in ((groups[0][0], 0.1), (groups[1][0], -0.2)):
        shifted.logprobs = [lp + shift if m else lp for lp, m in zip(shifted.logprobs, shifted.loss_mask, strict=True)]
    calls = spy_objective(learner)
    step = learner.train_step(Batch(groups))
    # k1 = log pi_rollout - log pi_ref per token: "a" 3 x 0.1, "c" 4 x -0.2; rewards lose 2 x that.
    a, b, c, d = 1.0 - 2.0 * 0.3, 0.0, 0.0 + 2.0 * 0.8, 1.0
    expected = sorted([a - (a + b) / 2, b - (a + b) / 2, c - (c + d) / 2, d - (c + d) / 2])
    assert sorted(torch.cat([call["advantages"] for call in calls]).tolist()) == pytest.approx(expected, abs=1e-5)
    assert step.metrics["kl_reward_penalty_mean"] == pytest.approx(2.0 * (0.3 - 0.8) / 4, abs=1e-5)


def test_entropy_is_logged_every_step_and_its_bonus_raises_it():
    plain, bonus = make_learner(), make_learner(entropy_coef=1.0)
    groups = two_groups(plain)
    first = plain.train_step(Batch(groups))
    bonus.train_step(Batch(groups))
    # Same weights before the step, so the same entropy measured; the one with the bonus moved toward more.
    assert first.metrics["entropy"] > 0
    after = [learner.train_step(Batch(groups)).metrics["entropy"] for learner in (plain, bonus)]
    assert after[1] > after[0]


def test_an_entropy_bonus_computes_zero_advantage_rows_too():
    learner = make_learner(entropy_coef=0.1)
    group = [sample(learner, "a", "g", 1.0, [10, 11]), sample(learner, "b", "g", 1.0, [20, 21])]  # all equal
    step = learner.train_step(Batch([group]))
    assert step.stepped and step.metrics["skipped_zero_adv"] == 0
    assert make_learner().train_step(Batch([group])).metrics["skipped_zero_adv"] == 2


def test_a_task_of_the_mix_trains_under_its_own_objective_and_loss_weight():
    from asyncrl.configs.objectives import DoubleSidedISObjective, IcepopGRPOObjective
    from asyncrl.learner.objectives import TaskLoss, build_objective, by_task

    generator = torch.Generator().manual_seed(0)
    rollout = -torch.rand(4, 5, generator=generator) * 3
    logp = rollout + 0.4 * torch.randn(4, 5, generator=generator)
    mask, advantages = torch.ones(4, 5), torch.tensor([1.0, -1.0, 0.5, 2.0])
    default, own = build_objective(IcepopGRPOObjective()), build_objective(DoubleSidedISObjective(eps_low=0.1, eps_high=0.1))
    losses = {"b": TaskLoss(own, 2.0), "c": TaskLoss(None, 0.5)}
    out = by_task(default, losses, ["a", "b", "c", "a"], logp, rollout, advantages, mask)
    plain, theirs = default(logp, rollout, advantages, mask), own(logp, rollout, advantages, mask)
    assert torch.equal(out.per_token[[0, 3]], plain.per_token[[0, 3]])
    assert torch.equal(out.per_token[1], 2.0 * theirs.per_token[1]) and torch.equal(out.kept[1], theirs.kept[1])
    assert torch.equal(out.per_token[2], 0.5 * plain.per_token[2])
    assert not torch.equal(theirs.kept[1], plain.kept[1])  # the two objectives disagree on that row's tokens


def test_task_losses_come_from_the_mix():
    from asyncrl.configs import load_config
    from asyncrl.learner.rl import task_losses

    run = load_config("quickstart", ["tasks.mix.x.env=reasoning", "tasks.mix.x.objective=ppo", "tasks.mix.y.env=reasoning",
                                     "tasks.mix.y.loss_weight=0.5", "tasks.mix.z.env=reasoning"])  # fmt: skip
    losses = task_losses(run)
    assert set(losses) == {"x", "y"} and losses["x"].objective is not None and losses["x"].weight == 1.0
    assert losses["x"].reads_old and not losses["y"].reads_old  # ppo's pi_old is scored when a batch takes several updates
    assert losses["y"].objective is None and losses["y"].weight == 0.5 and run.tasks.mix["z"].objective.name == "learner"
    assert run.tasks.mix["x"].objective.name == "ppo"


def test_a_task_weighted_zero_is_accounted_for_but_not_trained():
    from asyncrl.learner.objectives import TaskLoss

    learner = make_learner()
    learner.task_losses = {"muted": TaskLoss(None, 0.0)}
    groups = [[dataclasses.replace(s, task="muted") for s in group] for group in two_groups(learner)]
    step = learner.train_step(Batch(groups))
    assert step.ledger["trained"] == 4 and step.loss == 0.0


def test_a_tasks_own_ppo_objective_gets_pi_old_when_the_batch_takes_several_updates():
    from asyncrl.configs.objectives import PPOObjective
    from asyncrl.learner.objectives import TaskLoss, build_objective

    learner = make_learner(objective="double_sided_is", mini_batches=2, share_prefixes=False)
    ppo, olds = build_objective(PPOObjective()), []

    def spy(logp, logp_rollout, advantages, mask, *, old=None):
        olds.append(old)
        return ppo(logp, logp_rollout, advantages, mask, old=old)

    learner.task_losses = {"t": TaskLoss(spy, reads_old=True)}
    groups = [[dataclasses.replace(s, task="t") for s in group] for group in even_groups(learner)]
    assert learner.train_step(Batch(groups)).metrics["updates"] == 2
    assert len(olds) == 2 and all(old is not None for old in olds)
