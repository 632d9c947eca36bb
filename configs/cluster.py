"""The cluster section: which Ray the run's actors live in and where on it they are placed (docs/CLUSTER.md)."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

from .section import Section

ADDRESS = re.compile(r"^(local|auto|ray://[^\s/]+:\d+|[^\s/:]+:\d+)$")
RAY_RESOURCES = frozenset({"CPU", "GPU", "memory", "object_store_memory"})


class ClusterConfig(Section):
    """A private Ray on this machine (`local`), or a Ray cluster someone operates: engines spread over its
    nodes, the learner and teachers on nodes picked by custom resources."""

    address: str = "local"
    """`local`: a private Ray on this machine, started and stopped by the run; `auto`: the cluster this machine
    joined with `ray start` (or the one RAY_ADDRESS names); `host:port` or `ray://host:port`: that cluster.
    Anything but local needs store.type redis and runs_dir on storage every node mounts at the same path."""
    engine_placement: Literal["spread", "pack"] = "spread"
    """Rollout engines as one placement group, a bundle per engine: spread puts them on as many nodes as have
    room (a lost node costs the fewest engines), pack on as few as possible. A replacement takes its dead
    engine's bundle, which Ray moves to a node with room when the old one is gone."""
    engine_resources: dict[str, float] = {}
    """Custom Ray resources each engine asks for besides its CPUs and GPUs: {rollout: 1} places engines only on
    nodes started with `ray start --resources '{"rollout": N}'` (N engines each)."""
    learner_resources: dict[str, float] = {}
    """Custom Ray resources each learner rank asks for (as engine_resources), e.g. {trainer: 1}."""
    teacher_resources: dict[str, float] = {}
    """Custom Ray resources each distillation teacher's scoring actor asks for (as engine_resources)."""
    engine_labels: dict[str, str] = {}
    """Node labels each engine needs (Ray label selectors: {role: rollout} places engines only on nodes started
    with `ray start --labels role=rollout`; Ray's operators such as `!value` and `in(a,b)` work too)."""
    learner_labels: dict[str, str] = {}
    """Node labels each learner rank needs (as engine_labels)."""
    teacher_labels: dict[str, str] = {}
    """Node labels each distillation teacher's scoring actor needs (as engine_labels)."""
    gateway_labels: dict[str, str] = {}
    """Node labels each gateway replica actor needs (gateway.replicas > 1; as engine_labels); none: spread over the nodes."""
    placement_timeout_s: float = Field(300.0, gt=0)
    """How long the engines' placement group may wait for nodes with room before the run is refused, naming
    what it asked for and what the cluster has."""

    @field_validator("address")
    @classmethod
    def _check_address(cls, address: str) -> str:
        if not ADDRESS.match(address):
            raise ValueError(f"{address!r} is not local, auto, host:port or ray://host:port")
        return address

    @field_validator("engine_resources", "learner_resources", "teacher_resources")
    @classmethod
    def _check_resources(cls, resources: dict[str, float]) -> dict[str, float]:
        built_in = sorted(RAY_RESOURCES & set(resources))
        if built_in:
            raise ValueError(f"{', '.join(built_in)} are set by rollout.cpus_per_worker, learner.num_cpus and the GPU keys, not here")
        negative = sorted(name for name, amount in resources.items() if amount <= 0)
        if negative:
            raise ValueError(f"amounts must be positive ({', '.join(negative)})")
        return resources

    @property
    def is_local(self) -> bool:
        return self.address == "local"
