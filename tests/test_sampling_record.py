"""Temperature on the record, end to end: a turn records the sampling options the engine drew it with,
the learner scores each token at its turn's temperature, and `gateway.sampling_overrides=refuse`
answers a request for other options than the run's with a 400.

Everything here is real: the gateway over loopback HTTP, an embedded engine, the store, sample
assembly and an `RLLearner` over the same weights as the engine.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math

import openai
import pytest
import torch
from conftest import make_tiny_model
from gateway_helpers import LiveGateway, make_engine, make_service

from asyncrl.configs.schema import ArithmeticTaskConfig, LearnerConfig, SamplingConfig
from asyncrl.envs.reasoning import ReasoningEnv
from asyncrl.gateway.store import open_store
from asyncrl.jobs.contract import ContractError, check_environment
from asyncrl.learner.batch import micro_batches, to_rows
from asyncrl.learner.rl import RLLearner, sampled_logprobs
from asyncrl.policy.tokenizer import build_tokenizer
from asyncrl.records import Batch, Sample
from asyncrl.samples import trajectory_to_samples

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # forwards compared to 1e-4, on one thread

TOLERANCE = 1e-4
"""The learner's log-prob of a sampled token against the engine's, both fp32 (seen: ~1e-6)."""


@contextlib.contextmanager
def recording(tmp_path, policy, run: SamplingConfig):
    """(a live gateway over an embedded engine of a copy of `policy`, its store), the run's sampling `run`,
    per-request options allowed; the engine and store closed after."""
    engine = make_engine("e0", model=copy.deepcopy(policy))
    store = open_store(tmp_path)
    try:
        with LiveGateway(make_service(store, [engine], sampling=run, sampling_overrides="allow")) as gateway:
            yield gateway, store
    finally:
        engine.shutdown()
        store.close()


def learner_logprobs(learner: RLLearner, samples: list[Sample]) -> list[list[float]]:
    """The learner's log-prob of every token of each sample, through its own rows and micro-batches."""
    rows = to_rows(samples, [0.0] * len(samples), learner.temperature)
    out = []
    with torch.no_grad():
        for row in rows:
            (batch,) = micro_batches([row], 0, len(row.token_ids))
            logits = learner.model(input_ids=batch.input_ids).logits
            out.append([0.0, *sampled_logprobs(logits, batch.input_ids, batch.temperatures[:, 1:])[0].tolist()])
    return out


def largest_gap(samples: list[Sample], logprobs: list[list[float]]) -> float:
    pairs = zip(samples, logprobs, strict=True)
    return max(abs(a - b) for s, lp in pairs for a, b, m in zip(s.logprobs, lp, s.loss_mask, strict=True) if m)


