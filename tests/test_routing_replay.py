"""MoE routing replay: the engine records the experts behind each sampled token, the learner routes with them.

The central test builds a trajectory with a router near-tie on purpose: at the last prompt
position, the correction bias is set so that the engine's router and the learner's (transformers)
router, whose inputs differ only by float rounding, choose different experts. Without replay the
learner's log-probs then differ from the engine's by far more than rounding; with replay they agree
to rounding (TOLERANCE).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import make_tiny_model, run_to_completion

from asyncrl.configs.schema import EmbeddedRolloutConfig, LearnerConfig
from asyncrl.learner.consistency import LogprobGapWarning
from asyncrl.learner.rl import RLLearner, sampled_logprobs
from asyncrl.learner.routing_replay import replay, routes_tensor
from asyncrl.policy.mtp import build_mtp, policy_hidden_and_logits
from asyncrl.policy.routing import RouterSpec, choose_experts, moe_gates, route, use_shared_selection
from asyncrl.policy.tokenizer import build_tokenizer
from asyncrl.records import Batch, SamplingParams, Trajectory, Turn
from asyncrl.rollout import EmbeddedEngine
from asyncrl.samples import trajectory_to_samples

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOLERANCE = 1e-5
"""Max |engine - learner| log-prob with the same routes and DSA positions (fp32, CPU). Measured: 1-4e-6,
i.e. a few float32 ulps of log-probs around -4: the native forward and transformers' order their
sums differently (fused projections, cached K/V), so 1e-6 is below what two code paths reach."""
PROMPT = [5, 17, 33, 9, 64, 2, 71, 40, 41, 42, 8, 9]
COMPLETION = 10


def engine_for(model, **options) -> EmbeddedEngine:
    return EmbeddedEngine(model, EmbeddedRolloutConfig(max_num_seqs=4, record_routes=True, **options))


def learner_logprobs(model, prompt: list[int], completion: list[int], routes=None) -> torch.Tensor:
    """The learner's log-probs of `completion` (transformers forward, shared selection, optional replay)."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad(), replay(model, routes):
        _, logits = policy_hidden_and_logits(model, ids, torch.ones_like(ids))
    return sampled_logprobs(logits, ids, 1.0)[0, len(prompt) - 1 :]


def learner_routes(model, token_ids: list[int]) -> torch.Tensor:
    """[T, MoE layers, top_k] the experts the learner's own forward chooses (ascending), no replay."""
    chosen: list[torch.Tensor] = []
    hooks = [gate.register_forward_hook(lambda _m, _i, out: chosen.append(out[2])) for gate in moe_gates(model)]
    ids = torch.tensor([token_ids])
    with torch.no_grad(), replay(model, None):
        policy_hidden_and_logits(model, ids, torch.ones_like(ids))
    for hook in hooks:
        hook.remove()
    return torch.stack(chosen, dim=1).sort(dim=-1).values


def sample_routes(prompt: list[int], result) -> torch.Tensor:
    """The micro-batch routes the learner would build from this turn's sample (`Sample.routes`)."""
    tensor = routes_tensor([[None] * len(prompt) + result.routes], len(prompt) + len(result.token_ids))
    assert tensor is not None
    return tensor


# --- the shared router --------------------------------------------------------------------------


def test_router_ties_go_to_the_lower_expert_and_replay_keeps_the_router_gradient():
    spec = RouterSpec(top_k=2, n_group=1, topk_group=1, norm_topk_prob=True, scaling=1.0)
    tied = torch.tensor([[0.5, 0.2, 0.5, 0.5], [0.1, 0.9, 0.9, 0.3]])
    assert choose_experts(tied, spec).tolist() == [[0, 2], [1, 2]]
    logits = torch.randn(3, 4, requires_grad=True)
    given = torch.tensor([[3, 1], [-1, -1], [0, 2]])
    chosen, weights = route(logits, torch.zeros(4), spec, replay=given)
    own = choose_experts(logits.detach().sigmoid(), spec)
    assert chosen.tolist() == [[3, 1], own[1].tolist(), [0, 2]]
    scores = logits.detach().sigmoid()
    assert torch.allclose(weights[0], scores[0, [3, 1]] / scores[0, [3, 1]].sum())
    weights[:, 0].sum().backward()  # the replayed experts' scores carry the router's gradient
    assert logits.grad is not None and logits.grad[0, [1, 3]].abs().min() > 0 and logits.grad[0, [0, 2]].abs().max() == 0


