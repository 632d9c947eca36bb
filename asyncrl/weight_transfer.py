"""Weights from the learner straight to the engines: a broadcast group instead of the Ray object store.

On the object-store path (`sched/workers.py` RayWorkers.push) a push copies the learner's weights
to host memory, serializes them into the object store, and every engine copies them back to its device.
With `rollout.weight_transport=broadcast` the learner (rank 0) and the engines (ranks 1..N) form one
torch.distributed group of their own, NCCL between GPUs and gloo on CPU, and rank 0 broadcasts the
weights in buckets: each bucket packs whole tensors as raw bytes, so every dtype travels in one
collective per bucket, and the learner never holds more than one bucket beyond its weights. The
engines receive into buffers on their own device and swap all the weights in at once between two
steps (`EngineFront.update_weights`), as on the object-store path.

The group is separate from the learner's data-parallel group (a `ProcessGroup` built on its own
`TCPStore`, not `init_process_group`), and every group has a generation: when the engines change (one
died and was replaced), the driver opens the next one and the old one is dropped.

NCCL refuses two ranks on one GPU. Where every engine shares the learner's GPU (fractional
`gpus_per_rank` / `gpus_per_worker`), `cuda_ipc` hands the engines CUDA IPC handles to the learner's
packed buckets instead (`share`, `open_shared`), one bucket at a time, and each engine copies it out.
`resolve_transport` picks one for the devices at hand.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

BUCKET_BYTES = 256 << 20
"""Most bytes one broadcast carries (a tensor larger than this travels alone): the learner's extra memory
during a push, and the unit of overlap between packing and sending."""
ALIGN = 64
"""Every tensor starts at a multiple of this many bytes in its bucket, so it can be viewed as its dtype."""
GROUP_TIMEOUT = datetime.timedelta(minutes=5)
"""How long a broadcast waits for a rank that neither answers nor dies (a dead one fails it at once)."""


@dataclass(frozen=True)
class Slot:
    """Where one tensor lies in the buckets."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    bucket: int
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Layout:
    """How a state dict is cut into buckets: the same on every rank (rank 0 plans it, the driver hands it on)."""

    slots: tuple[Slot, ...]
    bucket_sizes: tuple[int, ...]

    @classmethod
    def plan(cls, tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = BUCKET_BYTES) -> Layout:
        slots: list[Slot] = []
        sizes: list[int] = []
        for name, tensor in tensors:
            nbytes = tensor.numel() * tensor.element_size()
            start = -(-sizes[-1] // ALIGN) * ALIGN if sizes else 0
            if not sizes or (start + nbytes > bucket_bytes and sizes[-1] > 0):
                sizes.append(0)
                start = 0
            slots.append(Slot(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), len(sizes) - 1, start, nbytes))
            sizes[-1] = start + nbytes
        return cls(tuple(slots), tuple(sizes))

    @property
    def total_bytes(self) -> int:
        return sum(slot.nbytes for slot in self.slots)

    def in_bucket(self, bucket: int) -> list[Slot]:
        return [slot for slot in self.slots if slot.bucket == bucket]


def pack(layout: Layout, bucket: int, tensors: Mapping[str, torch.Tensor], device: torch.device) -> torch.Tensor:
    """Bucket `bucket` of `tensors` as one byte buffer on `device`."""
    buffer = torch.empty(layout.bucket_sizes[bucket], dtype=torch.uint8, device=device)
    for slot in layout.in_bucket(bucket):
        tensor = tensors[slot.name].detach()
        if str(tensor.dtype).removeprefix("torch.") != slot.dtype or tuple(tensor.shape) != slot.shape:
            raise ValueError(f"weight {slot.name} is {tensor.dtype} {tuple(tensor.shape)}, the layout says {slot.dtype} {slot.shape}")
        buffer[slot.offset : slot.offset + slot.nbytes].copy_(tensor.contiguous().reshape(-1).view(torch.uint8), non_blocking=True)
    return buffer


