"""Cross-stage distillation: the advantage, its path through the learner, teacher routing, the prompt mix.

Teacher scoring against the teacher's full forward is in test_scoring.py; a run end to end
(Ray actors, gateway, loop) in test_distill_run.py.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
import torch
from conftest import make_tiny_model
from test_learner_rl import make_learner, model_logprobs, sample

from asyncrl.configs import ConfigError, load_config
from asyncrl.configs.schema import RunConfig
from asyncrl.distill.teachers import ScoredSample, Teachers, reverse_kl
from asyncrl.jobs.distill import NotADistillation, check_distill_config, reverse_kl_over_time
from asyncrl.learner.objectives import distill_advantages, icepop_grpo_loss
from asyncrl.records import Batch
from asyncrl.rollout.scoring import NativeScorer
from asyncrl.sched.tasks import distill_task_mix

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # forwards compared to 1e-4, on one thread

# -- the advantage -----------------------------------------------------------------------------


def test_advantage_is_the_teacher_minus_student_logprob_on_sampled_tokens():
    teacher = torch.tensor([[-1.0, -2.0, -0.25, -3.0]])
    student = torch.tensor([[-1.5, -0.5, -0.25, -9.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    # By hand: -2.0 - -0.5 = -1.5, -0.25 - -0.25 = 0, -3.0 - -9.0 = 6.0; the prompt token gets 0.
    assert distill_advantages(teacher, student, mask).tolist() == [[0.0, -1.5, 0.0, 6.0]]


def test_advantage_carries_no_gradient_to_the_teacher_or_through_itself():
    teacher_model, student_model = make_tiny_model("qwen3", seed=1), make_tiny_model("qwen3", seed=2)
    tokens = torch.tensor([[3, 4, 5, 10, 11, 12]])
    mask = torch.tensor([[0.0, 0.0, 1.0, 1.0, 1.0]])

    def logprobs(model):
        logits = model(input_ids=tokens).logits[:, :-1]
        return torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)

    teacher_logp, student_logp = logprobs(teacher_model), logprobs(student_model)
    advantages = distill_advantages(teacher_logp, student_logp, mask)
    assert not advantages.requires_grad
    out = icepop_grpo_loss(student_logp, student_logp.detach(), advantages, mask)
    out.loss.backward()
    assert all(p.grad is None for p in teacher_model.parameters())
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in student_model.parameters())


def test_reverse_kl_is_the_mean_log_ratio_over_sampled_tokens():
    total, count = reverse_kl([0.0, -1.0, -2.0, 0.0], [0.0, -1.5, -1.0, -7.0], [0, 1, 1, 0])
    assert (total, count) == (0.5 - 1.0, 2)


# -- through the learner -------------------------------------------------------------------------


def scored(learner, teacher_model, rollout: str, completion: list[int], **options) -> ScoredSample:
    """A student sample (group size 1, reward 0) with `teacher_model`'s log-prob of every token."""
    base = sample(learner, rollout, rollout, 0.0, completion, **options)
    fields = {name: getattr(base, name) for name in base.__dataclass_fields__}
    return ScoredSample(**fields, teacher="t", teacher_logprobs=model_logprobs_of(teacher_model, base.token_ids))


def model_logprobs_of(model, token_ids: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([token_ids])).logits[0, :-1]
    return [0.0, *torch.log_softmax(logits, -1).gather(-1, torch.tensor(token_ids[1:])[:, None]).squeeze(-1).tolist()]


def capture_advantages(learner) -> list[torch.Tensor]:
    seen: list[torch.Tensor] = []
    objective = learner.objective

    def spy(logp, logp_rollout, advantages, mask, **options):
        seen.append(advantages.detach().clone())
        return objective(logp, logp_rollout, advantages, mask, **options)

    learner.objective = spy
    return seen