def test_group_limited_choice_matches_transformers_router_without_ties():
    model = make_tiny_model("glm_moe_dsa", num_experts=8, experts_per_token=2, config_overrides={"n_group": 4, "topk_group": 2})
    gate = moe_gates(model)[0]
    x = torch.randn(50, model.config.hidden_size)
    with torch.no_grad():
        _, _, theirs = gate(x)
        use_shared_selection(model)
        _, _, ours = gate(x)
    assert torch.equal(theirs.sort(dim=-1).values, ours.sort(dim=-1).values)


# --- recording ------------------------------------------------------------------------------------


@pytest.mark.parametrize("drafting", [False, True])
def test_engine_records_the_experts_behind_every_sampled_token(drafting):
    model = make_tiny_model("glm_moe_dsa", num_layers=3, eos_token_id=None)
    options = dict(mtp_drafting=True, mtp_draft_tokens=2) if drafting else {}
    engine = EmbeddedEngine(
        model, EmbeddedRolloutConfig(max_num_seqs=4, record_routes=True, **options),
        mtp=build_mtp(model, seed=1) if drafting else None,
    )  # fmt: skip
    prompts = [PROMPT, PROMPT[:5]]
    results = run_to_completion(
        engine, [(p, SamplingParams(temperature=1.0, max_tokens=COMPLETION, seed=s)) for s, p in enumerate(prompts)]
    )
    for prompt, result in zip(prompts, results, strict=True):
        assert len(result.routes) == len(result.token_ids) == COMPLETION
        # routes[i] were chosen at the position that sampled token i: the learner, routing the same
        # tokens itself (no near-ties in this model), chooses the same at positions len(prompt)-1 ...
        own = learner_routes(model, prompt + result.token_ids)[len(prompt) - 1 : -1]
        assert own.tolist() == result.routes


def test_without_record_routes_results_carry_none():
    model = make_tiny_model("glm_moe_dsa")
    engine = EmbeddedEngine(model, EmbeddedRolloutConfig(max_num_seqs=2))
    (result,) = run_to_completion(engine, [(PROMPT, SamplingParams(max_tokens=3, seed=0))])
    assert getattr(result, "routes", None) is None


def test_routes_tensor_shifts_routes_to_the_positions_that_sampled_them():
    rows = [[None, None, [[1, 2]], [[0, 3]]], None, [None, [[2, 3]]]]
    tensor = routes_tensor(rows, 4)
    assert tensor.shape == (3, 4, 1, 2)
    assert tensor[0, :, 0].tolist() == [[-1, -1], [1, 2], [0, 3], [-1, -1]]
    assert (tensor[1] == -1).all() and tensor[2, 0, 0].tolist() == [2, 3]
    assert routes_tensor([None, [None, None]], 2) is None


# --- near-tied routers ----------------------------------------------------------------------------


