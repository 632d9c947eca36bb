"""Environments by name: the built-ins, plug-ins registered through entry points, or an import path.

A reference is one of
- a registered name: a built-in (`reasoning`, `agentic`, `general`, `dataset`, `reasoning_gym`,
  `verifiers`) or an entry point in the group
  `asyncrl.envs` of any installed package (`[project.entry-points."asyncrl.envs"] name =
  "package.module:Class"`), found without importing anything but the one chosen;
- an import path `package.module:Class` (a class or any factory function).

`load_environment(ref, options, context)` builds the environment: `Class.from_config(context,
**options)` when the class defines that hook (to read the run's settings, an `EnvContext` from
configs/context.py), else `Class(**options)`.
Errors say what went wrong in the user's terms: an unknown name lists the known ones.
"""

from __future__ import annotations

from typing import Any

from asyncrl.configs.context import EnvContext
from asyncrl.plugins import import_target, registered_names

from .base import Environment

GROUP = "asyncrl.envs"
BUILTIN: dict[str, str] = {
    "reasoning": "asyncrl.envs.reasoning:ReasoningEnv",
    "agentic": "asyncrl.envs.agentic:AgenticEnv",
    "general": "asyncrl.envs.general:GeneralEnv",
    "dataset": "asyncrl.envs.dataset.env:DatasetEnv",
    "reasoning_gym": "asyncrl.envs.procedural:ReasoningGymEnv",
    "verifiers": "asyncrl.envs.verifiers_env:VerifiersEnv",
}


class EnvironmentNotFound(LookupError):
    """The reference names no known environment, or its import path does not resolve."""


def registered() -> dict[str, str]:
    """Every registered name -> its import path: built-ins, then entry points of installed packages."""
    return registered_names(BUILTIN, GROUP, "environment", EnvironmentNotFound)


def resolve(ref: str) -> Any:
    """The class or factory a reference points at (imported, not called)."""
    path = ref if ":" in ref else registered().get(ref)
    if path is None:
        known = ", ".join(sorted(registered()))
        raise EnvironmentNotFound(
            f"unknown environment {ref!r}; known: {known}. Register one through an entry point in the group "
            f"{GROUP!r}, or give an import path 'package.module:Class'"
        )
    return import_target(ref, path, "environment", EnvironmentNotFound)


def load_environment(ref: str, options: dict | None = None, context: EnvContext | None = None) -> Environment:
    """Build the environment `ref` names with `options`; `context` (None: a default run's) goes to a `from_config` hook."""
    factory = resolve(ref)
    options = dict(options or {})
    try:
        env = factory.from_config(context or EnvContext(), **options) if hasattr(factory, "from_config") else factory(**options)
    except TypeError as error:
        raise TypeError(f"environment {ref!r} could not be built with options {sorted(options)}: {error}") from error
    missing = [m for m in ("name", "sample_task", "run_episode") if not hasattr(env, m)]
    if missing:
        raise TypeError(f"environment {ref!r} built a {type(env).__name__}, which lacks {', '.join(missing)} (see envs/base.py)")
    return env
