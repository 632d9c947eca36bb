"""The RL learner: one learner step per call on the samples of complete GRPO groups (docs/LEARNER.md, "The rules";
every objective and rule: docs/ALGORITHMS.md).

A step is a few named verbs:

    select      -> drop aborted, crashed and stale rollouts; fill or drop GRPO groups (`selection`)
    advantages  -> group-relative advantages over the filled groups, padding repeats included (`shaping`)
    accumulate  -> teacher-forced log-probs of every sampled token, the objective, backward
    step        -> gradient clip, the optimizer (`learner.optimizer`: AdamW, Muon, Muon Split) and its schedule

accumulate and step repeat once per update (`updates`: `learner.mini_batches` x `learner.epochs`, one by
default); the policy version goes up by one per learner step that stepped.

Groups whose rewards are all equal have zero advantage, so their samples give exactly zero
gradient: they are counted as trained but never run through the model. The loss is divided by the
trainable tokens of *every* selected sample, skipped ones included, so skipping changes the cost of a
step and nothing else.

Sampling temperature: engines report the log-prob of the distribution they actually sampled from,
i.e. softmax(logits / T). The learner divides the logits of every token by the T its turn was sampled
at (recorded on the turn, carried per token by the sample, `batch.Row.temperatures`), otherwise every
ratio would be off by the temperature and the masks would drop good tokens. Greedy tokens (T = 0)
are reported as raw log-probs, so T = 0 means 1 here; tokens with no temperature on record (old
stores, hand-built samples) take the run's (`sampling_temperature`; `from_config` takes
`rollout.sampling.temperature`). A turn sampled under top-k / top-p is scored under them too, renormalised
over what the engine's sampler keeps (`truncated_support`, asyncrl/policy/token_logprobs.py).

Distillation samples (cross-stage distillation, `distill/`) go through the same step: selection
(group size 1), the same objective, masks and staleness rule. They carry the teacher's log-prob of
every token, and their advantage is per token, stop-grad(log pi_teacher - log pi_theta) with
log pi_theta this step's own detached log-prob (`distill_advantages` in `learner/objectives/` says why), computed after the
forward; they are never skipped as zero-advantage.

Consistency (`learner/consistency.py`): every step reports the gap between its log-probs and the
rollouts' on the sampled tokens of the computed rows (mean and max, per task and per turn index), the
ratio quantiles and the masked fraction per side of the band; a (task, turn) whose mean gap passes
`learner.logprob_gap_warning` raises a `LogprobGapWarning` and is listed in `consistency_warnings`.

This module knows nothing of Ray or the loop: the scheduler hands `train_step` a `Batch` and gets a
`StepResult` back; it pushes `state_dict_for_push()` and calls `save` when the step made them due
(`asyncrl.records.due_after_step`, the rule the learner's optimizer reset on push follows too).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import PreTrainedModel

from asyncrl.configs.objectives import LearnerObjective, uses_old_policy
from asyncrl.configs.schema import LearnerConfig, RunConfig
from asyncrl.policy.checkpoint import build_policy
from asyncrl.policy.mtp import MTPLayer, check_plain_head
from asyncrl.policy.routing import use_shared_selection
from asyncrl.records import Account, Batch, StepResult, due_after_step

from .batch import MicroBatch, staleness_histogram, to_rows
from .consistency import ConsistencyStats, warn_gaps
from .distributed import all_reduce_gradients, broadcast_parameters, gather_objects
from .objectives import Objective, ObjectiveOutput, TaskLoss, build_objective, by_task, distill_advantages, token_weights
from .optim import build_optimizer
from .prefix import sharing_refusal
from .reference import Reference, kl_estimate, reward_penalties
from .resume import load_learner, save_learner
from .schedule import build_scheduler
from .selection import Selection, select
from .shaping import step_rows
from .sharding import (
    MTPTargets,
    Scorer,
    autocast_dtype,
    empty_pass,
    full_model_state,
    local_bytes,
    matched_passes,
    shard,
    total_norm,
    uses_fsdp,
)
from .updates import Update, computes, plan_updates, score_old


def sampled_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float | torch.Tensor) -> torch.Tensor:
    """[B, T-1]: log-prob of token j+1 given tokens 0..j, at the sampling temperature (float32): one
    for every token, or a [B, T-1] tensor giving the temperature of each token j+1."""
    if isinstance(temperature, torch.Tensor):
        temperature = temperature[..., None]  # one per position, broadcast over the vocabulary
    scaled = logits[:, :-1].float() / temperature
    chosen = scaled.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return chosen - torch.logsumexp(scaled, dim=-1)


def enable_gradient_checkpointing(model: PreTrainedModel) -> None:
    """transformers' per-layer activation checkpointing, in the learner's eval mode.

    transformers checkpoints a decoder layer only while that layer is in training mode; the learner
    keeps the policy in eval mode so that no dropout changes what it scores. So only the decoder layers
    themselves are marked as training: their submodules (attention and its dropout, MLPs, routers)
    keep eval mode, and the layers compute exactly what they compute without checkpointing
    (tests/test_learner_rl.py checks gradients equal).
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    family = model.config.model_type
    if not model.supports_gradient_checkpointing:
        raise ValueError(f"learner.gradient_checkpointing: transformers does not support it for {family}")
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    layers = [module for module in model.modules() if isinstance(module, GradientCheckpointingLayer)]
    if not layers:
        raise ValueError(f"learner.gradient_checkpointing: {family} has no layer transformers can checkpoint")
    for layer in layers:
        layer.training = True  # this flag alone, not .train(): the submodules stay in eval mode


