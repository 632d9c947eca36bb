"""What the loop drives, as types: the learner's client, the rollout engines as a worker group and their
supervision, and `Parts`, everything a run hands the loop.

    LearnerClient      train_step, weights (what a push sends), save, usage, and after a death: check, restart
    WorkerGroup        the engines that serve: push (every engine serves the weights once it returns),
                       versions, health
    WorkerSupervision  engines that die and are replaced meanwhile: serving, replaced, check

`sched/learners.py` implements the learner client over a Ray actor (`asyncrl run`) and in this process,
`sched/workers.py` the worker group, `sched/supervision.py` its supervision (the same loop runs without
Ray over in-process parts); `asyncrl/jobs/run.py` builds the Parts.

A dead rollout worker is its supervisor's business: it leaves routing and pushes at once and a
replacement joins routing once it serves the current weights; the loop only reads what happened
(`replaced`). A dead learner is the loop's: its client raises `LearnerDied`, and the loop restarts it
from the last checkpoint (`sched/recovery.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from asyncrl.gateway.store import TrajectoryStore
from asyncrl.records import Batch, StepResult

if TYPE_CHECKING:
    from openai import DefaultAioHttpClient
    from transformers import PreTrainedTokenizerBase

    from asyncrl.distill.teachers import Teachers
    from asyncrl.lifecycle import RolloutLifecycle
    from asyncrl.runlog import MetricsLog

    from .display import Display
    from .evaluation import OwnEngineEvaluation
    from .rundir import RunDir
    from .tasks import TaskMix

Weights = Any
"""The learner's weights in transit: a state dict, or a Ray ObjectRef to one (never fetched by the driver),
or a `DirectPush` (`sched/weight_push.py`: the learner sends them itself)."""


class LearnerDied(RuntimeError):
    """The learner's process is gone: its weights and optimizer state since the last checkpoint with it."""


class LearnerClient(Protocol):
    async def train_step(self, batch: Batch) -> StepResult:
        """One optimizer step on complete groups; what it did."""
        ...

    async def weights(self) -> Weights:
        """The current weights, in the form `WorkerGroup.push` takes."""
        ...

    async def save(self, directory: str) -> None:
        """A checkpoint of the policy, optimizer and version in `directory`."""
        ...

    async def check(self) -> None:
        """Raise LearnerDied if the learner is gone (to tell a failed push's cause)."""
        ...

    async def restart(self, checkpoint: str | None) -> None:
        """Replace a dead learner by a fresh one from `checkpoint` (None: the policy the run started from)."""
        ...

    async def usage(self) -> dict:
        """The learner's process CPU time so far: {"process_cpu_s": seconds}."""
        ...


class WorkerGroup(Protocol):
    async def push(self, weights: Weights, version: int) -> list[int]:
        """Every engine serves `weights` as `version` once this returns; raises if any refused them."""
        ...

    async def versions(self) -> list[int]:
        """The policy version each engine serves."""
        ...

    async def health(self) -> list[dict]:
        """Each engine's health record (`EmbeddedEngine.health`)."""
        ...


class WorkerSupervision(Protocol):
    def serving(self) -> int:
        """Engines serving now (0 while the only one is being replaced: nothing can be admitted)."""
        ...

    def replaced(self) -> list[dict]:
        """Records of the replacements finished since the last call (what died, when, how long it took)."""
        ...

    def check(self) -> None:
        """Raise why an engine that died could not be replaced, if one could not."""
        ...


@dataclass
class Parts:
    store: TrajectoryStore
    """The run's trajectory store: the loop claims and acknowledges what the gateway recorded (`sched/resume.py`),
    and aborts the rollouts no episode drives any more; it records nothing itself."""
    gateway: RolloutLifecycle
    """What episodes (training and evaluation) open and finish their rollouts with: the in-process gateway's lifecycle."""
    http: DefaultAioHttpClient
    """Shared by every episode's OpenAI client (`gateway/serving.py` episode_http_client)."""
    tasks: TaskMix
    learner: LearnerClient
    workers: WorkerGroup
    supervision: WorkerSupervision
    tokenizer: PreTrainedTokenizerBase
    rundir: RunDir
    metrics: MetricsLog
    display: Display
    teachers: Teachers | None = None
    """A distillation run's teachers score every batch before the learner sees it; None in RL."""
    evaluation: OwnEngineEvaluation | None = None
    """`eval.engine: own`: held-out evaluations on an engine of their own, beside training (`sched/evaluation.py`);
    None: between pushes, on the serving engines."""
    reclaim_store: Callable[[], TrajectoryStore] | None = None
    """Opens this run's store with no visibility timeout (every lease counts as expired), to take back
    what a dead learner held, then closed; None: a learner that dies ends the run."""
