"""Which finished rollouts the learner trains on, and the account every rollout ends in.

The rules (GLM-5 report; docs/LEARNER.md, "The rules"), applied per rollout in this order:

1. aborted rollouts -> `aborted`;
2. environment crashes (status in `crash_statuses`) -> `dropped_crash`;
3. stale rollouts, where current version - oldest version among its sampled tokens > max_staleness,
   -> `dropped_stale`; with `staleness_by="kv"` a token's version is the oldest one among the KV it
   attended to (`Sample.staleness_versions`), which a push mid-request under `rollout.kv_on_push: keep`
   leaves older than the version that sampled it;
4. per GRPO group of `group_size` rollouts: if more than half survived 1-3, the group is padded to
   full size by repeating its surviving rollouts (in order, cyclically) and they are `trained`;
   otherwise every survivor is `dropped_group`.

A rollout may have several samples (a forked trajectory); they share its account. Each rollout gets
exactly one account, so the ledger always adds up to the rollouts seen.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from asyncrl.records import Account, Sample, StalenessBy, oldest_version


@dataclass
class Selection:
    batch: list[Sample] = field(default_factory=list)
    """Samples to train on, padding repeats included, grouped by group in input order."""
    group_of: list[int] = field(default_factory=list)
    """Dense group index of each batch entry (for group-relative advantages)."""
    accounts: dict[str, Account] = field(default_factory=dict)
    """rollout_id -> its account."""
    padded: int = 0
    """Batch entries that are repeats added by group fill."""

    def ledger(self) -> Counter:
        return Counter(account.value for account in self.accounts.values())


def select(
    groups: Sequence[Sequence[Sample]],
    *,
    current_version: int,
    max_staleness: int,
    group_size: int,
    crash_statuses: Sequence[str] = ("env_crash", "error"),
    staleness_by: StalenessBy = "sampled",
) -> Selection:
    """Apply the drop and group-fill rules to complete groups (a `Batch`'s), each the samples of its rollouts."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    selection = Selection()
    for group in groups:
        by_rollout: dict[str, list[Sample]] = defaultdict(list)  # insertion order: the group's rollouts in order
        for sample in group:
            by_rollout[sample.rollout_id].append(sample)
        if len({sample.group_id for sample in group}) > 1:
            raise ValueError(f"a group of the batch mixes GRPO groups {sorted({sample.group_id for sample in group})}")
        if len(by_rollout) > group_size:
            raise ValueError(f"group {group[0].group_id!r} has {len(by_rollout)} rollouts, more than group_size={group_size}")
        survivors = []
        for rollout_id, samples in by_rollout.items():
            account = _individual_account(samples, current_version, max_staleness, crash_statuses, staleness_by)
            if account is None:
                survivors.append(rollout_id)
            else:
                selection.accounts[rollout_id] = account
        if 2 * len(survivors) <= group_size:
            selection.accounts.update({rollout_id: Account.DROPPED_GROUP for rollout_id in survivors})
            continue
        group_index = len(set(selection.group_of))
        filled = [survivors[i % len(survivors)] for i in range(group_size)]
        for position, rollout_id in enumerate(filled):
            selection.accounts[rollout_id] = Account.TRAINED
            selection.batch.extend(by_rollout[rollout_id])
            selection.group_of.extend([group_index] * len(by_rollout[rollout_id]))
            if position >= len(survivors):
                selection.padded += len(by_rollout[rollout_id])
    return selection


def _individual_account(
    samples: list[Sample], current_version: int, max_staleness: int, crash_statuses: Sequence[str], staleness_by: StalenessBy
) -> Account | None:
    status = samples[0].status
    if status == "aborted":
        return Account.ABORTED
    if status in crash_statuses:
        return Account.DROPPED_CRASH
    oldest = (oldest_version(s.staleness_versions(staleness_by), s.loss_mask) for s in samples)
    versions = [v for v in oldest if v is not None]
    if versions and current_version - min(versions) > max_staleness:
        return Account.DROPPED_STALE
    return None
