"""Log-probs through a policy's output head, computed only at the positions a loss reads.

The RL objective, the consistency figures and the distillation advantages read log pi(token j+1 | tokens
0..j) at trainable positions only (loss mask 1 on token j+1); the SFT loss and the MTP loss are
cross-entropies over trained tokens. Full-vocabulary logits at every position, upcast to float32 for the
softmax, are most of a large-vocabulary policy's activation memory: 8,192 tokens of a 151,936-word
vocabulary are 5 GB per float32 copy, and autograd's softmax keeps several (the upcast, the
temperature-scaled logits, its own output). So the head runs on the trained positions' hidden states
alone, at most `chunk_tokens` of them at a time, through `_HeadLogprobs`, which differentiates the
log-softmax by hand and works on one float32 [positions, vocabulary] buffer in place:

- one chunk (the common case on small batches): the buffer becomes the softmax and is kept for the backward
  pass, nothing recomputed;
- several chunks: each chunk keeps only its hidden states and recomputes its logits in the backward pass
  (one more head matmul over the trained positions), so one chunk's buffer exists at a time.

`trainable_logprobs` gives every other position `fill` (for the RL learner, the rollout's own log-probs,
detached): the objective masks those positions, and a ratio of exactly 1 there keeps an overflow out of
its masked arithmetic.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

DEFAULT_CHUNK_TOKENS = 2048
"""Most positions whose logits exist at once where no setting says otherwise (`learner.logits_chunk_tokens`'s
default too): 2048 x 151,936 words is a 1.2 GB float32 buffer."""


def trainable_logprobs(
    head: nn.Module,
    hidden: torch.Tensor,
    input_ids: torch.Tensor,
    temperatures: torch.Tensor,
    loss_mask: torch.Tensor,
    fill: torch.Tensor,
    chunk_tokens: int,
) -> torch.Tensor:
    """The log-probs of `trainable_logprobs_and_entropy`."""
    return trainable_logprobs_and_entropy(head, hidden, input_ids, temperatures, loss_mask, fill, chunk_tokens)[0]


def trainable_logprobs_and_entropy(
    head: nn.Module,
    hidden: torch.Tensor,
    input_ids: torch.Tensor,
    temperatures: torch.Tensor,
    loss_mask: torch.Tensor,
    fill: torch.Tensor,
    chunk_tokens: int,
    truncation: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, T-1] float32 log-probs, [B, T-1] float32 entropies). Where `loss_mask[:, j+1]` is set: the log-prob
    of token j+1 given tokens 0..j under softmax(head(hidden[:, j]) / temperatures[:, j+1]) (what
    `learner.rl.sampled_logprobs` gives at every position), and the entropy of that distribution, with its
    gradient (an entropy bonus), for one more pass over the logits; `fill[:, 1:]` and 0 elsewhere. `hidden` is
    [B, T, H]; the other tensors are [B, T]; `head` is the policy's linear output layer. `hidden[:, j]` may be
    any state the head reads to predict token j+1 (an MTP depth's, with the ids shifted to match).
    `truncation`: ([B, T] top-k, [B, T] top-p) token j+1 was sampled under; its distribution is then the engine's
    truncated one (`truncated_support`), renormalised over what it keeps."""
    if not isinstance(head, nn.Linear):
        raise TypeError(f"the learner scores through a linear output head; this policy's is {type(head).__name__}")
    scored = loss_mask[:, 1:].bool()
    # In the head's dtype: a decoder run under bfloat16 autocast over float32 weights (learner.precision
    # bf16-mixed) may hand over bfloat16 states, and its logits are computed in float32 all the same.
    states = hidden[:, :-1][scored].to(head.weight.dtype)
    targets = input_ids[:, 1:][scored]
    scales = temperatures[:, 1:][scored].float()
    cuts = None if truncation is None else (truncation[0][:, 1:][scored], truncation[1][:, 1:][scored].float())
    # An empty selection still runs the head: its gradient is then zero rather than missing, which the
    # sharded and replicated gradient reductions rely on.
    starts = range(0, max(len(states), 1), chunk_tokens)
    recompute = len(starts) > 1
    pieces, entropies = [], []
    for i in starts:
        chunk = slice(i, i + chunk_tokens)
        cut = None if cuts is None else (cuts[0][chunk], cuts[1][chunk])
        logp, entropy = _HeadLogprobs.apply(states[chunk], head.weight, head.bias, targets[chunk], scales[chunk], recompute, cut)
        pieces.append(logp)
        entropies.append(entropy)
    logp = fill[:, 1:].detach().float().masked_scatter(scored, torch.cat(pieces))
    return logp, torch.zeros_like(logp).masked_scatter(scored, torch.cat(entropies))


def masked_cross_entropy(
    head: nn.Module, hidden: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor, chunk_tokens: int
) -> torch.Tensor:
    """sum_j loss_mask[:, j+1] * -log softmax(head(hidden[:, j]))[token j+1]: the summed next-token cross-entropy
    over the tokens the mask trains (a float mask weighs them), through `trainable_logprobs` at temperature 1."""
    ones = torch.ones_like(loss_mask, dtype=torch.float32)
    logp = trainable_logprobs(head, hidden, input_ids, ones, loss_mask, torch.zeros_like(ones), chunk_tokens)
    return -(logp * loss_mask[:, 1:]).sum()


