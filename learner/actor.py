"""The RL learner as a Ray actor, so it runs beside the rollout workers on its own CPUs (or device).

The scheduler drives it with a handful of verbs; weights leave it as an ObjectRef:

    result = ray.get(learner.train_step.remote(batch))  # a StepResult
    weights = learner.state.remote()  # when the step made a push due (`asyncrl.records.due_after_step`)
    ray.get([worker.load_weights.remote(weights, result.version) for worker in workers])

`state.remote()` returns the state dict's ObjectRef, which every worker is handed as it is: the weights
are serialized once, by the learner, and never pass through the driver. The scheduler's loop makes
these calls through its learner client (`sched/learners.py` RayLearner).

With `learner.num_ranks` > 1 the actor the scheduler holds is rank 0 of a data-parallel learner
(learner/distributed.py): it starts the other ranks as actors of its own, so they live and die with
it, forms the process group with them, and forwards each step's samples to them. The scheduler sees
one learner either way; a rank that fails takes rank 0 down with it (`_peer_failed`), and the loop
restarts the whole group from the last checkpoint as it restarts a single learner. A sharded learner
(`learner.sharding` fsdp, learner/sharding.py) has the whole weights only when every rank joins in
gathering them, so rank 0 fans out the gather before the first push of a version, and the save.
"""

from __future__ import annotations

import logging
import os
import resource
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn, TypeVar

import ray
import torch
from ray.actor import ActorClass

from asyncrl.configs.schema import RunConfig
from asyncrl.records import Batch, StepResult
from asyncrl.weight_transfer import Layout, WeightGroup, device_identity, host_store, pack, share

from .consistency import LogprobGapWarning
from .distributed import free_address, join_group
from .rl import RLLearner, learner_device

log = logging.getLogger(__name__)
T = TypeVar("T")


