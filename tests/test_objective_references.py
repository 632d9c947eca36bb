"""Every objective against an independent reference on random inputs: loss and gradient within 1e-6.

Where TRL's GRPOTrainer has the variant (its loss types, sequence-level importance sampling, its vLLM
importance-sampling modes), the reference is TRL's own `_compute_loss` run on the same tensors (the trainer's
forward replaced by the tensors, its bookkeeping by a stub). For the rest the reference is the paper's
formula written out here, token by token, without calling the project's code.
"""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from asyncrl.configs.learner import LearnerConfig
from asyncrl.learner.objectives import StepTotals, build_objective, token_weights
from asyncrl.learner.reference import kl_estimate

pytest.importorskip("trl")
from trl import GRPOTrainer

B, T = 5, 9
TOLERANCE = 1e-6


def random_inputs(seed: int, spread: float = 0.3) -> dict[str, torch.Tensor]:
    """float64 log-probs of pi_theta (with gradient), pi_old and pi_rollout near each other, advantages, and
    a loss mask whose rows end at different lengths (one row a single token)."""
    generator = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=generator, dtype=torch.float64) * 3
    logp = (old + spread * torch.randn(B, T, generator=generator, dtype=torch.float64)).requires_grad_(True)
    rollout = old + spread * torch.randn(B, T, generator=generator, dtype=torch.float64)
    lengths = [T, T - 2, 4, 1, T - 1]
    mask = torch.tensor([[1.0 if t < n else 0.0 for t in range(T)] for n in lengths], dtype=torch.float64)
    advantages = torch.randn(B, generator=generator, dtype=torch.float64)
    return {"logp": logp, "old": old, "rollout": rollout, "mask": mask, "advantages": advantages}


def asyncrl_loss(inputs: dict, learner: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, d loss / d logp) of the project's objective and aggregation on `inputs`."""
    config = LearnerConfig(**learner)
    logp, mask = inputs["logp"], inputs["mask"]
    out = build_objective(config.objective)(logp, inputs["rollout"], inputs["advantages"], mask, old=inputs["old"])
    totals = StepTotals(tokens=int(mask.sum()), samples=int((mask.sum(-1) > 0).sum()))
    weights = token_weights(mask, config.loss_aggregation, totals, config.loss_constant).to(logp.dtype)
    loss = (out.per_token * weights).sum()
    (grad,) = torch.autograd.grad(loss, logp)
    return loss.detach(), grad


class _Accelerator:
    num_processes = 1
    sync_gradients = True

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x


def trl_loss(inputs: dict, **settings) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, d loss / d logp) of TRL's GRPOTrainer._compute_loss on `inputs`: its forward returns our logp."""
    logp, mask = inputs["logp"], inputs["mask"]
    defaults = dict(
        beta=0.0, epsilon_low=0.2, epsilon_high=0.28, importance_sampling_level="token", loss_type="grpo",
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, use_vllm=False, vllm_importance_sampling_correction=False,
        aux_loss_enabled=False, _entropy_bonus_enabled=False, current_gradient_accumulation_steps=1, max_completion_length=T,
    )  # fmt: skip
    trainer = SimpleNamespace(**{**defaults, **settings})
    trainer.args = SimpleNamespace(delta=None, use_bias_correction_kl=False, steps_per_generation=1)
    trainer.accelerator = _Accelerator()
    trainer.model = SimpleNamespace(training=True)
    trainer._metrics = defaultdict(lambda: defaultdict(list))
    trainer.ref_model = None
    trainer._get_per_token_logps_and_entropies = lambda *args, **kwargs: (logp, torch.zeros_like(logp), None)
    batch = {
        "prompt_ids": torch.ones(B, 2, dtype=torch.long), "prompt_mask": torch.ones(B, 2, dtype=torch.long),
        "completion_ids": torch.ones(B, T, dtype=torch.long), "completion_mask": mask,
        "advantages": inputs["advantages"], "old_per_token_logps": inputs["old"], "num_items_in_batch": mask.sum(),
    }  # fmt: skip
    for key in ("importance_sampling_ratio", "ref_per_token_logps"):
        if key in inputs:
            batch[key] = inputs[key]
    loss = GRPOTrainer._compute_loss(trainer, None, batch)
    (grad,) = torch.autograd.grad(loss, logp)
    return loss.detach(), grad


