"""The task sections: the built-in tasks, the task mix of RL and the rewards' services."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator

from .objectives import LearnerObjective, TaskObjectiveConfig, by_name
from .section import Section


class ArithmeticTaskConfig(Section):
    """The built-in reasoning task: arithmetic and word problems with verified answers."""

    min_digits: int = Field(1, ge=1, le=12)
    """Fewest digits in an operand."""
    max_digits: int = Field(3, ge=1, le=12)
    """Most digits in an operand."""
    word_problem_fraction: float = Field(0.1, ge=0.0, le=1.0)
    """Share of problems phrased as a short word problem instead of a bare expression."""
    subtraction_fraction: float = Field(0.25, ge=0.0, le=1.0)
    """Share of subtractions (a - b with a >= b); the rest are additions."""
    heldout_fraction: float = Field(0.1, gt=0.0, lt=1.0)
    """Share of the problem space reserved for evaluation; training never sees it."""

    @model_validator(mode="after")
    def _check_digits(self) -> ArithmeticTaskConfig:
        if self.min_digits > self.max_digits:
            raise ValueError("min_digits must not exceed max_digits")
        return self


class AgenticTaskConfig(Section):
    """The built-in agentic task: products too large to compute in the head, solved with a python tool."""

    min_digits: int = Field(3, ge=1, le=12)
    """Fewest digits in a factor."""
    max_digits: int = Field(5, ge=1, le=12)
    """Most digits in a factor."""
    heldout_fraction: float = Field(0.1, gt=0.0, lt=1.0)
    """Share of the problem space reserved for evaluation; training never sees it."""
    max_turns: int = Field(3, ge=1, le=64)
    """Most model calls per episode (tool calls and the final answer together)."""
    max_tokens: int = Field(48, ge=1)
    """Token budget of each model call (a tool call with two 5-digit factors is ~35 tokens)."""
    format_reward: float = Field(0.1, ge=0.0, le=1.0)
    """Reward of a wrong answer after at least one python call that ran cleanly (a right answer gets 1)."""

    @model_validator(mode="after")
    def _check_digits(self) -> AgenticTaskConfig:
        if self.min_digits > self.max_digits:
            raise ValueError("min_digits must not exceed max_digits")
        return self


class GeneralTaskConfig(Section):
    """The built-in general task: short instructions with verifiable constraints (envs/general.py)."""

    max_words: int = Field(3, ge=1, le=8)
    """Most words an instruction may ask for (every character is a decoding step of the char-level policy)."""
    constraint_fraction: float = Field(0.5, ge=0.0, le=1.0)
    """Chance that each optional constraint (word count, ending, forbidden word) is part of an instruction."""
    heldout_fraction: float = Field(0.1, gt=0.0, lt=1.0)
    """Share of the instruction space reserved for evaluation; training never sees it."""
    max_tokens: int = Field(32, ge=1)
    """Token budget of each answer."""
    reward: str = Field("constraints", min_length=1)
    """Reward plug-in: a registered name (constraints, http, judge, or an entry point in group asyncrl.rewards) or an import path."""
    reward_options: dict[str, Any] = {}
    """Keyword arguments of the reward (for http and judge they override the `rewards` section's fields)."""


class TaskSpec(Section):
    """One task of the mix that `asyncrl run` trains on: an environment, its share and its rate limit."""

    env: str = Field("reasoning", min_length=1)
    """A registered environment name (built-in or entry point in group asyncrl.envs) or an import path 'package.module:Class'."""
    options: dict[str, Any] = {}
    """Keyword arguments of the environment's constructor (or of its from_config hook)."""
    ratio: float = Field(1.0, gt=0.0, le=1e6)
    """Relative share of admitted GRPO groups (shares are ratio / sum of ratios)."""
    max_episodes_per_s: float | None = Field(None, gt=0.0)
    """Most episodes started per second for this task (a token bucket, burst of one group); None: unlimited."""
    eval_problems: int | None = Field(None, ge=0, le=100000)
    """Held-out episodes per evaluation of this task; None: eval.num_problems; 0: not evaluated."""
    objective: TaskObjectiveConfig = LearnerObjective()
    """This task's RL loss: learner (learner.objective), or an objective of its own (a name, or a section as
    learner.objective)."""
    loss_weight: float = Field(1.0, ge=0.0, le=1000.0)
    """Multiplies the loss of this task's tokens in the step (0: its rollouts are accounted for, not trained)."""

    @field_validator("objective", mode="before")
    @classmethod
    def _objective_by_name(cls, value: Any) -> Any:
        return by_name(value)


class TasksConfig(Section):
    """The built-in tasks used for demonstrations, rollouts and evaluation, and the task mix of RL."""

    arithmetic: ArithmeticTaskConfig = ArithmeticTaskConfig()
    """Arithmetic reasoning."""
    agentic: AgenticTaskConfig = AgenticTaskConfig()
    """Tool use: multiplication through a sandboxed python tool."""
    general: GeneralTaskConfig = GeneralTaskConfig()
    """General instructions with verifiable constraints (format, length, casing, required and forbidden words)."""
    mix: dict[str, TaskSpec] = {}
    """Tasks `asyncrl run` trains on at once, by name (recorded as each rollout's task); empty: reasoning alone."""

    @model_validator(mode="after")
    def _check_mix(self) -> TasksConfig:
        for name in self.mix:
            if not name or not all(c.isalnum() or c in "_.-" for c in name):
                raise ValueError(f"task name {name!r} must be letters, digits, '_', '.' or '-'")
        return self


class HTTPRewardConfig(Section):
    """A reward-model service over HTTP (reward `http`): POST JSON, read back a score."""

    url: str = "http://127.0.0.1:8000/score"
    """Endpoint that takes {"prompt_messages", "completion", "task"} and answers {"reward": number, "details": {...}}."""
    timeout_s: float = Field(10.0, gt=0, le=3600)
    """Longest wait for one answer; past it the episode ends as env_crash."""


class JudgeRewardConfig(Section):
    """A generative reward model (reward `judge`): an LLM grades the answer by a rubric through an OpenAI-compatible API."""

    base_url: str = "http://127.0.0.1:8000/v1"
    """OpenAI-compatible base URL (a second `asyncrl serve`, vLLM, or a hosted API)."""
    model: str = "judge"
    """Model name sent with each request."""
    api_key_env: str = "OPENAI_API_KEY"
    """Environment variable holding the API key (an `asyncrl serve` judge takes a rollout key); unset: 'EMPTY'."""
    rubric: str | None = None
    """Prompt template with {instruction} and {response}; it must ask for 'score: N' (None: the built-in rubric)."""
    max_score: float = Field(10.0, gt=0)
    """Top of the judge's scale; reward = score / max_score (a score outside [0, max_score] counts as unparseable)."""
    max_tokens: int = Field(32, ge=1, le=65536)
    """Token budget of the judge's verdict."""
    temperature: float = Field(0.0, ge=0.0, le=10.0)
    """Sampling temperature of the judge."""
    timeout_s: float = Field(30.0, gt=0, le=3600)
    """Longest wait for one verdict; past it the episode ends as env_crash."""
    max_retries: int = Field(0, ge=0, le=10)
    """Retries of a failed judge call (the openai client's own backoff)."""


class RewardsConfig(Section):
    """Settings of the built-in reward plug-ins that call a service (envs/rewards/)."""

    http: HTTPRewardConfig = HTTPRewardConfig()
    """The HTTP reward-model service."""
    judge: JudgeRewardConfig = JudgeRewardConfig()
    """The LLM judge."""
