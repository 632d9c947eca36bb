"""The typed configuration of a post-training pipeline (`asyncrl pipeline`, asyncrl/jobs/pipeline.py).

A pipeline file names a `base` run config (a mapping of RunConfig sections every stage starts from)
and an ordered mapping of `stages`. Each stage has a kind, its own tasks (an RL stage's training
mix, which is also its held-out eval), the teachers of a distillation stage, and `config`: RunConfig
sections laid over the base for that stage alone. `stage_config` resolves one stage into a validated
RunConfig; an invalid key is reported with its full path in the pipeline file
(`stages.reasoning.config.loop.steps: ...`).
"""

from __future__ import annotations

import copy
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, model_validator

from .loader import ConfigError, apply_override, format_validation_error, read_yaml
from .models import resolve_model_path
from .schema import RunConfig, Section, TaskSpec


class StageSpec(Section):
    """One stage of the pipeline; it starts from the previous stage's final checkpoint."""

    kind: Literal["sft", "rl", "distill"]
    """sft: supervised warm start from demonstrations; rl: RL on `tasks`; distill: on-policy cross-stage
    distillation from the earlier RL stages' final checkpoints (`teachers`)."""
    tasks: dict[str, TaskSpec] = Field(default_factory=dict)
    """rl: the stage's task mix (task name -> environment, ratio); each task's held-out eval is a column
    of the evaluation matrix and the stage's own eval. sft: the task `sft.task` names, whose environment's
    demonstrations it trains on and whose held-out split scores it (none: the built-in ones)."""
    teachers: dict[str, float] | None = None
    """distill: earlier RL stage name -> share of the student's prompts; unset: every earlier RL stage at 1."""
    config: dict[str, Any] = Field(default_factory=dict)
    """RunConfig sections for this stage, laid over `base` (e.g. loop.wall_budget_s, learner.lr)."""

    @model_validator(mode="after")
    def _check_kind(self) -> StageSpec:
        if self.kind == "rl" and not self.tasks:
            raise ValueError("an rl stage needs tasks (tasks.NAME.env: ENVIRONMENT)")
        if self.kind == "distill" and self.tasks:
            raise ValueError("a distill stage takes no tasks (its prompts come from its teachers)")
        if self.kind == "sft" and self.tasks and self.config.get("sft", {}).get("task") not in self.tasks:
            raise ValueError(f"an sft stage's tasks are for sft.task: set config.sft.task to one of {', '.join(self.tasks)}")
        if self.kind != "distill" and self.teachers is not None:
            raise ValueError("only a distill stage has teachers")
        for section in ("policy", "name", "runs_dir"):
            if section in self.config:
                raise ValueError(f"config.{section} is set by the pipeline (each stage starts from the previous "
                                 "stage's checkpoint, in the pipeline directory)")  # fmt: skip
        if "mix" in self.config.get("tasks", {}) or "teachers" in self.config.get("distill", {}):
            raise ValueError("set the stage's tasks and teachers at the stage level, not in config")
        return self


