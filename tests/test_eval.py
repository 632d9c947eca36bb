"""`asyncrl eval`: the pass@k estimator and its interval, sampled evaluation rollouts, and the command on a
checkpoint, a run directory and an OpenAI-compatible URL (the same greedy figures by both paths)."""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
from math import comb

import pytest
import torch

from asyncrl.cli import main
from asyncrl.configs import load_config
from asyncrl.envs.base import EpisodeResult
from asyncrl.envs.evaluation import tally
from asyncrl.envs.pass_at_k import mean_and_interval, pass_at_k, per_problem
from asyncrl.jobs.evaluate import Plan, Target, evaluate_target
from asyncrl.policy.checkpoint import build_policy, save_policy

OVERRIDES = ["eval.num_problems=12", "policy.tiny.arch=qwen3", "rollout.torch_threads=1"]


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_is_the_chance_that_k_of_the_n_samples_hold_a_success(n):
    for c, k in itertools.product(range(n + 1), range(1, n + 1)):
        samples = [1] * c + [0] * (n - c)
        subsets = list(itertools.combinations(samples, k))
        exact = sum(any(subset) for subset in subsets) / len(subsets)
        assert pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12)
        assert len(subsets) == comb(n, k)
    with pytest.raises(ValueError, match="needs 1 <= k <= n"):
        pass_at_k(n, 0, n + 1)


def test_interval_brackets_the_mean_narrows_with_problems_and_is_reproducible():
    few = per_problem([1, 0, 1, 1, 0, 0, 1, 0], 1, 1)
    mean, low, high = mean_and_interval(few)
    assert mean == 0.5 and low < 0.5 < high and mean_and_interval(few) == (mean, low, high)
    many = per_problem([1, 0, 1, 1, 0, 0, 1, 0] * 50, 1, 1)
    _, low_many, high_many = mean_and_interval(many)
    assert high_many - low_many < (high - low) / 4  # ~1/sqrt(50) as wide
    assert mean_and_interval(per_problem([3, 3], 3, 1)) == (1.0, 1.0, 1.0)


def test_tally_counts_each_problems_successes_in_order():
    def result(correct: bool, status: str = "ok") -> EpisodeResult:
        return EpisodeResult(1.0 if correct else 0.0, status, metrics={"correct": correct})

    results = [result(True), result(False), result(False), result(True, "timeout"), result(True), result(True)]
    evaluation = tally(results, 2, 1.0)
    assert evaluation.successes == [1, 0, 2] and evaluation.num_problems == 3 and evaluation.statuses == {"ok": 5, "timeout": 1}
    assert evaluation.pass_at(1)[0] == pytest.approx((0.5 + 0 + 1) / 3) and evaluation.pass_at(2)[0] == pytest.approx(2 / 3)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    config = load_config("quickstart", OVERRIDES)
    model, tokenizer, _ = build_policy(config.policy, seed=0)
    directory = tmp_path_factory.mktemp("ckpt") / "policy"
    save_policy(directory, model, tokenizer, None)
    return directory


def test_greedy_is_one_answer_per_problem_and_sampled_evaluation_samples(checkpoint):
    config = load_config("quickstart", [*OVERRIDES, "rollout.sampling.temperature=1.0"])
    (row,) = evaluate_target(config, Target(checkpoints={"c": checkpoint}), Plan(samples=4, ks=[1, 4]), say=lambda _: None).values()
    (figures,) = row.values()
    assert figures["problems"] == 12 and figures["samples"] == 4 and figures["statuses"] == {"ok": 12}
    assert figures["pass@4"][0] >= figures["pass@1"][0]
    # The sampled rollouts really sample: the gateway's greedy rule for evaluation rollouts does not reach them.
    replies = _replies(checkpoint, config, sampled=True) | _replies(checkpoint, config, sampled=True)
    assert len(replies) > 1 and len(_replies(checkpoint, config, sampled=False) | _replies(checkpoint, config, sampled=False)) == 1


def _replies(checkpoint, config, *, sampled: bool) -> set[str]:
    from transformers import AutoTokenizer

    from asyncrl.gateway.engines import LocalEngine
    from asyncrl.gateway.serving import evaluation_gateway
    from asyncrl.rollout.engine import EmbeddedEngine

    async def ask(engine, tokenizer) -> set[str]:
        async with evaluation_gateway(config, [LocalEngine(engine)], tokenizer) as gateway:
            rollout = await gateway.open_rollout("t", evaluation=True, sampled=sampled)
            client = rollout.async_openai(max_retries=0, timeout=60)
            body = {"model": "policy", "messages": [{"role": "user", "content": "12+34"}], "max_tokens": 12, "temperature": 1.0}
            replies = {
                (await client.post("/chat/completions", cast_to=object, body=body))["choices"][0]["message"]["content"] for _ in range(4)
            }
            await client.close()
            return replies

    engine = EmbeddedEngine.from_pretrained(str(checkpoint), config.rollout.embedded())
    try:
        return asyncio.run(ask(engine, AutoTokenizer.from_pretrained(str(checkpoint))))
    finally:
        engine.shutdown()


