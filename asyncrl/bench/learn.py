"""Benchmark: time to accuracy, asyncrl against TRL's GRPOTrainer, side by side in one command.

Every side starts from the same SFT checkpoint (one warm start, shared; none when `policy.path` is
set), trains on the same task (the config's one task: the built-in addition by default, or a dataset
file with its reward, as configs/smollm2.yaml's word problems; learn_task.py) with the same group size, prompts per step, temperature,
learning rate and gradient clip, for the same wall budget, one side after the other, and is scored
greedily on the same held-out problems (`eval.num_problems`, `eval.seed`) as it goes. `loop.steps`
(out of reach here) also ends every side, at that many optimizer steps: a side's length by count,
whatever the machine's speed (the test's sides end so):

- the engine alone (first, and again after the last side; `bench.engine_alone_s=0` skips it): the
  pipeline limit, the rollout engine fed `loop.max_inflight` requests at a time with nothing else
  running (asyncrl/bench/learn_engine.py); each side's samples/s over it is `fraction_of_engine_alone`.
  Measured twice and pooled because one 30 s measurement moved by ±5% between runs, as much as
  the fraction's distance to its target.
- async, sync: `asyncrl run` itself (Ray actors, the TITO gateway, the store), `loop.mode` async or
  sync, evaluating every `loop.eval_every` versions or `loop.eval_every_s` seconds. Its curve, samples
  and the CPU of each process over the RL phase come from the run's own records (metrics.jsonl, summary.json `usage`).
- plain: the floor, a synchronous GRPO loop of the project's own engine and learner in one process,
  with no Ray, gateway or store (asyncrl/bench/learn_plain.py): what the system costs on top of it.
- trl: TRL's GRPOTrainer in this one process (asyncrl/bench/learn_trl.py), evaluating every
  `bench.trl_eval_every_s` seconds of its wall; skipped, with a note, where `trl` is not installed
  (`pip install -e ".[bench]"`).

Wall time is each side's own clock from the end of its first evaluation (training starts there) and
includes its later evaluations, each timed when the weights it scored were the newest. asyncrl's budget
is `loop.wall_budget_s`, which also covers that first evaluation, so its sides train for slightly less.

Reported per side: the curve (seconds, samples trained, held-out accuracy), samples trained per
second, the first time at +10 and +20 points over the start, and the CPU time by process; then
async's time to TRL's accuracy at its end (the mean of its last three evaluations) as a fraction of
TRL's wall, and async's samples/s over TRL's. A plot of accuracy against time and against samples
goes beside the JSON (or into the working directory): `bench-learn.png`.

    asyncrl bench learn --json bench-learn.json
    asyncrl bench learn policy.path=runs/quickstart/sft/checkpoint bench.budget_s=120 bench.sides=[async,trl]
"""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Literal

from pydantic import Field

from asyncrl.configs.schema import RunConfig, Section

from .asyncloop import _warm_start, _with

PRESET = "quickstart"
OVERRIDES = (
    "name=bench-learn",
    "loop.steps=1000000",  # the wall budget ends every side
    "loop.eval_every=25",
    "eval.num_problems=200",
    "learner.checkpoint_every=1000000",
    "logging.wandb=disabled",
)
Side = Literal["async", "sync", "plain", "trl"]


class LearnBenchOptions(Section):
    """Settings of `asyncrl bench learn` itself (`bench.KEY=VALUE` on the command line)."""

    budget_s: float = Field(300.0, gt=0)
    """Wall seconds of training per side, from the end of its first held-out evaluation (or until loop.steps optimizer steps)."""
    sides: list[Side] = Field(["async", "sync", "plain", "trl"], min_length=1)
    """Sides to run, in this order."""
    trl_eval_every_s: float = Field(20.0, gt=0)
    """TRL's held-out evaluation cadence, in seconds of its wall. The comparison reads asyncrl at TRL's
    evaluation times from the last weights it evaluated by then (a shorter loop.eval_every_s keeps it fresh)."""
    engine_alone_s: float = Field(30.0, ge=0)
    """Seconds of each measurement of the engine alone at loop.max_inflight requests (the pipeline limit),
    first and again after the last side; 0 skips both."""


