"""One learner step: how it is taken, and what it leaves behind once it returns beside its ledger
(`Books.book`): its metrics record, the record of what it trained, and its warnings.

Kept apart from the loop so its train verb reads as what it does (take a step; when it returns,
book it, push, checkpoint, record) while the arithmetic of a record is a pure function of the step's
result and groups, and checked on its own (`tests/test_steps.py`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from asyncrl.records import Batch, StepResult

from .groups import Group
from .rundir import BatchRecord

if TYPE_CHECKING:
    from .parts import Parts


async def learn(parts: Parts, batch: Batch) -> StepResult:
    """One learner step; in distillation the teachers score the batch first (their metrics join the step's)."""
    scored: dict = {}
    if parts.teachers is not None:
        batch, scored = await parts.teachers.score(batch)
    result = await parts.learner.train_step(batch)
    result.metrics.update(scored)
    return result


def step_record(
    result: StepResult, groups: list[Group], *, elapsed_s: float, push_due: bool, pushed_version: int, in_flight: int, ahead: int
) -> dict:
    """The step's line in `metrics.jsonl` (and the display's last step): the mean reward of its groups'
    rollouts that have one, the staleness of its rollouts (the learner's histogram, version lag ->
    rollouts, as its mean and max), the loop's numbers, then the learner's own figures."""
    rewards = [t.reward for group in groups for t in group.trajectories if t.status != "aborted" and t.reward is not None]
    lags = result.staleness
    learner = {key: value for key, value in result.record().items() if key != "staleness"}
    return {
        "step": result.version, "elapsed_s": elapsed_s, "reward": sum(rewards) / max(len(rewards), 1),
        "staleness_mean": sum(int(k) * v for k, v in lags.items()) / max(sum(lags.values()), 1),
        "staleness_max": max(map(int, lags), default=0), "push_due": push_due, "pushed_version": pushed_version,
        "in_flight": in_flight, "ahead": ahead, **learner,
    }  # fmt: skip


def batch_record(result: StepResult, groups: list[Group], *, learner_version: int, distilled: bool) -> BatchRecord:
    """What the step trained, by reference (`asyncrl replay train` re-runs it); `learner_version` is the
    version it started from. Only for a step that stepped: one that did not leaves the version, and so
    the record of the step that made it, alone."""
    return BatchRecord(
        step=result.version, learner_version=learner_version,
        groups=[[t.rollout_id for t in group.trajectories] for group in groups],
        ledger=dict(result.ledger), padded=result.padded, loss=result.loss, grad_norm=result.grad_norm, distilled=distilled,
    )  # fmt: skip


def consistency_warnings(result: StepResult) -> list[str]:
    """One line per task and turn whose learner log-probs drifted from the rollout's past
    `learner.logprob_gap_warning`."""
    return [
        f"step {result.version}: task {gap['task']!r} turn {gap['turn']}: mean |learner - rollout| "
        f"log-prob {gap['gap']:.3f} over {gap['tokens']} tokens > learner.logprob_gap_warning"
        for gap in result.consistency_warnings
    ]


NO_SIGNAL_BATCHES = 10
"""Batches in a row without an optimizer step after which the run says so (and every 10x that after)."""


def no_signal_notice(batches: int, record: dict) -> str | None:
    """The display's line when `batches` batches in a row took no optimizer step (`record`: the last one's
    step record), at NO_SIGNAL_BATCHES and every 10 x NO_SIGNAL_BATCHES after; None otherwise. A run whose
    policy never earns a reward shows step 0 at full speed forever otherwise."""
    if batches != NO_SIGNAL_BATCHES and not (batches and batches % (10 * NO_SIGNAL_BATCHES) == 0):
        return None
    ledger = record.get("ledger", {})
    return (
        f"no optimizer step for {batches} batches in a row: in the last one {record.get('skipped_zero_adv', 0)} rollouts were in "
        f"groups whose rewards were all equal (mean reward {record.get('reward', 0.0):.3f}) and "
        f"{sum(v for k, v in ledger.items() if k.startswith('dropped'))} were dropped, so nothing had an advantage. "
        "The task may be too hard for the policy (start from a warm start: policy.path, or loop.sft_first), too easy, "
        "or its reward may not tell rollouts apart."
    )
