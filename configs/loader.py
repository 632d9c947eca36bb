"""Load a config: a preset name or YAML path, then dotted `key=value` overrides, then validation.

Errors are `ConfigError`s whose message names every offending key as users write it, e.g.
`rollout.sampling.temperature: Input should be greater than or equal to 0 (got -1)`, or
`sandbox.docker_host: unknown key (a key of sandbox.backend=docker only)`.
"""

from __future__ import annotations

import difflib
from importlib import resources
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, Discriminator, Tag, ValidationError
from pydantic.fields import FieldInfo

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


BY_NAME = ("objective",)
"""Keys of sections that a config may also write as a bare name (`learner.objective: ppo`, `tasks.mix.X.objective`)."""


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
        if isinstance(child, str) and part in BY_NAME:
            child = node[part] = {"name": child}  # `objective: ppo`, then `objective.eps_high=...`
        if not isinstance(child, dict):
            raise ConfigError(f"override {override!r}: {'.'.join(parts[: depth + 1])} is not a section")
        node = child
    node[parts[-1]] = value


def _choices(annotation: Any) -> dict[str, type[BaseModel]]:
    """Tag -> model of a section with choices (a union of `Annotated[Model, Tag(...)]`); empty for any other type."""
    found: dict[str, type[BaseModel]] = {}
    if get_origin(annotation) in (Union, UnionType):
        for member in get_args(annotation):
            if get_origin(member) is Annotated:
                model, *metadata = get_args(member)
                found.update({m.tag: model for m in metadata if isinstance(m, Tag)})
    return found


def _choice_key(field: FieldInfo) -> str:
    """The key that picks among a section's choices (`type`, `backend`), from its discriminator."""
    discriminator = next(m for m in field.metadata if isinstance(m, Discriminator))
    return str((discriminator.custom_error_context or {})["key"])


def _place(root: type[BaseModel], loc: tuple[Any, ...]) -> tuple[str, type[BaseModel] | None, dict[str, type[BaseModel]], str]:
    """For an error's location: the dotted key as users write it (without the tag pydantic inserts
    after a section with choices: `rollout.embedded.sampling` is `rollout.sampling`), the section its
    last part is a key of (None if it is not a section's key), and when that section is one choice of
    several, the other choices by value and the key that picks them (`sandbox.backend`)."""
    shown: list[str] = []
    annotation: Any = root
    section: type[BaseModel] | None = None
    others: dict[str, type[BaseModel]] = {}
    picker = ""
    section_others: dict[str, type[BaseModel]] = {}
    section_picker = ""
    i = 0
    while i < len(loc):
        part = str(loc[i])
        i += 1
        shown.append(part)
        section = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
        section_others, section_picker, others, picker = others, picker, {}, ""
        field = section.model_fields.get(part) if section else None
        if field is not None:
            annotation = field.annotation
            choices = _choices(annotation)
            if choices and i < len(loc) and loc[i] in choices:
                tag = loc[i]
                i += 1
                annotation, others = choices[tag], {t: m for t, m in choices.items() if t != tag}
                picker = f"{'.'.join(shown)}.{_choice_key(field)}"
        elif get_origin(annotation) is dict:
            annotation = get_args(annotation)[1]
        else:
            annotation = None
    return ".".join(shown), section, section_others, section_picker


RENAMED_SECTIONS = {"run": "loop"}
"""Sections whose name changed: a config written for the old name is told the new one."""


def _suggest(name: str, section: type[BaseModel] | None, others: dict[str, type[BaseModel]], picker: str) -> str:
    """The hint after 'unknown key': the new name of a renamed section, the choice it belongs to, else
    the closest key of its section."""
    if section is RunConfig and name in RENAMED_SECTIONS:
        return f" (the section is now {RENAMED_SECTIONS[name]!r})"
    owners = [tag for tag, model in others.items() if name in model.model_fields]
    if owners:
        return f" (a key of {picker}={owners[0]} only)"
    close = difflib.get_close_matches(name, list(section.model_fields), n=1) if section else []
    return f" (did you mean {close[0]!r}?)" if close else ""


def format_validation_error(err: ValidationError, root: type[BaseModel] = RunConfig) -> str:
    """One line per problem, each naming its dotted key; `root` is the model that was validated."""
    lines = []
    for problem in err.errors():
        loc = tuple(problem["loc"])
        key, section, others, picker = _place(root, loc)
        shown = problem.get("input")
        if problem["type"] == "extra_forbidden":
            lines.append(f"{key}: unknown key{_suggest(str(loc[-1]), section, others, picker)}")
        elif problem["type"] == "choice":  # a section with choices (schema._choice), with no choice's value
            choice = problem["ctx"]["key"]
            if isinstance(shown, dict):
                lines.append(f"{key}.{choice}: {problem['msg']} (got {shown.get(choice)!r})")
            else:
                lines.append(f"{key}: Input should be a mapping (got {shown!r})")
        else:
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
