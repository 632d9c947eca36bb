"""The task mix: several tasks trained at once, each its own environment, share and rate limit.

A task is a named environment (loaded through envs/registry.py, so built-ins and plug-ins alike)
with a ratio and an optional generation-rate limit (`tasks.mix` in the config). The loop asks
`TaskMix.pick()` which task the next GRPO group comes from:

- shares: smooth weighted round robin over the tasks whose rate limit allows a group now, so over
  any window the groups follow the ratios within one group per task (a random draw would wander);
- rate limits: a token bucket per task in episodes per second, holding at most one group, so a
  limited task starts at most its rate and never bursts after an idle spell.

Every task's episodes go through the same runner into the same store; the only trace of the task in
a trajectory is its `task` field (the task's name). With no mix configured the run is the
reasoning task alone, as before.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from asyncrl.configs.context import EnvContext
from asyncrl.configs.schema import RunConfig, TaskSpec
from asyncrl.envs.base import Environment, needs_sandbox
from asyncrl.envs.registry import load_environment

DEFAULT_MIX = {"reasoning": TaskSpec(env="reasoning")}


@dataclass
class Task:
    name: str
    env: Environment
    ratio: float = 1.0
    max_episodes_per_s: float | None = None
    eval_problems: int | None = None
    sandboxes: Any = None
    """The SandboxBackend its episodes open sandboxes from (None when the environment needs none)."""
    credit: float = 0.0  # smooth weighted round robin
    tokens: float = 0.0  # rate-limit bucket, in episodes
    refilled_at: float = field(default_factory=time.monotonic)


class TaskMix:
    def __init__(self, tasks: list[Task], group_size: int, clock: Callable[[], float] = time.monotonic) -> None:
        if not tasks:
            raise ValueError("the task mix is empty")
        self.tasks, self.group_size, self.clock = tasks, group_size, clock
        now = clock()
        for task in tasks:
            task.tokens, task.refilled_at = float(group_size), now  # each task may start one group at once

    @classmethod
    def from_config(cls, config: RunConfig, env: Environment | None = None) -> TaskMix:
        """The configured mix (or reasoning alone); `env` given: that one environment is the whole mix."""
        if env is not None:
            tasks = [Task(env.name, env)]
        else:
            context = EnvContext.of(config)
            tasks = [
                Task(name, load_environment(spec.env, spec.options, context), spec.ratio, spec.max_episodes_per_s, spec.eval_problems)
                for name, spec in (config.tasks.mix or DEFAULT_MIX).items()
            ]  # fmt: skip
        if any(needs_sandbox(task.env) for task in tasks):
            from asyncrl.envs.sandbox import open_backend

            backend = open_backend(config.sandbox)
            for task in tasks:
                task.sandboxes = backend if needs_sandbox(task.env) else None
        return cls(tasks, config.learner.group_size)

    async def check_sandboxes(self) -> None:
        """Open and close one sandbox of each backend the tasks use. A backend that cannot start
        (bubblewrap missing, no Docker engine or image) raises its SandboxError here, before the run
        starts, rather than ending every episode as env_crash for the whole wall budget."""
        backends = {id(task.sandboxes): task.sandboxes for task in self.tasks if task.sandboxes is not None}
        for backend in backends.values():
            async with backend.open():
                pass

    def pick(self) -> Task | None:
        """The task of the next group, or None while every task is at its rate limit."""
        now = self.clock()
        ready = [task for task in self.tasks if self._refill(task, now) >= self.group_size]
        if not ready:
            return None
        total = sum(task.ratio for task in ready)
        for task in ready:
            task.credit += task.ratio
        chosen = max(ready, key=lambda task: task.credit)
        chosen.credit -= total
        if chosen.max_episodes_per_s is not None:
            chosen.tokens -= self.group_size
        return chosen

    def _refill(self, task: Task, now: float) -> float:
        if task.max_episodes_per_s is None:
            return float("inf")
        task.tokens = min(float(self.group_size), task.tokens + (now - task.refilled_at) * task.max_episodes_per_s)
        task.refilled_at = now
        return task.tokens

    def evaluated(self, default_problems: int) -> list[tuple[Task, int]]:
        """(task, held-out episodes) for every task that is evaluated."""
        pairs = [(task, default_problems if task.eval_problems is None else task.eval_problems) for task in self.tasks]
        return [(task, n) for task, n in pairs if n > 0]


def distill_tasks(config: RunConfig) -> dict[str, TaskSpec]:
    """The student's prompt mix (cross-stage distillation): task name -> spec for every teacher, carrying
    the teacher's prompt ratio. A teacher's name is its stage's task: the task of that name in
    `tasks.mix`, or else the built-in environment of that name."""
    return {
        name: config.tasks.mix.get(name, TaskSpec(env=name)).model_copy(update={"ratio": teacher.ratio})
        for name, teacher in config.distill.teachers.items()
    }


def distill_task_mix(config: RunConfig) -> TaskMix:
    """The task mix of a distillation run (config.distill.teachers must not be empty)."""
    if not config.distill.teachers:
        raise ValueError("distillation needs at least one teacher (distill.teachers)")
    tasks = config.tasks.model_copy(update={"mix": distill_tasks(config)})
    return TaskMix.from_config(config.model_copy(update={"tasks": tasks}))