def test_a_per_request_temperature_is_recorded_and_the_learner_scores_its_tokens_as_the_engine_did(tmp_path):
    policy = make_tiny_model("qwen3", seed=5)
    run = SamplingConfig(temperature=1.0, max_tokens=6)
    with recording(tmp_path, policy, run) as (gateway, store):
        # One rollout of three token calls, each extending the last: an override, the run's
        # temperature (left unset) and greedy, so one sample holds three temperatures.
        tokens_id, tokens_key = gateway.open(group_id="g")
        prompt = [3, 4, 5, 6]
        for seed, temperature in enumerate((0.6, None, 0.0)):
            body = {"prompt_token_ids": prompt, "max_tokens": 6, "seed": seed}
            if temperature is not None:
                body["temperature"] = temperature
            reply = gateway.http.post("/v1/tokens/generate", json=body, headers={"Authorization": f"Bearer {tokens_key}"})
            assert reply.status_code == 200, reply.text
            prompt = prompt + reply.json()["token_ids"] + [7, 8]  # the environment's tokens
        chat_id, chat_key = gateway.open(group_id="g")
        gateway.openai(chat_key).chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "hi"}], temperature=1.7, top_p=1.0, max_tokens=6, seed=9
        )
        for rollout_id, reward in ((tokens_id, 1.0), (chat_id, 0.0)):
            gateway.http.post(f"/rollouts/{rollout_id}/finish", json={"reward": reward}).raise_for_status()
        tokens, chat = store.get(tokens_id), store.get(chat_id)

    assert [(t.temperature, t.top_p, t.top_k) for t in tokens.turns] == [(0.6, 1.0, 0), (1.0, 1.0, 0), (0.0, 1.0, 0)]
    assert [(t.temperature, t.top_p, t.top_k) for t in chat.turns] == [(1.7, 1.0, 0)]
    samples = trajectory_to_samples(tokens) + trajectory_to_samples(chat)
    assert len(samples) == 2 and samples[0].turn_indices == [0, 1, 2]
    assert {t for t, m in zip(samples[0].temperatures, samples[0].loss_mask, strict=True) if m} == {0.6, 1.0, 0.0}

    learner = RLLearner(LearnerConfig(group_size=2, lr=1e-3), policy, build_tokenizer(), sampling_temperature=run.temperature)
    assert largest_gap(samples, learner_logprobs(learner, samples)) < TOLERANCE
    # The control: scored at the run's temperature alone, as before turns recorded theirs, the
    # override's tokens (0.6 and 1.7) are far off.
    unrecorded = [dataclasses.replace(s, temperatures=None) for s in samples]
    assert largest_gap(unrecorded, learner_logprobs(learner, unrecorded)) > 100 * TOLERANCE
    # The learner's real step sees the same: every importance ratio is 1 within the tolerance.
    step = learner.train_step(Batch([samples]))  # one group: both rollouts are of "g"
    assert step.stepped and step.metrics["computed_trainable_tokens"] == sum(sum(s.loss_mask) for s in samples)
    assert step.metrics["abs_logp_diff"] < TOLERANCE
    assert math.exp(-TOLERANCE) < step.metrics["ratio_min"] <= step.metrics["ratio_max"] < math.exp(TOLERANCE)


@pytest.fixture(scope="module")
def scripted_engine():
    engine = make_engine("e0")
    yield engine
    engine.shutdown()


def test_refused_overrides_are_a_400_naming_the_option_and_the_runs_value(scripted_engine, tmp_path):
    store = open_store(tmp_path)
    service = make_service(store, [scripted_engine], sampling=SamplingConfig(temperature=0.8, max_tokens=4))
    assert service.config.sampling_overrides == "refuse"  # the default
    with LiveGateway(service) as gateway:
        rollout_id, key = gateway.open()
        client = gateway.openai(key)
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}], temperature=1.0)
        error = refused.value.body
        assert refused.value.status_code == 400 and error["code"] == "sampling_override_refused"
        assert "temperature=1.0 differs from this run's rollout.sampling.temperature=0.8" in error["message"]
        assert "gateway.sampling_overrides is 'refuse'" in error["message"]
        assert "gateway.sampling_overrides=allow" in error["message"]
        with pytest.raises(openai.BadRequestError, match=r"top_p=0\.5 differs from this run's rollout\.sampling\.top_p=1\.0"):
            client.completions.create(model="policy", prompt="<|user|>hi<|assistant|>", top_p=0.5)

        auth = {"Authorization": f"Bearer {key}"}
        refusals = [
            ({"top_k": 5}, "top_k=5 differs from this run's rollout.sampling.top_k=0"),
            ({"temperature": 0}, "temperature=0.0 differs from this run's rollout.sampling.temperature=0.8"),
        ]
        for option, expected in refusals:
            reply = gateway.http.post("/v1/tokens/generate", json={"prompt_token_ids": [4, 5], **option}, headers=auth)
            assert reply.status_code == 400 and reply.json()["error"]["code"] == "sampling_override_refused"
            assert expected in reply.json()["error"]["message"]

        # The run's own options, sent or left out, are served and recorded as they were sampled.
        same = {"prompt_token_ids": [4, 5], "temperature": 0.8, "top_p": 1.0, "top_k": 0, "max_tokens": 2}
        assert gateway.http.post("/v1/tokens/generate", json=same, headers=auth).status_code == 200
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
        turns = store.get(rollout_id).turns
    store.close()
    assert [(t.temperature, t.top_p, t.top_k) for t in turns] == [(0.8, 1.0, 0)] * 2  # nothing refused was recorded


