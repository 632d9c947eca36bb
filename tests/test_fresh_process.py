"""A pipeline stage in a spawned child (asyncrl/jobs/fresh_process.py): its result, its exception and its
death come back to the parent, and what it allocated does not stay there."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncrl.jobs.fresh_process import FreshProcessDied, in_fresh_process


def held_mib(megabytes: int) -> tuple[int, int]:
    """Touch `megabytes` of memory; this process's id and its peak resident set in MiB."""
    block = bytearray(megabytes * 2**20)
    block[::4096] = b"\x01" * len(block[::4096])
    return os.getpid(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024


class StageFailed(RuntimeError):
    pass


def fails(message: str) -> None:
    raise StageFailed(message)


def killed_by_the_kernel() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class Unpicklable(Exception):
    def __init__(self, reason: str, detail: object) -> None:  # two arguments: pickle calls it with one
        super().__init__(reason)
        self.detail = detail


def fails_unpicklably() -> None:
    raise Unpicklable("the learner went away", lambda: None)


def sleeps(pid_file: str) -> None:
    Path(pid_file).write_text(str(os.getpid()))
    time.sleep(600)


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] in ("Z", "X")  # dead, not yet reaped
    except FileNotFoundError:
        return True


def test_a_child_does_not_outlive_its_parent(tmp_path):
    pid_file = tmp_path / "child.pid"
    script = (
        "from test_fresh_process import sleeps; from asyncrl.jobs.fresh_process import in_fresh_process; "
        f"in_fresh_process(sleeps, {str(pid_file)!r})"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))}
    parent = subprocess.Popen([sys.executable, "-c", script], env=env)
    deadline = time.monotonic() + 120  # a guard against a hang, not a verdict
    while not pid_file.exists() or not pid_file.read_text():
        assert parent.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    child = int(pid_file.read_text())
    parent.kill()  # the pipeline alone, as `kill -9 PID` does; its child gets SIGTERM from the kernel
    parent.wait()
    while not _gone(child):
        assert time.monotonic() < deadline, f"the child {child} outlived its parent"
        time.sleep(0.05)


def test_the_result_comes_back_and_the_memory_stays_in_the_child():
    child, child_peak_mib = in_fresh_process(held_mib, 300)
    assert child != os.getpid()
    assert child_peak_mib >= 300
    # The parent never held the child's block: its own peak did not grow by it.
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    in_fresh_process(held_mib, 300)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100 * 1024


def test_the_childs_exception_is_raised_in_the_parent_with_its_type(capfd):
    with pytest.raises(StageFailed, match="no checkpoint"):
        in_fresh_process(fails, "no checkpoint")
    assert "StageFailed: no checkpoint" in capfd.readouterr().err  # the child's traceback, where it happened


def test_an_exception_that_does_not_pickle_still_says_what_it_was():
    with pytest.raises(RuntimeError, match="Unpicklable: the learner went away"):
        in_fresh_process(fails_unpicklably)


def test_a_child_killed_by_sigkill_is_said_so():
    with pytest.raises(FreshProcessDied, match=r"killed_by_the_kernel died.*SIGKILL.*OOM killer"):
        in_fresh_process(killed_by_the_kernel)
