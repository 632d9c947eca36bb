"""Floor 0: the records every component shares (docs/ARCHITECTURE.md, "Three floors").

What an engine is asked and answers (`SamplingParams`, `GenerationResult`, `ScoreResult`), what the
gateway records (one `Turn` per generation call, one `Trajectory` per rollout), what the learner
trains on (`Sample`) and the account every rollout ends in (`Account`). They import nothing of the
project, so any component can use them without importing another.

These are the ground truth the learner trains from, so they keep the engine's numbers exactly:
token ids as sampled, log-probs as floats that survive a JSON round trip bit for bit (Python writes
the shortest repr that reads back to the same double), the policy version of every token (and, where the
engine records it, the oldest version among the KV the token attended to), and the sampling options of every
turn, so the learner takes each log-prob at the temperature it was drawn at.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any, Literal, NamedTuple, get_args

# --- engine requests and results ---------------------------------------------------------

FinishReason = Literal["stop", "length", "abort", "error"]
MIN_TEMPERATURE = 1e-4
"""Smallest positive temperature; below it, ask for greedy (0) instead."""


class RequestError(ValueError):
    """A request the engine refuses (bad token ids, empty prompt, too long, bad sampling options).

    Raised for that request only; the engine and every other request carry on.
    """


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request.

    Log-prob semantics: the returned log-prob of a token is its log-probability under the
    distribution it was actually drawn from: logits / temperature, then top-k, then top-p, then
    renormalised. With temperature 0 (greedy) the token is the argmax and its log-prob is that of
    the raw model distribution (temperature 1, no truncation).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 32
    stop_token_ids: tuple[int, ...] = ()
    """Tokens that end the request (the EOS token always does); the stop token is returned."""
    seed: int | None = None
    """Seeds this request's own random stream: same seed, same prompt, same tokens, whatever else is batched."""

    def validate(self) -> None:
        if not (0.0 <= self.temperature <= 100.0):
            raise RequestError(f"temperature must be in [0, 100], got {self.temperature}")
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            # logits / 1e-300 overflow to inf and would turn the whole batch's logits into NaN.
            raise RequestError(f"temperature {self.temperature} is too small to sample with; use 0 for greedy")
        if not (0.0 < self.top_p <= 1.0):
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise RequestError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.max_tokens <= 0:
            raise RequestError(f"max_tokens must be > 0, got {self.max_tokens}")

    @classmethod
    def from_dict(cls, options: dict) -> SamplingParams:
        """Build from a plain mapping (JSON, Ray); unknown options are a RequestError naming them."""
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(options) - known)
        if unknown:
            raise RequestError(f"unknown sampling option(s): {', '.join(unknown)} (known: {', '.join(sorted(known))})")
        values = dict(options)
        if "stop_token_ids" in values:
            values["stop_token_ids"] = tuple(values["stop_token_ids"] or ())
        params = cls(**values)
        params.validate()
        return params


@dataclass
class GenerationResult:
    """One finished request: the sampled tokens with their log-probs and policy versions."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: FinishReason
    engine_id: str = ""
    cached_prompt_tokens: int = 0
    """Prompt tokens whose KV cache was reused from an earlier request of the same session."""
    mtp_verify_steps: int = 0
    """Decode steps that verified MTP drafts for this request (0 without drafting)."""
    mtp_accept_len: float | None = None
    """Mean tokens emitted per such step (accepted drafts + 1); None when nothing was drafted."""
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds: queued (submit to first scheduling), prefill, total."""
    error: str | None = None
    routes: list[list[list[int]]] | None = None
    """rollout.record_routes: per sampled token, per MoE layer, the expert ids (ascending) chosen at the
    position whose output sampled it (`asyncrl.policy.routing`). None when not recorded."""
    kv_versions: list[int] | None = None
    """KV provenance: per sampled token, the oldest policy version among the KV entries its forward attended
    to (every earlier position and its own). Older than `versions` where weights were pushed mid-request
    under `rollout.kv_on_push: keep`. None when the engine does not record it (vLLM)."""


