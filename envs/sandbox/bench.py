"""Sandbox start-up latency, for `asyncrl bench`: open a sandbox, run `print(1)`, close it."""

from __future__ import annotations

import time

from asyncrl.configs.schema import SandboxConfig
from asyncrl.envs.sandbox import open_backend


async def sandbox_start_ms(config: SandboxConfig, backends: tuple[str, ...] = ("docker", "process"), runs: int = 5) -> dict[str, float]:
    """Mean milliseconds from `open()` to the answer of a first `print(1)`, closing included, per backend.
    One untimed round per backend first (engine connection, leftover sweep, page cache)."""
    means: dict[str, float] = {}
    for name in backends:
        backend = open_backend(config.on_backend(name))
        try:
            times: list[float] = []
            for i in range(runs + 1):
                started = time.perf_counter()
                async with backend.open() as sandbox:
                    result = await sandbox.run_python("print(1)")
                if result.stdout.strip() != "1":
                    raise RuntimeError(f"{name} sandbox answered {result.as_tool_message()!r} to print(1)")
                if i:
                    times.append(time.perf_counter() - started)
            means[name] = 1000 * sum(times) / len(times)
        finally:
            await backend.close()
    return means
