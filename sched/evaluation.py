"""The loop's evaluate verb: each task's held-out greedy accuracy with the weights the engines serve.

`heldout_scores` is the one way the loop evaluates: each evaluated task plays its own held-out
episodes (`envs/evaluation.py`: the environment's own prompts, rewards and sandboxes) through the
run's own gateway, in rollouts opened for evaluation, which the gateway decodes greedily and records
nowhere. `record_evaluation` books the result in the metrics and on the display.
"""

from __future__ import annotations

from asyncrl.configs.schema import RunConfig
from asyncrl.envs.evaluation import evaluate_env

from .parts import Parts


async def heldout_scores(config: RunConfig, parts: Parts) -> dict[str, float]:
    """Each evaluated task's held-out accuracy (task name -> mean score), at `eval.num_problems` problems."""
    scores = {}
    for task, num_problems in parts.tasks.evaluated(config.eval.num_problems):
        result = await evaluate_env(
            task.env, parts.gateway, num_problems=num_problems, seed=config.eval.seed, sandboxes=task.sandboxes,
            timeout_s=config.loop.episode_timeout_s, http_client=parts.http, task_name=task.name,
        )  # fmt: skip
        scores[task.name] = result.accuracy
    return scores


def record_evaluation(parts: Parts, scores: dict[str, float], version: int, elapsed_s: float) -> float | None:
    """Metrics and display for one evaluation; returns its one number, the tasks weighed equally
    whatever their shares (None with no task evaluated)."""
    accuracy = sum(scores.values()) / len(scores) if scores else None
    per_task = {f"eval_accuracy/{name}": value for name, value in scores.items()} if len(scores) > 1 else {}
    parts.metrics.record({"step": version, "eval_accuracy": accuracy, **per_task, "elapsed_s": elapsed_s})
    shown = "  ".join(f"{name} {value:.1%}" for name, value in scores.items())
    parts.display.say(f"version {version}  {elapsed_s:6.0f}s  held-out accuracy {shown}")
    return accuracy
