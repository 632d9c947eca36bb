"""`asyncrl bench NAME`: benchmarks as user-facing commands.

Each entry is `run(config: RunConfig, json_path: str | None) -> dict`, measuring its ratios side by
side in one run (this machine is shared and noisy: absolute times drift, ratios hold).
"""

from __future__ import annotations


def _engine(config, json_path):
    from .engine import run

    return run(config, json_path)


def _gateway(config, json_path):
    from .gateway import run

    return run(config, json_path)


BENCHMARKS = {"engine": _engine, "gateway": _gateway}
"""Benchmark name -> runner; later issues add theirs here."""
