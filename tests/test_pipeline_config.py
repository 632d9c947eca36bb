"""The pipeline file: the preset resolves every stage, mistakes name their key, the matrix's checks."""

from __future__ import annotations

import pytest

from asyncrl.cli import main
from asyncrl.configs import ConfigError, load_config, preset_names
from asyncrl.configs.loader import pipeline_preset_names
from asyncrl.configs.pipeline import distill_tasks, load_pipeline, stage_config
from asyncrl.jobs.matrix import DISTILL_KEEP, format_matrix, matrix_checks, plot_matrix


def test_the_preset_resolves_every_stage_from_the_base():
    pipeline = load_pipeline("pipeline")
    assert list(pipeline.stages) == ["sft", "reasoning", "agentic", "general", "distill"]
    assert list(pipeline.eval_tasks()) == ["reasoning", "agentic", "general"]
    agentic = stage_config(pipeline, "agentic", "/tmp/p", {"policy": {"path": "/ckpt"}})
    assert agentic.learner.objective.name == "double_sided_is"  # the stage's own
    assert agentic.policy.tiny.arch == "qwen3" and agentic.tasks.arithmetic.subtraction_fraction == 0.0  # the base's
    assert agentic.name == "agentic" and agentic.runs_dir == "/tmp/p" and agentic.policy.path == "/ckpt"
    assert stage_config(pipeline, "reasoning", "/tmp/p", {}).learner.objective.name == "icepop_grpo"


def test_the_glm5_preset_trains_the_glm5_shape_with_the_sparse_path_in_reach():
    """Every stage is the GLM-5 shape (MLA + DSA + MoE, MTP at depth 3) with the indexer frozen in RL, the SFT
    stage warms the indexer up, and index_topk sits between the bare arithmetic prompts and the agentic stage's
    tool-call conversations, so the indexer's selection is what the policy attends with where contexts are long."""
    import random

    from asyncrl.envs.agentic import AgenticEnv
    from asyncrl.envs.tool_demos import PYTHON_TOOL
    from asyncrl.policy.tokenizer import build_tokenizer

    pipeline = load_pipeline("pipeline_glm5")
    assert list(pipeline.stages) == ["sft", "reasoning", "agentic", "general", "distill"]
    sft = stage_config(pipeline, "sft", "/tmp/p", {})
    assert sft.policy.tiny.arch == "glm_moe_dsa" and sft.policy.mtp.train_depth == 3
    assert sft.sft.indexer_warmup.steps > 0 and sft.sft.indexer_warmup.sparse_steps > 0
    for stage in ("reasoning", "agentic", "general"):
        assert stage_config(pipeline, stage, "/tmp/p", {"policy": {"path": "/ckpt"}}).learner.freeze_indexer
    topk = sft.policy.tiny.index_topk
    tokenizer, rng = build_tokenizer(), random.Random(0)
    conversations = [AgenticEnv().sample_task(rng).demonstration() for _ in range(20)]

    def tokens(messages, **options) -> int:
        return len(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **options)["input_ids"])

    lengths = [tokens(c, tools=[PYTHON_TOOL]) for c in conversations]
    assert min(lengths) > topk, (lengths, topk)
    assert tokens([{"role": "user", "content": "123+456"}], add_generation_prompt=True) < topk


def test_pipeline_presets_are_not_run_presets():
    assert "pipeline" in pipeline_preset_names() and "pipeline" not in preset_names()
    with pytest.raises(ConfigError, match="asyncrl pipeline"):
        load_config("pipeline")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("stages.reasoning.config.loop.stepz=3", r"stages\.reasoning: loop\.stepz: unknown key \(did you mean 'steps'\?\)"),
        (
            "stages.distill.config.learner.group_size=8",
            r"(?s)stage 'distill'.*stages\.distill: distillation trains on single rollouts: set learner\.group_size to 1",
        ),
        ("base.learner.lr=-1", r"stages\.sft: learner\.lr: Input should be greater than 0"),
        ("stages.distill.teachers.sft=1", r"stages\.distill\.teachers\.sft: not an earlier rl stage"),
        ("stages.general.kind=judge", r"stages\.general\.kind: Input should be 'sft', 'rl' or 'distill'"),
        ("stages.general.tasks={}", r"an rl stage needs tasks"),
        ("stages.general.config.policy.path=/x", r"config\.policy is set by the pipeline"),
        ("base.tasks.mix.x.env=reasoning", r"tasks\.mix and distill\.teachers belong to the stages"),
        ("stages.reasoning.kind=sft", r"an sft stage can only come first|tasks are for sft\.task"),
        (
            "stages.sft.tasks.agentic.env=agentic",
            r"stages\.sft: .*an sft stage's tasks are for sft\.task: set config\.sft\.task to one of agentic",
        ),
        ("stages={sft: {kind: sft}}", r"at least one rl stage"),
    ],
)
def test_mistakes_name_the_key_and_the_problem(override, message):
    with pytest.raises(ConfigError, match=message):
        load_pipeline("pipeline", [override])


