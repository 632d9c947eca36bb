"""The run directory: everything an RL run leaves behind, and what `asyncrl run --resume` reads back.

    <runs_dir>/<name>/
        config.yaml          the resolved config (policy.path points at the policy RL started from)
        metrics.jsonl        one record per learner step and per evaluation (wandb/ beside it, offline)
        curves.png           reward and held-out accuracy against step
        consistency.png      learner-vs-rollout log-prob gap, masked tokens per side, ratio quantiles
        summary.json         eval_before, eval_after, wall_s, the ledger
        trajectories.db      the SQLite trajectory store (unless store.type is redis)
        checkpoints/step-N/  HF checkpoint + learner state (LearnerActor.save) + loop_state.json
        batches/step-N.json  what learner step N trained (`BatchRecord`), when loop.record_batches is on
        sft/                 the SFT warm start, when the run did one

A checkpoint is the run's commit point: the trajectories it trained are acknowledged in the store
only once it is on disk, and `loop_state.json` is written last, so a checkpoint without it is
incomplete and ignored.

Retention (`Retention`: `learner.keep_checkpoints_every`, `learner.keep_last_checkpoints`) deletes the
checkpoints it does not keep once a newer one is committed (`Books.checkpoint`) or when asked
(`asyncrl replay prune`); never the newest, never an incomplete one (it may be being written).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from asyncrl.configs.loader import apply_override, dump_config, validate
from asyncrl.configs.schema import LearnerConfig, RunConfig
from asyncrl.gateway.store import SQLITE_FILENAME, TrajectoryStore, open_store
from asyncrl.records import Account
from asyncrl.runlog import MetricsLog, Panel, plot_panels

CONFIG_FILE, SUMMARY_FILE, LOOP_STATE_FILE = "config.yaml", "summary.json", "loop_state.json"


def empty_ledger() -> dict[str, int]:
    return {account.value: 0 for account in Account}


@dataclass
class LoopState:
    """What the loop remembers across a restart, beside the learner's own weights and optimizer."""

    version: int = 0
    """Learner policy version (= optimizer steps taken)."""
    ledger: dict[str, int] = field(default_factory=empty_ledger)
    """Accounts of every rollout acknowledged in the store so far."""
    eval_before: float | None = None
    """Held-out accuracy of the policy RL started from."""
    rl_wall_s: float = 0.0
    """Seconds of RL loop before this process (counts against loop.wall_budget_s)."""
    acking: list[str] = field(default_factory=list)
    """Rollouts this checkpoint trained, acknowledged in the store right after it is written (redone on
    resume in case the run died in between)."""

    def __post_init__(self) -> None:
        # A run saved before an account existed resumes with it at 0 (the books add to every account).
        self.ledger = {**empty_ledger(), **self.ledger}


@dataclass
class BatchRecord:
    """What one learner step was handed, by reference: the rollouts of its GRPO groups in the order the
    learner saw them (their `Batch` is re-derived from the store with `asyncrl.samples.batch_of`), the version
    staleness was measured against, and what the step reported. Selection is a pure function of these,
    so `asyncrl replay train` rebuilds the exact batch (samples, padding, advantages) from them."""

    step: int
    """The learner's version after the step (the `step` of its metrics record)."""
    learner_version: int
    """The version the step started from (staleness is measured against it)."""
    groups: list[list[str]]
    """Rollout ids, one list per group, in the order they were handed to the learner."""
    ledger: dict[str, int] = field(default_factory=dict)
    padded: int = 0
    loss: float | None = None
    grad_norm: float | None = None
    distilled: bool = False
    """The step's samples were scored by teachers first (their log-probs are not in the store)."""


@dataclass(frozen=True)
class Retention:
    """Which complete checkpoints a run keeps: every one whose version is a multiple of `every`, and
    the newest `last`; the newest of all, always. Both None keeps every checkpoint."""

    every: int | None = None
    last: int | None = None

    @classmethod
    def from_config(cls, learner: LearnerConfig) -> Retention:
        every = learner.keep_checkpoints_every
        # Without `keep_checkpoints_every` the run keeps them all; `keep_last_checkpoints` only adds to it.
        return cls(every, learner.keep_last_checkpoints if every is not None else None)

    @property
    def keeps_all(self) -> bool:
        return self.every is None and self.last is None

    def doomed(self, versions: Sequence[int]) -> list[int]:
        """Of these checkpoint versions, the ones this rule deletes, oldest first."""
        ordered = sorted(set(versions))
        if self.keeps_all or not ordered:
            return []
        newest = set(ordered[-max(self.last or 0, 1) :])
        return [v for v in ordered if v not in newest and not (self.every is not None and v % self.every == 0)]

    def describe(self) -> str:
        parts = [f"every {self.every} versions"] if self.every is not None else []
        return "keep " + " and ".join([*parts, f"the last {max(self.last or 0, 1)}"]) if not self.keeps_all else "keep all"


