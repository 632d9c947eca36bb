"""Per-request sampling from a batch of logits, with the log-prob of the distribution sampled from.

Each row has its own temperature, top-k, top-p and random stream. A token is drawn by inverse CDF:
one uniform number from the request's `random.Random`, walked along the row's distribution in a
fixed order (probability descending, ties by token id). The draw therefore depends only on that
request's logits and seed, never on what else is in the batch.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from .types import SamplingParams


def sample(
    logits: torch.Tensor, params: Sequence[SamplingParams], rngs: Sequence[random.Random]
) -> tuple[list[int], list[float]]:
    """Tokens and log-probs for logits [B, vocab], following `SamplingParams`' log-prob semantics:

    temperature, then top-k, then top-p, renormalised; greedy (temperature 0) takes the argmax and
    reports its log-prob under the raw model distribution.
    """
    rows, vocab = logits.shape
    device = logits.device
    greedy = [p.temperature == 0 for p in params]
    temperature = torch.tensor([1.0 if g else p.temperature for g, p in zip(greedy, params)], device=device)
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device)

    logp = torch.log_softmax(logits.float() / temperature[:, None], dim=-1)
    logp, order = logp.sort(dim=-1, descending=True, stable=True)
    keep = torch.arange(vocab, device=device)[None, :] < top_k[:, None]
    logp_k = logp.masked_fill(~keep, float("-inf"))
    logp_k = logp_k - torch.logsumexp(logp_k, dim=-1, keepdim=True)
    # top-p keeps the smallest head of the (top-k renormalised) distribution whose mass reaches p:
    # a token stays while the mass strictly before it is below p, so the first always stays.
    probs = logp_k.exp()
    keep &= (probs.cumsum(dim=-1) - probs) < top_p[:, None]
    final = logp_k.masked_fill(~keep, float("-inf"))
    final = final - torch.logsumexp(final, dim=-1, keepdim=True)

    cdf = final.exp().cumsum(dim=-1)
    uniform = torch.tensor([0.0 if g else rng.random() for g, rng in zip(greedy, rngs)], device=device, dtype=cdf.dtype)
    target = (uniform * cdf[:, -1]).unsqueeze(1)
    # Rounding can push the target onto the last kept token's CDF value; never step past that token.
    index = torch.searchsorted(cdf, target, right=True).squeeze(1)
    index = torch.minimum(index, keep.sum(dim=-1) - 1)
    greedy_t = torch.tensor(greedy, device=device)
    index = index.masked_fill(greedy_t, 0)
    tokens = order.gather(1, index[:, None]).squeeze(1)
    chosen = final.gather(1, index[:, None]).squeeze(1)
    # Greedy rows were computed at temperature 1 with no truncation: logp[:, 0] is the raw log-prob.
    logprobs = torch.where(greedy_t, logp[:, 0], chosen)
    return tokens.tolist(), logprobs.tolist()
