"""Benchmark: every RL objective on the same task, from the same SFT checkpoint, for the same number of steps.

One SFT warm start (none when `policy.path` is set, or `bench.sft_checkpoint` names one), then one
`asyncrl run` per objective in `bench.objectives`, each in a process of its own, each from that
checkpoint with `learner.objective` set to the objective's defaults and `loop.steps` = `bench.steps`
(count, not wall time: the verdict does not depend on how busy the machine is). Reported per objective:
held-out accuracy before and after (the run's own greedy evaluations), the gain, the steps taken, the
wall time, the gain per minute of it and the share of trained tokens its mask dropped. With
`bench.dynamic_sampling` (on by default) one more row trains the first objective with
`learner.dynamic_sampling` on, for DAPO's rule's effect on learning per wall second. A markdown table is
printed and written beside the JSON.

    asyncrl bench objectives --json bench-objectives.json
    asyncrl bench objectives bench.steps=60 "bench.objectives=[icepop_grpo,ppo]"
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, Field

from asyncrl.configs import RunConfig
from asyncrl.configs.objectives import OBJECTIVE_NAMES

PRESET = "quickstart"
OVERRIDES = ("loop.wall_budget_s=null", "loop.eval_every=1000000")


class ObjectivesBenchOptions(BaseModel):
    objectives: list[str] = Field(default_factory=lambda: list(OBJECTIVE_NAMES))
    """The objectives to compare (learner.objective names), each at its defaults."""
    steps: int = Field(100, ge=1)
    """Optimizer steps each objective trains for."""
    sft_checkpoint: str | None = None
    """Start every objective from this checkpoint (None: policy.path, else one SFT warm start of the config)."""
    dynamic_sampling: bool = True
    """One more row: the first objective with learner.dynamic_sampling on."""


def run(config: RunConfig, json_path: str | None, options: ObjectivesBenchOptions | None) -> dict:
    from asyncrl.jobs.fresh_process import in_fresh_process
    from asyncrl.jobs.run import run as run_job
    from asyncrl.jobs.sft import run_sft

    options = options or ObjectivesBenchOptions()
    unknown = sorted(set(options.objectives) - set(OBJECTIVE_NAMES))
    if unknown:
        raise ValueError(f"bench.objectives: unknown {unknown} (known: {', '.join(OBJECTIVE_NAMES)})")
    start = options.sft_checkpoint or config.policy.path
    if start is None:
        start = str(in_fresh_process(run_sft, config).checkpoint)
    variants = [(name, name, False) for name in options.objectives]
    if options.dynamic_sampling and options.objectives:
        variants.append((f"{options.objectives[0]} + dynamic sampling", options.objectives[0], True))
    rows = []
    for label, name, dynamic in variants:
        objective = type(config.learner).model_validate({"objective": name}).objective
        sampling = config.learner.dynamic_sampling.model_copy(update={"enabled": dynamic})
        learner = config.learner.model_copy(update={"objective": objective, "dynamic_sampling": sampling})
        run_config = config.model_copy(update={
            "name": f"{config.name}-objective-{name}{'-ds' if dynamic else ''}", "learner": learner,
            "policy": config.policy.model_copy(update={"path": start}),
            "loop": config.loop.model_copy(update={"steps": options.steps, "sft_first": False}),
        })  # fmt: skip
        summary = in_fresh_process(run_job, run_config)
        rows.append(_row(label, summary, Path(config.runs_dir) / run_config.name))
    result = {"benchmark": "objectives", "start": start, "steps": options.steps, "objectives": rows}
    table = _table(rows)
    print(table)
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=2))
        Path(json_path).with_suffix(".md").write_text(table + "\n")
    return result


def _row(name: str, summary: dict, run_dir: Path) -> dict:
    """One objective's figures from its summary and its metrics (the masked fraction, averaged over steps)."""
    masked = []
    metrics = run_dir / "metrics.jsonl"
    for line in metrics.read_text().splitlines() if metrics.exists() else ():
        record = json.loads(line)
        if (value := record.get("masked_token_frac")) is not None:
            masked.append(value)
    before, after = summary.get("eval_before"), summary.get("eval_after")
    return {
        "objective": name, "eval_before": before, "eval_after": after,
        "gain": None if before is None or after is None else after - before, "steps": summary.get("version"),
        "wall_s": summary.get("wall_s"), "masked_token_frac": sum(masked) / len(masked) if masked else None,
        "dropped_no_signal": summary.get("ledger", {}).get("dropped_no_signal"),
    }  # fmt: skip


def _table(rows: list[dict]) -> str:
    def pct(value):
        return "-" if value is None else f"{value:.1%}"

    header = "| objective | held-out before | after | gain (points) | steps | wall s | points / min | masked tokens |"
    lines = [header, "|---" * 8 + "|"]
    for row in rows:
        gain = "-" if row["gain"] is None else f"{100 * row['gain']:+.1f}"
        rate = "-" if row["gain"] is None or not row["wall_s"] else f"{6000 * row['gain'] / row['wall_s']:+.2f}"
        lines.append(f"| {row['objective']} | {pct(row['eval_before'])} | {pct(row['eval_after'])} | {gain} | {row['steps']} | "
                     f"{row['wall_s']:.0f} | {rate} | {pct(row['masked_token_frac'])} |")  # fmt: skip
    return "\n".join(lines)
