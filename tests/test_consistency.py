"""Learner-vs-rollout consistency figures (learner/consistency.py): the accumulator's exact sums,
maxima, quantiles and masked sides on hand-built tensors; the learner reporting them per task and
turn and warning on the (task, turn) that drifted; a real tiny run writing them to metrics.jsonl and
consistency.png."""

from __future__ import annotations

import asyncio
import json
import warnings

import numpy as np
import pytest
import torch
from conftest import make_tiny_model
from loop_helpers import CoinEnv, run_config, run_in_process

from asyncrl.configs.schema import LearnerConfig
from asyncrl.learner import consistency
from asyncrl.learner.consistency import QUANTILES, ConsistencyStats, LogprobGapWarning
from asyncrl.learner.objectives import double_sided_is_loss, icepop_grpo_loss
from asyncrl.learner.rl import RLLearner, sampled_logprobs
from asyncrl.policy.tokenizer import build_tokenizer
from asyncrl.records import UNSAMPLED_VERSION, Batch, Sample

# -- the accumulator ---------------------------------------------------------------------------


def micro_batch(generator: torch.Generator, rows: int, length: int, objective) -> dict:
    """A hand-built micro-batch: random log-ratios wide enough to leave both sides of the band, turns
    0..2, a few prompt tokens per row, and the objective's own output on them."""
    logp_rollout = -torch.rand(rows, length, generator=generator) * 3
    logp = logp_rollout + torch.randn(rows, length, generator=generator)
    mask = (torch.rand(rows, length, generator=generator) > 0.2).float()
    out = objective(logp, logp_rollout, torch.ones(rows), mask)
    turns = torch.randint(0, 3, (rows, length), generator=generator)
    return {"gap": (logp - logp_rollout).abs(), "ratio": out.ratio, "kept": out.kept, "trainable": mask, "turns": turns}


@pytest.mark.parametrize(
    "objective, below, above",
    [
        (lambda *a: double_sided_is_loss(*a, eps_low=0.2, eps_high=0.28), lambda r: r <= 0.8, lambda r: r >= 1.28),
        (lambda *a: icepop_grpo_loss(*a, beta=2.0), lambda r: r < 0.5, lambda r: r > 2.0),
    ],
    ids=["double_sided_is", "icepop"],
)
def test_the_accumulator_gives_exact_groups_quantiles_and_masked_sides(objective, below, above):
    generator = torch.Generator().manual_seed(0)
    stats = ConsistencyStats()
    flat: dict[str, list] = {"task": [], "turn": [], "gap": [], "ratio": [], "kept": []}
    for rows, length, tasks in [(3, 17, ["add", "tool", "add"]), (2, 40, ["tool", "chat"])]:
        batch = micro_batch(generator, rows, length, objective)
        stats.add(tasks, batch["turns"], batch["gap"], batch["ratio"], batch["kept"], batch["trainable"])
        trainable = batch["trainable"].bool()
        flat["task"] += [tasks[i] for i, _ in trainable.nonzero().tolist()]
        for key in ("turn", "gap", "ratio", "kept"):
            flat[key] += batch["turns" if key == "turn" else key][trainable].tolist()
    task, turn, gap, ratio, kept = (np.array(flat[k]) for k in ("task", "turn", "gap", "ratio", "kept"))
    metrics = stats.metrics()

    assert stats.tokens == len(gap) and metrics["logprob_gap_mean"] == pytest.approx(gap.mean(), rel=1e-6)
    assert metrics["logprob_gap_max"] == pytest.approx(gap.max(), rel=1e-6)
    assert set(metrics["logprob_gap_by_task"]) == {"add", "tool", "chat"}
    for name, figures in metrics["logprob_gap_by_task"].items():
        mine = gap[task == name]
        assert figures == {"mean": pytest.approx(mine.mean(), rel=1e-6), "max": pytest.approx(mine.max(), rel=1e-6), "tokens": len(mine)}
    assert list(metrics["logprob_gap_by_turn"]) == ["0", "1", "2"]
    for name, figures in metrics["logprob_gap_by_turn"].items():
        mine = gap[turn == int(name)]
        assert figures == {"mean": pytest.approx(mine.mean(), rel=1e-6), "max": pytest.approx(mine.max(), rel=1e-6), "tokens": len(mine)}
    for name, q in QUANTILES.items():
        assert metrics[f"ratio_{name}"] == pytest.approx(np.quantile(ratio, q), rel=1e-6)
    # The masked sides are the objective's own decision (its kept complement), split at ratio 1 ...
    assert metrics["masked_below_frac"] == pytest.approx(np.sum(~kept & (ratio < 1)) / len(gap))
    assert metrics["masked_above_frac"] == pytest.approx(np.sum(~kept & (ratio > 1)) / len(gap))
    # ... which are exactly the tokens beyond each edge of its band.
    assert np.sum(~kept & (ratio < 1)) == np.sum(below(ratio)) > 0 and np.sum(~kept & (ratio > 1)) == np.sum(above(ratio)) > 0


