"""Every field of every config section, set to a value just outside each of its bounds and to a value of
the wrong type, through the loader users use (`load_config(name, ["key=value"])`, and `asyncrl run
quickstart key=value` for a few): each is refused with a ConfigError whose message names the full dotted key and
the problem, never a traceback.

The cases are generated from the schema (`model_fields` and their annotated constraints), walking into
every section, every choice of the sections with choices (rollout.type, store.type, sandbox.backend) and
the sections kept by name (tasks.mix, distill.teachers), so a new field is covered as soon as it exists."""

from __future__ import annotations

import math
import re
import subprocess
import sys
import types
from dataclasses import dataclass
from typing import Any, Literal, Union, get_args, get_origin

import annotated_types
import pytest
from pydantic import BaseModel

from asyncrl.configs import ConfigError, load_config
from asyncrl.configs.loader import _choice_key, _choices
from asyncrl.configs.schema import RunConfig

ENTRY = "entry"
NAMED_CHOICES = {"learner.objective", "tasks.mix.entry.objective"}
"""Sections with choices that also take a bare choice (`learner.objective: ppo`): a wrong word is a wrong choice."""
"""The name given to one entry of a section kept by name (tasks.mix.entry, distill.teachers.entry)."""


@dataclass(frozen=True)
class Case:
    overrides: tuple[str, ...]
    key: str
    """The dotted key the error must name."""
    problem: str
    """A fragment the error must contain after the key."""

    @property
    def id(self) -> str:
        return self.overrides[-1]


def _optional(annotation: Any) -> Any:
    """X for `X | None`, else the annotation itself."""
    if get_origin(annotation) in (Union, types.UnionType):
        members = [a for a in get_args(annotation) if a is not type(None)]
        if len(members) == 1:
            return members[0]
    return annotation


