"""The teachers of cross-stage distillation: one scoring engine per earlier stage.

A teacher given as a checkpoint is that stage's final checkpoint behind a `NativeScorer`
(rollout/scoring.py) in its own Ray actor (`ScoringWorker`, started by `asyncrl run`). A teacher given as a url is a
gateway serving that checkpoint elsewhere (`asyncrl serve`), scored through its token-level
endpoint `POST /v1/tokens/score`, with no actor here. Either way it scores the student's token IDs
prefill-only and never samples.
`Teachers.score` routes every finished sample of a batch to the teacher of its stage (the sample's task
name), attaches the teacher's log-probs and measures the reverse KL per teacher. It is the one
verb the loop calls between collecting samples and handing them to the learner.

A teacher scores each token at the temperature the learner takes that token's log-prob at
(`Sample.scoring_temperatures`: the temperature its turn sampled at, 1 for greedy tokens, the run's
where none is on record), so the distillation advantage compares the two at one temperature. That
is one scoring call per teacher and temperature; a run that samples at one temperature makes one.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Protocol

import httpx

from asyncrl.configs.schema import RunConfig
from asyncrl.records import MAX_SCORE_SEQUENCES, Batch, Sample

KL_PREFIX = "reverse_kl/"
"""Metric key of a teacher's reverse KL (`reverse_kl/<teacher>`), one value per learner step."""
HTTP_CHUNK_TOKENS = 262_144
"""Tokens in one request to a url teacher: well under the gateway's default 8 MiB body limit."""


@dataclass
class ScoredSample(Sample):
    """A learner sample with its teacher's log-prob of every token (what makes it a distillation sample)."""

    teacher: str = ""
    teacher_logprobs: list[float] | None = None
    """Aligned with token_ids; entry 0 is 0.0."""


class TeacherScorer(Protocol):
    """What a teacher is to `Teachers`: the log-prob of every token of each sequence given the ones
    before it (entry 0 is 0.0), at `temperature`. Checkpoint teachers are `ScoringWorker` actors
    behind `RayScorer` (rollout/worker.py); url teachers are `HttpTeacher`s."""

    async def score(self, sequences: list[list[int]], temperature: float) -> list[list[float]]: ...


class TeacherError(RuntimeError):
    """A url teacher did not answer with scores; the message names the teacher, its url and why."""


class HttpTeacher:
    """A teacher behind a gateway: the student's token IDs go to `{url}/v1/tokens/score`, with that
    gateway's run token (`asyncrl token` of the run serving it; None for a gateway with auth off)."""

    def __init__(self, name: str, url: str, token: str | None = None) -> None:
        self.name, self.url = name, url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}

    def __repr__(self) -> str:  # never the token
        return f"HttpTeacher({self.name!r}, {self.url!r})"

    async def score(self, sequences: list[list[int]], temperature: float) -> list[list[float]]:
        # A client per call: the loop that calls may differ between calls (one per asyncio.run).
        # No read timeout: the gateway's request_timeout_s bounds every call and answers a 504.
        async with httpx.AsyncClient(base_url=self.url, timeout=httpx.Timeout(None, connect=10.0), headers=self._headers) as client:
            parts = await asyncio.gather(*(self._post(client, chunk, temperature) for chunk in _chunks(sequences)))
        return [logprobs for part in parts for logprobs in part]

    async def _post(self, client: httpx.AsyncClient, sequences: list[list[int]], temperature: float) -> list[list[float]]:
        where = f"teacher {self.name!r} at {self.url}"
        try:
            response = await client.post("/v1/tokens/score", json={"sequences": sequences, "temperature": temperature})
        except httpx.HTTPError as error:
            raise TeacherError(f"{where} is unreachable: {type(error).__name__}: {error}") from None
        if response.status_code == 401:
            raise TeacherError(f"{where} refused the run token ({response.text[:300]}); give the teacher the token of the run serving it")
        if response.status_code != 200:
            raise TeacherError(f"{where} answered HTTP {response.status_code}: {response.text[:500]}")
        logprobs = response.json().get("logprobs")
        if not isinstance(logprobs, list) or len(logprobs) != len(sequences):
            raise TeacherError(f"{where} answered {len(logprobs or [])} score rows for {len(sequences)} sequences")
        return logprobs


def _chunks(sequences: list[list[int]]) -> list[list[list[int]]]:
    """Consecutive runs of at most MAX_SCORE_SEQUENCES sequences and about HTTP_CHUNK_TOKENS tokens."""
    chunks: list[list[list[int]]] = []
    tokens = 0
    for sequence in sequences:
        if not chunks or len(chunks[-1]) == MAX_SCORE_SEQUENCES or tokens + len(sequence) > HTTP_CHUNK_TOKENS:
            chunks.append([])
            tokens = 0
        chunks[-1].append(sequence)
        tokens += len(sequence)
    return chunks


def _teacher_token(name: str, spec) -> str | None:
    """The run token of the gateway serving a url teacher, from the environment variable the teacher's
    `token_env` names (a token in the config file would be copied into every run directory)."""
    variable = spec.token_env
    if variable and variable not in os.environ:
        raise TeacherError(f"distill.teachers.{name}.token_env: environment variable {variable} is not set (`asyncrl token RUN` prints it)")
    return os.environ[variable] if variable else None