def test_an_empty_step_has_no_figures_and_unknown_turns_and_tasks_are_named():
    assert ConsistencyStats().metrics()["logprob_gap_mean"] is None
    assert ConsistencyStats().metrics()["ratio_p50"] is None and ConsistencyStats().over_threshold(0.1) == []
    stats = ConsistencyStats()
    ones = torch.ones(1, 3)
    stats.add([""], torch.tensor([[-1, -1, 4]]), torch.tensor([[0.1, 0.9, 0.3]]), ones, ones.bool(), ones)
    metrics = stats.metrics()
    assert metrics["logprob_gap_by_task"] == {"unknown": {"mean": pytest.approx(1.3 / 3), "max": pytest.approx(0.9), "tokens": 3}}
    assert metrics["logprob_gap_by_turn"]["unknown"] == {"mean": pytest.approx(0.5), "max": pytest.approx(0.9), "tokens": 2}
    assert stats.over_threshold(0.4) == [{"task": "unknown", "turn": None, "gap": pytest.approx(0.5), "tokens": 2}]
    stats.add(["b"], torch.tensor([[10, 2, 2]]), ones, ones, ones.bool(), ones)
    assert list(stats.metrics()["logprob_gap_by_turn"]) == ["unknown", "2", "4", "10"]  # in turn order, not as strings sort
    assert list(stats.metrics()["logprob_gap_by_task"]) == ["b", "unknown"]


def test_more_ratios_than_torch_quantile_takes_are_strided(monkeypatch):
    monkeypatch.setattr(consistency, "QUANTILE_LIMIT", 1000)
    stats, ratios, ones = ConsistencyStats(), torch.rand(2, 2250, generator=torch.Generator().manual_seed(1)) + 0.5, torch.ones(2, 2250)
    stats.add(["a", "b"], torch.zeros(2, 2250, dtype=torch.long), ones, ratios, ones.bool(), ones)
    strided = ratios.flatten().double().numpy()[::5]  # 4500 ratios, stride 5: 900 of them
    assert stats.metrics()["ratio_p90"] == pytest.approx(np.quantile(strided, 0.9), rel=1e-9) and stats.tokens == 4500


# -- the learner -------------------------------------------------------------------------------

PROMPT, FIRST, TOOL, SECOND = [3, 4, 5], [10, 11, 12], [30, 31], [40, 41, 42, 43]


def make_learner(**config) -> RLLearner:
    config = LearnerConfig(**{"group_size": 2, "lr": 1e-3, "weight_decay": 0.0, **config})
    return RLLearner(config, make_tiny_model("qwen3", seed=0), build_tokenizer())


def two_turn_sample(learner: RLLearner, rollout: str, task: str, reward: float, second_turn_offset: float = 0.0) -> Sample:
    """PROMPT + FIRST is turn 0, TOOL + SECOND is turn 1; the rollout log-probs are the policy's own, the
    second turn's lowered by `second_turn_offset` (the engine 'saw' those tokens as less likely)."""
    token_ids = PROMPT + FIRST + TOOL + SECOND
    loss_mask = [0] * len(PROMPT) + [1] * len(FIRST) + [0] * len(TOOL) + [1] * len(SECOND)
    turns = [0] * (len(PROMPT) + len(FIRST)) + [1] * (len(TOOL) + len(SECOND))
    with torch.no_grad():
        logits = learner.model(input_ids=torch.tensor([token_ids])).logits
        own = [0.0, *sampled_logprobs(logits, torch.tensor([token_ids]), 1.0)[0].tolist()]
    logprobs = [lp - (second_turn_offset if turn == 1 else 0.0) if m else 0.0 for lp, m, turn in zip(own, loss_mask, turns, strict=True)]
    versions = [0 if m else UNSAMPLED_VERSION for m in loss_mask]
    return Sample(token_ids, loss_mask, logprobs, versions, reward, f"g-{task}", rollout, "ok", task=task, token_turns=turns)


def batch(learner: RLLearner, offset: float) -> Batch:
    """Two tasks of one group each (rewards differ: both computed), and a zero-advantage group (skipped)."""
    return Batch([
        [two_turn_sample(learner, "a1", "add", 1.0), two_turn_sample(learner, "a2", "add", 0.0)],
        [two_turn_sample(learner, "t1", "tool", 1.0, offset), two_turn_sample(learner, "t2", "tool", 0.0, offset)],
        [two_turn_sample(learner, "s1", "same", 1.0, 5.0), two_turn_sample(learner, "s2", "same", 1.0, 5.0)],
    ])  # fmt: skip


