"""`asyncrl replay train RUN --step N`: re-run learner step N on exactly the batch it trained, and compare.

One process, no engine, gateway or Ray. The learner is built as the run built it
(`RLLearner.from_config` on the run's config: the tiny policy from the run's seed, or `policy.path`),
on `learner.torch_threads` threads as the learner actor runs, then loaded from the newest kept
checkpoint at or before version N-1. Every recorded step from that checkpoint's version + 1 up to N
is re-run with `train_step` on its recorded batch: the rollouts of each group, in the order the
learner was handed them, turned into a batch by the loop's own `batch_of`, staleness measured
against the recorded `learner_version`. Selection, padding and advantages are pure functions of
those, so the step is the same step. The learner's step draws no random numbers (eval mode, no
dropout), so no other seed enters.

Before step N's optimizer step, the same rows go through the learner's own functions (`select`,
`advantages_for`, `to_rows`, `micro_batches`, its scorer, the run's objective) once more,
without gradients, to split the loss into each sample's share and each token's share (the per-token
objective term over the step's trainable tokens; the shares add up to the loss).

Measured (the run of tests/test_replay_train.py, tiny qwen3 policy, CPU, 1 thread, three recorded runs):
the replayed loss and grad norm equal the logged ones bit for bit (|diff| = 0.0) at every step 1-4,
from the starting policy and from a checkpoint, and so does every step re-run on the way; the
tolerance checked (TOLERANCE) is 1e-6.

Refused with a message: a step that was not recorded (`loop.record_batches`), a distillation step
(the teachers' log-probs were not stored), a step whose starting checkpoint retention deleted when
no earlier one can be replayed forward, a batch whose trajectories were deleted
(`store.keep_trajectories`, `asyncrl replay prune`). Nothing is written into the run.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncrl.learner.batch import Row
    from asyncrl.learner.rl import RLLearner
    from asyncrl.records import Batch, Sample, StepResult
    from asyncrl.sched.rundir import BatchRecord

    from .run import CheckpointRef, RunView

TOLERANCE = 1e-6
"""What the replayed loss and grad norm must match the logged ones within (on CPU, same threads)."""
COMPARED = ("loss", "grad_norm", "masked_token_frac", "padded")


@dataclass
class SampleShare:
    """One row of the step (padding repeats are rows of their own) and its share of the loss."""

    row: int
    rollout_id: str
    group_id: str
    task: str
    reward: float
    advantage: float
    repeat: bool
    """A padding repeat of an earlier row of its group."""
    computed: bool
    """False for a zero-advantage row, which the learner never runs through the model (its share is 0)."""
    trainable_tokens: int
    kept_tokens: int
    loss_share: float


@dataclass
class TokenShare:
    row: int
    rollout_id: str
    position: int
    """Index in the sample's token ids."""
    token_id: int
    text: str
    logprob: float
    rollout_logprob: float
    ratio: float
    kept: bool
    advantage: float
    loss_share: float


@dataclass
class StepReplay:
    run: str
    step: int
    started_from: str
    """The checkpoint the replay loaded (`start` or `vN`)."""
    replayed_steps: list[int]
    threads: int
    replayed: dict[str, Any]
    """loss, grad_norm, masked_token_frac, padded, ledger of the re-run step."""
    logged: dict[str, Any]
    """The same as metrics.jsonl recorded them for the step."""
    differences: dict[str, float | None]
    """|replayed - logged| of each compared number."""
    on_the_way: dict[int, float | None] = field(default_factory=dict)
    """|replayed - recorded| grad norm of each step re-run before this one (where a replay drifted first)."""
    samples: list[SampleShare] = field(default_factory=list)
    top_tokens: list[TokenShare] = field(default_factory=list)

    @property
    def matches(self) -> bool:
        """Loss and grad norm within TOLERANCE of the log (a number the run did not log is not compared)."""
        return all((diff := self.differences[k]) is None or diff <= TOLERANCE for k in ("loss", "grad_norm"))

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "matches": self.matches, "tolerance": TOLERANCE}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--step", type=int, required=True, metavar="N", help="the learner step to re-run (its version after)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the whole report as JSON to PATH")
    parser.add_argument("--top", type=int, default=10, metavar="K",
                        help="samples the terminal shows and tokens the report lists, by |loss share| (default 10)")  # fmt: skip
    parser.epilog = "Exit status: 0 when loss and grad norm match the log within 1e-6, 2 when they do not, 1 on an error."