def test_a_url_and_the_checkpoint_behind_it_give_the_same_greedy_figures(checkpoint):
    """The URL path (the OpenAI client straight to a server) against the in-process path, one policy."""
    from transformers import AutoTokenizer

    from asyncrl.gateway.engines import LocalEngine
    from asyncrl.gateway.serving import evaluation_gateway
    from asyncrl.rollout.engine import EmbeddedEngine

    config = load_config("quickstart", OVERRIDES)
    (direct,) = evaluate_target(config, Target(checkpoints={"c": checkpoint}), Plan(), say=lambda _: None).values()
    engine = EmbeddedEngine.from_pretrained(str(checkpoint), config.rollout.embedded())
    served, done = {}, threading.Event()

    # Served as a server that samples as each request asks (the URL path asks for temperature 0).
    server_config = load_config("quickstart", [*OVERRIDES, "gateway.sampling_overrides=allow"])

    async def serve():
        async with evaluation_gateway(server_config, [LocalEngine(engine)], AutoTokenizer.from_pretrained(str(checkpoint))) as gateway:
            served["rollout"] = await gateway.open_rollout("url", evaluation=True)
            while not done.is_set():
                await asyncio.sleep(0.05)

    server = threading.Thread(target=asyncio.run, args=(serve(),), daemon=True)
    server.start()
    try:
        while "rollout" not in served:
            assert server.is_alive(), "the gateway did not start"
            server.join(0.05)
        rollout = served["rollout"]
        (by_url,) = evaluate_target(config, Target(url=rollout.base_url, api_key=rollout.api_key), Plan(), say=lambda _: None).values()
    finally:
        done.set()
        server.join(60)
        engine.shutdown()
    assert by_url == direct


def test_the_command_on_a_run_directory_evaluates_each_checkpoint_and_writes_json_and_plot(checkpoint, tmp_path, capsys):
    run = tmp_path / "run"
    for version in (10, 20):
        step = run / "checkpoints" / f"step-{version}"
        save_policy(step, *build_policy(load_config("quickstart", OVERRIDES).policy, seed=version)[:2], None)
        (step / "loop_state.json").write_text(json.dumps({"version": version}))
    (run / "config.yaml").write_text(load_config("quickstart", [*OVERRIDES, f"policy.path={checkpoint}"]).model_dump_json())
    assert main(["eval", str(run), "eval.num_problems=8", "--samples", "2"]) == 0
    report = json.loads((run / "eval.json").read_text())
    assert list(report["rows"]) == ["start", "step 10", "step 20"] and report["ks"] == [1, 2]
    assert main(["eval", str(run), "eval.num_problems=8", "--last", "1", "--json", str(tmp_path / "last.json")]) == 0
    assert list(json.loads((tmp_path / "last.json").read_text())["rows"]) == ["step 20"]
    assert (run / "eval.png").stat().st_size > 0 and "greedy_pass@1" in capsys.readouterr().out
    assert main(["eval", str(tmp_path / "nothing")]) == 2
    assert main(["eval", str(checkpoint)]) == 2  # a checkpoint needs a config naming the tasks
    assert "give a CONFIG" in capsys.readouterr().err
    assert main(["eval", str(checkpoint), "quickstart", "--samples", "2", "--k", "4"]) == 2
    assert main(["eval", str(checkpoint), "quickstart", "--samples", "2", "--k", "one"]) == 2
    assert "--k takes whole numbers" in capsys.readouterr().err
    assert torch.get_num_threads() >= 1


def test_the_loop_records_each_tasks_interval_and_how_long_training_waited():
    from types import SimpleNamespace

    from asyncrl.sched.evaluation import record_evaluation

    records, lines = [], []
    parts = SimpleNamespace(metrics=SimpleNamespace(record=records.append), display=SimpleNamespace(say=lines.append))
    solved = [EpisodeResult(1.0, "ok", metrics={"correct": i % 4 == 0}) for i in range(200)]
    accuracy = record_evaluation(parts, {"sums": tally(solved, 1, 80.0)}, 10, 400.0, wall_s=80.0)
    (record,) = records
    low, high = record["eval_interval/sums"]
    assert accuracy == record["eval_accuracy"] == 0.25 and low < 0.25 < high and high - low < 0.15
    assert record["eval_wall_s"] == 80.0 and "training waited 80 s" in lines[0] and "sums 25.0% [" in lines[0]
    assert record["eval_failed/sums"] == 0 and "failed" not in lines[0] and record["eval_engine"] == "shared"


def test_episodes_that_failed_are_counted_and_said_with_the_first_reason():
    from types import SimpleNamespace

    from asyncrl.sched.evaluation import record_evaluation

    records, lines = [], []
    parts = SimpleNamespace(metrics=SimpleNamespace(record=records.append), display=SimpleNamespace(say=lines.append))
    results = [EpisodeResult(1.0, "ok", metrics={"correct": True}) for _ in range(3)]
    results += [EpisodeResult(0.0, "error", reason="engine eval-0 left the gateway (heartbeat timeout)") for _ in range(5)]
    assert record_evaluation(parts, {"tool": tally(results, 1, 9.0)}, 4, 100.0, wall_s=9.0, aside=True) == 3 / 8
    assert records[0]["eval_failed/tool"] == 5 and records[0]["eval_engine"] == "own"
    assert "(5 tool episodes failed and scored 0; error: engine eval-0 left the gateway (heartbeat timeout))" in lines[0]
    assert "on its own engine in 9 s; training went on" in lines[0]


def test_sampled_without_evaluation_is_a_clear_refusal():
    from pydantic import ValidationError

    from asyncrl.gateway.api import OpenRolloutRequest

    assert OpenRolloutRequest(evaluation=True, sampled=True).sampled
    with pytest.raises(ValidationError, match="sampled applies to evaluation rollouts only"):
        OpenRolloutRequest(sampled=True)
