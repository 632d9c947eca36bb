"""Which finished rollouts the learner trains on, and the account every rollout ends in.

The rules (GLM-5 report; DESIGN §4), applied per rollout in this order:

1. aborted rollouts -> `aborted`;
2. environment crashes (status in `crash_statuses`) -> `dropped_crash`;
3. stale rollouts, where current version - oldest version among its sampled tokens > max_staleness,
   -> `dropped_stale`;
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
from typing import Protocol

from asyncrl.records import Account, oldest_version


class Candidate(Protocol):
    """What selection reads of a learner sample (read-only, so a sample's lists qualify as sequences)."""

    @property
    def rollout_id(self) -> str: ...

    @property
    def group_id(self) -> str: ...

    @property
    def status(self) -> str: ...

    @property
    def versions(self) -> Sequence[int]: ...

    @property
    def loss_mask(self) -> Sequence[int]: ...


@dataclass
class Selection:
    batch: list = field(default_factory=list)
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
    samples: Sequence[Candidate],
    *,
    current_version: int,
    max_staleness: int,
    group_size: int,
    crash_statuses: Sequence[str] = ("env_crash", "error"),
) -> Selection:
    """Apply the drop and group-fill rules to the samples of complete groups."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    by_rollout: dict[str, list[Candidate]] = defaultdict(list)
    groups: dict[str, list[str]] = defaultdict(list)
    for sample in samples:
        if sample.rollout_id not in by_rollout:
            groups[sample.group_id].append(sample.rollout_id)
        by_rollout[sample.rollout_id].append(sample)

    selection = Selection()
    for group_id, rollout_ids in groups.items():
        if len(rollout_ids) > group_size:
            raise ValueError(f"group {group_id!r} has {len(rollout_ids)} rollouts, more than group_size={group_size}")
        survivors = []
        for rollout_id in rollout_ids:
            account = _individual_account(by_rollout[rollout_id], current_version, max_staleness, crash_statuses)
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
    samples: list[Candidate], current_version: int, max_staleness: int, crash_statuses: Sequence[str]
) -> Account | None:
    status = samples[0].status
    if status == "aborted":
        return Account.ABORTED
    if status in crash_statuses:
        return Account.DROPPED_CRASH
    versions = [v for v in (oldest_version(s.versions, s.loss_mask) for s in samples) if v is not None]
    if versions and current_version - min(versions) > max_staleness:
        return Account.DROPPED_STALE
    return None
