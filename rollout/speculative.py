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

KV rollback is free in the slot cache: a rejected draft's K/V sits past the request's `computed`
frontier, where no later query looks before it is overwritten.
"""

from __future__ import annotations

import torch
from torch.nn.utils.rnn import pad_sequence

from .kv_cache import ForwardBatch
from .sampler import distributions


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

    Request state it reads and keeps (fields of the engine's `_Request`): `slot`, `computed`,
    `prompt` + `output`, `params`, `rng`, and `mtp_computed` / `mtp_hidden`: the MTP layer's K/V
    covers positions before `mtp_computed`, and `mtp_hidden` holds the target's hidden states of
    positions mtp_computed..computed-1, fed to the MTP layer at the next step.
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
        counts = [min(self.draft_tokens, r.params.max_tokens - len(r.output) - 1) for r in batch]
        drafts, q_rows = self._draft(batch, counts)
        depth = max(counts)
        rows = [[(r.output or r.prompt)[-1]] + d for r, d in zip(batch, drafts)]
        forward = ForwardBatch.build([r.slot for r in batch], rows, [r.computed for r in batch], self.device)
        hidden = self.model.hidden_states(forward, self.cache)
        width, vocab = hidden.shape[1], self.model.vocab_size
        logits = self.model.logits(hidden).reshape(-1, vocab)
        p, logp = distributions(logits, [r.params for r in batch for _ in range(width)])
        p, logp = p.view(len(batch), width, vocab), logp.view(len(batch), width, vocab)
        q = torch.zeros(len(batch), depth, vocab, dtype=p.dtype, device=self.device)
        draft_t = torch.zeros(len(batch), depth, dtype=torch.long, device=self.device)
        accept_u = torch.zeros(len(batch), depth, dtype=torch.float64)
        final_u = torch.zeros(len(batch), dtype=torch.float64)
        for b, (request, count) in enumerate(zip(batch, counts)):
            if count:
                q[b, :count] = torch.stack(q_rows[b])
                draft_t[b, :count] = torch.tensor(drafts[b], device=self.device)
                accept_u[b, :count] = torch.tensor([request.rng.random() for _ in range(count)], dtype=torch.float64)
            final_u[b] = request.rng.random()
        accepted, final = verify(
            p, q, draft_t, torch.tensor(counts, device=self.device), accept_u.to(self.device), final_u.to(self.device)
        )
        tokens, logprobs = [], []
        for b, (n, last) in enumerate(zip(accepted.tolist(), final.tolist())):
            emitted = drafts[b][:n] + [last]
            tokens.append(emitted)
            logprobs.append(logp[b, torch.arange(n + 1), torch.tensor(emitted)].tolist())
        return tokens, logprobs, counts, hidden

    def _draft(self, batch: list, counts: list[int]) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
        """Chain `counts[b]` drafts per request: token ids and the distribution each was drawn from."""
        drafts: list[list[int]] = [[] for _ in batch]
        q_rows: list[list[torch.Tensor]] = [[] for _ in batch]
        active = [b for b, n in enumerate(counts) if n > 0]
        if not active:
            return drafts, q_rows
        # Depth 1 catches the MTP layer up on every position the target computed since its last
        # step (the prompt, after prefill; the kept tokens, after a verify).
        requests = [batch[b] for b in active]
        rows = [(r.prompt + r.output)[r.mtp_computed + 1 : r.computed + 1] for r in requests]
        forward = ForwardBatch.build([r.slot for r in requests], rows, [r.mtp_computed for r in requests], self.device)
        logits, hidden = self.mtp.forward(forward, self.cache, pad_sequence([r.mtp_hidden for r in requests], batch_first=True))
        for r in requests:
            r.mtp_computed, r.mtp_hidden = r.computed, r.mtp_hidden[:0]
        step = 0
        while True:
            probs, _ = distributions(logits, [batch[b].params for b in active])
            uniforms = torch.tensor([batch[b].rng.random() for b in active], dtype=torch.float64, device=self.device)
            tokens = draw(probs, uniforms).tolist()
            for i, b in enumerate(active):
                drafts[b].append(tokens[i])
                q_rows[b].append(probs[i])
            step += 1
            going = [i for i, b in enumerate(active) if counts[b] > step]
            if not going:
                return drafts, q_rows
            active = [active[i] for i in going]
            # Depth k > 1 sits one position further on, fed the MTP layer's own output as the hidden state.
            forward = ForwardBatch.build(
                [batch[b].slot for b in active],
                [[drafts[b][-1]] for b in active],
                [batch[b].computed + step - 1 for b in active],
                self.device,
            )
            logits, hidden = self.mtp.forward(forward, self.cache, hidden[going].unsqueeze(1))