def _router_inputs_at_last_prompt_position(model, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The router inputs of MoE layer `layer` at every position up to the last prompt one, as the
    engine's prefill and the learner's forward (over a sequence as long as the one to come) compute them."""
    engine = engine_for(model)
    inputs: list[torch.Tensor] = []
    native_moe = engine.model.moe
    engine.model.moe = lambda lw, x: (inputs.append(x.reshape(-1, x.shape[-1]).clone()), native_moe(lw, x))[1]
    run_to_completion(engine, [(PROMPT, SamplingParams(max_tokens=1, seed=0))])
    engine_x = inputs[layer]  # the prefill's MoE calls, one per layer
    captured: list[torch.Tensor] = []
    hook = moe_gates(model)[layer].register_forward_pre_hook(lambda _m, args: captured.append(args[0].reshape(-1, args[0].shape[-1])))
    ids = torch.tensor([PROMPT + [0] * COMPLETION])  # later tokens cannot reach this position
    with torch.no_grad(), replay(model, None):
        policy_hidden_and_logits(model, ids, torch.ones_like(ids))
    hook.remove()
    return engine_x, captured[0][: len(PROMPT)]


def _craft_near_tie(model) -> int:
    """Set one correction-bias entry of the first MoE layer where it can be done so that the engine and
    the learner choose different experts at the last prompt position; returns that layer."""
    spec = RouterSpec.of(model.config)
    for layer, gate in enumerate(moe_gates(model)):
        engine_x, learner_x = _router_inputs_at_last_prompt_position(model, layer)
        with torch.no_grad():
            # Scores as each forward computes them: one matmul over all its positions, then the last prompt one.
            engine_s, learner_s = (F.linear(x.float(), gate.weight.float()).sigmoid()[-1] for x in (engine_x, learner_x))
            bias = gate.e_score_correction_bias
            ranked = (engine_s + bias).argsort(descending=True)
            last_in, first_out = int(ranked[spec.top_k - 1]), int(ranked[spec.top_k])
            tie = (engine_s[last_in] + bias[last_in]) - engine_s[first_out]  # the engine's exact tie
            # Walk float32 values outward from the tie until the two routers disagree.
            for direction in (float("inf"), float("-inf")):
                candidate = tie
                for _ in range(64):
                    trial = bias.clone()
                    trial[first_out] = candidate
                    if not torch.equal(*(choose_experts((s + trial)[None], spec).sort().values for s in (engine_s, learner_s))):
                        bias.copy_(trial)
                        return layer
                    candidate = torch.nextafter(candidate, torch.tensor(direction))
    raise AssertionError("the engine's and the learner's router scores are bit-identical at that position in every MoE layer")


def test_replay_makes_the_learner_match_the_engine_on_a_near_tied_router():
    model = make_tiny_model("glm_moe_dsa", num_layers=4, eos_token_id=None)
    use_shared_selection(model)
    layer = _craft_near_tie(model)
    (result,) = run_to_completion(engine_for(model), [(PROMPT, SamplingParams(temperature=1.0, max_tokens=COMPLETION, seed=7))])
    recorded = sample_routes(PROMPT, result)
    own = learner_routes(model, PROMPT + result.token_ids)
    assert not torch.equal(own[len(PROMPT) - 1, layer], recorded[0, len(PROMPT) - 1, layer])  # the near-tie split them

    engine = torch.tensor(result.logprobs)
    off = (learner_logprobs(model, PROMPT, result.token_ids) - engine).abs().max().item()
    on = (learner_logprobs(model, PROMPT, result.token_ids, recorded) - engine).abs().max().item()
    assert on < TOLERANCE, f"with routing replay: max |engine - learner| {on:.2e}"
    assert off > 100 * TOLERANCE, f"without routing replay: max |engine - learner| only {off:.2e}"


def test_recorded_routes_travel_through_turns_and_samples_to_the_learner():
    # Two turns of one session (the second prefilled over the first's retained cache), recorded as
    # the gateway records them, assembled into a sample, replayed by the learner on a near-tied router.
    model = make_tiny_model("glm_moe_dsa", num_layers=4, eos_token_id=None)
    use_shared_selection(model)
    _craft_near_tie(model)
    engine = EmbeddedEngine(model, EmbeddedRolloutConfig(max_num_seqs=2, record_routes=True))
    params = SamplingParams(temperature=1.0, max_tokens=COMPLETION, seed=5)
    (first,) = run_to_completion(engine, [(PROMPT, params)], session_id="r")
    second_prompt = PROMPT + first.token_ids + [60, 61, 62]  # the environment's reply in between
    (second,) = run_to_completion(engine, [(second_prompt, params)], session_id="r")
    assert second.cached_prompt_tokens > 0
    turns = [
        Turn("r", result.prompt_token_ids, result.token_ids, result.logprobs, result.versions, result.finish_reason, routes=result.routes)
        for result in (first, second)
    ]
    (sample,) = trajectory_to_samples(Trajectory("r", turns=turns, status="ok", reward=1.0))
    routes = routes_tensor([sample.routes], len(sample.token_ids))
    ids = torch.tensor([sample.token_ids])
    sampled = torch.tensor(sample.loss_mask[1:], dtype=torch.bool)
    engine_logprobs = torch.tensor(sample.logprobs[1:])[sampled]
    for replayed, check in ((routes, lambda d: d < TOLERANCE), (None, lambda d: d > 100 * TOLERANCE)):
        with torch.no_grad(), replay(model, replayed):
            _, logits = policy_hidden_and_logits(model, ids, torch.ones_like(ids))
        diff = (sampled_logprobs(logits, ids, 1.0)[0][sampled] - engine_logprobs).abs().max().item()
        assert check(diff), f"replay {'on' if replayed is not None else 'off'}: max |engine - learner| {diff:.2e}"


@pytest.mark.parametrize("routing_replay", [True, False])
def test_learner_step_replays_the_recorded_routes(routing_replay):
    # The learner's own step (learner.routing_replay) on a group recorded over a near-tied router:
    # its logged gap to the engine is rounding with replay and a flipped expert's worth without.
    model = make_tiny_model("glm_moe_dsa", num_layers=4, eos_token_id=None)
    use_shared_selection(model)
    _craft_near_tie(model)
    results = run_to_completion(
        engine_for(model), [(PROMPT, SamplingParams(temperature=1.0, max_tokens=COMPLETION, seed=s)) for s in (7, 8)]
    )
    samples = []
    for i, r in enumerate(results):
        turn = Turn(f"r{i}", r.prompt_token_ids, r.token_ids, r.logprobs, r.versions, r.finish_reason, routes=r.routes)
        samples += trajectory_to_samples(Trajectory(f"r{i}", group_id="g", turns=[turn], status="ok", reward=float(i)))
    # Whole rows without replay too: the tie was crafted against a whole-row forward, and a prefix pass of other
    # shapes rounds the router's scores its own way (on some CPUs past the tie, on others not).
    config = LearnerConfig(group_size=2, routing_replay=routing_replay, share_prefixes=False)
    learner = RLLearner(config, model, build_tokenizer())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LogprobGapWarning)  # expected without replay
        step = learner.train_step(Batch([samples]))
    if routing_replay:
        assert step.metrics["logprob_gap_max"] < TOLERANCE
    else:
        assert step.metrics["logprob_gap_max"] > 100 * TOLERANCE


@pytest.mark.parametrize("family", ["glm4_moe", "deepseek_v3"])
def test_the_other_sigmoid_moe_families_record_and_replay_routes(family):
    # GLM-4.5 and DeepSeek-V3 run natively with the same router: the engine records what it chose and the
    # learner's transformers model replays it, with every MoE layer's gate found.
    from families import tiny_family_model

    model = tiny_family_model(family, eos_token_id=None)
    assert len(moe_gates(model)) == 1  # two layers, the first dense
    results = run_to_completion(
        engine_for(model), [(PROMPT, SamplingParams(temperature=1.0, max_tokens=COMPLETION, seed=s)) for s in (7, 8)]
    )
    samples = []
    for i, r in enumerate(results):
        assert len(r.routes) == COMPLETION
        turn = Turn(f"r{i}", r.prompt_token_ids, r.token_ids, r.logprobs, r.versions, r.finish_reason, routes=r.routes)
        samples += trajectory_to_samples(Trajectory(f"r{i}", group_id="g", turns=[turn], status="ok", reward=float(i)))
    step = RLLearner(LearnerConfig(group_size=2, routing_replay=True), model, build_tokenizer()).train_step(Batch([samples]))
    assert step.stepped and step.metrics["logprob_gap_max"] < TOLERANCE
