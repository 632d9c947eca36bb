"""Data parallelism for the RL learner: `learner.num_ranks` processes, one torch.distributed group.

Every rank holds the whole policy and its optimizer (data parallel with replicated state, DDP's
semantics): a step's samples reach every rank, each runs the same selection (it is deterministic),
computes its share of the rows (`shard_rows`: balanced by token count), and the gradients are summed
over the group (`all_reduce_gradients`) before the clip and the optimizer step. The loss of every
micro-batch is already scaled by the step's trainable tokens over *all* rows, so the sum is exactly
the one-rank gradient; every rank then applies the same update to the same weights and stays
identical without a broadcast. Rank 0 therefore has the full state for the push and the checkpoint,
and a checkpoint resumes under any rank count.

The group runs gloo on CPU and NCCL on CUDA. Sharding the parameters themselves (FSDP2, for models
that do not fit one device) is learner/sharding.py (`learner.sharding`); the split of the rows is the same.
"""

from __future__ import annotations

import datetime
import socket
from collections.abc import Sequence
from typing import TypeVar

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .sft_data import Masked

GROUP_TIMEOUT = datetime.timedelta(minutes=10)
"""How long a collective waits for a rank that neither answers nor dies."""
BUCKET_BYTES = 32 << 20
"""Gradients are reduced in flattened buckets of about this size: few collective calls, bounded extra memory."""


R = TypeVar("R", bound=Masked)


def shard_rows(rows: Sequence[R], rank: int, world: int) -> list[R]:
    """This rank's rows: longest first, each to the rank with the fewest tokens so far (ties: lowest rank).
    Deterministic, so every rank computes the same split from the same rows; the original order is kept."""
    if world == 1:
        return list(rows)
    load = [0] * world
    owner = [0] * len(rows)
    for index in sorted(range(len(rows)), key=lambda i: -len(rows[i].token_ids)):
        target = min(range(world), key=lambda r: (load[r], r))
        owner[index] = target
        load[target] += len(rows[index].token_ids)
    return [row for row, who in zip(rows, owner, strict=True) if who == rank]


def all_reduce_gradients(params: Sequence[torch.nn.Parameter]) -> None:
    """Sum every parameter's gradient over the group, in place (a rank that computed no rows adds zeros)."""
    for param in params:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
    bucket: list[torch.Tensor] = []
    size = 0
    for param in params:
        assert param.grad is not None
        bucket.append(param.grad)
        size += param.grad.numel() * param.grad.element_size()
        if size >= BUCKET_BYTES:
            _reduce(bucket)
            bucket, size = [], 0
    if bucket:
        _reduce(bucket)


def _reduce(grads: list[torch.Tensor]) -> None:
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    for grad, reduced in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
        grad.copy_(reduced)


def broadcast_parameters(params: Sequence[torch.Tensor]) -> None:
    """Rank 0's values into every rank's parameters: the ranks start identical however each built its model."""
    for param in params:
        dist.broadcast(param.data, src=0)


def gather_objects(value: object) -> list:
    """Every rank's `value`, in rank order (picklable objects: the ranks' step statistics)."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def free_address() -> tuple[str, int]:
    """This node's address and a free TCP port for the group's rendezvous (rank 0 calls it)."""
    import ray

    host = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
    with socket.socket() as probe:
        probe.bind(("", 0))
        return host, probe.getsockname()[1]


def join_group(address: tuple[str, int], rank: int, world: int, device: torch.device) -> None:
    """Join the learner's process group (gloo on CPU, NCCL on CUDA) at rank 0's address."""
    host, port = address
    backend = "nccl" if device.type == "cuda" else "gloo"
    # A rank that dies closes its sockets and the others' collectives fail at once; the timeout bounds
    # what it cannot catch (a rank that hangs), well above any step.
    dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=rank, world_size=world, timeout=GROUP_TIMEOUT)
