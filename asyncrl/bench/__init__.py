"""`asyncrl bench NAME`: benchmarks as user-facing commands.

Each benchmark measures its ratios side by side in one run (this machine is shared and noisy:
absolute times drift, ratios hold). Its runner is `run(config: RunConfig, json_path: str | None,
options) -> dict`; `options` is its own settings model (`bench.KEY=VALUE` on the command line) or
None for benchmarks that have none. Runners import their heavy dependencies when called, so the
registry stays cheap to import (`asyncrl --help`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pydantic import BaseModel, ValidationError

from asyncrl.configs import ConfigError, RunConfig, load_config
from asyncrl.configs.loader import apply_override, format_validation_error


@dataclass(frozen=True)
class Benchmark:
    run: Callable[..., dict]
    preset: str | None = None
    """Config used when the command names none (None: the built-in defaults)."""
    overrides: tuple[str, ...] = ()
    """The benchmark's sizing, applied to the config before the command's own overrides."""
    options: type[BaseModel] | None = None
    """The benchmark's own settings (`bench.KEY=VALUE`), or None."""

    def resolve(self, source: str | None, words: list[str]) -> tuple[RunConfig, BaseModel | None]:
        """The config (`source` or the preset, then the sizing, then the other words) and the
        benchmark's own settings (the `bench.` words)."""
        settings = [word for word in words if word.startswith("bench.")]
        config = load_config(source or self.preset, [*self.overrides, *(word for word in words if word not in settings)])
        if self.options is None:
            if settings:
                raise ConfigError(f"this benchmark has no bench.* settings (got {settings[0]!r})")
            return config, None
        data: dict = {}
        for setting in settings:
            apply_override(data, setting.removeprefix("bench."))
        try:
            return config, self.options.model_validate(data)
        except ValidationError as err:
            raise ConfigError(format_validation_error(err, self.options).replace("\n  ", "\n  bench.")) from None

    def describe(self, name: str) -> list[str]:
        """Lines for `asyncrl bench --help`: the config it runs and its own settings."""
        sizing = f", then {' '.join(self.overrides)}" if self.overrides else ""
        return [f"  {name}: config {self.preset or 'built-in defaults'}{sizing}",
                *(f"    {key} (default {default}): {doc}" for key, default, doc in _settings(self.options, "bench."))]  # fmt: skip


def _settings(model: type[BaseModel] | None, prefix: str):
    """(dotted key, default, docstring) of every leaf field of `model`."""
    for key, field in model.model_fields.items() if model is not None else ():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            yield from _settings(annotation, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", field.default, (field.description or "").replace("\n", " ")


def _engine(config, json_path, options=None):
    from .engine import run

    return run(config, json_path, options)


def _gateway(config, json_path, options=None):
    from .gateway import run

    return run(config, json_path)


def _async(config, json_path, options=None):
    from .asyncloop import run

    return run(config, json_path, options)


def _agentic(config, json_path, options=None):
    from .agentic import run

    return run(config, json_path, options)


def _soak(config, json_path, options=None):
    from .soak import run

    return run(config, json_path, options)


def _replay(config, json_path, options=None):
    from .replay import run

    return run(config, json_path, options)


def _learn(config, json_path, options=None):
    from .learn import run

    return run(config, json_path, options)


def _learner(config, json_path, options=None):
    from .learner import run

    return run(config, json_path, options)


def _scale(config, json_path, options=None):
    from .scale import run

    return run(config, json_path, options)


def _objectives(config, json_path, options=None):
    from .objectives import run

    return run(config, json_path, options)


def _registry() -> dict[str, Benchmark]:
    from . import agentic, asyncloop, engine_options, learn, learner, objectives, replay, scale, soak

    return {
        "engine": Benchmark(_engine, options=engine_options.EngineBenchOptions),
        "gateway": Benchmark(_gateway),
        "async": Benchmark(_async, asyncloop.PRESET, asyncloop.OVERRIDES, asyncloop.AsyncBenchOptions),
        "agentic": Benchmark(_agentic, agentic.PRESET, options=agentic.AgenticBenchOptions),
        "soak": Benchmark(_soak, options=soak.SoakBenchOptions),
        "replay": Benchmark(_replay, replay.PRESET, options=replay.ReplayBenchOptions),
        "learn": Benchmark(_learn, learn.PRESET, learn.OVERRIDES, learn.LearnBenchOptions),
        "learner": Benchmark(_learner, learner.PRESET, learner.OVERRIDES, learner.LearnerBenchOptions),
        "scale": Benchmark(_scale, scale.PRESET, options=scale.ScaleBenchOptions),
        "objectives": Benchmark(_objectives, objectives.PRESET, objectives.OVERRIDES, objectives.ObjectivesBenchOptions),
    }


BENCHMARKS = _registry()
"""Benchmark name -> Benchmark; later issues add theirs here."""