class LearnerActor:
    def __init__(
        self, config: RunConfig | dict, resume_from: str | None = None, rank: int = 0, address: tuple[str, int] | None = None
    ) -> None:
        """Builds the policy of `config.policy`; `resume_from` is a directory written by `save`. `rank` and
        `address` (rank 0's rendezvous) are given by rank 0 to the ranks it starts."""
        config = RunConfig.model_validate(config)
        # Its own thread budget: the rollout workers and the gateway share the same cores.
        torch.set_num_threads(config.learner.torch_threads)
        world = config.learner.num_ranks
        self.rank = rank
        self.peers: list = []
        self._next_group: tuple = (None, None, 0, -1)
        self._weight_group: WeightGroup | None = None
        self._shared: torch.Tensor | None = None
        if world > 1:
            if rank == 0:
                address = free_address()
                options = rank_options(config)
                self.peers = [
                    LearnerPeerClass.options(**options).remote(config.model_dump(), resume_from, r, address) for r in range(1, world)
                ]
            assert address is not None
            join_group(address, rank, world, learner_device(config))
        self.learner = RLLearner.from_config(config)
        if world > 1 and rank == 0:
            held = "FSDP2 shards of the weights, gradients and optimizer state" if self.learner.fsdp else "the whole policy each"
            log.info("data-parallel learner: %d ranks holding %s (learner.sharding %s)", world, held, config.learner.sharding)
        if resume_from is not None:
            self.learner.load(resume_from)

    def train_step(self, batch: Batch, current_version: int | None = None) -> StepResult:
        if self.rank > 0:
            with warnings.catch_warnings():  # rank 0 warns for the step
                warnings.simplefilter("ignore", LogprobGapWarning)
                return self.learner.train_step(batch, current_version)
        if not self.peers:
            return self.learner.train_step(batch, current_version)
        shared = ray.put(batch)  # serialized once for all the other ranks
        pending = [peer.train_step.remote(shared, current_version) for peer in self.peers]
        try:
            result = self.learner.train_step(batch, current_version)
        except RuntimeError as error:  # a collective failed (a rank left mid-step): the group is broken
            self._peer_failed(error)
        except Exception:
            # Bad input fails every rank the same way, before any collective (the step is deterministic):
            # the caller gets rank 0's error, as from a single learner, once the others are done.
            ray.wait(pending, num_returns=len(pending))
            raise
        try:
            ray.get(pending)
        except ray.exceptions.RayActorError as error:  # a rank's process died
            self._peer_failed(error)
        return result

    def version(self) -> int:
        return self.learner.version

    def usage(self) -> dict:
        """CPU time so far of this process and the other ranks' (`asyncrl run`'s summary reports each part's
        share), and each rank's peak resident memory in bytes, weights and optimizer state held in bytes
        (FSDP's shards) and Ray node, rank 0 first."""
        others = ray.get([peer.usage.remote() for peer in self.peers]) if self.peers else []
        # ru_maxrss is in KiB on Linux.
        peaks = [resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, *(p for u in others for p in u["peak_rss_bytes"])]
        held = [self.learner.held_bytes(), *(b for u in others for b in u["held_bytes"])]
        nodes = [ray.get_runtime_context().get_node_id(), *(n for u in others for n in u["node_ids"])]
        cpu = time.process_time() + sum(u["process_cpu_s"] for u in others)
        return {"process_cpu_s": cpu, "peak_rss_bytes": peaks, "held_bytes": held, "node_ids": nodes}

    def state(self) -> dict[str, torch.Tensor]:
        self._gather()
        return self.learner.state_dict_for_push()

    def versioned_state(self) -> tuple[dict[str, torch.Tensor], int]:
        """`state` and the version it is (call with `num_returns=2`: the weights stay an ObjectRef)."""
        self._gather()
        return self.learner.state_dict_for_push(), self.learner.version

    def gather_weights(self) -> None:
        """A sharded learner's rank's part in gathering the whole weights onto rank 0 (`_gather`)."""
        self.learner.gather_weights()

    def _gather(self) -> None:
        """With FSDP (learner/sharding.py) the whole weights exist only once every rank has joined in
        gathering them: once per version, before the first push of it."""
        if self.learner.needs_gather():
            pending = [peer.gather_weights.remote() for peer in self.peers]
            self._collective(self.learner.gather_weights, pending)

    # --- the direct pushes (`asyncrl/weight_transfer.py`, `sched/weight_push.py`) ------------------------

    def device_identity(self) -> dict:
        return device_identity(self.learner.device)

    def weight_layout(self) -> Layout:
        self._gather()
        return Layout.plan(self.learner.push_tensors().items())

    def share_bucket(self, layout: Layout, bucket: int) -> tuple:
        """Bucket `bucket` of the weights packed on this GPU, as a CUDA IPC handle for engines on it
        (`sched/weight_push.py`); kept until `release_shared`."""
        self._gather()
        self._shared = pack(layout, bucket, self.learner.push_tensors(), self.learner.device)
        return share(self._shared)

    def release_shared(self) -> None:
        self._shared = None

    def open_weight_group(self, world: int, generation: int) -> tuple[str, int]:
        """Serve the rendezvous of the next weight group; its address, for the engines."""
        store, address = host_store(world)
        self._next_group = store, address, world, generation
        self._weight_group = None  # the old group's engines are gone or joining the new one
        return address

    def send_weights(self, generation: int, backend: str, layout: Layout) -> int:
        """Broadcast the weights in `layout` (the one the engines receive into) to the engines of group
        `generation` (they call `receive_weights` meanwhile); the version sent."""
        if self._weight_group is None or self._weight_group.generation != generation:
            store, address, world, opened = self._next_group
            if opened != generation:
                raise RuntimeError(f"weight group {generation} was never opened (the last opened is {opened})")
            self._weight_group = WeightGroup(address, 0, world, backend, generation, store=store)
        self._gather()
        try:
            self._weight_group.send(layout, self.learner.push_tensors())
        except BaseException:
            # A rank died mid-broadcast: closing the group fails the others' receives now, not at its timeout.
            self._weight_group.close()
            self._weight_group = None
            raise
        return self.learner.version

    def save(self, directory: str) -> str:
        if not self.learner.fsdp:
            return str(self.learner.save(directory))  # every rank holds the same state: rank 0 writes it
        pending = [peer.save.remote(directory) for peer in self.peers]  # the state is gathered from every rank's shard
        return str(self._collective(lambda: self.learner.save(directory), pending))

    def reads(self, path: str, token: str) -> list[str]:
        """The ranks, with their nodes, on which the file `path` does not hold `token`: a run directory that is
        not the driver's (`asyncrl/jobs/cluster.py`)."""
        try:
            seen = Path(path).read_text() == token
        except OSError:
            seen = False
        unseen = [] if seen else [f"learner rank {self.rank} (node {ray.util.get_node_ip_address()})"]
        return unseen + [node for nodes in ray.get([peer.reads.remote(path, token) for peer in self.peers]) for node in nodes]

    def load(self, directory: str) -> int:
        pending = [peer.load.remote(directory) for peer in self.peers]
        if self.learner.fsdp:  # each rank takes its shards of the whole state
            self._collective(lambda: self.learner.load(directory), pending)
        else:
            self.learner.load(directory)
            ray.get(pending)
        return self.learner.version

    def _collective(self, call: Callable[[], T], pending: list) -> T:
        """Rank 0's part of a call every rank makes (`pending`: the others'), failing as `train_step` does."""
        try:
            result = call()
        except RuntimeError as error:  # a collective failed: a rank left mid-call
            self._peer_failed(error)
        try:
            ray.get(pending)
        except ray.exceptions.RayActorError as error:
            self._peer_failed(error)
        return result

    def _peer_failed(self, error: BaseException) -> NoReturn:
        log.error(
            "data-parallel learner: a step failed across the ranks (%s: %s); exiting so the group restarts", type(error).__name__, error
        )
        os._exit(1)  # the other ranks are this actor's own: they go with it