@dataclass
class TokenDelta:
    """Tokens a streaming request sampled since its last delta, in order; the stream ends with the
    request's `GenerationResult`, which holds every token again."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    engine_id: str = ""
    """The engine that sampled them (set by the gateway's pool), so a stream cut short records where it ran."""
    kv_versions: list[int] | None = None
    """As `GenerationResult.kv_versions`, for these tokens."""

    def extend(self, more: TokenDelta) -> None:
        """Append `more`'s tokens. KV provenance stays on record only while every delta carries it."""
        if more.kv_versions is None or (self.kv_versions is None and self.token_ids):
            self.kv_versions = None
        elif self.kv_versions is None:
            self.kv_versions = list(more.kv_versions)
        else:
            self.kv_versions += more.kv_versions
        self.token_ids += more.token_ids
        self.logprobs += more.logprobs
        self.versions += more.versions


@dataclass
class ScoreResult:
    """One prefill-only scoring call (`rollout/scoring.py`): per sequence, the log-prob of each token
    given the ones before it (entry 0 is 0.0), and the policy version of the weights that scored."""

    logprobs: list[list[float]]
    version: int
    engine_id: str = ""


MAX_SCORE_SEQUENCES = 1024
"""Sequences in one scoring request (the gateway's limit; url teachers split their batches by it);
each is also bounded by the engine's max_model_len."""


# --- what the gateway records -----------------------------------------------------------

FinishStatus = Literal["ok", "env_crash", "timeout", "error"]
"""How an episode ended when the environment finished it."""
TrajectoryStatus = Literal["running", "ok", "env_crash", "timeout", "error", "aborted"]
"""`running` until finished or aborted; every other value is terminal."""

FINISH_STATUSES: tuple[str, ...] = get_args(FinishStatus)
TERMINAL_STATUSES: tuple[str, ...] = (*FINISH_STATUSES, "aborted")


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
    temperature: float | None = None
    """The sampling options the engine drew this turn with (temperature 0: greedy). None: not on
    record (turns stored before turns carried them); the learner then assumes the run's."""
    top_p: float | None = None
    top_k: int | None = None
    routes: list[list[list[int]]] | None = None
    """MoE routing replay: for each completion token, per MoE layer, the experts the engine's router chose
    (rollout.record_routes). None when not recorded."""
    kv_versions: list[int] | None = None
    """For each completion token, the oldest policy version among the KV it attended to
    (`GenerationResult.kv_versions`). None when not recorded (vLLM, turns stored before it was)."""

    def __post_init__(self) -> None:
        # A misaligned turn would silently shift every importance ratio after it; refuse it here.
        n = len(self.completion_token_ids)
        if len(self.logprobs) != n or len(self.versions) != n:
            raise ValueError(
                f"turn of rollout {self.rollout_id!r}: {n} completion tokens but {len(self.logprobs)} "
                f"log-probs and {len(self.versions)} versions; they must be aligned one to one"
            )
        if self.routes is not None and len(self.routes) != n:
            raise ValueError(f"turn of rollout {self.rollout_id!r}: {n} completion tokens but routes for {len(self.routes)}")
        if self.kv_versions is not None and len(self.kv_versions) != n:
            raise ValueError(
                f"turn of rollout {self.rollout_id!r}: {n} completion tokens but {len(self.kv_versions)} kv_versions; "
                "they must be aligned one to one"
            )

    def to_dict(self) -> dict[str, Any]:
        """Plain data for JSON. Not `dataclasses.asdict`: its deep copy of every token id made it the
        most expensive step of recording a turn."""
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        for name in ("prompt_token_ids", "completion_token_ids", "logprobs", "versions", "timings"):
            data[name] = data[name].copy()
        if self.kv_versions is not None:
            data["kv_versions"] = self.kv_versions.copy()
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Turn:
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
    def from_dict(cls, data: dict[str, Any]) -> Trajectory:
        values = dict(data)
        values["turns"] = [Turn.from_dict(t) for t in values.get("turns", [])]
        return cls(**values)


# --- what the learner trains on ----------------------------------------------------------

UNSAMPLED_VERSION = -1
"""Version recorded for tokens the policy did not sample (prompt, tool and environment tokens)."""
StalenessBy = Literal["sampled", "kv"]
"""Which version a token's staleness counts from (`learner.staleness_by`, `Sample.staleness_versions`)."""


@dataclass
class Sample:
    """One token sequence for the learner, every list aligned with `token_ids`."""

    token_ids: list[int]
    loss_mask: list[int]
    """1 exactly on tokens the policy sampled; 0 on prompt, tool and environment tokens."""
    logprobs: list[float]
    """Rollout log-prob of each sampled token; 0.0 where the mask is 0."""
    versions: list[int]
    """Policy version of each sampled token; UNSAMPLED_VERSION where the mask is 0."""
    reward: float
    group_id: str
    rollout_id: str
    status: str
    task: str = ""
    branch: int = 0
    """Which fork of its trajectory this is (0 for the first); forks share the reward."""
    turn_indices: list[int] = field(default_factory=list)
    """The trajectory's turns merged into this sample, in order."""
    temperatures: list[float | None] | None = None
    """Sampling temperature of each sampled token, from its turn (0: greedy), aligned with token_ids;
    None where the mask is 0 or the turn recorded none. None for the whole sample when no turn
    recorded one (hand-built samples, old stores). Per token, because the turns of one sample may
    have been sampled at different temperatures."""
    token_turns: list[int] | None = None
    """Index of the trajectory turn each token came in with (its prompt's new tokens and its completion),
    aligned with token_ids; None for hand-built samples. Per-turn consistency figures and replay use it."""
    routes: list[list[list[int]] | None] | None = None
    """MoE routing replay: per token, the experts chosen per MoE layer when it was sampled (None where the
    mask is 0), aligned with token_ids; None for the whole sample when no turn recorded routes."""
    top_ks: list[int] | None = None
    """top-k each sampled token was drawn under (0: none), from its turn, aligned with token_ids (0 where the mask
    is 0 and on greedy tokens); None for the whole sample when no turn truncated."""
    top_ps: list[float] | None = None
    """top-p each sampled token was drawn under (1.0: none), as `top_ks`."""
    truncated: bool = False
    """Its last turn ended at the token limit (finish reason `length`): `learner.overlong.filter` trains none of it."""
    kv_versions: list[int] | None = None
    """Oldest policy version among the KV each sampled token attended to (`Turn.kv_versions`), aligned with
    token_ids, UNSAMPLED_VERSION where the mask is 0; a turn that recorded none gives its `versions` (see
    `asyncrl/samples.py`). None for the whole sample when no turn recorded it."""

    @property
    def oldest_version(self) -> int | None:
        return oldest_version(self.versions, self.loss_mask)

    def staleness_versions(self, by: StalenessBy) -> list[int]:
        """Per token, the version its staleness counts from (`learner.staleness_by`): the one that sampled it,
        or with "kv" the oldest one among the KV it attended to (the sampling one where that is not on record)."""
        if by == "sampled" or self.kv_versions is None:
            return self.versions
        if len(self.kv_versions) != len(self.token_ids):
            raise ValueError(
                f"sample of rollout {self.rollout_id!r}: {len(self.token_ids)} tokens but {len(self.kv_versions)} kv_versions; "
                "they must be aligned with token_ids"
            )
        return self.kv_versions

    def scoring_temperatures(self, default: float) -> list[float]:
        """The temperature at which the learner (and a teacher) takes the log-prob of each token, so that
        it compares with the engine's: its sampling temperature, 1 for greedy tokens (the engines report
        raw log-probs for them), `default` (the run's) where none is on record."""
        fallback = scoring_temperature(default)
        if self.temperatures is None:
            return [fallback] * len(self.token_ids)
        return [fallback if t is None else scoring_temperature(t) for t in self.temperatures]


def scoring_temperature(temperature: float) -> float:
    """The temperature of the log-prob an engine reports for a token sampled at `temperature`: itself,
    or 1 for greedy (0), whose log-prob is that of the raw model distribution."""
    return temperature if temperature > 0 else 1.0


class Account(str, Enum):
    """The one account every rollout ends in; the run's ledger counts them."""

    TRAINED = "trained"
    DROPPED_STALE = "dropped_stale"
    DROPPED_CRASH = "dropped_crash"
    DROPPED_GROUP = "dropped_group"
    DROPPED_OVERLONG = "dropped_overlong"
    DROPPED_NO_SIGNAL = "dropped_no_signal"
    ABORTED = "aborted"


def oldest_version(versions: Sequence[int], loss_mask: Sequence[int]) -> int | None:
    """The staleness rule's input: the oldest policy version among sampled (loss-mask 1) tokens; None
    if none was sampled."""
    sampled = [v for v, m in zip(versions, loss_mask, strict=True) if m]
    return min(sampled) if sampled else None


# --- one learner step: what it is handed, what it reports, what it makes due --------------


@dataclass
class Batch:
    """What one learner step is handed: whole GRPO groups, in the order they were taken.

    Each group holds the samples of every rollout in it (a forked rollout has several, one that gave
    nothing to train on a placeholder with no tokens), so every rollout the step is handed gets an account.
    """

    groups: list[list[Sample]]

    @property
    def samples(self) -> list[Sample]:
        """Every sample, group after group."""
        return [sample for group in self.groups for sample in group]

    @property
    def rollout_ids(self) -> list[str]:
        """Each rollout once, in order."""
        return list(dict.fromkeys(sample.rollout_id for sample in self.samples))


@dataclass
class StepResult:
    """What one learner step reports: the figures the loop acts on, typed, and the rest by name."""

    version: int
    """The policy version after the step (one more than before it, when it stepped)."""
    stepped: bool
    """Whether an optimizer step was taken (none when no rollout had an advantage)."""
    ledger: dict[str, int]
    """Rollouts per `Account`: one account for each rollout the step was handed."""
    loss: float
    grad_norm: float | None
    """None when the step took no optimizer step."""
    padded: int
    """Samples repeated to fill GRPO groups."""
    staleness: dict[int, int]
    """Rollouts per version lag (the step's version before it - the oldest sampled version), before any drop."""
    consistency_warnings: list[dict] = field(default_factory=list)
    """The (task, turn) pairs whose learner-vs-rollout log-prob gap passed `learner.logprob_gap_warning`."""
    metrics: dict[str, Any] = field(default_factory=dict)
    """Everything else the step measured (log-prob gaps, ratios, tokens, time, teachers' KL), by name."""

    def record(self) -> dict[str, Any]:
        """The step's figures as one flat mapping, the columns of the metrics log."""
        typed = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "metrics"}
        return {**typed, **self.metrics}


class Due(NamedTuple):
    push: bool
    checkpoint: bool


def due_after_step(before: int, after: int, *, push_every: int, checkpoint_every: int) -> Due:
    """What a learner step that took the policy from version `before` to `after` makes due: a weight push
    when it reached a multiple of `push_every`, a checkpoint when it reached one of `checkpoint_every`. A
    step that took no optimizer step (`after == before`) makes nothing due. The one rule the loop pushes and
    checkpoints by, and the learner resets its optimizer by (`learner.reset_optimizer_on_push`)."""
    return Due(push=after // push_every > before // push_every, checkpoint=after // checkpoint_every > before // checkpoint_every)
