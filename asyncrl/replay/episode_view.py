"""The terminal view of `asyncrl replay episode`: one row per replayed rollout, the first divergences in
full (the decoded text both sides share, then the recorded and the replayed text from the differing
token on), one row per task saying whether it replayed the same, and, for a single rollout, every turn's
new text (what the environment or its tools sent before that call) on both sides."""

from __future__ import annotations

import json
from collections import Counter

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .divergence import EpisodeReplay, TaskSummary

SHOWN_DETAILS = 8
"""Diverged rollouts whose divergence is shown in full."""


def show(console: Console, reports: list[EpisodeReplay], summaries: list[TaskSummary], left_out: list[EpisodeReplay]) -> None:
    table = Table(title="replayed episodes")
    table.add_column("rollout", no_wrap=True)
    for column in ("task", "turns rec/rep", "verdict", "first divergence"):
        table.add_column(column)
    for r in reports:
        verdict = "[green]OK[/green]" if r.verdict == "ok" else "[red]diverged[/red]"
        table.add_row(r.rollout_id, escape(r.task), f"{r.recorded_turns}/{r.replayed_turns}", verdict, escape(where(r)))
    console.print(table)
    if len(reports) == 1:
        _turns(console, reports[0])
    for r in [r for r in reports if r.divergence is not None][:SHOWN_DETAILS]:
        d = r.divergence
        assert d is not None
        console.print(f"[bold]{r.rollout_id}[/bold] ({escape(r.task)}) {escape(where(r))}: {escape(d.explanation)}")
        if d.before:
            console.print(f"  before:   {escape(_line(d.before))}")
        console.print(f"  recorded: {escape(_line(d.recorded))}")
        console.print(f"  replayed: {escape(_line(d.replayed))}")
    tasks = Table(title="tasks")
    for column in ("task", "replayed", "diverged", "where", "tools"):
        tasks.add_column(column)
    for s in summaries:
        kinds = ", ".join(f"{kind.replace('_', ' ')} x{n}" for kind, n in s.kinds.items())
        tools = ", ".join(f"{tool} x{n}" for tool, n in s.tools.items())
        tasks.add_row(escape(s.task), str(s.replayed), f"[red]{s.diverged}[/red]" if s.diverged else "0", escape(kinds), escape(tools))
    console.print(tasks)
    nondeterministic = [s.task for s in summaries if not s.deterministic]
    if nondeterministic:
        console.print(f"[red]not deterministic:[/red] {escape(', '.join(nondeterministic))}")
    else:
        console.print(f"[green]every replayed episode matched its record[/green] ({len(reports)} rollouts)")
    if left_out:
        console.print(f"skipped {len(left_out)} rollout(s): {escape(reasons_text(left_out))}")


def where(report: EpisodeReplay) -> str:
    """`turn 1, token 37: tool output (dice)`, or `outcome: reward`; empty when it replayed the same."""
    d = report.divergence
    if d is None:
        return ""
    place = "outcome" if d.turn is None else f"turn {d.turn}" + (f", token {d.position}" if d.position is not None else "")
    tools = f" ({', '.join(d.tools)})" if d.tools else ""
    return f"{place}: {d.kind.replace('_', ' ')}{tools}"


def reasons_text(left_out: list[EpisodeReplay]) -> str:
    """Why rollouts were skipped, each reason once with its count."""
    counts = Counter(r.reason for r in left_out)
    return "; ".join(f"{n} because {reason}" for reason, n in counts.most_common())


def _turns(console: Console, report: EpisodeReplay) -> None:
    table = Table(title=f"turns of {report.rollout_id}: the new text of each prompt")
    for column in ("turn", "prompt", "recorded", "replayed"):
        table.add_column(column)
    for turn in report.turns:
        same = "[green]equal[/green]" if turn.equal else f"[red]differs at {turn.first_difference}[/red]"
        recorded = "(not in the record)" if turn.recorded_new is None else _line(turn.recorded_new)
        replayed = "(not asked)" if turn.replayed_new is None else _line(turn.replayed_new)
        table.add_row(str(turn.turn), same, escape(recorded), escape(replayed if not turn.equal else "(same)"))
    console.print(table)


def _line(text: str) -> str:
    return json.dumps(text)[1:-1] or "(nothing)"
