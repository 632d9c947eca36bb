"""Load a config: a preset name or YAML path, then dotted `key=value` overrides, then validation.

Errors are `ConfigError`s whose message names every offending key, e.g.
`rollout.temperature: Input should be greater than or equal to 0 (got -1)`.
"""

from __future__ import annotations

import difflib
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from .schema import RunConfig


class ConfigError(ValueError):
    """A config that cannot be used; the message names the key and the problem."""


def _presets() -> dict[str, bool]:
    """Preset name -> whether it is a pipeline (a file with `stages`) rather than a run config."""
    found = {}
    for entry in resources.files(__package__).iterdir():
        if entry.name.endswith(".yaml"):
            found[entry.name[:-5]] = "stages" in (yaml.safe_load(entry.read_text()) or {})
    return dict(sorted(found.items()))


def preset_names() -> list[str]:
    """Names of the run-config presets shipped with the package (`asyncrl run NAME`)."""
    return [name for name, pipeline in _presets().items() if not pipeline]


def pipeline_preset_names() -> list[str]:
    """Names of the pipeline presets shipped with the package (`asyncrl pipeline NAME`)."""
    return [name for name, pipeline in _presets().items() if pipeline]


def read_yaml(source: str) -> dict[str, Any]:
    path = Path(source)
    if path.is_file():
        text = path.read_text()
    elif source in _presets():
        text = resources.files(__package__).joinpath(f"{source}.yaml").read_text()
    else:
        raise ConfigError(f"config {source!r}: no such file and no such preset (presets: {', '.join(_presets())})")
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"config {source!r}: not valid YAML: {err}") from err
    if not isinstance(data, dict):
        raise ConfigError(f"config {source!r}: the top level must be a mapping of sections")
    return data


def apply_override(data: dict[str, Any], override: str) -> None:
    """Apply one `dotted.key=value` override; the value is parsed as YAML (`0.7`, `true`, `[1, 2]`)."""
    key, sep, raw = override.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {override!r}: expected dotted.key=value, e.g. rollout.temperature=0.7")
    try:
        value = yaml.safe_load(raw) if raw else None
    except yaml.YAMLError as err:
        raise ConfigError(f"override {override!r}: value is not valid YAML: {err}") from err
    node = data
    parts = key.split(".")
    for depth, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {override!r}: {'.'.join(parts[: depth + 1])} is not a section")
        node = child
    node[parts[-1]] = value


def _suggest(loc: tuple[Any, ...]) -> str:
    """'did you mean' for an unknown key, from the field names of the section it sits in."""
    model: type[BaseModel] | None = RunConfig
    for part in loc[:-1]:
        field = model.model_fields.get(part) if model else None
        annotation = field.annotation if field else None
        model = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
    if model is None:
        return ""
    close = difflib.get_close_matches(str(loc[-1]), list(model.model_fields), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def format_validation_error(err: ValidationError) -> str:
    lines = []
    for problem in err.errors():
        loc = tuple(problem["loc"])
        key = ".".join(str(p) for p in loc) or "<root>"
        if problem["type"] == "extra_forbidden":
            lines.append(f"{key}: unknown key{_suggest(loc)}")
        else:
            shown = problem.get("input")
            got = "" if isinstance(shown, dict) else f" (got {shown!r})"
            message = problem["msg"].removeprefix("Value error, ")  # our validators' own sentences
            lines.append(f"{key}: {message}{got}" if loc else f"{message}{got}")
    return "invalid config:\n  " + "\n  ".join(lines)


def validate(data: dict[str, Any]) -> RunConfig:
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err)) from None


def load_config(source: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Resolve a preset name or YAML path (None: all defaults) plus overrides into a RunConfig."""
    data = read_yaml(source) if source else {}
    if "stages" in data:
        raise ConfigError(f"config {source!r} is a pipeline (it has stages): run it with `asyncrl pipeline {source}`")
    for override in overrides:
        apply_override(data, override)
    return validate(data)


def dump_config(config: RunConfig) -> str:
    """The resolved config as YAML (what --dry-run prints and what a run directory keeps)."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
