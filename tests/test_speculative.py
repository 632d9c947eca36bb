"""MTP speculative decoding: the rejection rule keeps the target's distribution, and the engine with
drafting samples what the engine without it would (greedy: the same tokens; sampled: the same
distribution, the target's log-probs).

Statistical tests use a fixed seed (deterministic) and reject at significance ALPHA: with a wrong
rule (e.g. always accepting drafts, or resampling from p instead of the residual) they fail by
many orders of magnitude.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import make_tiny_model, run_to_completion
from pydantic import ValidationError
from test_engine_numerics import assert_matches_hf

from asyncrl.configs.schema import EmbeddedRolloutConfig
from asyncrl.policy.mtp import build_mtp, mtp_logits, policy_hidden_and_logits
from asyncrl.records import SamplingParams
from asyncrl.rollout import EmbeddedEngine
from asyncrl.rollout.sampler import distributions
from asyncrl.rollout.speculative import draw, verify

ALPHA = 1e-3
"""Significance of every chi-square test here."""


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of observed counts against exact probabilities; cells of probability 0 must be empty.

    Cells expecting fewer than 5 samples are pooled into one (and that into the smallest other
    cell while it still expects fewer than 5), the usual condition for the chi-square law.
    """
    counts, probs = counts.flatten().double(), probs.flatten().double()
    assert counts[probs == 0].sum() == 0, "a token outside the target's support was emitted"
    counts, probs = counts[probs > 0], probs[probs > 0]
    total = counts.sum()
    order = torch.argsort(probs)
    counts, probs = counts[order], probs[order]
    small = int((probs * total < 5).sum())
    while small and small < len(probs) and probs[:small].sum() * total < 5:
        small += 1
    if small:
        counts = torch.cat([counts[:small].sum()[None], counts[small:]])
        probs = torch.cat([probs[:small].sum()[None], probs[small:]])
    assert len(probs) >= 2, "too few samples for a chi-square test"
    expected = probs * total
    stat = ((counts - expected) ** 2 / expected).sum()
    dof = torch.tensor(float(len(probs) - 1), dtype=torch.float64)
    return torch.special.gammaincc(dof / 2, stat / 2).item()


# --- the rejection rule alone, on a synthetic target and drafter ---------------------------------


@pytest.mark.parametrize("options", [dict(temperature=1.0), dict(temperature=0.8, top_p=0.8)], ids=["t1", "top_p"])
def test_verify_keeps_the_target_distribution(options):
    """Three tokens over a 4-token vocabulary, each conditioned on the ones before it (target and
    drafter disagree). One speculative round with 2 drafts, the rest of the sequence sampled
    directly from the target: the joint of the 3 tokens must be the target's."""
    vocab, rows = 4, 200_000
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(**options)

    def table(shape):  # filtered distributions, [*shape, vocab], from random logits
        logits = torch.randn(*shape, vocab, generator=gen)
        return distributions(logits.reshape(-1, vocab), [params] * logits[..., 0].numel())[0].view(*shape, vocab)

    p1, p2, p3 = table(()), table((vocab,)), table((vocab, vocab))
    q1, q2 = table(()), table((vocab,))
    u = torch.rand(rows, 6, generator=gen, dtype=torch.float64)
    d1 = draw(q1.expand(rows, -1), u[:, 0])
    d2 = draw(q2[d1], u[:, 1])
    p = torch.stack([p1.expand(rows, -1), p2[d1], p3[d1, d2]], dim=1)
    q = torch.stack([q1.expand(rows, -1), q2[d1]], dim=1)
    accepted, final = verify(p, q, torch.stack([d1, d2], 1), torch.full((rows,), 2), u[:, 2:4], u[:, 4])
    emitted = torch.stack([d1, d2, torch.zeros_like(d1)], 1)
    emitted[torch.arange(rows), accepted] = final
    # Complete short rounds from the target itself: x2 after one token, x3 after two.
    x1 = emitted[:, 0]
    x2 = torch.where(accepted >= 1, emitted[:, 1], draw(p2[x1], u[:, 5]))
    x3 = torch.where(accepted >= 2, emitted[:, 2], draw(p3[x1, x2], torch.rand(rows, generator=gen, dtype=torch.float64)))
    counts = torch.zeros(vocab, vocab, vocab).index_put_((x1, x2, x3), torch.ones(rows), accumulate=True)
    exact = p1[:, None, None] * p2[:, :, None] * p3
    assert chi_square_p_value(counts, exact) > ALPHA
    assert 0 < (accepted == 2).float().mean() < 1  # both outcomes of the rule were exercised