def main(args: argparse.Namespace) -> int:
    from .run import RunView

    with RunView.open(args.run) as view:
        report = replay_step(view, args.step, top=max(args.top, 0))
    if args.json is not None:
        args.json.write_text(json.dumps(report.to_dict(), indent=1) + "\n")
    _print(report, args.top)
    return 0 if report.matches else 2


def replay_step(view: RunView, step: int, *, top: int = 10) -> StepReplay:
    """Re-run learner step `step` of the run `view` opened (from the checkpoint before it) and compare."""
    import torch

    from asyncrl.learner.rl import RLLearner

    start, records = plan(view, step)
    batches = [_batch(view, record) for record in records]  # every trajectory read before any training
    threads = view.config.learner.torch_threads
    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # the learner actor's budget: reductions then add up in the same order
    try:
        learner = RLLearner.from_config(view.config)
        if start.path is not None and start.version > 0:
            learner.load(start.path)
        on_the_way = {}
        for record, batch in zip(records[:-1], batches[:-1], strict=True):
            on_the_way[record.step] = _difference(_train(learner, record, batch).grad_norm, record.grad_norm)
        shares, tokens = _shares(learner, batches[-1], records[-1].learner_version, top)  # before step N's update
        metrics = _train(learner, records[-1], batches[-1]).record()
    finally:
        torch.set_num_threads(before)
    replayed = {k: metrics[k] for k in COMPARED} | {"ledger": metrics["ledger"]}
    logged = _logged(view, records[-1])
    differences = {k: _difference(replayed[k], logged.get(k)) for k in COMPARED}
    return StepReplay(
        run=str(view.path), step=step, started_from=start.label, replayed_steps=[r.step for r in records], threads=threads,
        replayed=replayed, logged=logged, differences=differences, on_the_way=on_the_way, samples=shares, top_tokens=tokens,
    )  # fmt: skip


def _train(learner: RLLearner, record: BatchRecord, batch: Batch) -> StepResult:
    if learner.version != record.learner_version:
        raise _error(f"learner step {record.step} started from version {record.learner_version}, but the replay is at {learner.version}")
    return learner.train_step(batch, current_version=record.learner_version)


def plan(view: RunView, step: int) -> tuple[CheckpointRef, list[BatchRecord]]:
    """The checkpoint to start from and the batch records to re-run, in order, the last one `step`'s."""
    target = view.batch(step)  # an unknown step lists the recorded ones
    start = view.checkpoint_at_or_before(step - 1)
    if start.version == 0 and start.path is not None and not start.path.is_dir():
        raise _error(f"the run's starting policy {start.path} (policy.path) no longer exists")
    records = []
    for version in range(start.version + 1, step):
        record = view.rundir.read_batch(version)
        if record is None:
            raise _error(_missing_between(view, step, start, version))
        records.append(record)
    records.append(target)
    for record in records:
        if record.distilled:
            raise _error(f"learner step {record.step} was a distillation step: the teachers' log-probs it trained on "
                         "were not stored, so it cannot be re-run")  # fmt: skip
    return start, records


def _missing_between(view: RunView, step: int, start: CheckpointRef, version: int) -> str:
    learner = view.config.learner
    every = learner.checkpoint_every
    wanted = (step - 1) // every * every
    gap = f"replaying from {start.label} needs the batch of step {version}, which was not recorded (loop.record_batches)"
    if wanted <= start.version:
        return f"learner step {step}: {gap}"
    return (
        f"learner step {step} starts from checkpoint v{wanted} (learner.checkpoint_every={every}), which is no longer in "
        f"{view.path}: retention deleted it (learner.keep_checkpoints_every={learner.keep_checkpoints_every}, "
        f"keep_last_checkpoints={learner.keep_last_checkpoints}; learner.keep_checkpoints_every={every} would have kept it) "
        f"or `asyncrl replay prune --checkpoints` did; and {gap}"
    )


