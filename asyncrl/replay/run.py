"""A recorded run opened for replay: its config, checkpoints, learner batches, metrics and trajectories.

Every replay verb starts here (`RunView.open`). Nothing in it writes: the store is opened through
`open_reader` (a SQLite file read-only, Redis through its reading verbs alone), and the run directory
is only read. What a replay needs and the run did not keep is a `ReplayError` that says which setting
would have kept it; an unknown rollout, step or checkpoint lists what exists.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from asyncrl.configs.schema import RunConfig
from asyncrl.gateway.store import ReadOnlyStore, UnknownRollout, open_reader
from asyncrl.records import Trajectory
from asyncrl.sched.rundir import LOOP_STATE_FILE, BatchRecord, RunDir

SHOWN = 8
"""How many existing ids, steps or checkpoints an error lists."""


class ReplayError(Exception):
    """What a replay asked for is not in the run (or not kept); the message says what exists."""


@dataclass(frozen=True)
class CheckpointRef:
    """A policy a replay can load: a checkpoint of the run (`step-N`), or the policy RL started from."""

    version: int
    """The learner version of these weights (optimizer steps taken); 0 for the starting policy."""
    path: Path | None
    """The checkpoint directory; None for a starting policy the config builds from its seed (the tiny policy)."""
    label: str
    """How reports name it: `v12`, or `start`."""


@dataclass(frozen=True)
class Selection:
    """Which trajectories to replay; every field given narrows it."""

    rollout_id: str | None = None
    step: int | None = None
    """The rollouts learner step `step` trained (needs the run's batch records)."""
    task: str | None = None
    status: str | None = None
    reward_min: float | None = None
    reward_max: float | None = None
    limit: int | None = None


class RunView:
    """Read-only access to one run directory (and the store it recorded into)."""

    def __init__(self, rundir: RunDir, config: RunConfig, store: ReadOnlyStore) -> None:
        self.rundir, self.config, self.store = rundir, config, store

    @classmethod
    def open(cls, run: str | Path) -> RunView:
        path = Path(run)
        if not path.is_dir():
            raise ReplayError(f"{run}: no such run directory")
        rundir = RunDir(path)
        try:
            config = rundir.read_config()
        except FileNotFoundError as e:
            raise ReplayError(str(e)) from None
        address = rundir.store_address(config)
        try:
            store = open_reader(address, namespace=rundir.store_namespace(config))
        except FileNotFoundError:
            raise ReplayError(f"{run}: the run's trajectory store {address} does not exist") from None
        return cls(rundir, config, store)

    def close(self) -> None:
        self.store.close()

    def __enter__(self) -> RunView:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def path(self) -> Path:
        return self.rundir.path

    # -- checkpoints --------------------------------------------------------------------------

    def start(self) -> CheckpointRef:
        """The policy RL started from: `policy.path` (the SFT warm start), or the tiny policy of the seed."""
        path = self.config.policy.path
        return CheckpointRef(0, Path(path) if path else None, "start")

    def checkpoints(self) -> list[CheckpointRef]:
        """The starting policy, then every complete checkpoint of the run, oldest first."""
        found = [self.start()]
        for state in sorted(self.rundir.checkpoints.glob(f"step-*/{LOOP_STATE_FILE}")):
            version = int(state.parent.name.removeprefix("step-"))
            if version > 0:
                found.append(CheckpointRef(version, state.parent, f"v{version}"))
        return found

    def checkpoint(self, version: int) -> CheckpointRef:
        """The checkpoint of exactly `version`."""
        for ref in self.checkpoints():
            if ref.version == version:
                return ref
        raise ReplayError(
            f"no checkpoint of version {version} in {self.path}: there are {_listed(r.version for r in self.checkpoints())}"
            f" (learner.checkpoint_every={self.config.learner.checkpoint_every} and the retention settings decide which are kept)"
        )

    def nearest_checkpoint(self, version: int) -> CheckpointRef:
        """The kept checkpoint closest to `version` (the earlier one on a tie)."""
        return min(self.checkpoints(), key=lambda ref: (abs(ref.version - version), ref.version))

    def checkpoint_at_or_before(self, version: int) -> CheckpointRef:
        before = [ref for ref in self.checkpoints() if ref.version <= version]
        return before[-1] if before else self.start()

    def final_checkpoint(self) -> CheckpointRef:
        return self.checkpoints()[-1]

    # -- learner steps ------------------------------------------------------------------------

    def batch(self, step: int) -> BatchRecord:
        record = self.rundir.read_batch(step)
        if record is not None:
            return record
        steps = self.rundir.batch_steps()
        if not steps:
            raise ReplayError(f"{self.path} recorded no learner batches: run with loop.record_batches=true to replay learner steps")
        raise ReplayError(f"no batch of learner step {step} in {self.path}: recorded steps are {_listed(steps)}")

    def metrics(self) -> list[dict]:
        path = self.path / "metrics.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def step_metrics(self, step: int) -> dict | None:
        """The metrics record learner step `step` logged (the last one, if a resume logged it twice)."""
        found = [r for r in self.metrics() if r.get("step") == step and "loss" in r and "event" not in r and r.get("stepped", True)]
        return found[-1] if found else None

    # -- trajectories -------------------------------------------------------------------------

    def trajectory(self, rollout_id: str) -> Trajectory:
        try:
            return self.store.get(rollout_id)
        except UnknownRollout:
            some = [t.rollout_id for t in self.store.list(limit=SHOWN)]
            raise ReplayError(
                f"no rollout {rollout_id!r} in {self.path}"
                + (f"; some that exist: {', '.join(some)}" if some else " (the store holds none)")
            ) from None

    def select(self, selection: Selection) -> list[Trajectory]:
        """The trajectories `selection` names, in recording order (a step's in the order it trained them)."""
        if selection.rollout_id is not None:
            candidates = [self.trajectory(selection.rollout_id)]
        elif selection.step is not None:
            candidates = [self.trajectory(rid) for group in self.batch(selection.step).groups for rid in group]
        else:
            candidates = self.store.list(status=selection.status)
        chosen = [t for t in candidates if _matches(t, selection)]
        return chosen[: selection.limit] if selection.limit is not None else chosen


def _matches(t: Trajectory, s: Selection) -> bool:
    if s.task is not None and t.task != s.task:
        return False
    if s.status is not None and t.status != s.status:
        return False
    if s.reward_min is not None and (t.reward is None or t.reward < s.reward_min):
        return False
    return not (s.reward_max is not None and (t.reward is None or t.reward > s.reward_max))


def _listed(values: Iterable[object]) -> str:
    values = list(values)
    shown = ", ".join(map(str, values[:SHOWN]))
    return shown + (f", ... ({len(values)} in all)" if len(values) > SHOWN else "") if values else "none"
