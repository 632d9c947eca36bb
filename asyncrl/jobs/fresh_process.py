"""Run one job in a fresh interpreter, so that everything it held goes back to the OS when it ends.

A pipeline runs its stages one after the other. In one process, what a stage leaves behind (torch's
and glibc's freed-but-kept heap, caches of the model it loaded) stays, and on a real model it adds up:
after SmolLM2's SFT stage and its matrix evaluation the pipeline's process held 11 GB, and Ray's memory
monitor killed the next stage's learner. A stage in a spawned child leaves nothing when it exits.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import signal
import sys
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class FreshProcessDied(RuntimeError):
    """The child ended without a result or an exception: killed (the kernel's OOM killer sends SIGKILL) or crashed."""


def in_fresh_process(job: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`job(*args, **kwargs)` in a spawned child: its result, or its exception raised here (the child prints
    its traceback first). `job`, its arguments and its result must pickle; the child inherits the
    environment, the working directory and standard output. A Ctrl-C reaches both: the child ends the
    job as it would alone, and this waits for it before raising."""
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_call, args=(os.getpid(), send, job, args, kwargs), name=getattr(job, "__name__", "job"))
    child.start()
    send.close()
    try:
        outcome = receive.recv()
    except EOFError:
        outcome = None
    except KeyboardInterrupt:
        child.join()
        raise
    child.join()
    if outcome is None:
        raise FreshProcessDied(f"{child.name} died in its own process ({_how(child.exitcode)}) before it returned")
    returned, value = outcome
    if returned:
        return value
    raise value


def _call(parent: int, send, job: Callable, args: tuple, kwargs: dict) -> None:
    _die_with(parent)
    try:
        outcome = (True, job(*args, **kwargs))
    except BaseException as failure:  # KeyboardInterrupt included: the parent re-raises it
        traceback.print_exc()
        outcome = (False, failure)
    try:
        send.send(outcome)
    except Exception as unpicklable:  # an exception (or result) that does not pickle still says what it was
        send.send((False, RuntimeError(f"{_described(outcome[1])} (and it could not be sent back: {unpicklable})")))
    finally:
        send.close()
        sys.stdout.flush()


def _die_with(parent: int) -> None:
    """SIGTERM this child when its parent dies, however (a SIGTERM or SIGKILL to the pipeline alone), so that
    no stage runs on orphaned with its Ray cluster (Linux's PR_SET_PDEATHSIG; elsewhere the child outlives it)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before the line above
        os._exit(1)


def _described(value: object) -> str:
    return f"{type(value).__name__}: {value}"


def _how(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        name = signal.Signals(-exitcode).name
        return f"{name}; the kernel's OOM killer sends SIGKILL" if name == "SIGKILL" else name
    return f"exit code {exitcode}"
