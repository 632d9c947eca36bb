"""The learner's log-probs through the head at trained positions only (asyncrl/policy/token_logprobs.py).

What must hold: the figures are those of the full-vocabulary softmax at every position, read where a token
is trained (at each token's own temperature); the other positions carry the rollout's log-probs; chunking
changes neither the figures nor the gradients (autograd's, through the full softmax); and what is kept for
the backward pass is one softmax for one chunk and none for several (read from autograd's saved tensors,
which do not depend on the machine's timing or allocator).
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_model
from learner_steps import batch_for, record_gradients

from asyncrl.configs.schema import LearnerConfig
from asyncrl.learner.rl import RLLearner, sampled_logprobs
from asyncrl.policy.mtp import build_mtp, mtp_loss, policy_hidden_and_logits
from asyncrl.policy.token_logprobs import masked_cross_entropy, trainable_logprobs, trainable_logprobs_and_entropy
from asyncrl.policy.tokenizer import build_tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # compared to 1e-6, on one thread

ROWS, WIDTH, HIDDEN, VOCAB = 3, 9, 16, 2000


def case(seed: int = 0) -> dict:
    """A micro-batch's tensors: hidden states, ids, per-token temperatures, a loss mask with a row that trains
    nothing, and rollout log-probs to fill with."""
    generator = torch.Generator().manual_seed(seed)
    loss_mask = (torch.rand(ROWS, WIDTH, generator=generator) < 0.6).float()
    loss_mask[:, 0] = 0
    loss_mask[2] = 0
    return {
        "hidden": torch.randn(ROWS, WIDTH, HIDDEN, generator=generator, requires_grad=True),
        "input_ids": torch.randint(0, VOCAB, (ROWS, WIDTH), generator=generator),
        "temperatures": 0.5 + torch.rand(ROWS, WIDTH, generator=generator),
        "loss_mask": loss_mask,
        "fill": -torch.rand(ROWS, WIDTH, generator=generator) * loss_mask,
    }


def head(bias: bool = False) -> torch.nn.Linear:
    torch.manual_seed(1)
    projection = torch.nn.Linear(HIDDEN, VOCAB, bias=bias)
    if bias:
        torch.nn.init.normal_(projection.bias)
    return projection


@pytest.mark.parametrize("chunk_tokens", [1, 4, 4096])
def test_trained_positions_get_the_full_softmax_at_their_temperature_and_the_rest_the_rollout_figures(chunk_tokens):
    inputs, projection = case(), head()
    got = trainable_logprobs(projection, chunk_tokens=chunk_tokens, **inputs)
    with torch.no_grad():
        full = sampled_logprobs(projection(inputs["hidden"]), inputs["input_ids"], inputs["temperatures"][:, 1:])
    trained = inputs["loss_mask"][:, 1:].bool()
    assert got.shape == (ROWS, WIDTH - 1) and got.dtype == torch.float32 and int(trained.sum()) > 4
    torch.testing.assert_close(got[trained], full[trained], atol=1e-6, rtol=0)
    assert torch.equal(got[~trained], inputs["fill"][:, 1:][~trained])


def gradients(chunk_tokens: int | None, bias: bool) -> tuple[list[torch.Tensor], list[torch.Size]]:
    """The gradients of the hidden states and the head's parameters of a loss that weighs every position
    differently, and the shapes of what autograd saved for the backward pass; `chunk_tokens` None: autograd
    through `sampled_logprobs`, the reference."""
    inputs, projection = case(), head(bias)
    saved: list[torch.Size] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor.shape)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        if chunk_tokens is None:
            logp = sampled_logprobs(projection(inputs["hidden"]), inputs["input_ids"], inputs["temperatures"][:, 1:])
        else:
            logp = trainable_logprobs(projection, chunk_tokens=chunk_tokens, **inputs)
    trained = inputs["loss_mask"][:, 1:].bool()
    weights = torch.linspace(-1.0, 1.0, logp.numel()).view_as(logp) * trained  # every trained position its own share
    (logp * weights).sum().backward()
    return [inputs["hidden"].grad, *(p.grad for p in projection.parameters())], saved


@pytest.mark.parametrize("bias", [False, True])
def test_the_gradients_are_autograds_through_the_full_softmax_in_one_chunk_or_several(bias):
    reference, _ = gradients(None, bias)
    assert len(reference) == (3 if bias else 2) and all(float(g.abs().sum()) > 0 for g in reference)
    for chunk_tokens in (4, 4096):
        got, _ = gradients(chunk_tokens, bias)
        for a, b in zip(got, reference, strict=True):
            torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-5)


def test_one_chunk_keeps_one_softmax_for_the_backward_pass_and_several_keep_none():
    trained = int(case()["loss_mask"][:, 1:].sum())
    vocabulary_wide = lambda shapes: [s for s in shapes if s[-1] == VOCAB]  # noqa: E731
    _, reference = gradients(None, False)
    assert len(vocabulary_wide(reference)) >= 2  # autograd's softmax path keeps logits and more
    _, one = gradients(4096, False)
    assert vocabulary_wide(one) == [torch.Size([trained, VOCAB])]
    _, several = gradients(4, False)
    assert vocabulary_wide(several) == []  # recomputed from the chunks' hidden states in the backward pass


def test_nothing_trained_still_gives_the_head_a_zero_gradient():
    # A sharded or replicated learner reduces every parameter's gradient; an absent one would desynchronize ranks.
    inputs, projection = case(), head()
    inputs["loss_mask"] = torch.zeros_like(inputs["loss_mask"])
    logp = trainable_logprobs(projection, chunk_tokens=4, **inputs)
    (logp.sum() * 0.0).backward()
    assert projection.weight.grad is not None and not projection.weight.grad.any()


@pytest.mark.parametrize("share_prefixes", [False, True])
def test_a_learner_step_in_chunks_of_three_positions_is_the_step_in_one(share_prefixes):
    def learner(chunk_tokens: int) -> RLLearner:
        model = make_tiny_model("qwen3")
        config = LearnerConfig(
            group_size=4, lr=1e-3, weight_decay=0.0, mtp_loss_weight=0.3, logits_chunk_tokens=chunk_tokens, share_prefixes=share_prefixes
        )
        return RLLearner(config, model, build_tokenizer(), build_mtp(model, seed=1))

    whole, chunked = learner(4096), learner(3)
    gradients = [record_gradients(whole), record_gradients(chunked)]
    a, b = whole.train_step(batch_for(whole)), chunked.train_step(batch_for(chunked))
    assert a.metrics["computed_trainable_tokens"] > 3 * a.metrics["micro_batches"]  # every micro-batch really ran in chunks
    assert b.loss == pytest.approx(a.loss, abs=1e-6) and b.grad_norm == pytest.approx(a.grad_norm, rel=1e-5)
    assert b.metrics["abs_logp_diff"] == pytest.approx(a.metrics["abs_logp_diff"], abs=1e-6)
    assert b.metrics["mtp_loss"] == pytest.approx(a.metrics["mtp_loss"], rel=1e-6)
    (of_whole,), (of_chunked,) = gradients
    assert of_whole.keys() == of_chunked.keys() and len(of_whole) > 5
    for name, gradient in of_whole.items():
        torch.testing.assert_close(of_chunked[name], gradient, atol=1e-7, rtol=1e-5, msg=name)


def test_the_masked_cross_entropy_is_the_full_softmax_one_weighted_by_the_mask():
    inputs, projection = case(), head(bias=True)
    weights = inputs["loss_mask"] * torch.linspace(0.5, 2.0, WIDTH)  # a float mask weighs its tokens
    with torch.no_grad():
        logits = projection(inputs["hidden"])[:, :-1]
        per_token = torch.nn.functional.cross_entropy(logits.transpose(1, 2), inputs["input_ids"][:, 1:], reduction="none")
        expected = (per_token * weights[:, 1:]).sum()
        for chunk_tokens in (3, 4096):
            got = masked_cross_entropy(projection, inputs["hidden"], inputs["input_ids"], weights, chunk_tokens)
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-6)


def test_the_mtp_loss_in_chunks_is_the_loss_in_one():
    model = make_tiny_model("qwen3")
    ids = torch.randint(20, 100, (3, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(3, 12)
    mask[:, 4:] = 1
    results = []
    for chunk_tokens in (2, 4096):
        mtp = build_mtp(model, seed=1)
        hidden = policy_hidden_and_logits(model, ids)[0].detach()
        loss = mtp_loss(model, mtp, hidden, ids, None, mask, depth=2, chunk_tokens=chunk_tokens)
        loss.backward()
        results.append((loss.detach(), [p.grad for p in mtp.parameters() if p.grad is not None]))
    (chunked, chunked_grads), (whole, whole_grads) = results
    torch.testing.assert_close(chunked, whole, atol=1e-6, rtol=1e-6)
    assert len(whole_grads) == len(chunked_grads) > 3
    for a, b in zip(chunked_grads, whole_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-5)


def reference_entropy(projection: torch.nn.Linear, inputs: dict) -> torch.Tensor:
    """[B, T-1] entropy of softmax(logits / T) at every position, by autograd's own softmax."""
    logits = projection(inputs["hidden"])[:, :-1] / inputs["temperatures"][:, 1:, None]
    logp = torch.log_softmax(logits, -1)
    return -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("chunk_tokens", [1, 4, 4096])