def unpack(layout: Layout, bucket: int, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
    """The tensors of bucket `bucket`, as views into `buffer` (no copy)."""
    return {
        slot.name: buffer[slot.offset : slot.offset + slot.nbytes].view(getattr(torch, slot.dtype)).view(slot.shape)
        for slot in layout.in_bucket(bucket)
    }


def host_store(world: int) -> tuple[dist.TCPStore, tuple[str, int]]:
    """The rendezvous of a new group, served by rank 0's process on a free port; its address for the others."""
    import ray

    host = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
    store = dist.TCPStore(host, 0, world, is_master=True, timeout=GROUP_TIMEOUT, wait_for_workers=False)
    return store, (host, store.port)


class WeightGroup:
    """One process's membership in a broadcast group (rank 0 sends, the others receive)."""

    def __init__(self, address: tuple[str, int], rank: int, world: int, backend: str, generation: int, store=None) -> None:
        """`store`: rank 0's own `host_store`; the others connect to `address`. Blocks until every rank joined
        (gloo), or until the first broadcast (NCCL)."""
        host, port = address
        store = store if store is not None else dist.TCPStore(host, port, world, is_master=False, timeout=GROUP_TIMEOUT)
        prefixed = dist.PrefixStore(f"asyncrl-weights/{generation}", store)
        self.generation, self.rank, self.backend = generation, rank, backend
        self._store = store  # rank 0's serves the others' rendezvous for the group's lifetime
        self._group: dist.ProcessGroup
        if backend == "nccl":
            self.device = torch.device("cuda", torch.cuda.current_device())
            self._group = dist.ProcessGroupNCCL(prefixed, rank, world, dist.ProcessGroupNCCL.Options())  # type: ignore[assignment]
        elif backend == "gloo":
            self.device = torch.device("cpu")
            self._group = dist.ProcessGroupGloo(prefixed, rank, world, GROUP_TIMEOUT)  # type: ignore[assignment]
        else:
            raise ValueError(f"weight group backend {backend!r}: expected nccl or gloo")

    def send(self, layout: Layout, tensors: Mapping[str, torch.Tensor]) -> None:
        for bucket in range(len(layout.bucket_sizes)):
            self._broadcast(pack(layout, bucket, tensors, self.device))

    def receive(self, layout: Layout) -> dict[str, torch.Tensor]:
        received: dict[str, torch.Tensor] = {}
        for bucket, size in enumerate(layout.bucket_sizes):
            buffer = torch.empty(size, dtype=torch.uint8, device=self.device)
            self._broadcast(buffer)
            received.update(unpack(layout, bucket, buffer))
        return received

    def close(self) -> None:
        """Leave the group: the other ranks' pending broadcasts fail instead of waiting out the timeout."""
        if self.backend == "nccl":
            self._group.abort()
        del self._group

    def _broadcast(self, buffer: torch.Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self._group.broadcast([buffer], options).wait()
        if buffer.is_cuda:
            torch.cuda.current_stream().synchronize()


def device_identity(device: torch.device) -> dict:
    """What `resolve_transport` needs of a process's device: its type and, on CUDA, the GPU's UUID."""
    if device.type != "cuda":
        return {"type": device.type, "uuid": None}
    return {"type": "cuda", "uuid": str(torch.cuda.get_device_properties(device).uuid)}


def share(buffer: torch.Tensor) -> tuple:
    """A CUDA tensor as a handle that another process on the same GPU opens with `open_shared` (CUDA IPC);
    the tensor must stay alive until that process copied it."""
    from torch.multiprocessing.reductions import reduce_tensor

    torch.cuda.current_stream(buffer.device).synchronize()  # its bytes are written before anyone reads them
    return reduce_tensor(buffer)


def open_shared(handle: tuple) -> torch.Tensor:
    """The tensor behind `share`'s handle, mapped into this process (no copy)."""
    rebuild, args = handle
    return rebuild(*args)


def resolve_transport(wanted: str, learner: dict, engines: list[dict]) -> tuple[str, str | None]:
    """`rollout.weight_transport` for these devices (`device_identity`s): ("broadcast", backend), ("cuda_ipc",
    None) or ("object_store", None). `auto`: CUDA IPC when every engine shares the learner's GPU, an NCCL
    broadcast when each has a GPU of its own, else the object store. An explicit `broadcast` uses gloo unless
    all of them are on CUDA, and is refused where NCCL cannot run (a GPU shared by two of them); an explicit
    `cuda_ipc` is refused unless every engine is on the learner's GPU."""
    on_cuda = learner["type"] == "cuda" and all(engine["type"] == "cuda" for engine in engines)
    uuids = [learner["uuid"], *(engine["uuid"] for engine in engines)]
    shared = on_cuda and len(set(uuids)) < len(uuids)
    colocated = on_cuda and set(uuids) == {learner["uuid"]}
    if wanted == "object_store":
        return "object_store", None
    if wanted == "cuda_ipc" or (wanted == "auto" and colocated):
        if not colocated:
            raise ValueError(
                "rollout.weight_transport=cuda_ipc: every engine must be on the learner's GPU (fractional "
                "learner.gpus_per_rank and rollout.gpus_per_worker); use broadcast or object_store otherwise"
            )
        return "cuda_ipc", None
    if wanted == "auto" and (not on_cuda or shared):
        return "object_store", None
    if shared:
        raise ValueError(
            "rollout.weight_transport=broadcast: the learner and an engine (or two engines) share a GPU, where NCCL "
            "cannot broadcast between them; give each its own GPU, or use cuda_ipc (every engine on the learner's GPU)"
        )
    return "broadcast", "nccl" if on_cuda else "gloo"
