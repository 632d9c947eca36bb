"""The `asyncrl eval` command: what to evaluate, on which config, and the table, JSON and plot it leaves."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .evaluate import Plan, Target, evaluate_target, run_checkpoints

EXIT_USAGE = 2


def add_parser(sub) -> None:
    ev = sub.add_parser(
        "eval", help="held-out pass@1 / pass@k of a checkpoint, a run's checkpoints or an OpenAI-compatible URL",
        description="Plays each task's held-out problems as an RL run evaluates them: greedy pass@1, and with --samples N "
        "pass@1 and pass@k from N sampled episodes per problem (unbiased estimator), each with a 95%% bootstrap interval.",
    )  # fmt: skip
    ev.add_argument("target", help="a checkpoint directory, a run directory (every checkpoint of it), or an http(s):// URL")
    ev.add_argument("config", nargs="?", default=None, help="preset or YAML naming the tasks (default: a run directory's own)")
    ev.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. eval.num_problems=500")
    ev.add_argument("--samples", type=int, default=0, metavar="N", help="sampled episodes per problem (default 0: greedy only)")
    ev.add_argument("--k", default=None, metavar="K,K", help="pass@k to report from the samples (default: 1 and N)")
    ev.add_argument("--temperature", type=float, default=None, help="sampling temperature (rollout.sampling.temperature)")
    ev.add_argument(
        "--last",
        type=int,
        default=None,
        metavar="M",
        help="a run directory: only its last M checkpoints (default: all it kept, after the one it started from)",
    )
    ev.add_argument("--api-key", default="none", help="the URL's API key")
    ev.add_argument("--json", default=None, metavar="PATH", help="write every figure here (default for a run: RUN/eval.json)")
    ev.add_argument("--plot", default=None, metavar="PATH", help="plot here (default for a run: RUN/eval.png)")
    ev.set_defaults(handler=cmd_eval)


class _Usage(Exception):
    """A command line that cannot run: the message says why."""


def cmd_eval(args: argparse.Namespace) -> int:
    source, overrides = args.config, list(args.overrides)
    if source is not None and "=" in source and not Path(source).is_file():
        source, overrides = None, [source, *overrides]
    if args.temperature is not None:
        overrides.append(f"rollout.sampling.temperature={args.temperature}")
    try:
        target, run_dir = _target(args)
        plan = _plan(args)
        config = _config(args, target, run_dir, source, overrides)
    except _Usage as usage:
        print(f"asyncrl eval: {usage}", file=sys.stderr)
        return EXIT_USAGE
    rows = evaluate_target(config, target, plan, say=lambda line: print(line, file=sys.stderr))
    print_table(rows, plan)
    for label, tasks in rows.items():
        for task, figures in tasks.items():
            for status, reason in figures.get("failures", {}).items():
                print(f"asyncrl eval: {label} {task}: episodes ended {status} (they count as failures), e.g.: {reason}", file=sys.stderr)
    json_path = args.json or (run_dir / "eval.json" if run_dir else None)
    plot_path = args.plot or (run_dir / "eval.png" if run_dir else None)
    if json_path:
        report = {"config": source or str(run_dir), "overrides": overrides, "samples": plan.samples, "ks": plan.ks, "rows": rows}
        Path(json_path).write_text(json.dumps(report, indent=2) + "\n")
        print(f"figures: {json_path}")
    if plot_path:
        plot(rows, plan, Path(plot_path))
        print(f"plot: {plot_path}")
    return 0


def _target(args: argparse.Namespace) -> tuple[Target, Path | None]:
    """What to evaluate, and the run directory when it is one."""
    target, given = Target(api_key=args.api_key), Path(args.target)
    if args.target.startswith(("http://", "https://")):
        target.url = args.target
        return target, None
    if (given / "config.json").is_file():
        target.checkpoints = {given.name: given}
        return target, None
    if (given / "checkpoints").is_dir():
        kept = list(run_checkpoints(given).items())
        target.checkpoints = dict(kept[-args.last :] if args.last else kept)
        return target, given
    raise _Usage(f"{args.target} is neither a checkpoint (config.json), a run directory (checkpoints/) nor a URL")


def _plan(args: argparse.Namespace) -> Plan:
    try:
        ks = sorted({int(k) for k in args.k.split(",")}) if args.k else sorted({1, args.samples}) if args.samples else [1]
    except ValueError:
        raise _Usage(f"--k takes whole numbers separated by commas (1,4,8), not {args.k!r}") from None
    if min(ks) < 1 or args.samples < 0:
        raise _Usage("--k and --samples must be positive")
    if args.samples and max(ks) > args.samples:
        raise _Usage(f"pass@{max(ks)} needs at least {max(ks)} samples per problem (--samples {args.samples})")
    return Plan(samples=args.samples, ks=ks)


def _config(args: argparse.Namespace, target: Target, run_dir: Path | None, source: str | None, overrides: list[str]):
    """The config naming the tasks: CONFIG, else a run directory's own (whose start joins the checkpoints)."""
    from asyncrl.configs import load_config

    if source is not None:
        return load_config(source, overrides)
    if run_dir is None:
        raise _Usage("give a CONFIG (preset or YAML) naming the tasks to evaluate on")
    from asyncrl.sched.rundir import RunDir

    config = RunDir(run_dir).read_config(overrides)
    if config.policy.path and not args.last:  # the checkpoint RL started from, for the before and after
        target.checkpoints = {"start": Path(config.policy.path), **target.checkpoints}
    return config