def run(config: RunConfig, json_path: str | None = None, options: LearnBenchOptions | None = None) -> dict:
    options = options or LearnBenchOptions()
    sides: dict[str, dict] = {}
    notes: list[str] = []
    with TemporaryDirectory(prefix="bench-learn-") as tmp:
        config = _with(config, f"runs_dir={tmp}", f"loop.wall_budget_s={options.budget_s}")
        config, sft = _warm_start(config)
        alone_runs = [_engine_alone(config, options.engine_alone_s, "first")] if options.engine_alone_s else []
        for side in options.sides:
            _say(f"bench learn: {side}, {options.budget_s:.0f} s from {config.policy.path}")
            if side == "trl":
                from .learn_trl import TRLMissing, run_trl

                try:
                    sides[side] = run_trl(config, options.budget_s, options.trl_eval_every_s)
                except TRLMissing as missing:
                    notes.append(str(missing))
                    _say(f"bench learn: trl skipped: {missing}")
                continue
            if side == "plain":
                from .learn_plain import run_plain

                sides[side] = run_plain(config, options.budget_s)
                continue
            sides[side] = _asyncrl_side(_with(config, f"loop.mode={side}", f"name={config.name}-{side}"))
        if options.engine_alone_s:
            alone_runs.append(_engine_alone(config, options.engine_alone_s, "again, last"))
    alone = _pooled(alone_runs) if alone_runs else None
    if alone is not None:
        for measured in sides.values():
            measured["fraction_of_engine_alone"] = round(measured["samples_per_s"] / alone["samples_per_s"], 3)
    results = {"sides": sides, **_compare(sides), "engine_alone": alone, "notes": notes}
    results["setup"] = {
        "preset": PRESET, "overrides": list(OVERRIDES), "budget_s": options.budget_s, "policy": config.policy.path, "sft": sft,
        "group_size": config.learner.group_size, "batch_groups": config.learner.batch_groups, "lr": config.learner.lr,
        "temperature": config.rollout.sampling.temperature, "eval_problems": config.eval.num_problems,
        "machine": platform.machine(), "python": platform.python_version(),
    }  # fmt: skip
    plot_path = Path(json_path).with_suffix(".png") if json_path else Path("bench-learn.png")
    plot(sides, plot_path)
    results["plot"] = str(plot_path)
    if json_path:
        Path(json_path).write_text(json.dumps(results, indent=2) + "\n")
    return results