class PipelineConfig(Section):
    """A whole post-training pipeline. The preset `pipeline` is SFT -> Reasoning RL -> Agentic RL ->
    General RL -> distillation."""

    name: str = Field("pipeline", min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    """Pipeline name; its directory is <runs_dir>/<name>, each stage's run directory inside it."""
    runs_dir: str = "runs"
    """Folder that holds pipeline directories."""
    base: dict[str, Any] = Field(default_factory=dict)
    """RunConfig sections shared by every stage (policy shape, rollout, learner, task options)."""
    stages: dict[str, StageSpec]
    """Stage name -> stage, run in the order written; a stage set to null is left out (`stages.agentic=null`)."""

    @model_validator(mode="before")
    @classmethod
    def _drop_null_stages(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("stages"), dict):
            data = {**data, "stages": {name: stage for name, stage in data["stages"].items() if stage is not None}}
        return data

    @model_validator(mode="after")
    def _check_stages(self) -> PipelineConfig:
        if not self.stages:
            raise ValueError("stages is empty")
        if "mix" in self.base.get("tasks", {}) or "teachers" in self.base.get("distill", {}):
            raise ValueError("base: tasks.mix and distill.teachers belong to the stages (stages.NAME.tasks / .teachers)")
        names = list(self.stages)
        if not any(stage.kind == "rl" for stage in self.stages.values()):
            raise ValueError("stages: a pipeline needs at least one rl stage (its tasks are the evaluation matrix's columns)")
        for position, (name, stage) in enumerate(self.stages.items()):
            if not all(c.isalnum() or c in "_.-" for c in name):
                raise ValueError(f"stage name {name!r} must be letters, digits, '_', '.' or '-'")
            if stage.kind == "sft" and position:
                raise ValueError(f"stages.{name}: an sft stage can only come first")
            earlier_rl = [n for n in names[:position] if self.stages[n].kind == "rl"]
            if stage.kind == "distill":
                if not earlier_rl:
                    raise ValueError(f"stages.{name}: a distill stage needs an earlier rl stage to learn from")
                for teacher in stage.teachers or {}:
                    if teacher not in earlier_rl:
                        raise ValueError(f"stages.{name}.teachers.{teacher}: not an earlier rl stage ({', '.join(earlier_rl)})")
        if self.stages[names[0]].kind != "sft" and not self.base.get("policy", {}).get("path"):
            raise ValueError("the first stage is not sft: set base.policy.path to the checkpoint it starts from")
        return self

    def start_path(self) -> str | None:
        """The checkpoint the first stage starts from (`base.policy.path`; a fetched catalog model's name
        resolved to its directory, as a RunConfig resolves it); None: the tiny policy."""
        path = self.base.get("policy", {}).get("path")
        return None if path is None else resolve_model_path(path)

    def teachers(self, stage: str) -> dict[str, float]:
        """A distill stage's teacher stages and their prompt shares."""
        spec = self.stages[stage]
        if spec.teachers is not None:
            return dict(spec.teachers)
        names = list(self.stages)
        return {n: 1.0 for n in names[: names.index(stage)] if self.stages[n].kind == "rl"}

    def eval_tasks(self) -> dict[str, TaskSpec]:
        """The evaluation matrix's columns: every RL stage's tasks, in stage order (first definition wins)."""
        columns: dict[str, TaskSpec] = {}
        for stage in self.stages.values():
            for name, task in stage.tasks.items() if stage.kind == "rl" else ():
                columns.setdefault(name, task)
        return columns

    def owner(self, task: str) -> str:
        """The first RL stage that trains `task` (its teacher in distillation)."""
        return next(name for name, stage in self.stages.items() if stage.kind == "rl" and task in stage.tasks)


def _deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    merged = copy.deepcopy(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def stage_config(pipeline: PipelineConfig, stage: str, directory: str, sections: dict[str, Any]) -> RunConfig:
    """The stage's RunConfig: base, then the stage's config, then `sections` (what the pipeline sets:
    policy.path, teachers), named `stage` and kept in `directory`. Errors name the pipeline key."""
    spec = pipeline.stages[stage]
    data = _deep_merge(_deep_merge(pipeline.base, spec.config), sections)
    data.update(name=stage, runs_dir=directory)
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        message = format_validation_error(err).replace("\n  ", f"\n  stages.{stage}: ")
        raise ConfigError(
            message.replace("invalid config:", f"invalid config for stage {stage!r} (base + stages.{stage}.config):")
        ) from None


def load_pipeline(source: str, overrides: list[str] | tuple[str, ...] = ()) -> PipelineConfig:
    """A pipeline file (or preset name) plus dotted overrides (`stages.reasoning.config.loop.steps=50`),
    validated, with every stage's RunConfig resolved once so a bad stage fails before anything runs."""
    data = read_yaml(source)
    return validate_pipeline(data, overrides)


def validate_pipeline(data: dict[str, Any], overrides: list[str] | tuple[str, ...] = ()) -> PipelineConfig:
    data = copy.deepcopy(data)
    for override in overrides:
        apply_override(data, override)
    try:
        pipeline = PipelineConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, PipelineConfig).replace("invalid config", "invalid pipeline config")) from None
    for stage in pipeline.stages:
        stage_config(pipeline, stage, pipeline.runs_dir, _placeholder_sections(pipeline, stage))
    return pipeline


def _placeholder_sections(pipeline: PipelineConfig, stage: str) -> dict[str, Any]:
    """What the pipeline will set for `stage`, with placeholder checkpoints, for validation."""
    if pipeline.stages[stage].kind == "distill":
        teachers = {task: {"checkpoint": "<teacher>"} for task in distill_tasks(pipeline, stage)}
        return {"policy": {"path": "<previous stage>"}, "distill": {"teachers": teachers}}
    spec = pipeline.stages[stage]
    tasks = {"tasks": {"mix": {name: task.model_dump() for name, task in spec.tasks.items()}}} if spec.tasks else {}
    return {"policy": {"path": "<previous stage>"}, **tasks} if spec.kind == "rl" else tasks


def distill_tasks(pipeline: PipelineConfig, stage: str) -> dict[str, tuple[str, TaskSpec, float]]:
    """A distill stage's prompt tasks: task name -> (teacher stage, task spec, prompt share). A teacher
    stage with several tasks splits its share among them by their ratios."""
    out: dict[str, tuple[str, TaskSpec, float]] = {}
    for teacher, share in pipeline.teachers(stage).items():
        tasks = pipeline.stages[teacher].tasks
        total = sum(task.ratio for task in tasks.values())
        for name, task in tasks.items():
            out.setdefault(name, (teacher, task, share * task.ratio / total))
    return out


def dump_pipeline(pipeline: PipelineConfig) -> str:
    return yaml.safe_dump(pipeline.model_dump(mode="json"), sort_keys=False)
