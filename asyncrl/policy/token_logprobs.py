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
    """[B, T-1] float32: where `loss_mask[:, j+1]` is set, the log-prob of token j+1 given tokens 0..j under
    softmax(head(hidden[:, j]) / temperatures[:, j+1]) (what `learner.rl.sampled_logprobs` gives at every
    position); `fill[:, 1:]` elsewhere. `hidden` is [B, T, H]; the other tensors are [B, T]; `head` is the
    policy's linear output layer. `hidden[:, j]` may be any state the head reads to predict token j+1 (an MTP
    depth's, with the ids shifted to match)."""
    if not isinstance(head, nn.Linear):
        raise TypeError(f"the learner scores through a linear output head; this policy's is {type(head).__name__}")
    scored = loss_mask[:, 1:].bool()
    states = hidden[:, :-1][scored]
    targets = input_ids[:, 1:][scored]
    scales = temperatures[:, 1:][scored].float()
    # An empty selection still runs the head: its gradient is then zero rather than missing, which the
    # sharded and replicated gradient reductions rely on.
    starts = range(0, max(len(states), 1), chunk_tokens)
    recompute = len(starts) > 1
    pieces = []
    for i in starts:
        chunk = slice(i, i + chunk_tokens)
        pieces.append(_HeadLogprobs.apply(states[chunk], head.weight, head.bias, targets[chunk], scales[chunk], recompute))
    return fill[:, 1:].detach().float().masked_scatter(scored, torch.cat(pieces))


def masked_cross_entropy(
    head: nn.Module, hidden: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor, chunk_tokens: int
) -> torch.Tensor:
    """sum_j loss_mask[:, j+1] * -log softmax(head(hidden[:, j]))[token j+1]: the summed next-token cross-entropy
    over the tokens the mask trains (a float mask weighs them), through `trainable_logprobs` at temperature 1."""
    ones = torch.ones_like(loss_mask, dtype=torch.float32)
    logp = trainable_logprobs(head, hidden, input_ids, ones, loss_mask, torch.zeros_like(ones), chunk_tokens)
    return -(logp * loss_mask[:, 1:]).sum()


def _scaled_logits(states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperatures: torch.Tensor) -> torch.Tensor:
    """[n, V] float32 logits / temperature, in a buffer of their own (modified in place by the callers)."""
    logits = F.linear(states, weight, bias)
    logits = logits.float() if logits.dtype != torch.float32 else logits
    return logits.div_(temperatures[:, None])


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
    ) -> torch.Tensor:
        scaled = _scaled_logits(states, weight, bias, temperatures)
        chosen = scaled.gather(-1, targets[:, None]).squeeze(-1)
        # logsumexp by hand, in the one buffer (torch.logsumexp would allocate another of the same size).
        top = scaled.amax(dim=-1, keepdim=True)
        probs = scaled.sub_(top).exp_()
        total = probs.sum(dim=-1, keepdim=True)
        lse = (total.log() + top).squeeze(-1)
        ctx.recompute = recompute
        if recompute:
            del scaled, probs
            ctx.save_for_backward(states, weight, bias, targets, temperatures, lse)
        else:
            ctx.save_for_backward(states, weight, bias, targets, temperatures, probs.div_(total))
        return chosen - lse

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        states, weight, bias, targets, temperatures, kept = ctx.saved_tensors
        # Recomputing, `kept` is the log-sum-exp: the softmax again, in the recomputed buffer.
        probs = _scaled_logits(states, weight, bias, temperatures).sub_(kept[:, None]).exp_() if ctx.recompute else kept
        # d logp / d scaled = onehot(target) - softmax; then d scaled / d logits = 1 / T.
        d_scaled = probs.mul_(-grad[:, None]).scatter_add_(-1, targets[:, None], grad[:, None])
        d_logits = d_scaled.div_(temperatures[:, None]).to(weight.dtype)
        d_states = d_logits @ weight if ctx.needs_input_grad[0] else None
        d_weight = d_logits.t() @ states.to(weight.dtype) if ctx.needs_input_grad[1] else None
        d_bias = d_logits.sum(0) if bias is not None and ctx.needs_input_grad[2] else None
        return d_states, d_weight, d_bias, None, None, None