def test_a_wrong_rule_fails_the_same_test():
    """The test has power: accepting every draft samples the drafter's distribution, and is rejected."""
    vocab, rows = 4, 200_000
    gen = torch.Generator().manual_seed(1)
    p = torch.softmax(2 * torch.randn(vocab, generator=gen), -1).double()
    q = torch.softmax(2 * torch.randn(vocab, generator=gen), -1).double()
    drafts = draw(q.expand(rows, -1), torch.rand(rows, generator=gen, dtype=torch.float64))
    counts = torch.bincount(drafts, minlength=vocab)
    assert chi_square_p_value(counts, p) < 1e-9


def test_greedy_rows_accept_exactly_the_target_argmax():
    p = torch.tensor([[[0, 1, 0], [1, 0, 0], [0, 0, 1]]], dtype=torch.float64).expand(2, -1, -1)
    q = torch.tensor([[[0, 1, 0], [0, 0, 1]], [[0, 1, 0], [1, 0, 0]]], dtype=torch.float64)
    drafts = torch.tensor([[1, 2], [1, 0]])
    accepted, final = verify(
        p, q, drafts, torch.tensor([2, 2]), torch.full((2, 2), 0.99, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)
    )
    assert accepted.tolist() == [1, 2]
    assert final.tolist() == [0, 2]  # the target's argmax at the rejected position; the bonus token


# --- the engine ---------------------------------------------------------------------------------


def engine(model, mtp=None, **options) -> EmbeddedEngine:
    return EmbeddedEngine(model, EmbeddedRolloutConfig(max_num_seqs=64, **options), mtp=mtp)


@pytest.fixture(scope="module")
def small_vocab():
    """A qwen3 policy over 6 tokens (no EOS) and an untrained MTP layer: drafts often right, often wrong."""
    model = make_tiny_model("qwen3", eos_token_id=None, config_overrides={"vocab_size": 6})
    return model, build_mtp(model, seed=1).eval()


@pytest.mark.parametrize("arch", ["qwen3", "glm_moe_dsa"])
def test_native_mtp_layer_matches_the_trained_module(arch):
    """The engine's drafter computes what asyncrl.policy.mtp computes (depth 1, every position)."""
    from asyncrl.rollout.kv_cache import ForwardBatch, KVCache
    from asyncrl.rollout.models import build_model
    from asyncrl.rollout.models.mtp import NativeMTP

    model = make_tiny_model(arch)
    mtp = build_mtp(model, seed=2).eval()
    with torch.no_grad():
        for param in mtp.parameters():  # unit scale, as make_tiny_model does, so every part matters
            param.normal_(0.0, param.shape[-1] ** -0.5) if param.dim() >= 2 else param.normal_(1.0, 0.1)
    ids = torch.tensor([[7, 30, 31, 50, 9, 12, 44, 3]])
    with torch.no_grad():
        hidden, _ = policy_hidden_and_logits(model, ids)
        expected = mtp_logits(model, mtp, hidden, ids, None, depth=1)[0][0, :-1]
    native = build_model(model.config, model.state_dict(), max_len=64, dtype=torch.float32, device=torch.device("cpu"))
    drafter = NativeMTP(native, mtp.state_dict())
    # Blocks of 4 in reverse order: the drafter's reads cross blocks as the engine's do.
    table, cpu = [16, 12, 8, 4], torch.device("cpu")
    cache = KVCache(native.cache_layout(extra_layers=1), 17, 4, max_len=64, dtype=torch.float32, device=cpu)
    tokens = ids[0].tolist()
    target = native.hidden_states(ForwardBatch.build([table], [tokens], [0], 4, cpu), cache)
    # Positions 0..5 in one forward, then position 6 alone: the drafter's K/V cache is used too.
    first, _ = drafter.forward(ForwardBatch.build([table], [tokens[1:7]], [0], 4, cpu), cache, target[:, :6])
    second, _ = drafter.forward(ForwardBatch.build([table], [tokens[7:8]], [6], 4, cpu), cache, target[:, 6:7])
    torch.testing.assert_close(first[0], expected[5], atol=1e-4, rtol=0)
    torch.testing.assert_close(second[0], expected[6], atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ["qwen3", "glm_moe_dsa"])
