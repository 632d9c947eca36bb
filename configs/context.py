"""What an environment or reward plug-in is built with: the few settings of the run it may read.

`from_config(context, **options)` hooks (envs/registry.py, envs/rewards/registry.py) get an
`EnvContext`, not the whole `RunConfig`: a plug-in depends on these fields only, so the rest of the
config can change without breaking plug-ins, and a test builds one with `EnvContext()` (the
defaults of a run) or `EnvContext(seed=3, ...)`.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from .schema import LoopConfig, RewardsConfig, RunConfig, SamplingConfig, TasksConfig


class EnvContext(BaseModel):
    """The run's settings a plug-in may read; `EnvContext.of(config)` takes them from a RunConfig."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    seed: int = 0
    """The run's global seed."""
    tasks: TasksConfig = TasksConfig()
    """The built-in tasks' settings (`tasks.arithmetic`, `tasks.agentic`, `tasks.general`)."""
    rewards: RewardsConfig = RewardsConfig()
    """Settings of the reward plug-ins that call a service (`rewards.http`, `rewards.judge`)."""
    sampling: SamplingConfig = SamplingConfig()
    """The rollouts' sampling defaults; episodes sample at `sampling.temperature`, the learner's."""
    episode_max_tokens: int = Field(LoopConfig().episode_max_tokens, ge=1)
    """Answer budget of each training episode, in tokens."""

    @classmethod
    def of(cls, config: RunConfig) -> EnvContext:
        """The plug-ins' view of `config`."""
        return cls(
            seed=config.seed,
            tasks=config.tasks,
            rewards=config.rewards,
            sampling=config.rollout.sampling,
            episode_max_tokens=config.loop.episode_max_tokens,
        )
