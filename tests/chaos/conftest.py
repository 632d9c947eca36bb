"""What the chaos tests share: a real `asyncrl run` in a process session of its own on a tiny config,
the Ray actors of that run (found by their process titles), the checks of its books against the
trajectory store and the checkpoints, and the figures each test measured.

The books a killed run must still balance, from what is on disk (not from what the run says):

- the store (the run's own, SQLite or Redis, as its config.yaml says): every rollout that was started
  is terminal and acknowledged (none running, pending or claimed). The loop acknowledges a rollout
  only after booking it, at a checkpoint, so none was lost;
- the checkpoints: each lists the rollouts it acknowledged (`acking` in its loop_state.json; the run's
  last checkpoint rewrites the one of its version, so not every list survives); no rollout is in two
  of them and each is a rollout of the store;
- the last checkpoint's ledger (the books of the weights that survived) has as many accounts as
  rollouts were started, and summary.json agrees. With every rollout acknowledged, that is exactly
  one account each: none was trained twice.

A test's figures (`figures`) go to runs/chaos/<name>.json (`services_helpers.record_figures`, as the
other chaos tests write theirs) and to the JUnit report's properties, and are listed at the end of
the pytest session, with or without `-s`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
# A conftest here needs tests/chaos/__init__.py (two top-level `conftest` modules would shadow each
# other); the helper modules beside the tests are still imported by their bare names.
sys.path.insert(0, str(HERE))

from loop_helpers import TINY  # noqa: E402  (tests/ is on the path: pytest's rootdir-relative import)
from services_helpers import record_figures  # noqa: E402

PATIENCE_S = 180.0
"""Longest wait for any event of a run on a loaded 2-core machine; only a hang ever reaches it."""

COIN = ["tasks.mix.coin.env=loop_helpers:CoinEnv", "tasks.mix.coin.eval_problems=8"]
"""The task mix of most chaos runs: the parity task (a random policy's groups have signal)."""


class RunProcess:
    """`python -m asyncrl run ...` in its own session (its Ray and actors with it), logging to a file."""

    def __init__(self, run_dir: Path, argv: list[str], log: Path) -> None:
        self.run_dir, self.log = run_dir, log
        # The tasks live in tests/loop_helpers.py (the parity task) and beside the tests that use them.
        path = [str(HERE.parent), str(HERE), os.environ.get("PYTHONPATH")]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(filter(None, path))}
        with log.open("w") as out:
            self.process = subprocess.Popen([sys.executable, "-m", "asyncrl", "run", *argv], stdout=out, stderr=subprocess.STDOUT,
                                            env=env, start_new_session=True)  # fmt: skip
        self.pid = self.process.pid

    # -- what the run has done, from its files -------------------------------------------------

    def metrics(self) -> list[dict]:
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return []
        records = []
        for line in path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                break  # the line being written
        return records

    def step(self) -> int:
        """The learner's latest version in the metrics (0 before its first step)."""
        return max((r["step"] for r in self.metrics() if "loss" in r), default=0)

    def committed(self) -> int:
        """The version of the newest complete checkpoint (-1: none yet)."""
        states = self.run_dir.glob("checkpoints/step-*/loop_state.json")
        return max((int(path.parent.name.removeprefix("step-")) for path in states), default=-1)

    def summary(self) -> dict:
        return json.loads((self.run_dir / "summary.json").read_text())

    def tail(self) -> str:
        return self.log.read_text()[-4000:]

    # -- its processes ---------------------------------------------------------------------------

    def processes(self) -> dict[int, str]:
        """pid -> process title, of every live (not zombie) process in this run's session."""
        found = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
                title = (entry / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
            except OSError:
                continue  # gone meanwhile
            state, _, _, session = stat.rsplit(")", 1)[1].split()[:4]
            if int(session) == self.pid and state != "Z":
                found[int(entry.name)] = title
        return found

    def actor_pids(self, title: str) -> list[int]:
        """This run's processes whose title starts with `title` (Ray names an actor's process
        `ray::<Class>`, `ray::<Class>.<method>` while it runs one)."""
        return [pid for pid, name in self.processes().items() if name.startswith(title)]

    def niceness(self, pid: int | None = None) -> int:
        return os.getpriority(os.PRIO_PROCESS, self.pid if pid is None else pid)

    def wait_until(self, condition, what: str):
        """Poll `condition` (a guard against hangs, not a timing check); fails if the run exits first."""
        deadline = time.monotonic() + PATIENCE_S
        while not (value := condition()):
            assert self.process.poll() is None, f"the run exited ({self.process.returncode}) before {what}:\n{self.tail()}"
            assert time.monotonic() < deadline, f"gave up after {PATIENCE_S:g} s waiting for {what}:\n{self.tail()}"
            time.sleep(0.02)
        return value

    def wait_for_actor(self, title: str) -> int:
        (pid,) = self.wait_until(lambda: self.actor_pids(title), f"the {title} actor")
        return pid

    def wait_until_gone(self, *titles: str) -> None:
        """Wait until no process of this run's session has a title starting with one of `titles`."""
        deadline = time.monotonic() + PATIENCE_S
        while any(self.actor_pids(title) for title in titles):
            assert time.monotonic() < deadline, f"{titles} outlived their driver by {PATIENCE_S:g} s: {self.processes()}"
            time.sleep(0.02)

    def kill9(self, pid: int) -> float:
        """SIGKILL `pid`; returns the wall-clock time of the kill."""
        killed_at = time.time()
        os.kill(pid, signal.SIGKILL)
        return killed_at

    def finish(self) -> int:
        """Wait for the run to exit; its exit status."""
        try:
            return self.process.wait(timeout=PATIENCE_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the run did not finish within {PATIENCE_S:g} s:\n{self.tail()}") from None

    def kill_session(self) -> None:
        """SIGKILL whatever is left of the run's session (its Ray, its actors) and wait until it is gone."""
        for pid in self.processes():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self.process.poll() is None:
            self.process.wait()
        deadline = time.monotonic() + PATIENCE_S
        while self.processes() and time.monotonic() < deadline:
            time.sleep(0.02)


@pytest.fixture
def start_run(tmp_path):
    """`start_run(name, *overrides, resume=False, tasks=COIN)`: a tiny `asyncrl run` (TINY, one rollout
    worker) of the task mix `tasks` under tmp_path (or `--resume` of that run). Every run a test starts
    is killed with its whole session when the test ends."""
    runs: list[RunProcess] = []

    def start(name: str, *overrides: str, resume: bool = False, tasks: list[str] = COIN) -> RunProcess:
        run_dir = tmp_path / name
        fresh = ["quickstart", *TINY, *tasks, f"runs_dir={tmp_path}", f"name={name}", *overrides]
        argv = ["--resume", str(run_dir), *overrides] if resume else fresh
        run = RunProcess(run_dir, argv, tmp_path / f"{name}-{len(runs)}.log")
        runs.append(run)
        return run

    yield start
    for run in runs:
        run.kill_session()


@pytest.fixture
def books():
    """`books(run_dir)`: assert the books of the module docstring; returns their figures."""
    return check_books


@pytest.fixture
def store():
    """`store(run_dir)`: the run's trajectory store, read-only, wherever its config puts it (close it when done)."""
    return run_store


@pytest.fixture
def turns():
    """`turns(run_dir)`: every recorded turn of the run, by the engine that sampled it."""
    return turns_by_engine


@pytest.fixture
def figures(record_property):
    """`figures(name, {...})`: a test's measured figures to runs/chaos/<name>.json, the JUnit report's
    properties and the session's summary."""

    def record(name: str, measured: dict) -> None:
        record_figures(name, measured)
        for key, value in measured.items():
            record_property(key, value)

    return record


def run_store(run_dir: Path):
    """The run's trajectory store, read-only, wherever its config puts it (a SQLite file, a Redis namespace)."""
    from asyncrl.gateway.store import open_reader
    from asyncrl.sched.rundir import RunDir

    rundir = RunDir(run_dir)
    config = rundir.read_config()
    return open_reader(rundir.store_address(config), namespace=RunDir.store_namespace(config))


def check_books(run_dir: Path) -> dict:
    """Assert the module docstring's books from the store and the checkpoints; returns their figures."""
    store = run_store(run_dir)
    try:
        counts, rollouts = store.counts(), {t.rollout_id for t in store.list()}
    finally:
        store.close()
    started = len(rollouts)
    assert counts["running"] == counts["pending"] == counts["claimed"] == 0 and counts["acked"] == started > 0, counts
    states = [json.loads(p.read_text()) for p in sorted(run_dir.glob("checkpoints/step-*/loop_state.json"))]
    committed = [rollout for state in states for rollout in state["acking"]]
    assert len(committed) == len(set(committed)), "a rollout was acknowledged by two checkpoints: trained twice"
    assert set(committed) <= rollouts, "a checkpoint acknowledged rollouts the store never had"
    ledger = states[-1]["ledger"]
    assert sum(ledger.values()) == started, (ledger, started)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["balanced"] and summary["ledger"] == {**ledger, "started": started}, summary["ledger"]
    return {"started": started, "ledger": ledger, "checkpoints": len(states)}


def turns_by_engine(run_dir: Path) -> dict[str, list]:
    """Every recorded turn of the run, by the engine that sampled it."""
    store = run_store(run_dir)
    try:
        by_engine: dict[str, list] = {}
        for trajectory in store.list():
            for turn in trajectory.turns:
                by_engine.setdefault(turn.engine_id, []).append(turn)
        return by_engine
    finally:
        store.close()


def pytest_terminal_summary(terminalreporter) -> None:
    """What this session's chaos tests measured (their `figures`), shown whether or not output was captured."""
    reports = [r for key in ("passed", "failed") for r in terminalreporter.stats.get(key, ())]
    measured = [r for r in reports if r.when == "call" and "chaos/" in r.nodeid and r.user_properties]
    if measured:
        terminalreporter.section("chaos: recovery figures (also in runs/chaos/)")
        for report in measured:
            terminalreporter.write_line(f"{report.nodeid.rsplit('::', 1)[-1]}: {json.dumps(dict(report.user_properties))}")
