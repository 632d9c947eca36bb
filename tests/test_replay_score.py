"""`asyncrl replay score` on a real recorded run: the tiny policy's own loop, three learner steps, every
checkpoint kept, a two-turn environment whose turns are sampled at two temperatures."""

from __future__ import annotations

import asyncio
import hashlib
import json

import pytest
import torch
from loop_helpers import run_config, run_in_process
from rich.console import Console
from transformers import AutoModelForCausalLM

from asyncrl import cli
from asyncrl.configs.objectives import IcepopGRPOObjective
from asyncrl.envs.base import EpisodeResult
from asyncrl.learner.objectives import double_sided_is_loss, icepop_grpo_loss
from asyncrl.learner.rl import sampled_logprobs
from asyncrl.policy.checkpoint import build_policy, save_policy
from asyncrl.replay import rescore as rescore_module
from asyncrl.replay.rescore import Series, rescore
from asyncrl.replay.run import RunView, Selection
from asyncrl.replay.score import PolicyLoader
from asyncrl.replay.terminal import colored_text, render
from asyncrl.samples import trajectory_to_samples

TEMPERATURES = (0.7, 1.3)
RUN = ["loop.mode=sync", "gateway.sampling_overrides=allow", "loop.wall_budget_s=120"]
"""Every turn sampled under one policy version (an async run pushes weights mid-turn, see below); agents may
pick their temperature; a broken run ends instead of hanging the test."""


class TwoTurnEnv:
    """Asks twice in one conversation, the turns at two temperatures; rewards the parity of the second reply."""

    name = "twoturn"

    def sample_task(self, rng, split="train") -> int:
        return rng.randrange(1_000_000)

    async def run_episode(self, task: int, client) -> EpisodeResult:
        messages = [{"role": "user", "content": str(task)}]
        first = await client.chat.completions.create(model="policy", messages=messages, max_tokens=4, temperature=TEMPERATURES[0])
        messages += [{"role": "assistant", "content": first.choices[0].message.content or ""}, {"role": "user", "content": "again"}]
        second = await client.chat.completions.create(model="policy", messages=messages, max_tokens=4, temperature=TEMPERATURES[1])
        return EpisodeResult(reward=float(sum(map(ord, second.choices[0].message.content or "")) % 2))


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    config = run_config(tmp_path_factory.mktemp("replay"), "name=replayed", "learner.checkpoint_every=1", "loop.steps=3", *RUN)
    result = asyncio.run(run_in_process(config, TwoTurnEnv()))
    return result["rundir"].path


@pytest.fixture(scope="module")
def store_fingerprint(run_dir):
    """The store's content hash and mtime, taken before any test reads it."""
    return _fingerprint(run_dir)


def _fingerprint(run_dir) -> tuple[str, int]:
    path = run_dir / "trajectories.db"
    return hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_mtime_ns


def _score(view: RunView, trajectories, series):
    loader = PolicyLoader(view)
    return rescore(view, trajectories, series, loader.scorer, loader.tokenizer)


def _sampled(scores):
    return [t for s in scores for t in s.tokens if t.sampled]


def test_the_sampling_checkpoint_reproduces_the_engines_own_logprobs(run_dir, store_fingerprint):
    with RunView.open(run_dir) as view:
        trajectories = view.select(Selection())
        series = [Series(ref.label, ref) for ref in view.checkpoints()] + [Series("nearest", None)]
        scores = _score(view, trajectories, series)
        label_of = {ref.version: ref.label for ref in view.checkpoints()}
    # In an async run a weight push in the middle of a turn leaves the tokens after it (and the next turn,
    # whose prompt reuses that turn's K/V as a retained prefix) conditioned on K/V the older weights computed,
    # which no single checkpoint reproduces: replay shows them drifting. This run is sync: every token matches.
    tokens = _sampled(scores)
    assert len({t.version for t in tokens}) >= 2, "the run should sample under several versions"
    for token in tokens:
        assert token.nearest_version == token.version
        assert abs(token.logprobs[label_of[token.version]] - token.rollout_logprob) < 1e-4, token
        assert token.logprobs["nearest"] == token.logprobs[label_of[token.version]]
    # Both temperatures were scored at their own: the log-probs above would not match otherwise.
    assert {t.temperature for t in tokens} == set(TEMPERATURES)


