"""What the loop drives, as types: two small clients (the learner, the rollout engines) and `Parts`.

    LearnerClient  train_step, weights (what a push sends), save
    WorkerGroup    engines (the gateway's handles), update_weights, versions, health

`sched/clients.py` implements both over Ray actors (`asyncrl run`) and over objects in this
process (the same loop without Ray); `sched/run.py` builds the Parts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from asyncrl.records import Sample

if TYPE_CHECKING:
    from openai import DefaultAioHttpClient
    from transformers import PreTrainedTokenizerBase

    from asyncrl.distill.teachers import Teachers
    from asyncrl.gateway.engines import EngineHandle
    from asyncrl.gateway.store import TrajectoryStore
    from asyncrl.lifecycle import RolloutLifecycle
    from asyncrl.runlog import MetricsLog

    from .display import Display
    from .rundir import RunDir
    from .tasks import TaskMix

Weights = Any
"""The learner's weights in transit: a state dict, or a Ray ObjectRef to one (never fetched by the driver)."""


class LearnerClient(Protocol):
    async def train_step(self, samples: list[Sample]) -> dict:
        """One optimizer step on complete groups; its metrics, with `version`, `push_due` and `ledger`."""
        ...

    async def weights(self) -> Weights:
        """The current weights, in the form `WorkerGroup.update_weights` takes."""
        ...

    async def save(self, directory: str) -> None:
        """A checkpoint of the policy, optimizer and version in `directory`."""
        ...


class WorkerGroup(Protocol):
    engines: list[EngineHandle]
    """One handle per rollout engine, for the gateway."""

    async def update_weights(self, weights: Weights, version: int) -> list[int]:
        """Every engine serves `weights` as `version` once this returns; raises if any refused them."""
        ...

    async def versions(self) -> list[int]:
        """The policy version each engine serves."""
        ...

    async def health(self) -> list[dict]:
        """Each engine's health record (`EmbeddedEngine.health`)."""
        ...


@dataclass
class Parts:
    store: TrajectoryStore
    gateway: RolloutLifecycle
    """What episodes (training and evaluation) open and finish their rollouts with: the in-process gateway's lifecycle."""
    http: DefaultAioHttpClient
    """Shared by every episode's OpenAI client (`gateway/serving.py` episode_http_client)."""
    tasks: TaskMix
    learner: LearnerClient
    workers: WorkerGroup
    tokenizer: PreTrainedTokenizerBase
    rundir: RunDir
    metrics: MetricsLog
    display: Display
    teachers: Teachers | None = None
    """A distillation run's teachers score every batch before the learner sees it; None in RL."""
