"""`asyncrl eval`: held-out pass@1 and pass@k of a checkpoint, of every checkpoint of a run, or of any
OpenAI-compatible server, on the tasks a config names.

Every problem is played as an RL run evaluates it (`envs/evaluation.py`: the environment's own
episodes, prompts, rewards and sandboxes, the same held-out set for the same `eval.seed` and
`eval.num_problems`), so `asyncrl eval RUN_DIR` reproduces the figures the run logged. A checkpoint is
served by an embedded engine in this process behind an in-process gateway (as the pipeline's matrix
does); a URL is called directly with the OpenAI client, which must answer to the model name `policy`
(vLLM: `--served-model-name policy`).

Greedy decoding gives pass@1; `--samples N` adds N sampled episodes per problem at
`rollout.sampling.temperature`, from which pass@1 and pass@k come by the unbiased estimator
(`envs/pass_at_k.py`), each with a 95% bootstrap interval over problems.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncrl.configs.schema import RunConfig


@dataclass
class Target:
    """What is evaluated: checkpoints (label -> directory) or one server."""

    checkpoints: dict[str, Path] = field(default_factory=dict)
    url: str | None = None
    api_key: str = "none"


@dataclass
class Plan:
    samples: int = 0
    """Sampled episodes per problem (0: greedy only)."""
    ks: list[int] = field(default_factory=lambda: [1])


def row_figures(evals: dict[str, Any], plan: Plan) -> dict[str, dict]:
    """Task -> its figures: greedy pass@1 and, with samples, pass@k per k, each (value, low, high)."""
    figures: dict[str, dict] = {}
    for task, (greedy, sampled) in evals.items():
        entry = {"problems": greedy.num_problems, "greedy_pass@1": greedy.pass_at(1), "statuses": greedy.statuses}
        if greedy.reasons or (sampled is not None and sampled.reasons):
            entry["failures"] = {**(sampled.reasons if sampled is not None else {}), **greedy.reasons}
        if sampled is not None:
            entry["samples"], entry["statuses_sampled"] = sampled.samples, sampled.statuses
            entry["mean_score_sampled"] = (sampled.accuracy, *sampled.accuracy_interval())
            entry.update({f"pass@{k}": sampled.pass_at(k) for k in plan.ks})
        entry["mean_score_greedy"] = (greedy.accuracy, *greedy.accuracy_interval())
        figures[task] = entry
    return figures


def evaluate_target(config: RunConfig, target: Target, plan: Plan, say=print) -> dict[str, dict[str, dict]]:
    """Row label (a checkpoint, or the URL) -> task -> figures."""
    rows = {}
    if target.url is not None:
        rows[target.url] = row_figures(asyncio.run(_evaluate_url(config, target, plan)), plan)
        return rows
    for label, checkpoint in target.checkpoints.items():
        began = time.monotonic()
        rows[label] = row_figures(_evaluate_checkpoint(config, checkpoint, plan), plan)
        say(f"{label}: evaluated in {time.monotonic() - began:.0f} s")
    return rows


def _evaluate_checkpoint(config: RunConfig, checkpoint: Path, plan: Plan) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from asyncrl.rollout.engine import EmbeddedEngine

    # The command has the machine to itself: every core, where a run's engine shares it with the learner.
    threads = max(config.rollout.torch_threads, os.cpu_count() or 1)
    rollout = config.rollout.embedded().model_copy(update={"mtp_drafting": False, "torch_threads": threads})
    engine = EmbeddedEngine.from_pretrained(str(checkpoint), rollout)
    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    try:
        return asyncio.run(_evaluate_engine(config, engine, tokenizer, plan))
    finally:
        engine.shutdown()


async def _evaluate_engine(config: RunConfig, engine, tokenizer, plan: Plan) -> dict[str, Any]:
    from asyncrl.envs.evaluation import evaluate_env
    from asyncrl.gateway.engines import LocalEngine
    from asyncrl.gateway.serving import episode_http_client, evaluation_gateway
    from asyncrl.sched.tasks import TaskMix

    evals = {}
    async with evaluation_gateway(config, [LocalEngine(engine)], tokenizer) as gateway, episode_http_client(config, gateway) as http:
        for task, num_problems in TaskMix.from_config(config).evaluated(config.eval.num_problems):
            common = dict(
                num_problems=num_problems, seed=config.eval.seed, sandboxes=task.sandboxes,
                timeout_s=config.loop.episode_timeout_s, http_client=http, task_name=task.name,
            )  # fmt: skip
            greedy = await evaluate_env(task.env, gateway, **common)
            sampled = await evaluate_env(task.env, gateway, samples=plan.samples, sampled=True, **common) if plan.samples else None
            evals[task.name] = (greedy, sampled)
    return evals


async def _evaluate_url(config: RunConfig, target: Target, plan: Plan) -> dict[str, Any]:
    """The same episodes against a server: greedy by a temperature-0 copy of the config's environments."""
    import openai

    greedy_config = config.model_copy(deep=True)
    greedy_config.rollout.sampling.temperature = 0.0
    client = openai.AsyncOpenAI(base_url=target.url, api_key=target.api_key, max_retries=0, timeout=config.loop.episode_timeout_s)
    try:
        greedy = await _play_url(greedy_config, client, 1)
        sampled = await _play_url(config, client, plan.samples) if plan.samples else {}
    finally:
        await client.close()
    return {task: (evaluation, sampled.get(task)) for task, evaluation in greedy.items()}


async def _play_url(config: RunConfig, client, samples: int) -> dict[str, Any]:
    from asyncrl.envs.evaluation import play_heldout
    from asyncrl.envs.runner import play_episode
    from asyncrl.sched.tasks import TaskMix

    evals = {}
    for task, num_problems in TaskMix.from_config(config).evaluated(config.eval.num_problems):

        async def play(problem, task=task):
            return await play_episode(task.env, problem, client, task.sandboxes, config.loop.episode_timeout_s)

        evals[task.name] = await play_heldout(task.env, play, num_problems=num_problems, seed=config.eval.seed, samples=samples)
    return evals


def run_checkpoints(run_dir: Path) -> dict[str, Path]:
    """A run's committed checkpoints, oldest first, labelled `step N`."""
    from asyncrl.sched.rundir import RunDir

    return {f"step {version}": path for version, path in sorted(RunDir(run_dir).complete_checkpoints().items())}
