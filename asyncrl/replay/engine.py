"""The replay engine: an engine that answers each generation call of a replayed rollout with the
completion that rollout recorded, in order, and keeps the prompt it was asked with.

It meets the engine contract the gateway's pool calls (`generate`, `health`; `score` is refused as
unsupported), so the gateway renders prompts and parses tool calls from the recorded tokens exactly as
it did when the run sampled them. Calls are told apart by the gateway's session id, which is the
replaying rollout's id: `expect(session_id, trajectory)` binds a replaying rollout to the recorded one
before its episode starts, so any number of rollouts replay at once through one engine.

A call past the recorded turns is answered with a `RequestError` (the gateway's 400): the episode then
ends as the environment ends a refused call, and the script keeps the prompt it was asked with, so the
report can show what the extra turn would have been.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

from asyncrl.records import FinishReason, GenerationResult, RequestError, SamplingParams, Trajectory, Turn


@dataclass
class Script:
    """One replaying rollout: the recorded turns it answers with and the prompts it was asked with."""

    recorded: Trajectory
    prompts: list[list[int]] = field(default_factory=list)
    """Prompt token ids of every generation call, in the order the gateway sent them (extra calls included)."""
    sampling: list[SamplingParams] = field(default_factory=list)

    @property
    def turns(self) -> list[Turn]:
        return self.recorded.turns

    @property
    def extra_calls(self) -> int:
        """Calls the replay made past the end of the record."""
        return max(0, len(self.prompts) - len(self.turns))


class ReplayEngine:
    """Answers generation calls from recorded trajectories, one `Script` per session id."""

    def __init__(self, engine_id: str = "replay") -> None:
        self.engine_id = engine_id
        self.scripts: dict[str, Script] = {}
        self.calls = 0

    def expect(self, session_id: str, recorded: Trajectory) -> Script:
        """Bind the replaying rollout `session_id` to the `recorded` one; its calls are answered from it."""
        script = self.scripts[session_id] = Script(recorded)
        return script

    async def generate(self, prompt_token_ids: list[int], sampling: SamplingParams, *, session_id: str | None = None) -> GenerationResult:
        script = self.scripts.get(session_id or "")
        if script is None:
            raise RequestError(f"the replay engine has no recorded rollout for session {session_id!r}")
        index = len(script.prompts)
        script.prompts.append(list(prompt_token_ids))
        script.sampling.append(sampling)
        self.calls += 1
        if index >= len(script.turns):
            raise RequestError(
                f"replay of {script.recorded.rollout_id}: the replay asked for turn {index}, and the record has "
                f"{len(script.turns)} turn{'s' if len(script.turns) != 1 else ''}"
            )
        turn = script.turns[index]
        return GenerationResult(
            request_id=f"replay-{script.recorded.rollout_id}-{index}",
            prompt_token_ids=list(prompt_token_ids),
            token_ids=list(turn.completion_token_ids),
            logprobs=list(turn.logprobs),
            versions=list(turn.versions),
            finish_reason=cast(FinishReason, turn.finish_reason),
            engine_id=self.engine_id,
            kv_versions=None if turn.kv_versions is None else list(turn.kv_versions),
        )

    async def score(self, sequences: list[list[int]], temperature: float):
        raise NotImplementedError("the replay engine answers recorded completions; it has no policy to score with")

    def health(self) -> dict:
        return {"alive": True, "engine_id": self.engine_id, "version": 0, "running": 0, "waiting": 0, "replayed_calls": self.calls}
