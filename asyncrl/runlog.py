"""What every training job writes down: `metrics.jsonl`, an optional wandb run, PNG curves.

Shared by the SFT warm start (`asyncrl/jobs/sft.py`) and the RL loop (`sched/`). wandb is optional: it
runs offline unless the config says online, and a missing install only costs the wandb copy.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from asyncrl.configs.schema import RunConfig


class MetricsLog:
    """One JSON line per record in `<out_dir>/metrics.jsonl`, mirrored to wandb when enabled."""

    def __init__(self, config: RunConfig, out_dir: Path, run_name: str, *, append: bool = False) -> None:
        self.path = out_dir / "metrics.jsonl"
        if not append or not self.path.exists():
            self.path.write_text("")
        self.wandb = None
        if config.logging.wandb != "disabled":
            try:
                import wandb
            except ImportError:
                print("wandb is not installed: metrics go to metrics.jsonl only")
            else:
                self.wandb = wandb.init(
                    project=config.logging.wandb_project, name=run_name, dir=str(out_dir),
                    mode=config.logging.wandb, config=config.model_dump(mode="json"), reinit="finish_previous",
                )  # fmt: skip

    def record(self, metrics: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(metrics) + "\n")
        if self.wandb is not None:
            self.wandb.log(metrics, step=metrics["step"])

    def read(self) -> list[dict]:
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()


@dataclass
class Panel:
    """One plot: named metrics against `step`, from the records that have them."""

    title: str
    ylabel: str
    series: list[tuple[str, str]]
    """(metric key, legend label) pairs."""
    yscale: str = "linear"
    ylim: tuple[float, float] | None = None
    marker: str | None = None


def plot_panels(records: list[dict], panels: list[Panel], path: Path) -> None:
    """Side-by-side panels against optimizer step, saved as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        drawn = 0
        for key, label in panel.series:
            points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
            if points:
                ax.plot(*zip(*points, strict=True), label=label, marker=panel.marker)
                drawn += 1
        ax.set(xlabel="step", ylabel=panel.ylabel, yscale=panel.yscale, title=panel.title)
        if panel.ylim is not None:
            ax.set_ylim(*panel.ylim)
        if drawn > 1:
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_consistency(records: list[dict], path: Path) -> None:
    """`consistency.png`: the learner-vs-rollout log-prob gap of every learner step (overall mean and max,
    and each task's mean), the fraction of tokens the objective masked on each side of its band, and
    the ratio quantiles; from the step records' consistency keys (`learner/consistency.py`)."""
    tasks = sorted({task for r in records for task in r.get("logprob_gap_by_task") or {}})
    # Each task's mean gap as a flat key of its own, so it is one more series of a panel.
    flat = [{**r, **{f"gap/{t}": g["mean"] for t, g in (r.get("logprob_gap_by_task") or {}).items()}} for r in records]
    panels = [
        Panel("learner vs rollout |log-prob gap|", "|Δ log-p| (sampled tokens)",
              [("logprob_gap_mean", "mean"), ("logprob_gap_max", "max")]),
        Panel("mean |log-prob gap| per task", "|Δ log-p|", [(f"gap/{t}", t) for t in tasks]),
        Panel("tokens masked by the objective", "fraction of trainable tokens",
              [("masked_below_frac", "below the band"), ("masked_above_frac", "above the band")]),
        Panel("importance ratio quantiles", "ratio", [("ratio_p01", "p01"), ("ratio_p50", "p50"), ("ratio_p99", "p99")], yscale="log"),
    ]  # fmt: skip
    plot_panels(flat, panels, path)
