"""Rule rewards: plain Python functions of the answer, made into `Reward`s by the `@rule` decorator.

```python
from asyncrl.envs.rewards import rule

@rule
def shouts(prompt_messages, completion_text, task, bonus: float = 0.0) -> float:
    return float(completion_text.isupper()) + bonus
```

A rule returns a number, a bool, or a `RewardResult`; it may be `async`. Referenced from a config as
`package.module:shouts`, with `reward_options` bound as keyword arguments (`{bonus: 0.5}`).

`constraints` is the built-in rule of the general task: the share of the task's constraints the
answer meets (tasks offering `check(text) -> {constraint: met}`, as envs/general.py's do).
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from typing import Any

from .base import RewardError, RewardResult


class RuleReward:
    """A rule function with the `Reward` interface; still callable as the plain function it wraps."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def bind(self, **options: Any) -> RuleReward:
        """The same rule with keyword arguments fixed (the config's reward options)."""
        return RuleReward(functools.partial(self.fn, **options)) if options else self

    async def score(self, prompt_messages: list[dict], completion_text: str, task: Any) -> RewardResult:
        value = self.fn(prompt_messages, completion_text, task)
        if inspect.isawaitable(value):
            value = await value
        if isinstance(value, RewardResult):
            return value
        # bool is an int: True/False become 1.0/0.0 here, as a rule author would expect.
        if isinstance(value, (int, float)) and math.isfinite(value):
            return RewardResult(float(value))
        raise RewardError(f"rule {getattr(self.fn, '__name__', self.fn)!r} returned {value!r}, not a finite number or RewardResult")


def rule(fn: Callable[..., Any]) -> RuleReward:
    """Decorator: `fn(prompt_messages, completion_text, task, **options)` becomes a loadable reward."""
    return RuleReward(fn)


@rule
def constraints(prompt_messages: list[dict], completion_text: str, task: Any) -> RewardResult:
    """Share of `task.check(text)`'s constraints met; `details` lists the failed ones and `correct`
    (all met), which held-out evaluation counts as success."""
    if not hasattr(task, "check"):
        raise RewardError(f"the constraints rule needs a task with check(text); got {type(task).__name__}")
    met = task.check(completion_text)
    failed = sorted(name for name, ok in met.items() if not ok)
    return RewardResult(sum(met.values()) / max(len(met), 1), {"failed": failed, "correct": not failed})
