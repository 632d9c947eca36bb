"""`asyncrl replay prune RUN`: delete what a run no longer needs, and say what replay can then no longer do.

The one replay verb that writes. `--trajectories` deletes the trajectories the learner acknowledged
(trained or accounted for at a checkpoint); a live run's pending and running ones are never touched,
the store refuses them. `--checkpoints` deletes the complete checkpoints outside a retention rule
(`--keep-every N`, `--keep-last K`; by default the run's own `learner.keep_checkpoints_every` and
`learner.keep_last_checkpoints`); the newest checkpoint and any still being written are never
deleted. `--dry-run` prints what would go and deletes nothing.
"""

from __future__ import annotations

import argparse
import sys

SHOWN = 8
"""How many deleted trajectory ids the report lists."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Delete acknowledged trajectories and/or checkpoints outside a retention rule. This verb WRITES to "
        "the run (every other replay verb only reads); --dry-run shows what it would delete. Never deleted: "
        "running or unacknowledged trajectories, the newest checkpoint, a checkpoint being written."
    )
    parser.add_argument("--trajectories", action="store_true", help="delete the trajectories the learner acknowledged")
    parser.add_argument("--checkpoints", action="store_true", help="delete the checkpoints the retention rule does not keep")
    parser.add_argument("--keep-every", type=int, metavar="N", help="keep checkpoints whose version is a multiple of N "
                        "(default: the run's learner.keep_checkpoints_every)")  # fmt: skip
    parser.add_argument("--keep-last", type=int, metavar="K", help="keep the newest K checkpoints "
                        "(default: the run's learner.keep_last_checkpoints)")  # fmt: skip
    parser.add_argument("--dry-run", action="store_true", help="print what would be deleted; delete nothing")


def main(args: argparse.Namespace) -> int:
    from asyncrl.gateway.store import open_store
    from asyncrl.gateway.store.base import TrajectoryPruner
    from asyncrl.sched.rundir import Retention

    from .run import ReplayError, RunView

    if not (args.trajectories or args.checkpoints):
        raise ReplayError("nothing to prune: give --trajectories and/or --checkpoints")
    for name in ("keep_every", "keep_last"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ReplayError(f"--{name.replace('_', '-')} must be at least 1")
    with RunView.open(args.run) as view:
        config, rundir, address = view.config, view.rundir, view.rundir.store_address(view.config)
    verb, deleted_any = ("would delete" if args.dry_run else "deleted"), False
    if args.checkpoints:
        learner = config.learner
        every = args.keep_every if args.keep_every is not None else learner.keep_checkpoints_every
        last = args.keep_last if args.keep_last is not None else learner.keep_last_checkpoints if every is not None else None
        retention = Retention(every, last)
        if retention.keeps_all:
            raise ReplayError(
                "the run keeps every checkpoint (learner.keep_checkpoints_every is unset): give --keep-every N and/or --keep-last K"
            )
        doomed = rundir.retire_checkpoints(retention, dry_run=args.dry_run)
        deleted_any |= bool(doomed)
        print(f"checkpoints ({retention.describe()}): {verb} {len(doomed)}" + "".join(f"\n  {path}" for path in doomed))
    if args.trajectories:
        store = open_store(address, namespace=rundir.store_namespace(config))
        assert isinstance(store, TrajectoryPruner)  # both backends delete
        try:
            acknowledged = store.acknowledged()
            deleted = len(acknowledged) if args.dry_run else store.delete(acknowledged)
            left = store.counts()
        finally:
            store.close()
        deleted_any |= bool(deleted)
        kept = left["running"] + left["pending"] + left["claimed"]
        shown = "".join(f"\n  {rollout_id}" for rollout_id in acknowledged[:SHOWN])
        more = f"\n  ... ({len(acknowledged)} in all)" if len(acknowledged) > SHOWN else ""
        print(f"trajectories: {verb} {deleted} acknowledged; kept {kept} running or not yet acknowledged{shown}{more}")
    if deleted_any and not args.dry_run:
        print("replay can no longer score, train or re-play with what was deleted", file=sys.stderr)
    return 0
