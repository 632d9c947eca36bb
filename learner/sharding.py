"""FSDP2 for the data-parallel learner (`learner.sharding`): each of the `learner.num_ranks` ranks holds a
1/num_ranks shard of the weights, gradients and optimizer state (torch's `fully_shard`), so a policy that does
not fit one device trains across several. The replicated alternative is learner/distributed.py.

What sharding changes in a step, and why:

- The learner scores with the decoder and then the head (`policy_hidden`, `trainable_logprobs`), never the HF
  model's own forward, so the FSDP root is a `Scorer` whose forward is exactly that: its hooks gather the
  embedding, final norm and head (one group, so a tied head is no problem), and each decoder layer is a
  group of its own, gathered for its forward and backward only.
- Every rank runs the same number of forward/backward passes, because every layer's all-gather and
  reduce-scatter is a collective: a rank with fewer micro-batches than another runs empty ones
  (`empty_pass`: one token, zero loss).
- The reduce-scatter sums instead of averaging (divide factor 1): each micro-batch's loss is already
  scaled by the step's trainable tokens over all ranks, so the sum is the one-rank gradient, as in the
  replicated learner.
- The full weights exist only when gathered (`full_model_state`, a collective every rank joins: the
  actor fans the call out), as CPU tensors on rank 0, for the weight push and the checkpoint.
- The optimizer state goes to disk in the single-process layout (`optimizer.state_dict()`'s parameter
  indices), so a checkpoint resumes under any rank count and either sharding.

The MTP layer is a child of the `Scorer` (its block a group of its own, its norms and projection in the
root's), and its loss is computed inside the root's forward: it reads the policy's embedding and head,
which are whole only there. Muon orthogonalizes whole matrices; under FSDP each rank runs the elementwise
parts of the update on its shards and the Newton-Schulz of every num_ranks-th matrix, gathered whole, and
broadcasts the result (`BlockMuon._update_sharded`): exact, each orthogonalization run once.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel

from asyncrl.configs.schema import RunConfig
from asyncrl.policy.hardware import cpu_has_bf16
from asyncrl.policy.mtp import MTPLayer, decoder_and_head, mtp_loss, policy_hidden
from asyncrl.policy.token_logprobs import trainable_logprobs_and_entropy

from .optim import CombinedOptimizer
from .prefix import PrefixSplit, shared_hidden
from .routing_replay import replay

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
"""Whole tensors, on the CPU of rank 0 only (the other ranks get empty dicts)."""


@dataclass(frozen=True)
class MTPTargets:
    """How a step trains the MTP layer (`mtp_loss`'s arguments besides the micro-batch)."""

    num_tokens: float
    """The step's trainable tokens, over all ranks: every depth's summed loss is divided by it."""
    depth_weights: Sequence[float]
    """lambda_1..lambda_D."""

    @property
    def depth(self) -> int:
        return len(self.depth_weights)


class Scored(NamedTuple):
    """What the learner's forward gives for a micro-batch."""

    logp: torch.Tensor
    """[B, T-1] log-prob of token j+1 where it is trained (the fill elsewhere)."""
    mtp_loss: torch.Tensor | None
    """The MTP layer's loss where it is trained, else None."""
    entropy: torch.Tensor
    """[B, T-1] entropy of the policy's tempered distribution at trained positions, 0 elsewhere."""


class Scorer(nn.Module):
    """The learner's forward: the policy's log-probs of the trainable tokens (its decoder, then its head on those
    positions only: `asyncrl/policy/token_logprobs.py`), under routing replay where the micro-batch has routes, and the
    MTP layer's loss where it is trained. The head runs inside this forward so that under FSDP it is whole.
    With `autocast` (`learner.precision` bf16-mixed) the decoder runs in bfloat16 autocast, its backward too,
    over float32 weights; the heads' logits and log-softmax stay float32."""

    def __init__(self, policy: PreTrainedModel, mtp: MTPLayer | None, chunk_tokens: int, autocast: torch.dtype | None = None) -> None:
        super().__init__()
        self.policy = policy
        self.mtp = mtp
        self.chunk_tokens = chunk_tokens
        self.autocast = autocast
        """The dtype the decoder's forward (and so its backward) autocasts to (`learner.precision` bf16-mixed:
        `autocast_dtype`); None: the weights' own. The heads compute in the weights' dtype either way."""

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        loss_mask: torch.Tensor,
        temperatures: torch.Tensor,
        fill: torch.Tensor,
        routes: torch.Tensor | None = None,
        mtp: MTPTargets | None = None,
        prefix: PrefixSplit | None = None,
        truncation: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> Scored:
        """The log-probs and entropies of the tokens `loss_mask` marks, at their `temperatures` (`fill` and 0
        elsewhere: `trainable_logprobs_and_entropy`), and the MTP loss over those tokens where `mtp` is given,
        through the shared prefixes of `prefix` where given (the same figures, `learner/prefix.py`), under the
        engine's top-k / top-p where `truncation` gives them."""
        if prefix is not None and routes is not None:
            raise ValueError("routing replay scores whole rows: each row's prompt has routes of its own")
        mixed = self.autocast is not None
        with torch.autocast(input_ids.device.type, dtype=self.autocast) if mixed else contextlib.nullcontext():
            if prefix is not None:
                hidden = shared_hidden(self.policy, prefix)
            else:
                with replay(self.policy, routes):
                    hidden = policy_hidden(self.policy, input_ids, attention_mask)
        head = decoder_and_head(self.policy)[1]
        scored = (head, hidden, input_ids, temperatures, loss_mask, fill, self.chunk_tokens)
        logp, entropy = trainable_logprobs_and_entropy(*scored, truncation)
        if mtp is None or self.mtp is None:
            return Scored(logp, None, entropy)
        # Detached hidden states: the drafter follows the policy without pulling the trunk toward every
        # sampled token (negative-advantage ones included). Inside this forward, so that under FSDP the
        # embedding and head it shares with the policy are whole. The MTP layer computes in its weights'
        # dtype, autocast or not (what it did before bf16-mixed): the states it reads come in that dtype.
        weight = head.weight
        assert isinstance(weight, torch.Tensor)
        detached = hidden.detach().to(weight.dtype) if mixed else hidden.detach()
        aux = mtp_loss(
            self.policy, self.mtp, detached, input_ids, attention_mask, loss_mask,
            mtp.depth, mtp.num_tokens, mtp.depth_weights, self.chunk_tokens,
        )  # fmt: skip
        return Scored(logp, aux, entropy)


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """What the `Scorer`'s decoder autocasts to under `learner.precision` on `device`: None (fp32) or bfloat16
    (bf16-mixed). Refuses a GPU without bfloat16 units; warns on a CPU without bfloat16 instructions, where
    torch emulates bfloat16 matmuls (slower than float32, not wrong)."""
    if precision == "fp32":
        return None
    if precision != "bf16-mixed":
        raise ValueError(f"learner.precision={precision!r}: expected fp32 or bf16-mixed")
    if device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
        raise ValueError(f"learner.precision=bf16-mixed: {torch.cuda.get_device_name(device)} has no bfloat16 units; use fp32")
    if device.type == "cpu" and not cpu_has_bf16():
        warnings.warn(
            "learner.precision=bf16-mixed: this CPU lists no bfloat16 instructions (avx512_bf16, amx_bf16 in "
            "/proc/cpuinfo), so bfloat16 is emulated there: slower than fp32",
            stacklevel=2,
        )
    return torch.bfloat16


def uses_fsdp(run: RunConfig, device: torch.device) -> bool:
    """Whether this learner shards: `learner.sharding` fsdp, or auto on CUDA."""
    learner = run.learner
    if learner.num_ranks == 1 or learner.sharding == "replicate":
        return False
    if learner.sharding == "fsdp":
        return True
    return device.type == "cuda"


def shard(scorer: Scorer, world: int, device: torch.device) -> None:
    """`fully_shard` every decoder layer, then the root (embedding, final norm, head), over all `world` ranks."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    mesh = init_device_mesh(device.type, (world,))
    # transformers' decoder layers of every family derive from GradientCheckpointingLayer.
    for layer in [m for m in scorer.modules() if isinstance(m, GradientCheckpointingLayer)]:
        fully_shard(layer, mesh=mesh)
    fully_shard(scorer, mesh=mesh)
    for module in scorer.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            # A plain SUM (gloo has no PREMUL_SUM, which FSDP would use to multiply by 1 / factor).
            module.set_force_sum_reduction_for_comms(True)


def matched_passes(passes: int, device: torch.device) -> int:
    """The most forward/backward passes any rank has this step: what every rank runs."""
    most = torch.tensor([passes], device=device)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    return int(most.item())


def empty_pass(scorer: Scorer, pad_token_id: int, device: torch.device, mtp: MTPTargets | None) -> None:
    """A forward and backward that joins every group's collectives (the MTP layer's too, where `mtp` says it is
    trained) and adds nothing to any gradient."""
    ids = torch.full((1, 2 + (mtp.depth if mtp is not None else 0)), pad_token_id, device=device)
    none = torch.zeros_like(ids)
    logp, aux, entropy = scorer(ids, torch.ones_like(ids), none, torch.ones_like(ids), none, None, mtp)
    ((logp.sum() + entropy.sum() + (aux if aux is not None else 0.0)) * 0.0).backward()


def total_norm(norm: torch.Tensor) -> float:
    """`clip_grad_norm_`'s result as a number (over sharded gradients it is a DTensor)."""
    return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)


