"""One task drawn from a dataset: what an episode of `env: dataset` plays and what its reward reads."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class DatasetRow:
    """A dataset row mapped to the task's columns (`envs/dataset/`), the `task` of its episode.

    Rewards receive it as their `task` argument: `answer` for answer checks (math-verify, exact,
    regex), `tests` for code tests run in the sandbox, `metadata` for anything else the reward reads."""

    row_id: str
    """Stable id of the row in its file (file name and row index, or an id column): held-out splits and replay use it."""
    messages: list[dict]
    """The prompt as OpenAI-style chat messages (system prompt and template already applied)."""
    answer: Any = None
    tests: list[str] | None = None
    """Unit tests (python source) the model's code must pass, for the code_tests reward."""
    tools: list[dict] | None = None
    """OpenAI tool definitions the episode offers, from a tools column."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """The row's other mapped columns, passed through to the reward."""