def truncated_support(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """[n, V] bool: the tokens the engine's sampler keeps (rollout/sampler.py) from logits / temperature `scaled`:
    top-k of the probability order (ties by token id), then the smallest head of that renormalised distribution
    whose mass before a token is below top-p. The sampled token is always kept: should the learner's logits
    rank it out where the engine's did not, its log-prob stays finite (the objective's ratio then shows the gap)."""
    n, vocab = scaled.shape
    keep = torch.ones_like(scaled, dtype=torch.bool)
    rows = ((top_k > 0) & (top_k < vocab) | (top_p < 1.0)).nonzero().squeeze(-1)
    if len(rows):
        by_prob, order = torch.log_softmax(scaled[rows], dim=-1).sort(dim=-1, descending=True, stable=True)
        k = torch.where((top_k[rows] > 0) & (top_k[rows] < vocab), top_k[rows], vocab)
        kept = torch.arange(vocab, device=scaled.device)[None, :] < k[:, None]
        head = by_prob.masked_fill(~kept, float("-inf"))
        probs = (head - torch.logsumexp(head, dim=-1, keepdim=True)).exp()
        kept &= ((probs.cumsum(dim=-1) - probs) < top_p[rows, None]) | (top_p[rows, None] >= 1.0)
        keep[rows] = torch.zeros_like(kept).scatter_(-1, order, kept)
    keep[torch.arange(n, device=scaled.device), targets] = True
    return keep


def _scaled_logits(
    states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    temperatures: torch.Tensor,
    cut: tuple[torch.Tensor, torch.Tensor] | None = None,
    targets: torch.Tensor | None = None,
) -> torch.Tensor:
    """[n, V] float32 logits / temperature, in a buffer of their own (modified in place by the callers); with
    `cut` (top-k, top-p), -inf outside the truncated support of each position (`targets` always inside)."""
    with _no_autocast(states):  # the head's matmul in the weights' dtype, under an autocast or not
        logits = F.linear(states, weight, bias)
    logits = logits.float() if logits.dtype != torch.float32 else logits
    logits = logits.div_(temperatures[:, None])
    if cut is not None and targets is not None:
        logits.masked_fill_(~truncated_support(logits, cut[0], cut[1], targets), float("-inf"))
    return logits


def _no_autocast(states: torch.Tensor) -> torch.autocast:
    return torch.autocast(states.device.type, enabled=False)


ENTROPY_ROWS = 256
"""Positions whose x log x terms exist at once while an entropy is summed (a [rows, vocabulary] buffer)."""


def _entropy(unnormalized: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """[n] entropy of softmax rows from e = exp(s - max s) and its row sums Z: H = log Z - sum(e log e) / Z."""
    sums = torch.cat([torch.special.xlogy(block, block).sum(-1) for block in unnormalized.split(ENTROPY_ROWS)])
    total = total.squeeze(-1)
    return total.log() - sums / total


def _entropy_gradient(probs: torch.Tensor, entropy: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """[n, V] grad x d H / d scaled = -grad x p (log p + H) (x log x written as xlogy, so p = 0 gives 0)."""
    return -(torch.special.xlogy(probs, probs) + probs * entropy[:, None]) * grad[:, None]


class _HeadLogprobs(torch.autograd.Function):
    """log softmax(head(states) / T)[target] for n positions, with the gradient written out:
    d/d(scaled logits) = grad * (onehot(target) - softmax), then through 1/T and the head's matmul. The graph
    is backpropagated once (the learner's step), so the kept softmax buffer is reused for the gradient."""

    @staticmethod
    def forward(
        ctx: Any,
        states: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        temperatures: torch.Tensor,
        recompute: bool,
        cut: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        scaled = _scaled_logits(states, weight, bias, temperatures, cut, targets)
        chosen = scaled.gather(-1, targets[:, None]).squeeze(-1)
        # logsumexp by hand, in the one buffer (torch.logsumexp would allocate another of the same size).
        top = scaled.amax(dim=-1, keepdim=True)
        probs = scaled.sub_(top).exp_()
        total = probs.sum(dim=-1, keepdim=True)
        lse = (total.log() + top).squeeze(-1)
        entropy = _entropy(probs, total)
        ctx.recompute, ctx.cut = recompute, cut
        ctx.set_materialize_grads(False)
        if recompute:
            del scaled, probs
            ctx.save_for_backward(states, weight, bias, targets, temperatures, entropy, lse)
        else:
            ctx.save_for_backward(states, weight, bias, targets, temperatures, entropy, probs.div_(total))
        return chosen - lse, entropy

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None, grad_entropy: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        states, weight, bias, targets, temperatures, entropy, kept = ctx.saved_tensors
        # Recomputing, `kept` is the log-sum-exp: the softmax again, in the recomputed buffer (the same support).
        recomputed = _scaled_logits(states, weight, bias, temperatures, ctx.cut, targets) if ctx.recompute else None
        probs = recomputed.sub_(kept[:, None]).exp_() if recomputed is not None else kept
        # d H / d scaled = -p (log p + H): in a buffer of its own, before `probs` becomes the log-prob's gradient.
        d_entropy = _entropy_gradient(probs, entropy, grad_entropy) if grad_entropy is not None else None
        grad = torch.zeros_like(entropy) if grad is None else grad
        # d logp / d scaled = onehot(target) - softmax; then d scaled / d logits = 1 / T.
        d_scaled = probs.mul_(-grad[:, None]).scatter_add_(-1, targets[:, None], grad[:, None])
        if d_entropy is not None:
            d_scaled += d_entropy
        d_logits = d_scaled.div_(temperatures[:, None]).to(weight.dtype)
        with _no_autocast(states):
            d_states = d_logits @ weight if ctx.needs_input_grad[0] else None
            d_weight = d_logits.t() @ states.to(weight.dtype) if ctx.needs_input_grad[1] else None
        d_bias = d_logits.sum(0) if bias is not None and ctx.needs_input_grad[2] else None
        return d_states, d_weight, d_bias, None, None, None, None
