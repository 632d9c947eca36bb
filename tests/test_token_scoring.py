"""Token-level scoring: `EmbeddedEngine.score` (prefill-only, the engine's own weights), the gateway's
`POST /v1/tokens/score` over loopback, and distillation teachers reached through it by url.

The engine's scores must be the checkpoint scorer's (`NativeScorer`, tested against transformers in
test_scoring.py) and follow weight updates; the endpoint must return the same numbers, refuse
bad input with a 400 that says why, and never answer a malformed request with a 5xx.
"""

from __future__ import annotations

import asyncio
import socket
from types import SimpleNamespace

import httpx
import pytest
from conftest import make_tiny_model
from gateway_helpers import LiveGateway, make_engine, make_service
from pydantic import ValidationError
from test_distill import LoopbackTeacher
from test_scoring import SEQUENCES

from asyncrl.configs.schema import EmbeddedRolloutConfig, RunConfig, TeacherSpec
from asyncrl.distill.teachers import HttpTeacher, TeacherError, Teachers, check_checkpoints
from asyncrl.gateway.engines import HttpEngine, LocalEngine, RayEngine, ScoringUnsupported, engine_app
from asyncrl.gateway.store import open_store
from asyncrl.records import Batch, RequestError, Sample
from asyncrl.rollout import EmbeddedEngine
from asyncrl.rollout.scoring import NativeScorer
from asyncrl.rollout.worker import RolloutWorker

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # forwards compared to 1e-4, on one thread

TOLERANCE = 1e-5
"""Max abs difference of per-token log-probs between two runs of the same native forward."""


def max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    assert [len(x) for x in a] == [len(y) for y in b]
    return max(abs(x - y) for row_a, row_b in zip(a, b, strict=True) for x, y in zip(row_a, row_b, strict=True))


@pytest.fixture(scope="module")
def teacher_model():
    return make_tiny_model("qwen3", seed=3)


@pytest.fixture(scope="module")
def gateway(teacher_model, tmp_path_factory):
    engine = make_engine("e0", model=teacher_model)
    with LiveGateway(make_service(open_store(tmp_path_factory.mktemp("store")), [engine])) as gw:
        yield gw
    engine.shutdown()


# -- the engine verb ------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["qwen3", "glm_moe_dsa"])
def test_engine_scores_equal_the_checkpoint_scorer_and_follow_weight_updates(arch, tmp_path):
    make_tiny_model(arch, seed=1).save_pretrained(tmp_path)
    engine = EmbeddedEngine.from_pretrained(
        str(tmp_path), EmbeddedRolloutConfig(device="cpu", torch_threads=1, max_num_seqs=4), engine_id="s"
    )
    try:
        before = asyncio.run(engine.score(SEQUENCES, 0.7)).logprobs
        assert max_diff(before, NativeScorer(str(tmp_path)).score(SEQUENCES, 0.7)) < TOLERANCE
        assert all(row[0] == 0.0 for row in before)
        other = make_tiny_model(arch, seed=2)
        engine.update_weights(other.state_dict(), version=3)
        after = asyncio.run(engine.score(SEQUENCES, 0.7))
        assert after.version == 3 and after.engine_id == "s"
        assert max_diff(after.logprobs, NativeScorer(other).score(SEQUENCES, 0.7)) < TOLERANCE
        assert max_diff(after.logprobs, before) > 0.1  # the new weights, not the old ones
    finally:
        engine.shutdown()


def test_scoring_between_steps_leaves_generation_exactly_as_it_was(teacher_model):
    """Seeded requests sample the same tokens whether or not scoring calls run beside them: scoring
    uses its own cache, never an engine slot or a retained prefix."""
    prompts = [[5, 17, 33, 9], [40, 41, 42]]
    sampling = {"temperature": 1.0, "max_tokens": 12, "seed": 7}

    async def run(with_scoring: bool):
        engine = make_engine("g", model=teacher_model)
        try:
            turns = [engine.generate(p, sampling, session_id=str(i)) for i, p in enumerate(prompts)]
            scores = [engine.score(SEQUENCES) for _ in range(3)] if with_scoring else []
            results = await asyncio.gather(*turns, *scores)
            again = await engine.generate(prompts[0] + results[0].token_ids + [5], sampling, session_id="0")
            return [r.token_ids for r in results[: len(prompts)]] + [again.token_ids], again.cached_prompt_tokens
        finally:
            engine.shutdown()

    assert asyncio.run(run(True)) == asyncio.run(run(False))


# -- the gateway endpoint -------------------------------------------------------------------------


def test_the_endpoint_returns_the_engines_scores_over_loopback(gateway, teacher_model):
    response = gateway.http.post("/v1/tokens/score", json={"sequences": SEQUENCES, "temperature": 0.7})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["engine_id"] == "e0" and body["version"] == 0
    assert max_diff(body["logprobs"], NativeScorer(teacher_model).score(SEQUENCES, 0.7)) < TOLERANCE
    default = gateway.http.post("/v1/tokens/score", json={"sequences": SEQUENCES[:1]}).json()["logprobs"]
    assert max_diff(default, NativeScorer(teacher_model).score(SEQUENCES[:1], 1.0)) < TOLERANCE


