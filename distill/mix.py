"""The student's prompt mix: each teacher's stage contributes prompts at its configured ratio.

A teacher's name is its stage's task: the task of that name in `tasks.mix` (its environment and
options), or else the built-in environment of that name. The mix is the scheduler's own `TaskMix`
(smooth weighted round robin: over any window the prompts follow the ratios within one group, here
one prompt, per stage), built from those tasks with the distillation ratios in place of the RL
ones, so episodes, sandboxes, rate limits and held-out evaluation work exactly as in an RL run.
"""

from __future__ import annotations

from asyncrl.configs.schema import RunConfig, TaskSpec
from asyncrl.sched.tasks import TaskMix


def distill_tasks(config: RunConfig) -> dict[str, TaskSpec]:
    """Task name -> spec for every teacher, carrying the teacher's prompt ratio."""
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
