"""What every training job writes down: `metrics.jsonl`, an optional wandb run, PNG curves.

Shared by the SFT warm start (`sched/sft.py`) and the RL loop (`sched/`). wandb is optional: it
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