class RunDir:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.checkpoints = self.path / "checkpoints"

    @classmethod
    def for_config(cls, config: RunConfig) -> RunDir:
        return cls(Path(config.runs_dir) / config.name)

    # -- config -------------------------------------------------------------------------------

    def write_config(self, config: RunConfig) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / CONFIG_FILE).write_text(dump_config(config))

    def read_config(self, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
        """The run's own resolved config, with overrides (e.g. more `loop.steps`) applied on top."""
        path = self.path / CONFIG_FILE
        if not path.exists():
            raise FileNotFoundError(f"{self.path} is not a run directory (no {CONFIG_FILE})")
        data = yaml.safe_load(path.read_text())
        for override in overrides:
            apply_override(data, override)
        return validate(data)

    @staticmethod
    def store_namespace(config: RunConfig) -> str:
        """The key prefix the run's Redis store uses: `store.namespace`, else the run's name (a SQLite
        file is one run already; the name is passed and ignored)."""
        return (config.store.namespace if config.store.type == "redis" else None) or config.name

    def store_address(self, config: RunConfig) -> str:
        store = config.store
        return store.url if store.type == "redis" else str(store.path or self.path / SQLITE_FILENAME)

    def open_store(self, config: RunConfig, *, visibility_timeout_s: float | None = None) -> TrajectoryStore:
        """The run's trajectory store (`store_address`, `store_namespace`), its leases `store.visibility_timeout_s`
        long unless `visibility_timeout_s` says otherwise (1e-6: every lease counts as expired, to reclaim them)."""
        timeout = visibility_timeout_s or config.store.visibility_timeout_s
        return open_store(self.store_address(config), namespace=self.store_namespace(config), visibility_timeout_s=timeout)

    # -- checkpoints --------------------------------------------------------------------------

    def checkpoint_dir(self, version: int) -> Path:
        return self.checkpoints / f"step-{version:06d}"

    def commit_checkpoint(self, directory: Path, state: LoopState) -> None:
        # Its loop state marks a checkpoint complete: written whole or not at all (a run killed while
        # writing it must leave an incomplete checkpoint, not a truncated state that resume cannot read).
        tmp = directory / f".{LOOP_STATE_FILE}.tmp"
        tmp.write_text(json.dumps(asdict(state), indent=1))
        os.replace(tmp, directory / LOOP_STATE_FILE)

    def latest_checkpoint(self) -> tuple[Path, LoopState] | None:
        """The newest complete checkpoint and its loop state, or None."""
        done = sorted(p.parent for p in self.checkpoints.glob(f"step-*/{LOOP_STATE_FILE}"))
        if not done:
            return None
        return done[-1], LoopState(**json.loads((done[-1] / LOOP_STATE_FILE).read_text()))

    def complete_checkpoints(self) -> dict[int, Path]:
        """Version -> directory of every checkpoint with its loop state written (one being written has none)."""
        return {int(p.parent.name.removeprefix("step-")): p.parent for p in sorted(self.checkpoints.glob(f"step-*/{LOOP_STATE_FILE}"))}

    def retire_checkpoints(self, retention: Retention, *, dry_run: bool = False) -> list[Path]:
        """Delete the complete checkpoints `retention` does not keep (never the newest; incomplete ones,
        possibly being written, are not looked at); returns them, oldest first."""
        done = self.complete_checkpoints()
        doomed = [done[version] for version in retention.doomed(list(done))]
        if not dry_run:
            for directory in doomed:
                # The loop state first: a delete cut short leaves an incomplete checkpoint, which
                # resume and replay ignore, never a complete-looking one with weights missing.
                (directory / LOOP_STATE_FILE).unlink(missing_ok=True)
                shutil.rmtree(directory, ignore_errors=True)
        return doomed

    def has_run(self) -> bool:
        return (self.path / SQLITE_FILENAME).exists() or self.checkpoints.exists()

    # -- batches ------------------------------------------------------------------------------

    @property
    def batches(self) -> Path:
        return self.path / "batches"

    def write_batch(self, record: BatchRecord) -> Path:
        self.batches.mkdir(parents=True, exist_ok=True)
        path = self.batches / f"step-{record.step:06d}.json"
        path.write_text(json.dumps(asdict(record)) + "\n")
        return path

    def read_batch(self, step: int) -> BatchRecord | None:
        path = self.batches / f"step-{step:06d}.json"
        return BatchRecord(**json.loads(path.read_text())) if path.exists() else None

    def batch_steps(self) -> list[int]:
        return sorted(int(p.stem.removeprefix("step-")) for p in self.batches.glob("step-*.json"))

    # -- logs ---------------------------------------------------------------------------------

    def metrics(self, config: RunConfig, *, resume: bool) -> MetricsLog:
        return MetricsLog(config, self.path, f"{config.name}-rl", append=resume)

    def plot(self, records: list[dict]) -> Path:
        """`curves.png` (reward, held-out accuracy) and `consistency.png` (learner vs rollout log-probs,
        masked tokens; `runlog.plot_consistency`) beside it; returns the path of curves.png."""
        from asyncrl.runlog import plot_consistency

        path = self.path / "curves.png"
        reward = Panel("rollout reward", "mean reward", [("reward", "training rollouts")], ylim=(0, 1))
        accuracy = Panel("held-out greedy accuracy", "accuracy", [("eval_accuracy", "held-out")], ylim=(0, 1), marker="o")
        plot_panels(records, [reward, accuracy], path)
        plot_consistency(records, self.path / "consistency.png")
        return path

    def write_summary(self, summary: dict) -> Path:
        path = self.path / SUMMARY_FILE
        path.write_text(json.dumps(summary, indent=2) + "\n")
        return path