def local_bytes(tensor: torch.Tensor) -> int:
    """Bytes this rank stores of `tensor` (its shard of a DTensor)."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole weights as CPU tensors on rank 0 ({} on the others). A collective: every rank calls it."""
    state: Any = get_model_state_dict(model, options=FULL)  # typed for any value; these are tensors
    return state


def load_full_model_state(model: nn.Module, state: dict[str, torch.Tensor], strict: bool = True) -> None:
    """Whole weights (every rank has them) into this rank's shards (`strict` False: some may be missing)."""
    whole: Any = state
    set_model_state_dict(model, whole, options=StateDictOptions(full_state_dict=True, strict=strict))


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's whole state in `optimizer.state_dict()`'s layout, on rank 0 ({} on the others). A
    collective: every rank calls it."""
    if isinstance(optimizer, CombinedOptimizer):  # Muon and AdamW: each its own state dict
        parts = {name: full_optimizer_state(model, inner) for name, inner in optimizer.optimizers.items()}
        return parts if all(parts.values()) else {}
    if not optimizer.state:
        # Fresh moments (before the first step, or reset on a push): the hyperparameters alone. torch's full
        # state dict would first make a state by stepping with zero gradients, moving AdamW's step count.
        return optimizer.state_dict() if dist.get_rank() == 0 else {}
    state: Any = get_optimizer_state_dict(model, optimizer, options=FULL)
    if not state:
        return {}
    index = {name: i for i, name in enumerate(parameter_names(model, optimizer))}
    return {
        "state": {index[name]: value for name, value in state["state"].items()},
        "param_groups": [{**group, "params": [index[name] for name in group["params"]]} for group in state["param_groups"]],
    }


def load_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    """`optimizer.state_dict()`-layout state (a checkpoint of any rank count) into this rank's shards."""
    if isinstance(optimizer, CombinedOptimizer):
        if set(saved) != set(optimizer.optimizers):
            raise ValueError(f"optimizer state of {sorted(saved)}, expected {sorted(optimizer.optimizers)} (another optimizer.type?)")
        for name, inner in optimizer.optimizers.items():
            load_optimizer_state(model, inner, saved[name])
        optimizer.param_groups = [g for o in optimizer.optimizers.values() for g in o.param_groups]
        return
    if not saved["state"]:
        optimizer.load_state_dict(saved)  # fresh moments: no tensors to shard (and no zero-gradient step to make some)
        return
    names = parameter_names(model, optimizer)
    state: Any = {
        "state": {names[int(i)]: value for i, value in saved["state"].items()},
        "param_groups": [{**group, "params": [names[int(i)] for i in group["params"]]} for group in saved["param_groups"]],
    }
    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))


def parameter_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The name of every parameter the optimizer steps, in the order `optimizer.state_dict()` numbers them."""
    names = {id(param): name for name, param in model.named_parameters()}
    return [names[id(param)] for group in optimizer.param_groups for param in group["params"]]
