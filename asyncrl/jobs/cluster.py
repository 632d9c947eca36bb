"""The Ray a run's actors live in: a private one on this machine, or a cluster (`cluster.address`), and
the checks that refuse a cluster the run cannot work on before any actor starts (docs/CLUSTER.md).

A run on a cluster keeps its driver (the loop, the gateway, the store client) on the machine that runs
`asyncrl run`; engines, learner ranks and teachers go wherever their resource requests fit. The learner
writes checkpoints into the run directory and the driver reads them back, so the run directory must be
one directory that every node mounts at the same path: `check_shared_run_dir` proves it from the
learner's node before the first step, rather than finding out at the first resume.
"""

from __future__ import annotations

import math
import os
import socket
import uuid
from collections import defaultdict
from pathlib import Path

import ray

from asyncrl.configs import ConfigError
from asyncrl.configs.schema import RunConfig

SHARED_CHECK = ".cluster-check"
"""The file in the run directory the driver writes and the learner's node reads back."""


def start_ray(config: RunConfig, *, learner: bool = True) -> bool:
    """Connect to the run's Ray and refuse one without the CPUs, GPUs or custom resources its actors ask
    for (`learner` False: the engines alone, as `asyncrl serve` starts); True when this call started (or
    connected) Ray and so owns the session, False when a caller (a test, a notebook) already had one.

    `local`: a private Ray sized so every actor fits (logical CPUs; real cores are bounded by torch
    threads), its actors at this process's niceness. Anything else: `ray.init(address=...)`; the
    cluster's own nodes decide niceness (`ray start --system-config`, docs/CLUSTER.md)."""
    from asyncrl.rollout.worker import RAY_SYSTEM_CONFIG

    needed = resources_needed(config, learner=learner)
    started = not ray.is_initialized()
    if started and config.cluster.is_local:
        # address="local": a new Ray even where `ray start` runs one on this machine, which a bare
        # ray.init() would join (and then refuse num_cpus).
        ray.init(
            address="local", num_cpus=max(os.cpu_count() or 1, math.ceil(needed["CPU"])), include_dashboard=False,
            log_to_driver=False, _system_config=RAY_SYSTEM_CONFIG,
        )  # fmt: skip
    elif started:
        _check_reachable(config.cluster.address)
        try:
            ray.init(address=config.cluster.address, log_to_driver=False)
        except ConnectionError as error:
            raise ConfigError(f"cluster.address {config.cluster.address!r}: no Ray cluster answered ({error})") from None
    problems = shortfalls(needed, ray.cluster_resources()) + unlabelled(
        config, [n.get("Labels", {}) for n in ray.nodes() if n.get("Alive")], learner=learner
    )
    if problems:
        if started:
            ray.shutdown()
        raise ConfigError("; ".join(problems))
    return started


def _check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Refuse a host:port nothing listens on: Ray itself retries an unreachable address for minutes."""
    if address == "auto":
        return  # Ray reads the address of the cluster this machine joined, and says at once when there is none
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as error:
        raise ConfigError(
            f"cluster.address {address!r}: nothing answers there ({error}); is the Ray head running (`ray status`)?"
        ) from None


def resources_needed(config: RunConfig, *, learner: bool = True) -> dict[str, float]:
    """The Ray resources of every actor the run starts, summed: CPU, GPU and each custom resource
    (`learner` False: the engines' alone)."""
    rollout, training, distill, cluster = config.rollout, config.learner, config.distill, config.cluster
    needed: defaultdict[str, float] = defaultdict(float)
    teachers = sum(1 for spec in distill.teachers.values() if spec.checkpoint)
    actors = [(rollout.num_workers, rollout.cpus_per_worker, _gpus(rollout.gpus_per_worker, rollout.device), cluster.engine_resources)]
    if learner:
        actors += [
            (training.num_ranks, training.num_cpus, _gpus(training.gpus_per_rank, training.device), cluster.learner_resources),
            (teachers, distill.cpus_per_teacher, distill.gpus_per_teacher, cluster.teacher_resources),
        ]
    for count, cpus, gpus, custom in actors:
        needed["CPU"] += count * cpus
        needed["GPU"] += count * gpus
        for name, amount in custom.items():
            needed[name] += count * amount
    return dict(needed)


def shortfalls(needed: dict[str, float], cluster: dict[str, float]) -> list[str]:
    """What the cluster lacks of `needed`, one sentence per resource, naming the keys that ask for it."""
    asked_by = {
        "CPU": "rollout.num_workers x rollout.cpus_per_worker + learner.num_ranks x learner.num_cpus (+ teachers)",
        "GPU": "rollout.num_workers x rollout.gpus_per_worker + learner.num_ranks x learner.gpus_per_rank, "
        "a whole GPU each where a device is cuda (+ teachers)",
    }
    problems = []
    for name, amount in needed.items():
        if amount > 0 and cluster.get(name, 0) < amount:
            source = asked_by.get(name, "cluster.engine_resources / learner_resources / teacher_resources")
            what = {"CPU": "CPUs", "GPU": "GPUs"}.get(name, f"of custom resource {name!r}")
            problems.append(f"the run's actors need {amount:g} {what} ({source}), the Ray cluster has {cluster.get(name, 0):g}")
    return problems


def unlabelled(config: RunConfig, nodes: list[dict[str, str]], *, learner: bool = True) -> list[str]:
    """The label selectors of the cluster section that no node (`nodes`: each node's labels) matches, one
    sentence each (`learner` False: the engines' alone). Only plain `key: value` selectors are checked;
    Ray's operators (`!v`, `in(a,b)`) are left to Ray, which then waits for a matching node (the engines'
    placement times out with a message)."""
    problems = []
    teachers = any(spec.checkpoint for spec in config.distill.teachers.values())
    keys = ["engine_labels"] + (["learner_labels"] if learner else []) + (["teacher_labels"] if learner and teachers else [])
    keys += ["gateway_labels"] if learner and config.gateway.replicas > 1 else []
    for key in keys:
        wanted = getattr(config.cluster, key)
        plain = wanted and not any(any(c in value for c in "!()") for value in wanted.values())
        if plain and not any(all(labels.get(k) == v for k, v in wanted.items()) for labels in nodes):
            problems.append(f"cluster.{key}: no node of the Ray cluster has the labels {wanted}")
    return problems


def _gpus(explicit: float, device: str) -> float:
    return explicit or (1.0 if device == "cuda" else 0.0)


def write_shared_check(run_dir: Path) -> tuple[str, str]:
    """Write a fresh token into the run directory for `check_shared_run_dir`; returns the file and the token."""
    token, path = uuid.uuid4().hex, run_dir / SHARED_CHECK
    path.write_text(token)
    return str(path), token


def check_shared_run_dir(run_dir: Path, unseen: list[str]) -> None:
    """Refuse the run when a node that writes checkpoints did not read the token of `write_shared_check`
    back from the run directory; `unseen` names those nodes (`LearnerActor.reads`)."""
    if unseen:
        raise ConfigError(
            f"runs_dir: the run directory {run_dir} is not the same directory on {', '.join(unseen)}: the learner writes "
            "checkpoints there and this driver reads them back, so a cluster run needs runs_dir on storage every node "
            "mounts at the same path (NFS, a cluster filesystem)"
        )
