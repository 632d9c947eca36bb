"""The environment contract: what an episode returns, and the small Protocol every environment meets.

An environment draws tasks and runs one episode of a task against an OpenAI-compatible client bound
to one rollout (the gateway records every call the client makes). It returns the reward and the
episode's status; it never needs to know about token IDs, the store or the learner.

An environment that runs tools says so with `needs_sandbox = True`: the runner then opens a fresh
sandbox for each episode, passes it as the third argument and closes it afterwards, whatever
happens (`SandboxedEnvironment`). Environments without tools may leave both the attribute and the
parameter out; they are called as `run_episode(task, client)` (`PlainEnvironment`). `Environment`
is either.

An environment may also offer demonstrations for the SFT warm start: `demonstration(rng)` returns one
`Demonstration` (chat messages, with the tools they use) drawn from its training split. The SFT entry
point (asyncrl/jobs/sft.py) mixes the streams of the environments it is configured with; the learner only
renders them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    from typing_extensions import TypeIs

EpisodeStatus = Literal["ok", "env_crash", "timeout", "error"]
"""ok: the episode ran (whatever its reward); env_crash: the environment or its sandbox failed and the
learner drops the rollout; timeout: the episode ran out of time; error: the policy call failed."""

Split = Literal["train", "eval"]


@dataclass
class EpisodeResult:
    reward: float
    status: EpisodeStatus = "ok"
    metrics: dict[str, Any] = field(default_factory=dict)
    """Environment-specific numbers (e.g. turns, tool calls), stored with the trajectory. A boolean
    `correct` is what held-out evaluation counts as success (without it, the reward is the score)."""
    reason: str = ""
    """Why the status is not ok, for people reading the trajectory."""


@dataclass
class Demonstration:
    """One conversation to imitate: OpenAI-style messages whose assistant turns are the targets."""

    messages: list[dict]
    tools: list[dict] | None = None


@runtime_checkable
class PlainEnvironment(Protocol):
    """An environment without tools: its episodes need no sandbox."""

    name: str
    """Registry name; the default `task` recorded with each rollout."""

    def sample_task(self, rng: random.Random, split: Split = "train") -> Any:
        """One task from the training split, or from the held-out evaluation split."""
        ...

    async def run_episode(self, task: Any, client: Any) -> EpisodeResult:
        """Play one episode of `task`; `client` is an `openai.AsyncOpenAI` bound to this rollout."""
        ...


@runtime_checkable
class SandboxedEnvironment(Protocol):
    """An environment that runs tools (`needs_sandbox` true): each episode gets its own sandbox."""

    name: str
    needs_sandbox: bool

    def sample_task(self, rng: random.Random, split: Split = "train") -> Any:
        """One task from the training split, or from the held-out evaluation split."""
        ...

    async def run_episode(self, task: Any, client: Any, sandbox: Any) -> EpisodeResult:
        """Play one episode of `task` as `PlainEnvironment.run_episode`; `sandbox` is an open
        `asyncrl.envs.sandbox.Sandbox`, closed by the runner afterwards."""
        ...


Environment = PlainEnvironment | SandboxedEnvironment
"""Any environment; `needs_sandbox` tells which of the two it is."""


@runtime_checkable
class OffersDemonstrations(Protocol):
    def demonstration(self, rng: random.Random) -> Demonstration:
        """One demonstration, drawn with `rng` (and nothing else, so a seed fixes the stream)."""
        ...


def needs_sandbox(env: Any) -> TypeIs[SandboxedEnvironment]:
    """Whether the runner must open a sandbox for each of `env`'s episodes (False when undeclared)."""
    return bool(getattr(env, "needs_sandbox", False))


def score(result: EpisodeResult) -> float:
    """What held-out evaluation counts for one episode: `metrics["correct"]` when the environment
    reports it (so a format term in the reward does not count as success), else the reward."""
    if "correct" in result.metrics:
        return float(bool(result.metrics["correct"]))
    return float(result.reward)