def _batch(view: RunView, record: BatchRecord) -> Batch:
    """The step's batch, rebuilt from the store the way the loop built it."""
    from asyncrl.gateway.store import UnknownRollout
    from asyncrl.samples import batch_of

    groups = []
    for ids in record.groups:
        try:
            trajectories = [view.store.get(rollout_id) for rollout_id in ids]
        except UnknownRollout as missing:
            raise _error(
                f"learner step {record.step} trained rollouts that are no longer in the store ({missing}): "
                "store.keep_trajectories=false deletes them once a checkpoint holds their training, and "
                "`asyncrl replay prune --trajectories` deletes them later; keep them to re-run the step"
            ) from None
        groups.append(trajectories)
    return batch_of(groups, view.config.learner.crash_statuses)


def _shares(learner: RLLearner, batch: Batch, current_version: int, top: int) -> tuple[list[SampleShare], list[TokenShare]]:
    """Each row's and each token's share of the loss, from the learner's own functions, no gradient."""
    import torch

    from asyncrl.learner.batch import micro_batches
    from asyncrl.learner.objectives import StepTotals, token_weights
    from asyncrl.learner.selection import select
    from asyncrl.learner.sft_data import length_buckets
    from asyncrl.learner.shaping import step_rows
    from asyncrl.learner.updates import computes

    config = learner.config
    selection = select(batch.groups, current_version=current_version, max_staleness=config.max_staleness,
                       staleness_by=config.staleness_by, group_size=config.group_size,
                       crash_statuses=config.crash_statuses)  # fmt: skip
    rows = step_rows(selection, config, learner.temperature)[0]
    computed = [row for row in rows if computes(row)]
    totals = StepTotals(tokens=sum(sum(row.loss_mask[1:]) for row in rows), samples=sum(1 for row in rows if any(row.loss_mask[1:])))
    index = {id(row): i for i, row in enumerate(rows)}
    # micro_batches lays rows out in length-bucket order; that order maps its tensors back to rows.
    order = iter([row for bucket in length_buckets(computed) for row in bucket])
    pad = learner.tokenizer.pad_token_id if learner.tokenizer.pad_token_id is not None else 0
    shares = {i: (0.0, 0) for i in range(len(rows))}
    tokens: list[TokenShare] = []

    with torch.no_grad():
        for micro in micro_batches(computed, pad, config.micro_batch_tokens):
            micro = micro.to(learner.device)
            logp = learner.scorer(micro.input_ids, micro.attention_mask, micro.loss_mask, micro.temperatures, micro.rollout_logprobs).logp
            mask, rollout = micro.loss_mask[:, 1:], micro.rollout_logprobs[:, 1:]
            out = learner.objective(logp, rollout, micro.advantages, mask)
            per_token = out.per_token * token_weights(mask, config.loss_aggregation, totals, config.loss_constant)
            for b in range(logp.shape[0]):
                row = next(order)
                n = len(row.token_ids)
                if micro.input_ids[b, :n].tolist() != row.token_ids:
                    raise RuntimeError("micro_batches no longer lays rows out in length-bucket order; replay's row map needs updating")
                i = index[id(row)]
                shares[i] = (float(per_token[b].sum()), int(out.kept[b].sum()))
                for j in mask[b].nonzero().flatten().tolist():
                    tokens.append(TokenShare(
                        row=i, rollout_id=selection.batch[i].rollout_id, position=j + 1, token_id=row.token_ids[j + 1],
                        text=learner.tokenizer.decode([row.token_ids[j + 1]]), logprob=float(logp[b, j]),
                        rollout_logprob=float(rollout[b, j]), ratio=float(out.ratio[b, j]), kept=bool(out.kept[b, j]),
                        advantage=row.advantage, loss_share=float(per_token[b, j]),
                    ))  # fmt: skip
    samples_shares = _sample_shares(selection.batch, rows, computed, shares)
    tokens.sort(key=lambda t: -abs(t.loss_share))
    return samples_shares, tokens[:top]