def assert_same(ours: tuple[torch.Tensor, torch.Tensor], reference: tuple[torch.Tensor, torch.Tensor]) -> None:
    assert ours[0].item() == pytest.approx(reference[0].item(), abs=TOLERANCE)
    assert (ours[1] - reference[1]).abs().max().item() < TOLERANCE
    assert reference[1].abs().max().item() > 1e-3  # a gradient to compare, not two zeros


# -- against TRL's own loss code ------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(
    "trl_type, aggregation",
    [("grpo", {"loss_aggregation": "sequence_mean"}), ("bnpo", {}), ("dapo", {}),
     ("dr_grpo", {"loss_aggregation": "constant", "loss_constant": T})],
)  # fmt: skip
def test_ppo_equals_trl_loss_types(seed, trl_type, aggregation):
    inputs = random_inputs(seed)
    ours = asyncrl_loss(inputs, {"objective": {"name": "ppo", "eps_low": 0.2, "eps_high": 0.28}, **aggregation})
    assert_same(ours, trl_loss(inputs, loss_type=trl_type, epsilon_low=0.2, epsilon_high=0.28))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gspo_equals_trl_sequence_level_importance_sampling(seed):
    inputs = random_inputs(seed, spread=0.05)
    objective = {"name": "gspo", "eps_low": 0.01, "eps_high": 0.02}
    ours = asyncrl_loss(inputs, {"objective": objective, "loss_aggregation": "sequence_mean"})
    reference = trl_loss(inputs, loss_type="grpo", importance_sampling_level="sequence", epsilon_low=0.01, epsilon_high=0.02)
    assert_same(ours, reference)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cispo_equals_trl_cispo(seed):
    inputs = random_inputs(seed, spread=0.5)
    # TRL's epsilon_high is the weight's cap itself; ours is the cap's distance from 1.
    ours = asyncrl_loss(inputs, {"objective": {"name": "cispo", "eps_high": 0.3}})
    assert_same(ours, trl_loss(inputs, loss_type="cispo", epsilon_high=1.3))


def trl_sampling_ratio(inputs: dict, mode: str, cap: float) -> torch.Tensor:
    """TRL's vLLM importance-sampling ratio as its generation step computes it: exp of the masked old - sampling
    log-prob gap, per token or summed per sequence, then truncated at `cap` or zeroed above it."""
    gap = (inputs["old"] - inputs["rollout"]) * inputs["mask"]
    if mode.startswith("sequence"):
        gap = gap.sum(-1, keepdim=True)
    ratio = torch.exp(gap)
    return ratio.clamp(max=cap) if mode.endswith("truncate") else ratio.masked_fill(ratio > cap, 0.0)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_ppo_corrections_equal_trl_vllm_importance_sampling(seed, mode):
    inputs = random_inputs(seed, spread=0.4)
    # The cap at the median weight, so that some tokens (or samples) are over it and some under.
    cap = float(trl_sampling_ratio(inputs, mode, math.inf).expand(B, T)[inputs["mask"].bool()].median())
    inputs["importance_sampling_ratio"] = trl_sampling_ratio(inputs, mode, cap)
    level, kind = mode.split("_")
    correction = {"kind": kind, "level": level, "high": cap}
    ours = asyncrl_loss(inputs, {"objective": {"name": "ppo", "correction": correction}, "loss_aggregation": "sequence_mean"})
    reference = trl_loss(inputs, use_vllm=True, vllm_importance_sampling_correction=True)
    assert_same(ours, reference)
    # The comparison covered weights the correction changed as well as ones it kept.
    weight = inputs["importance_sampling_ratio"].expand(B, T)[inputs["mask"].bool()]
    assert (weight < cap).any() and (weight == (0 if kind == "mask" else cap)).any()


# -- against the papers' formulas, written out token by token ------------------------------------------


