"""The teachers of cross-stage distillation: one scoring engine per earlier stage, as Ray actors.

Each teacher is a stage's final checkpoint behind a `NativeScorer` (rollout/scoring.py) in its own
actor, like a rollout worker: it scores the student's token IDs prefill-only, never samples.
`Teachers.score` routes every finished sample to the teacher of its stage (the sample's task
name), attaches the teacher's log-probs and measures the reverse KL per teacher. It is the one
verb the loop calls between collecting samples and handing them to the learner.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path

import ray

from asyncrl.configs.schema import RunConfig
from asyncrl.gateway.samples import Sample

from .advantage import reverse_kl

KL_PREFIX = "reverse_kl/"
"""Metric key of a teacher's reverse KL (`reverse_kl/<teacher>`), one value per learner step."""


@dataclass
class ScoredSample(Sample):
    """A learner sample with its teacher's log-prob of every token (what makes it a distillation sample)."""

    teacher: str = ""
    teacher_logprobs: list[float] | None = None
    """Aligned with token_ids; entry 0 is 0.0."""


@ray.remote
class TeacherWorker:
    """One teacher's scoring engine. Calls run one at a time: each is one batched forward already."""

    def __init__(self, checkpoint: str, torch_threads: int, max_batch_tokens: int) -> None:
        import torch

        from asyncrl.rollout.scoring import NativeScorer

        torch.set_num_threads(torch_threads)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        self.scorer = NativeScorer(checkpoint, max_batch_tokens=max_batch_tokens, device=device)

    def score(self, sequences: list[list[int]], temperature: float) -> list[list[float]]:
        return self.scorer.score(sequences, temperature)


def check_checkpoints(config: RunConfig) -> None:
    """FileNotFoundError naming the first teacher whose checkpoint is not a model directory."""
    for name, spec in config.distill.teachers.items():
        if not (Path(spec.checkpoint) / "config.json").is_file():
            raise FileNotFoundError(f"teacher {name!r}: {spec.checkpoint} is not a checkpoint directory (no config.json)")


def start_teachers(config: RunConfig) -> dict:
    """A TeacherWorker per configured teacher (call after `ray.init()`); refuses a missing checkpoint."""
    check_checkpoints(config)
    distill = config.distill
    options = dict(num_cpus=distill.cpus_per_teacher, num_gpus=distill.gpus_per_teacher)
    return {
        name: TeacherWorker.options(**options).remote(spec.checkpoint, distill.torch_threads, distill.max_batch_tokens)
        for name, spec in distill.teachers.items()
    }


class Teachers:
    """Scores samples with the teacher of their stage; `handles` maps teacher name -> TeacherWorker."""

    def __init__(self, handles: dict, temperature: float, skip_statuses: Sequence[str] = ("aborted", "env_crash", "error")) -> None:
        self.handles = handles
        self.temperature = temperature
        """The rollouts' sampling temperature: teachers score at the temperature the learner scores at."""
        self.skip_statuses = frozenset(skip_statuses)

    @classmethod
    def from_config(cls, config: RunConfig, handles: dict) -> "Teachers":
        skipped = ("aborted", *config.learner.crash_statuses)
        return cls(handles, config.rollout.sampling.temperature, skipped)

    async def score(self, samples: Sequence[Sample]) -> tuple[list[Sample], dict[str, float]]:
        """The samples with teacher log-probs attached, and `reverse_kl/<teacher>` per teacher.

        Samples the learner will drop anyway (aborted, crashed, nothing sampled) pass through
        unscored. A sample whose task has no teacher is an error: its advantage would be undefined.
        """
        wanted: dict[str, list[int]] = {}
        for i, sample in enumerate(samples):
            if sample.status in self.skip_statuses or not any(sample.loss_mask):
                continue
            if sample.task not in self.handles:
                raise ValueError(f"rollout {sample.rollout_id}: task {sample.task!r} has no teacher (teachers: {', '.join(self.handles)})")
            wanted.setdefault(sample.task, []).append(i)
        names = list(wanted)
        scored = await asyncio.gather(*(self._score(name, [samples[i].token_ids for i in wanted[name]]) for name in names))
        out: list[Sample] = list(samples)
        metrics: dict[str, float] = {}
        for name, logprobs in zip(names, scored):
            total, count = 0.0, 0
            for i, teacher_logprobs in zip(wanted[name], logprobs):
                out[i] = ScoredSample(**_sample_fields(samples[i]), teacher=name, teacher_logprobs=teacher_logprobs)
                kl, n = reverse_kl(samples[i].logprobs, teacher_logprobs, samples[i].loss_mask)
                total, count = total + kl, count + n
            if count:
                metrics[KL_PREFIX + name] = total / count
        return out, metrics

    async def _score(self, name: str, sequences: list[list[int]]) -> list[list[float]]:
        return await asyncio.wrap_future(self.handles[name].score.remote(sequences, self.temperature).future())


def _sample_fields(sample: Sample) -> dict:
    return {f.name: getattr(sample, f.name) for f in fields(Sample)}
