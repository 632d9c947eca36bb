"""Where a run's time went: each process's CPU and each engine's busy time over the RL phase.

`asyncrl run` takes a `snapshot` when RL starts (after the first held-out evaluation) and one at the
end; `between` turns the two into the summary's `usage`: the RL phase's wall time, CPU seconds and
share of one core per process (the driver: gateway, episodes and loop; each rollout worker; the
learner; each gateway replica actor), and each engine's busy fraction (time its stepping thread spent in steps; 1 - that is the
engine's idle fraction, what the loop failed to feed it). Processes are named by their role, not
their pid; an in-process engine or learner shares the driver's process (its CPU is the driver's).
Engines without these figures (vLLM) report None, as does a learner that could not answer or was
restarted meanwhile (its new process's clock starts again). `nodes` says where each engine and each
learner rank ran at the end (Ray node ids; None in process), which on a cluster shows the placement.
"""

from __future__ import annotations

import time
from typing import Any


async def snapshot(workers: Any, learner: Any, replicas: Any = None) -> dict:
    """Figures a dead part cannot give are None: a report must not end a run that finished. `replicas`:
    the run's gateway replica actors (`gateway/replica_actors.py`), if any."""
    try:
        engines = {h.get("engine_id", str(i)): h for i, h in enumerate(await workers.health())}
    except Exception:
        engines = {}
    try:
        learned = await learner.usage()
    except Exception:
        learned = {}
    gateways = await replicas.usage() if replicas is not None else {}
    nodes = {f"engine:{name}": h.get("node_id") for name, h in engines.items()}
    nodes.update({f"gateway:{name}": g.get("node_id") for name, g in gateways.items()})
    return {
        "wall": time.monotonic(), "driver_cpu_s": time.process_time(), "learner_cpu_s": learned.get("process_cpu_s"),
        "engines": {name: {"cpu_s": h.get("process_cpu_s"), "busy_s": h.get("busy_s")} for name, h in engines.items()},
        "gateways": {name: g.get("process_cpu_s") for name, g in gateways.items()},
        "nodes": {**nodes, "learner": learned.get("node_ids")},
    }  # fmt: skip


def between(start: dict, end: dict) -> dict:
    """The summary's `usage` from two snapshots (engines present in both: a replaced one is left out)."""
    wall = max(end["wall"] - start["wall"], 1e-9)
    cpu = {"driver": end["driver_cpu_s"] - start["driver_cpu_s"], "learner": _delta(start["learner_cpu_s"], end["learner_cpu_s"])}
    busy = {}
    for name in start["engines"].keys() & end["engines"].keys():
        before, after = start["engines"][name], end["engines"][name]
        cpu[f"engine:{name}"] = _delta(before["cpu_s"], after["cpu_s"])
        busy[name] = None if (spent := _delta(before["busy_s"], after["busy_s"])) is None else round(spent / wall, 4)
    for name in start.get("gateways", {}).keys() & end.get("gateways", {}).keys():
        cpu[f"gateway:{name}"] = _delta(start["gateways"][name], end["gateways"][name])
    return {
        "wall_s": round(wall, 2),
        "cpu_s": {name: None if s is None else round(s, 2) for name, s in cpu.items()},
        "cpu_core_frac": {name: None if s is None else round(s / wall, 4) for name, s in cpu.items()},
        "engine_busy_frac": busy,
        "nodes": end["nodes"],
    }


def _delta(before: float | None, after: float | None) -> float | None:
    """after - before; None without both, or when the clock went back (another process since)."""
    return None if before is None or after is None or after < before else after - before
