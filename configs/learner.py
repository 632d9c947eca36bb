"""The learner section and the optimizer it (and SFT) steps with."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from .objectives import IcepopGRPOObjective, ObjectiveConfig, by_name
from .section import Section


class OptimizerConfig(Section):
    """The optimizer of a training section (learner, sft); its learning rate and weight decay are the section's own
    `lr` and `weight_decay`. adamw: AdamW on every parameter. muon: torch's Muon (orthogonalized momentum) on the
    hidden weight matrices, each MoE expert's matrix on its own, and AdamW on embeddings, the LM head, norms,
    biases, router gates and the DSA indexer's head weights. muon_split: as muon, but each attention head's
    slice of a multi-head projection (q/k/v/o, MLA's q_b/kv_b, the indexer's wq_b) is orthogonalized on its own."""

    type: Literal["adamw", "muon", "muon_split"] = "adamw"
    """adamw (every parameter), muon (orthogonalized updates for hidden matrices) or muon_split (per attention head)."""
    momentum: float = Field(0.95, ge=0.0, lt=1.0)
    """Muon: momentum of the gradient buffer that is orthogonalized."""
    nesterov: bool = True
    """Muon: orthogonalize the Nesterov look-ahead (gradient + momentum x buffer) instead of the buffer."""
    ns_steps: int = Field(5, ge=1, le=99)
    """Muon: Newton-Schulz iterations per orthogonalization (torch's quintic coefficients)."""
    adjust_lr_fn: Literal["match_rms_adamw", "original"] = "match_rms_adamw"
    """Muon: update scale per matrix (per head block under muon_split): match_rms_adamw (0.2 sqrt(max(rows, cols)),
    so the section's AdamW lr and weight decay carry over) or original (sqrt(max(1, rows/cols)), Keller Jordan's)."""
    adamw_lr: float | None = Field(None, gt=0, le=1.0)
    """muon / muon_split: learning rate of the AdamW group (embeddings, LM head, norms, biases, gates); None: the
    section's lr."""
    ns_dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """Muon: precision of the Newton-Schulz iterations. bfloat16 is torch.optim.Muon's; auto is float32 on a CPU,
    where bfloat16 matmuls are emulated (13x slower than float32 on the 2-core benchmark machine), else bfloat16."""


class ScheduleConfig(Section):
    """The learning rate over optimizer steps: linear warm-up from lr / warmup_steps to lr over `warmup_steps`,
    then constant, or linear / cosine decay to min_lr_ratio x lr at `decay_steps` (counted from the first step)."""

    kind: Literal["constant", "linear", "cosine"] = "constant"
    """After warm-up: constant, linear decay or cosine decay."""
    warmup_steps: int = Field(0, ge=0)
    """Optimizer steps of linear warm-up (0: none)."""
    decay_steps: int | None = Field(None, ge=1)
    """linear / cosine: the step at which the rate reaches min_lr_ratio x lr (and stays)."""
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0)
    """linear / cosine: the final rate as a fraction of lr."""

    @model_validator(mode="after")
    def _decay_has_an_end(self) -> ScheduleConfig:
        if self.kind != "constant" and self.decay_steps is None:
            raise ValueError(f"kind {self.kind} decays over decay_steps: set it")
        if self.decay_steps is not None and self.decay_steps <= self.warmup_steps:
            raise ValueError(f"decay_steps ({self.decay_steps}) must be greater than warmup_steps ({self.warmup_steps})")
        return self


