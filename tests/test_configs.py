"""The config schema, presets, overrides and the errors users see."""

from __future__ import annotations

from types import UnionType
from typing import Annotated, Any, Union, get_args, get_origin

import pytest
import yaml
from pydantic import BaseModel, TypeAdapter, ValidationError

from asyncrl.cli import main
from asyncrl.configs import ConfigError, RunConfig, dump_config, load_config, preset_names
from asyncrl.configs.context import EnvContext
from asyncrl.configs.pipeline import PipelineConfig, StageSpec
from asyncrl.configs.schema import (
    DockerSandboxConfig,
    EmbeddedRolloutConfig,
    ProcessSandboxConfig,
    RedisStoreConfig,
    RolloutConfig,
    SamplingConfig,
    SandboxConfig,
    Section,
    SQLiteStoreConfig,
    VLLMRolloutConfig,
)


@pytest.mark.parametrize("name", preset_names())
def test_every_shipped_preset_loads(name: str) -> None:
    config = load_config(name)
    assert isinstance(config, RunConfig)
    # The dump is itself a valid config that resolves to the same thing.
    assert load_config(None, []).model_validate(yaml.safe_load(dump_config(config))) == config


def test_presets_are_shipped() -> None:
    assert "quickstart" in preset_names()


def _models(annotation: Any) -> list[type[BaseModel]]:
    """The section models a field holds: itself, every choice of a union, the values of a mapping."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if get_origin(annotation) is Annotated:
        return _models(get_args(annotation)[0])
    if get_origin(annotation) in (Union, UnionType, dict):
        return [model for arg in get_args(annotation) for model in _models(arg)]
    return []


def _sections(model: type[BaseModel]):
    yield model
    for field in model.model_fields.values():
        for section in _models(field.annotation):
            yield from _sections(section)


SECTIONS = {*_sections(RunConfig), *_sections(PipelineConfig)}


def test_the_walk_reaches_the_choices_and_the_mappings() -> None:
    names = {section.__name__ for section in SECTIONS}
    assert {"EmbeddedRolloutConfig", "VLLMRolloutConfig", "SQLiteStoreConfig", "RedisStoreConfig"} <= names
    assert {"ProcessSandboxConfig", "DockerSandboxConfig", "TaskSpec", "TeacherSpec", "StageSpec"} <= names


def test_every_section_has_a_docstring() -> None:
    for section in SECTIONS | {EnvContext}:
        assert (section.__doc__ or "").strip(), f"{section.__name__} has no docstring"


def test_every_field_has_a_docstring_and_default() -> None:
    for section in SECTIONS - {PipelineConfig, StageSpec}:
        assert issubclass(section, Section), section
        for name, field in section.model_fields.items():
            assert not field.is_required(), f"{section.__name__}.{name} has no default"
            assert field.description, f"{section.__name__}.{name} has no docstring"
    for name, field in {**EnvContext.model_fields, **PipelineConfig.model_fields, **StageSpec.model_fields}.items():
        assert field.description, f"{name} has no docstring"


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
    with pytest.raises(ConfigError, match=r"no such file and no such preset.*quickstart"):
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


@pytest.mark.parametrize(
    ("overrides", "section", "expected"),
    [
        ([], "store", SQLiteStoreConfig()),
        (["store.path=x.db"], "store", SQLiteStoreConfig(path="x.db")),
        (["store.type=redis", "store.namespace=n"], "store", RedisStoreConfig(namespace="n")),
        (["rollout.kv_block_size=32"], "rollout", EmbeddedRolloutConfig(kv_block_size=32)),
        (["rollout.type=vllm", "rollout.max_num_seqs=8"], "rollout", VLLMRolloutConfig(max_num_seqs=8)),
        (["sandbox.backend=docker", "sandbox.cpus=2"], "sandbox", DockerSandboxConfig(cpus=2.0)),
    ],
)
def test_the_choice_key_picks_the_section_model(overrides: list[str], section: str, expected: BaseModel) -> None:
    assert getattr(load_config(None, overrides), section) == expected


def test_an_override_switches_the_choice_of_a_preset(tmp_path) -> None:
    assert load_config("agentic").sandbox == ProcessSandboxConfig()
    assert load_config("agentic", ["sandbox.backend=docker"]).sandbox == DockerSandboxConfig()
    path = tmp_path / "c.yaml"
    path.write_text("sandbox:\n  backend: docker\n  docker_image: mine:1\nstore:\n  type: redis\n  namespace: a\n")
    config = load_config(str(path), ["store.namespace=b"])
    assert (config.sandbox, config.store) == (DockerSandboxConfig(docker_image="mine:1"), RedisStoreConfig(namespace="b"))
    with pytest.raises(ConfigError) as info:
        load_config(str(path), ["sandbox.backend=process"])
    assert str(info.value) == "invalid config:\n  sandbox.docker_image: unknown key (a key of sandbox.backend=docker only)"


def test_a_dump_with_other_choices_loads_back(tmp_path) -> None:
    config = load_config(
        "quickstart", ["store.type=redis", "rollout.type=vllm", "sandbox.backend=docker", "sandbox.docker_host=unix:///d.sock"]
    )
    path = tmp_path / "dumped.yaml"
    path.write_text(dump_config(config))
    assert load_config(str(path)) == config
    assert (yaml.safe_load(dump_config(config))["rollout"]["type"], type(load_config(str(path)).rollout)) == ("vllm", VLLMRolloutConfig)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["sandbox.backend=vm"], "sandbox.backend: Input should be 'process' or 'docker' (got 'vm')"),
        (["rollout.type=null"], "rollout.type: Input should be 'embedded' or 'vllm' (got None)"),
        (["store=3"], "store: Input should be a mapping (got 3)"),
        (["store.namespace=run1"], "store.namespace: unknown key (a key of store.type=redis only)"),
        (
            ["rollout.type=vllm", "rollout.kv_block_size=8"],
            "rollout.kv_block_size: unknown key (a key of rollout.type=embedded only)",
        ),
        (["rollout.kv_blok_size=8"], "rollout.kv_blok_size: unknown key (did you mean 'kv_block_size'?)"),
        (["rollout.sampling.temprature=1"], "rollout.sampling.temprature: unknown key (did you mean 'temperature'?)"),
        (["rollout.type=vllm", "rollout.sampling.top_p=0"], "rollout.sampling.top_p: Input should be greater than 0 (got 0)"),
        (["sandbox.backend=docker", "sandbox.cpus=0"], "sandbox.cpus: Input should be greater than 0 (got 0)"),
        (["rollout.mtp_draft_tokens=9"], "rollout: mtp_draft_tokens (9) exceeds mtp_max_draft_tokens (8)"),
        (["run.steps=3"], "run: unknown key (the section is now 'loop')"),
    ],
)
def test_errors_in_a_section_with_choices_name_the_key_as_written(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert str(info.value) == f"invalid config:\n  {message}"


def test_a_section_alone_validates_with_its_default_choice() -> None:
    rollout = TypeAdapter(RolloutConfig)
    assert rollout.validate_python({"max_num_seqs": 2}) == EmbeddedRolloutConfig(max_num_seqs=2)
    assert rollout.validate_python(VLLMRolloutConfig(max_num_seqs=3).model_dump()) == VLLMRolloutConfig(max_num_seqs=3)
    with pytest.raises(ValidationError):
        TypeAdapter(SandboxConfig).validate_python({"backend": "process", "docker_image": "x"})


def test_a_section_moves_to_another_choice_keeping_what_they_share() -> None:
    docker = DockerSandboxConfig(memory_mb=512, network=True, docker_host="unix:///d.sock")
    assert docker.on_backend("docker") is docker
    assert docker.on_backend("process") == ProcessSandboxConfig(memory_mb=512, network=True)
    assert ProcessSandboxConfig(python="/x/python3", timeout_s=2).on_backend("docker") == DockerSandboxConfig(timeout_s=2)
    vllm = VLLMRolloutConfig(max_num_seqs=8, fp8=True, sampling=SamplingConfig(temperature=0.5))
    assert vllm.embedded() == EmbeddedRolloutConfig(max_num_seqs=8, fp8=True, sampling=SamplingConfig(temperature=0.5))
    embedded = EmbeddedRolloutConfig(kv_block_size=8)
    assert embedded.embedded() is embedded


def test_the_env_context_carries_what_plugins_read() -> None:
    overrides = [
        "seed=5",
        "rollout.sampling.temperature=0.7",
        "loop.episode_max_tokens=9",
        "tasks.general.max_words=2",
        "rewards.http.timeout_s=3",
    ]
    config = load_config("quickstart", overrides)
    context = EnvContext.of(config)
    assert (context.seed, context.sampling.temperature, context.episode_max_tokens) == (5, 0.7, 9)
    assert (context.tasks, context.rewards) == (config.tasks, config.rewards)
    assert EnvContext() == EnvContext.of(RunConfig())  # the defaults are a default run's
    with pytest.raises(ValidationError):
        context.seed = 1  # type: ignore[misc]  # frozen: every plug-in sees the same settings


def test_learner_sharding_resolves_auto_by_device_and_refuses_unknown_values() -> None:
    import torch

    from asyncrl.learner.sharding import uses_fsdp

    fsdp = ["learner.num_ranks=2", "learner.sharding=fsdp"]
    with pytest.raises(ConfigError, match=r"learner.sharding: Input should be 'auto', 'replicate' or 'fsdp'"):
        load_config("quickstart", ["learner.sharding=zero3"])
    # auto: FSDP on CUDA, the replicated learner otherwise.
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    two = load_config("quickstart", ["learner.num_ranks=2"])
    assert uses_fsdp(two, cuda) and not uses_fsdp(two, cpu)
    assert not uses_fsdp(load_config("quickstart", ["learner.num_ranks=2", "learner.sharding=replicate"]), cuda)
    assert not uses_fsdp(load_config("quickstart", []), cuda)  # one rank
    assert uses_fsdp(load_config("quickstart", fsdp), cpu)


def test_an_objective_written_by_name_takes_overrides_of_its_keys():
    config = load_config("smollm2_agentic", ["learner.objective.eps_high=0.5"])  # the preset writes `objective: double_sided_is`
    assert config.learner.objective.name == "double_sided_is" and config.learner.objective.eps_high == 0.5
    mixed = load_config("quickstart", ["tasks.mix.a.objective=ppo", "tasks.mix.a.objective.correction.kind=truncate"])
    assert mixed.tasks.mix["a"].objective.name == "ppo" and mixed.tasks.mix["a"].objective.correction.kind == "truncate"


def test_a_config_from_before_objective_sections_keeps_its_bounds():
    from asyncrl.configs.learner import LearnerConfig

    old = LearnerConfig.model_validate({"objective": "icepop_grpo", "eps_low": 0.1, "eps_high": 0.3, "icepop_beta": 3.0})
    assert (old.objective.name, old.objective.eps_low, old.objective.eps_high, old.objective.beta) == ("icepop_grpo", 0.1, 0.3, 3.0)
    sided = LearnerConfig.model_validate({"objective": "double_sided_is", "eps_high": 0.5, "icepop_beta": 3.0})
    assert sided.objective.name == "double_sided_is" and sided.objective.eps_high == 0.5  # beta had no place there
    assert LearnerConfig.model_validate({"eps_low": 0.15}).objective.eps_low == 0.15  # the default objective, moved into
    written = LearnerConfig.model_validate({"objective": {"name": "ppo", "eps_low": 0.05}, "eps_low": 0.3})
    assert written.objective.eps_low == 0.05  # the objective's own key wins


def test_a_config_from_before_the_paged_cache_still_loads_and_says_its_retained_prefixes_are_ignored() -> None:
    with pytest.warns(DeprecationWarning, match=r"rollout\.retained_prefixes is ignored: the paged KV cache keeps every finished block"):
        old = EmbeddedRolloutConfig.model_validate({"retained_prefixes": 64, "max_num_seqs": 8})
    assert old == EmbeddedRolloutConfig(max_num_seqs=8)
