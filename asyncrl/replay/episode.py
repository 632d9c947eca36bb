"""`asyncrl replay episode RUN [selection]`: re-play recorded episodes with the recorded completions in
place of the model, and report where each first parted from its record.

Each selected rollout's episode is played again by its task's environment, built from the run's config,
on the problem drawn from the rollout's `task_seed`, through the same gateway code, with a replay engine
answering every call with the recorded completion (asyncrl/replay/player.py). The comparison
(asyncrl/replay/divergence.py) checks every turn's prompt tokens, the tool and environment outputs in
them, the number of turns and the outcome. Exit status: 0 when every replayed rollout matched its record,
2 when any diverged, 1 on bad input.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import TYPE_CHECKING

from .cli import add_selection_arguments

if TYPE_CHECKING:
    from rich.console import Console

    from asyncrl.configs.schema import RunConfig
    from asyncrl.records import Trajectory

    from .player import Player, Replayed


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = "exit status: 0 every replayed rollout matched its record, 2 some diverged, 1 bad input"
    add_selection_arguments(parser, limit_help="at most N rollouts (of those that can be replayed)")
    parser.add_argument("--concurrency", type=int, default=8, metavar="N", help="episodes replayed at once (default 8)")
    parser.add_argument("--json", metavar="PATH", help="also write the report as JSON to PATH")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def main(args: argparse.Namespace) -> int:
    from rich.console import Console

    from .divergence import compare, skipped, summarize
    from .episode_view import reasons_text, show
    from .run import ReplayError, RunView, Selection

    if args.limit is not None and args.limit < 1:
        raise ReplayError("--limit must be at least 1")
    if args.concurrency < 1:
        raise ReplayError("--concurrency must be at least 1")
    with RunView.open(args.run) as view:
        player = _player(view.config)
        if args.task is not None and args.task not in player.tasks:
            raise ReplayError(f"task {args.task!r} is not in the run's config; its tasks are {', '.join(sorted(player.tasks))}")
        chosen = view.select(Selection(
            rollout_id=args.rollout, step=args.step, task=args.task, status=args.status,
            reward_min=args.reward_min, reward_max=args.reward_max,
        ))  # fmt: skip
        if not chosen:
            raise ReplayError(f"no rollout of {view.path} matches the selection")
        reasons = {t.rollout_id: player.unreplayable(t) for t in chosen}
        if args.rollout is not None and reasons[args.rollout] is not None:
            raise ReplayError(f"rollout {args.rollout} cannot be replayed: {reasons[args.rollout]}")
        playable = [t for t in chosen if reasons[t.rollout_id] is None][: args.limit]
        left_out = [skipped(t, why) for t in chosen if (why := reasons[t.rollout_id]) is not None]
        if not playable:
            raise ReplayError(f"none of the {len(chosen)} selected rollouts can be replayed: {reasons_text(left_out)}")
        console = Console(stderr=True)
        replayed = asyncio.run(_play(player, playable, args.concurrency, progress=not args.no_progress, console=console))
    reports = [compare(r, player.tokenizer) for r in replayed]
    summaries = summarize(reports)
    show(Console(), reports, summaries, left_out)
    if args.json:
        document = {
            "run": str(Path(args.run)),
            "rollouts": [r.to_dict() for r in reports],
            "tasks": [{**vars(s), "deterministic": s.deterministic} for s in summaries],
            "skipped": [{"rollout_id": r.rollout_id, "task": r.task, "reason": r.reason} for r in left_out],
        }
        Path(args.json).write_text(json.dumps(document, indent=1) + "\n")
    return 2 if any(r.verdict == "diverged" for r in reports) else 0


def _player(config: RunConfig) -> Player:
    from asyncrl.envs.registry import EnvironmentNotFound

    from .player import Player
    from .run import ReplayError

    try:
        return Player(config)
    except (EnvironmentNotFound, TypeError, ValueError, OSError) as error:  # OSError: the policy's tokenizer is gone
        raise ReplayError(f"the run's task mix or tokenizer cannot be built again: {error}") from None


async def _play(player: Player, trajectories: list[Trajectory], concurrency: int, *, progress: bool, console: Console) -> list[Replayed]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from asyncrl.envs.sandbox import SandboxError

    from .run import ReplayError

    columns = (TextColumn("replaying"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True, disable=not progress) as bar:
        job = bar.add_task("replay", total=len(trajectories))
        try:
            return await player.play(trajectories, concurrency=concurrency, on_done=lambda _: bar.advance(job))
        except SandboxError as error:
            raise ReplayError(f"the run's sandbox backend cannot start here: {error}") from None
