"""`asyncrl bench learn`'s pipeline limit: the rollout engine alone, fed as fast as it can take requests.

The embedded engine of the run's config (`rollout.*`: its torch threads, its batch), on the same
checkpoint, prompts and sampling as the training episodes, with `loop.max_inflight` requests always
waiting or running and nothing else in the process: the completions it finishes per second. No
system can train samples faster than its engine makes them, so a side's samples trained per second
over this is how much of the engine's capacity the rest of the system leaves it (a run's engine also
shares the machine with the learner and the driver; here it has it to itself).

`BareEngine` is what this and the plain loop (learn_plain.py) share: the engine on the checkpoint,
the task (learn_task.py), and prompts rendered by the checkpoint's own tokenizer, token ids straight to
the engine.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any, cast

from asyncrl.configs.schema import EmbeddedRolloutConfig, RunConfig

from .learn_task import BenchTask


class BareEngine:
    """The run's embedded engine on `policy.path`, with no gateway in front of it."""

    def __init__(self, config: RunConfig, engine_id: str) -> None:
        from transformers import AutoTokenizer

        from asyncrl.records import SamplingParams
        from asyncrl.rollout import EmbeddedEngine

        path, rollout = config.policy.path, config.rollout
        if path is None or not isinstance(rollout, EmbeddedRolloutConfig):
            raise ValueError(f"bench learn's {engine_id} side runs the embedded engine (rollout.type: embedded) on policy.path")
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.engine = EmbeddedEngine.from_pretrained(path, rollout, engine_id=engine_id)
        self.task, self.rng = BenchTask(config), random.Random(config.seed)
        self.sampling = SamplingParams(temperature=config.rollout.sampling.temperature, max_tokens=self.task.max_tokens)

    def prompt(self, problem: Any) -> list[int]:
        messages = self.task.messages(problem)
        rendered = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        return cast(list[int], rendered)

    def text(self, token_ids: list[int]) -> str:
        return cast(str, self.tokenizer.decode(token_ids))


def engine_alone(config: RunConfig, seconds: float) -> dict:
    from asyncrl.gateway.app import run_loop

    return run_loop(_run(config, seconds))


async def _run(config: RunConfig, seconds: float) -> dict:
    bare = BareEngine(config, "alone")
    done, deadline = 0, 0.0

    async def feed() -> None:
        nonlocal done
        while time.monotonic() < deadline:
            await bare.engine.generate(bare.prompt(bare.task.sample(bare.rng)), bare.sampling)
            done += 1

    try:
        await bare.engine.generate(
            bare.prompt(bare.task.sample(bare.rng)), bare.sampling
        )  # warm: the first step builds what later ones reuse
        began = time.monotonic()
        deadline = began + seconds
        await asyncio.gather(*(feed() for _ in range(config.loop.max_inflight)))
        wall = time.monotonic() - began
    finally:
        bare.engine.shutdown()
    return {"samples_per_s": round(done / wall, 2), "completions": done, "wall_s": round(wall, 1), "in_flight": config.loop.max_inflight}
