"""The `asyncrl` command line.

Every job command takes a config (a preset name such as `quickstart`, or a YAML path) followed by
dotted overrides (`rollout.sampling.temperature=0.7`); `--dry-run` prints the resolved config and
exits. Heavy imports (torch, Ray) happen inside the commands so `asyncrl --help` stays instant.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import yaml

from asyncrl.configs import ConfigError, RunConfig, dump_config, load_config, preset_names

EXIT_CONFIG_ERROR = 2


def _add_config_arguments(parser: argparse.ArgumentParser, *, required: bool = True) -> None:
    parser.add_argument(
        "config",
        nargs=None if required else "?",
        help=f"preset name ({', '.join(preset_names())}) or path to a YAML config",
    )
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. sft.lr=3e-4")
    parser.add_argument("--dry-run", action="store_true", help="print the resolved config and exit")


def _resolve(args: argparse.Namespace) -> RunConfig | None:
    """Load the config; with --dry-run print it and return None (the command then stops)."""
    config = load_config(args.config, args.overrides)
    if args.dry_run:
        print(dump_config(config), end="")
        return None
    return config


def cmd_sft(args: argparse.Namespace) -> int:
    config = _resolve(args)
    if config is None:
        return 0
    from asyncrl.jobs.sft import run_sft

    result = run_sft(config)
    print(f"checkpoint: {result.checkpoint}")
    print(f"held-out accuracy: {result.accuracy:.1%} after {result.steps} steps in {result.wall_s:.0f} s")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    if args.resume is None and args.config is None:
        print("asyncrl run: give a CONFIG, or --resume RUN_DIR", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    if args.address is not None:
        args.overrides.append(f"cluster.address={args.address}")
    if args.resume is not None:
        # CONFIG is optional with --resume (the run directory holds it); a KEY=VALUE there is an override.
        overrides = ([args.config] if args.config else []) + args.overrides
        from asyncrl.sched.rundir import RunDir

        if args.dry_run:
            print(dump_config(RunDir(args.resume).read_config(overrides)), end="")
            return 0
        config = None
    else:
        overrides = []
        config = _resolve(args)
        if config is None:
            return 0
    from asyncrl.envs.sandbox.base import SandboxError
    from asyncrl.jobs.run import RunExists, run

    try:
        summary = run(config, resume=args.resume, overrides=overrides)
    except (RunExists, FileNotFoundError, SandboxError) as err:
        print(f"asyncrl run: {err}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    print(format_summary(summary))
    return 0 if summary["balanced"] and summary.get("stop_reason") != "no_signal" else 1


def cmd_distill(args: argparse.Namespace) -> int:
    config = _resolve(args)
    if config is None:
        return 0
    from asyncrl.envs.sandbox.base import SandboxError
    from asyncrl.jobs.distill import NotADistillation, distill
    from asyncrl.jobs.run import RunExists

    try:
        summary = distill(config)
    except (NotADistillation, RunExists, SandboxError) as err:
        print(f"asyncrl distill: {err}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    print(format_summary(summary))
    kl = summary.get("reverse_kl") or {}
    if kl:
        print("reverse KL to each teacher (first -> last step): " + "  ".join(f"{k} {a:.3f} -> {b:.3f}" for k, (a, b) in kl.items()))
    return 0 if summary["balanced"] else 1


def cmd_pipeline(args: argparse.Namespace) -> int:
    from asyncrl.configs.pipeline import dump_pipeline, load_pipeline

    if args.resume is None and args.config is None:
        print("asyncrl pipeline: give a CONFIG, or --resume PIPELINE_DIR", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    from asyncrl.envs.sandbox.base import SandboxError
    from asyncrl.jobs.pipeline import PipelineDir, PipelineExists, StageLearnedNothing, run_pipeline

    # CONFIG is optional with --resume (the pipeline directory holds it); a KEY=VALUE there is an override.
    overrides = ([args.config] if args.resume is not None and args.config else []) + args.overrides
    try:
        pipeline = PipelineDir(args.resume).read_config(overrides) if args.resume else load_pipeline(args.config, overrides)
        if args.dry_run:
            print(dump_pipeline(pipeline), end="")
            return 0
        summary = run_pipeline(None if args.resume else pipeline, resume=args.resume, overrides=overrides)
    except (PipelineExists, FileNotFoundError, SandboxError) as err:
        print(f"asyncrl pipeline: {err}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    except StageLearnedNothing as err:
        print(f"asyncrl pipeline: {err}", file=sys.stderr)
        return 1
    misses = [check for check in summary["checks"] if not check["passed"]]
    print(f"pipeline directory: {summary['pipeline_dir']}  ({len(summary['stages'])} stages, {summary['wall_s'] / 60:.1f} min)")
    print(f"checks: {len(summary['checks']) - len(misses)} of {len(summary['checks'])} met" + ("" if not misses else " (see above)"))
    return 0


NO_SIGNAL_STOP = (
    "stopped early: loop.max_batches_without_step batches in a row took no optimizer step (in every group the rewards "
    "were equal). Start from a warm start (policy.path, or loop.sft_first), or check that the task's reward tells rollouts apart."
)


def format_summary(summary: dict) -> str:
    def pct(value):
        return "-" if value is None else f"{value:.1%}"

    ledger = summary["ledger"]
    accounts = "  ".join(f"{k} {v}" for k, v in ledger.items() if k != "started")
    check = "balanced" if summary["balanced"] else "NOT BALANCED"
    return "\n".join([
        f"run directory: {summary['run_dir']}  ({summary['mode']}, {summary['version']} optimizer steps, {summary['wall_s']:.0f} s)",
        f"held-out accuracy: {pct(summary['eval_before'])} before RL -> {pct(summary['eval_after'])} after",
        f"ledger: {accounts}  = {sum(v for k, v in ledger.items() if k != 'started')} of {ledger['started']} started ({check})",
        *([NO_SIGNAL_STOP] if summary.get("stop_reason") == "no_signal" else []),
    ])  # fmt: skip


def cmd_generate(args: argparse.Namespace) -> int:
    from asyncrl.generate import generate_from_checkpoint

    return generate_from_checkpoint(args)


def cmd_bench(args: argparse.Namespace) -> int:
    from asyncrl.bench import BENCHMARKS

    if args.name not in BENCHMARKS:
        print(f"asyncrl bench: unknown benchmark {args.name!r} (known: {', '.join(sorted(BENCHMARKS))})", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    source, overrides = args.config, list(args.overrides)
    if source is not None and "=" in source and not Path(source).is_file():
        source, overrides = None, [source, *overrides]  # no CONFIG given: the first word is an override
    if args.minutes is not None:
        overrides.append(f"bench.minutes={args.minutes}")
    config, options = BENCHMARKS[args.name].resolve(source, overrides)
    if args.dry_run:
        print(dump_config(config), end="")
        if options is not None:
            print(yaml.safe_dump({"bench": options.model_dump(mode="json")}, sort_keys=False), end="")
        return 0
    results = BENCHMARKS[args.name].run(config, args.json, options)
    print(json.dumps(results, indent=2))
    return 0


def _bench_epilog() -> str:
    from asyncrl.bench import BENCHMARKS

    return "\n".join(["benchmarks:", *(line for name, bench in BENCHMARKS.items() for line in bench.describe(name))])


def cmd_serve(args: argparse.Namespace) -> int:
    if args.address is not None:  # engines on the cluster: as Ray actors
        args.overrides += [f"cluster.address={args.address}", "gateway.engines=ray"]
    config = _resolve(args)
    if config is None:
        return 0
    from asyncrl.jobs.serve import serve

    return serve(config)


def cmd_token(args: argparse.Namespace) -> int:
    from asyncrl.jobs.serve import run_credentials, run_directory

    # A run directory (what `asyncrl serve` prints) or the config the gateway was served with.
    given = Path(args.config)
    run_dir = given if not args.overrides and given.is_dir() else run_directory(load_config(args.config, args.overrides))
    try:
        credentials = run_credentials(run_dir)
    except (FileNotFoundError, ValueError) as err:
        print(f"asyncrl token: {err}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    print(credentials.engine_token if args.engine else credentials.run_token)
    return 0


def cmd_trajectories(args: argparse.Namespace) -> int:
    from asyncrl.gateway.inspect import main as inspect_main

    return inspect_main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="asyncrl",
        description="Asynchronous agentic RL post-training: SFT warm start, RL runs, rollout engines, gateway, benchmarks.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    sft = sub.add_parser("sft", help="train the policy and its MTP module on synthetic demonstrations")
    _add_config_arguments(sft)
    sft.set_defaults(handler=cmd_sft)

    run = sub.add_parser("run", help="SFT warm start (if needed), then asynchronous RL: engines, gateway, episodes, learner")
    _add_config_arguments(run, required=False)
    run.add_argument("--resume", metavar="RUN_DIR", default=None, help="continue a stopped run from its last checkpoint")
    run.add_argument(
        "--address", default=None, metavar="ADDR",
        help="run on this Ray cluster: auto, HOST:PORT or ray://HOST:PORT (cluster.address; docs/CLUSTER.md)",
    )  # fmt: skip
    run.set_defaults(handler=cmd_run)

    distill = sub.add_parser("distill", help="on-policy cross-stage distillation: the student (policy.path) learns from distill.teachers")
    _add_config_arguments(distill)
    distill.set_defaults(handler=cmd_distill)

    pipeline = sub.add_parser(
        "pipeline", help="run a post-training pipeline (SFT -> RL stages -> distillation) from one file, with its evaluation matrix"
    )
    pipeline.add_argument("config", nargs="?", help="pipeline preset name (pipeline) or path to a pipeline YAML")
    pipeline.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. stages.reasoning.config.loop.steps=50")
    pipeline.add_argument(
        "--resume", metavar="PIPELINE_DIR", default=None, help="continue a stopped pipeline at the stage and step where it stopped"
    )
    pipeline.add_argument("--dry-run", action="store_true", help="print the resolved pipeline config and exit")
    pipeline.set_defaults(handler=cmd_pipeline)

    gen = sub.add_parser("generate", help="sample from a checkpoint with the embedded engine")
    gen.add_argument("checkpoint", help="a Hugging Face model directory (e.g. runs/quickstart/sft/checkpoint)")
    source = gen.add_mutually_exclusive_group()
    source.add_argument("--prompt", help="a user message, rendered with the chat template")
    source.add_argument("--raw", help="raw text, tokenized as is (no chat template)")
    source.add_argument("--token-ids", help="comma-separated prompt token ids")
    gen.add_argument("-n", "--num-samples", type=int, default=1, help="samples to draw (default 1)")
    gen.add_argument("--temperature", type=float, default=1.0, help="0 means greedy (default 1.0)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--tokens", action="store_true", help="print a token-by-token table (id, text, log-prob, version)")
    gen.add_argument("--json", action="store_true", help="print results as JSON lines")
    gen.set_defaults(handler=cmd_generate)

    bench = sub.add_parser(
        "bench",
        help="run a benchmark and write its results as JSON",
        epilog=_bench_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_argument("name", help="benchmark name, e.g. engine")
    bench.add_argument("config", nargs="?", default=None, help="preset or YAML config (default: the benchmark's own, below)")
    bench.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="dotted config overrides; bench.KEY=VALUE sets the benchmark's own settings"
    )
    bench.add_argument("--json", default=None, metavar="PATH", help="write results to this JSON file")
    bench.add_argument("--dry-run", action="store_true", help="print the resolved config and exit")
    bench.add_argument("--minutes", type=float, default=None, metavar="N", help="how long a timed benchmark runs (soak): bench.minutes=N")
    bench.set_defaults(handler=cmd_bench)

    serve = sub.add_parser("serve", help="start engines and the TITO gateway for agents to call by hand")
    _add_config_arguments(serve)
    serve.add_argument(
        "--address", default=None, metavar="ADDR",
        help="start the engines on this Ray cluster (auto, HOST:PORT or ray://HOST:PORT; sets cluster.address and gateway.engines=ray)",
    )  # fmt: skip
    serve.set_defaults(handler=cmd_serve)

    token = sub.add_parser("token", help="print the run token (or --engine: the engine token) of the gateway `asyncrl serve CONFIG` runs")
    token.add_argument("config", help="the config served (preset or YAML, with the same overrides), or its run directory")
    token.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, as given to asyncrl serve")
    token.add_argument("--engine", action="store_true", help="the engine token (engine registration) instead of the run token")
    token.set_defaults(handler=cmd_token)

    traj = sub.add_parser("trajectories", help="list or show recorded trajectories token by token")
    traj_sub = traj.add_subparsers(dest="action", required=True, metavar="ACTION")
    listing = traj_sub.add_parser("list", help="one line per rollout")
    show = traj_sub.add_parser("show", help="one trajectory: text, token id, log-prob, version, loss mask")
    for p in (listing, show):
        p.add_argument("run", metavar="RUN", help="run directory, SQLite file, or redis:// URL")
        p.add_argument("--namespace", default=None, help="Redis key prefix (the run name)")
        p.set_defaults(handler=cmd_trajectories)
    listing.add_argument("--status", default=None, help="only rollouts with this status")
    listing.add_argument("--limit", type=int, default=100, help="most rows (default 100)")
    show.add_argument("rollout_id", metavar="ID")
    show.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer directory (default: that of the policy a run directory's config names, else the tiny policy's)",
    )

    from asyncrl.jobs.eval_cli import add_parser as add_eval_parser
    from asyncrl.jobs.model import add_parser as add_model_parser
    from asyncrl.replay.cli import add_parser as add_replay_parser

    add_eval_parser(sub)
    add_model_parser(sub)
    add_replay_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        return handler(args)
    except ConfigError as err:
        print(f"asyncrl: {err}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    except KeyboardInterrupt:
        print("asyncrl: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
