"""Held-out evaluation of any environment: its own episodes, played greedily, recorded nowhere.

An environment is scored by its own `run_episode` on held-out tasks, so evaluation uses exactly the
reward logic, prompts, tools and sandboxes of training. The episodes talk to `GreedyClient`, which
answers the subset of the OpenAI chat API that environments use the way the gateway does (same chat
template, same tool-call parsing) but decodes greedily whatever temperature the episode asks for,
and records nothing: evaluation rollouts never reach the store, the learner or the ledger.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from asyncrl.gateway.toolcalls import parse_completion, to_template_messages, to_template_tools

from .base import Environment, score
from .runner import play_episode

AsyncGenerateFn = Callable[[list[int], int], Awaitable[list[int]]]
"""generate(prompt token IDs, max_tokens) -> completion token IDs, greedy, ending at EOS or max_tokens."""
CONCURRENCY = 64
"""Episodes evaluated at once: enough to fill the engines' batches, few enough sandboxes at a time."""


@dataclass
class TaskEval:
    accuracy: float
    """Mean score (envs/base.py `score`: `correct` when reported, else the reward)."""
    num_problems: int
    statuses: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0


def heldout_tasks(env: Environment, num_problems: int, seed: int) -> list[Any]:
    """The environment's own fixed held-out set when it offers one, else seeded draws from its eval split."""
    if hasattr(env, "heldout_tasks"):
        return list(env.heldout_tasks(num_problems, seed))
    rng = random.Random(seed)
    return [env.sample_task(rng, "eval") for _ in range(num_problems)]


async def evaluate_env(
    env: Environment, generate: AsyncGenerateFn, tokenizer, *, num_problems: int, seed: int,
    sandboxes: Any = None, default_max_tokens: int = 32, timeout_s: float = 300.0,
) -> TaskEval:  # fmt: skip
    began = time.monotonic()
    client = GreedyClient(generate, tokenizer, default_max_tokens)
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(task: Any):
        async with gate:
            return await play_episode(env, task, client, sandboxes, timeout_s)

    results = await asyncio.gather(*(one(task) for task in heldout_tasks(env, num_problems, seed)))
    statuses: dict[str, int] = {}
    for result in results:
        statuses[result.status] = statuses.get(result.status, 0) + 1
    scores = [score(r) if r.status == "ok" else 0.0 for r in results]
    return TaskEval(sum(scores) / max(len(scores), 1), len(scores), statuses, time.monotonic() - began)


class GreedyClient:
    """`client.chat.completions.create(...)` over a generate function; returns real `openai` types."""

    def __init__(self, generate: AsyncGenerateFn, tokenizer, default_max_tokens: int) -> None:
        self.chat = _Chat(_Completions(generate, tokenizer, default_max_tokens))


@dataclass
class _Chat:
    completions: "_Completions"


class _Completions:
    def __init__(self, generate: AsyncGenerateFn, tokenizer, default_max_tokens: int) -> None:
        self.generate, self.tokenizer, self.default_max_tokens = generate, tokenizer, default_max_tokens

    async def create(self, *, messages: list, tools: list | None = None, max_tokens: int | None = None,
                     max_completion_tokens: int | None = None, **_sampling: Any):  # fmt: skip
        from openai.types.chat import ChatCompletion

        # Plain dicts and openai message objects alike, as the gateway receives them over HTTP.
        messages = [m if isinstance(m, dict) else m.model_dump(exclude_none=True) for m in messages]
        text = self.tokenizer.apply_chat_template(
            to_template_messages(messages), tools=to_template_tools(tools), tokenize=False, add_generation_prompt=True
        )
        prompt = self.tokenizer.encode(text, add_special_tokens=False)
        completion = await self.generate(prompt, max_completion_tokens or max_tokens or self.default_max_tokens)
        parsed = parse_completion(completion, self.tokenizer, tools)
        finished = "stop" if completion and completion[-1] == self.tokenizer.eos_token_id else "length"
        return ChatCompletion.model_validate({
            "id": "eval", "object": "chat.completion", "created": int(time.time()), "model": "policy",
            "choices": [{"index": 0, "message": parsed.message(), "finish_reason": parsed.finish_reason(finished)}],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(completion), "total_tokens": len(prompt) + len(completion)},
        })  # fmt: skip