BAD = [
    ({"sequences": [[5, 10_000]]}, "token id 10000 is outside the vocabulary"),
    ({"sequences": [[5, -1]]}, "outside the vocabulary"),
    ({"sequences": [[5, 6], []]}, "sequence 1 is empty"),
    ({"sequences": [list(range(10)) * 200]}, "more than the model's"),
    ({"sequences": [[5, 6]], "temperature": 1e-300}, "too small"),
]
MALFORMED = [
    (b"{not json", "JSON"),
    ({}, "sequences"),
    ({"sequences": []}, "sequences"),
    ({"sequences": "5 6"}, "sequences"),
    ({"sequences": [[5, 6.5]]}, "sequences"),
    ({"sequences": [[5, 6]], "temperature": -1}, "temperature"),
    ({"sequences": [[5, 6]], "temperature": "hot"}, "temperature"),
    ({"sequences": [[5, 6]], "bogus": 1}, "bogus"),
    ({"sequences": [[5]] * 1025}, "sequences"),
]


@pytest.mark.parametrize(("body", "fragment"), BAD + MALFORMED, ids=[c[1] for c in BAD + MALFORMED])
def test_bad_and_malformed_requests_get_a_400_that_says_why(gateway, body, fragment):
    """Bad token ids and lengths are the engine's RequestError; malformed bodies fail validation.
    Both are the gateway's 400 (its validation errors are 400s, not FastAPI's 422s); no key is needed."""
    if isinstance(body, bytes):
        response = gateway.http.post("/v1/tokens/score", content=body, headers={"Content-Type": "application/json"})
    else:
        response = gateway.http.post("/v1/tokens/score", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert fragment in error["message"] and error["code"] == "invalid_request", error


class CannotScore:
    """An engine that generates but refuses to score, as the vLLM engine does."""

    def __init__(self, engine, engine_id: str) -> None:
        self.engine, self.engine_id = engine, engine_id

    async def generate(self, prompt_token_ids, sampling=None, *, session_id=None):
        return await self.engine.generate(prompt_token_ids, sampling, session_id=session_id)

    async def score(self, sequences, temperature=1.0):
        raise NotImplementedError(f"engine {self.engine_id} (vLLM) cannot score token sequences")

    def health(self) -> dict:
        return {**self.engine.health(), "engine_id": self.engine_id}


def test_an_engine_that_cannot_score_is_passed_over_and_alone_it_is_a_501(teacher_model, tmp_path):
    engine = make_engine("b-able", model=teacher_model)
    unable = LocalEngine(CannotScore(engine, "a-unable"))
    try:
        # engine_retries=0: passing over an engine that cannot score uses no retry.
        with LiveGateway(make_service(open_store(tmp_path / "a"), [unable, engine], engine_retries=0)) as gw:
            for _ in range(3):  # "a-unable" is picked first each time (tied loads, first id)
                response = gw.http.post("/v1/tokens/score", json={"sequences": SEQUENCES[:2]})
                assert response.status_code == 200 and response.json()["engine_id"] == "b-able", response.text
        with LiveGateway(make_service(open_store(tmp_path / "b"), [unable])) as gw:
            response = gw.http.post("/v1/tokens/score", json={"sequences": SEQUENCES[:2]})
            assert response.status_code == 501, response.text
            assert "a-unable (vLLM) cannot score" in response.json()["error"]["message"]
            assert gw.http.post("/v1/tokens/score", json={"sequences": "x"}).status_code == 400
    finally:
        engine.shutdown()


class InProcessActor:
    """A Ray actor handle without Ray: `actor.method.remote(...)` is the method's coroutine, awaited
    as Ray's ObjectRef would be (a Ray start belongs to the slow tests, test_rollout_worker.py)."""

    def __init__(self, obj) -> None:
        self.obj = obj

    def __getattr__(self, name: str):
        return SimpleNamespace(remote=getattr(self.obj, name))


def http_handle(engine) -> HttpEngine:
    """An HttpEngine whose requests reach `engine_app(engine)` in this process."""
    handle = HttpEngine("http://engine", engine.engine_id)
    handle._client = httpx.AsyncClient(transport=httpx.ASGITransport(app=engine_app(engine)), base_url=handle.url)
    return handle


def test_ray_and_http_engine_handles_score_as_the_engine_does(teacher_model):
    # The RolloutWorker actor's class, run in this process.
    worker = RolloutWorker(teacher_model, EmbeddedRolloutConfig(device="cpu", torch_threads=1), "w0")
    refusing = CannotScore(worker.engine, "v")
    expected = NativeScorer(teacher_model).score(SEQUENCES, 0.7)

    async def check() -> None:
        for handle in (RayEngine(InProcessActor(worker), "w0"), http_handle(worker.engine)):
            result = await handle.score(SEQUENCES, 0.7)
            assert (result.engine_id, result.version) == ("w0", 0) and max_diff(result.logprobs, expected) < TOLERANCE
            with pytest.raises(RequestError, match="token id 10000 is outside the vocabulary"):
                await handle.score([[5, 10_000]], 1.0)
        for handle in (RayEngine(InProcessActor(refusing), "v"), http_handle(refusing)):
            with pytest.raises(ScoringUnsupported, match="cannot score"):
                await handle.score([[5, 6]], 1.0)

    try:
        asyncio.run(check())
    finally:
        worker.engine.shutdown()


def test_scoring_records_nothing(gateway):
    before = gateway.service.store.counts()
    assert gateway.http.post("/v1/tokens/score", json={"sequences": SEQUENCES[:1]}).status_code == 200
    assert gateway.service.store.counts() == before


# -- teachers by url ------------------------------------------------------------------------------


def distill_config(tmp_path, **teachers) -> RunConfig:
    (tmp_path / "config.json").write_text("{}")
    return RunConfig.model_validate({
        "policy": {"path": str(tmp_path)}, "learner": {"group_size": 1}, "distill": {"teachers": teachers},
    })  # fmt: skip


def student_batch() -> Batch:
    """Three groups of one (group size 1), a sample each."""
    groups = []
    for i, tokens in enumerate(SEQUENCES[:3]):
        mask = [0] * (len(tokens) // 2) + [1] * (len(tokens) - len(tokens) // 2)
        logprobs = [-0.5 * m for m in mask]
        groups.append([Sample(tokens, mask, logprobs, [0] * len(tokens), 0.0, f"g{i}", f"r{i}", "ok", task="words")])
    return Batch(groups)


def test_a_url_teacher_scores_as_the_local_teacher_does(gateway, teacher_model, tmp_path):
    config = distill_config(tmp_path, words={"url": gateway.url + "/"})
    check_checkpoints(config)  # a url teacher has no checkpoint to check
    remote = Teachers.from_config(config, {})
    assert isinstance(remote.handles["words"], HttpTeacher)
    remote.handles["words"] = HttpTeacher("words", gateway.url, token=gateway.run_token)  # the serving run's token
    local = Teachers({"words": LoopbackTeacher(teacher_model)}, remote.temperature, remote.skip_statuses)
    batch = student_batch()
    (out_remote, kl_remote), (out_local, kl_local) = asyncio.run(remote.score(batch)), asyncio.run(local.score(batch))
    got = [s.teacher_logprobs for s in out_remote.samples]
    assert max_diff(got, [s.teacher_logprobs for s in out_local.samples]) < TOLERANCE
    assert all(s.teacher == "words" for s in out_remote.samples)
    assert set(kl_remote) == {"reverse_kl/words"} and kl_remote["reverse_kl/words"] == pytest.approx(kl_local["reverse_kl/words"], abs=1e-5)


def test_a_url_teacher_splits_large_batches_and_keeps_their_order(gateway, teacher_model, monkeypatch):
    import asyncrl.distill.teachers as teachers

    monkeypatch.setattr(teachers, "HTTP_CHUNK_TOKENS", 40)  # SEQUENCES: 8 + 2 | 40 | 1 tokens: 3 requests
    assert [len(c) for c in teachers._chunks(SEQUENCES)] == [2, 1, 1]
    got = asyncio.run(HttpTeacher("words", gateway.url, token=gateway.run_token).score(SEQUENCES, 1.0))
    assert max_diff(got, NativeScorer(teacher_model).score(SEQUENCES, 1.0)) < TOLERANCE


def test_a_url_teacher_that_fails_names_itself_and_its_url(gateway):
    with socket.socket() as sock:  # a port nothing listens on once closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(TeacherError, match=rf"teacher 'math' at http://127.0.0.1:{port} is unreachable"):
        asyncio.run(HttpTeacher("math", f"http://127.0.0.1:{port}").score([[5, 6]], 1.0))
    with pytest.raises(TeacherError, match=r"teacher 'words' at http://127.0.0.1:\d+ answered HTTP 400: .*outside the vocabulary"):
        asyncio.run(HttpTeacher("words", gateway.url, token=gateway.run_token).score([[5, 10_000]], 1.0))
    with pytest.raises(TeacherError, match=r"teacher 'words' at http://127.0.0.1:\d+ refused the run token .*run token"):
        asyncio.run(HttpTeacher("words", gateway.url).score([[5, 6]], 1.0))  # no token for a gateway that checks them


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({}, "needs its stage's checkpoint"),
        ({"checkpoint": "/ckpt", "url": "http://127.0.0.1:8000"}, "not both"),
        ({"url": "127.0.0.1:8000"}, "must start with http"),
    ],
)
def test_a_teacher_is_exactly_one_of_a_checkpoint_and_a_url(spec, message):
    with pytest.raises(ValidationError, match=message):
        TeacherSpec.model_validate(spec)
    assert TeacherSpec.model_validate({"url": "https://teacher:8000"}).checkpoint is None
