"""What the gateway records: one `Turn` per generation call, one `Trajectory` per rollout.

These are the ground truth the learner trains from, so they keep the engine's numbers exactly:
token ids as sampled, log-probs as floats that survive a JSON round trip bit for bit (Python writes
the shortest repr that reads back to the same double), and the policy version of every token.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields
from typing import Any, Literal, get_args

FinishStatus = Literal["ok", "env_crash", "timeout", "error"]
"""How an episode ended when the environment finished it."""
TrajectoryStatus = Literal["running", "ok", "env_crash", "timeout", "error", "aborted"]
"""`running` until finished or aborted; every other value is terminal."""

FINISH_STATUSES: tuple[str, ...] = get_args(FinishStatus)
TERMINAL_STATUSES: tuple[str, ...] = FINISH_STATUSES + ("aborted",)


@dataclass
class Turn:
    """One generation call of a rollout: the exact prompt the engine saw and what it sampled."""

    rollout_id: str
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    logprobs: list[float]
    """Log-prob of each completion token under the distribution it was sampled from."""
    versions: list[int]
    """Policy version of the weights that sampled each completion token."""
    finish_reason: str = "stop"
    index: int = -1
    """Position in the rollout, assigned by the store on append (-1 until then)."""
    branch: int = 0
    """The gateway's fork label, for display and replay. Sample assembly decides forks from the tokens
    themselves, so a mislabelled turn cannot corrupt a loss mask."""
    engine_id: str = ""
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds, as the engine and gateway report them (queued, prefill, total, ...)."""
    created_at: float = 0.0

    def __post_init__(self) -> None:
        # A misaligned turn would silently shift every importance ratio after it; refuse it here.
        n = len(self.completion_token_ids)
        if len(self.logprobs) != n or len(self.versions) != n:
            raise ValueError(
                f"turn of rollout {self.rollout_id!r}: {n} completion tokens but {len(self.logprobs)} "
                f"log-probs and {len(self.versions)} versions; they must be aligned one to one"
            )

    def to_dict(self) -> dict[str, Any]:
        """Plain data for JSON. Not `dataclasses.asdict`: its deep copy of every token id made it the
        most expensive step of recording a turn."""
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        for name in ("prompt_token_ids", "completion_token_ids", "logprobs", "versions", "timings"):
            data[name] = data[name].copy()
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Turn":
        return cls(**data)


@dataclass
class Trajectory:
    """A whole rollout: its turns in recording order, and how it ended."""

    rollout_id: str
    task: str = ""
    group_id: str = ""
    """Rollouts of the same prompt that the learner compares (a GRPO group)."""
    metadata: dict[str, Any] = field(default_factory=dict)
    turns: list[Turn] = field(default_factory=list)
    status: TrajectoryStatus = "running"
    reward: float | None = None
    """Set when finished; None while running and for aborted rollouts."""
    metrics: dict[str, Any] = field(default_factory=dict)
    """Environment metrics reported at finish (JSON values)."""
    reason: str = ""
    """Why it ended badly, when it did (abort reason, error message)."""
    created_at: float = 0.0
    finished_at: float | None = None

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL_STATUSES

    def to_dict(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data.update(
            turns=[turn.to_dict() for turn in self.turns],
            metadata=copy.deepcopy(self.metadata),
            metrics=copy.deepcopy(self.metrics),
        )
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Trajectory":
        values = dict(data)
        values["turns"] = [Turn.from_dict(t) for t in values.get("turns", [])]
        return cls(**values)
