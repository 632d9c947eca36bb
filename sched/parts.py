"""What the loop drives, as types: two small clients (the learner, the rollout engines), the store
as the loop may use it, and `Parts`.

    LearnerClient  train_step, weights (what a push sends), save, usage, and after a death: check, restart
    WorkerGroup    engines (the gateway's handles), update_weights, versions, health, and the
                   replacement of engines that die: attach (to the gateway's routing), serving,
                   replaced, check, close
    LoopStore      the store's hand-off (claim, ack, counts) and aborting the rollouts no episode
                   drives any more (list, abort); nothing that records
    ReclaimStore   the hand-off of the run's store opened to take back a dead learner's leases, and close

`sched/clients.py` implements the two clients over Ray actors (`asyncrl run`) and over objects in this
process (the same loop without Ray); `asyncrl/jobs/run.py` builds the Parts.

A dead rollout worker is the group's own business: it leaves routing and pushes at once and a
replacement joins routing once it serves the current weights; the loop only reads what happened
(`replaced`). A dead learner is the loop's: its clients raise `LearnerDied`, and the loop restarts
it from the last checkpoint (`sched/recovery.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from asyncrl.gateway.store import TrajectoryHandOff
from asyncrl.records import Batch, StepResult, Trajectory

if TYPE_CHECKING:
    from openai import DefaultAioHttpClient
    from transformers import PreTrainedTokenizerBase

    from asyncrl.distill.teachers import Teachers
    from asyncrl.gateway.engines import EngineHandle
    from asyncrl.gateway.pool import Routing
    from asyncrl.lifecycle import RolloutLifecycle
    from asyncrl.runlog import MetricsLog

    from .display import Display
    from .rundir import RunDir
    from .tasks import TaskMix

Weights = Any
"""The learner's weights in transit: a state dict, or a Ray ObjectRef to one (never fetched by the driver)."""


class LearnerDied(RuntimeError):
    """The learner's process is gone: its weights and optimizer state since the last checkpoint with it."""


class LearnerClient(Protocol):
    async def train_step(self, batch: Batch) -> StepResult:
        """One optimizer step on complete groups; what it did."""
        ...

    async def weights(self) -> Weights:
        """The current weights, in the form `WorkerGroup.update_weights` takes."""
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
    engines: list[EngineHandle]
    """One handle per rollout engine the group started with, for the gateway (replacements join it
    through the routing given to `attach`)."""

    async def update_weights(self, weights: Weights, version: int) -> list[int]:
        """Every engine serves `weights` as `version` once this returns; raises if any refused them."""
        ...

    async def versions(self) -> list[int]:
        """The policy version each engine serves."""
        ...

    async def health(self) -> list[dict]:
        """Each engine's health record (`EmbeddedEngine.health`)."""
        ...

    def attach(self, routing: Routing) -> None:
        """Start watching the engines (after the first push): one that dies leaves `routing`, pushes and
        `versions`; its replacement loads the latest pushed weights and version, then joins `routing`."""
        ...

    def serving(self) -> int:
        """Engines serving now (0 while the only one is being replaced: nothing can be admitted)."""
        ...

    def replaced(self) -> list[dict]:
        """Records of the replacements finished since the last call (what died, when, how long it took)."""
        ...

    def check(self) -> None:
        """Raise why an engine that died could not be replaced, if one could not."""
        ...

    async def close(self) -> None:
        """Stop watching (before the run kills its actors: those deaths are not to be replaced)."""
        ...


class LoopStore(TrajectoryHandOff, Protocol):
    """The trajectory store as the loop may use it: the hand-off of terminal trajectories to the learner
    (`TrajectoryHandOff`: claim, ack, counts), and ending the rollouts no episode drives any more, at a
    resume and at the end of a run (`sched/resume.py` abort_running). It opens and records nothing: the
    gateway records, the loop takes what was recorded. With `store.keep_trajectories=false` the books also
    delete what they acknowledged, from a store that is a `TrajectoryPruner` too (checked when they do)."""

    def abort(self, rollout_id: str, reason: str = "") -> None:
        """End a running rollout without a reward (status aborted); RolloutClosed if it already ended."""
        ...

    def list(
        self, *, status: str | None = None, group_id: str | None = None, limit: int | None = None, offset: int = 0
    ) -> list[Trajectory]:
        """Trajectories in the order they were opened (the loop lists the running ones only)."""
        ...


class ReclaimStore(TrajectoryHandOff, Protocol):
    """This run's store with no visibility timeout, opened to claim again what a dead learner held, then closed."""

    def close(self) -> None: ...


@dataclass
class Parts:
    store: LoopStore
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
    reclaim_store: Callable[[], ReclaimStore] | None = None
    """Opens this run's store with no visibility timeout (every lease counts as expired), to take back
    what a dead learner held; None: a learner that dies ends the run."""