def freeze_indexers(model: PreTrainedModel, mtp: MTPLayer | None) -> None:
    """`learner.freeze_indexer`: the DSA indexers take no gradient, the MTP block's (it runs one of its own) too."""
    for name, param in [*model.named_parameters(), *(mtp.named_parameters() if mtp is not None else ())]:
        if ".indexer." in name:
            param.requires_grad_(False)


def trained_parameters(model: PreTrainedModel, mtp: MTPLayer | None) -> list[torch.nn.Parameter]:
    """The parameters the optimizer steps: the policy's trainable ones, and the trained MTP layer's, those it shares
    with the policy (embedding, head) listed once."""
    params = [p for p in model.parameters() if p.requires_grad]
    if mtp is not None:
        seen = {id(p) for p in params}
        params += [p for p in mtp.parameters() if p.requires_grad and id(p) not in seen]
    return params


def task_losses(run: RunConfig) -> dict[str, TaskLoss]:
    """The tasks of `tasks.mix` with an objective or a loss weight of their own."""
    return {
        name: TaskLoss(
            None if isinstance(spec.objective, LearnerObjective) else build_objective(spec.objective),
            spec.loss_weight,
            reads_old=not isinstance(spec.objective, LearnerObjective) and uses_old_policy(spec.objective),
        )
        for name, spec in run.tasks.mix.items()
        if not isinstance(spec.objective, LearnerObjective) or spec.loss_weight != 1.0
    }


def learner_device(run: RunConfig) -> torch.device:
    """`learner.device` resolved in this process, refusing a CUDA learner without a GPU and a dtype its GPU
    cannot run (checked before the policy loads)."""
    wanted = run.learner.device
    if wanted == "cuda" and not torch.cuda.is_available():
        raise ValueError("learner.device=cuda: the learner's process sees no CUDA device (Ray gives it learner.gpus_per_rank GPUs)")
    device = torch.device("cuda" if wanted == "cuda" or (wanted == "auto" and torch.cuda.is_available()) else "cpu")
    if device.type == "cuda" and run.policy.dtype == "bfloat16" and not torch.cuda.is_bf16_supported():
        raise ValueError(f"policy.dtype=bfloat16: {torch.cuda.get_device_name()} cannot run bfloat16 (use float16 or float32)")
    return device


