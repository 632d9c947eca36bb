"""The built-in agentic environment: multiply two 3-5 digit numbers with a sandboxed `python` tool.

The tiny policy cannot multiply such numbers in its head; the way to a right answer is the one the
SFT demonstrations show (envs/tool_demos.py): call `python` with `print(A*B)`, read the printed
product, answer it as a bare number. Episodes use exactly that format: the same user prompts, the
same single tool definition (`PYTHON_TOOL`), no system prompt, and a clean run's printed output alone
inside `<tool_response>` (`ToolResult.as_tool_message`). Tool calls travel as OpenAI `tool_calls` through the gateway, and the code runs
in a fresh sandbox per episode.

Reward: 1 for the verified product; a wrong answer after a python call that ran cleanly gets the
small `format_reward`, so early on the group advantage still favours using the tool. The held-out
split is fixed by a hash of `A*B`, as for arithmetic.

Option `context` (envs/context.py; default `full`) trims what each call sends, e.g. `{strategy: keep_last,
turns: 5}`; the episode keeps its full history and the gateway records each trimmed call as a fork.

Its SFT demonstrations (`demonstration`) are drawn from the whole problem space, held-out products
included, as the warm start has always drawn them: the product comes from the tool's output, so what
they teach is the call format, not the answers.
"""

from __future__ import annotations

import json
import random
from typing import TYPE_CHECKING, Any

from asyncrl.configs.context import EnvContext
from asyncrl.configs.schema import AgenticTaskConfig

from .arithmetic import is_heldout, verify
from .base import Demonstration, EpisodeResult, Split
from .context import ContextSpec, context_strategy
from .tool_demos import PYTHON_TOOL, ToolProblem, sample_tool_problem

if TYPE_CHECKING:
    from .sandbox import Sandbox


class AgenticEnv:
    name = "agentic"
    needs_sandbox = True

    def __init__(self, config: AgenticTaskConfig | None = None, *, temperature: float = 1.0, context: ContextSpec = None) -> None:
        self.config = config or AgenticTaskConfig()
        self.temperature = temperature
        self.context = context_strategy(context)

    @classmethod
    def from_config(cls, context: EnvContext, /, **options) -> AgenticEnv:
        """`tasks.agentic` with `options` overriding its fields, sampling at the learner's temperature;
        the option `context` is the context strategy (envs/context.py), hence the positional-only run context."""
        strategy = options.pop("context", None)
        task = AgenticTaskConfig(**{**context.tasks.agentic.model_dump(), **options})
        return cls(task, temperature=context.sampling.temperature, context=strategy)

    def sample_task(self, rng: random.Random, split: Split = "train") -> ToolProblem:
        c = self.config
        for _ in range(100_000):
            problem = sample_tool_problem(rng, c.min_digits, c.max_digits)
            if is_heldout(f"{problem.a}*{problem.b}", c.heldout_fraction) == (split == "eval"):
                return problem
        raise RuntimeError("the problem space is too small for this held-out fraction")

    def demonstration(self, rng: random.Random) -> Demonstration:
        """A python call, its printed product, and the bare answer (envs/tool_demos.py)."""
        problem = sample_tool_problem(rng, self.config.min_digits, self.config.max_digits)
        return Demonstration(problem.demonstration(), tools=[PYTHON_TOOL])

    async def run_episode(self, task: ToolProblem, client: Any, sandbox: Sandbox) -> EpisodeResult:
        messages: list[dict] = task.messages()
        calls = clean_runs = 0
        answer = None
        for _ in range(self.config.max_turns):
            reply = await client.chat.completions.create(
                model="policy", messages=self.context.apply(messages), tools=[PYTHON_TOOL],
                max_tokens=self.config.max_tokens, temperature=self.temperature,
            )  # fmt: skip
            message = reply.choices[0].message
            if not message.tool_calls:
                answer = message.content or ""
                break
            messages.append({"role": "assistant", "content": message.content, "tool_calls": [c.model_dump() for c in message.tool_calls]})
            for call in message.tool_calls:
                calls += 1
                code = python_code(call)
                if code is None:
                    output = "error: the only tool is python(code)"
                else:
                    result = await sandbox.run_python(code)  # under sandbox.timeout_s
                    clean_runs += result.ok
                    # A clean run reads as its bare output, as in the SFT demonstrations' tool messages.
                    output = result.as_tool_message()
                messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
        correct = answer is not None and verify(answer, task)
        reward = 1.0 if correct else self.config.format_reward if clean_runs else 0.0
        return EpisodeResult(
            reward, metrics={"correct": correct, "tool_calls": calls, "clean_runs": clean_runs, "answered": answer is not None}
        )


def python_code(call: Any) -> str | None:
    """The `code` argument of a call to `python`; None for any other tool or malformed arguments."""
    if call.function.name != PYTHON_TOOL["function"]["name"]:
        return None
    try:
        arguments = json.loads(call.function.arguments or "{}")
    except ValueError:
        return None
    code = arguments.get("code") if isinstance(arguments, dict) else None
    return code if isinstance(code, str) else None