def test_learner_trains_distillation_samples_on_per_token_teacher_minus_current_logprobs():
    learner = make_learner(group_size=1)
    teacher = make_tiny_model("qwen3", seed=7)
    samples = [scored(learner, teacher, "a", [10, 11, 12], env=[30], more=[13]), scored(learner, teacher, "b", [20, 21])]
    for s in samples:  # rollout log-probs a little off the learner's: the advantage must use the learner's
        s.logprobs = [lp - 0.05 if m else 0.0 for lp, m in zip(s.logprobs, s.loss_mask, strict=True)]
    expected = []
    for s in samples:  # by hand: teacher minus the student's current log-prob, on sampled tokens only
        current = model_logprobs(learner, s.token_ids)
        expected.append([t - c if m else 0.0 for t, c, m in zip(s.teacher_logprobs, current, s.loss_mask, strict=True)][1:])
    seen = capture_advantages(learner)
    before = [model_logprobs(learner, s.token_ids) for s in samples]
    step = learner.train_step(Batch([[s] for s in samples]))  # group size 1: each its own group
    assert step.stepped and step.metrics["skipped_zero_adv"] == 0 and step.ledger["trained"] == 2
    rows = [row.tolist() for batch in seen for row in batch]  # padded to their micro-batch's width
    for e in expected:
        # strict=False: a padded row is longer than the advantages it carries; the padding is checked to be zero.
        assert any(
            len(row) >= len(e) and max(abs(a - b) for a, b in zip(row, e, strict=False)) < 1e-5 and not any(row[len(e) :]) for row in rows
        ), f"no row carried the hand-computed advantages {e}: {rows}"
    # First order, a step on -sum(A * logp) raises sum(A * logp): the student moves toward the teacher.
    after = [model_logprobs(learner, s.token_ids) for s in samples]
    gain = sum(a * (y - x) for e, b, f in zip(expected, before, after, strict=True) for a, x, y in zip(e, b[1:], f[1:], strict=True))
    assert gain > 0


def test_distillation_samples_follow_the_staleness_and_crash_rules():
    learner = make_learner(group_size=1, max_staleness=1)
    learner.version = 5
    teacher = make_tiny_model("qwen3", seed=7)
    fresh = scored(learner, teacher, "fresh", [10, 11], version=4)
    stale = scored(learner, teacher, "stale", [10, 11], version=3)
    crashed = scored(learner, teacher, "crashed", [10, 11], version=5, status="env_crash")
    step = learner.train_step(Batch([[fresh], [stale], [crashed]]))
    assert step.ledger == {
        "trained": 1,
        "dropped_stale": 1,
        "dropped_crash": 1,
        "dropped_group": 0,
        "dropped_overlong": 0,
        "dropped_no_signal": 0,
        "aborted": 0,
    }


def test_a_distillation_sample_whose_teacher_logprobs_do_not_line_up_is_refused():
    learner = make_learner(group_size=1)
    bad = scored(learner, make_tiny_model("qwen3", seed=7), "a", [10, 11])
    bad.teacher_logprobs = bad.teacher_logprobs[:-1]
    with pytest.raises(ValueError, match="teacher_logprobs"):
        learner.train_step(Batch([[bad]]))


# -- teacher routing -------------------------------------------------------------------------------


class LoopbackTeacher:
    """A TeacherScorer without Ray: a NativeScorer here, recording its calls."""

    def __init__(self, model) -> None:
        self.scorer, self.calls = NativeScorer(model), []

    async def score(self, sequences, temperature):
        self.calls.append((sequences, temperature))
        return self.scorer.score(sequences, temperature)


def test_samples_are_scored_by_their_stages_teacher_at_the_sampling_temperature():
    learner = make_learner(group_size=1)
    models = {"math": make_tiny_model("qwen3", seed=3), "tools": make_tiny_model("qwen3", seed=4)}
    handles = {name: LoopbackTeacher(model) for name, model in models.items()}
    samples = [sample(learner, f"r{i}", f"r{i}", 0.0, [10 + i, 11]) for i in range(4)]
    for s, task in zip(samples, ["math", "tools", "math", "tools"], strict=True):
        s.task = task
    samples[2].status = "env_crash"
    batch, metrics = asyncio.run(Teachers(handles, temperature=0.5).score(Batch([[s] for s in samples])))
    assert [[s.rollout_id for s in group] for group in batch.groups] == [["r0"], ["r1"], ["r2"], ["r3"]]  # the groups as handed in
    out = batch.samples
    assert out[2] is samples[2]  # the learner drops it: not worth a teacher forward
    assert [len(h.calls[0][0]) for h in handles.values()] == [1, 2] and all(h.calls[0][1] == 0.5 for h in handles.values())
    for s, o in zip(samples, out, strict=True):
        if o is s:
            continue
        assert o.teacher == s.task and o.token_ids == s.token_ids and o.logprobs == s.logprobs
        assert o.teacher_logprobs == NativeScorer(models[s.task]).score([s.token_ids], 0.5)[0]
    kl, n = reverse_kl(out[1].logprobs, out[1].teacher_logprobs, out[1].loss_mask)
    kl3, n3 = reverse_kl(out[3].logprobs, out[3].teacher_logprobs, out[3].loss_mask)
    assert metrics["reverse_kl/tools"] == pytest.approx((kl + kl3) / (n + n3))
    assert set(metrics) == {"reverse_kl/math", "reverse_kl/tools"}


