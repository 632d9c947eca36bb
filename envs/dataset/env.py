"""`env: dataset`: each episode is one row of a dataset file, its answer scored by a reward plug-in.

```yaml
tasks:
  mix:
    gsm:
      env: dataset
      options: {path: data/gsm.jsonl, prompt_template: "Solve: {question}", answer_column: answer, reward: math}
```

The options (envs/dataset/options.py) say where the rows are, how their columns map onto a task
(`DatasetRow`), how the held-out split is drawn, and which reward scores the answer. The file is
scanned once when the environment is built (envs/dataset/splits.py): a missing column, an unreadable
file, malformed rows (with `on_bad_row: error`), an empty dataset or an empty split stop the run
there, before any episode.

An episode sends the row's messages to the policy once; a row with tools (a tools column) gets a
short tool loop instead: calls of the `python_tool` run in the episode's sandbox, and the final
answer (the first reply without tool calls) is what the reward judges. `needs_sandbox` is true when
the reward needs a sandbox (`needs_sandbox = True` on the reward, e.g. code_tests) or tools are
mapped. An answer the reward reports it could not parse (`details["unparsed"]`) scores 0 and is
counted in the episode's metrics (`unparsed`); `correct`, what held-out evaluation counts, is the
reward's own verdict when it gives one (`details["correct"]`), else evaluation averages the reward.
"""

from __future__ import annotations

import json
import math
import random
from typing import Any

from asyncrl.configs.context import EnvContext
from asyncrl.envs.base import EpisodeResult, Split
from asyncrl.envs.rewards import Reward, RewardError, load_reward

from .options import DatasetOptions, parse_options
from .row import DatasetRow
from .splits import ScanReport, build_splits


class DatasetEnv:
    """Tasks drawn from a dataset file; see the module docstring."""

    name = "dataset"

    def __init__(self, options: DatasetOptions, reward: Reward, *, max_tokens: int = 64, temperature: float = 1.0) -> None:
        self.options, self.reward = options, reward
        self.max_tokens, self.temperature = max_tokens, temperature
        self.train, self.eval, self.reports = build_splits(options)
        self.reward_needs_sandbox = bool(getattr(reward, "needs_sandbox", False))
        self.needs_sandbox = self.reward_needs_sandbox or options.tools_column is not None

    @classmethod
    def from_config(cls, context: EnvContext, **options: Any) -> DatasetEnv:
        """Options validated (errors name the option), the reward built with the run's `rewards`, the run's
        answer budget unless `max_tokens` is set, sampling at the learner's temperature."""
        parsed = parse_options(options)
        reward = load_reward(parsed.reward, parsed.reward_options, context)
        return cls(parsed, reward, max_tokens=parsed.max_tokens or context.episode_max_tokens, temperature=context.sampling.temperature)

    @property
    def report(self) -> ScanReport:
        """What the scan of the training file found (`reports` has the held-out file's too, when separate)."""
        return self.reports[0]

    def sample_task(self, rng: random.Random, split: Split = "train") -> DatasetRow:
        rows = self.train if split == "train" else self.eval
        return rows.row(rng.randrange(len(rows)))

    def heldout_tasks(self, num_problems: int, seed: int) -> list[DatasetRow]:
        """Distinct held-out rows in a seeded order: the first `num_problems`, or all when there are fewer."""
        picked = random.Random(seed).sample(range(len(self.eval)), min(num_problems, len(self.eval)))
        return [self.eval.row(i) for i in picked]

    async def run_episode(self, task: DatasetRow, client: Any, sandbox: Any = None) -> EpisodeResult:
        messages = list(task.messages)
        metrics: dict[str, Any] = {"row_id": task.row_id}
        text, reply = await self._answer(messages, task.tools, client, sandbox, metrics)
        # A reward that needs a sandbox (e.g. code_tests) gets the episode's; RewardError -> env_crash (runner).
        extra = {"sandbox": sandbox} if self.reward_needs_sandbox else {}
        scored = await self.reward.score(task.messages, text, task, **extra)
        if not math.isfinite(scored.reward):
            raise RewardError(f"reward {self.options.reward!r} gave {scored.reward!r}")
        unparsed = bool(scored.details.get("unparsed", False))
        if "correct" in scored.details:
            metrics["correct"] = bool(scored.details["correct"]) and not unparsed
        metrics.update(
            unparsed=unparsed, reward_details=scored.details, finish_reason=reply.choices[0].finish_reason,
        )  # fmt: skip
        return EpisodeResult(0.0 if unparsed else scored.reward, metrics=metrics)

    async def _answer(self, messages: list[dict], tools: list[dict] | None, client: Any, sandbox: Any, metrics: dict) -> tuple[str, Any]:
        """(the final answer, the last reply): one call, or with tools a loop until a reply without tool calls."""
        calls = tokens = 0
        offered = {"tools": tools} if tools else {}
        for _ in range(self.options.max_turns if tools else 1):
            reply = await client.chat.completions.create(
                model="policy", messages=messages, max_tokens=self.max_tokens, temperature=self.temperature, **offered
            )
            tokens += reply.usage.completion_tokens
            message = reply.choices[0].message
            if not tools or not message.tool_calls:
                metrics["completion_tokens"] = tokens
                if tools:
                    metrics.update(tool_calls=calls, answered=True)
                return message.content or "", reply
            # Sent back exactly as the gateway returned it, so the turns merge into one training sample.
            messages.append({"role": "assistant", "content": message.content, "tool_calls": [c.model_dump() for c in message.tool_calls]})
            for call in message.tool_calls:
                calls += 1
                messages.append({"role": "tool", "tool_call_id": call.id, "content": await self._run_tool(call, sandbox)})
        metrics.update(completion_tokens=tokens, tool_calls=calls, answered=False)
        return "", reply  # out of turns without a final answer: the reward judges an empty one

    async def _run_tool(self, call: Any, sandbox: Any) -> str:
        if call.function.name != self.options.python_tool:
            return f"error: tool {call.function.name!r} is not available here; the only tool that runs is {self.options.python_tool}(code)"
        try:
            arguments = json.loads(call.function.arguments or "{}")
        except ValueError:
            arguments = None
        code = arguments.get("code") if isinstance(arguments, dict) else None
        if not isinstance(code, str):
            return f"error: {self.options.python_tool} takes one argument, code (python source)"
        result = await sandbox.run_python(code)  # under sandbox.timeout_s; SandboxError -> env_crash
        return result.as_tool_message()
