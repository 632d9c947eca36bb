"""A first debugging view of recorded trajectories, in the terminal.

    asyncrl trajectories list RUN            one line a rollout: status, reward, turns, tokens, forks
    asyncrl trajectories show RUN ID         every token: text, id, log-prob, version, loss mask

RUN is a run directory, a SQLite file, or a Redis URL (with --namespace). The loss mask shown is the
one the learner will train with: it comes from `samples.trajectory_to_samples`, one table per fork.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from asyncrl.records import Trajectory
from asyncrl.samples import trajectory_to_samples

from .store import ReadOnlyStore, StoreError, TrajectoryReader, open_reader


def open_run(run: str, namespace: str | None = None) -> ReadOnlyStore:
    """The store behind RUN, opened for reading only; a SQLite path must exist (reading must not
    create an empty store)."""
    if run.startswith(("redis://", "rediss://", "unix://")):
        return open_reader(run, namespace=namespace or "default")
    path = Path(run)
    if not path.exists():
        raise FileNotFoundError(f"{run}: no such run directory or store file")
    if path.is_dir() and not (path / "trajectories.db").exists():
        raise FileNotFoundError(f"{run}: no trajectories.db in this directory (has `asyncrl serve` recorded anything?)")
    return open_reader(path)


def list_trajectories(store: TrajectoryReader, console: Console, *, status: str | None = None, limit: int = 100) -> int:
    trajectories = store.list(status=status, limit=limit)
    table = Table(title=f"{len(trajectories)} trajectories" + (f" ({status})" if status else ""), header_style="bold")
    table.add_column("rollout id", no_wrap=True, min_width=32)  # ids are what `show` takes: never cut them
    for column in ("task", "group", "status", "reward", "turns", "sampled", "forks", "engines"):
        table.add_column(column, justify="right" if column in ("reward", "turns", "sampled", "forks") else "left")
    for t in trajectories:
        reward = "" if t.reward is None else f"{t.reward:g}"
        sampled = sum(len(turn.completion_token_ids) for turn in t.turns)
        forks = len({turn.branch for turn in t.turns})
        engines = ",".join(sorted({turn.engine_id for turn in t.turns}))
        table.add_row(t.rollout_id, t.task, t.group_id, _status(t.status), reward, str(len(t.turns)), str(sampled), str(forks), engines)
    console.print(table)
    counts = store.counts()
    console.print(" ".join(f"{k}={v}" for k, v in counts.items() if v), style="dim")
    return len(trajectories)


def show_trajectory(store: TrajectoryReader, rollout_id: str, console: Console, tokenizer=None) -> None:
    t = store.get(rollout_id)
    reward = "none" if t.reward is None else f"{t.reward:g}"
    console.print(f"[bold]{t.rollout_id}[/]  task={t.task!r} group={t.group_id!r} status={_status(t.status)} reward={reward}")
    if t.metrics or t.reason or t.metadata:
        console.print(f"metadata={t.metadata} metrics={t.metrics} reason={t.reason!r}", style="dim")
    for turn in t.turns:
        timings = " ".join(f"{k}={v * 1000:.1f}ms" for k, v in turn.timings.items() if k.endswith("_s") or k == "total")
        console.print(
            f"turn {turn.index}: branch {turn.branch}, engine {turn.engine_id or '?'}, {len(turn.prompt_token_ids)} prompt + "
            f"{len(turn.completion_token_ids)} sampled tokens, finish {turn.finish_reason}  [dim]{timings}[/]"
        )
    for sample in trajectory_to_samples(_as_finished(t)):
        console.print(_token_table(sample, tokenizer or _tokenizer()))
    if t.status != "ok" and t.turns:
        console.print(f"(status {t.status}: masks shown as the learner would assemble them; it drops or skips such rollouts)", style="dim")


def _as_finished(t: Trajectory) -> Trajectory:
    """Running and aborted trajectories have no samples yet; show the masks they would get."""
    if t.status in ("running", "aborted"):
        return dataclasses.replace(t, status="ok", reward=0.0 if t.reward is None else t.reward)
    return t


def _token_table(sample, tokenizer) -> Table:
    title = f"fork {sample.branch}: turns {sample.turn_indices}, {len(sample.token_ids)} tokens, {sum(sample.loss_mask)} sampled"
    table = Table(title=title, header_style="bold", show_edge=False, pad_edge=False)
    # The KV version column only where the engine recorded one: elsewhere it would repeat the version.
    kv_versions = sample.kv_versions
    for column in ("pos", "text", "token id", "log-prob", "version", *(("kv version",) if kv_versions else ()), "mask"):
        table.add_column(column, justify="left" if column == "text" else "right")
    columns = zip(sample.token_ids, sample.loss_mask, sample.logprobs, sample.versions, strict=True)
    for pos, (token, mask, logprob, version) in enumerate(columns):
        text = Text(repr(tokenizer.decode([token], skip_special_tokens=False))[1:-1], style="bold green" if mask else "dim")
        shown = [f"{logprob:.4f}", str(version), *((str(kv_versions[pos]),) if kv_versions else ())]
        table.add_row(str(pos), text, str(token), *(shown if mask else [""] * len(shown)), str(mask), style=None if mask else "dim")
    return table


def _status(status: str) -> str:
    color = {"ok": "green", "running": "cyan", "aborted": "yellow"}.get(status, "red")
    return f"[{color}]{status}[/]"


def _tokenizer():
    from asyncrl.policy.tokenizer import build_tokenizer

    return build_tokenizer()


def _run_policy(run: str) -> str | None:
    """The policy directory a run directory's config names (its tokenizer decodes the run's tokens); None
    for the tiny policy, or where `run` is no run directory."""
    config = Path(run) / "config.yaml"
    if not config.is_file():
        return None
    from asyncrl.configs.loader import load_config

    return load_config(str(config)).policy.path


def main(args) -> int:
    """The `asyncrl trajectories` command (list | show)."""
    console = Console()
    try:
        store = open_run(args.run, args.namespace)
    except (FileNotFoundError, StoreError) as error:
        console.print(f"asyncrl trajectories: {error}", style="red")
        return 2
    try:
        if args.action == "list":
            list_trajectories(store, console, status=args.status, limit=args.limit)
        else:
            tokenizer = None
            source = args.tokenizer or _run_policy(args.run)
            if source:
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(source)
            show_trajectory(store, args.rollout_id, console, tokenizer)
    except StoreError as error:
        console.print(f"asyncrl trajectories: {error}", style="red")
        return 1
    finally:
        store.close()
    return 0