def test_a_teacher_scores_each_token_at_its_turns_temperature():
    learner = make_learner(group_size=1)
    model = make_tiny_model("qwen3", seed=3)
    teacher = LoopbackTeacher(model)
    mixed = sample(learner, "a", "a", 0.0, [10, 11], env=[40], more=[12, 13])
    mixed.temperatures = [None] * 3 + [0.5, 0.5] + [None] + [0.0, 0.0]  # a turn at 0.5, then a greedy one
    plain = sample(learner, "b", "b", 0.0, [20, 21])  # no temperature on record: the run's
    for s in (mixed, plain):
        s.task = "math"
    batch, _ = asyncio.run(Teachers({"math": teacher}, temperature=0.7).score(Batch([[mixed], [plain]])))
    out = batch.samples
    # One call per temperature among the sampled tokens: 0.5, 1 (greedy), 0.7 (the run's).
    assert [(len(sequences), temperature) for sequences, temperature in teacher.calls] == [(1, 0.5), (1, 1.0), (1, 0.7)]
    scorer = NativeScorer(model)
    at = {t: scorer.score([mixed.token_ids], t)[0] for t in (0.5, 1.0)}
    sampled = [j for j, m in enumerate(mixed.loss_mask) if m]
    assert [out[0].teacher_logprobs[j] for j in sampled] == [at[0.5][3], at[0.5][4], at[1.0][6], at[1.0][7]]
    assert out[1].teacher_logprobs == scorer.score([plain.token_ids], 0.7)[0]


def test_a_sample_of_a_task_without_a_teacher_is_an_error():
    learner = make_learner(group_size=1)
    stray = sample(learner, "r", "r", 0.0, [10, 11])
    stray.task = "unknown"
    with pytest.raises(ValueError, match="has no teacher"):
        asyncio.run(Teachers({"math": LoopbackTeacher(make_tiny_model("qwen3"))}, temperature=1.0).score(Batch([[stray]])))


# -- the prompt mix and the config ------------------------------------------------------------------


def distill_config(tmp_path, **teachers) -> RunConfig:
    (tmp_path / "config.json").write_text("{}")
    mix = {"words": {"env": "reasoning", "options": {}, "ratio": 50.0, "eval_problems": 7}}
    return RunConfig.model_validate({
        "policy": {"path": str(tmp_path)}, "learner": {"group_size": 1},
        "tasks": {"mix": mix}, "distill": {"teachers": teachers},
    })  # fmt: skip


def test_the_prompt_mix_follows_the_configured_ratios_within_one_prompt_per_stage(tmp_path):
    teacher = {"checkpoint": str(tmp_path)}
    config = distill_config(tmp_path, reasoning={**teacher, "ratio": 3.0}, words={**teacher, "ratio": 1.0})
    mix = distill_task_mix(config)
    words = next(task for task in mix.tasks if task.name == "words")
    assert words.ratio == 1.0 and words.eval_problems == 7  # the task's own settings, the teacher's ratio
    counts: Counter = Counter()
    # Tolerance: after every prompt, each stage's count is within one prompt of its share.
    for n in range(1, 401):
        counts[mix.pick().name] += 1
        assert abs(counts["reasoning"] - 0.75 * n) <= 1 and abs(counts["words"] - 0.25 * n) <= 1
    assert counts == {"reasoning": 300, "words": 100}


def test_distillation_config_refusals(tmp_path):
    with pytest.raises(ValueError, match="group_size to 1"):
        RunConfig.model_validate({"distill": {"teachers": {"reasoning": {"checkpoint": str(tmp_path)}}}})
    with pytest.raises(ConfigError, match="checkpoint"):
        load_config("quickstart", ["learner.group_size=1", "distill.teachers.reasoning.ratio=2"])
    with pytest.raises(NotADistillation, match=r"distill\.teachers is empty"):
        check_distill_config(RunConfig())
    missing = distill_config(tmp_path, reasoning={"checkpoint": str(tmp_path / "nowhere")})
    with pytest.raises(NotADistillation, match="nowhere"):
        check_distill_config(missing)
    no_student = distill_config(tmp_path, reasoning={"checkpoint": str(tmp_path)})
    no_student.policy.path = None
    with pytest.raises(NotADistillation, match=r"policy\.path"):
        check_distill_config(no_student)


def test_reverse_kl_over_time_takes_each_teachers_first_and_last_value():
    records = [{"step": 1, "reverse_kl/a": 2.0}, {"step": 1, "eval_accuracy": 0.5}, {"step": 2, "reverse_kl/a": 1.0, "reverse_kl/b": 3.0}]
    assert reverse_kl_over_time(records) == {"a": (2.0, 1.0), "b": (3.0, 3.0)}
