"""Learner-vs-rollout consistency of one learner step: how far the learner's log-probs of the sampled
tokens are from the ones the engines reported, and what the objective's mask made of the gap.

The learner scores every sampled token again, under the weights it is about to update; the engine
reported the log-prob it sampled with. Their gap |log pi_learner - log pi_rollout| is staleness plus
numerical mismatch (FP8, kernels, MoE routing and sparse-attention ties). A task or a turn index whose
gap is far above the others points at its cause: a tool whose output is rendered differently on the
learner's side, a long-context turn where the sparse attention picks other positions, a task sampled at
a temperature the learner does not reproduce.

`ConsistencyStats` accumulates, per computed micro-batch and over its trainable tokens only:

* the gap grouped by (task, turn index): sum, count and max, so the per-task and the per-turn figures
  are exact aggregates of the same groups;
* the ratios, for quantiles taken once per step;
* the tokens the objective masked, split by side: ratio below 1 (masked below the band) or above.

A step computes only the rows with a non-zero advantage (the learner never runs zero-advantage groups
through the model), so every figure here covers the computed rows only: `tokens` says how many.
Everything is vectorised per micro-batch; the python work is per group (task x turn), never per token.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

QUANTILES = {"p01": 0.01, "p10": 0.10, "p50": 0.50, "p90": 0.90, "p99": 0.99}
"""The ratio quantiles every step reports, as `ratio_<name>`."""
QUANTILE_LIMIT = 1 << 24
"""The most ratios torch.quantile takes; a step with more (large GPU batches) reports those of an even stride."""
TURN_SPAN = 1 << 32
"""(task, turn) key = task * TURN_SPAN + turn + 1: turn indices stay far below it."""
UNKNOWN = "unknown"
"""The task of a sample with none on record, the turn of a token with none (hand-built samples)."""


class LogprobGapWarning(UserWarning):
    """A task's turn whose sampled tokens the learner scores far from the engines (`learner.logprob_gap_warning`)."""


@dataclass
class GapGroup:
    """|log-prob gap| of one group's tokens: their sum, how many, the largest."""

    total: float = 0.0
    tokens: int = 0
    max: float = 0.0

    def merge(self, total: float, tokens: int, largest: float) -> None:
        self.total += total
        self.tokens += tokens
        self.max = max(self.max, largest)

    def figures(self) -> dict[str, float | int]:
        return {"mean": self.total / self.tokens if self.tokens else 0.0, "max": self.max, "tokens": self.tokens}


