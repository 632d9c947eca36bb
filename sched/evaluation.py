"""The loop's evaluate verb: each task's held-out greedy accuracy with the weights the engines serve.

`heldout_scores` is the one way the loop evaluates: each evaluated task plays its own held-out
episodes (`envs/evaluation.py`: the environment's own prompts, rewards and sandboxes) through the
run's own gateway, in rollouts opened for evaluation, which the gateway decodes greedily and records
nowhere. `record_evaluation` books the result in the metrics and on the display.
"""

from __future__ import annotations

from asyncrl.configs.schema import RunConfig
from asyncrl.envs.evaluation import TaskEval, evaluate_env

from .parts import Parts


async def heldout_scores(config: RunConfig, parts: Parts) -> dict[str, TaskEval]:
    """Each evaluated task's held-out evaluation (task name -> its greedy episodes), at `eval.num_problems` problems."""
    scores = {}
    for task, num_problems in parts.tasks.evaluated(config.eval.num_problems):
        scores[task.name] = await evaluate_env(
            task.env, parts.gateway, num_problems=num_problems, seed=config.eval.seed, sandboxes=task.sandboxes,
            timeout_s=config.loop.episode_timeout_s, http_client=parts.http, task_name=task.name,
        )  # fmt: skip
    return scores


def record_evaluation(parts: Parts, evals: dict[str, TaskEval], version: int, elapsed_s: float, wall_s: float = 0.0) -> float | None:
    """Metrics and display for one evaluation; returns its one number, the tasks weighed equally
    whatever their shares (None with no task evaluated). Each task's figure comes with its 95% interval
    (`eval_interval/<task>`). `wall_s`: what the evaluation took, during which the loop neither trained
    nor pushed (it evaluates the pushed version, between pushes)."""
    scores = {name: evaluation.accuracy for name, evaluation in evals.items()}
    intervals = {name: evaluation.accuracy_interval() for name, evaluation in evals.items()}
    accuracy = sum(scores.values()) / len(scores) if scores else None
    per_task = {f"eval_accuracy/{name}": value for name, value in scores.items()} if len(scores) > 1 else {}
    bounds = {f"eval_interval/{name}": [round(low, 4), round(high, 4)] for name, (low, high) in intervals.items()}
    parts.metrics.record({"step": version, "eval_accuracy": accuracy, **per_task, **bounds, "elapsed_s": elapsed_s, "eval_wall_s": wall_s})
    shown = "  ".join(f"{name} {value:.1%} [{intervals[name][0]:.1%}, {intervals[name][1]:.1%}]" for name, value in scores.items())
    paused = f"  (between pushes: training waited {wall_s:.0f} s)" if wall_s >= 1 else ""
    parts.display.say(f"version {version}  {elapsed_s:6.0f}s  held-out accuracy {shown}{paused}")
    return accuracy
