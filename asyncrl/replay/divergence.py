"""Compare a replayed episode with its record: per turn the prompt tokens (and so the environment's and
the tools' outputs, which are the new tokens of the next prompt), then the number of turns, then the
reward, status and metrics. The first difference is the rollout's divergence; over many rollouts,
`summarize` names the tasks (and the tools) that did not replay the same.

The replay feeds the recorded completions back, so up to the first divergence both sides saw the same
tokens: whatever differs first is the environment's doing (or the config's, when a setting changed).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from asyncrl.gateway.toolcalls import parse_completion
from asyncrl.records import Trajectory, Turn

from .player import Replayed

CONTEXT_TOKENS = 24
"""Tokens of decoded text shown on each side of a differing position."""

Kind = Literal[
    "prompt", "history", "environment_message", "tool_output", "sampling", "extra_turn", "missing_turn", "status", "reward", "metrics"
]
EXPLAINED: dict[str, str] = {
    "prompt": "the first prompt differs (the problem drawn from task_seed, or the environment's first messages)",
    "history": "the conversation before the last completion was sent differently",
    "environment_message": "the environment's message after the previous completion differs",
    "tool_output": "a tool's output differs",
    "sampling": "the episode asked for other sampling options",
    "extra_turn": "the replay asked for a turn the record does not have",
    "missing_turn": "the replay ended before the record's last turn",
    "status": "the episode ended with another status",
    "reward": "the reward differs",
    "metrics": "the environment's metrics differ",
}


@dataclass
class Divergence:
    """Where a replay first parted from its record."""

    kind: Kind
    turn: int | None
    """The turn whose prompt (or call) differs; None for the outcome (status, reward, metrics)."""
    position: int | None = None
    """First differing token position in that turn's prompt."""
    recorded: str = ""
    """Decoded recorded text from the differing position on (or the recorded value)."""
    replayed: str = ""
    before: str = ""
    """Decoded text both sides share just before the differing position."""
    tools: list[str] = field(default_factory=list)
    """For a tool output: the tools the previous completion called (the one whose output differs, when it can be told)."""

    @property
    def explanation(self) -> str:
        return EXPLAINED[self.kind]


@dataclass
class TurnCheck:
    """One turn of the replay against the record: its prompt, and the new text the environment sent before it."""

    turn: int
    equal: bool
    first_difference: int | None
    recorded_new: str | None
    """Decoded new tokens of the recorded prompt (the environment's or tools' reply to the previous completion); None past the record."""
    replayed_new: str | None
    """The same for the replay; None past the replay's last call."""


@dataclass
class EpisodeReplay:
    """One rollout's replay verdict."""

    rollout_id: str
    task: str
    verdict: Literal["ok", "diverged", "skipped"]
    recorded_turns: int = 0
    replayed_turns: int = 0
    divergence: Divergence | None = None
    turns: list[TurnCheck] = field(default_factory=list)
    recorded_outcome: dict[str, Any] = field(default_factory=dict)
    replayed_outcome: dict[str, Any] = field(default_factory=dict)
    reason: str = ""
    """Why it was skipped; the replay's own failure reason (when it ended badly) otherwise."""

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        if self.divergence is not None:
            data["divergence"]["explanation"] = self.divergence.explanation
        return data


def skipped(trajectory: Trajectory, reason: str) -> EpisodeReplay:
    return EpisodeReplay(trajectory.rollout_id, trajectory.task, "skipped", len(trajectory.turns), reason=reason)


def compare(replayed: Replayed, tokenizer: Any) -> EpisodeReplay:
    """The verdict on one replay: every turn checked, the first divergence named."""
    recorded, prompts = replayed.recorded.turns, replayed.script.prompts
    decode = lambda ids: tokenizer.decode(list(ids), skip_special_tokens=False)  # noqa: E731
    # An episode that ended in `error` lost its last policy call (the engine failed it, so the gateway
    # recorded nothing); the replay engine refuses that same call, which is not a divergence.
    lost = 1 if replayed.recorded.status == "error" and len(prompts) == len(recorded) + 1 else 0
    report = EpisodeReplay(
        replayed.recorded.rollout_id, replayed.recorded.task, "ok", len(recorded), len(prompts) - lost,
        recorded_outcome=_outcome(replayed.recorded), replayed_outcome=_outcome(replayed.replay), reason=replayed.replay.reason,
    )  # fmt: skip
    for i in range(max(len(recorded), len(prompts) - lost)):
        theirs = recorded[i].prompt_token_ids if i < len(recorded) else None
        ours = prompts[i] if i < len(prompts) else None
        previous = recorded[i - 1] if 0 < i <= len(recorded) else None
        fed = previous.completion_token_ids if previous is not None else []  # what the replay engine answered last
        recorded_new = _after(theirs, [*previous.prompt_token_ids, *fed] if previous is not None else [])
        replayed_new = _after(ours, [*prompts[i - 1], *fed] if 0 < i <= len(prompts) else [])
        position = None if ours is None or theirs is None else first_difference(theirs, ours)
        report.turns.append(
            TurnCheck(
                i, ours is not None and theirs is not None and position is None, position,
                None if recorded_new is None else decode(recorded_new), None if replayed_new is None else decode(replayed_new),
            )
        )  # fmt: skip
        if report.divergence is not None:
            continue
        if theirs is None:
            report.divergence = Divergence("extra_turn", i, recorded="", replayed=report.turns[-1].replayed_new or "")
        elif ours is None:
            report.divergence = Divergence("missing_turn", i, recorded=report.turns[-1].recorded_new or "", replayed="")
        elif position is not None:
            report.divergence = _prompt_divergence(i, position, theirs, ours, previous, tokenizer, decode)
        elif (sampling := _sampling_difference(recorded[i], replayed.script.sampling[i])) is not None:
            report.divergence = Divergence("sampling", i, recorded=sampling[0], replayed=sampling[1])
    if report.divergence is None:
        report.divergence = _outcome_divergence(report.recorded_outcome, report.replayed_outcome)
    report.verdict = "ok" if report.divergence is None else "diverged"
    return report


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first position where `a` and `b` differ (one ending early counts); None when equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _after(prompt: list[int] | None, base: list[int]) -> list[int] | None:
    """The tokens of `prompt` past what it shares with `base` (the previous prompt and completion)."""
    return None if prompt is None else prompt[_shared(prompt, base) :]


