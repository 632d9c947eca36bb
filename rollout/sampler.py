"""Per-request sampling from a batch of logits, with the log-prob of the distribution sampled from.

Each row has its own temperature, top-k, top-p and random stream. A token is drawn by inverse CDF:
one uniform number from the request's `random.Random`, walked along the row's distribution in an
order fixed by the row alone (token id order; probability order when it truncates). The draw
therefore depends only on that request's logits, options and seed, never on the rest of the batch.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from asyncrl.records import SamplingParams


class SamplingRows:
    """Per-row sampling options as tensors, built once per batch and reused by every call that step.

    Speculative decoding samples the same rows up to D+1 times a step (each draft, then the verify
    positions), and building these tensors from Python lists each time cost as much as the math.
    """

    def __init__(self, params: Sequence[SamplingParams], vocab: int, device: torch.device) -> None:
        self.vocab, self.device = vocab, device
        self.greedy = torch.tensor([p.temperature == 0 for p in params], device=device)
        self.temperature = torch.tensor([p.temperature or 1.0 for p in params], device=device)
        self.top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=device)
        self.top_p = torch.tensor([p.top_p for p in params], device=device)
        truncates = [0 < p.top_k < vocab or p.top_p < 1.0 for p in params]
        self.truncates = torch.tensor(truncates, device=device)
        self.any_truncates = any(truncates)
        self.any_greedy = any(p.temperature == 0 for p in params)
        self.all_unit_temperature = all(p.temperature in (0, 1.0) for p in params)

    def repeat(self, times: int) -> SamplingRows:
        """Each row's options `times` times over, for rows scored at several positions each."""
        return self if times == 1 else self.select(torch.arange(len(self.greedy), device=self.device).repeat_interleave(times))

    def select(self, index: torch.Tensor) -> SamplingRows:
        """The options of rows `index` (a subset, or rows repeated for several positions each)."""
        rows = object.__new__(SamplingRows)
        rows.__dict__.update(self.__dict__)
        for name in ("greedy", "temperature", "top_k", "top_p", "truncates"):
            setattr(rows, name, getattr(self, name)[index])
        return rows


def _rows(params, logits: torch.Tensor) -> SamplingRows:
    return params if isinstance(params, SamplingRows) else SamplingRows(params, logits.shape[1], logits.device)


def _truncate(logits: torch.Tensor, params: Sequence[SamplingParams] | SamplingRows):
    """Temperature, then top-k, then top-p, renormalised: (final log-probs, their token order or None for
    token-id order, kept mask or None when all are kept, raw best log-prob, best token, greedy rows).
    Truncating rows are in probability order (ties by token id), the others in token-id order, so a
    row's order depends only on its own options."""
    rows = _rows(params, logits)
    vocab = logits.shape[1]
    device = logits.device
    scaled = logits.float() if rows.all_unit_temperature else logits.float() / rows.temperature[:, None]
    logp = torch.log_softmax(scaled, dim=-1)
    # Greedy rows ran at temperature 1: their maximum is the raw model log-prob of the argmax.
    best_logp, best_token = logp.max(dim=-1)
    if not rows.any_truncates:
        # Nothing cut: the softmax is the final distribution, in token-id order.
        return logp, None, None, best_logp, best_token, rows.greedy
    softmax = logp
    order = torch.arange(vocab, device=device).expand(logits.shape[0], -1)
    by_prob, by_prob_order = logp.sort(dim=-1, descending=True, stable=True)
    truncating = rows.truncates[:, None]
    logp = torch.where(truncating, by_prob, logp)
    order = torch.where(truncating, by_prob_order, order)
    keep = torch.arange(vocab, device=device)[None, :] < rows.top_k[:, None]
    logp_k = logp.masked_fill(~keep, float("-inf"))
    logp_k = logp_k - torch.logsumexp(logp_k, dim=-1, keepdim=True)
    # top-p keeps the smallest head of the (top-k renormalised) distribution whose mass reaches p:
    # a token stays while the mass strictly before it is below p, so the first always stays.
    # top_p = 1 keeps everything outright (a rounded cumulative sum may touch 1 before the tail).
    probs = logp_k.exp()
    keep &= ((probs.cumsum(dim=-1) - probs) < rows.top_p[:, None]) | (rows.top_p[:, None] >= 1.0)
    final = logp_k.masked_fill(~keep, float("-inf"))
    final = final - torch.logsumexp(final, dim=-1, keepdim=True)
    # Rows that cut nothing keep the bare softmax, bit for bit what they get in a batch where no
    # row truncates: a row's numbers must not depend on its neighbours' options.
    final = torch.where(truncating, final, softmax)
    return final, order, keep, best_logp, best_token, rows.greedy


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], rngs: Sequence[random.Random]) -> tuple[list[int], list[float]]:
    """Tokens and log-probs for logits [B, vocab], following `SamplingParams`' log-prob semantics:

    temperature, then top-k, then top-p, renormalised; greedy (temperature 0) takes the argmax and
    reports its log-prob under the raw model distribution.
    """
    vocab = logits.shape[1]
    final, order, keep, best_logp, best_token, greedy = _truncate(logits, params)
    # float64 so a uniform just below 1 does not round up to the end of the CDF.
    cdf = final.double().exp().cumsum(dim=-1)
    draws = [0.0 if p.temperature == 0 else rng.random() for p, rng in zip(params, rngs, strict=True)]
    uniform = torch.tensor(draws, dtype=cdf.dtype, device=logits.device)
    target = (uniform * cdf[:, -1]).unsqueeze(1)
    # Rounding can put the target at or past the CDF's end; never step past the last kept token,
    # and never onto a zero-probability one (right=True skips flat stretches of the CDF).
    index = torch.searchsorted(cdf, target, right=True).squeeze(1)
    kept = keep if keep is not None else final > float("-inf")
    last_kept = vocab - 1 - kept.flip(-1).int().argmax(dim=-1)
    index = torch.minimum(index, last_kept)
    drawn = index if order is None else order.gather(1, index[:, None]).squeeze(1)
    tokens = torch.where(greedy, best_token, drawn)
    logprobs = torch.where(greedy, best_logp, final.gather(1, index[:, None]).squeeze(1))
    return tokens.tolist(), logprobs.tolist()


def distributions(logits: torch.Tensor, params: Sequence[SamplingParams] | SamplingRows) -> tuple[torch.Tensor, torch.Tensor]:
    """What each row samples from, in token-id order: (probs [B, vocab] float64, reported log-probs [B, vocab]).

    Sampled rows: the truncated, renormalised distribution and its log-probs (-inf where cut).
    Greedy rows: a one-hot on the argmax (drawing from it is taking the argmax) and the raw model
    log-probs, as `sample` reports them. Speculative decoding compares these for target and draft.
    """
    rows = _rows(params, logits)
    final, order, _, _, best_token, greedy = _truncate(logits, rows)
    by_id = final if order is None else torch.empty_like(final).scatter_(1, order, final)
    probs = by_id.double().exp()
    if not rows.any_greedy:
        return probs, by_id
    raw = by_id if rows.all_unit_temperature and not rows.any_truncates else torch.log_softmax(logits.float(), dim=-1)
    logp = torch.where(greedy[:, None], raw, by_id)
    one_hot = torch.zeros_like(probs).scatter_(1, best_token[:, None], 1.0)
    return torch.where(greedy[:, None], one_hot, probs), logp