def _is_section(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _yaml_float(value: float) -> str:
    # A mantissa with a dot: PyYAML reads `5e-324` as a string, `4.9e-324` as a float.
    return f"{value:.17e}" if math.isfinite(value) else {math.inf: ".inf", -math.inf: "-.inf"}.get(value, ".nan")


def _outside_bounds(key: str, kind: type, metadata: list, picks: tuple[str, ...]) -> list[Case]:
    """A value just past each numeric bound: the bound itself for gt/lt, one step beyond it for ge/le."""
    cases = []
    for bound in metadata:
        for name, word, direction in (("gt", "greater than", -1), ("ge", "greater than or equal to", -1),
                                      ("lt", "less than", 1), ("le", "less than or equal to", 1)):  # fmt: skip
            if not isinstance(bound, getattr(annotated_types, name.capitalize())):
                continue
            limit = getattr(bound, name)
            if name in ("gt", "lt"):
                value = limit
            elif kind is int:
                value = limit + direction
            else:
                value = math.nextafter(limit, direction * math.inf)
            shown = str(int(value)) if kind is int else _yaml_float(float(value))
            printed = int(limit) if float(limit).is_integer() else limit  # as pydantic prints it: 0, not 0.0
            cases.append(Case((*picks, f"{key}={shown}"), key, f"{word} {printed}"))
            if kind is float:  # NaN compares false with every bound, so every bound must refuse it
                cases.append(Case((*picks, f"{key}=.nan"), key, "Input should be"))
    return cases


def _outside_strings(key: str, metadata: list, picks: tuple[str, ...]) -> list[Case]:
    cases = []
    for constraint in metadata:
        if isinstance(constraint, annotated_types.MinLen) and constraint.min_length > 0:
            cases.append(Case((*picks, f"{key}='{'x' * (constraint.min_length - 1)}'"), key, "at least"))
        elif isinstance(constraint, annotated_types.MaxLen):
            cases.append(Case((*picks, f"{key}={'x' * (constraint.max_length + 1)}"), key, "at most"))
        elif getattr(constraint, "pattern", None) and not re.fullmatch(constraint.pattern, "no spaces or slashes / here"):
            cases.append(Case((*picks, f"{key}='no spaces or slashes / here'"), key, "should match pattern"))
    return cases


WRONG_TYPE: dict[Any, tuple[str, str]] = {
    int: ("twelve", "valid integer"),
    float: ("fast", "valid number"),
    bool: ("perhaps", "valid boolean"),
    str: ("[1, 2]", "valid string"),
}
"""Field type -> (a YAML value of another type, what the error says)."""


def _wrong_types(key: str, annotation: Any, picks: tuple[str, ...]) -> list[Case]:
    annotation = _optional(annotation)
    origin = get_origin(annotation)
    if annotation in WRONG_TYPE:
        value, problem = WRONG_TYPE[annotation]
        cases = [Case((*picks, f"{key}={value}"), key, problem)]
        if annotation is int:
            cases.append(Case((*picks, f"{key}=1.5"), key, "fractional part"))
        return cases
    if origin is Literal:
        return [Case((*picks, f"{key}=no_such_choice"), key, "Input should be")]
    if origin is list:
        cases = [Case((*picks, f"{key}=just-one-word"), key, "valid list")]
        (item,) = get_args(annotation)
        if get_origin(item) is Literal:
            cases.append(Case((*picks, f"{key}=[no_such_choice]"), f"{key}.0", "Input should be"))
        return cases
    if origin is dict:
        return [Case((*picks, f"{key}=just-one-word"), key, "valid dictionary")]
    if annotation is Any:
        return []
    raise AssertionError(f"{key}: no wrong-type value for {annotation!r}; add one to WRONG_TYPE")


def cases_for(model: type[BaseModel], prefix: str = "", picks: tuple[str, ...] = ()) -> list[Case]:
    """Every refusal case for `model`'s fields (dotted under `prefix`), each after `picks` (the overrides
    that select the choice the field belongs to)."""
    cases = [Case((*picks, f"{prefix}no_such_key=1"), f"{prefix}no_such_key", "unknown key")]
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        annotation = _optional(field.annotation)
        choices = _choices(field.annotation)
        if choices:  # a section with choices: each choice's fields, after the override that picks it
            picker = _choice_key(field)
            cases.append(Case((*picks, f"{key}.{picker}=no_such_choice"), f"{key}.{picker}", "Input should be"))
            if key in NAMED_CHOICES:
                cases.append(Case((*picks, f"{key}=just-one-word"), f"{key}.{picker}", "Input should be"))
            else:
                cases.append(Case((*picks, f"{key}=just-one-word"), key, "mapping"))
            for tag, choice in choices.items():
                cases += [c for c in cases_for(choice, f"{key}.", (*picks, f"{key}.{picker}={tag}")) if not c.key.endswith(f".{picker}")]
        elif _is_section(annotation):
            cases.append(Case((*picks, f"{key}=just-one-word"), key, "valid dictionary"))
            cases += cases_for(annotation, f"{key}.", picks)
        elif get_origin(annotation) is dict and _is_section(get_args(annotation)[1]):
            cases.append(Case((*picks, f"{key}=just-one-word"), key, "valid dictionary"))
            cases += cases_for(get_args(annotation)[1], f"{key}.{ENTRY}.", picks)
        else:
            kind = annotation if annotation in (int, float) else None
            if kind is not None:
                cases += _outside_bounds(key, kind, field.metadata, picks)
            if annotation is str:
                cases += _outside_strings(key, field.metadata, picks)
            cases += _wrong_types(key, field.annotation, picks)
    return cases


CASES = cases_for(RunConfig)


def test_the_battery_reaches_every_section_and_choice() -> None:
    keys = {case.key for case in CASES}
    for expected in (
        "rollout.sampling.temperature", "rollout.mtp_draft_tokens", "rollout.kv_block_size", "store.url",
        "store.visibility_timeout_s", "sandbox.docker_host", "sandbox.memory_mb", "tasks.mix.entry.ratio",
        "distill.teachers.entry.ratio", "gateway.max_body_bytes", "policy.tiny.hidden_size", "learner.crash_statuses.0",
    ):  # fmt: skip
        assert expected in keys, expected
    assert len(CASES) > 400


@pytest.mark.parametrize("case", CASES, ids=[case.id[:120] for case in CASES])
def test_an_invalid_value_is_refused_naming_its_key(case: Case) -> None:
    with pytest.raises(ConfigError) as refused:
        load_config(None, list(case.overrides))
    message = str(refused.value)
    lines = message.splitlines()
    assert lines[0] == "invalid config:", message
    named = [line.strip() for line in lines[1:] if line.strip().startswith(f"{case.key}:")]
    assert named, f"no line names {case.key!r}:\n{message}"
    assert any(case.problem in line for line in named), f"{case.key}: expected {case.problem!r} in:\n{message}"


def test_the_same_errors_come_through_a_preset() -> None:
    """A preset's own values do not hide an override's error (quickstart sets some of these keys itself)."""
    with pytest.raises(ConfigError, match=r"rollout\.sampling\.temperature: Input should be less than or equal to 10"):
        load_config("quickstart", ["rollout.sampling.temperature=10.5"])


CLI_CASES = [
    ("gateway.port=65536", "gateway.port: Input should be less than or equal to 65535"),
    ("learner.lr=fast", "learner.lr: Input should be a valid number"),
    ("sandbox.docker_host=unix:///x", "sandbox.docker_host: unknown key (a key of sandbox.backend=docker only)"),
    ("rollout.type=tpu", "rollout.type: Input should be 'embedded' or 'vllm'"),
]


@pytest.mark.parametrize(("override", "expected"), CLI_CASES, ids=[c[0] for c in CLI_CASES])
def test_the_cli_refuses_an_invalid_override_without_a_traceback(override: str, expected: str) -> None:
    done = subprocess.run([sys.executable, "-m", "asyncrl", "run", "quickstart", override], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert expected in done.stderr, done.stderr
    assert "Traceback" not in done.stderr + done.stdout
