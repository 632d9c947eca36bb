"""`asyncrl distill CONFIG`: the student learns from the earlier stages' final checkpoints.

A distillation run is an `asyncrl run` whose config lists `distill.teachers`: the same loop,
engines, gateway, store, learner, checkpoints and ledger, with the teachers' stages as the task
mix and a scoring actor per teacher (asyncrl/jobs/run.py). What this entry adds is the refusals that make
such a run meaningful before anything starts; `asyncrl run --resume RUN_DIR` continues one.
"""

from __future__ import annotations

import json
from pathlib import Path

from asyncrl.configs.schema import RunConfig
from asyncrl.distill.teachers import KL_PREFIX, check_checkpoints
from asyncrl.runlog import Panel, plot_panels
from asyncrl.sched.rundir import RunDir

from .run import run


class NotADistillation(ValueError):
    """The config cannot be a distillation run; the message says what to set."""


def check_distill_config(config: RunConfig) -> None:
    if not config.distill.teachers:
        raise NotADistillation("distill.teachers is empty: name each earlier stage with its final checkpoint "
                               "(distill.teachers.STAGE.checkpoint=PATH) or a gateway serving it "
                               "(distill.teachers.STAGE.url=http://HOST:PORT)")  # fmt: skip
    if config.policy.path is None:
        raise NotADistillation("policy.path is unset: the student is a checkpoint (usually the last stage's)")
    try:
        check_checkpoints(config)
    except FileNotFoundError as error:
        raise NotADistillation(str(error)) from None


def distill(config: RunConfig, resume: str | Path | None = None) -> dict:
    """Run (or, with `resume`, continue) cross-stage distillation; returns the run's summary (also
    written to summary.json), with `reverse_kl`: each teacher's reverse KL at the first and the last
    step, and `reverse_kl.png`. A resumed run goes on with the config saved in its directory."""
    if resume is not None:
        config = RunDir(resume).read_config()
    check_distill_config(config)
    summary = run(None, resume=resume) if resume is not None else run(config)
    rundir = RunDir(summary["run_dir"])
    records = [json.loads(line) for line in (rundir.path / "metrics.jsonl").read_text().splitlines() if line.strip()]
    summary["reverse_kl"] = reverse_kl_over_time(records)
    series = [(f"{KL_PREFIX}{name}", name) for name in config.distill.teachers]
    plot_panels(records, [Panel("reverse KL to each teacher", "KL(student || teacher) per token", series)], rundir.path / "reverse_kl.png")
    rundir.write_summary(summary)
    return summary


def reverse_kl_over_time(records: list[dict]) -> dict[str, tuple[float, float]]:
    """Teacher -> (reverse KL at its first recorded step, at its last)."""
    series: dict[str, list[float]] = {}
    for record in records:
        for key, value in record.items():
            if key.startswith(KL_PREFIX) and value is not None:
                series.setdefault(key.removeprefix(KL_PREFIX), []).append(value)
    return {name: (values[0], values[-1]) for name, values in series.items()}
