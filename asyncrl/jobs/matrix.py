"""The pipeline's evaluation matrix: every stage's held-out eval on every checkpoint so far.

Rows are checkpoints (one per finished stage, in pipeline order), columns are the RL stages' tasks.
A cell is the task's held-out greedy success (envs/evaluation.py: the environment's own episodes,
reward logic and sandboxes, the same evaluation an RL run reports) of that checkpoint, served by an
embedded engine in this process behind an in-process gateway (`gateway/serving.py` evaluation_gateway).
Reading down a column shows whether a later stage erased what an earlier one taught; `checks` states
the pipeline's two promises in numbers: each RL stage raises its own tasks over the checkpoint it
started from, and the distilled student keeps at least
`DISTILL_KEEP` of each teacher's score on the teacher's own tasks.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

from asyncrl.configs.schema import RunConfig, TaskSpec

DISTILL_KEEP = 0.95
"""The share of each teacher's own-eval score the distilled student must keep."""


@dataclass
class Column:
    """One task's held-out eval, with the config of the stage that owns it (task options, sandbox, eval)."""

    task: str
    spec: TaskSpec
    config: RunConfig


def evaluate_checkpoint(checkpoint: str | Path, columns: list[Column], torch_threads: int) -> dict[str, float]:
    """Task name -> held-out accuracy of `checkpoint`, each task evaluated as its own stage does."""
    from transformers import AutoTokenizer

    from asyncrl.rollout.engine import EmbeddedEngine

    rollout = columns[0].config.rollout.embedded().model_copy(update={"torch_threads": torch_threads, "mtp_drafting": False})
    engine = EmbeddedEngine.from_pretrained(str(checkpoint), rollout)
    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    try:
        return asyncio.run(_evaluate(engine, tokenizer, columns))
    finally:
        engine.shutdown()


async def _evaluate(engine, tokenizer, columns: list[Column]) -> dict[str, float]:
    from asyncrl.envs.evaluation import evaluate_env
    from asyncrl.gateway.engines import LocalEngine
    from asyncrl.gateway.serving import episode_http_client, evaluation_gateway
    from asyncrl.sched.tasks import TaskMix

    scores = {}
    for column in columns:
        config = column.config
        tasks = config.tasks.model_copy(update={"mix": {column.task: column.spec}})
        ((task, num_problems),) = TaskMix.from_config(config.model_copy(update={"tasks": tasks})).evaluated(config.eval.num_problems)
        # Each column behind a gateway of its own stage's config (its sampling defaults and limits).
        async with evaluation_gateway(config, [LocalEngine(engine)], tokenizer) as gateway, episode_http_client(config, gateway) as http:
            result = await evaluate_env(
                task.env, gateway, num_problems=num_problems, seed=config.eval.seed, sandboxes=task.sandboxes,
                timeout_s=config.loop.episode_timeout_s, http_client=http, task_name=column.task,
            )  # fmt: skip
        scores[column.task] = result.accuracy
    return scores


def matrix_checks(rows: dict[str, dict[str, float]], own_tasks: dict[str, list[str]], teachers: dict[str, dict[str, str]]) -> list[dict]:
    """The pipeline's promises, checked on the matrix so far.

    `rows`: stage (checkpoint) -> task -> accuracy, in pipeline order; `own_tasks`: RL stage -> its tasks;
    `teachers`: distill stage -> task -> the teacher stage whose eval it must keep.
    """
    checks = []
    order = list(rows)
    for position, stage in enumerate(order):
        if stage in own_tasks and position > 0:
            before = rows[order[position - 1]]
            for task in own_tasks[stage]:
                start, end = before.get(task), rows[stage].get(task)
                checks.append({
                    "check": "rl_raises_own_eval", "stage": stage, "task": task, "start": start, "end": end,
                    "passed": start is not None and end is not None and end > start,
                })  # fmt: skip
        for task, teacher in teachers.get(stage, {}).items():
            if teacher not in rows:
                continue
            teacher_score, student = rows[teacher].get(task), rows[stage].get(task)
            ratio = None if not teacher_score or student is None else student / teacher_score
            checks.append({
                "check": "student_keeps_teacher", "stage": stage, "task": task, "teacher": teacher,
                "teacher_score": teacher_score, "student_score": student, "ratio": ratio,
                "passed": student is not None and teacher_score is not None and student >= DISTILL_KEEP * teacher_score,
            })  # fmt: skip
    return checks


def format_matrix(rows: dict[str, dict[str, float]], tasks: list[str]) -> str:
    """The matrix as a plain-text table (rows: checkpoints, columns: held-out evals)."""
    width = max([len("checkpoint"), *map(len, rows)]) + 2
    cells = [max(len(task), 6) + 2 for task in tasks]
    lines = ["checkpoint".ljust(width) + "".join(task.rjust(w) for task, w in zip(tasks, cells, strict=True))]
    for stage, scores in rows.items():
        shown = ("-" if scores.get(task) is None else f"{scores[task]:.1%}" for task in tasks)
        lines.append(stage.ljust(width) + "".join(value.rjust(w) for value, w in zip(shown, cells, strict=True)))
    return "\n".join(lines)


def format_checks(checks: list[dict]) -> str:
    lines = []
    for check in checks:
        mark = "ok  " if check["passed"] else "MISS"
        if check["check"] == "rl_raises_own_eval":
            lines.append(f"{mark} {check['stage']} raises {check['task']}: {_pct(check['start'])} -> {_pct(check['end'])}")
        else:
            ratio = "-" if check["ratio"] is None else f"{check['ratio']:.0%}"
            lines.append(f"{mark} {check['stage']} keeps {DISTILL_KEEP:.0%} of {check['teacher']} on {check['task']}: "
                         f"{_pct(check['student_score'])} vs {_pct(check['teacher_score'])} ({ratio})")  # fmt: skip
    return "\n".join(lines)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def plot_matrix(rows: dict[str, dict[str, float]], tasks: list[str], path: Path) -> None:
    """A heat map (rows: checkpoints, columns: evals, colour and label: accuracy) saved as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    values = np.array([[np.nan if rows[s].get(t) is None else rows[s][t] for t in tasks] for s in rows], dtype=float)
    fig, ax = plt.subplots(figsize=(1.6 * len(tasks) + 2.5, 0.6 * len(rows) + 1.8))
    image = ax.imshow(values, cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
    ax.set_xticks(range(len(tasks)), tasks)
    ax.set_yticks(range(len(rows)), list(rows))
    ax.set(xlabel="held-out eval", ylabel="checkpoint (after stage)", title="evaluation matrix")
    for i in range(values.shape[0]):
        for j in range(values.shape[1]):
            if not np.isnan(values[i, j]):
                ax.text(j, i, f"{values[i, j]:.0%}", ha="center", va="center", color="white" if values[i, j] < 0.6 else "black")
    fig.colorbar(image, ax=ax, label="accuracy")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