def _cell(figure) -> str:
    value, low, high = figure
    return f"{value:6.1%} [{low:.1%}, {high:.1%}]"


def print_table(rows: dict[str, dict[str, dict]], plan: Plan) -> None:
    from rich.console import Console
    from rich.table import Table

    columns = ["greedy_pass@1", *(f"pass@{k}" for k in plan.ks if plan.samples)]
    table = Table(title="held-out evaluation (95% bootstrap intervals over problems)")
    for heading in ["checkpoint", "task", "problems", *columns]:
        table.add_column(heading)
    for label, tasks in rows.items():
        for task, figures in tasks.items():
            table.add_row(label, task, str(figures["problems"]), *(_cell(figures[c]) for c in columns))
    console = Console()
    # Piped or captured output has no width of its own: rich would fold the figures into 80 columns.
    (console if console.is_terminal else Console(width=160)).print(table)


def plot(rows: dict[str, dict[str, dict]], plan: Plan, path: Path) -> None:
    """Each task's figures against the checkpoints (a run), or side by side (one checkpoint)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = ["greedy_pass@1", *(f"pass@{k}" for k in plan.ks if plan.samples)]
    tasks = sorted({task for row in rows.values() for task in row})
    fig, axes = plt.subplots(1, len(tasks), figsize=(5 * len(tasks), 3.6), squeeze=False)
    labels = list(rows)
    for ax, task in zip(axes[0], tasks, strict=True):
        for column in columns:
            points = [(i, rows[label][task][column]) for i, label in enumerate(labels) if task in rows[label]]
            xs = [i for i, _ in points]
            values, lows, highs = ([f[j] for _, f in points] for j in range(3))
            if len(labels) > 1:
                ax.plot(xs, values, marker="o", label=column)
                ax.fill_between(xs, lows, highs, alpha=0.2)
            else:
                below = [v - lo for v, lo in zip(values, lows, strict=True)]
                above = [h - v for v, h in zip(values, highs, strict=True)]
                ax.errorbar([column], values, yerr=[below, above], fmt="o")
        ax.set_title(task if len(labels) > 1 else f"{task}: {labels[0]}")
        ax.set(ylim=(0, 1), ylabel="held-out (95% interval)")
        if len(labels) > 1:
            ax.set_xticks(range(len(labels)), labels, rotation=45, ha="right", fontsize=7)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
