"""`asyncrl replay VERB RUN ...`: the replay verbs' command lines.

Each verb is a module of this package with `add_arguments(parser)` and `main(args) -> int`; their top
levels import nothing heavy (torch, transformers, Ray load inside `main`), so `--help` stays instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys

VERBS = {
    "score": "re-score recorded tokens under checkpoints: ratios, objective decisions, drift (terminal, JSON lines, HTML)",
    "train": "re-run a learner step on exactly the batch it trained, from the checkpoint before it, and compare",
    "episode": "re-play episodes with the recorded completions in place of the model; report the first divergence",
    "prune": "delete trajectories and checkpoints a run no longer needs (what replay can no longer use)",
}


def add_selection_arguments(parser: argparse.ArgumentParser, *, limit_help: str) -> None:
    """The options that choose which recorded rollouts a verb replays (`run.Selection`)."""
    pick = parser.add_argument_group("selection (every option given narrows it; none: every rollout of the run)")
    pick.add_argument("--rollout", metavar="ID", help="one rollout")
    pick.add_argument("--step", type=int, metavar="N", help="the rollouts learner step N trained (needs loop.record_batches)")
    pick.add_argument("--task", metavar="T", help="rollouts of task T")
    pick.add_argument("--status", metavar="S", help="rollouts that ended with status S (ok, env_crash, timeout, error)")
    pick.add_argument("--reward-min", type=float, metavar="X", help="reward at least X")
    pick.add_argument("--reward-max", type=float, metavar="X", help="reward at most X")
    pick.add_argument("--limit", type=int, metavar="N", help=limit_help)


def add_parser(sub: argparse._SubParsersAction) -> None:
    replay = sub.add_parser("replay", help="replay a recorded run for debugging: score, train, episode, prune")
    verbs = replay.add_subparsers(dest="verb", required=True, metavar="VERB")
    for verb, help_text in VERBS.items():
        parser = verbs.add_parser(verb, help=help_text, description=help_text)
        parser.add_argument("run", metavar="RUN", help="the run directory (runs/NAME)")
        module = importlib.import_module(f"asyncrl.replay.{verb}")
        module.add_arguments(parser)
        parser.set_defaults(handler=_handler(verb))


def _handler(verb: str):
    def handle(args: argparse.Namespace) -> int:
        from .run import ReplayError

        module = importlib.import_module(f"asyncrl.replay.{verb}")
        try:
            return int(module.main(args))
        except ReplayError as error:
            print(f"asyncrl replay {verb}: {error}", file=sys.stderr)
            return 1

    return handle
