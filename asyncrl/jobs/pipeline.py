"""`asyncrl pipeline CONFIG`: the stages of one pipeline file, in order, each from the last one's checkpoint.

    <runs_dir>/<name>/
        pipeline.yaml     the resolved pipeline config (what `--resume` reads back)
        state.json        per stage: done, its final checkpoint, wall time, a short summary; the matrix
        matrix.json       the evaluation matrix so far (rows: checkpoints, columns: evals) and its checks
        matrix.png        the same as a heat map
        summary.json      at the end: matrix, checks, stages, wall time
        <stage>/          each stage's own run directory (an `asyncrl run` / `distill` / `sft` one)

A stage is done once its final checkpoint is recorded in state.json (written atomically); a stage
that was stopped part-way is resumed, not redone: an RL or distill stage through its run
directory's last checkpoint (`asyncrl run --resume`), so it continues at that step; an SFT stage,
which keeps no intermediate checkpoints, starts over. After each stage its checkpoint is evaluated on
every column of the matrix (asyncrl/jobs/matrix.py), and the matrix is written and printed.

Each stage and each matrix evaluation runs in a process of its own (asyncrl/jobs/fresh_process.py):
what one leaves behind on a real model (gigabytes of freed-but-kept heap) is gone before the next starts.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import yaml

from asyncrl.configs.loader import apply_override
from asyncrl.configs.pipeline import PipelineConfig, distill_tasks, dump_pipeline, stage_config, validate_pipeline
from asyncrl.configs.schema import RunConfig
from asyncrl.sched.rundir import SUMMARY_FILE, RunDir

from .fresh_process import in_fresh_process
from .matrix import Column, evaluate_checkpoint, format_checks, format_matrix, matrix_checks, plot_matrix

PIPELINE_FILE, STATE_FILE, MATRIX_FILE, MATRIX_PLOT = "pipeline.yaml", "state.json", "matrix.json", "matrix.png"
START_ROW = "start"
"""The matrix row of the checkpoint a pipeline without an SFT stage starts from (base.policy.path)."""


class StageLearnedNothing(RuntimeError):
    """An RL stage stopped by loop.max_batches_without_step: the pipeline stops rather than build on it."""


class PipelineExists(RuntimeError):
    """A fresh pipeline would overwrite an earlier one's stages."""


class PipelineDir:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def has_pipeline(self) -> bool:
        return (self.path / PIPELINE_FILE).exists()

    def write_config(self, pipeline: PipelineConfig) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / PIPELINE_FILE).write_text(dump_pipeline(pipeline))

    def read_config(self, overrides: list[str] | tuple[str, ...] = ()) -> PipelineConfig:
        path = self.path / PIPELINE_FILE
        if not path.exists():
            raise FileNotFoundError(f"{self.path} is not a pipeline directory (no {PIPELINE_FILE})")
        data = yaml.safe_load(path.read_text())
        for override in overrides:
            apply_override(data, override)
        return validate_pipeline(data)

    def read_state(self) -> dict:
        path = self.path / STATE_FILE
        return json.loads(path.read_text()) if path.exists() else {"stages": {}, "matrix": {}}

    def write_json(self, name: str, data: dict) -> None:
        """Written whole or not at all: a kill mid-write leaves the previous version."""
        tmp = self.path / f".{name}.tmp"
        tmp.write_text(json.dumps(data, indent=2) + "\n")
        os.replace(tmp, self.path / name)


def run_pipeline(
    pipeline: PipelineConfig | None,
    *,
    resume: str | Path | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    say: Callable[[str], None] = print,
) -> dict:
    """Run (or, with `resume`, continue) a pipeline; returns the summary also written to summary.json."""
    if resume is not None:
        directory = PipelineDir(resume)
        pipeline = directory.read_config(overrides)
        if overrides:
            directory.write_config(pipeline)  # a later resume keeps them
    elif pipeline is None:
        raise ValueError("run_pipeline needs a pipeline config, or a pipeline directory to resume")
    else:
        directory = PipelineDir(Path(pipeline.runs_dir) / pipeline.name)
        if directory.has_pipeline():
            raise PipelineExists(f"{directory.path} already holds a pipeline: continue it with "
                                 f"`asyncrl pipeline --resume {directory.path}`, or pick another name=")  # fmt: skip
        directory.write_config(pipeline)
    return Pipeline(pipeline, directory, say).run()