def test_an_sft_stage_warms_up_on_the_task_sft_task_names_which_is_no_matrix_column():
    pipeline = load_pipeline("smollm2_pipeline")
    assert list(pipeline.stages["sft"].tasks) == ["agentic"]
    assert list(pipeline.eval_tasks()) == ["word_problems", "agentic", "general"]
    assert pipeline.owner("agentic") == "agentic"  # the RL stage is its teacher, not the SFT stage
    sft = stage_config(pipeline, "sft", "/tmp/p", {"tasks": {"mix": {"agentic": pipeline.stages["sft"].tasks["agentic"].model_dump()}}})
    assert sft.sft.task == "agentic" and sft.sft_warm_start is False and sft.policy.chat_template.endswith("smollm2_tools.jinja")


def test_a_pipeline_without_sft_needs_a_starting_checkpoint():
    with pytest.raises(ConfigError, match=r"base\.policy\.path"):
        load_pipeline("pipeline", ["stages.sft=null"])
    assert "sft" not in load_pipeline("pipeline", ["stages.sft=null", "base.policy.path=/ckpt"]).stages


def test_distill_shares_split_a_teacher_stage_among_its_tasks():
    pipeline = load_pipeline("pipeline", [
        "stages.general.tasks.style.env=general", "stages.general.tasks.style.ratio=3", "stages.distill.teachers.agentic=2",
    ])  # fmt: skip
    plan = distill_tasks(pipeline, "distill")
    assert {task: (teacher, share) for task, (teacher, _, share) in plan.items()} == {
        "reasoning": ("reasoning", 1.0), "agentic": ("agentic", 2.0), "general": ("general", 0.25), "style": ("general", 0.75),
    }  # fmt: skip
    pipeline = load_pipeline("pipeline", ["stages.distill.teachers=null"])
    assert pipeline.teachers("distill") == {"reasoning": 1.0, "agentic": 1.0, "general": 1.0}


def test_matrix_checks_compare_with_the_starting_checkpoint_and_the_teachers():
    rows = {
        "sft": {"r": 0.25, "a": 0.40},
        "reasoning": {"r": 0.50, "a": 0.38},
        "agentic": {"r": 0.45, "a": 0.40},  # compared with the row before it (0.38), not with sft's 0.40
        "distill": {"r": 0.475, "a": 0.37},
    }
    checks = matrix_checks(rows, {"reasoning": ["r"], "agentic": ["a"]}, {"distill": {"r": "reasoning", "a": "agentic"}})
    by = {(c["check"], c["stage"], c["task"]): c for c in checks}
    assert by["rl_raises_own_eval", "reasoning", "r"]["passed"]
    assert by["rl_raises_own_eval", "agentic", "a"]["start"] == 0.38 and by["rl_raises_own_eval", "agentic", "a"]["passed"]
    keep = by["student_keeps_teacher", "distill", "r"]
    assert keep["ratio"] == pytest.approx(0.95) and keep["passed"]  # exactly DISTILL_KEEP of the teacher passes
    miss = by["student_keeps_teacher", "distill", "a"]
    assert miss["ratio"] == pytest.approx(0.37 / 0.40) and not miss["passed"] and DISTILL_KEEP * 0.40 > 0.37
    flat = matrix_checks({"sft": {"r": 0.3}, "reasoning": {"r": 0.3}}, {"reasoning": ["r"]}, {})
    assert not flat[0]["passed"]  # equal is not a raise


def test_matrix_table_and_heat_map(tmp_path):
    rows = {"sft": {"r": 0.25, "a": 0.4}, "reasoning": {"r": 0.5}}
    table = format_matrix(rows, ["r", "a"])
    assert table.splitlines()[1].split() == ["sft", "25.0%", "40.0%"]
    assert table.splitlines()[2].split() == ["reasoning", "50.0%", "-"]
    plot_matrix(rows, ["r", "a"], tmp_path / "m.png")
    assert (tmp_path / "m.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_dry_run_and_refusals(tmp_path, capsys):
    assert main(["pipeline", "pipeline", "stages.reasoning.config.loop.steps=7", "--dry-run"]) == 0
    assert "steps: 7" in capsys.readouterr().out
    assert main(["pipeline"]) == 2
    assert "--resume" in capsys.readouterr().err
    assert main(["pipeline", "--resume", str(tmp_path / "nothing")]) == 2
    assert "not a pipeline directory" in capsys.readouterr().err
    assert main(["pipeline", "pipeline", "stages.x.kind=rl"]) == 2
    assert "stages.x" in capsys.readouterr().err


def test_an_rl_stage_that_learned_nothing_stops_the_pipeline(tmp_path):
    import json

    from asyncrl.jobs.pipeline import Pipeline, PipelineDir, StageLearnedNothing
    from asyncrl.sched.rundir import RunDir

    pipeline = load_pipeline("pipeline")
    stage = "reasoning"
    runner = Pipeline(pipeline, PipelineDir(tmp_path), say=print)
    # The stage's run ended (its summary is written) because no batch had an advantage.
    rundir = RunDir.for_config(runner.stage_config(stage, {}))
    rundir.path.mkdir(parents=True)
    (rundir.path / "summary.json").write_text(json.dumps({"stop_reason": "no_signal", "version": 0}))
    with pytest.raises(StageLearnedNothing, match="delete this run directory"):
        runner.run_rl(stage, str(tmp_path / "previous"))