def test_a_later_checkpoint_gives_the_learners_ratios(run_dir):
    with RunView.open(run_dir) as view:
        trajectories = [t for t in view.select(Selection()) if {v for turn in t.turns for v in turn.versions} == {0}]
        final = view.final_checkpoint()
        assert final.version >= 2
        scores = _score(view, trajectories, [Series("final", final)])
        model = AutoModelForCausalLM.from_pretrained(str(final.path), dtype=torch.float32).eval()
        samples = {(s.rollout_id, s.branch): s for t in trajectories for s in trajectory_to_samples(t)}
        deviations = []
        for score in scores:
            sample = samples[(score.rollout_id, score.branch)]
            ids = torch.tensor([sample.token_ids])
            temperatures = torch.tensor([sample.scoring_temperatures(1.0)], dtype=torch.float32)
            with torch.no_grad():
                logp = sampled_logprobs(model(ids).logits, ids, temperatures[:, 1:])[0]
            for token in score.tokens:
                if token.sampled:
                    expected = float(torch.exp(logp[token.position - 1] - token.rollout_logprob))
                    assert abs(token.ratios["final"] - expected) < 1e-4 * max(1.0, expected)
                    deviations.append(abs(expected - 1.0))
        assert max(deviations) > 0.05, "three steps at lr 1e-2 should move the policy measurably"


def test_decisions_are_the_learners_functions_on_the_same_tensors(run_dir):
    with RunView.open(run_dir) as view:
        learner = view.config.learner.model_copy(update={"objective": IcepopGRPOObjective(eps_low=0.05, eps_high=0.05, beta=1.3)})
        view.config = view.config.model_copy(update={"learner": learner})
        tokens = _sampled(_score(view, view.select(Selection()), [Series("final", view.final_checkpoint())]))
    logp = torch.tensor([[t.logprobs["final"] for t in tokens]], dtype=torch.float32)
    rollout = torch.tensor([[t.rollout_logprob for t in tokens]], dtype=torch.float32)
    mask, advantages = torch.ones_like(logp), torch.zeros(1)
    outputs = {
        "double_sided_is": double_sided_is_loss(logp, rollout, advantages, mask, eps_low=0.05, eps_high=0.05),
        "icepop_grpo": icepop_grpo_loss(logp, rollout, advantages, mask, eps_low=0.05, eps_high=0.05, beta=1.3),
    }
    for objective, out in outputs.items():
        expected = [
            "kept" if k else ("below" if r < 1 else "above") for k, r in zip(out.kept[0].tolist(), out.ratio[0].tolist(), strict=True)
        ]
        assert [t.decisions["final"][objective] for t in tokens] == expected
        assert {"kept", "below", "above"} <= set(expected) or objective == "icepop_grpo"
    assert {"below", "above"} <= {t.decisions["final"]["icepop_grpo"] for t in tokens}


def test_the_cli_writes_json_lines_and_leaves_the_store_alone(run_dir, store_fingerprint, tmp_path, capsys):
    out = tmp_path / "scores.jsonl"
    assert cli.main(["replay", "score", str(run_dir), "--json", str(out), "--limit", "4"]) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) >= 4
    assert {c["label"] for c in lines[0]["checkpoints"]} == {"nearest", "final"}
    sampled = [t for t in lines[0]["tokens"] if t["sampled"]]
    assert sampled and set(sampled[0]["decisions"]["final"]) == {"double_sided_is", "icepop_grpo"}
    assert len({line["rollout_id"] for line in lines}) == 4
    assert "rollout " + lines[0]["rollout_id"] in capsys.readouterr().out  # the terminal view
    assert _fingerprint(run_dir) == store_fingerprint


def test_the_cli_writes_the_html_report(run_dir, store_fingerprint, tmp_path):
    pytest.importorskip("asyncrl.replay.html")
    page = tmp_path / "report.html"
    assert cli.main(["replay", "score", str(run_dir), "--limit", "2", "--html", str(page), "--quiet"]) == 0
    with RunView.open(run_dir) as view:
        first = view.select(Selection(limit=1))[0].rollout_id
    assert first in page.read_text()
    assert _fingerprint(run_dir) == store_fingerprint


def test_an_unknown_rollout_lists_those_that_exist(run_dir, store_fingerprint, capsys):
    with RunView.open(run_dir) as view:
        some = view.select(Selection(limit=1))[0].rollout_id
    assert cli.main(["replay", "score", str(run_dir), "--rollout", "nope"]) == 1
    error = capsys.readouterr().err
    assert "no rollout 'nope'" in error and some in error
    assert _fingerprint(run_dir) == store_fingerprint


