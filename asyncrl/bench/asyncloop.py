"""Benchmark: the asynchronous loop against the synchronous one, on heavy-tailed episodes.

One config (the quickstart preset, sized down by OVERRIDES, then the command's own overrides) runs
twice through `asyncrl run`'s code, `loop.mode=sync` and `loop.mode=async`, from the same starting
checkpoint (one SFT warm start, shared; skipped when `policy.path` is set), with the same number of
optimizer steps of the same batch. Every episode is the reasoning environment wrapped in
`LatencyEnv` (envs/latency.py): a simulated tool latency (lognormal body, Pareto tail, seeded; the
n-th episode admitted waits the n-th draw in both modes) that costs no CPU. Sync waits for the
slowest episode of each batch; async keeps admitting within its in-flight and staleness bounds.

Measured from each run's own records (metrics.jsonl), not from outside timers:

- RL phase: from the end of the first held-out evaluation (the loop starts admitting right after)
  to the booking of the last optimizer step; start-up, SFT and the final evaluation are outside it.
- samples_per_s: rollouts trained (ledger `trained`: stale, crashed and dropped-group rollouts do
  not count) / RL phase wall. `async_over_sync_samples_per_s` is async's over sync's.
- learner_idle_frac: 1 - (sum of `step_s`, the learner actor's time inside `train_step`) / RL phase wall.

    asyncrl bench async --json bench-async.json
    asyncrl bench async quickstart loop.steps=20 bench.latency.median_s=1.0 --json bench-async.json
"""

from __future__ import annotations

import json
import platform
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Literal

from pydantic import Field

from asyncrl.configs.loader import apply_override, validate
from asyncrl.configs.schema import RunConfig, Section
from asyncrl.envs.latency import LatencyConfig, LatencyEnv

PRESET = "quickstart"
OVERRIDES = (
    "name=bench-async",
    "loop.steps=12",
    "learner.batch_groups=8",
    "learner.max_staleness=4",
    "loop.max_inflight=64",
    "loop.eval_every=1000000",  # no evaluation inside the RL phase
    "learner.checkpoint_every=1000000",  # nor checkpoints: only the one at the end of the run
    "loop.wall_budget_s=900",
    "eval.num_problems=64",
    "logging.wandb=disabled",
)
"""Bench sizing on top of the preset (the command's overrides come after these): 12 steps of
8 groups x 8 rollouts (768 rollouts a mode), tau = 4 (the schema's default; quickstart uses 1)."""


class AsyncBenchOptions(Section):
    """Settings of `asyncrl bench async` itself (`bench.KEY=VALUE` on the command line)."""

    latency: LatencyConfig = LatencyConfig()
    """The simulated tool latency added to every episode (envs/latency.py)."""
    order: list[Literal["sync", "async"]] = Field(["sync", "async"], min_length=1)
    """Modes to run, in this order (each once); the ratio needs both."""


def run(
    config: RunConfig, json_path: str | None = None, options: AsyncBenchOptions | None = None, *, env_factory: Callable | None = None
) -> dict:
    """Both modes, side by side; `env_factory(config)` builds the wrapped environment (default: reasoning)."""
    from asyncrl.jobs.run import run as run_loop

    options = options or AsyncBenchOptions()
    env_factory = env_factory or _reasoning_env
    sides: dict[str, dict] = {}
    with TemporaryDirectory(prefix="bench-async-") as tmp:
        config = _with(config, f"runs_dir={tmp}")
        config, sft = _warm_start(config)
        for mode in options.order:
            _say(f"bench async: {mode} run, {config.loop.steps} steps of {config.learner.batch_groups} x {config.learner.group_size}")
            side = _with(config, f"loop.mode={mode}", f"name={config.name}-{mode}")
            summary = run_loop(side, env=LatencyEnv(env_factory(side), options.latency))
            sides[mode] = _measure(summary, Path(summary["run_dir"]))
    results = {}
    if {"sync", "async"} <= sides.keys():
        results["async_over_sync_samples_per_s"] = round(sides["async"]["samples_per_s"] / sides["sync"]["samples_per_s"], 3)
    results.update({f"learner_idle_frac_{mode}": side["learner_idle_frac"] for mode, side in sides.items()})
    results.update(sides)
    results["setup"] = {
        "preset": PRESET, "overrides": list(OVERRIDES), "steps": config.loop.steps,
        "batch_groups": config.learner.batch_groups, "group_size": config.learner.group_size,
        "max_staleness": config.learner.max_staleness, "max_inflight": config.loop.max_inflight,
        "rollout_workers": config.rollout.num_workers, "policy": config.policy.path, "sft": sft,
        "latency": options.latency.model_dump(), "machine": platform.machine(), "python": platform.python_version(),
    }  # fmt: skip
    if json_path:
        Path(json_path).write_text(json.dumps(results, indent=2) + "\n")
    return results