def _shared(a: Sequence[int], b: Sequence[int]) -> int:
    position = first_difference(a, b)
    return min(len(a), len(b)) if position is None else position


def _prompt_divergence(i: int, position: int, theirs: list[int], ours: list[int], previous: Turn | None, tokenizer, decode) -> Divergence:
    def window(ids: list[int]) -> str:
        return decode(ids[position : position + CONTEXT_TOKENS])

    before = decode(theirs[max(0, position - CONTEXT_TOKENS) : position])
    found = Divergence("prompt", i, position, window(theirs), window(ours), before)
    if previous is None:
        return found
    continued = _shared(theirs, [*previous.prompt_token_ids, *previous.completion_token_ids])
    if position < continued:
        found.kind = "history"
        return found
    calls = parse_completion(previous.completion_token_ids, tokenizer).tool_calls
    if not calls:
        found.kind = "environment_message"
        return found
    found.kind = "tool_output"
    names = [call["function"]["name"] for call in calls]
    # The k-th tool response of the new text answers the k-th call, when the tokenizer marks them.
    observation = tokenizer.convert_tokens_to_ids("<|observation|>")
    answered = sum(1 for t in theirs[continued : position + 1] if t == observation) if isinstance(observation, int) else 0
    found.tools = [names[answered - 1]] if 0 < answered <= len(names) else sorted(set(names))
    return found


def _sampling_difference(turn: Turn, asked) -> tuple[str, str] | None:
    recorded = (turn.temperature, turn.top_p, turn.top_k)
    if turn.temperature is None:
        return None  # a turn stored before turns carried their sampling options
    replayed = (asked.temperature, asked.top_p, asked.top_k)
    if recorded == replayed:
        return None
    show = lambda t: f"temperature={t[0]} top_p={t[1]} top_k={t[2]}"  # noqa: E731
    return show(recorded), show(replayed)


def _outcome(trajectory: Trajectory) -> dict[str, Any]:
    return {"status": trajectory.status, "reward": trajectory.reward, "metrics": trajectory.metrics}


def _outcome_divergence(recorded: dict[str, Any], replayed: dict[str, Any]) -> Divergence | None:
    for kind in ("status", "reward"):
        if recorded[kind] != replayed[kind]:
            return Divergence(kind, None, recorded=repr(recorded[kind]), replayed=repr(replayed[kind]))
    if recorded["metrics"] != replayed["metrics"]:
        keys = sorted(k for k in {*recorded["metrics"], *replayed["metrics"]} if recorded["metrics"].get(k) != replayed["metrics"].get(k))
        show = lambda m: ", ".join(f"{k}={m.get(k)!r}" for k in keys)  # noqa: E731
        return Divergence("metrics", None, recorded=show(recorded["metrics"]), replayed=show(replayed["metrics"]))
    return None


@dataclass
class TaskSummary:
    """Over the replayed rollouts of one task: how many diverged, where, and in which tools."""

    task: str
    replayed: int = 0
    diverged: int = 0
    kinds: dict[str, int] = field(default_factory=dict)
    tools: dict[str, int] = field(default_factory=dict)

    @property
    def deterministic(self) -> bool:
        return self.diverged == 0


def summarize(reports: list[EpisodeReplay]) -> list[TaskSummary]:
    """One summary per task replayed (skipped rollouts left out), in order of first appearance."""
    summaries: dict[str, TaskSummary] = {}
    kinds: dict[str, Counter] = {}
    tools: dict[str, Counter] = {}
    for report in reports:
        if report.verdict == "skipped":
            continue
        summary = summaries.setdefault(report.task, TaskSummary(report.task))
        summary.replayed += 1
        if report.divergence is not None:
            summary.diverged += 1
            kinds.setdefault(report.task, Counter())[report.divergence.kind] += 1
            tools.setdefault(report.task, Counter()).update(report.divergence.tools)
    for name, summary in summaries.items():
        summary.kinds = dict(kinds.get(name, Counter()).most_common())
        summary.tools = dict(tools.get(name, Counter()).most_common())
    return list(summaries.values())