class LearnerPeer(LearnerActor):
    """A rank above 0 of a data-parallel learner, started by rank 0 (its own class so that its processes
    are told apart: `ray::LearnerPeer` in ps and the Ray dashboard)."""


LearnerActorClass: ActorClass[LearnerActor] = ray.remote(LearnerActor)
"""LearnerActor as a Ray actor class (made by a call rather than a decorator, so that type checkers
see the actor class and its `.options`, not the plain class)."""
LearnerPeerClass: ActorClass[LearnerPeer] = ray.remote(LearnerPeer)


def gpus_per_rank(config: RunConfig) -> float:
    """Ray GPUs of each learner rank: `learner.gpus_per_rank`, else one whole GPU when the learner will run on
    CUDA (learner.device cuda, or auto on a cluster with GPUs), else none. Whole GPUs are never shared with an
    engine's, so rollout and learner only share a device when fractions ask for it."""
    learner = config.learner
    if learner.gpus_per_rank > 0:
        return learner.gpus_per_rank
    on_gpu = learner.device == "cuda" or (learner.device == "auto" and ray.cluster_resources().get("GPU", 0) > 0)
    return 1.0 if on_gpu else 0.0


def create_learner(config: RunConfig, resume_from: str | None = None):
    """Start the LearnerActor on `config.learner.num_cpus` CPUs and `gpus_per_rank` GPUs (call after
    `ray.init()`); with `learner.num_ranks` > 1 it is rank 0 and starts the others."""
    return LearnerActorClass.options(**rank_options(config)).remote(config.model_dump(), resume_from)


def rank_options(config: RunConfig) -> dict:
    """Ray options of each learner rank: its CPUs, GPUs, custom resources and node labels (`cluster.learner_*`)."""
    options = dict(num_cpus=config.learner.num_cpus, num_gpus=gpus_per_rank(config), resources=config.cluster.learner_resources)
    if config.cluster.learner_labels:
        options["label_selector"] = dict(config.cluster.learner_labels)
    return options
