"""Speculative decoding with the policy's MTP layer: draft D tokens, verify them in one target forward.

Exactness is the rejection rule of Leviathan et al. / Chen et al. (2023): draft token x, drawn from
the drafter's distribution q, is kept with probability min(1, p(x)/q(x)) under the target's p; at
the first rejection the token is drawn from norm(max(0, p - q)), and when every draft is kept a
bonus token is drawn from p at the next position. Each emitted token is then distributed exactly as
if the target had sampled it alone. p and q are the same filtered distributions the plain sampler
draws from (temperature, top-k, top-p; a one-hot for greedy), and the log-probs returned are the
target's, so the learner's importance ratios see the same numbers as without drafting.

Every random number comes from the request's own stream, a fixed count per step (one per draft
drawn, one per draft tested, one for the last token), so a seeded request samples the same tokens
whatever else is batched.

KV rollback is free in the paged cache: a rejected draft's K/V sits past the request's `computed`
frontier, in its own blocks, where no later query looks before it is overwritten (a block is shared
only once every position in it is computed).
"""

from __future__ import annotations

import torch
from torch.nn.utils.rnn import pad_sequence

from .kv_cache import ForwardBatch
from .sampler import SamplingRows, distributions


def draw(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw, in token-id order, of one token per row of probs [N, V] (float64)."""
    cdf = probs.cumsum(dim=-1)
    index = torch.searchsorted(cdf, (uniforms * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
    # Rounding can reach past the last token with mass; never land on a zero-probability one.
    last = probs.shape[1] - 1 - (probs > 0).flip(-1).int().argmax(dim=-1)
    return torch.minimum(index, last)


def verify(
    p: torch.Tensor,
    q: torch.Tensor,
    drafts: torch.Tensor,
    num_drafts: torch.Tensor,
    accept_uniforms: torch.Tensor,
    final_uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rejection rule for a batch: (drafts accepted [B], the token after them [B]).

    p [B, D+1, V]: target distributions at the D+1 verified positions; q [B, D, V]: the drafter's
    at the first D; drafts [B, D]; num_drafts [B] <= D (columns past a row's count are ignored);
    accept_uniforms [B, D] and final_uniforms [B] in [0, 1).
    """
    rows, depth = drafts.shape
    arange = torch.arange(rows, device=p.device)
    if depth == 0:
        return torch.zeros(rows, dtype=torch.long, device=p.device), draw(p[:, 0], final_uniforms)
    p_draft = p[:, :depth].gather(2, drafts.unsqueeze(2)).squeeze(2)
    q_draft = q.gather(2, drafts.unsqueeze(2)).squeeze(2)
    # u < p/q without dividing: q > 0 wherever a draft was drawn.
    kept = (accept_uniforms * q_draft < p_draft) & (torch.arange(depth, device=p.device)[None, :] < num_drafts[:, None])
    accepted = kept.long().cumprod(dim=1).sum(dim=1)
    p_next = p[arange, accepted]
    residual = (p_next - q[arange, accepted.clamp(max=depth - 1)]).clamp(min=0.0)
    # A rejection means p < q somewhere, so the residual has mass; rounding aside (then p itself).
    rejected = (accepted < num_drafts) & (residual.sum(dim=1) > 0)
    final = draw(torch.where(rejected[:, None], residual, p_next), final_uniforms)
    return accepted, final


class SpeculativeDecoder:
    """One decode step for a batch of running requests: draft with the MTP layer, verify, accept.

    Request state it reads and keeps (fields of the engine's `Request`, rollout/request.py): `blocks`, `computed`,
    `prompt` + `output`, `params`, `rng`, and `mtp_computed` / `mtp_hidden`: the MTP layer's K/V
    covers positions before `mtp_computed`, and `mtp_hidden` holds the target's hidden states of
    positions mtp_computed..computed-1, fed to the MTP layer at the next step.

    At this model size a step costs mostly per-call overhead, not arithmetic, so the step works on
    whole-batch tensors: drafts and their distributions go straight into [B, D] / [B, D, V] tensors,
    sampling options become tensors once per step, and Python touches each request only to draw its
    uniforms and to hand its tokens back.
    """

    def __init__(self, model, mtp, cache, draft_tokens: int, device: torch.device) -> None:
        self.model, self.mtp, self.cache = model, mtp, cache
        self.draft_tokens = draft_tokens
        self.device = device

    def step(self, batch: list) -> tuple[list[list[int]], list[list[float]], list[int], torch.Tensor]:
        """(tokens, target log-probs, drafts proposed, target hidden states [B, D+1, H]) per request.

        The caller keeps a prefix of each request's tokens (it may stop early) and advances
        `computed` by that many; the hidden states of the kept positions go to `mtp_hidden`.
        """
        size, vocab, device = len(batch), self.model.vocab_size, self.device
        counts = [min(self.draft_tokens, r.params.max_tokens - len(r.output) - 1) for r in batch]
        depth = max(counts)
        rows = SamplingRows([r.params for r in batch], vocab, device)
        uniforms = self._uniforms(batch, counts, depth)
        drafts = torch.zeros(size, depth, dtype=torch.long, device=device)
        q = torch.zeros(size, depth, vocab, dtype=torch.float64, device=device)
        if depth:
            self._draft(batch, counts, rows, uniforms, drafts, q)

        width = depth + 1
        last = torch.tensor([(r.output or r.prompt)[-1] for r in batch], dtype=torch.long, device=device)
        ragged = None if min(counts) == depth else [n + 1 for n in counts]
        forward = ForwardBatch.from_tokens(
            [r.blocks for r in batch], torch.cat([last[:, None], drafts], 1), [r.computed for r in batch], self.cache.block_size, ragged
        )
        hidden = self.model.hidden_states(forward, self.cache)
        logits = self.model.logits(hidden).reshape(-1, vocab)
        p, logp = distributions(logits, rows.repeat(width))
        p, logp = p.view(size, width, vocab), logp.view(size, width, vocab)
        accepted, final = verify(p, q, drafts, torch.tensor(counts, device=device), uniforms[:, depth : 2 * depth], uniforms[:, 2 * depth])
        # Emitted tokens are the accepted drafts, then the final token at column `accepted`.
        emitted = torch.cat([drafts, final[:, None]], 1).scatter_(1, accepted[:, None], final[:, None])
        emitted_logp = logp.gather(2, emitted[:, :, None]).squeeze(2)
        kept = [n + 1 for n in accepted.tolist()]
        tokens = [row[:n] for row, n in zip(emitted.tolist(), kept, strict=True)]
        logprobs = [row[:n] for row, n in zip(emitted_logp.tolist(), kept, strict=True)]
        return tokens, logprobs, counts, hidden

    def _uniforms(self, batch: list, counts: list[int], depth: int) -> torch.Tensor:
        """[B, 2D+1] float64: per request, its draft draws, its acceptance tests, its last token.

        Each request draws its 2n+1 numbers from its own stream in one go, in that order, so a
        seeded request's tokens do not depend on what else is batched; unused columns are 0.
        """
        table = []
        for request, n in zip(batch, counts, strict=True):
            draws = [request.rng.random() for _ in range(2 * n + 1)]
            pad = [0.0] * (depth - n)
            table.append(draws[:n] + pad + draws[n : 2 * n] + pad + draws[2 * n :])
        return torch.tensor(table, dtype=torch.float64, device=self.device)

    def _draft(
        self, batch: list, counts: list[int], rows: SamplingRows, uniforms: torch.Tensor, drafts: torch.Tensor, q: torch.Tensor
    ) -> None:
        """Chain `counts[b]` drafts per request into drafts[b] and the distributions drawn from into q[b]."""
        active = [b for b, n in enumerate(counts) if n > 0]
        requests = [batch[b] for b in active]
        index = None if len(active) == len(batch) else torch.tensor(active, device=self.device)
        # Depth 1 catches the MTP layer up on every position the target computed since its last
        # step (the prompt, after prefill; the kept tokens, after a verify).
        catch_up = ForwardBatch.build(
            [r.blocks for r in requests],
            [r.context(r.mtp_computed + 1, r.computed + 1) for r in requests],
            [r.mtp_computed for r in requests],
            self.cache.block_size,
            self.device,
        )
        logits, hidden = self.mtp.forward(catch_up, self.cache, pad_sequence([r.mtp_hidden for r in requests], batch_first=True))
        for r in requests:
            r.mtp_computed, r.mtp_hidden = r.computed, None
        step_rows = rows if index is None else rows.select(index)
        tables, starts = [r.blocks for r in requests], [r.computed for r in requests]
        forward: ForwardBatch | None = None
        for step in range(max(counts)):
            probs, _ = distributions(logits, step_rows)
            column = uniforms[:, step] if index is None else uniforms[index, step]
            tokens = draw(probs, column)
            if index is None:
                drafts[:, step], q[:, step] = tokens, probs
            else:
                drafts[index, step], q[index, step] = tokens, probs
            going = [i for i, b in enumerate(active) if counts[b] > step + 1]
            if not going:
                return
            if len(going) < len(active):  # only near max_tokens: some requests want fewer drafts
                keep = torch.tensor(going, device=self.device)
                active = [active[i] for i in going]
                index = torch.tensor(active, device=self.device)
                step_rows = rows.select(index)
                tables, starts = [tables[i] for i in going], [starts[i] for i in going]
                tokens, hidden = tokens[keep], hidden[keep]
                forward = None
            # Depth k > 1 sits one position further on, fed the MTP layer's own output as the hidden state.
            if forward is None:
                forward = ForwardBatch.from_tokens(tables, tokens[:, None], [s + step for s in starts], self.cache.block_size)
            else:
                forward = forward.next_position(tokens[:, None])
            logits, hidden = self.mtp.forward(forward, self.cache, hidden.unsqueeze(1), chained=True)
