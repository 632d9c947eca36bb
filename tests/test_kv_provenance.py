"""KV provenance per token (issue 36): for each sampled token, the oldest policy version among the KV it attended
to, from the engine's result through the gateway's recording (whole calls, streams, a stream its client left,
engines in process and over HTTP) into the real Redis store, samples, the learner's staleness rule
(`learner.staleness_by`) and replay; misaligned records refused, records written before the field load."""

from __future__ import annotations

import json
import time
import uuid
from types import SimpleNamespace

import httpx
import pytest
from conftest import REDIS_URL, make_tiny_model, redis_or_skip
from gateway_helpers import KV_REPLY, KV_VERSIONS, SAMPLED_BY, EngineServer, KVEngine, LiveGateway, make_service
from rich.console import Console

from asyncrl.configs.schema import LearnerConfig
from asyncrl.gateway.engines import HttpEngine, LocalEngine
from asyncrl.gateway.store import open_store
from asyncrl.gateway.store.base import turn_json
from asyncrl.learner.rl import RLLearner
from asyncrl.learner.selection import select
from asyncrl.policy.tokenizer import build_tokenizer
from asyncrl.records import UNSAMPLED_VERSION, Account, Sample, TokenDelta, Trajectory, Turn
from asyncrl.replay.records import RolloutScore
from asyncrl.replay.rescore import OBJECTIVES, _Item, _report, _Texts
from asyncrl.replay.terminal import render_one
from asyncrl.samples import batch_of, trajectory_to_samples

USER = [{"role": "user", "content": "weather?"}]
WAIT_S = 60.0