def test_entropy_and_its_gradient_are_the_full_softmaxs_at_trained_positions(chunk_tokens):
    inputs, projection = case(), head(bias=True)
    logp, entropy = trainable_logprobs_and_entropy(projection, chunk_tokens=chunk_tokens, **inputs)
    trained = inputs["loss_mask"][:, 1:].bool()
    weights = torch.linspace(-1.0, 1.0, entropy.numel()).view_as(entropy) * trained
    others = torch.linspace(0.7, -0.4, entropy.numel()).view_as(entropy) * trained
    (entropy * weights + logp * others).sum().backward()  # both outputs carry gradient at once
    got = [inputs["hidden"].grad.clone(), *(p.grad.clone() for p in projection.parameters())]
    inputs["hidden"].grad = None
    projection.zero_grad()
    expected = reference_entropy(projection, inputs)
    torch.testing.assert_close(entropy[trained], expected[trained].detach(), atol=1e-5, rtol=0)
    assert torch.equal(entropy[~trained], torch.zeros_like(entropy[~trained]))
    full = sampled_logprobs(projection(inputs["hidden"]), inputs["input_ids"], inputs["temperatures"][:, 1:])
    (expected * weights + full * others).sum().backward()
    for mine, theirs in zip(got, [inputs["hidden"].grad, *(p.grad for p in projection.parameters())], strict=True):
        assert float(theirs.abs().sum()) > 0
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_truncated_support_is_the_samplers_own(seed):
    """The learner's kept set of a truncated token is the engine's (rollout/sampler.py), token for token, and
    its log-probs over it are the sampler's final ones."""
    from asyncrl.policy.token_logprobs import truncated_support
    from asyncrl.records import SamplingParams
    from asyncrl.rollout.sampler import _truncate

    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, 50, generator=generator) * 3
    logits[0, 7] = logits[0, 9]  # a tie, broken by token id in both
    params = [SamplingParams(temperature=t, top_p=p, top_k=k) for t, p, k in
              ((1.0, 0.9, 0), (0.7, 1.0, 5), (1.3, 0.5, 10), (1.0, 1.0, 0), (1.0, 0.95, 1), (2.0, 0.3, 49))]  # fmt: skip
    final, order, keep, *_ = _truncate(logits, params)
    engine_keep = torch.zeros_like(keep).scatter_(-1, order, keep)
    scaled = logits / torch.tensor([p.temperature for p in params])[:, None]
    targets = scaled.argmax(-1)  # always kept by both
    top_k, top_p = torch.tensor([p.top_k for p in params]), torch.tensor([p.top_p for p in params])
    ours = truncated_support(scaled, top_k, top_p, targets)
    assert torch.equal(ours, engine_keep) and 0 < int(ours.sum()) < ours.numel()
    engine_logp = torch.empty_like(final).scatter_(-1, order, final)
    learner_logp = torch.log_softmax(scaled.masked_fill(~ours, float("-inf")), -1)
    torch.testing.assert_close(learner_logp[ours], engine_logp[ours], atol=1e-5, rtol=0)