def test_an_overriding_environment_breaks_the_contract_and_a_faithful_one_passes():
    task = ArithmeticTaskConfig()
    report = check_environment(ReasoningEnv(task, max_tokens=4), episodes=2, eval_episodes=0)
    assert all((t.temperature, t.top_p, t.top_k) == (1.0, 1.0, 0) for tr in report.trajectories for t in tr.turns)
    with pytest.raises(ContractError) as broken:
        check_environment(ReasoningEnv(task, max_tokens=4, temperature=0.5), episodes=2, eval_episodes=0)
    message = str(broken.value)
    assert "episode 0 turn 0: sampled with temperature, top_p, top_k = (0.5, 1.0, 0), not the run's (1.0, 1.0, 0)" in message
    assert "episode 1 turn 0" in message and "gateway.sampling_overrides=refuse" in message


@pytest.mark.parametrize(("overrides", "expected"), [([], "allow"), (["gateway.sampling_overrides=refuse"], "refuse")])
def test_asyncrl_serve_allows_overrides_unless_the_config_says(tmp_path, overrides, expected):
    from asyncrl.configs import load_config
    from asyncrl.jobs.serve import build_service

    config = load_config("quickstart", [f"runs_dir={tmp_path}", "rollout.device=cpu", *overrides])
    assert config.gateway.sampling_overrides == "refuse"  # what `asyncrl run` uses
    service, handles = build_service(config)
    try:
        assert service.config.sampling_overrides == expected
    finally:
        service.close()
        service.store.close()
        for handle in handles:
            handle.engine.shutdown()


def test_tokens_sampled_under_top_p_and_top_k_are_scored_under_them(tmp_path):
    policy = make_tiny_model("qwen3", seed=5)
    run = SamplingConfig(temperature=1.0, max_tokens=8)
    with recording(tmp_path, policy, run) as (gateway, store):
        # One rollout of three calls, each extending the last: top-p 0.8, top-k 5 at temperature 1.3, neither.
        rollout_id, key = gateway.open(group_id="g")
        prompt = [3, 4, 5, 6]
        for seed, options in enumerate(({"top_p": 0.8}, {"top_k": 5, "temperature": 1.3}, {})):
            body = {"prompt_token_ids": prompt, "max_tokens": 8, "seed": seed, **options}
            reply = gateway.http.post("/v1/tokens/generate", json=body, headers={"Authorization": f"Bearer {key}"})
            assert reply.status_code == 200, reply.text
            prompt = prompt + reply.json()["token_ids"] + [7, 8]
        other_id, other_key = gateway.open(group_id="g")
        body = {"prompt_token_ids": [3, 4, 9], "max_tokens": 8, "seed": 7, "top_p": 0.5, "top_k": 3}
        reply = gateway.http.post("/v1/tokens/generate", json=body, headers={"Authorization": f"Bearer {other_key}"})
        assert reply.status_code == 200, reply.text
        for finished, reward in ((rollout_id, 1.0), (other_id, 0.0)):
            gateway.http.post(f"/rollouts/{finished}/finish", json={"reward": reward}).raise_for_status()
        trajectories = [store.get(rollout_id), store.get(other_id)]

    samples = [s for t in trajectories for s in trajectory_to_samples(t)]
    sampled = [(k, p) for s in samples for k, p, m in zip(s.top_ks, s.top_ps, s.loss_mask, strict=True) if m]
    assert {(0, 0.8), (5, 1.0), (0, 1.0), (3, 0.5)} == set(sampled)
    control = RLLearner(LearnerConfig(group_size=2, lr=1e-3), copy.deepcopy(policy), build_tokenizer())
    learner = RLLearner(LearnerConfig(group_size=2, lr=1e-3), policy, build_tokenizer(), sampling_temperature=run.temperature)
    # The learner's real step: every importance ratio is 1 within the tolerance, truncated tokens included.
    step = learner.train_step(Batch([samples]))
    assert step.stepped and step.metrics["abs_logp_diff"] < TOLERANCE
    assert math.exp(-TOLERANCE) < step.metrics["ratio_min"] <= step.metrics["ratio_max"] < math.exp(TOLERANCE)
    # The control: the same tokens scored without the truncation are far off (the kept mass was < 1).
    untruncated = [dataclasses.replace(s, top_ks=None, top_ps=None) for s in samples]
    assert control.train_step(Batch([untruncated])).metrics["abs_logp_diff"] > 100 * TOLERANCE