class Pipeline:
    def __init__(self, pipeline: PipelineConfig, directory: PipelineDir, say: Callable[[str], None]) -> None:
        self.pipeline, self.dir, self.say = pipeline, directory, say
        self.state = directory.read_state()
        self.columns = [
            Column(task, spec, self.stage_config(pipeline.owner(task), {"tasks": {"mix": {task: spec.model_dump()}}}))
            for task, spec in pipeline.eval_tasks().items()
        ]  # fmt: skip

    def stage_config(self, stage: str, sections: dict) -> RunConfig:
        return stage_config(self.pipeline, stage, str(self.dir.path), sections)

    def run(self) -> dict:
        began = time.monotonic()
        previous = self.pipeline.start_path()
        if previous is not None and START_ROW not in self.state["matrix"]:
            self.evaluate(START_ROW, previous)
        for name, spec in self.pipeline.stages.items():
            record = self.state["stages"].get(name)
            if record is None:
                self.say(f"== stage {name} ({spec.kind})" + (f" from {previous}" if previous else ""))
                stage_began = time.monotonic()
                runner = {"sft": self.run_sft, "rl": self.run_rl, "distill": self.run_distill}[spec.kind]
                checkpoint, summary = runner(name, previous)
                record = {"kind": spec.kind, "checkpoint": str(checkpoint), "wall_s": time.monotonic() - stage_began, "summary": summary}
                self.state["stages"][name] = record
                self.save()
            else:
                self.say(f"== stage {name} ({spec.kind}): done, checkpoint {record['checkpoint']}")
            if name not in self.state["matrix"]:
                self.evaluate(name, record["checkpoint"])
            previous = record["checkpoint"]
        self.state["wall_s"] = self.state.get("wall_s", 0.0) + time.monotonic() - began
        self.save()
        summary = {
            "name": self.pipeline.name, "pipeline_dir": str(self.dir.path), **self.matrix(),
            "stages": self.state["stages"], "wall_s": self.state["wall_s"],
        }  # fmt: skip
        self.dir.write_json(SUMMARY_FILE, summary)
        return summary

    # -- stages ---------------------------------------------------------------------------------

    def run_sft(self, name: str, previous: str | None) -> tuple[Path, dict]:
        from .sft import run_sft

        tasks = {task: spec.model_dump() for task, spec in self.pipeline.stages[name].tasks.items()}
        # No intermediate checkpoints: a stopped SFT starts over.
        result = in_fresh_process(run_sft, self.stage_config(name, {"tasks": {"mix": tasks}} if tasks else {}))
        return result.checkpoint, {"accuracy": result.accuracy, "steps": result.steps, "stop_reason": result.stop_reason}

    def run_rl(self, name: str, previous: str | None) -> tuple[Path, dict]:
        tasks = {task: spec.model_dump() for task, spec in self.pipeline.stages[name].tasks.items()}
        return self._run(self.stage_config(name, {"policy": {"path": previous}, "tasks": {"mix": tasks}}), distilling=False)

    def run_distill(self, name: str, previous: str | None) -> tuple[Path, dict]:
        done = self.state["stages"]
        plan = distill_tasks(self.pipeline, name)
        sections = {
            "policy": {"path": previous},
            "tasks": {"mix": {task: spec.model_dump() for task, (_, spec, _) in plan.items()}},
            "distill": {"teachers": {
                task: {"checkpoint": done[teacher]["checkpoint"], "ratio": share} for task, (teacher, _, share) in plan.items()
            }},
        }  # fmt: skip
        return self._run(self.stage_config(name, sections), distilling=True)

    def _run(self, config: RunConfig, *, distilling: bool) -> tuple[Path, dict]:
        from .distill import distill
        from .run import run

        rundir = RunDir.for_config(config)
        if (rundir.path / SUMMARY_FILE).exists():
            summary = json.loads((rundir.path / SUMMARY_FILE).read_text())  # finished; the pipeline stopped before recording it
        else:
            resume = rundir.path if rundir.has_run() else None
            if resume is not None:
                # The pipeline file is the source of truth: overrides given with --resume reach the stage.
                rundir.write_config(config)
                self.say(f"   resuming {rundir.path} from its last checkpoint")
            summary = in_fresh_process(distill if distilling else run, config, resume=resume)
        if summary.get("stop_reason") == "no_signal":
            raise StageLearnedNothing(
                f"{rundir.path}: the stage stopped after loop.max_batches_without_step batches in a row without an optimizer step "
                "(in every group the rewards were equal), so the next stage would start from a policy that learned nothing here. "
                "Fix the stage's tasks or its warm start, delete this run directory, and resume the pipeline"
            )
        latest = rundir.latest_checkpoint()
        if latest is None:
            raise RuntimeError(f"{rundir.path}: the stage ended without a checkpoint")
        keep = (
            "eval_before",
            "eval_after",
            "eval_before_by_task",
            "eval_after_by_task",
            "version",
            "rl_wall_s",
            "ledger",
            "balanced",
            "stop_reason",
            "reverse_kl",
        )
        return latest[0], {key: summary[key] for key in keep if key in summary}

    # -- the matrix -----------------------------------------------------------------------------

    def evaluate(self, row: str, checkpoint: str) -> None:
        began = time.monotonic()
        threads = self.columns[0].config.torch_threads
        self.state["matrix"][row] = in_fresh_process(evaluate_checkpoint, checkpoint, self.columns, threads)
        self.save()
        matrix = self.matrix()
        self.dir.write_json(MATRIX_FILE, matrix)
        plot_matrix(matrix["rows"], matrix["tasks"], self.dir.path / MATRIX_PLOT)
        self.say(f"evaluation matrix after {row} ({time.monotonic() - began:.0f} s; {self.dir.path / MATRIX_PLOT}):")
        self.say(format_matrix(matrix["rows"], matrix["tasks"]))
        if matrix["checks"]:
            self.say(format_checks(matrix["checks"]))

    def matrix(self) -> dict:
        rows = {row: self.state["matrix"][row] for row in [START_ROW, *self.pipeline.stages] if row in self.state["matrix"]}
        own = {name: list(spec.tasks) for name, spec in self.pipeline.stages.items() if spec.kind == "rl"}
        teachers = {
            name: {task: teacher for task, (teacher, _, _) in distill_tasks(self.pipeline, name).items()}
            for name, spec in self.pipeline.stages.items() if spec.kind == "distill"
        }  # fmt: skip
        checks = matrix_checks(rows, own, teachers)
        return {
            "tasks": [column.task for column in self.columns],
            "rows": rows,
            "checks": checks,
            "passed": all(c["passed"] for c in checks),
        }

    def save(self) -> None:
        self.dir.write_json(STATE_FILE, self.state)
