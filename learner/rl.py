"""The RL learner: one optimizer step per call on the samples of complete GRPO groups (docs/LEARNER.md, "The rules").

A step is a few named verbs:

    select      -> drop aborted, crashed and stale rollouts; fill or drop GRPO groups (`selection`)
    advantages  -> group-relative advantages over the filled groups, padding repeats included
    accumulate  -> teacher-forced log-probs of every sampled token, the objective, backward
    step        -> gradient clip, the optimizer (`learner.optimizer`: AdamW, Muon, Muon Split); the policy version goes up by one

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
`rollout.sampling.temperature`). top-k / top-p renormalise over a truncated distribution the learner
does not reproduce; such runs get a warning and ratios below 1 on every truncated step.

Distillation samples (cross-stage distillation, `distill/`) go through the same step: selection
(group size 1), the same objective, masks and staleness rule. They carry the teacher's log-prob of
every token, and their advantage is per token, stop-grad(log pi_teacher - log pi_theta) with
log pi_theta this step's own detached log-prob (`distill_advantages` in `learner/objectives.py` says why), computed after the
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import PreTrainedModel

from asyncrl.configs.schema import LearnerConfig, RunConfig
from asyncrl.policy.checkpoint import build_policy, load_policy, save_policy
from asyncrl.policy.mtp import MTPLayer, check_plain_head
from asyncrl.policy.routing import use_shared_selection
from asyncrl.records import Account, Batch, StepResult, due_after_step

from .batch import MicroBatch, Row, micro_batches, staleness_histogram, to_rows
from .consistency import ConsistencyStats, warn_gaps
from .distributed import all_reduce_gradients, broadcast_parameters, gather_objects, shard_rows
from .objectives import ObjectiveOutput, distill_advantages, double_sided_is_loss, group_advantages, icepop_grpo_loss
from .optim import build_optimizer
from .prefix import sharing_refusal
from .selection import Selection, select
from .sharding import (
    MTPTargets,
    Scorer,
    empty_pass,
    full_model_state,
    full_optimizer_state,
    load_full_model_state,
    load_optimizer_state,
    local_bytes,
    matched_passes,
    shard,
    total_norm,
    uses_fsdp,
)

STATE_FILE = "learner_state.pt"
"""Optimizer state and policy version, saved beside the HF checkpoint."""


Objective = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], ObjectiveOutput]


def make_objective(config: LearnerConfig) -> Objective:
    """(logp, logp_rollout, advantages, loss_mask) -> ObjectiveOutput, as the config selects."""
    if config.objective == "icepop_grpo":
        return partial(icepop_grpo_loss, eps_low=config.eps_low, eps_high=config.eps_high, beta=config.icepop_beta)
    return partial(double_sided_is_loss, eps_low=config.eps_low, eps_high=config.eps_high)


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


def advantages_for(selection: Selection, normalize_std: bool) -> list[float]:
    """Group-relative advantages of the selected batch; exactly 0 for every all-equal group.

    The exact zero matters: a float mean of equal rewards can differ from them in the last bit,
    and only an exact zero lets those samples be skipped without changing the step.
    """
    if not selection.batch:
        return []
    rewards = torch.tensor([s.reward for s in selection.batch], dtype=torch.float64)
    index = torch.tensor(selection.group_of)
    advantages = group_advantages(rewards, index, normalize_std=normalize_std).tolist()
    spread: dict[int, set[float]] = {}
    for group, reward in zip(selection.group_of, rewards.tolist(), strict=True):
        spread.setdefault(group, set()).add(reward)
    return [0.0 if len(spread[g]) == 1 else a for g, a in zip(selection.group_of, advantages, strict=True)]


@dataclass
class _StepStats:
    """Sums over the computed micro-batches of one step; the ratio and log-prob gap figures come from
    `consistency` and, like it, cover the computed rows only (`computed_trainable_tokens` of them)."""

    loss: float = 0.0
    mtp_loss: float = 0.0
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
    ) -> None:
        self.config = config
        # Eval mode: no dropout, so the learner scores the very function the engines sample from
        # (gradients flow all the same).
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.mtp = mtp.eval() if mtp is not None else None
        self.temperature = sampling_temperature if sampling_temperature > 0 else 1.0
        """The run's sampling temperature, for tokens with none on record."""
        self.mtp_depth_weights = list(mtp_depth_weights)
        """lambda_k of the MTP loss for depths 1..len (policy.mtp.train_depth)."""
        self.version = version
        """Policy version of the current weights: +1 per optimizer step."""
        self.objective = make_objective(config)
        if config.freeze_indexer:
            # The MTP block runs a DSA indexer of its own: frozen with the policy's.
            for name, param in [*model.named_parameters(), *(mtp.named_parameters() if mtp is not None else ())]:
                if ".indexer." in name:
                    param.requires_grad_(False)
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
        self.scorer = Scorer(model, self.mtp, config.logits_chunk_tokens)
        self.fsdp = fsdp and self.world > 1
        """Sharded over the ranks (learner/sharding.py) rather than replicated on each."""
        if self.fsdp:
            shard(self.scorer, self.world, self.device)
        self.share_prefixes = self._shares_prefixes()
        """Whether micro-batches score their rows' shared prefixes once (`learner.share_prefixes`, learner/prefix.py)."""
        self._gathered: tuple[int, dict[str, torch.Tensor], dict[str, torch.Tensor]] | None = None
        """(version, the policy's whole weights, the MTP layer's) on the CPU, of the last `gather_weights` (rank 0
        of a sharded learner)."""
        self.params = [p for p in model.parameters() if p.requires_grad]
        if (trained_mtp := self._trained_mtp) is not None:
            # The MTP layer shares the policy's embedding and head; list those only once.
            seen = {id(p) for p in self.params}
            self.params += [p for p in trained_mtp.parameters() if p.requires_grad and id(p) not in seen]
        self.optimizer = build_optimizer(
            config.optimizer, model, self.params, lr=config.lr, weight_decay=config.weight_decay,
            extra=[trained_mtp] if trained_mtp is not None else [],
        )  # fmt: skip

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
        if sampling.top_p < 1.0 or sampling.top_k > 0:
            warnings.warn(
                "rollouts sample with top-k/top-p: their log-probs are of a truncated distribution the learner "
                "does not reproduce, so importance ratios are biased below 1",
                stacklevel=2,
            )
        device = learner_device(run)
        model, tokenizer, mtp = build_policy(run.policy, run.seed)
        modules: list[torch.nn.Module] = [model, *([mtp] if mtp is not None else [])]
        for module in modules:
            module.to(device)  # in place
        return cls(
            run.learner, model, tokenizer, mtp,
            sampling_temperature=sampling.temperature, mtp_depth_weights=run.policy.mtp.weights_per_depth(),
            fsdp=uses_fsdp(run, device),
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
            batch.groups, current_version=current, max_staleness=self.config.max_staleness,
            group_size=self.config.group_size, crash_statuses=self.config.crash_statuses,
        )  # fmt: skip
        advantages = advantages_for(selection, self.config.normalize_adv_std)
        rows = to_rows(selection.batch, advantages, self.temperature)
        computed = [row for row in rows if row.advantage != 0.0 or row.teacher_logprobs is not None]
        trainable = sum(sum(row.loss_mask[1:]) for row in rows)
        computed_trainable = sum(sum(row.loss_mask[1:]) for row in computed)
        stats = self._accumulate(shard_rows(computed, self.rank, self.world), trainable, computed_trainable)
        if self.world > 1:
            if computed and not self.fsdp:  # FSDP has reduced them already, layer by layer
                all_reduce_gradients(self.params)
            stats = _StepStats.combined(gather_objects(stats.portable()))  # every rank's, in rank order
        before = self.version
        grad_norm = self._step() if computed else None
        gaps = warn_gaps(stats.consistency, self.config.logprob_gap_warning, self.version)
        config = self.config
        due = due_after_step(before, self.version, push_every=config.push_every, checkpoint_every=config.checkpoint_every)
        if due.push and config.reset_optimizer_on_push:
            self.reset_optimizer()  # fresh moments for the policy the engines are about to serve
        ledger = selection.ledger()
        metrics = {
            "mtp_loss": stats.mtp_loss if self._trained_mtp is not None else None,
            **stats.metrics(),
            "trainable_tokens": trainable, "samples": len(rows), "skipped_zero_adv": len(rows) - len(computed),
            "rollouts": len(selection.accounts), "groups": len(set(selection.group_of)),
            "step_s": time.perf_counter() - start,
        }  # fmt: skip
        return StepResult(
            version=self.version, stepped=grad_norm is not None, loss=stats.loss, grad_norm=grad_norm,
            ledger={account.value: ledger.get(account.value, 0) for account in Account}, padded=selection.padded,
            staleness=staleness_histogram(batch.samples, current), consistency_warnings=gaps, metrics=metrics,
        )  # fmt: skip

    @property
    def _trained_mtp(self) -> MTPLayer | None:
        """The MTP layer when this learner trains it (it has one and a positive loss weight), else None."""
        return self.mtp if self.mtp is not None and self.config.mtp_loss_weight > 0 else None

    def _accumulate(self, rows: list[Row], total_trainable: int, computed_trainable: int) -> _StepStats:
        """Forward and backward every micro-batch of `rows` (this rank's share); gradients add up to the whole
        step's token mean (`total_trainable`: every selected row's trainable tokens; `computed_trainable`:
        those of the computed rows, all ranks' shares)."""
        stats = _StepStats()
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        batches = micro_batches(rows, pad, self.config.micro_batch_tokens, self.share_prefixes)
        # FSDP: agreed before any pass, since every pass's gathers are collectives too.
        passes = matched_passes(len(batches), self.device) if self.fsdp else len(batches)
        mtp = MTPTargets(float(max(computed_trainable, 1)), self.mtp_depth_weights) if self._trained_mtp is not None else None
        for batch in batches:
            batch = batch.to(self.device)
            routes = batch.routes if self.config.routing_replay else None
            scored = (batch.input_ids, batch.attention_mask, batch.loss_mask, batch.temperatures, batch.rollout_logprobs)
            logp, aux = self.scorer(*scored, routes, mtp, batch.prefix)
            mask = batch.loss_mask[:, 1:]
            out = self.objective(logp, batch.rollout_logprobs[:, 1:], _advantages(batch, logp, mask), mask)
            # The objective divides by this micro-batch's trainable tokens; rescale to the step's.
            loss = out.loss * (float(mask.sum()) / max(total_trainable, 1))
            if aux is not None:
                (loss + self.config.mtp_loss_weight * aux).backward()
                stats.mtp_loss += aux.item()
            else:
                loss.backward()
            stats.loss += loss.item()
            stats.add(out, logp, batch, mask)
        for _ in range(passes - len(batches)):
            empty_pass(self.scorer, pad, self.device, mtp)
        return stats

    def _step(self) -> float:
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.config.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        return total_norm(grad_norm)

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
        self._gathered = (self.version, *self._whole_state())

    def _whole_state(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
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
        """An HF checkpoint (policy + MTP layer) with the optimizer state and version beside it. Sharded, a
        collective every rank calls; rank 0 writes."""
        provenance = {"asyncrl": {"stage": "rl", "version": self.version}}
        weights, mtp_weights, optimizer = None, None, self.optimizer.state_dict()
        if self.fsdp:
            (weights, mtp_weights), optimizer = self._whole_state(), full_optimizer_state(self.scorer, self.optimizer)
            if self.rank > 0:
                return Path(directory)
        directory = save_policy(
            directory, self.model, self.tokenizer, self.mtp, extra_config=provenance, state_dict=weights, mtp_state=mtp_weights
        )
        state = {"version": self.version, "optimizer": optimizer, "config": self.config.model_dump()}
        torch.save(state, directory / STATE_FILE)
        return directory

    def load(self, directory: str | Path) -> None:
        """Resume from `save`: weights, MTP layer, optimizer moments and version."""
        directory = Path(directory)
        model, _, mtp = load_policy(directory)
        if self.fsdp:
            whole = {f"policy.{name}": t for name, t in model.state_dict().items()}
            if self.mtp is not None and mtp is not None:
                whole.update({f"mtp.{name}": t for name, t in mtp.state_dict().items()})
            # A checkpoint without an MTP layer leaves this learner's fresh one as it is.
            load_full_model_state(self.scorer, whole, strict=self.mtp is None or mtp is not None)
        else:
            self.model.load_state_dict(model.state_dict())
            if self.mtp is not None and mtp is not None:
                self.mtp.load_state_dict(mtp.state_dict())
        state = torch.load(directory / STATE_FILE, map_location=self.device, weights_only=True)
        if self.fsdp:
            load_optimizer_state(self.scorer, self.optimizer, state["optimizer"])
        else:
            self.optimizer.load_state_dict(state["optimizer"])
        self.version = int(state["version"])
        self._gathered = None


def _under(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The entries of `state` under `prefix`, without it."""
    return {name.removeprefix(prefix): t for name, t in state.items() if name.startswith(prefix)}


def _advantages(batch: MicroBatch, logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B] reward advantages, or [B, T-1] per-token ones when the micro-batch holds distillation rows."""
    if not bool(batch.distill.any()):
        return batch.advantages
    per_token = distill_advantages(batch.teacher_logprobs[:, 1:], logp, mask)
    return torch.where(batch.distill[:, None], per_token, batch.advantages[:, None].expand_as(per_token))