def written_out(inputs: dict, token_loss, aggregation: str = "token_mean") -> tuple[torch.Tensor, torch.Tensor]:
    """sum over samples i and trained tokens t of token_loss(i, t) / the aggregation's divisor, with plain loops."""
    logp, mask = inputs["logp"], inputs["mask"]
    total = logp.new_zeros(())
    tokens = int(mask.sum())
    samples = [i for i in range(B) if mask[i].sum() > 0]
    for i in samples:
        n = int(mask[i].sum())
        for t in range(n):
            divisor = tokens if aggregation == "token_mean" else n * len(samples)
            total = total + token_loss(i, t, n) / divisor
    (grad,) = torch.autograd.grad(total, logp)
    return total.detach(), grad


def ppo_term(inputs: dict, i: int, t: int, low: float = 0.2, high: float = 0.28) -> torch.Tensor:
    r = torch.exp(inputs["logp"][i, t] - inputs["old"][i, t])
    a = inputs["advantages"][i]
    return -torch.minimum(r * a, torch.clamp(r, 1 - low, 1 + high) * a)


def rho(inputs: dict, i: int, t: int) -> float:
    return math.exp(float(inputs["old"][i, t] - inputs["rollout"][i, t]))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_icepop_reference_form_masks_on_old_over_rollout_and_weights_by_it(seed):
    """IcePop (Ring-1T): M(k) = k inside [1/beta, beta], 0 outside, k = pi_old / pi_rollout, times PPO's term."""
    inputs, beta = random_inputs(seed, spread=0.6), 1.5

    def term(i, t, n):
        k = rho(inputs, i, t)
        return (k if 1 / beta <= k <= beta else 0.0) * ppo_term(inputs, i, t)

    correction = {"kind": "mask", "low": 1 / beta, "high": beta}
    assert_same(asyncrl_loss(inputs, {"objective": {"name": "ppo", "correction": correction}}), written_out(inputs, term))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_decoupled_ppo_weights_by_proximal_over_behaviour_and_drops_above_the_cap(seed):
    """AReaL: -(pi_prox / pi_behav) * min(r A, clip(r) A), r = pi_theta / pi_prox; a token whose weight exceeds
    the cap is dropped."""
    inputs, cap = random_inputs(seed, spread=0.5), 1.4

    def term(i, t, n):
        w = rho(inputs, i, t)
        return (w if w <= cap else 0.0) * ppo_term(inputs, i, t)

    correction = {"kind": "mask", "low": 0.0, "high": cap}
    assert_same(asyncrl_loss(inputs, {"objective": {"name": "ppo", "correction": correction}}), written_out(inputs, term))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_token_tis_truncates_the_weight(seed):
    inputs, cap = random_inputs(seed, spread=0.5), 1.2

    def term(i, t, n):
        return min(rho(inputs, i, t), cap) * ppo_term(inputs, i, t)

    correction = {"kind": "truncate", "high": cap}
    assert_same(asyncrl_loss(inputs, {"objective": {"name": "ppo", "correction": correction}}), written_out(inputs, term))


