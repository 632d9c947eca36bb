"""`asyncrl bench learn`'s pipeline limit: the rollout engine alone, fed as fast as it can take requests.

The embedded engine of the run's config (`rollout.*`: its torch threads, its batch), on the same
checkpoint, prompts and sampling as the training episodes, with `loop.max_inflight` requests always
waiting or running and nothing else in the process: the completions it finishes per second. No
system can train samples faster than its engine makes them, so a side's samples trained per second
over this is how much of the engine's capacity the rest of the system leaves it (a run's engine also
shares the machine with the learner and the driver; here it has it to itself).
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import cast

from asyncrl.configs.schema import EmbeddedRolloutConfig, RunConfig


def engine_alone(config: RunConfig, seconds: float) -> dict:
    from asyncrl.gateway.app import run_loop

    return run_loop(_run(config, seconds))


async def _run(config: RunConfig, seconds: float) -> dict:
    from transformers import AutoTokenizer

    from asyncrl.envs.arithmetic import ArithmeticTask
    from asyncrl.records import SamplingParams
    from asyncrl.rollout import EmbeddedEngine

    path, rollout = config.policy.path, config.rollout
    if path is None or not isinstance(rollout, EmbeddedRolloutConfig):
        raise ValueError("the engine-alone measure runs the embedded engine (rollout.type: embedded) on policy.path")
    tokenizer = AutoTokenizer.from_pretrained(path)
    engine = EmbeddedEngine.from_pretrained(path, rollout, engine_id="alone")
    task, rng = ArithmeticTask(config.tasks.arithmetic), random.Random(config.seed)
    sampling = SamplingParams(temperature=config.rollout.sampling.temperature, max_tokens=config.loop.episode_max_tokens)

    def prompt() -> list[int]:
        messages = task.sample(rng).messages()
        return cast(list[int], tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))

    done, deadline = 0, 0.0

    async def feed() -> None:
        nonlocal done
        while time.monotonic() < deadline:
            await engine.generate(prompt(), sampling)
            done += 1

    try:
        await engine.generate(prompt(), sampling)  # warm: the first step builds what later ones reuse
        began = time.monotonic()
        deadline = began + seconds
        await asyncio.gather(*(feed() for _ in range(config.loop.max_inflight)))
        wall = time.monotonic() - began
    finally:
        engine.shutdown()
    return {"samples_per_s": round(done / wall, 2), "completions": done, "wall_s": round(wall, 1), "in_flight": config.loop.max_inflight}
