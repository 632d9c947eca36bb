"""SFT curves of several optimizers against wall time, from their runs' metrics.jsonl: a table and a PNG.

The runs are the same `asyncrl sft` with a different sft.optimizer.type each, started together so that
they share the machine alike (docs/BENCHMARKS.md, "Optimizers"):

    for t in adamw muon muon_split; do
      asyncrl sft glm5 runs_dir=runs/optw-$t name=$t torch_threads=1 sft.optimizer.type=$t sft.stop_at_accuracy=null \\
        sft.time_budget_s=900 sft.eval_every=50 sft.indexer_warmup.steps=0 sft.indexer_warmup.sparse_steps=0 &
    done; wait
    python scripts/optimizer_curves.py runs/optw-adamw/adamw runs/optw-muon/muon runs/optw-muon_split/muon_split \\
      --png docs/images/optimizer_curves.png
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def records(run: Path) -> list[dict]:
    path = run / "sft" / "metrics.jsonl"
    if not path.exists():
        raise SystemExit(f"{run}: no sft/metrics.jsonl (is it an `asyncrl sft` run directory?)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summary(rows: list[dict]) -> dict:
    losses = [r for r in rows if "loss" in r and "elapsed_s" in r]
    evals = [r for r in rows if "eval_accuracy" in r]
    last = losses[-5:]
    return {
        "steps": max((r["step"] for r in rows), default=0),
        "wall_s": round(max((r.get("elapsed_s", 0.0) for r in rows), default=0.0)),
        "final_loss": round(statistics.mean(r["loss"] for r in last), 3) if last else None,
        "best_heldout": max((r["eval_accuracy"] for r in evals), default=None),
        "final_heldout": evals[-1]["eval_accuracy"] if evals else None,
    }


def plot(runs: dict[str, list[dict]], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (loss_ax, eval_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for name, rows in runs.items():
        losses = [(r["elapsed_s"], r["loss"]) for r in rows if "loss" in r and "elapsed_s" in r]
        evals = [(r["elapsed_s"], r["eval_accuracy"]) for r in rows if "eval_accuracy" in r and "elapsed_s" in r]
        if losses:
            loss_ax.plot(*zip(*losses, strict=True), label=name)
        if evals:
            eval_ax.plot(*zip(*evals, strict=True), marker="o", label=name)
    loss_ax.set(title="SFT training loss", xlabel="wall time (s)", ylabel="loss", yscale="log")
    eval_ax.set(title="held-out greedy accuracy", xlabel="wall time (s)", ylabel="accuracy", ylim=(0, None))
    for ax in (loss_ax, eval_ax):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="`asyncrl sft` run directories (<runs_dir>/<name>)")
    parser.add_argument("--png", type=Path, help="write the curves here")
    args = parser.parse_args()
    runs = {run.name: records(run) for run in args.runs}
    print("| run | steps | wall (s) | loss, last 5 logs | best held-out | final held-out |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, rows in runs.items():
        s = summary(rows)
        print(f"| {name} | {s['steps']} | {s['wall_s']} | {s['final_loss']} | {s['best_heldout']} | {s['final_heldout']} |")
    if args.png:
        plot(runs, args.png)
        print(f"curves: {args.png}")


if __name__ == "__main__":
    main()