@pytest.fixture
def redis_store():
    """A RedisStore in a namespace of its own on the real server, deleted afterwards."""
    client = redis_or_skip()
    namespace = f"test-kv-{uuid.uuid4().hex}"
    store = open_store(REDIS_URL, namespace=namespace)
    yield store
    store.close()
    keys = list(client.scan_iter(match=f"asyncrl:{namespace}:*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()


def _turn(rollout_id: str, prompt: list[int], completion: list[int], versions: list[int], kv_versions: list[int] | None) -> Turn:
    return Turn(rollout_id, prompt, completion, [-0.5] * len(completion), versions, kv_versions=kv_versions)


def _trajectory(rollout_id: str, group_id: str, reward: float, turns: list[Turn]) -> Trajectory:
    for index, turn in enumerate(turns):
        turn.index = index
    return Trajectory(rollout_id, task="t", group_id=group_id, turns=turns, status="ok", reward=reward)


# -- records ------------------------------------------------------------------------------------


def test_a_turn_refuses_kv_versions_not_aligned_with_its_tokens() -> None:
    with pytest.raises(ValueError, match=r"turn of rollout 'r': 2 completion tokens but 1 kv_versions; they must be aligned"):
        _turn("r", [1], [2, 3], [0, 0], [0])
    assert _turn("r", [1], [2, 3], [4, 4], [3, 4]).kv_versions == [3, 4]


def test_selection_refuses_a_sample_whose_kv_versions_are_not_aligned_with_its_tokens() -> None:
    sample = Sample([1, 2, 3], [0, 1, 1], [0.0, -1.0, -1.0], [-1, 4, 4], 1.0, "g", "r", "ok", kv_versions=[3, 4])
    with pytest.raises(ValueError, match=r"sample of rollout 'r': 3 tokens but 2 kv_versions; they must be aligned with token_ids"):
        select([[sample]], current_version=4, max_staleness=1, group_size=1, staleness_by="kv")
    # Under "sampled" the learner does not read them.
    assert select([[sample]], current_version=4, max_staleness=1, group_size=1).accounts == {"r": Account.TRAINED}


def test_deltas_keep_kv_versions_only_while_every_part_of_a_stream_carries_them() -> None:
    joined = TokenDelta([], [], [])
    joined.extend(TokenDelta([5], [-0.1], [7], kv_versions=[5]))
    joined.extend(TokenDelta([6, 8], [-0.2, -0.3], [7, 7], kv_versions=[6, 7]))
    assert (joined.token_ids, joined.versions, joined.kv_versions) == ([5, 6, 8], [7, 7, 7], [5, 6, 7])
    joined.extend(TokenDelta([9], [-0.4], [7]))  # a part without provenance: the whole stream has none
    assert (joined.token_ids, joined.kv_versions) == ([5, 6, 8, 9], None)
    joined.extend(TokenDelta([10], [-0.5], [7], kv_versions=[7]))
    assert joined.kv_versions is None  # not [7]: that would misalign it with the tokens


# -- the store ----------------------------------------------------------------------------------


def test_kv_versions_round_trip_through_redis_and_turns_stored_before_them_load_without(redis_store) -> None:
    rollout_id = redis_store.open("t", "g")
    recorded = _turn(rollout_id, [1, 2], [3, 4, 5], [7, 7, 7], [5, 6, 7])
    redis_store.append(recorded)
    # A turn as a gateway from before the field stored it: the same JSON without the key.
    old = json.loads(turn_json(_turn(rollout_id, [1, 2, 3, 4, 5, 9], [6], [7], None)))
    del old["kv_versions"]
    redis_store._r.rpush(redis_store._turns(rollout_id), json.dumps(old))
    first, second = redis_store.get(rollout_id).turns
    assert (first.kv_versions, first.versions, first.logprobs) == ([5, 6, 7], [7, 7, 7], [-0.5] * 3)
    assert (second.index, second.completion_token_ids, second.kv_versions) == (1, [6], None)


# -- the gateway's recording --------------------------------------------------------------------


def _gateway(store, engine: KVEngine, transport: str):
    """A live gateway over `store` whose one engine is `engine`, in process or behind `engine_app` over HTTP
    (the result and every delta then cross a JSON round trip)."""
    if transport == "local":
        return LiveGateway(make_service(store, [LocalEngine(engine)])), None
    server = EngineServer(engine)
    url = server.start()
    return LiveGateway(make_service(store, [HttpEngine(url, engine.engine_id)])), server


@pytest.mark.parametrize("transport", ["local", "http"])
def test_the_gateway_records_kv_versions_of_whole_and_streamed_calls_in_redis(redis_store, transport) -> None:
    live, server = _gateway(redis_store, KVEngine(), transport)
    try:
        with live as gateway:
            rollout_id, key = gateway.open()
            headers = {"Authorization": f"Bearer {key}"}
            answer = gateway.http.post("/v1/tokens/generate", json={"prompt_token_ids": [5, 6]}, headers=headers).json()
            assert (answer["versions"], answer["kv_versions"]) == ([SAMPLED_BY] * len(KV_REPLY), KV_VERSIONS)
            client = gateway.openai(key)
            client.chat.completions.create(model="policy", messages=USER)
            list(client.chat.completions.create(model="policy", messages=USER, stream=True))
            turns = redis_store.get(rollout_id).turns
    finally:
        if server is not None:
            server.stop()
    assert [turn.kv_versions for turn in turns] == [KV_VERSIONS] * 3
    assert [turn.completion_token_ids for turn in turns] == [KV_REPLY] * 3


def test_a_stream_its_client_left_keeps_the_kv_versions_of_the_tokens_it_sampled(redis_store) -> None:
    engine = KVEngine(hold=3)
    live, _ = _gateway(redis_store, engine, "local")
    with live as gateway:
        rollout_id, key = gateway.open()
        body = {"messages": USER, "stream": True}
        with httpx.stream("POST", gateway.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as response:
            for line in response.iter_lines():
                if '"content":"' in line and '"content":""' not in line:
                    break  # tokens arrived; the client leaves while the engine holds the rest
        assert engine.closed.wait(WAIT_S), "the engine request was not aborted"
        deadline = time.monotonic() + WAIT_S
        while not redis_store.get(rollout_id).turns:
            assert time.monotonic() < deadline, "the truncated turn was never recorded"
            time.sleep(0.01)
    (turn,) = redis_store.get(rollout_id).turns
    assert (turn.finish_reason, turn.completion_token_ids, turn.kv_versions) == ("abort", KV_REPLY[:3], KV_VERSIONS[:3])


def test_an_engine_that_records_no_kv_versions_gives_turns_without_them(tmp_path) -> None:
    live, _ = _gateway(open_store(tmp_path / "run.db"), KVEngine(records_kv=False), "local")
    with live as gateway:
        rollout_id, key = gateway.open()
        client = gateway.openai(key)
        client.chat.completions.create(model="policy", messages=USER)
        list(client.chat.completions.create(model="policy", messages=USER, stream=True))
        answer = gateway.http.post("/v1/tokens/generate", json={"prompt_token_ids": [5]}, headers={"Authorization": f"Bearer {key}"})
        assert answer.json()["kv_versions"] is None
        assert [turn.kv_versions for turn in gateway.service.store.get(rollout_id).turns] == [None] * 3


# -- samples, selection, the learner, replay ----------------------------------------------------


def test_samples_carry_kv_versions_and_turns_without_them_give_their_sampling_versions() -> None:
    both = _trajectory("r", "g", 1.0, [_turn("r", [1, 2], [3, 4], [7, 7], [5, 7]), _turn("r", [1, 2, 3, 4, 9], [6], [8], None)])
    (sample,) = trajectory_to_samples(both)
    assert sample.versions == [UNSAMPLED_VERSION] * 2 + [7, 7] + [UNSAMPLED_VERSION] + [8]
    assert sample.kv_versions == [UNSAMPLED_VERSION] * 2 + [5, 7] + [UNSAMPLED_VERSION] + [8]
    (old,) = trajectory_to_samples(_trajectory("o", "g", 1.0, [_turn("o", [1], [3, 4], [7, 7], None)]))
    assert old.kv_versions is None


def _groups(kv_of_a: list[int] | None) -> list[list[Trajectory]]:
    """Two groups of one rollout each, sampled by version 7: `a` over KV of `kv_of_a`, `b` recording none (vLLM's)."""
    return [
        [_trajectory("a", "ga", 1.0, [_turn("a", [1, 2], [3, 4, 5], [7, 7, 7], kv_of_a)])],
        [_trajectory("b", "gb", 0.0, [_turn("b", [1, 2], [3, 6], [7, 7], None)])],
    ]


def test_staleness_by_kv_drops_a_rollout_whose_kv_is_stale_where_sampled_keeps_it() -> None:
    batch = batch_of(_groups([2, 6, 7]), ["env_crash", "error"])
    rule = dict(current_version=8, max_staleness=2, group_size=1)
    assert select(batch.groups, **rule, staleness_by="sampled").accounts == {"a": Account.TRAINED, "b": Account.TRAINED}
    # KV of version 2 is 6 versions behind; b recorded none and counts by its sampling versions, 1 behind.
    assert select(batch.groups, **rule, staleness_by="kv").accounts == {"a": Account.DROPPED_STALE, "b": Account.TRAINED}
    fresh = batch_of(_groups([6, 6, 7]), ["env_crash", "error"])
    assert select(fresh.groups, **rule, staleness_by="kv").accounts == {"a": Account.TRAINED, "b": Account.TRAINED}


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("staleness_by", ["sampled", "kv"])
def test_the_learner_drops_and_reports_lags_by_the_version_staleness_by_names(staleness_by) -> None:
    config = LearnerConfig(group_size=1, max_staleness=2, lr=1e-3, staleness_by=staleness_by)
    learner = RLLearner(config, make_tiny_model("qwen3"), build_tokenizer(), None, sampling_temperature=1.0)
    learner.version = 8
    step = learner.train_step(batch_of(_groups([2, 6, 7]), config.crash_statuses))
    if staleness_by == "kv":
        assert (step.ledger["trained"], step.ledger["dropped_stale"]) == (1, 1)
        assert step.staleness == {1: 1, 6: 1}
    else:
        assert (step.ledger["trained"], step.ledger["dropped_stale"]) == (2, 0)
        assert step.staleness == {1: 2}


def test_learner_config_takes_staleness_by_sampled_or_kv_and_refuses_anything_else() -> None:
    assert LearnerConfig().staleness_by == "sampled"
    assert LearnerConfig(staleness_by="kv").staleness_by == "kv"
    with pytest.raises(ValueError, match="staleness_by"):
        LearnerConfig(staleness_by="oldest")


def _replayed(sample: Sample, trained_version: int) -> RolloutScore:
    """`asyncrl replay score`'s report of `sample` with its log-probs re-scored as recorded (a ratio of 1), under
    one checkpoint; its group is not in a store, so no advantage."""
    labels = ["final"]
    item = _Item(
        sample=sample, temperatures=sample.scoring_temperatures(1.0), trained_version=trained_version, advantage=None, account=None,
        logprobs={"final": list(sample.logprobs)}, nearest=[None] * len(sample.token_ids),
    )  # fmt: skip
    view = SimpleNamespace(config=SimpleNamespace(learner=LearnerConfig()))
    return _report(view, item, labels, OBJECTIVES, _Texts(build_tokenizer()), [{"label": "final", "version": 9, "path": None}])


def test_replay_shows_each_tokens_kv_version_and_its_staleness_where_the_engine_recorded_them() -> None:
    (sample,) = trajectory_to_samples(_trajectory("r", "g", 1.0, [_turn("r", [1, 2], [3, 4], [7, 7], [5, 7])]))
    score = _replayed(sample, trained_version=9)
    sampled = [(t.version, t.staleness, t.kv_version, t.kv_staleness) for t in score.tokens if t.sampled]
    assert sampled == [(7, 2, 5, 4), (7, 2, 7, 2)]
    assert all(t.kv_version is None and t.kv_staleness is None for t in score.tokens if not t.sampled)
    console = Console(record=True, width=200)
    render_one(score, console)
    header, *rows = [line for line in console.export_text().splitlines() if "stale" in line or "final" in line][-3:]
    assert "kv stale" in header
    assert [row.split()[3:7] for row in rows] == [["7", "2", "5", "4"], ["7", "2", "7", "2"]]  # ver, stale, kv, kv stale

    (old,) = trajectory_to_samples(_trajectory("o", "g", 1.0, [_turn("o", [1, 2], [3, 4], [7, 7], None)]))
    console = Console(record=True, width=200)
    render_one(_replayed(old, trained_version=9), console)
    assert "stale" in console.export_text() and "kv" not in console.export_text()