@pytest.mark.usefixtures("one_torch_thread")
def test_the_learner_reports_and_warns_on_the_task_and_turn_that_drifted():
    learner = make_learner()  # IcePop, beta 2: a ratio of e^1.5 is masked above the band
    with pytest.warns(LogprobGapWarning, match=r"task 'tool' turn 1: mean \|learner - rollout\| log-prob 1\.500") as caught:
        step = learner.train_step(batch(learner, 1.5))
    assert len(caught) == 1
    assert step.consistency_warnings == [{"task": "tool", "turn": 1, "gap": pytest.approx(1.5, abs=1e-4), "tokens": 8}]
    metrics = step.metrics
    by_task, by_turn = metrics["logprob_gap_by_task"], metrics["logprob_gap_by_turn"]
    # Only computed rows count: the zero-advantage group ("same", offset 5) never ran through the model.
    assert set(by_task) == {"add", "tool"} and metrics["skipped_zero_adv"] == 2
    assert by_task["add"]["mean"] < 1e-4 and by_task["tool"]["mean"] == pytest.approx(1.5 * 8 / 14, abs=1e-4)
    assert by_turn["0"] == {"mean": pytest.approx(0.0, abs=1e-4), "max": pytest.approx(0.0, abs=1e-4), "tokens": 12}
    assert by_turn["1"]["tokens"] == 16 and by_turn["1"]["max"] == pytest.approx(1.5, abs=1e-4)
    assert metrics["computed_trainable_tokens"] == 28 and metrics["logprob_gap_max"] == pytest.approx(1.5, abs=1e-4)
    assert metrics["masked_above_frac"] == pytest.approx(8 / 28) and metrics["masked_below_frac"] == 0.0
    assert metrics["masked_token_frac"] == pytest.approx(8 / 28) and metrics["abs_logp_diff"] == metrics["logprob_gap_mean"]
    assert metrics["ratio_p01"] == pytest.approx(1.0, abs=1e-4) and metrics["ratio_p99"] == pytest.approx(np.exp(1.5), rel=1e-4)


@pytest.mark.usefixtures("one_torch_thread")
def test_a_gap_below_the_threshold_raises_no_warning_and_the_other_side_is_masked_below():
    learner = make_learner(objective="double_sided_is", logprob_gap_warning=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error", LogprobGapWarning)
        step = learner.train_step(batch(learner, -0.4))  # ratio e^-0.4 = 0.67: below the band, under the threshold
    metrics = step.metrics
    assert step.consistency_warnings == [] and metrics["logprob_gap_by_task"]["tool"]["max"] == pytest.approx(0.4, abs=1e-4)
    assert metrics["masked_below_frac"] == pytest.approx(8 / 28) and metrics["masked_above_frac"] == 0.0


@pytest.mark.usefixtures("one_torch_thread")
def test_micro_batching_does_not_change_the_figures():
    one, many = make_learner(), make_learner(micro_batch_tokens=16)  # 16 tokens: one row per micro-batch
    with pytest.warns(LogprobGapWarning):
        a, b = one.train_step(batch(one, 1.5)).metrics, many.train_step(batch(many, 1.5)).metrics
    assert a["micro_batches"] == 1 and b["micro_batches"] == 4
    for key in ("logprob_gap_by_task", "logprob_gap_by_turn"):
        for name, figures in a[key].items():
            assert b[key][name] == {k: pytest.approx(v, abs=1e-5) for k, v in figures.items()}
    for key in ("ratio_p01", "ratio_p10", "ratio_p50", "ratio_p90", "ratio_p99", "masked_below_frac", "masked_above_frac"):
        assert b[key] == pytest.approx(a[key], abs=1e-5)


# -- a real run --------------------------------------------------------------------------------


def test_a_tiny_run_writes_the_consistency_figures_and_plot(tmp_path):
    config = run_config(tmp_path, "name=c", "loop.mode=sync", "loop.steps=2")
    result = asyncio.run(run_in_process(config, CoinEnv()))
    rundir = result["rundir"]
    steps = [json.loads(line) for line in (rundir.path / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    stepped = [r for r in steps if r["stepped"]]
    assert stepped and all(r["consistency_warnings"] == [] for r in stepped)
    for record in stepped:
        assert 0.0 <= record["logprob_gap_mean"] <= record["logprob_gap_max"] < 0.1  # the learner scores what the engine sampled
        assert record["ratio_p01"] <= record["ratio_p50"] <= record["ratio_p99"]
        assert record["masked_below_frac"] + record["masked_above_frac"] == pytest.approx(record["masked_token_frac"])
        assert record["logprob_gap_by_task"]["coin"]["tokens"] == record["computed_trainable_tokens"]
        assert sum(g["tokens"] for g in record["logprob_gap_by_turn"].values()) == record["computed_trainable_tokens"]
        assert "unknown" not in record["logprob_gap_by_turn"]  # every recorded token knows its turn
    rundir.plot(result["records"])
    assert (rundir.path / "consistency.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
