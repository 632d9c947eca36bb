"""The run summary's `usage`: each process's CPU and each engine's busy share over the RL phase, from two snapshots."""

from __future__ import annotations

import asyncio

from asyncrl.jobs import usage


class Workers:
    def __init__(self, engines: dict[str, dict]) -> None:
        self.engines = engines

    async def health(self) -> list[dict]:
        return [{"engine_id": name, **figures} for name, figures in self.engines.items()]


class Learner:
    def __init__(self, cpu_s: float) -> None:
        self.cpu_s = cpu_s

    async def usage(self) -> dict:
        return {"process_cpu_s": self.cpu_s}


def test_shares_over_the_phase_and_engines_without_figures() -> None:
    start = asyncio.run(usage.snapshot(Workers({"e0": {"process_cpu_s": 10.0, "busy_s": 4.0}, "vllm": {}}), Learner(3.0)))
    end = asyncio.run(usage.snapshot(Workers({"e0": {"process_cpu_s": 16.0, "busy_s": 9.0}, "vllm": {}}), Learner(5.0)))
    end["wall"] = start["wall"] + 10.0
    spent = usage.between(start, end)
    assert spent["wall_s"] == 10.0
    assert spent["cpu_s"]["learner"] == 2.0 and spent["cpu_s"]["engine:e0"] == 6.0 and spent["cpu_s"]["engine:vllm"] is None
    assert spent["cpu_core_frac"]["engine:e0"] == 0.6 and spent["engine_busy_frac"] == {"e0": 0.5, "vllm": None}
    assert spent["cpu_s"]["driver"] >= 0


def test_an_engine_replaced_meanwhile_is_left_out() -> None:
    start = asyncio.run(usage.snapshot(Workers({"e0": {"process_cpu_s": 1.0, "busy_s": 1.0}}), Learner(0.0)))
    end = asyncio.run(usage.snapshot(Workers({"e1": {"process_cpu_s": 2.0, "busy_s": 1.0}}), Learner(1.0)))
    spent = usage.between(start, end)
    assert spent["engine_busy_frac"] == {} and set(spent["cpu_s"]) == {"driver", "learner"}


def test_a_learner_that_cannot_answer_or_restarted_gives_none() -> None:
    class Dead:
        async def usage(self) -> dict:
            raise RuntimeError("the learner actor died")

    engines = Workers({"e0": {"process_cpu_s": 1.0, "busy_s": 1.0}})
    dead = asyncio.run(usage.snapshot(engines, Dead()))
    alive = asyncio.run(usage.snapshot(engines, Learner(9.0)))
    assert usage.between(dead, alive)["cpu_s"]["learner"] is None
    restarted = asyncio.run(usage.snapshot(engines, Learner(2.0)))
    spent = usage.between(alive, restarted)
    assert spent["cpu_s"]["learner"] is None and spent["cpu_core_frac"]["learner"] is None