def _sample_shares(samples: list[Sample], rows: list[Row], computed: list[Row], shares: dict[int, tuple[float, int]]) -> list[SampleShare]:
    """Each row's `SampleShare`, from its sample, its row and `shares` (row index -> (loss share, kept tokens))."""
    seen: set[tuple[str, int]] = set()
    was_computed = {id(row) for row in computed}
    samples_shares = []
    for i, (sample, row) in enumerate(zip(samples, rows, strict=True)):
        key = (sample.rollout_id, sample.branch)
        samples_shares.append(SampleShare(
            row=i, rollout_id=sample.rollout_id, group_id=sample.group_id, task=sample.task, reward=sample.reward,
            advantage=row.advantage, repeat=key in seen, computed=id(row) in was_computed,
            trainable_tokens=sum(row.loss_mask[1:]), kept_tokens=shares[i][1], loss_share=shares[i][0],
        ))  # fmt: skip
        seen.add(key)
    return samples_shares


def _logged(view: RunView, record: BatchRecord) -> dict[str, Any]:
    """What the run logged for the step: its metrics record (the one that stepped, the last if it was
    logged twice), else what the batch record kept."""
    logged = view.step_metrics(record.step) or {}
    fallback = {"loss": record.loss, "grad_norm": record.grad_norm, "padded": record.padded, "ledger": record.ledger}
    return {k: logged.get(k, fallback.get(k)) for k in (*COMPARED, "ledger")}


def _difference(replayed: Any, logged: Any) -> float | None:
    if replayed is None or logged is None:
        return None
    return abs(float(replayed) - float(logged))


def _error(message: str) -> Exception:
    from .run import ReplayError

    return ReplayError(message)


def _print(report: StepReplay, top: int) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    steps = report.replayed_steps
    console.print(f"[bold]learner step {report.step}[/] of {report.run}: from {report.started_from}, re-ran steps "
                  f"{steps[0]}..{steps[-1]} on {report.threads} thread(s)")  # fmt: skip
    summary = Table("", "replayed", "logged", "|diff|")
    for key in COMPARED:
        diff = report.differences[key]
        summary.add_row(key, _fmt(report.replayed[key]), _fmt(report.logged.get(key)), "-" if diff is None else f"{diff:.3g}")
    summary.add_row("ledger", _ledger(report.replayed["ledger"]), _ledger(report.logged.get("ledger")), "")
    console.print(summary)
    drifted = {k: d for k, d in report.on_the_way.items() if d is not None and d > TOLERANCE}
    if drifted:
        console.print(f"[yellow]steps re-run on the way drifted from their records (|grad norm diff|): {drifted}[/]")
    verdict = "[green]match the log[/]" if report.matches else "[red]DIFFER from the log[/]"
    console.print(f"loss and grad norm {verdict} (tolerance {TOLERANCE:g})")
    samples = Table("row", "rollout", "task", "reward", "advantage", "kept/trainable", "loss share", title="samples by |loss share|")
    for s in sorted(report.samples, key=lambda s: -abs(s.loss_share))[:top]:
        note = " (repeat)" if s.repeat else "" if s.computed else " (zero adv., not computed)"
        samples.add_row(str(s.row), s.rollout_id[:12] + note, s.task, f"{s.reward:g}", f"{s.advantage:+.3f}",
                        f"{s.kept_tokens}/{s.trainable_tokens}", f"{s.loss_share:+.3e}")  # fmt: skip
    console.print(samples)
    tokens = Table("row", "pos", "token", "logp", "rollout logp", "ratio", "kept", "loss share", title="top tokens by |loss share|")
    for t in report.top_tokens:
        tokens.add_row(str(t.row), str(t.position), repr(t.text), f"{t.logprob:.4f}", f"{t.rollout_logprob:.4f}",
                       f"{t.ratio:.4f}", "yes" if t.kept else "masked", f"{t.loss_share:+.3e}")  # fmt: skip
    console.print(tokens)


def _fmt(value: Any) -> str:
    return "-" if value is None else f"{value:.9g}" if isinstance(value, float) else str(value)


def _ledger(ledger: dict | None) -> str:
    return ", ".join(f"{k} {v}" for k, v in ledger.items() if v) if ledger else "-"
