"""What `asyncrl replay score` reports: one `RolloutScore` per replayed sample, with a `TokenScore` per token.

These are plain data (JSON lines, the terminal view and the HTML report all read them), keyed by
checkpoint label (`start`, `v12`) so one report can compare several checkpoints. Decisions name what
an objective would do with a sampled token at the run's epsilons: `kept`, `below` (ratio under the
band, masked) or `above` (over it, masked).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Decision = Literal["kept", "below", "above"]


@dataclass
class TokenScore:
    position: int
    """Index in the sample's token ids."""
    token_id: int
    text: str
    turn: int
    """Index of the trajectory turn the token belongs to (its prompt or its completion)."""
    sampled: bool
    """Loss mask 1: the policy sampled this token (the rest is prompt, tool output, environment text)."""
    rollout_logprob: float | None = None
    version: int | None = None
    """Policy version that sampled it."""
    staleness: int | None = None
    """Versions between sampling and the step that trained it (or the final checkpoint when untrained)."""
    kv_version: int | None = None
    """Oldest policy version among the KV it attended to (`Sample.kv_versions`); None where none is on record."""
    kv_staleness: int | None = None
    """Versions between that KV and the step that trained it, as `staleness` (`learner.staleness_by: kv` reads it)."""
    temperature: float | None = None
    logprobs: dict[str, float] = field(default_factory=dict)
    """Re-scored log-prob under each checkpoint (by label)."""
    ratios: dict[str, float] = field(default_factory=dict)
    """exp(re-scored - rollout) per checkpoint."""
    decisions: dict[str, dict[str, Decision]] = field(default_factory=dict)
    """Per checkpoint, per objective (`double_sided_is`, `icepop_grpo`): kept, below or above."""
    nearest_version: int | None = None
    """Version of the checkpoint the `nearest` series scored this token with (the kept one closest to `version`)."""


@dataclass
class TurnSummary:
    index: int
    sampled_tokens: int
    mean_abs_delta: dict[str, float] = field(default_factory=dict)
    """Mean |re-scored - rollout log-prob| over the turn's sampled tokens, per checkpoint."""
    max_abs_delta: dict[str, float] = field(default_factory=dict)
    masked_fraction: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per checkpoint, per objective: share of the turn's sampled tokens masked."""
    tool_calls: int = 0


@dataclass
class RolloutScore:
    rollout_id: str
    branch: int
    task: str
    status: str
    reward: float | None
    group_id: str
    advantage: float | None
    """GRPO advantage recomputed from the recorded group (None when the group is incomplete in the store)."""
    checkpoints: list[dict[str, Any]]
    """[{label, version, path}] in the order scored."""
    tokens: list[TokenScore]
    turns: list[TurnSummary]
    summary: dict[str, Any] = field(default_factory=dict)
    """Whole-sample figures: mean/max |delta| and masked fraction per checkpoint, KL between checkpoints."""
    account: str | None = None
    """What the learner's selection makes of this rollout in its recorded group (`trained`, `dropped_stale`, ...);
    None when the group is incomplete in the store."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
