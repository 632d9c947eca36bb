"""The supervisor of one tool call, run inside the sandbox as `python3 -c <this file> <spec json>`.

It starts the tool code as a child under resource limits, enforces the wall clock and the output
cap itself (so a call ends on time even when the host is slow to notice), kills every process the
call left behind, and prints exactly one JSON line describing what happened. Standard library only,
and no imports from asyncrl: this file is the whole program the sandbox's interpreter sees.
"""

import contextlib
import json
import os
import resource
import selectors
import signal
import subprocess
import sys
import time

# A child that exited may leave grandchildren holding its pipes open; wait this long for them.
_LINGER_S = 0.2
_ENV = {
    "PATH": "/usr/bin:/bin",
    "HOME": "/scratch",
    "TMPDIR": "/tmp",
    "LANG": "C.UTF-8",
    "PYTHONUNBUFFERED": "1",  # output printed before a kill still reaches the model
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONIOENCODING": "utf-8",
}


def _limit_child(rlimits):
    def apply():
        os.nice(10)  # tool code yields the CPU to the trainer and the engines
        try:
            # Under memory pressure the kernel kills the tool code, not this supervisor.
            with open("/proc/self/oom_score_adj", "w") as f:
                f.write("1000")
        except OSError:
            pass
        for name, value in rlimits.items():
            resource.setrlimit(getattr(resource, name), (value, value))

    return apply


def _kill_everything(child, whole_namespace):
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.pid, signal.SIGKILL)
    if whole_namespace:
        # Code that left its session (setsid, double fork) is still in this PID namespace, where
        # kill(-1) reaches every process but init and ourselves. Only sent inside a namespace of the
        # sandbox's own: outside one it would reach every process of this user on the machine.
        with contextlib.suppress(ProcessLookupError):
            os.kill(-1, signal.SIGKILL)


def _pump(child, deadline, cap):
    """Read both pipes until EOF, the deadline or the cap; returns (stdout, stderr, total, reason)."""
    selector = selectors.DefaultSelector()
    buffers = {child.stdout: bytearray(), child.stderr: bytearray()}
    for pipe in buffers:
        selector.register(pipe, selectors.EVENT_READ)
    total, exited_at = 0, None
    while selector.get_map():
        now = time.monotonic()
        if exited_at is None and child.poll() is not None:
            exited_at = now
        if exited_at is not None and now - exited_at > _LINGER_S:
            break
        if now >= deadline:
            return buffers[child.stdout], buffers[child.stderr], total, "timeout"
        for key, _ in selector.select(min(deadline - now, 0.1)):
            chunk = os.read(key.fd, 65536)
            if not chunk:
                selector.unregister(key.fileobj)
                continue
            room = cap - total
            if room > 0:
                buffers[key.fileobj] += chunk[:room]
            total += len(chunk)
            if total > cap:
                return buffers[child.stdout], buffers[child.stderr], total, "output"
    return buffers[child.stdout], buffers[child.stderr], total, None


def _diagnose(returncode, stderr):
    """Which limit stopped code that ended on its own (the sandbox did not kill it)."""
    if returncode == -signal.SIGKILL:
        return "memory"  # nobody but the OOM killer sends SIGKILL here
    if returncode == -signal.SIGXCPU:
        return "timeout"
    if returncode != 0:
        tail = stderr[-4096:]
        if b"MemoryError" in tail:
            return "memory"
        if b"Resource temporarily unavailable" in tail or b"can't start new thread" in tail:
            return "pids"
    return None


def main():
    spec = json.loads(sys.argv[1])
    started = time.monotonic()
    child = subprocess.Popen(
        [sys.executable, "-B", "-c", spec["code"]],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=spec["cwd"],
        env=_ENV,
        start_new_session=True,
        preexec_fn=_limit_child(spec["rlimits"]),
    )
    try:
        out, err, total, killed = _pump(child, started + spec["timeout_s"], spec["max_output_bytes"])
    finally:
        _kill_everything(child, spec["whole_namespace"])
    returncode = child.wait()
    if killed is None:
        killed = _diagnose(returncode, err)
    result = {
        "stdout": out.decode("utf-8", "replace"),
        "stderr": err.decode("utf-8", "replace"),
        "exit_code": returncode if returncode >= 0 else None,
        "killed": killed,
        "truncated": total > spec["max_output_bytes"],
        "seconds": round(time.monotonic() - started, 4),
    }
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