def _measure(summary: dict, run_dir: Path) -> dict:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [r for r in records if "eval_accuracy" in r]
    steps = [r for r in records if "step_s" in r]
    if not evals or not steps:
        raise RuntimeError(f"{run_dir}: no learner step was recorded (does the policy get any reward signal?)")
    wall = steps[-1]["elapsed_s"] - evals[0]["elapsed_s"]
    busy = sum(r["step_s"] for r in steps)
    trained = sum(r["ledger"]["trained"] for r in steps)
    handed = sum(sum(r["ledger"].values()) for r in steps)
    latencies = _tool_latencies(run_dir)
    return {
        "samples_per_s": round(trained / wall, 3),
        "learner_idle_frac": round(1.0 - busy / wall, 4),
        "rl_wall_s": round(wall, 2),
        "learner_busy_s": round(busy, 2),
        "run_wall_s": round(summary["wall_s"], 2),
        "optimizer_steps": summary["version"],
        "learner_calls": len(steps),
        "rollouts_to_learner": handed,
        "trained": trained,
        "dropped": {k: sum(r["ledger"][k] for r in steps) for k in steps[0]["ledger"] if k != "trained"},
        "staleness_mean": round(statistics.fmean(r["staleness_mean"] for r in steps), 3),
        "staleness_max": max(r["staleness_max"] for r in steps),
        "reward_mean": round(statistics.fmean(r["reward"] for r in steps), 3),
        "tool_latency_s": latencies,
        "ledger": summary["ledger"],
        "balanced": summary["balanced"],
    }


def _tool_latencies(run_dir: Path) -> dict:
    """What the finished episodes waited: quantiles, and the sum over admission cohorts (same
    `admitted_at_version`) of each cohort's slowest wait. In sync mode a cohort is a batch, so that
    sum is the time sync spends waiting for stragglers however fast everything else is."""
    from asyncrl.gateway.store import open_store

    store = open_store(run_dir)
    waits = [
        (t.metadata.get("admitted_at_version"), t.metrics["tool_latency_s"]) for t in store.list() if "tool_latency_s" in (t.metrics or {})
    ]
    store.close()
    if not waits:
        return {}
    drawn = sorted(latency for _, latency in waits)
    slowest: dict = {}
    for cohort, latency in waits:
        slowest[cohort] = max(slowest.get(cohort, 0.0), latency)
    quantile = lambda q: round(drawn[min(len(drawn) - 1, int(q * len(drawn)))], 3)  # noqa: E731
    return {
        "n": len(drawn), "mean": round(statistics.fmean(drawn), 3), "p50": quantile(0.5), "p99": quantile(0.99),
        "max": round(drawn[-1], 3), "sum_of_cohort_max": round(sum(slowest.values()), 2),
    }  # fmt: skip


def _warm_start(config: RunConfig) -> tuple[RunConfig, dict | None]:
    """One SFT warm start for both modes (as `asyncrl run` would do for each), or none when the policy
    is given. A policy with no reward signal (e.g. an untrained one on arithmetic) never steps."""
    if not config.sft_warm_start:
        return config, None
    from asyncrl.jobs.sft import run_sft

    _say("bench async: SFT warm start (shared by both modes)")
    result = run_sft(config)
    sft = {"accuracy": result.accuracy, "steps": result.steps, "wall_s": round(result.wall_s, 1)}
    return _with(config, f"policy.path={result.checkpoint}", "loop.sft_first=false"), sft


def _reasoning_env(config: RunConfig):
    from asyncrl.envs.reasoning import ReasoningEnv

    # Episodes sample at the temperature the learner scores them at (as asyncrl/jobs/run.py's default env).
    return ReasoningEnv(config.tasks.arithmetic, max_tokens=config.loop.episode_max_tokens, temperature=config.rollout.sampling.temperature)


def _with(config: RunConfig, *overrides: str) -> RunConfig:
    data = config.model_dump(mode="json")
    for override in overrides:
        apply_override(data, override)
    return validate(data)


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
