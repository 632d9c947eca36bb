"""Reward plug-ins through the loader users use (`load_reward`, as `tasks.general.reward` names them):
rule functions, an HTTP reward model served by a real local HTTP server, and an LLM judge served by a
real gateway in front of a scripted tiny model. Failures (timeout, 500, garbage) must end the episode
as env_crash, recorded, with the runner carrying on."""

from __future__ import annotations

import asyncio
import threading
import time
from contextlib import contextmanager

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from gateway_helpers import LiveGateway, make_engine, make_service, scripted_model

from asyncrl.configs.context import EnvContext
from asyncrl.configs.schema import RunConfig
from asyncrl.envs.general import GeneralEnv, Instruction
from asyncrl.envs.registry import load_environment
from asyncrl.envs.rewards import RewardError, RewardNotFound, RewardResult, load_reward, rule
from asyncrl.envs.rewards.judge import UnparseableVerdict, parse_verdict
from asyncrl.jobs.contract import check_environment
from asyncrl.policy.tokenizer import ASSISTANT, EOS

TASK = Instruction(("cat", "sun"), "upper", count=3, banned="dog", ending="!")
MESSAGES = TASK.messages()


@rule
def shouts(prompt_messages, completion_text, task, bonus: float = 0.0) -> float:
    return float(completion_text.isupper()) + bonus


@rule
async def asks_back(prompt_messages, completion_text, task) -> RewardResult:
    return RewardResult(0.25, {"question": completion_text.endswith("?")})


@rule
def broken(prompt_messages, completion_text, task):
    return "high"


class NotAReward:
    def __init__(self) -> None:
        pass


def score(reward, text: str, task=TASK, messages=MESSAGES) -> RewardResult:
    return asyncio.run(reward.score(messages, text, task))


# ---- rules ----


def test_a_rule_function_loads_by_import_path_with_its_options_bound():
    plain = load_reward(f"{__name__}:shouts")
    assert score(plain, "CAT").reward == 1.0 and score(plain, "cat").reward == 0.0
    assert score(load_reward(f"{__name__}:shouts", {"bonus": 0.5}), "cat").reward == 0.5
    assert shouts([], "A", None) == 1.0  # still the plain function
    result = score(load_reward(f"{__name__}:asks_back"), "why?")
    assert (result.reward, result.details) == (0.25, {"question": True})


def test_a_rule_returning_garbage_is_a_reward_error():
    with pytest.raises(RewardError, match="returned 'high'"):
        score(load_reward(f"{__name__}:broken"), "x")


def test_the_constraints_rule_is_the_share_of_constraints_met():
    reward = load_reward("constraints")
    assert score(reward, "CAT SUN CAT!").details == {"failed": [], "correct": True}
    assert score(reward, "CAT SUN CAT!").reward == 1.0
    # words, case, banned met; count (2 words) and ending missed: 3 of 5.
    result = score(reward, "CAT SUN")
    assert result.reward == 3 / 5 and result.details == {"failed": ["count", "ending"], "correct": False}
    with pytest.raises(RewardError, match="needs a task with check"):
        score(reward, "x", task=7)


def test_bad_references_say_what_is_wrong():
    with pytest.raises(RewardNotFound, match="unknown reward 'nope'; known: code_tests, constraints, exact, http, judge, math, regex"):
        load_reward("nope")
    with pytest.raises(RewardNotFound, match="reward 'no_such_module:x': cannot import"):
        load_reward("no_such_module:x")
    with pytest.raises(TypeError, match="lacks an async score"):
        load_reward(f"{__name__}:NotAReward")
    with pytest.raises(ValueError, match="timeout_s"):
        load_reward("http", {"timeout_s": -1}, EnvContext())


def test_a_reward_registered_by_entry_point_is_found_by_name(tmp_path, monkeypatch):
    info = tmp_path / "demo_rewards-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: demo-rewards\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[asyncrl.rewards]\nloud = {__name__}:shouts\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert score(load_reward("loud", {"bonus": 1.0}), "CAT").reward == 2.0


# ---- an HTTP reward model ----


