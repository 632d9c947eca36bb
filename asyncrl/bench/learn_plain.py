"""`asyncrl bench learn`'s floor: a plain synchronous GRPO loop in one process, no Ray, no gateway, no store.

The project's own parts and nothing around them: the embedded engine samples `learner.group_size`
completions of `learner.batch_groups` prompts (the chat template rendered by the tokenizer, token ids
straight to the engine), the task's own reward scores them (learn_task.py), the RL learner takes one step on them,
and the engine loads the new weights; then again. What `asyncrl run` adds on top of this (actors,
the TITO gateway and its records, the store, the loop's bookkeeping) is the system's overhead, and
this side measures it. Held-out evaluation is greedy on the engine, on the same problems, every
`loop.eval_every` versions, inside the budget as the other sides' are.

Engine and learner take turns in this process, so each gets torch's default threads (the machine).
"""

from __future__ import annotations

import asyncio
import os
import time

import torch

from asyncrl.configs.schema import RunConfig
from asyncrl.records import UNSAMPLED_VERSION, Batch, Sample


def run_plain(config: RunConfig, budget_s: float) -> dict:
    from asyncrl.gateway.app import run_loop

    return run_loop(_run(config, budget_s))


async def _run(config: RunConfig, budget_s: float) -> dict:
    from asyncrl.learner.rl import RLLearner
    from asyncrl.records import SamplingParams

    from .learn import _side
    from .learn_engine import BareEngine

    bare = BareEngine(config, "plain")
    engine, task, prompt, text = bare.engine, bare.task, bare.prompt, bare.text
    learner = await asyncio.to_thread(RLLearner.from_config, config)
    torch.set_num_threads(os.cpu_count() or 1)  # after the engine set its own (rollout.torch_threads)
    heldout = task.heldout(config.eval.num_problems, config.eval.seed)
    greedy = SamplingParams(temperature=0.0, max_tokens=task.max_tokens)
    heldout_prompts = [prompt(problem) for problem in heldout]

    async def evaluate() -> float:
        results = await asyncio.gather(*(engine.generate(ids, greedy) for ids in heldout_prompts))
        scored = await asyncio.gather(*(task.score(p, text(r.token_ids)) for r, p in zip(results, heldout, strict=True)))
        return sum(correct for _, correct in scored) / len(heldout)

    try:
        curve = [(0.0, 0, await evaluate())]
        began, cpu_before, trained, done = time.monotonic(), time.process_time(), 0, False
        while not done:
            step = await asyncio.to_thread(learner.train_step, await _batch(config, bare))
            trained += step.ledger["trained"]
            await asyncio.to_thread(engine.update_weights, learner.state_dict_for_push(), learner.version)
            # The clock is read once: the last batch always closes the curve. loop.steps, out of reach in the
            # bench's own settings, ends the side by count where the time it takes must not matter (a test).
            done = time.monotonic() - began >= budget_s or learner.version >= config.loop.steps
            if done or learner.version % config.loop.eval_every == 0:
                curve.append((round(time.monotonic() - began, 1), trained, await evaluate()))
        wall, cpu = time.monotonic() - began, time.process_time() - cpu_before
    finally:
        engine.shutdown()
    return _side(curve, trained=trained, wall_s=wall, optimizer_steps=learner.version, cpu_s={"plain": round(cpu, 2)})


async def _batch(config: RunConfig, bare) -> Batch:
    """`learner.batch_groups` prompts, each sampled `learner.group_size` times and scored by the task."""
    engine, task, sampling, size = bare.engine, bare.task, bare.sampling, config.learner.group_size
    problems = [task.sample(bare.rng) for _ in range(config.learner.batch_groups)]
    asked = [(g, problem, bare.prompt(problem)) for g, problem in enumerate(problems) for _ in range(size)]
    results = await asyncio.gather(*(engine.generate(ids, sampling) for _, _, ids in asked))
    rewards = await asyncio.gather(
        *(task.score(problem, bare.text(r.token_ids)) for (_, problem, _), r in zip(asked, results, strict=True))
    )
    groups: list[list[Sample]] = [[] for _ in problems]
    for i, ((g, _, ids), result, (reward, _)) in enumerate(zip(asked, results, rewards, strict=True)):
        n = len(result.token_ids)
        groups[g].append(Sample(
            token_ids=[*ids, *result.token_ids], loss_mask=[0] * len(ids) + [1] * n,
            logprobs=[0.0] * len(ids) + list(result.logprobs), versions=[UNSAMPLED_VERSION] * len(ids) + list(result.versions),
            reward=reward, group_id=f"g{g}", rollout_id=f"r{i}", status="ok", task=task.name,
            temperatures=[None] * len(ids) + [sampling.temperature] * n,
        ))  # fmt: skip
    return Batch(groups)
