"""Environment references: built-in names, entry points (a temporary dist-info on sys.path, read by
importlib.metadata as for any installed package), import paths, and the errors users see."""

from __future__ import annotations

import pytest

from asyncrl.configs import ConfigError, load_config
from asyncrl.configs.context import EnvContext
from asyncrl.envs.agentic import AgenticEnv
from asyncrl.envs.base import EpisodeResult
from asyncrl.envs.reasoning import ReasoningEnv
from asyncrl.envs.registry import EnvironmentNotFound, load_environment, registered


class Plain:
    name = "plain"

    def __init__(self, size: int = 1) -> None:
        self.size = size

    def sample_task(self, rng, split="train"):
        return self.size

    async def run_episode(self, task, client):
        return EpisodeResult(0.0)


class Configured(Plain):
    name = "configured"

    @classmethod
    def from_config(cls, context, **options):
        instance = cls(**options)
        instance.seed = context.seed
        return instance


NOT_AN_ENV = 3


def _dist_info(root, name: str, entry_points: str):
    info = root / f"{name}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(entry_points)


def test_builtin_names_build_the_builtin_environments_from_the_run_config():
    config = load_config("quickstart", ["loop.episode_max_tokens=7", "tasks.agentic.max_turns=5"])
    reasoning = load_environment("reasoning", {"max_digits": 2}, EnvContext.of(config))
    assert isinstance(reasoning, ReasoningEnv) and reasoning.max_tokens == 7 and reasoning.task.config.max_digits == 2
    agentic = load_environment("agentic", {}, EnvContext.of(config))
    assert isinstance(agentic, AgenticEnv) and agentic.config.max_turns == 5 and agentic.needs_sandbox


def test_an_import_path_builds_with_options_or_through_from_config():
    assert load_environment(f"{__name__}:Plain", {"size": 3}).size == 3
    built = load_environment(f"{__name__}:Configured", {"size": 2}, EnvContext(seed=11))
    assert (built.size, built.seed) == (2, 11)


def test_entry_points_are_discovered(tmp_path, monkeypatch):
    _dist_info(tmp_path, "plug", f"[asyncrl.envs]\nplain-plug = {__name__}:Plain\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert registered()["plain-plug"] == f"{__name__}:Plain"
    assert isinstance(load_environment("plain-plug", {"size": 4}), Plain)


def test_a_name_registered_twice_is_an_error_naming_both(tmp_path, monkeypatch):
    _dist_info(tmp_path, "clash", f"[asyncrl.envs]\nreasoning = {__name__}:Plain\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(
        EnvironmentNotFound, match=r"'reasoning' is registered twice: asyncrl.envs.reasoning:ReasoningEnv and .*:Plain.*clash"
    ):
        load_environment("reasoning")


@pytest.mark.parametrize(
    ("ref", "options", "error", "message"),
    [
        ("nope", {}, EnvironmentNotFound, r"unknown environment 'nope'; known: agentic, .*reasoning.*entry point"),
        ("no_such_module_x:Env", {}, EnvironmentNotFound, r"cannot import module 'no_such_module_x'"),
        (f"{__name__}:Missing", {}, EnvironmentNotFound, r"has no attribute 'Missing'"),
        (f"{__name__}:NOT_AN_ENV", {}, EnvironmentNotFound, r"not a class or factory"),
        (f"{__name__}:Plain", {"colour": 1}, TypeError, r"could not be built with options \['colour'\]"),
        (f"{__name__}:EpisodeResult", {"reward": 1.0}, TypeError, r"lacks name, sample_task, run_episode"),
    ],
)
def test_bad_references_say_what_is_wrong(ref, options, error, message):
    with pytest.raises(error, match=message):
        load_environment(ref, options)


def test_the_task_mix_config_validates_names_and_bounds():
    config = load_config("quickstart", ["tasks.mix={a: {env: reasoning, ratio: 2}, b-1: {env: 'pkg.mod:Env', max_episodes_per_s: 5}}"])
    assert config.tasks.mix["a"].ratio == 2 and config.tasks.mix["b-1"].max_episodes_per_s == 5
    with pytest.raises(ConfigError, match="task name 'a b'"):
        load_config("quickstart", ["tasks.mix={'a b': {env: reasoning}}"])
    with pytest.raises(ConfigError, match="ratio"):
        load_config("quickstart", ["tasks.mix={a: {ratio: 0}}"])