@pytest.mark.parametrize("kind", ["truncate", "mask"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_geometric_mean_correction(seed, kind):
    """rho_geo = (prod_t rho_t) ** (1/n) over the sample's trained tokens; MIS keeps the sample inside [low, high]."""
    inputs, low, high = random_inputs(seed, spread=0.5), 0.8, 1.1

    def term(i, t, n):
        geo = math.exp(sum(math.log(rho(inputs, i, s)) for s in range(n)) / n)
        weight = min(geo, high) if kind == "truncate" else (geo if low <= geo <= high else 0.0)
        return weight * ppo_term(inputs, i, t)

    correction = {"kind": kind, "level": "geometric", "low": low if kind == "mask" else 0.0, "high": high}
    ours = asyncrl_loss(inputs, {"objective": {"name": "ppo", "correction": correction}})
    assert_same(ours, written_out(inputs, term))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gspo_sequence_ratio_clipped_per_sample(seed):
    """GSPO: s_i = exp(mean_t log(pi_theta / pi_old)); -min(s_i A_i, clip(s_i) A_i), averaged over samples."""
    inputs, low, high = random_inputs(seed, spread=0.05), 0.01, 0.02

    def term(i, t, n):
        s = torch.exp(sum(inputs["logp"][i, u] - inputs["old"][i, u] for u in range(n)) / n)
        a = inputs["advantages"][i]
        return -torch.minimum(s * a, torch.clamp(s, 1 - low, 1 + high) * a)

    objective = {"name": "gspo", "eps_low": low, "eps_high": high}
    ours = asyncrl_loss(inputs, {"objective": objective, "loss_aggregation": "sequence_mean"})
    assert_same(ours, written_out(inputs, term, "sequence_mean"))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cispo_with_a_lower_bound(seed):
    """MiniMax-M1: -sg(clip(r, 1 - eps_low, 1 + eps_high)) A log pi_theta."""
    inputs, low, high = random_inputs(seed, spread=0.5), 0.1, 0.2

    def term(i, t, n):
        r = math.exp(float(inputs["logp"][i, t].detach() - inputs["old"][i, t]))
        return -min(max(r, 1 - low), 1 + high) * inputs["advantages"][i] * inputs["logp"][i, t]

    ours = asyncrl_loss(inputs, {"objective": {"name": "cispo", "eps_low": low, "eps_high": high}})
    assert_same(ours, written_out(inputs, term))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_glm5_objectives_against_their_formulas(seed):
    """double-sided IS: -r A inside (1 - eps_low, 1 + eps_high), r = pi_theta / pi_rollout; icepop_grpo: PPO's
    term on the same r, tokens outside [1/beta, beta] dropped. Neither reads pi_old."""
    inputs = random_inputs(seed, spread=0.4)

    def ratio(i, t):
        return torch.exp(inputs["logp"][i, t] - inputs["rollout"][i, t])

    def double_sided(i, t, n):
        r = ratio(i, t)
        return -r * inputs["advantages"][i] if 0.8 < float(r.detach()) < 1.2 else r * 0.0

    def icepop_grpo(i, t, n):
        r, a = ratio(i, t), inputs["advantages"][i]
        inside = 1 / 1.5 <= float(r.detach()) <= 1.5
        return -torch.minimum(r * a, torch.clamp(r, 0.8, 1.28) * a) if inside else r * 0.0

    ours = asyncrl_loss(inputs, {"objective": {"name": "double_sided_is", "eps_low": 0.2, "eps_high": 0.2}})
    assert_same(ours, written_out(inputs, double_sided))
    ours = asyncrl_loss(inputs, {"objective": {"name": "icepop_grpo", "beta": 1.5}})
    assert_same(ours, written_out(inputs, icepop_grpo))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kl_loss_term_k3_equals_trl_beta(seed):
    """GRPO's KL term: beta x (pi_ref / pi_theta - 1 - log(pi_ref / pi_theta)) on every token, in the loss."""
    inputs = random_inputs(seed)
    generator = torch.Generator().manual_seed(100 + seed)
    inputs["ref"] = inputs["old"] + 0.3 * torch.randn(B, T, generator=generator, dtype=torch.float64)
    config = LearnerConfig(objective="ppo", loss_aggregation="sequence_mean", kl={"coef": 0.04, "estimator": "k3"})
    logp, mask = inputs["logp"], inputs["mask"]
    out = build_objective(config.objective)(logp, inputs["rollout"], inputs["advantages"], mask, old=inputs["old"])
    # The learner's composition (RLLearner._kl_term): coef x the estimate on trained tokens, added per token.
    kl = torch.where(mask.bool(), kl_estimate(logp, inputs["ref"], "k3"), torch.zeros_like(logp))
    weights = token_weights(mask, "sequence_mean", StepTotals(tokens=int(mask.sum()), samples=B)).to(logp.dtype)
    loss = ((out.per_token + config.kl.coef * kl) * weights).sum()
    ours = (loss.detach(), torch.autograd.grad(loss, logp)[0])
    assert_same(ours, trl_loss({**inputs, "ref_per_token_logps": inputs["ref"]}, beta=0.04))


def test_kl_estimators_against_their_formulas():
    logp, ref = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64), torch.tensor([-1.5, -1.0, -0.5], dtype=torch.float64)
    for (a, b), k1, k2, k3 in zip(
        zip(logp.tolist(), ref.tolist(), strict=True), *(kl_estimate(logp, ref, k) for k in ("k1", "k2", "k3")), strict=True
    ):
        log_r = b - a
        assert float(k1) == pytest.approx(-log_r) and float(k2) == pytest.approx(log_r**2 / 2)
        assert float(k3) == pytest.approx(math.exp(log_r) - 1 - log_r)
