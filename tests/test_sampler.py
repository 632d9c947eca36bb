"""Sampling semantics: which tokens may appear, the log-prob reported for them, and their frequencies."""

from __future__ import annotations

import random

import pytest
import torch

from asyncrl.records import SamplingParams
from asyncrl.rollout.sampler import sample

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])


def truncated(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Reference: the renormalised distribution after temperature, top-k, top-p (written plainly)."""
    probs = torch.softmax(logits / temperature, dim=-1)
    order = probs.argsort(descending=True).tolist()
    kept = order[:top_k] if top_k else order
    mass = probs[kept].sum()
    nucleus, running = [], 0.0
    for token in kept:
        if running >= top_p * mass:
            break
        nucleus.append(token)
        running += probs[token].item()
    out = torch.zeros_like(probs)
    out[nucleus] = probs[nucleus] / probs[nucleus].sum()
    return out


def draw(params: SamplingParams, n: int, seed: int = 0) -> tuple[list[int], list[float]]:
    rng = random.Random(seed)
    return sample(LOGITS.expand(n, -1), [params] * n, [rng] * n)


def test_greedy_takes_argmax_with_the_raw_model_logprob():
    tokens, logprobs = draw(SamplingParams(temperature=0, top_k=3, top_p=0.5), 4)
    assert tokens == [0] * 4
    assert logprobs[0] == pytest.approx(torch.log_softmax(LOGITS, -1)[0].item(), abs=1e-6)


@pytest.mark.parametrize(
    "temperature, top_k, top_p",
    [(1.0, 0, 1.0), (0.5, 0, 1.0), (2.0, 0, 1.0), (1.0, 3, 1.0), (1.0, 0, 0.6), (0.7, 4, 0.8), (1.3, 0, 0.95)],
)
def test_logprobs_and_support_follow_the_truncated_distribution(temperature, top_k, top_p):
    expected = truncated(LOGITS, temperature, top_k, top_p)
    tokens, logprobs = draw(SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p), 2000, seed=1)
    assert set(tokens) <= set(expected.nonzero().squeeze(1).tolist()), "a token outside top-k/top-p appeared"
    for token, logprob in zip(tokens[:50], logprobs[:50], strict=True):
        assert logprob == pytest.approx(expected[token].log().item(), abs=1e-5)


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.8, 5, 0.9), (1.5, 0, 0.7)])
def test_empirical_frequencies_match_the_distribution(temperature, top_k, top_p):
    n = 20000
    expected = truncated(LOGITS, temperature, top_k, top_p)
    tokens, _ = draw(SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p), n, seed=7)
    freq = torch.bincount(torch.tensor(tokens), minlength=len(LOGITS)).float() / n
    # Binomial standard error is at most 0.0036 at n=20000; 0.015 is over four of them.
    assert (freq - expected).abs().max().item() < 0.015


@pytest.mark.parametrize("own", [SamplingParams(), SamplingParams(top_k=4, top_p=0.9)])
@pytest.mark.parametrize("others", [SamplingParams(), SamplingParams(temperature=0.5, top_p=0.8), SamplingParams(temperature=0)])
def test_a_rows_draw_depends_only_on_its_own_seed_options_and_logits(own, others):
    for seed in range(20):
        alone = sample(LOGITS[None], [own], [random.Random(seed)])
        batch = torch.cat([torch.randn(2, len(LOGITS)), LOGITS[None], torch.randn(3, len(LOGITS))])
        rngs = [random.Random(1000 + i) for i in range(6)]
        rngs[2] = random.Random(seed)
        tokens, logprobs = sample(batch, [others, others, own, others, others, others], rngs)
        assert (tokens[2], logprobs[2]) == (alone[0][0], alone[1][0])


def test_rows_with_different_options_are_sampled_independently():
    greedy, nucleus = SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_k=2)
    tokens, logprobs = sample(LOGITS.expand(2, -1), [greedy, nucleus], [random.Random(0), random.Random(0)])
    assert tokens[0] == 0 and tokens[1] in (0, 1)
    assert logprobs[1] == pytest.approx(truncated(LOGITS, 1.0, 2, 1.0)[tokens[1]].log().item(), abs=1e-5)