def _asyncrl_side(config: RunConfig) -> dict:
    from asyncrl.jobs.run import run as run_loop

    summary = run_loop(config)
    records = [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [r for r in records if r.get("eval_accuracy") is not None]
    steps = [r for r in records if "step_s" in r]
    first = evals[0]  # training starts when it ends, or with it on an engine of its own
    start = first["elapsed_s"] + (first["eval_wall_s"] if first.get("eval_engine") == "shared" else 0.0)
    curve = [(0.0, 0, first["eval_accuracy"])]
    for record in evals[1:]:
        trained = sum(s["ledger"]["trained"] for s in steps if s["elapsed_s"] <= record["elapsed_s"])
        curve.append((round(record["elapsed_s"] - start, 1), trained, record["eval_accuracy"]))
    usage, trained = summary["usage"], summary["ledger"]["trained"]
    if summary["eval_after"] is not None and (curve[-1][0] < usage["wall_s"] or curve[-1][1] != trained):
        # The run's closing evaluation, at the end of its budget (it records none when no version came since the
        # last), with every sample trained (a batch that took no optimizer step counts, and records no version).
        curve.append((max(round(usage["wall_s"], 1), curve[-1][0]), trained, summary["eval_after"]))
    extra = {"engine_busy_frac": usage["engine_busy_frac"], "cpu_core_frac": usage["cpu_core_frac"], "ledger": summary["ledger"]}
    return _side(
        curve,
        trained=trained,
        wall_s=usage["wall_s"],
        optimizer_steps=summary["version"],
        cpu_s=usage["cpu_s"],
        extra=extra,
    )


def _side(curve: list[tuple], *, trained: int, wall_s: float, optimizer_steps: int, cpu_s: dict, extra: dict | None = None) -> dict:
    """One side's record: its curve and what the comparison reads from it."""
    start = curve[0][2]

    def first_at(gain: float) -> float | None:
        return next((t for t, _, accuracy in curve if accuracy >= start + gain - 1e-9), None)

    return {
        "curve": [{"s": t, "samples": n, "accuracy": a} for t, n, a in curve],
        "accuracy_start": start, "accuracy_final": curve[-1][2], "accuracy_best": max(a for _, _, a in curve),
        "samples_trained": trained, "wall_s": round(wall_s, 1), "samples_per_s": round(trained / max(wall_s, 1e-9), 2),
        "optimizer_steps": optimizer_steps, "s_to_plus_10": first_at(0.10), "s_to_plus_20": first_at(0.20),
        "cpu_s": cpu_s, **(extra or {}),
    }  # fmt: skip


def _engine_alone(config: RunConfig, seconds: float, when: str) -> dict:
    from .learn_engine import engine_alone

    _say(f"bench learn: the engine alone ({when}), {seconds:.0f} s at {config.loop.max_inflight} requests")
    return engine_alone(config, seconds)


def _pooled(runs: list[dict]) -> dict:
    """The engine alone over all its measurements: completions over wall, and each run."""
    completions, wall = sum(r["completions"] for r in runs), sum(r["wall_s"] for r in runs)
    return {"samples_per_s": round(completions / wall, 2), "completions": completions, "wall_s": round(wall, 1),
            "in_flight": runs[0]["in_flight"], "runs": runs}  # fmt: skip


def _compare(sides: dict[str, dict]) -> dict:
    """async against trl: the time async took to reach TRL's accuracy at the end of its budget (the mean
    of its last three evaluations: one evaluation of a few hundred problems moves by a few points), as
    a fraction of TRL's wall; the ratio of samples trained per second; and at each of TRL's evaluations
    after its start, both sides' accuracy at that time of their own training (async's: of the last
    weights it evaluated by then), and whether async was ahead at every one."""
    if not {"async", "trl"} <= sides.keys():
        return {}
    ours, theirs = sides["async"], sides["trl"]
    last = [point["accuracy"] for point in theirs["curve"][1:][-3:]] or [theirs["accuracy_final"]]
    target = round(sum(last) / len(last), 4)
    reached = next((point["s"] for point in ours["curve"] if point["accuracy"] >= target), None)
    at_trl_evals = [
        {"s": point["s"], "trl": point["accuracy"], "async": _accuracy_at(ours["curve"], point["s"])} for point in theirs["curve"][1:]
    ]  # fmt: skip
    return {
        "trl_end_accuracy": target,
        "async_s_to_trl_end": reached,
        "async_time_frac_of_trl": None if reached is None else round(reached / theirs["wall_s"], 3),
        "async_over_trl_samples_per_s": round(ours["samples_per_s"] / max(theirs["samples_per_s"], 1e-9), 3),
        "at_trl_evaluations": at_trl_evals,
        "async_ahead_at_every_trl_evaluation": all(point["async"] > point["trl"] for point in at_trl_evals),
    }


def _accuracy_at(curve: list[dict], seconds: float) -> float:
    """A side's held-out accuracy at `seconds` into its training: that of the last weights it evaluated by
    then (each curve point is timed when its weights were the newest)."""
    return [point for point in curve if point["s"] <= seconds][-1]["accuracy"]


def plot(sides: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (by_time, by_samples) = plt.subplots(1, 2, figsize=(11, 4))
    for name, side in sides.items():
        points = side["curve"]
        by_time.plot([p["s"] for p in points], [100 * p["accuracy"] for p in points], marker="o", label=name)
        by_samples.plot([p["samples"] for p in points], [100 * p["accuracy"] for p in points], marker="o", label=name)
    by_time.set(xlabel="wall seconds of training", ylabel="held-out accuracy (%)", title="accuracy against time")
    by_samples.set(xlabel="samples trained", ylabel="held-out accuracy (%)", title="accuracy against samples")
    for axes in (by_time, by_samples):
        axes.grid(alpha=0.3)
        axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
