"""The learner's rules with exact, hand-computed values (docs/LEARNER.md, "The rules")."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.learner.objectives import double_sided_is_loss, group_advantages, icepop_grpo_loss
from asyncrl.learner.selection import select
from asyncrl.records import Account, Sample, oldest_version

LN2 = math.log(2.0)  # exp(±ln 2) is exactly 2 and 1/2 in float32 and float64, so edges are exact


def _tokens(log_ratios, mask, dtype=torch.float64):
    """logp with requires_grad, and rollout log-probs, giving exactly the requested log-ratios."""
    # Rollout log-prob 0 makes logp - rollout exactly the requested log-ratio (no rounding).
    rollout = torch.zeros((1, len(log_ratios)), dtype=dtype)
    logp = (rollout + torch.tensor([log_ratios], dtype=dtype)).requires_grad_(True)
    return logp, rollout, torch.tensor([mask])


class TestDoubleSided:
    def test_strict_bounds_mask_both_edges(self):
        # eps_low 0.5, eps_high 1.0: the keep interval is (0.5, 2.0), open at both ends.
        logp, rollout, mask = _tokens([-LN2, LN2, 0.0, math.log(1.9), math.log(0.51)], [1, 1, 1, 1, 1])
        out = double_sided_is_loss(logp, rollout, torch.tensor([1.0]), mask, eps_low=0.5, eps_high=1.0)
        assert out.ratio[0, 0].item() == 0.5 and out.ratio[0, 1].item() == 2.0
        assert out.kept.tolist() == [[False, False, True, True, True]]

    def test_loss_and_gradient_values(self):
        # ratios 1, 1.2, 3.0 on trainable tokens, A = 2; eps 0.3 keeps 1 and 1.2, masks 3.0.
        logp, rollout, mask = _tokens([0.0, math.log(1.2), math.log(3.0), 0.5], [1, 1, 1, 0])
        out = double_sided_is_loss(logp, rollout, torch.tensor([2.0]), mask, eps_low=0.3, eps_high=0.3)
        # loss = -(1*2 + 1.2*2) / 3 trainable tokens
        assert out.loss.item() == pytest.approx(-(2.0 + 2.4) / 3, abs=1e-12)
        out.loss.backward()
        # d(-r A)/d logp = -r A, divided by 3; masked and prompt tokens get exactly 0.
        assert logp.grad.tolist()[0] == pytest.approx([-2.0 / 3, -2.4 / 3, 0.0, 0.0], abs=1e-12)
        assert logp.grad[0, 2].item() == 0.0 and logp.grad[0, 3].item() == 0.0
        stats = out.stats()
        assert stats["masked_token_frac"] == pytest.approx(1 / 3)
        assert stats["ratio_max"] == pytest.approx(3.0)

    def test_overflowing_ratio_on_masked_token_gives_no_nan(self):
        logp, rollout, mask = _tokens([0.0, 500.0], [1, 1], dtype=torch.float32)
        out = double_sided_is_loss(logp, rollout, torch.tensor([1.0]), mask)
        out.loss.backward()
        assert torch.isfinite(logp.grad).all()
        assert logp.grad[0, 1].item() == 0.0


class TestIcePop:
    def test_inclusive_bounds_keep_both_edges(self):
        logp, rollout, mask = _tokens([-LN2, LN2, math.log(2.01), math.log(0.49)], [1, 1, 1, 1])
        out = icepop_grpo_loss(logp, rollout, torch.tensor([1.0]), mask, beta=2.0)
        assert out.kept.tolist() == [[True, True, False, False]]

    def test_ppo_clip_positive_advantage(self):
        # r = 1.5 > 1 + eps_high = 1.28: the clipped term wins, loss -1.28 A, no gradient.
        logp, rollout, mask = _tokens([math.log(1.5)], [1])
        out = icepop_grpo_loss(logp, rollout, torch.tensor([1.0]), mask)
        assert out.loss.item() == pytest.approx(-1.28, abs=1e-12)
        out.loss.backward()
        assert logp.grad.item() == 0.0

    def test_ppo_clip_negative_advantage(self):
        # A = -1, r = 1.5: min(1.5 * -1, 1.28 * -1) = -1.5, loss 1.5, gradient -r A = 1.5.
        logp, rollout, mask = _tokens([math.log(1.5)], [1])
        out = icepop_grpo_loss(logp, rollout, torch.tensor([-1.0]), mask)
        assert out.loss.item() == pytest.approx(1.5, abs=1e-12)
        out.loss.backward()
        assert logp.grad.item() == pytest.approx(1.5, abs=1e-12)

    def test_low_side_clip(self):
        # r = 0.6 < 1 - eps_low = 0.8 with A = -1: min(-0.6, -0.8) = -0.8 (clipped, constant).
        logp, rollout, mask = _tokens([math.log(0.6)], [1])
        out = icepop_grpo_loss(logp, rollout, torch.tensor([-1.0]), mask)
        assert out.loss.item() == pytest.approx(0.8, abs=1e-12)
        out.loss.backward()
        assert logp.grad.item() == 0.0

    def test_environment_tokens_give_zero_gradient(self):
        logp, rollout, mask = _tokens([0.1, 0.0, -0.1], [0, 1, 0])
        icepop_grpo_loss(logp, rollout, torch.tensor([3.0]), mask).loss.backward()
        assert logp.grad[0, 0].item() == 0.0 and logp.grad[0, 2].item() == 0.0
        assert logp.grad[0, 1].item() == pytest.approx(-3.0)


def test_group_advantages_hand_computed():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1])
    # group 0: mean 0.5, population std 0.5 -> ±1; group 1: all equal -> 0
    assert group_advantages(rewards, groups).tolist() == pytest.approx([1, -1, -1, 1, 0, 0], abs=1e-5)
    assert group_advantages(rewards, groups, normalize_std=False).tolist() == pytest.approx([0.5, -0.5, -0.5, 0.5, 0, 0])


def fake_sample(rollout_id: str, group_id: str = "g", status: str = "ok") -> Sample:
    """Three tokens, the last two sampled at version 5."""
    return Sample([1, 2, 3], [0, 1, 1], [0.0, -1.0, -1.0], [0, 5, 5], 0.0, group_id, rollout_id, status)


def test_oldest_version_reads_only_sampled_tokens():
    assert oldest_version([0, 7, 6], [0, 1, 1]) == 6
    assert oldest_version([3], [0]) is None


@pytest.mark.parametrize(("current", "expected"), [(7, Account.TRAINED), (8, Account.DROPPED_STALE)])
def test_staleness_at_tau_and_tau_plus_one(current, expected):
    # oldest sampled version 5, tau = 2: 7 - 5 = 2 is kept, 8 - 5 = 3 is dropped.
    selection = select([[fake_sample("a", "g1")]], current_version=current, max_staleness=2, group_size=1)
    assert selection.accounts["a"] is expected


def test_crash_and_abort_accounts():
    samples = [fake_sample("a", status="env_crash"), fake_sample("b", status="aborted"), fake_sample("c"), fake_sample("d")]
    selection = select([samples], current_version=5, max_staleness=0, group_size=4)
    assert selection.accounts["a"] is Account.DROPPED_CRASH
    assert selection.accounts["b"] is Account.ABORTED
    # 2 of 4 valid is exactly half: not more than half, so the group is dropped.
    assert selection.accounts["c"] is Account.DROPPED_GROUP and selection.batch == []


def _group(valid: int, size: int):
    return [fake_sample(f"r{i}", status="ok" if i < valid else "env_crash") for i in range(size)]


def test_group_fill_just_above_half_pads_by_repeating():
    selection = select([_group(3, 4)], current_version=5, max_staleness=0, group_size=4)
    assert [s.rollout_id for s in selection.batch] == ["r0", "r1", "r2", "r0"]
    assert selection.padded == 1 and selection.group_of == [0, 0, 0, 0]
    assert selection.ledger() == {"trained": 3, "dropped_crash": 1}


def test_group_fill_odd_size_boundaries():
    # group of 5: 3 valid (> 2.5) is kept and padded to 5; 2 valid is dropped.
    kept = select([_group(3, 5)], current_version=5, max_staleness=0, group_size=5)
    assert [s.rollout_id for s in kept.batch] == ["r0", "r1", "r2", "r0", "r1"]
    dropped = select([_group(2, 5)], current_version=5, max_staleness=0, group_size=5)
    assert dropped.batch == [] and dropped.ledger() == {"dropped_group": 2, "dropped_crash": 3}


def test_ledger_adds_up_and_forks_share_an_account():
    g = [*_group(4, 4), fake_sample("r1")]  # r1 forked into two samples
    h = [fake_sample(f"s{i}", group_id="h", status="aborted" if i == 0 else "ok") for i in range(4)]
    selection = select([g, h], current_version=5, max_staleness=0, group_size=4)
    assert sum(selection.ledger().values()) == 8
    assert [s.rollout_id for s in selection.batch].count("r1") == 2
    assert set(selection.group_of) == {0, 1}