def test_greedy_output_identical_to_plain_decoding(arch):
    model = make_tiny_model(arch, eos_token_id=None, config_overrides={"vocab_size": 8})
    mtp = build_mtp(model, seed=1).eval()
    prompts = [[5, 1, 3, 6, 4, 2, 7], [4, 1, 2], [i % 8 for i in range(3, 28)]]
    greedy = SamplingParams(temperature=0, max_tokens=24)
    plain = run_to_completion(engine(model), [(p, greedy) for p in prompts])
    drafting = engine(model, mtp, mtp_drafting=True, mtp_draft_tokens=3)
    spec = run_to_completion(drafting, [(p, greedy) for p in prompts])
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    torch.testing.assert_close(torch.tensor([r.logprobs for r in spec]), torch.tensor([r.logprobs for r in plain]), atol=1e-5, rtol=0)
    accept = drafting.health()["mtp_accept_len"]
    assert 1.0 < accept < 4.0  # drafts were both accepted and rejected, so both paths ran
    assert all(r.mtp_verify_steps > 0 and r.mtp_accept_len >= 1.0 for r in spec)


@pytest.mark.parametrize("arch", ["qwen3", "glm_moe_dsa"])
def test_returned_logprobs_are_the_target_full_forward(arch):
    model = make_tiny_model(arch)
    mtp = build_mtp(model, seed=1).eval()
    prompts = [[5, 17, 33, 9, 64, 2, 71], [40, 41, 42], list(range(20, 45))]
    params = SamplingParams(temperature=0.7, max_tokens=16, seed=3)
    results = run_to_completion(engine(model, mtp, mtp_drafting=True), [(p, params) for p in prompts])
    assert_matches_hf(model, results, temperature=0.7)


def test_seeded_requests_sample_the_same_tokens_whatever_the_batch(small_vocab):
    model, mtp = small_vocab
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=20, seed=11)
    alone = run_to_completion(engine(model, mtp, mtp_drafting=True), [([1, 2, 3], params)])[0]
    others = [([4, 5, 0, 1], SamplingParams(temperature=1.0, max_tokens=9, seed=s)) for s in range(5)]
    crowd = run_to_completion(engine(model, mtp, mtp_drafting=True), [*others[:2], ([1, 2, 3], params), *others[2:]])[2]
    assert crowd.token_ids == alone.token_ids
    assert crowd.logprobs == pytest.approx(alone.logprobs, abs=1e-5)


@pytest.mark.parametrize("options", [dict(temperature=1.0), dict(temperature=1.0, top_p=0.8)], ids=["t1", "top_p"])
def test_engine_samples_the_target_distribution(small_vocab, options):
    """3 tokens after a fixed prompt (1 from prefill, 2 from one verify step with 2 drafts), many
    seeds: their joint is chi-square-tested against the exact target distribution from HF forwards."""
    model, mtp = small_vocab
    vocab, prompt, requests = 6, [1, 4, 2], 3000
    params = SamplingParams(max_tokens=3, **options)
    drafting = engine(model, mtp, mtp_drafting=True, mtp_draft_tokens=2)
    results = run_to_completion(drafting, [(prompt, SamplingParams(**{**params.__dict__, "seed": s})) for s in range(requests)])
    counts = torch.zeros(vocab, vocab, vocab)
    for r in results:
        counts[tuple(r.token_ids)] += 1
    prefixes = [[]] + [[a] for a in range(vocab)] + [list(ab) for ab in itertools.product(range(vocab), repeat=2)]
    with torch.no_grad():
        logits = torch.stack([model(torch.tensor([prompt + x])).logits[0, -1] for x in prefixes])
    probs = distributions(logits, [params] * len(prefixes))[0]
    p1, p2, p3 = probs[0], probs[1 : 1 + vocab], probs[1 + vocab :].view(vocab, vocab, vocab)
    exact = p1[:, None, None] * p2[:, :, None] * p3
    assert chi_square_p_value(counts, exact) > ALPHA
    assert 1.0 < drafting.health()["mtp_accept_len"] < 3.0


def test_draft_count_out_of_range_is_a_config_error():
    with pytest.raises(ValidationError, match="mtp_draft_tokens"):
        EmbeddedRolloutConfig(mtp_draft_tokens=0)
    with pytest.raises(ValidationError, match="exceeds mtp_max_draft_tokens"):
        EmbeddedRolloutConfig(mtp_draft_tokens=9, mtp_max_draft_tokens=8)


