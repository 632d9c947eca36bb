"""Teacher scoring (rollout/scoring.py): prefill-only log-probs equal the teacher's full forward."""

from __future__ import annotations

import pytest
import torch

from asyncrl.records import RequestError
from asyncrl.rollout.scoring import NativeScorer

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # forwards compared to 1e-4, on one thread

TOLERANCE = 1e-4
"""Max abs difference of per-token log-probs, native scorer vs transformers, both fp32."""

SEQUENCES = [[5, 17, 33, 9, 64, 2, 71, 8], [40, 41], list(range(20, 60)), [7]]


def full_forward_logprobs(model, tokens: list[int], temperature: float) -> list[float]:
    """log p(token j | tokens < j) at `temperature` from one transformers forward; 0.0 for token 0."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0, :-1].float() / temperature
    chosen = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(tokens[1:])[:, None]).squeeze(1)
    return [0.0, *chosen.tolist()]


@pytest.mark.parametrize("arch", ["glm_moe_dsa", "qwen3"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_scores_equal_the_teachers_full_forward(arch, temperature, glm_model, qwen3_model):
    model = glm_model if arch == "glm_moe_dsa" else qwen3_model
    # Small chunks: the sequences are split over several forwards that reuse the same cache slots.
    scorer = NativeScorer(model, max_rows=2, max_batch_tokens=64)
    scores = scorer.score(SEQUENCES, temperature)
    for tokens, got in zip(SEQUENCES, scores, strict=True):
        expected = full_forward_logprobs(model, tokens, temperature)
        assert len(got) == len(tokens) and got[0] == 0.0
        diff = max(abs(a - b) for a, b in zip(got, expected, strict=True))
        assert diff < TOLERANCE, f"{arch} T={temperature} len {len(tokens)}: max |diff| {diff:.2e}"


def test_greedy_temperature_scores_raw_logprobs(qwen3_model):
    scorer = NativeScorer(qwen3_model)
    assert scorer.score([SEQUENCES[0]], 0.0) == scorer.score([SEQUENCES[0]], 1.0)


def test_scores_do_not_depend_on_what_is_batched_beside(qwen3_model):
    scorer = NativeScorer(qwen3_model)
    alone = scorer.score([SEQUENCES[1]])[0]
    together = scorer.score(SEQUENCES)[1]
    assert max(abs(a - b) for a, b in zip(alone, together, strict=True)) < 1e-5


@pytest.mark.parametrize(
    "sequences, message",
    [
        ([[]], "empty"),
        ([[1, 2, 10_000]], "outside the vocabulary"),
        ([[1, -1]], "outside the vocabulary"),
        ([[1, 2.5]], "integers"),
        ([list(range(10)) * 20], "more than the model's"),
    ],
)
def test_bad_input_is_a_request_error(qwen3_model, sequences, message):
    with pytest.raises(RequestError, match=message):
        NativeScorer(qwen3_model).score(sequences)


def test_bad_temperature_is_a_request_error(qwen3_model):
    with pytest.raises(RequestError, match="temperature"):
        NativeScorer(qwen3_model).score([[1, 2]], -1.0)


def test_a_scorer_for_short_sequences_keeps_a_cache_of_their_length(qwen3_model):
    # A distillation teacher scores the student's rollouts, at most rollout.max_model_len long; its cache is
    # sized by that, not by the model's whole context (SmolLM2's 8,192 positions: 24 GB of cache a teacher).
    whole, short = NativeScorer(qwen3_model), NativeScorer(qwen3_model, max_len=48)
    assert whole.max_len == qwen3_model.config.max_position_embeddings > 48 == short.max_len
    assert short.cache.max_len == 48 and whole.cache.max_len == whole.max_len
    assert max(abs(a - b) for a, b in zip(short.score(SEQUENCES)[2], whole.score(SEQUENCES)[2], strict=True)) < 1e-5
    with pytest.raises(RequestError, match="more than the model's 48"):
        short.score([list(range(20, 70))])
    # A length beyond the model's context is no reason to allocate more than the model can score.
    assert NativeScorer(qwen3_model, max_len=10**6).max_len == whole.max_len
