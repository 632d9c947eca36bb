"""`learner.objective`: the RL loss, one variant per family the field uses (docs/ALGORITHMS.md).

Three probabilities meet in every objective: pi_theta (the weights being trained), pi_old (the same
weights before the batch's first update: the learner's own scoring pass) and pi_rollout (what the
engine recorded when it sampled). GLM-5's two objectives compare pi_theta with pi_rollout directly;
the PPO family clips pi_theta / pi_old and corrects the gap between pi_old and pi_rollout separately
(`correction`: TIS, MIS, IcePop, AReaL's decoupled PPO, at token, sequence or geometric-mean level).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, Tag, model_validator

from .section import Section, choice


class CorrectionConfig(Section):
    """Rollout correction: a weight on each token's loss from rho = pi_old / pi_rollout, the gap between the
    learner's weights before this batch and the engine that sampled (staleness, FP8, kernels). At `level` token
    rho is the token's own; sequence: the product over the sample's trained tokens; geometric: their geometric
    mean. none: weight 1. truncate (TIS): min(rho, high). mask (MIS, IcePop, decoupled PPO): rho where
    low <= rho <= high, else 0 (the token, or at sequence levels the whole sample, gives no gradient)."""

    kind: Literal["none", "truncate", "mask"] = "none"
    """none, truncate (truncated importance sampling) or mask (masked importance sampling)."""
    level: Literal["token", "sequence", "geometric"] = "token"
    """Where rho is measured: per token, per sample (product of its tokens' rho), or the samples' geometric mean."""
    low: float = Field(0.0, ge=0.0)
    """mask: the smallest rho kept (IcePop: 1/beta; 0 keeps every small rho)."""
    high: float = Field(2.0, gt=0.0)
    """truncate: the cap on rho; mask: the largest rho kept."""

    @model_validator(mode="after")
    def _band(self) -> CorrectionConfig:
        if self.low >= self.high:
            raise ValueError(f"low ({self.low}) must be below high ({self.high})")
        return self


class _Clipped(Section):
    eps_low: float = Field(0.2, ge=0.0, le=1.0)
    """Lower bound 1 - eps_low of the ratio (clip or mask, as the objective says)."""
    eps_high: float = Field(0.28, ge=0.0, le=10.0)
    """Upper bound 1 + eps_high of the ratio (clip or mask, as the objective says)."""


class IcepopGRPOObjective(_Clipped):
    """GLM-5's reasoning objective: tokens whose pi_theta / pi_rollout lies outside [1/beta, beta] give no gradient,
    then PPO's clip on the same ratio. No pi_old."""

    name: Literal["icepop_grpo"] = "icepop_grpo"
    """Picks this objective."""
    beta: float = Field(2.0, gt=1.0, le=100.0)
    """Tokens whose pi_theta / pi_rollout lies outside [1/beta, beta] give no gradient."""


class DoubleSidedISObjective(_Clipped):
    """GLM-5's agentic objective: keep a token only when 1 - eps_low < pi_theta / pi_rollout < 1 + eps_high; loss
    -ratio x advantage on kept tokens. No pi_old."""

    name: Literal["double_sided_is"] = "double_sided_is"
    """Picks this objective."""


class PPOObjective(_Clipped):
    """GRPO's clipped surrogate on r = pi_theta / pi_old, min(r A, clip(r, 1 - eps_low, 1 + eps_high) A), times the
    rollout correction. TIS, MIS, IcePop (reference form) and AReaL's decoupled PPO are this with a correction."""

    name: Literal["ppo"] = "ppo"
    """Picks this objective."""
    correction: CorrectionConfig = CorrectionConfig()
    """The weight from pi_old / pi_rollout (default none: the plain GRPO loss)."""


class GSPOObjective(_Clipped):
    """GSPO: one ratio per sample, s = exp(mean over its tokens of log pi_theta / pi_old), clipped as in PPO; each
    token's gradient is the sample's (GSPO-token with the advantage shared by the sample)."""

    name: Literal["gspo"] = "gspo"
    """Picks this objective."""
    eps_low: float = Field(3e-4, ge=0.0, le=1.0)
    """Lower bound 1 - eps_low of the sequence ratio (the GSPO paper's 3e-4)."""
    eps_high: float = Field(4e-4, ge=0.0, le=10.0)
    """Upper bound 1 + eps_high of the sequence ratio (the GSPO paper's 4e-4)."""
    correction: CorrectionConfig = CorrectionConfig()
    """The weight from pi_old / pi_rollout (default none)."""


class CISPOObjective(Section):
    """CISPO (MiniMax-M1): the ratio r = pi_theta / pi_old is clipped and detached, and weights a policy-gradient
    term: -sg(clip(r, 1 - eps_low, 1 + eps_high)) A log pi_theta. Every token keeps a gradient."""

    name: Literal["cispo"] = "cispo"
    """Picks this objective."""
    eps_low: float | None = Field(None, ge=0.0, le=1.0)
    """Lower bound 1 - eps_low on the weight; None: no lower bound (MiniMax-M1's setting)."""
    eps_high: float = Field(4.0, gt=0.0, le=100.0)
    """Upper bound 1 + eps_high on the weight."""
    correction: CorrectionConfig = CorrectionConfig()
    """The weight from pi_old / pi_rollout (default none)."""


OBJECTIVE_NAMES = ("icepop_grpo", "double_sided_is", "ppo", "gspo", "cispo")

ObjectiveConfig = Annotated[
    Annotated[IcepopGRPOObjective, Tag("icepop_grpo")]
    | Annotated[DoubleSidedISObjective, Tag("double_sided_is")]
    | Annotated[PPOObjective, Tag("ppo")]
    | Annotated[GSPOObjective, Tag("gspo")]
    | Annotated[CISPOObjective, Tag("cispo")],
    choice("name", *OBJECTIVE_NAMES),
]
"""`learner.objective`: `name` picks the loss; a bare name (`objective: ppo`) takes that loss's defaults."""


class LearnerObjective(Section):
    """A task of the mix that trains under the learner's objective (`learner.objective`)."""

    name: Literal["learner"] = "learner"
    """Picks the learner's objective."""


TaskObjectiveConfig = Annotated[
    Annotated[LearnerObjective, Tag("learner")]
    | Annotated[IcepopGRPOObjective, Tag("icepop_grpo")]
    | Annotated[DoubleSidedISObjective, Tag("double_sided_is")]
    | Annotated[PPOObjective, Tag("ppo")]
    | Annotated[GSPOObjective, Tag("gspo")]
    | Annotated[CISPOObjective, Tag("cispo")],
    choice("name", "learner", *OBJECTIVE_NAMES),
]
"""`tasks.mix.NAME.objective`: `learner` (the default) or an objective of the task's own."""


def by_name(value: Any) -> Any:
    """`objective: NAME` is that objective with its defaults (a before-validator of the sections holding one)."""
    return {"name": value} if isinstance(value, str) else value


def uses_old_policy(objective: ObjectiveConfig) -> bool:
    """Whether the objective reads pi_old (the PPO family), which GLM-5's two do not."""
    return objective.name in ("ppo", "gspo", "cispo")