@dataclass
class _StepStats:
    """Sums over the computed micro-batches of one step; the ratio and log-prob gap figures come from
    `consistency` and, like it, cover the computed rows only (`computed_trainable_tokens` of them)."""

    loss: float = 0.0
    mtp_loss: float = 0.0
    entropy_sum: float = 0.0
    """Sum of the policy's entropy over the trained tokens of the computed rows."""
    kl_sum: float = 0.0
    """Sum of the KL estimate over the trained tokens of the computed rows (`learner.kl` as a loss term)."""
    tokens: int = 0
    prefix_skipped_tokens: int = 0
    micro_batches: int = 0
    consistency: ConsistencyStats = field(default_factory=ConsistencyStats)

    def add(self, out: ObjectiveOutput, logp: torch.Tensor, batch: MicroBatch, mask: torch.Tensor) -> None:
        gap = (logp.detach() - batch.rollout_logprobs[:, 1:]).abs()
        # Token j+1 is scored at position j: its turn is that of token j+1.
        self.consistency.add(batch.tasks, batch.turns[:, 1:], gap, out.ratio, out.kept, mask)
        self.tokens += int(batch.attention_mask.sum())
        if batch.prefix is not None:
            self.prefix_skipped_tokens += int(batch.attention_mask.sum() - batch.prefix.prefix_mask.sum() - batch.prefix.suffix_mask.sum())
        self.micro_batches += 1

    def portable(self) -> _StepStats:
        """These sums with their tensors on the CPU, to send to the other ranks."""
        self.consistency.ratios = [r.cpu() for r in self.consistency.ratios]
        return self

    @classmethod
    def combined(cls, parts: Sequence[_StepStats]) -> _StepStats:
        """The step's sums over every rank's share of its rows."""
        total = cls()
        for part in parts:
            total.merge(part)
        return total

    def merge(self, other: _StepStats) -> None:
        """Add another share's sums for the same step (learner/distributed.py)."""
        self.loss += other.loss
        self.mtp_loss += other.mtp_loss
        self.kl_sum += other.kl_sum
        self.entropy_sum += other.entropy_sum
        self.tokens += other.tokens
        self.prefix_skipped_tokens += other.prefix_skipped_tokens
        self.micro_batches += other.micro_batches
        self.consistency.merge(other.consistency)

    def metrics(self) -> dict:
        consistency = self.consistency.metrics()
        n = self.consistency.tokens
        ratios = self.consistency.all_ratios()
        masked = self.consistency.masked_below + self.consistency.masked_above
        return {
            "masked_token_frac": masked / n if n else 0.0,
            "ratio_mean": float(ratios.mean()) if n else None,
            "ratio_min": float(ratios.min()) if n else None,
            "ratio_max": float(ratios.max()) if n else None,
            "abs_logp_diff": consistency["logprob_gap_mean"],
            "entropy": self.entropy_sum / n if n else None,
            "computed_tokens": self.tokens,
            "prefix_skipped_tokens": self.prefix_skipped_tokens,
            "computed_trainable_tokens": n,
            "micro_batches": self.micro_batches,
            **consistency,
        }


