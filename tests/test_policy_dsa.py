"""DSA top-k: one selection for engine and learner, ties included, on contexts longer than index_topk;
and the frozen indexer stays frozen through a learner step."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_model, run_to_completion

from asyncrl.configs.schema import EmbeddedRolloutConfig, LearnerConfig
from asyncrl.learner.rl import RLLearner, sampled_logprobs
from asyncrl.policy.dsa import selection_mask, topk_positions
from asyncrl.policy.mtp import build_mtp, policy_hidden_and_logits
from asyncrl.policy.routing import use_shared_selection
from asyncrl.policy.tokenizer import build_tokenizer
from asyncrl.records import UNSAMPLED_VERSION, Batch, Sample, SamplingParams
from asyncrl.rollout import EmbeddedEngine

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    # The frozen-indexer steps use made-up rollout log-probs: the learner rightly warns of the gap.
    pytest.mark.filterwarnings("ignore::asyncrl.learner.consistency.LogprobGapWarning"),
]

TOLERANCE = 1e-5
"""Max |engine - learner| log-prob with the same DSA positions (fp32, CPU); measured 1-2e-6 (see test_routing_replay)."""
INDEX_TOPK = 4
PROMPTS = [list(range(20, 34)), [5, 17, 33, 9, 64, 2, 71]]
COMPLETION = 16


def test_ties_go_to_the_earliest_position_whatever_the_sign_of_zero():
    scores = torch.tensor([[0.0, -0.0, 3.0, 0.0, -0.0, float("-inf"), 1.0]])
    assert topk_positions(scores, 4).tolist() == [[2, 6, 0, 1]]
    visible = torch.tensor([[True] * 5 + [False, True]])
    assert selection_mask(scores, 6, visible).tolist() == [[True, True, True, True, True, False, True]]
    # Fewer visible positions than k: the hidden ones come last and stay hidden.
    assert selection_mask(torch.tensor([[0.0, float("-inf")]]), 2, torch.tensor([[True, False]])).tolist() == [[True, False]]


def tied_model(kind: str):
    """A glm_moe_dsa policy whose indexer scores tie: 'all' (zero head weights: every score is 0) or
    'relu' (one head, positive weight: every position whose q.k <= 0 scores exactly 0)."""
    model = make_tiny_model(
        "glm_moe_dsa", num_layers=3, index_topk=INDEX_TOPK, index_heads=1 if kind == "relu" else 2, eos_token_id=None,
        config_overrides={"indexer_types": ["full", "full", "shared"]},
    )  # fmt: skip
    with torch.no_grad():
        for layer in model.model.layers:
            if layer.self_attn.indexer is not None:
                weights = layer.self_attn.indexer.weights_proj.weight
                weights.zero_() if kind == "all" else weights.abs_().add_(0.1)
    return model


def learner_logprobs(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        _, logits = policy_hidden_and_logits(model, ids, torch.ones_like(ids))
    return sampled_logprobs(logits, ids, 1.0)[0, len(prompt) - 1 :]


@pytest.mark.parametrize("kind", ["all", "relu"])
def test_engine_and_learner_attend_to_the_same_positions_on_tied_scores(kind):
    model = tied_model(kind)
    engine = EmbeddedEngine(model, EmbeddedRolloutConfig(max_num_seqs=4))
    params = SamplingParams(temperature=1.0, max_tokens=COMPLETION, seed=3)
    results = run_to_completion(engine, [(p, params) for p in PROMPTS])
    assert all(len(p) + COMPLETION > INDEX_TOPK * 4 for p in PROMPTS)  # the sparse path runs, at most queries

    stock = {r.request_id: learner_logprobs(model, r.prompt_token_ids, r.token_ids) for r in results}  # torch.topk
    chosen: list[torch.Tensor] = []
    use_shared_selection(model)
    hook = model.model.layers[0].self_attn.indexer.register_forward_hook(lambda _m, _i, out: chosen.append(out))
    shared = {r.request_id: learner_logprobs(model, r.prompt_token_ids, r.token_ids) for r in results}
    hook.remove()
    for result in results:
        engine_logprobs = torch.tensor(result.logprobs)
        diff = (shared[result.request_id] - engine_logprobs).abs().max().item()
        assert diff < TOLERANCE, f"{kind} ties, shared selection: max |engine - learner| {diff:.2e}"
    if kind == "all":
        # Every query attends to the first index_topk positions; torch.topk picks other equals.
        assert all((c.sort(dim=-1).values == torch.arange(INDEX_TOPK, dtype=torch.int32)).all() for c in chosen)
        worst = max((stock[r.request_id] - torch.tensor(r.logprobs)).abs().max().item() for r in results)
        assert worst > 1e-2, f"torch.topk happened to break every tie like the shared function ({worst:.2e})"


# --- the frozen indexer ---------------------------------------------------------------------------


def _sample(rollout: str, reward: float, prompt: list[int], completion: list[int]) -> Sample:
    tokens = prompt + completion
    mask = [0] * len(prompt) + [1] * len(completion)
    versions = [0 if m else UNSAMPLED_VERSION for m in mask]
    return Sample(tokens, mask, [-3.0 if m else 0.0 for m in mask], versions, reward, "g", rollout, "ok")


def _indexer_params(learner: RLLearner) -> dict[str, torch.nn.Parameter]:
    named = [*learner.model.named_parameters(), *(("mtp." + n, p) for n, p in learner.mtp.named_parameters())]
    return {name: p for name, p in named if ".indexer." in name}


def _glm_learner(freeze: bool) -> RLLearner:
    model = make_tiny_model("glm_moe_dsa", num_layers=2, index_topk=INDEX_TOPK, eos_token_id=None)
    config = LearnerConfig(group_size=2, lr=1e-2, mtp_loss_weight=0.3, freeze_indexer=freeze)
    return RLLearner(config, model, build_tokenizer(), build_mtp(model, seed=1))


def _step(learner: RLLearner, watched: dict[str, torch.nn.Parameter]) -> set[str]:
    """One learner step; returns the names among `watched` that received a gradient during it."""
    graded: set[str] = set()
    hooks = [p.register_post_accumulate_grad_hook(lambda _p, n=name: graded.add(n)) for name, p in watched.items() if p.requires_grad]
    # Contexts of 20+ tokens against index_topk 4: the indexer's selection shapes every later query.
    samples = [_sample("a", 1.0, PROMPTS[0], list(range(40, 50))), _sample("b", 0.0, PROMPTS[1], list(range(50, 63)))]
    assert learner.train_step(Batch([samples])).stepped
    for hook in hooks:
        hook.remove()
    return graded


def test_frozen_indexer_gets_no_gradient_stays_bit_identical_and_is_not_optimized():
    learner = _glm_learner(freeze=True)
    indexer = _indexer_params(learner)
    assert any(n.startswith("mtp.") for n in indexer) and any(n.startswith("model.") for n in indexer)
    before = {name: p.detach().clone() for name, p in indexer.items()}
    optimized = {id(p) for group in learner.optimizer.param_groups for p in group["params"]}
    q_proj = learner.model.model.layers[0].self_attn.q_a_proj.weight
    graded = _step(learner, {**indexer, "q_a_proj": q_proj})
    assert graded == {"q_a_proj"}  # the attention beside it trains
    for name, param in indexer.items():
        assert torch.equal(param, before[name]), f"{name} moved"
        assert param.grad is None and not param.requires_grad, f"{name} can take a gradient"
        assert id(param) not in optimized, f"{name} is in the optimizer"


def test_unfrozen_indexer_is_optimized_but_gets_no_gradient_from_transformers_forward():
    # transformers computes the indexer under no_grad (its top-k is discrete): freeze_indexer=False
    # lists it in the optimizer, yet the RL loss cannot move it. It learns only from its own KL loss,
    # in the SFT-side warm-up (tests/test_indexer_warmup.py: a warmed-up indexer kept through RL).
    learner = _glm_learner(freeze=False)
    indexer = _indexer_params(learner)
    optimized = {id(p) for group in learner.optimizer.param_groups for p in group["params"]}
    assert all(id(p) in optimized for p in indexer.values())
    before = {name: p.detach().clone() for name, p in indexer.items()}
    assert not _step(learner, indexer)
    assert all(torch.equal(p, before[name]) for name, p in indexer.items())
