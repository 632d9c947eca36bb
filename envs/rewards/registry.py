"""Rewards by name or import path, loaded the way environments are (envs/registry.py).

A reference is a built-in name (`constraints`, `http`, `judge`, `math`, `exact`, `regex`,
`code_tests`), a name registered by an installed package in the entry-point group `asyncrl.rewards`,
or an import path `package.module:attr`. The target may be
- a rule (a function decorated with `@rule`): options are bound as its keyword arguments;
- a class or factory: built with `from_config(context, **options)` when it has that hook (an
  `EnvContext`, configs/context.py: the built-in `http` and `judge` read its `rewards` this way),
  else `factory(**options)`.
Whatever is built must have an async `score` (envs/rewards/base.py).
"""

from __future__ import annotations

import inspect

from asyncrl.configs.context import EnvContext
from asyncrl.plugins import import_target, registered_names

from .base import Reward
from .rules import RuleReward

GROUP = "asyncrl.rewards"
BUILTIN: dict[str, str] = {
    "constraints": "asyncrl.envs.rewards.rules:constraints",
    "http": "asyncrl.envs.rewards.http_model:HTTPReward",
    "judge": "asyncrl.envs.rewards.judge:JudgeReward",
    "math": "asyncrl.envs.rewards.answers:MathReward",
    "exact": "asyncrl.envs.rewards.answers:ExactReward",
    "regex": "asyncrl.envs.rewards.answers:RegexReward",
    "code_tests": "asyncrl.envs.rewards.code_tests:CodeTestsReward",
}


class RewardNotFound(LookupError):
    """The reference names no known reward, or its import path does not resolve."""


def registered() -> dict[str, str]:
    """Every registered reward name -> its import path: built-ins, then entry points."""
    return registered_names(BUILTIN, GROUP, "reward", RewardNotFound)


def load_reward(ref: str, options: dict | None = None, context: EnvContext | None = None) -> Reward:
    """Build the reward `ref` names with `options`; `context` (None: a default run's) goes to a `from_config` hook."""
    path = ref if ":" in ref else registered().get(ref)
    if path is None:
        raise RewardNotFound(
            f"unknown reward {ref!r}; known: {', '.join(sorted(registered()))}. Register one through an entry "
            f"point in the group {GROUP!r}, or give an import path 'package.module:attr'"
        )
    target = import_target(ref, path, "reward", RewardNotFound)
    options = dict(options or {})
    try:
        if isinstance(target, RuleReward):
            reward = target.bind(**options)
        elif hasattr(target, "from_config"):
            reward = target.from_config(context or EnvContext(), **options)
        else:
            reward = target(**options)
    except TypeError as error:
        raise TypeError(f"reward {ref!r} could not be built with options {sorted(options)}: {error}") from error
    if not inspect.iscoroutinefunction(getattr(reward, "score", None)):
        raise TypeError(f"reward {ref!r} built a {type(reward).__name__}, which lacks an async score() (see envs/rewards/base.py)")
    return reward