class RLLearner:
    """Trains a policy (any HF causal LM, plus its MTP layer if any) on rollout samples."""

    def __init__(
        self,
        config: LearnerConfig,
        model: PreTrainedModel,
        tokenizer,
        mtp: MTPLayer | None = None,
        *,
        sampling_temperature: float = 1.0,
        mtp_depth_weights: Sequence[float] = (1.0,),
        version: int = 0,
        fsdp: bool = False,
        task_losses: Mapping[str, TaskLoss] | None = None,
    ) -> None:
        self.config = config
        # Eval mode: no dropout, so the learner scores the very function the engines sample from
        # (gradients flow all the same).
        self.model = model.eval()
        self.tokenizer, self.pad = tokenizer, tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.mtp = mtp.eval() if mtp is not None else None
        self.temperature = sampling_temperature if sampling_temperature > 0 else 1.0
        """The run's sampling temperature, for tokens with none on record."""
        self.mtp_depth_weights = list(mtp_depth_weights)
        """lambda_k of the MTP loss for depths 1..len (policy.mtp.train_depth)."""
        self.version = version
        """Policy version of the current weights: +1 per learner step (batch) that took an optimizer step."""
        self.objective: Objective = build_objective(config.objective)
        self.task_losses = dict(task_losses or {})  # the tasks of the mix whose objective or weight is their own
        if config.freeze_indexer:
            freeze_indexers(model, mtp)
        check_plain_head(model)
        if config.gradient_checkpointing:
            enable_gradient_checkpointing(model)
        # DSA and router top-k through the functions the embedded engine uses (ties included).
        use_shared_selection(model, *([mtp] if mtp is not None else []))
        self.device = next(model.parameters()).device
        self.rank, self.world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        """This process's place in a data-parallel learner (learner/distributed.py); (0, 1) alone."""
        if self.world > 1:  # before FSDP (if any) cuts the parameters into shards
            broadcast_parameters([*model.parameters(), *(mtp.parameters() if mtp is not None else ())])
        for module in [model, *([mtp] if mtp is not None else [])]:  # learner.precision: float32 weights, always
            module.to(dtype=torch.float32)
        self.scorer = Scorer(model, self.mtp, config.logits_chunk_tokens, autocast_dtype(config.precision, self.device))
        self.fsdp = fsdp and self.world > 1
        """Sharded over the ranks (learner/sharding.py) rather than replicated on each."""
        if self.fsdp:
            shard(self.scorer, self.world, self.device)
        self.share_prefixes = self._shares_prefixes()
        """Whether micro-batches score their rows' shared prefixes once (`learner.share_prefixes`, learner/prefix.py)."""
        self._gathered: tuple[int, dict[str, torch.Tensor], dict[str, torch.Tensor]] | None = None
        """(version, the policy's whole weights, the MTP layer's) on the CPU, of the last `gather_weights` (rank 0
        of a sharded learner)."""
        self.params = trained_parameters(model, self._trained_mtp)
        self.optimizer = build_optimizer(
            config.optimizer, model, self.params, lr=config.lr, weight_decay=config.weight_decay,
            extra=[self._trained_mtp] if self._trained_mtp is not None else [], no_decay=config.no_decay,
        )  # fmt: skip
        self.scheduler = build_scheduler(self.optimizer, config.schedule)
        """`learner.schedule`: one step per optimizer update; saved and resumed with the optimizer."""
        self.reference = Reference.for_learner(config, model, sharded=self.fsdp, autocast=self.scorer.autocast)
        """`learner.kl`'s reference: the policy as this learner was built with it (the run's start)."""

    def _shares_prefixes(self) -> bool:
        config = self.config
        if not config.share_prefixes or config.routing_replay or config.gradient_checkpointing or self.fsdp:
            return False
        if (refusal := sharing_refusal(self.model)) is not None:
            warnings.warn(f"learner.share_prefixes: {refusal}; scoring whole rows", stacklevel=3)
            return False
        return True

    @classmethod
    def from_config(cls, run: RunConfig) -> RLLearner:
        """The policy of `run.policy` (a checkpoint, or the tiny policy) at the run's sampling temperature,
        sharded over the ranks where `learner.sharding` says so."""
        sampling = run.rollout.sampling
        device = learner_device(run)
        autocast_dtype(run.learner.precision, device)  # refused before the policy loads, not after
        model, tokenizer, mtp = build_policy(run.policy, run.seed)
        for module in [model, *([mtp] if mtp is not None else [])]:
            module.to(device)  # in place; the learner casts to its float32 master weights
        return cls(
            run.learner, model, tokenizer, mtp,
            sampling_temperature=sampling.temperature, mtp_depth_weights=run.policy.mtp.weights_per_depth(),
            fsdp=uses_fsdp(run, device), task_losses=task_losses(run),
        )  # fmt: skip

    # -- one optimizer step -------------------------------------------------------------------

    def train_step(self, batch: Batch, current_version: int | None = None) -> StepResult:
        """Select, compute advantages, accumulate gradients, step; returns what the step did.

        `batch` holds complete GRPO groups (every rollout of a group, aborted ones too).
        `current_version` is the version staleness is measured against (default: this learner's).
        With nothing to learn from (every group dropped or all-equal) no optimizer step is taken
        and the version stays; the rollouts are still accounted for in the result's ledger.
        """
        start = time.perf_counter()
        current = self.version if current_version is None else current_version
        selection = select(
            batch.groups, current_version=current, max_staleness=self.config.max_staleness, staleness_by=self.config.staleness_by,
            group_size=self.config.group_size, crash_statuses=self.config.crash_statuses,
        )  # fmt: skip
        rows, shaping = step_rows(selection, self.config, self.temperature, self._reward_kl(selection))
        updates = plan_updates(
            rows, selection.group_of, self.config.mini_batches, rank=self.rank, world=self.world, pad=self.pad,
            max_tokens=self.config.micro_batch_tokens, share=self.share_prefixes, every_row=self.config.entropy_coef > 0,
        )  # fmt: skip
        before, lr = self.version, self.scheduler.get_last_lr()[0]
        stats, norms = self._train(updates)
        if norms:
            self.version += 1
        gaps = warn_gaps(stats.consistency, self.config.logprob_gap_warning, self.version)
        config = self.config
        due = due_after_step(before, self.version, push_every=config.push_every, checkpoint_every=config.checkpoint_every)
        if due.push and config.reset_optimizer_on_push:
            self.reset_optimizer()  # fresh moments for the policy the engines are about to serve
        ledger = selection.ledger()
        metrics = {
            "mtp_loss": stats.mtp_loss if self._trained_mtp is not None else None,
            "kl": stats.kl_sum / max(stats.consistency.tokens, 1) if self.reference and config.kl.mode == "loss" else None,
            **stats.metrics(),
            **_norm_metrics(norms), "lr": lr, "updates": len(norms),
            "trainable_tokens": sum(u.totals.tokens for u in updates), "samples": len(rows),
            "skipped_zero_adv": sum(1 for row in rows if not computes(row, every_row=config.entropy_coef > 0)),
            **shaping, "rollouts": len(selection.accounts), "groups": len(set(selection.group_of)),
            "step_s": time.perf_counter() - start,
        }  # fmt: skip
        return StepResult(
            version=self.version, stepped=bool(norms), loss=stats.loss, grad_norm=norms[-1][0] if norms else None,
            ledger={account.value: ledger.get(account.value, 0) for account in Account}, padded=selection.padded,
            staleness=staleness_histogram(batch.samples, current, config.staleness_by), consistency_warnings=gaps, metrics=metrics,
        )  # fmt: skip

    def _reward_kl(self, selection: Selection) -> list[float] | None:
        """Each selected sample's summed KL estimate to the reference, where `learner.kl` is a reward penalty."""
        if self.reference is None or self.config.kl.mode != "reward":
            return None
        rows = to_rows(selection.batch, [0.0] * len(selection.batch), self.temperature)
        return reward_penalties(self.reference, rows, self.pad, self.config.micro_batch_tokens, self.device, self.config.kl.estimator)

    @property
    def _trained_mtp(self) -> MTPLayer | None:
        """The MTP layer when this learner trains it (it has one and a positive loss weight), else None."""
        return self.mtp if self.mtp is not None and self.config.mtp_loss_weight > 0 else None

    def _train(self, updates: list[Update]) -> tuple[_StepStats, list[tuple[float, float]]]:
        """Every update of the step, `learner.epochs` times over: (the first pass's figures, with the mean loss of
        all updates; each optimizer step's gradient norm before and after clipping)."""
        config = self.config
        reads_old = uses_old_policy(config.objective) or any(loss.reads_old for loss in self.task_losses.values())
        if config.epochs * len(updates) > 1 and reads_old:
            for update in updates:
                score_old(self.scorer, update.batches, self.device, routing_replay=config.routing_replay, fsdp=self.fsdp)
        first, losses, norms = _StepStats(), [], []
        for epoch in range(config.epochs):
            for update in updates:
                if not update.computes:
                    continue
                stats = self._accumulate(update)
                if self.world > 1:
                    if not self.fsdp:  # FSDP has reduced them already, layer by layer
                        all_reduce_gradients(self.params)
                    stats = _StepStats.combined(gather_objects(stats.portable()))  # every rank's, in rank order
                if epoch == 0:
                    first.merge(stats)
                losses.append(stats.loss)
                norms.append(self._step())
        first.loss = sum(losses) / len(losses) if losses else 0.0
        return first, norms

    def _accumulate(self, update: Update) -> _StepStats:
        """Forward and backward every micro-batch of `update` (this rank's share); gradients add up to the update's
        loss as `learner.loss_aggregation` divides it."""
        stats, config = _StepStats(), self.config
        # FSDP: agreed before any pass, since every pass's gathers are collectives too.
        passes = matched_passes(len(update.batches), self.device) if self.fsdp else len(update.batches)
        trains_mtp = self._trained_mtp is not None
        mtp = MTPTargets(float(max(update.computed_trainable, 1)), self.mtp_depth_weights) if trains_mtp else None
        for batch in update.batches:
            batch = batch.to(self.device)
            routes = batch.routes if self.config.routing_replay else None
            scored = (batch.input_ids, batch.attention_mask, batch.loss_mask, batch.temperatures, batch.rollout_logprobs)
            logp, aux, entropy = self.scorer(*scored, routes, mtp, batch.prefix, batch.truncation)
            mask = batch.loss_mask[:, 1:]
            advantages = _advantages(batch, logp, mask)
            scored_tokens = (logp, batch.rollout_logprobs[:, 1:], advantages, mask)
            out = by_task(self.objective, self.task_losses, batch.tasks, *scored_tokens, old=batch.old_logprobs)
            weights = token_weights(mask, self.config.loss_aggregation, update.totals, self.config.loss_constant)
            loss = ((out.per_token + self._kl_term(batch, logp, routes, stats)) * weights).sum()
            stats.entropy_sum += float(entropy.detach().sum())
            if config.entropy_coef > 0:  # a bonus: the step's mean entropy at trained tokens, subtracted
                loss = loss - config.entropy_coef * entropy.sum() / max(update.totals.tokens, 1)
            if aux is not None:
                (loss + self.config.mtp_loss_weight * aux).backward()
                stats.mtp_loss += aux.item()
            else:
                loss.backward()
            stats.loss += loss.item()
            stats.add(out, logp, batch, mask)
        for _ in range(passes - len(update.batches)):
            empty_pass(self.scorer, self.pad, self.device, mtp)
        return stats

    def _kl_term(self, batch: MicroBatch, logp: torch.Tensor, routes: torch.Tensor | None, stats: _StepStats) -> torch.Tensor | float:
        """coef x the KL estimate on each trained token, where `learner.kl` is a loss term (else 0); its mean is noted."""
        if self.reference is None or self.config.kl.mode != "loss":
            return 0.0
        mask = batch.loss_mask[:, 1:].bool()
        estimate = kl_estimate(logp, self.reference.logprobs(batch, routes), self.config.kl.estimator)
        estimate = torch.where(mask, estimate, torch.zeros_like(estimate))
        stats.kl_sum += float(estimate.detach().sum())
        return self.config.kl.coef * estimate

    def _step(self) -> tuple[float, float]:
        """Clip, step the optimizer and the learning-rate schedule: the gradient norm before and after clipping."""
        norm = total_norm(torch.nn.utils.clip_grad_norm_(self.params, self.config.grad_clip))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return norm, min(norm, self.config.grad_clip)

    # -- weights, checkpoints, optimizer ------------------------------------------------------

    def state_dict_for_push(self) -> dict[str, torch.Tensor]:
        """The policy's weights, plus its MTP layer under "mtp.*" when it trains one (so drafting
        engines keep drafting for the policy they serve), as CPU copies the engines can load while
        training goes on."""
        if self.fsdp:
            return self.push_tensors()  # gathered as CPU copies already
        return {name: t.detach().to("cpu", copy=True) for name, t in self.push_tensors().items()}

    def push_tensors(self) -> dict[str, torch.Tensor]:
        """What `state_dict_for_push` copies, as the live tensors on the learner's device (no copy): for a
        push that sends them while the learner waits (`asyncrl/weight_transfer.py`). A sharded learner's
        rank 0 returns what `gather_weights` gathered for this version."""
        if self.fsdp:
            if self._gathered is None or self._gathered[0] != self.version:
                raise RuntimeError(f"learner version {self.version}: its weights were not gathered (gather_weights on every rank)")
            weights, mtp_weights = dict(self._gathered[1]), self._gathered[2]
        else:
            weights, mtp_weights = dict(self.model.state_dict()), self.mtp.state_dict() if self.mtp is not None else {}
        if self._trained_mtp is not None:
            weights.update({f"mtp.{name}": t for name, t in mtp_weights.items()})
        return weights

    def needs_gather(self) -> bool:
        """Whether a push of this version needs `gather_weights` first (a sharded learner that has not)."""
        return self.fsdp and (self._gathered is None or self._gathered[0] != self.version)

    def gather_weights(self) -> None:
        """Gather the whole weights onto rank 0's CPU for the pushes of this version. A collective: every
        rank calls it (LearnerActor fans the call out)."""
        self._gathered = None  # the last version's copy is not kept beside the new one
        self._gathered = (self.version, *self.whole_state())

    def whole_state(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The policy's and the MTP layer's whole weights, gathered from the shards (a collective)."""
        whole = full_model_state(self.scorer)
        return _under(whole, "policy."), _under(whole, "mtp.")

    def held_bytes(self) -> int:
        """Bytes of weights and optimizer state this rank holds (with FSDP, its shards: about 1/num_ranks)."""
        tensors = [*self.model.parameters(), *(t for state in self.optimizer.state.values() for t in state.values())]
        return sum(local_bytes(t) for t in tensors if isinstance(t, torch.Tensor))

    def reset_optimizer(self) -> None:
        """Fresh moments (AdamW's, Muon's momentum buffers) for every parameter."""
        self.optimizer.state.clear()

    def save(self, directory: str | Path) -> Path:
        """An HF checkpoint (policy + MTP layer) with the optimizer, schedule and version beside it (learner/resume.py).
        Sharded, a collective every rank calls; rank 0 writes."""
        return save_learner(self, Path(directory))

    def load(self, directory: str | Path) -> None:
        """Resume from `save`: weights, MTP layer, optimizer moments, schedule and version."""
        load_learner(self, Path(directory))
        self._gathered = None


def _under(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The entries of `state` under `prefix`, without it."""
    return {name.removeprefix(prefix): t for name, t in state.items() if name.startswith(prefix)}


def _norm_metrics(norms: list[tuple[float, float]]) -> dict[str, float | None]:
    """The step's gradient norms before and after clipping (the last update's; the largest over its updates)."""
    if not norms:
        return {"grad_norm_before_clip": None, "grad_norm_after_clip": None, "grad_norm_max": None}
    return {"grad_norm_before_clip": norms[-1][0], "grad_norm_after_clip": norms[-1][1], "grad_norm_max": max(n for n, _ in norms)}


def _advantages(batch: MicroBatch, logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B] reward advantages, or [B, T-1] per-token ones when the micro-batch holds distillation rows."""
    if not bool(batch.distill.any()):
        return batch.advantages
    per_token = distill_advantages(batch.teacher_logprobs[:, 1:], logp, mask)
    return torch.where(batch.distill[:, None], per_token, batch.advantages[:, None].expand_as(per_token))
