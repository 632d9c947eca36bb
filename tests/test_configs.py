"""The config schema, presets, overrides and the errors users see."""

from __future__ import annotations

import pytest
import yaml
from pydantic import BaseModel

from asyncrl.cli import main
from asyncrl.configs import ConfigError, RunConfig, dump_config, load_config, preset_names
from asyncrl.configs.schema import Section


@pytest.mark.parametrize("name", preset_names())
def test_every_shipped_preset_loads(name: str) -> None:
    config = load_config(name)
    assert isinstance(config, RunConfig)
    # The dump is itself a valid config that resolves to the same thing.
    assert load_config(None, []).model_validate(yaml.safe_load(dump_config(config))) == config


def test_presets_are_shipped() -> None:
    assert "quickstart" in preset_names()


def _sections(model: type[BaseModel]):
    yield model
    for field in model.model_fields.values():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            yield from _sections(field.annotation)


def test_every_field_has_a_docstring_and_default() -> None:
    for section in _sections(RunConfig):
        assert issubclass(section, Section), section
        for name, field in section.model_fields.items():
            assert not field.is_required(), f"{section.__name__}.{name} has no default"
            annotation = field.annotation
            is_section = isinstance(annotation, type) and issubclass(annotation, BaseModel)
            assert is_section or field.description, f"{section.__name__}.{name} has no docstring"


def test_dotted_overrides_parse_yaml_values() -> None:
    config = load_config("quickstart", ["rollout.sampling.temperature=0.7", "sft.stop_at_accuracy=null", "name=x"])
    assert config.rollout.sampling.temperature == 0.7
    assert config.sft.stop_at_accuracy is None
    assert config.name == "x"


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("rollout.temprature=1", "rollout.temprature: unknown key"),
        ("rollout.sampling.temprature=1", "did you mean 'temperature'"),
        ("rollout.sampling.temperature=-1", "rollout.sampling.temperature: Input should be greater than or equal to 0"),
        ("sft.lr=abc", "sft.lr: Input should be a valid number"),
        ("policy.tiny.arch=llama", "policy.tiny.arch: Input should be 'glm_moe_dsa' or 'qwen3'"),
        ("policy.tiny.experts_per_token=9", "experts_per_token must not exceed num_experts"),
        ("sft.time_budget_s.x=1", "sft.time_budget_s is not a section"),
        ("sft.lr.x=1", "sft.lr: Input should be a valid number"),
        ("no_equals_sign", "expected dotted.key=value"),
    ],
)
def test_bad_values_name_the_key(override: str, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config("quickstart", [override])
    assert expected in str(info.value)


def test_missing_config_lists_presets(tmp_path) -> None:
    with pytest.raises(ConfigError, match="no such file and no such preset.*quickstart"):
        load_config(str(tmp_path / "nope.yaml"))


def test_yaml_file_with_unknown_section(tmp_path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("rollot:\n  num_workers: 2\n")
    with pytest.raises(ConfigError, match=r"rollot: unknown key \(did you mean 'rollout'\?\)"):
        load_config(str(path))


def test_cli_dry_run_prints_resolved_config(capsys) -> None:
    assert main(["sft", "quickstart", "sft.lr=0.002", "--dry-run"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["sft"]["lr"] == 0.002
    assert printed["name"] == "quickstart"


def test_cli_bad_config_is_exit_2_with_message(capsys) -> None:
    assert main(["sft", "quickstart", "sft.batch_size=0"]) == 2
    assert "sft.batch_size: Input should be greater than or equal to 1" in capsys.readouterr().err