def check_checkpoints(config: RunConfig) -> None:
    """FileNotFoundError naming the first teacher whose checkpoint is not a model directory (url teachers
    are checked when first scored: their gateway may start after this run's config is written)."""
    for name, spec in config.distill.teachers.items():
        if spec.checkpoint and not (Path(spec.checkpoint) / "config.json").is_file():
            raise FileNotFoundError(f"teacher {name!r}: {spec.checkpoint} is not a checkpoint directory (no config.json)")


class Teachers:
    """Scores samples with the teacher of their stage; `handles` maps teacher name -> its
    `TeacherScorer`."""

    def __init__(self, handles: dict, temperature: float, skip_statuses: Sequence[str] = ("aborted", "env_crash", "error")) -> None:
        self.handles = handles
        self.temperature = temperature
        """The run's sampling temperature, for tokens with none on record (each token is scored at its own)."""
        self.skip_statuses = frozenset(skip_statuses)

    @classmethod
    def from_config(cls, config: RunConfig, handles: dict) -> Teachers:
        """`handles`: the checkpoint teachers' scorers (`asyncrl run` starts them); the url teachers are
        added here."""
        skipped = ("aborted", *config.learner.crash_statuses)
        teachers = config.distill.teachers.items()
        remote = {name: HttpTeacher(name, spec.url, _teacher_token(name, spec)) for name, spec in teachers if spec.url}
        return cls({**handles, **remote}, config.rollout.sampling.temperature, skipped)

    async def score(self, batch: Batch) -> tuple[Batch, dict[str, float]]:
        """The batch with teacher log-probs attached to its samples, and `reverse_kl/<teacher>` per teacher.

        Samples the learner will drop anyway (aborted, crashed, nothing sampled) pass through
        unscored. A sample whose task has no teacher is an error: its advantage would be undefined.
        """
        samples = batch.samples
        wanted: dict[str, list[int]] = {}
        for i, sample in enumerate(samples):
            if sample.status in self.skip_statuses or not any(sample.loss_mask):
                continue
            if sample.task not in self.handles:
                raise ValueError(f"rollout {sample.rollout_id}: task {sample.task!r} has no teacher (teachers: {', '.join(self.handles)})")
            wanted.setdefault(sample.task, []).append(i)
        names = list(wanted)
        scored = await asyncio.gather(*(self._score(name, [samples[i] for i in wanted[name]]) for name in names))
        out: list[Sample] = list(samples)
        metrics: dict[str, float] = {}
        for name, logprobs in zip(names, scored, strict=True):
            total, count = 0.0, 0
            for i, teacher_logprobs in zip(wanted[name], logprobs, strict=True):
                out[i] = ScoredSample(**_sample_fields(samples[i]), teacher=name, teacher_logprobs=teacher_logprobs)
                kl, n = reverse_kl(samples[i].logprobs, teacher_logprobs, samples[i].loss_mask)
                total, count = total + kl, count + n
            if count:
                metrics[KL_PREFIX + name] = total / count
        scored_samples = iter(out)
        return Batch([[next(scored_samples) for _ in group] for group in batch.groups]), metrics

    async def _score(self, name: str, samples: list[Sample]) -> list[list[float]]:
        """Teacher `name`'s log-prob of every token of each sample, each at its scoring temperature: one
        call per temperature among the samples' sampled tokens, then each token's from its call."""
        temperatures = [sample.scoring_temperatures(self.temperature) for sample in samples]
        wanted: dict[float, list[int]] = {}
        for i, (sample, row) in enumerate(zip(samples, temperatures, strict=True)):
            for temperature in dict.fromkeys(t for t, sampled in zip(row, sample.loss_mask, strict=True) if sampled):
                wanted.setdefault(temperature, []).append(i)
        calls = list(wanted)
        scored = await asyncio.gather(*(self.handles[name].score([samples[i].token_ids for i in wanted[t]], t) for t in calls))
        by_temperature: list[dict[float, list[float]]] = [{} for _ in samples]
        for temperature, rows in zip(calls, scored, strict=True):
            for i, logprobs in zip(wanted[temperature], rows, strict=True):
                by_temperature[i][temperature] = logprobs
        return [_per_token(rows, row) for rows, row in zip(by_temperature, temperatures, strict=True)]


def _per_token(scored: dict[float, list[float]], temperatures: list[float]) -> list[float]:
    """One sample's teacher log-probs, each token's from the call at its temperature (tokens the policy
    did not sample, which no loss reads, from any call)."""
    first = next(iter(scored.values()))
    if len(scored) == 1:
        return first
    return [scored.get(t, first)[j] for j, t in enumerate(temperatures)]


def _sample_fields(sample: Sample) -> dict:
    return {f.name: getattr(sample, f.name) for f in fields(Sample)}


def reverse_kl(student_logprobs: list[float], teacher_logprobs: list[float], loss_mask: list[int]) -> tuple[float, int]:
    """(sum over sampled tokens of log pi_student - log pi_teacher, number of sampled tokens).

    The sum's mean is the Monte-Carlo estimate of KL(pi_student || pi_teacher) per token on the
    student's own samples: the quantity distillation drives down.
    """
    total, count = 0.0, 0
    for student, teacher, sampled in zip(student_logprobs, teacher_logprobs, loss_mask, strict=True):
        if sampled:
            total += student - teacher
            count += 1
    return total, count