@contextmanager
def serve(app: FastAPI):
    """`app` on a free loopback port, served by uvicorn in a thread; yields its base URL."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=20)


def reward_model_app() -> tuple[FastAPI, list]:
    """A reward model scoring answers by length, plus endpoints that misbehave in each way."""
    app, seen = FastAPI(), []

    @app.post("/score")
    async def score_(request: Request) -> dict:
        body = await request.json()
        seen.append(body)
        return {"reward": len(body["completion"]) / 10, "details": {"chars": len(body["completion"])}}

    @app.post("/slow")
    async def slow() -> dict:
        await asyncio.sleep(3)
        return {"reward": 1.0}

    @app.post("/fail")
    async def fail():
        return PlainTextResponse("model exploded", status_code=500)

    @app.post("/garbage")
    async def garbage():
        return PlainTextResponse("<html>not json</html>")

    @app.post("/no_reward")
    async def no_reward() -> dict:
        return {"score": "high"}

    @app.post("/v1/chat/completions")
    async def slow_judge() -> dict:
        await asyncio.sleep(3)
        return {}

    return app, seen


@pytest.fixture(scope="module")
def reward_server():
    app, seen = reward_model_app()
    with serve(app) as url:
        yield url, seen


def test_the_http_reward_model_gets_the_episode_and_its_score_comes_back(reward_server):
    url, seen = reward_server
    reward = load_reward("http", {"url": f"{url}/score"}, EnvContext())
    result = score(reward, "CAT SUN")
    assert (result.reward, result.details) == (0.7, {"chars": 7})
    assert seen[-1] == {
        "prompt_messages": MESSAGES, "completion": "CAT SUN",
        "task": {"words": ["cat", "sun"], "case": "upper", "count": 3, "banned": "dog", "ending": "!"},
    }  # fmt: skip


def test_the_http_reward_reads_its_settings_from_the_run_config(reward_server):
    url, _ = reward_server
    config = RunConfig.model_validate({"rewards": {"http": {"url": f"{url}/score", "timeout_s": 3}}})
    reward = load_reward("http", {}, EnvContext.of(config))
    assert (reward.config.url, reward.config.timeout_s) == (f"{url}/score", 3.0)
    assert score(reward, "ab").reward == 0.2


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("/slow", "gave no answer within 0.5 s"),
        ("/fail", "answered 500: 'model exploded'"),
        ("/garbage", "answered non-JSON"),
        ("/no_reward", "without a finite 'reward'"),
        ("/missing", "answered 404"),
    ],
)
def test_http_reward_failures_are_clear_reward_errors(reward_server, path, message):
    url, _ = reward_server
    # Only /slow may meet the time limit; every other endpoint answers far inside the default one, however busy the machine.
    timeout = {"timeout_s": 0.5} if path == "/slow" else {}
    with pytest.raises(RewardError, match=message):
        score(load_reward("http", {"url": url + path, **timeout}, EnvContext()), "x")


def test_an_unreachable_reward_service_is_a_reward_error():
    with pytest.raises(RewardError, match="unreachable"):
        score(load_reward("http", {"url": "http://127.0.0.1:9/score"}, EnvContext()), "x")


def test_a_failing_reward_model_ends_episodes_as_env_crash_and_the_runner_carries_on(reward_server):
    url, _ = reward_server
    config = RunConfig.model_validate({"tasks": {"general": {"reward": "http"}}, "rewards": {"http": {"url": f"{url}/fail"}}})
    env = load_environment("general", {}, EnvContext.of(config))
    report = check_environment(env, episodes=3, eval_episodes=2, allowed_statuses=("env_crash",))
    assert [r.status for r in report.results] == ["env_crash"] * 3
    assert all("RewardError" in r.reason and "answered 500" in r.reason for r in report.results)
    assert [t.status for t in report.trajectories] == ["env_crash"] * 3  # recorded, so the learner drops them
    assert report.eval.statuses == {"env_crash": 2} and report.eval.accuracy == 0.0


# ---- an LLM judge ----


def judge_policy(verdict: str):
    return scripted_model([ASSISTANT, *verdict, EOS])


JUDGE_KEY_ENV = "ASYNCRL_TEST_JUDGE_KEY"


@contextmanager
def served_judge(verdict: str, tmp_path, monkeypatch):
    """A real gateway in front of a tiny model that always writes `verdict`, as a judge's base URL; an
    `asyncrl serve` judge takes a rollout key, put in the environment variable the config names."""
    from asyncrl.gateway.store import open_store

    engine = make_engine("judge", judge_policy(verdict))
    try:
        # As `asyncrl serve` serves it: the judge samples at its own temperature.
        with LiveGateway(make_service(open_store(tmp_path), [engine], sampling_overrides="allow")) as gateway:
            _, key = gateway.open(task="judge")
            monkeypatch.setenv(JUDGE_KEY_ENV, key)
            yield f"{gateway.url}/v1"
    finally:
        engine.shutdown()


def judge(base_url: str, **options):
    return load_reward("judge", {"base_url": base_url, "api_key_env": JUDGE_KEY_ENV, **options}, EnvContext())


def test_the_judge_scores_through_a_served_model(tmp_path, monkeypatch):
    with served_judge("score: 7", tmp_path, monkeypatch) as url:
        reward = judge(url)
        result = score(reward, "CAT SUN CAT!")
        assert result.reward == pytest.approx(0.7)
        assert result.details == {"judge_score": 7.0, "verdict": "score: 7"}
        assert "Instruction: Use cat sun. 3 words. Caps. No dog. End with !" in reward.prompt(MESSAGES, "CAT")
        # On the judge's own scale: a 0..7 judge saying 7 gives full reward.
        assert score(judge(url, max_score=7), "x").reward == 1.0


def test_the_judge_trains_the_general_task_through_the_runner(tmp_path, monkeypatch):
    with served_judge("score: 7", tmp_path, monkeypatch) as url:
        config = RunConfig.model_validate(
            {"tasks": {"general": {"reward": "judge"}}, "rewards": {"judge": {"base_url": url, "api_key_env": JUDGE_KEY_ENV}}}
        )
        env = load_environment("general", {}, EnvContext.of(config))
        report = check_environment(env, episodes=3, eval_episodes=2)
    assert [r.reward for r in report.results] == pytest.approx([0.7] * 3)
    assert all(r.metrics["reward_details"]["judge_score"] == 7.0 for r in report.results)


def test_an_unparseable_verdict_ends_the_episode_as_env_crash(tmp_path, monkeypatch):
    with served_judge("fine", tmp_path, monkeypatch) as url:
        with pytest.raises(UnparseableVerdict, match="no score in \\[0, 10\\]: 'fine'"):
            score(judge(url), "x")
        env = GeneralEnv(reward=judge(url))
        report = check_environment(env, episodes=2, eval_episodes=0, allowed_statuses=("env_crash",))
    assert [t.status for t in report.trajectories] == ["env_crash"] * 2
    assert all("UnparseableVerdict" in r.reason and "'fine'" in r.reason for r in report.results)


def test_a_judge_that_times_out_or_is_gone_is_a_reward_error(reward_server, monkeypatch):
    url, _ = reward_server
    monkeypatch.setenv(JUDGE_KEY_ENV, "k")
    with pytest.raises(RewardError, match=r"gave no verdict within 0\.5 s"):
        score(judge(f"{url}/v1", timeout_s=0.5), "x")
    with pytest.raises(RewardError, match=r"judge at http://127\.0\.0\.1:9/v1 failed: APIConnectionError"):
        score(judge("http://127.0.0.1:9/v1"), "x")


def test_parse_verdict_reads_the_last_score_on_the_scale():
    assert parse_verdict("score: 7", 10) == 7.0
    assert parse_verdict("Constraints met. Score = 3/10", 10) == 3.0
    assert parse_verdict("score: 4, no wait, SCORE:9", 10) == 9.0
    assert parse_verdict(" 8.5 ", 10) == 8.5
    assert parse_verdict("score: 0", 10) == 0.0
    for garbage in ("great answer", "", "score: eleven", "score: 11", "score: -1", "7 out of 10"):
        assert parse_verdict(garbage, 10) is None, garbage