@dataclass
class ConsistencyStats:
    """Sums over the computed micro-batches of one learner step (see the module docstring)."""

    groups: dict[tuple[str, int], GapGroup] = field(default_factory=dict)
    """(task, turn index; -1 where unknown) -> the gap of its tokens."""
    ratios: list[torch.Tensor] = field(default_factory=list)
    """The trainable tokens' ratios, one tensor per micro-batch (on the learner's device)."""
    masked_below: int = 0
    masked_above: int = 0

    def add(
        self, tasks: Sequence[str], turns: torch.Tensor, gap: torch.Tensor, ratio: torch.Tensor, kept: torch.Tensor, trainable: torch.Tensor
    ) -> None:
        """One micro-batch, all [B, T] but `tasks` (one per row): the turn index of each token (-1: unknown),
        |learner - rollout| log-prob, the objective's observed ratio and its `kept` mask, and the trainable
        (loss mask 1) tokens. A masked token is below the band when its ratio is under 1, else above."""
        names = sorted(set(tasks))
        row_task = torch.tensor([names.index(t) for t in tasks], device=gap.device)
        rows, positions = trainable.bool().nonzero(as_tuple=True)  # found once, then gathered from
        gaps = gap.detach()[rows, positions].double()
        # One integer key per (task, turn): a handful of groups, found without a python loop over tokens.
        keys, inverse = torch.unique(row_task[rows] * TURN_SPAN + (turns[rows, positions].long() + 1), return_inverse=True)
        zeros = torch.zeros(len(keys), dtype=torch.float64, device=gap.device)
        totals = zeros.index_add(0, inverse, gaps)
        counts = torch.bincount(inverse, minlength=len(keys))
        largest = zeros.scatter_reduce(0, inverse, gaps, "amax", include_self=False)
        for key, total, count, top in zip(keys.tolist(), totals.tolist(), counts.tolist(), largest.tolist(), strict=True):
            group = (names[key // TURN_SPAN], key % TURN_SPAN - 1)
            self.groups.setdefault(group, GapGroup()).merge(total, count, top)
        ratios = ratio.detach()[rows, positions]
        self.ratios.append(ratios)
        masked = ~kept[rows, positions]
        below, above = torch.stack([(masked & (ratios < 1.0)).sum(), (masked & (ratios >= 1.0)).sum()]).tolist()
        self.masked_below += below
        self.masked_above += above

    def merge(self, other: ConsistencyStats) -> None:
        """Add the sums of another share of the same step's rows (another learner rank's)."""
        for key, group in other.groups.items():
            self.groups.setdefault(key, GapGroup()).merge(group.total, group.tokens, group.max)
        self.ratios += other.ratios
        self.masked_below += other.masked_below
        self.masked_above += other.masked_above

    def all_ratios(self) -> torch.Tensor:
        """Every trainable token's ratio so far, as one float64 tensor (concatenated once, then kept)."""
        if len(self.ratios) != 1:
            self.ratios = [torch.cat(self.ratios) if self.ratios else torch.zeros(0)]
        return self.ratios[0].double()

    @property
    def tokens(self) -> int:
        return sum(group.tokens for group in self.groups.values())

    def by_task(self) -> dict[str, GapGroup]:
        return dict(sorted(_merge((task or UNKNOWN, group) for (task, _), group in self.groups.items()).items()))

    def by_turn(self) -> dict[str, GapGroup]:
        """Keyed by the turn index as a string (the JSON key it becomes), in turn order."""
        ordered = sorted(self.groups.items(), key=lambda item: (item[0][1], item[0][0]))
        return _merge((UNKNOWN if turn < 0 else str(turn), group) for (_, turn), group in ordered)

    def metrics(self) -> dict:
        """The step's figures: flat headline keys (None when nothing was computed) and the nested groups."""
        n = self.tokens
        ratios = self.all_ratios()
        quantiles = [None] * len(QUANTILES)
        if ratios.numel() > QUANTILE_LIMIT:
            ratios = ratios[:: -(-ratios.numel() // QUANTILE_LIMIT)]  # an even stride: torch.quantile's input limit
        if ratios.numel():
            quantiles = torch.quantile(ratios, torch.tensor(list(QUANTILES.values()), dtype=torch.float64, device=ratios.device)).tolist()
        overall = GapGroup()
        for group in self.groups.values():
            overall.merge(group.total, group.tokens, group.max)
        return {
            "logprob_gap_mean": overall.total / n if n else None,
            "logprob_gap_max": overall.max if n else None,
            **{f"ratio_{name}": q for name, q in zip(QUANTILES, quantiles, strict=True)},
            "masked_below_frac": self.masked_below / n if n else None,
            "masked_above_frac": self.masked_above / n if n else None,
            "logprob_gap_by_task": {name: group.figures() for name, group in self.by_task().items()},
            "logprob_gap_by_turn": {name: group.figures() for name, group in self.by_turn().items()},
        }

    def over_threshold(self, threshold: float) -> list[dict]:
        """The (task, turn) groups whose mean gap exceeds `threshold`, largest first."""
        found = [
            {"task": task or UNKNOWN, "turn": turn if turn >= 0 else None, "gap": group.total / group.tokens, "tokens": group.tokens}
            for (task, turn), group in self.groups.items()
            if group.tokens and group.total / group.tokens > threshold
        ]
        return sorted(found, key=lambda w: -w["gap"])


def _merge(named: Iterable[tuple[str, GapGroup]]) -> dict[str, GapGroup]:
    """Groups of the same name merged into one, in the order the names first come."""
    merged: dict[str, GapGroup] = {}
    for name, group in named:
        merged.setdefault(name, GapGroup()).merge(group.total, group.tokens, group.max)
    return merged


def warn_gaps(stats: ConsistencyStats, threshold: float, step: int) -> list[dict]:
    """The (task, turn) groups of learner step `step` whose mean gap passed `threshold`
    (`learner.logprob_gap_warning`), each also raised as a `LogprobGapWarning`; the loop shows the list."""
    found = stats.over_threshold(threshold)
    for gap in found:
        turn = UNKNOWN if gap["turn"] is None else gap["turn"]
        warnings.warn(
            f"learner step {step}: task {gap['task']!r} turn {turn}: mean |learner - rollout| log-prob "
            f"{gap['gap']:.3f} over {gap['tokens']} tokens exceeds learner.logprob_gap_warning={threshold}",
            LogprobGapWarning,
            stacklevel=3,  # the caller of train_step
        )
    return found