class OverlongConfig(Section):
    """DAPO's rules for completions that hit the token limit (learner/shaping.py); both off by default."""

    filter: bool = False
    """Truncated samples (last turn ended at the token limit) train no token; their rewards still count in
    their groups' advantages, and their rollouts' account is dropped_overlong."""
    penalty_buffer: int = Field(0, ge=0)
    """Soft overlong penalty: a sample of L sampled tokens gets reward + (max_tokens - buffer - L) / buffer once
    L > max_tokens - buffer, and -1 beyond max_tokens; 0 turns it off."""
    max_tokens: int | None = Field(None, ge=1)
    """L_max of the penalty: the sampled tokens a sample may have (the rollouts' token limit)."""

    @model_validator(mode="after")
    def _penalty_has_a_limit(self) -> OverlongConfig:
        if self.penalty_buffer and self.max_tokens is None:
            raise ValueError("penalty_buffer needs max_tokens, the sampled-token limit it counts back from")
        if self.penalty_buffer and self.max_tokens is not None and self.penalty_buffer > self.max_tokens:
            raise ValueError(f"penalty_buffer ({self.penalty_buffer}) exceeds max_tokens ({self.max_tokens})")
        return self


class KLConfig(Section):
    """KL to the run's starting policy (learner/reference.py): off at coef 0."""

    coef: float = Field(0.0, ge=0.0, le=100.0)
    """Weight of the KL term (0: no reference policy is kept)."""
    estimator: Literal["k1", "k2", "k3"] = "k3"
    """The per-token estimator of KL(pi_theta || pi_ref): k1 (log ratio), k2 (half its square) or k3 (GRPO's)."""
    mode: Literal["loss", "reward"] = "loss"
    """loss: coef x the estimate on each trained token's loss; reward: coef x the sample's summed k1 off its reward."""


class DynamicSamplingConfig(Section):
    """DAPO's dynamic sampling (sched/loop.py): a complete group whose rollouts all earned one reward has no
    advantage to learn from; it leaves the batch before the learner sees it (account dropped_no_signal) and the
    loop admits groups in its place."""

    enabled: bool = False
    """Drop groups without signal before they reach the learner (off: they are trained at zero advantage)."""
    max_dropped: float = Field(3.0, ge=0.0, le=100.0)
    """At most this x batch_groups groups dropped while one batch gathers; past it, groups without signal are
    trained (at zero advantage) so that a task the policy always or never solves cannot stall the run."""


