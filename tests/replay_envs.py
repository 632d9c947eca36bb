"""Environments for the `asyncrl replay episode` tests, loaded the way a user's are: by import path in
`tasks.mix` (`env: "replay_envs:FlakyEnv"`; pytest puts tests/ on the path).

Each plays two turns, so a replay has a second prompt that continues the first. `EchoEnv` is
deterministic (tests/test_replay_html.py records with it too); the others are not, each in one place on
purpose: `FlakyEnv` puts a fresh random nonce in its second message, `LuckyEnv` draws its reward from
`random.random()`, `UnseededEnv` draws its problem from the global random stream instead of the seeded
one, `DiceEnv` answers its `dice` tool with a random roll, and `ChattyEnv` plays as many turns as
`REPLAY_TEST_TURNS` says (state outside the seed, the way an environment reading a file or a service
would be).
"""

from __future__ import annotations

import os
import random
from typing import Any, ClassVar

from asyncrl.envs.base import EpisodeResult

MAX_TOKENS = 4
NONCE_CHARS = 16
DICE_TOOL: dict = {
    "type": "function",
    "function": {"name": "dice", "description": "Roll a die.", "parameters": {"type": "object", "properties": {}}},
}


def assistant_message(message: Any) -> dict:
    """The reply as the conversation echoes it back (tool calls included, so the next prompt continues this one)."""
    echoed: dict = {"role": "assistant", "content": message.content}
    if message.tool_calls:
        echoed["tool_calls"] = [call.model_dump() for call in message.tool_calls]
    return echoed


class EchoEnv:
    """Two turns about the task number; the reward is the parity of what the policy wrote. Deterministic."""

    name = "echo"
    tools: ClassVar[list[dict] | None] = None

    def sample_task(self, rng: random.Random, split: str = "train") -> int:
        return rng.randrange(1_000_000)

    def second_message(self, task: int) -> str:
        return f"again {task}"

    def reward(self, texts: list[str]) -> float:
        return float(sum(map(ord, "".join(texts))) % 2)

    async def ask(self, client: Any, messages: list[dict]) -> Any:
        extra = {"tools": self.tools} if self.tools else {}
        reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=MAX_TOKENS, temperature=1.0, **extra)
        return reply.choices[0].message

    async def run_episode(self, task: int, client: Any) -> EpisodeResult:
        messages: list[dict] = [{"role": "user", "content": str(task)}]
        first = await self.ask(client, messages)
        messages += [assistant_message(first), {"role": "user", "content": self.second_message(task)}]
        second = await self.ask(client, messages)
        texts = [first.content or "", second.content or ""]
        return EpisodeResult(reward=self.reward(texts), metrics={"chars": len("".join(texts))})


class FlakyEnv(EchoEnv):
    """EchoEnv whose second message carries a random nonce: the replay's second prompt differs inside it."""

    name = "flaky"
    PREFIX = "nonce "

    def second_message(self, task: int) -> str:
        return self.PREFIX + f"{random.getrandbits(4 * NONCE_CHARS):0{NONCE_CHARS}x}"


class LuckyEnv(EchoEnv):
    """EchoEnv with a reward drawn from `random.random()`: every prompt replays exactly, the reward does not."""

    name = "lucky"

    def reward(self, texts: list[str]) -> float:
        return random.random()


class DiceEnv(EchoEnv):
    """Offers a `dice` tool; when the first reply calls it, the tool's output (a random roll) is the
    second turn's new text. A recording engine that writes the call is in the tests."""

    name = "dice"
    tools: ClassVar[list[dict] | None] = [DICE_TOOL]

    async def run_episode(self, task: int, client: Any) -> EpisodeResult:
        messages: list[dict] = [{"role": "user", "content": str(task)}]
        first = await self.ask(client, messages)
        messages.append(assistant_message(first))
        for call in first.tool_calls or []:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": f"rolled {random.getrandbits(4 * NONCE_CHARS):016x}"})
        if not first.tool_calls:
            messages.append({"role": "user", "content": self.second_message(task)})
        second = await self.ask(client, messages)
        return EpisodeResult(
            reward=self.reward([first.content or "", second.content or ""]), metrics={"calls": len(first.tool_calls or [])}
        )


class UnseededEnv(EchoEnv):
    """Draws its problem from the global random stream instead of the seeded `rng` it is handed."""

    name = "unseeded"

    def sample_task(self, rng: random.Random, split: str = "train") -> int:
        return random.randrange(10**12, 10**13)


class ChattyEnv(EchoEnv):
    """Asks `REPLAY_TEST_TURNS` times (default 2): a replay under another value asks for more or fewer turns."""

    name = "chatty"

    async def run_episode(self, task: int, client: Any) -> EpisodeResult:
        messages: list[dict] = [{"role": "user", "content": str(task)}]
        texts = []
        for turn in range(int(os.environ.get("REPLAY_TEST_TURNS", "2"))):
            if turn:
                messages.append({"role": "user", "content": self.second_message(task)})
            reply = await self.ask(client, messages)
            messages.append(assistant_message(reply))
            texts.append(reply.content or "")
        return EpisodeResult(reward=self.reward(texts), metrics={"turns": len(texts)})