def test_a_checkpoint_of_another_shape_or_tokenizer_is_refused_before_scoring(run_dir, store_fingerprint, tmp_path, capsys, monkeypatch):
    with RunView.open(run_dir) as view:
        policy = view.config.policy.model_copy(update={"tiny": view.config.policy.tiny.model_copy(update={"hidden_size": 64})})
        seed = view.config.seed
    model, tokenizer, _ = build_policy(policy, seed)
    other = save_policy(tmp_path / "other", model, tokenizer)

    def never(*args, **kwargs):
        raise AssertionError("scored with a checkpoint that should have been refused")

    monkeypatch.setattr(rescore_module, "rescore", never)
    assert cli.main(["replay", "score", str(run_dir), "--checkpoint", str(other), "--limit", "1"]) == 1
    error = capsys.readouterr().err
    assert "does not fit the run's policy" in error and "hidden_size 64 (the run's: 32)" in error
    swapped = save_policy(tmp_path / "swapped", *build_policy(view.config.policy, seed)[:2])
    spec = json.loads((swapped / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    (swapped / "tokenizer.json").write_text(json.dumps(spec))
    assert cli.main(["replay", "score", str(run_dir), "--checkpoint", "final", str(swapped), "--limit", "1"]) == 1
    error = capsys.readouterr().err
    assert "tokenizer maps 2 ids to other tokens" in error and "hidden_size" not in error
    assert cli.main(["replay", "score", str(run_dir), "--checkpoint", "v9", "--limit", "1"]) == 1
    assert "no checkpoint of version 9" in capsys.readouterr().err
    assert _fingerprint(run_dir) == store_fingerprint


def test_a_step_scores_the_rollouts_it_trained(run_dir, tmp_path):
    if not (run_dir / "batches").is_dir():
        pytest.skip("this loop does not record learner batches yet (loop.record_batches)")
    with RunView.open(run_dir) as view:
        step = view.rundir.batch_steps()[0]
        trained = {rid for group in view.batch(step).groups for rid in group}
        started_from = view.batch(step).learner_version
    out = tmp_path / "step.jsonl"
    assert cli.main(["replay", "score", str(run_dir), "--step", str(step), "--json", str(out), "--quiet"]) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines and {line["rollout_id"] for line in lines} == trained
    for line in lines:
        assert line["account"] == "trained"
        # Staleness is counted to the version the training step started from, as its selection counted it.
        assert all(t["staleness"] == started_from - t["version"] for t in line["tokens"] if t["sampled"])


def test_advantages_are_recomputed_from_the_recorded_groups(run_dir):
    with RunView.open(run_dir) as view:
        scores = _score(view, view.select(Selection()), [Series("final", view.final_checkpoint())])
        normalize = view.config.learner.normalize_adv_std
    groups: dict[str, list] = {}
    for score in scores:
        groups.setdefault(score.group_id, []).append(score)
    assert len(groups) >= 3
    for members in groups.values():
        rewards = torch.tensor([m.reward for m in members], dtype=torch.float64)
        centered = rewards - rewards.mean()
        expected = centered / (centered.pow(2).mean().sqrt() + 1e-6) if normalize else centered
        if len(set(rewards.tolist())) == 1:
            expected = torch.zeros_like(rewards)
        assert [m.advantage for m in members] == pytest.approx(expected.tolist(), abs=1e-5)


def test_the_terminal_view_shows_every_token_coloured_and_the_turns(run_dir):
    with RunView.open(run_dir) as view:
        scores = _score(view, view.select(Selection(limit=1)), [Series("nearest", None), Series("final", view.final_checkpoint())])
    score = scores[0]
    text = colored_text(score.tokens, "final")
    assert text.plain == "".join(t.text.replace("\n", "⏎\n") if t.sampled else t.text for t in score.tokens)
    styles = {str(span.style) for span in text.spans}
    assert "dim" in styles and styles - {"dim"}, "sampled tokens are coloured, the rest dimmed"
    console = Console(record=True, width=100)
    render(scores, console)
    shown = console.export_text()
    assert score.rollout_id in shown and "per turn" in shown and "tokens that drifted most" in shown
    assert len(score.turns) == 2 and all(turn.sampled_tokens > 0 for turn in score.turns)