class LearnerConfig(Section):
    """The RL learner: objective, drop and group rules, optimizer, weight pushes (docs/LEARNER.md, "The rules")."""

    objective: ObjectiveConfig = IcepopGRPOObjective()
    """The RL loss (`name`: icepop_grpo, double_sided_is, ppo, gspo or cispo) and its bounds (docs/ALGORITHMS.md)."""
    loss_aggregation: Literal["token_mean", "sequence_mean", "constant"] = "token_mean"
    """How per-token losses become the step's: token_mean (sum over the step's trained tokens / their number),
    sequence_mean (each sample's token mean, averaged over samples: GRPO's) or constant (sum / (samples x
    loss_constant): Dr.GRPO's, no length bias)."""
    epochs: int = Field(1, ge=1, le=100)
    """Passes over each batch; with more than one update per batch the PPO family's pi_old is scored first."""
    mini_batches: int = Field(1, ge=1, le=1024)
    """Optimizer updates per pass, each on an even share of the batch's GRPO groups (the policy version still
    rises by one per batch)."""
    kl: KLConfig = KLConfig()
    """KL to the starting policy, as a loss term or a reward penalty (off by default, as in GLM-5 and DAPO)."""
    dynamic_sampling: DynamicSamplingConfig = DynamicSamplingConfig()
    """Groups whose rollouts all earned one reward leave the batch and more are admitted (off by default)."""
    overlong: OverlongConfig = OverlongConfig()
    """Truncated completions: DAPO's overlong filtering and soft overlong penalty (off by default)."""
    loss_constant: int | None = Field(None, ge=1)
    """constant aggregation: the token count each sample is divided by (Dr.GRPO: the generation budget)."""
    group_size: int = Field(8, ge=1, le=1024)
    """Rollouts per GRPO group (one prompt, group_size samples)."""
    normalize_adv_std: bool = True
    """Divide group-centred rewards by the group's standard deviation."""
    max_staleness: int = Field(4, ge=0)
    """tau: drop a rollout when learner version - oldest version among its sampled tokens > tau."""
    staleness_by: Literal["sampled", "kv"] = "sampled"
    """The version a token's staleness counts from, for max_staleness and the reported lags: "sampled", the weights
    that sampled it; "kv", the oldest weights among the KV it attended to, older than those under
    rollout.kv_on_push: keep when a push came mid-request (turns that recorded no KV versions, vLLM's: the sampling one)."""
    crash_statuses: list[Literal["env_crash", "timeout", "error"]] = ["env_crash", "error"]
    """Finish statuses that count as environment crashes and are dropped."""
    lr: float = Field(1e-4, gt=0, le=1.0)
    """Learning rate (AdamW's; Muon's too under muon / muon_split; 3e-4 was unstable on the tiny policy with AdamW)."""
    weight_decay: float = Field(0.01, ge=0.0, le=1.0)
    """Decoupled weight decay (AdamW's, and Muon's under muon / muon_split)."""
    no_decay: list[Literal["norms", "biases", "embeddings"]] = ["norms", "biases", "embeddings"]
    """Parameters that take no weight decay: normalization weights, biases, token embeddings (and a head tied to them)."""
    schedule: ScheduleConfig = ScheduleConfig()
    """The learning rate over optimizer steps: warm-up, then constant, linear or cosine decay."""
    precision: Literal["fp32", "bf16-mixed"] = "fp32"
    """The learner's own precision; policy.dtype stays the engines' (pushes are cast to it as they load). fp32:
    weights, optimizer state and compute in float32. bf16-mixed: float32 weights and optimizer state, the decoder's
    forward and backward in bfloat16 autocast, the head's logits, log-softmax and the MTP loss in float32. A GPU
    without bfloat16 units refuses it; a CPU without bfloat16 instructions (avx512_bf16, amx_bf16) runs it emulated,
    slower than fp32, with a warning. Checkpoints hold the float32 weights, so a resume is exact."""
    entropy_coef: float = Field(0.0, ge=0.0, le=1.0)
    """Entropy bonus: subtract this x the policy's mean entropy at trained tokens from the loss (0: logged only)."""
    grad_clip: float = Field(1.0, gt=0)
    """Global gradient-norm clip."""
    optimizer: OptimizerConfig = OptimizerConfig()
    """adamw, muon or muon_split, with Muon's knobs (lr and weight_decay above)."""
    batch_groups: int = Field(32, ge=1, le=65536)
    """GRPO groups per learner step (one policy version; `mini_batches` optimizer updates per pass over them)."""
    push_every: int = Field(1, ge=1)
    """K: publish weights to the rollout workers every K learner steps (policy versions)."""
    reset_optimizer_on_push: bool = False
    """Clear the optimizer's moments (AdamW's, Muon's momentum buffers) after each weight push."""
    mtp_loss_weight: float = Field(0.0, ge=0.0, le=10.0)
    """Weight of the MTP auxiliary loss on sampled tokens during RL (keeps drafting accurate); 0 turns it off."""
    freeze_indexer: bool = True
    """Keep the DSA indexer's weights fixed during RL (the GLM-5 report saw collapse when it drifted)."""
    torch_threads: int = Field(1, ge=1, le=256)
    """torch intra-op threads in the learner process."""
    num_cpus: float = Field(1.0, gt=0.0)
    """Ray CPU resources of the learner actor (of each rank's, with num_ranks > 1)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the learner computes; auto picks cuda when its process sees a GPU (a whole GPU per rank is asked of Ray
    when this is cuda, or auto on a cluster with GPUs, unless gpus_per_rank says otherwise)."""
    gpus_per_rank: float = Field(0.0, ge=0.0)
    """Ray GPU resources of each learner rank; 0: one whole GPU each when the learner runs on CUDA, none on CPU."""
    num_ranks: int = Field(1, ge=1, le=1024)
    """Data-parallel learner processes (learner/distributed.py): each computes a share of every step's rows
    and the gradients are summed over a torch.distributed group (gloo on CPU); the result is the one-rank step's."""
    sharding: Literal["auto", "replicate", "fsdp"] = "auto"
    """How num_ranks > 1 hold the policy (learner/sharding.py): replicate (every rank the whole policy and optimizer,
    gradients summed: DDP's semantics) or fsdp (torch's FSDP2 `fully_shard`: each rank a 1/num_ranks shard of the
    weights, gradients and optimizer state, for a model that does not fit one device). auto: fsdp when the
    learner runs on CUDA, else replicate."""
    micro_batch_tokens: int = Field(8192, ge=1)
    """Most padded tokens (rows x longest) in one forward/backward; bounds activation memory."""
    share_prefixes: bool = True
    """Score the tokens that rows begin with in common (a GRPO group's prompt) once per micro-batch, not once per
    row (learner/prefix.py): the same log-probs and gradients for fewer tokens. Applies where the policy's family
    gives the same logits both ways (checked at start; a warning says when not) and not with routing_replay,
    gradient_checkpointing or fsdp sharding, which score whole rows."""
    logits_chunk_tokens: int = Field(2048, ge=1)
    """Most positions whose full-vocabulary logits exist at once. The head (the MTP layer's loss's too) runs only
    where a token is trained, into one float32 buffer of this many positions at most (2048 x 151,936 words:
    1.2 GB); a micro-batch with more trained tokens is scored chunk by chunk, each chunk's logits recomputed in
    the backward pass instead of kept (asyncrl/policy/token_logprobs.py), for one more head matmul."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass instead of keeping them: activation memory
    of one layer instead of all, for about a third more compute (a model too big for its device at micro_batch_tokens)."""
    checkpoint_every: int = Field(50, ge=1)
    """Save an HF checkpoint plus learner state every this many learner steps (policy versions)."""
    keep_checkpoints_every: int | None = Field(None, ge=1)
    """Checkpoint retention: keep the checkpoints whose version is a multiple of this, plus the last
    `keep_last_checkpoints`, and delete the others once a newer one is on disk (None: keep every one)."""
    keep_last_checkpoints: int = Field(2, ge=1, le=100000)
    """The newest checkpoints always kept (with keep_checkpoints_every set); resume needs the last one."""
    logprob_gap_warning: float = Field(0.5, gt=0.0)
    """Warn when, in a step, the mean |learner - rollout| log-prob of a task's (or a turn index's) sampled
    tokens exceeds this: the learner and the engines no longer compute the same policy."""
    routing_replay: bool = False
    """MoE policies: the learner's forward uses the experts the engine chose for each sampled token
    (recorded with rollout.record_routes) instead of routing again, so router near-ties cannot split them."""

    @model_validator(mode="before")
    @classmethod
    def _objective_by_name(cls, data: Any) -> Any:
        """`objective: NAME` is that objective with its defaults. Configs written before the objective became a
        section (run directories among them) kept its bounds beside it, as eps_low, eps_high and icepop_beta:
        they move into it."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        legacy = {key: data.pop(key) for key in ("eps_low", "eps_high", "icepop_beta") if key in data}
        if "objective" not in data and not legacy:
            return data
        objective = by_name(data.get("objective", {}))
        if legacy and isinstance(objective, dict):
            moved = {"beta" if key == "icepop_beta" else key: value for key, value in legacy.items()}
            if objective.get("name", "icepop_grpo") != "icepop_grpo":
                moved.pop("beta", None)  # only icepop_grpo has one
            objective = {**moved, **objective}  # the objective's own keys win
        data["objective"] = objective
        return data

    @model_validator(mode="after")
    def _aggregation_has_a_constant(self) -> LearnerConfig:
        if self.loss_aggregation == "constant" and self.loss_constant is None:
            raise ValueError("loss_aggregation constant divides every sample by loss_constant tokens: set learner.loss_constant")
        return self