def test_engine_refuses_bad_drafting_setups(small_vocab):
    model, mtp = small_vocab
    with pytest.raises(ValueError, match="needs the policy's MTP layer"):
        EmbeddedEngine(model, EmbeddedRolloutConfig(mtp_drafting=True))
    # model_copy skips validation; the engine checks again at start-up.
    unchecked = EmbeddedRolloutConfig(mtp_drafting=True).model_copy(update={"mtp_draft_tokens": 0})
    with pytest.raises(ValueError, match="mtp_draft_tokens must be in"):
        EmbeddedEngine(model, unchecked, mtp=mtp)


def test_serve_gives_drafting_engines_the_policys_mtp_layer(tmp_path):
    """`asyncrl serve` with rollout.mtp_drafting: engines draft with the checkpoint's MTP layer, and a
    checkpoint without one is refused at start-up (no fresh, untrained drafter in its place)."""
    from asyncrl.configs.schema import RunConfig
    from asyncrl.jobs.serve import _engines, _policy
    from asyncrl.policy.checkpoint import build_tokenizer, save_policy

    model = make_tiny_model("qwen3")
    mtp = build_mtp(model, seed=1).eval()
    save_policy(tmp_path / "with", model, build_tokenizer(), mtp)
    save_policy(tmp_path / "without", model, build_tokenizer())
    rollout = {"mtp_drafting": True, "num_workers": 1, "max_num_seqs": 2}
    config = RunConfig.model_validate({"policy": {"path": str(tmp_path / "with")}, "rollout": rollout})
    loaded, _, loaded_mtp = _policy(config)
    [handle] = _engines(config, loaded, loaded_mtp)
    engine = handle.engine
    torch.testing.assert_close(engine.drafter.weights["eh_proj"], mtp.state_dict()["eh_proj.weight"])
    [result] = run_to_completion(engine, [([5, 17, 33], SamplingParams(max_tokens=6, seed=0))])
    assert len(result.token_ids) == 6 and result.mtp_verify_steps > 0
    config = RunConfig.model_validate({"policy": {"path": str(tmp_path / "without")}, "rollout": rollout})
    with pytest.raises(ValueError, match="has no MTP layer to draft with"):
        _policy(config)


def test_chained_draft_batches_equal_freshly_built_ones():
    """`ForwardBatch.next_position` (chained drafts) describes the same forward as building it anew."""
    from asyncrl.rollout.kv_cache import ForwardBatch

    tables = [[1, 2, 3, 4], [9, 8, 7, 6], [5, 10, 11, 12]]
    first = ForwardBatch.from_tokens(tables, torch.tensor([[7], [8], [9]]), [5, 11, 3], 4)
    chained = first.next_position(torch.tensor([[1], [2], [3]]))
    fresh = ForwardBatch.build(tables, [[1], [2], [3]], [6, 12, 4], 4, torch.device("cpu"))
    for name in ("tables", "tokens", "positions", "last_index", "mask", "write_index", "read_index"):
        assert torch.equal(getattr(chained, name), getattr(fresh, name)), name
    assert (chained.context_len, chained.write_rows) == (fresh.context_len, None)
    assert chained.write_index.tolist() == [2 * 4 + 2, 6 * 4 + 0, 10 * 4 + 0]  # row 0 position 6: its block 2, offset 2


def test_drafting_after_a_prompt_prefilled_in_pieces_is_unchanged():
    model = make_tiny_model("qwen3", eos_token_id=None, config_overrides={"vocab_size": 8})
    mtp = build_mtp(model, seed=1).eval()
    prompts = [[i % 8 for i in range(3, 40)], [4, 1, 2]]
    greedy = SamplingParams(temperature=0, max_tokens=16)
    whole = run_to_completion(engine(model, mtp, mtp_drafting=True, mtp_draft_tokens=3), [(p, greedy) for p in prompts])
    drafting = engine(model, mtp, mtp_drafting=True, mtp_draft_tokens=3, prefill_chunk_tokens=16)
    pieces = run_to_completion(drafting, [(p, greedy) for p in prompts])
    assert [r.token_ids for r in pieces] == [r.token_ids for r in whole]
    assert [r.mtp_accept_len for r in pieces] == [r.mtp_accept_len for r in whole]  # the drafter saw every prompt position
