"""Demonstrations of the agentic tool-call format, for the SFT warm start of the agentic task
(`AgenticEnv.demonstration`).

The problems (products of two 3-5 digit numbers) are beyond what the tiny model can compute in its
head, so the only way to a right answer is the one shown: call the `python` tool, read its output,
answer the bare number. Messages are OpenAI-style with `arguments` as a mapping, so the tokenizer's
chat template renders the call exactly as the model is later expected to write it:
`<tool_call>python<arg_key>code</arg_key><arg_value>print(A*B)</arg_value></tool_call><|endoftext|>`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

PYTHON_TOOL: dict = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run Python code and return what it prints.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "The program."}},
            "required": ["code"],
        },
    },
}
PROMPT_TEMPLATES = ("{a}*{b}", "What is {a} times {b}?", "Multiply {a} by {b}.")


@dataclass(frozen=True)
class ToolProblem:
    a: int
    b: int
    template: int = 0

    @property
    def answer(self) -> int:
        return self.a * self.b

    @property
    def code(self) -> str:
        return f"print({self.a}*{self.b})"

    def messages(self) -> list[dict]:
        return [{"role": "user", "content": PROMPT_TEMPLATES[self.template].format(a=self.a, b=self.b)}]

    def demonstration(self) -> list[dict]:
        """User question, assistant tool call, tool output, assistant answer."""
        call = {"type": "function", "function": {"name": "python", "arguments": {"code": self.code}}}
        return [
            *self.messages(),
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": str(self.answer)},
            {"role": "assistant", "content": str(self.answer)},
        ]


def sample_tool_problem(rng: random.Random, min_digits: int = 3, max_digits: int = 5) -> ToolProblem:
    def operand() -> int:
        digits = rng.randint(min_digits, max_digits)
        return rng.randint(10 ** (digits - 1), 10**digits - 1)

    return ToolProblem(operand(), operand(), rng.randrange(len(PROMPT_TEMPLATES)))
