"""The RL learner as a Ray actor, so it runs beside the rollout workers on its own CPUs (or device).

The scheduler drives it with a handful of verbs; weights leave it as an ObjectRef:

    metrics = ray.get(learner.train_step.remote(samples))
    if metrics["push_due"]:
        push_weights(workers, learner.state.remote(), metrics["version"])

`state.remote()` returns the state dict's ObjectRef, which `push_weights` hands to every worker as
it is: the weights are serialized once, by the learner, and never pass through the driver. The
scheduler's loop makes these calls through its learner client (`sched/clients.py` RayLearner).
"""

from __future__ import annotations

import time

import ray
import torch
from ray.actor import ActorClass

from asyncrl.configs.schema import RunConfig
from asyncrl.records import Sample

from .rl import RLLearner


class LearnerActor:
    def __init__(self, config: RunConfig | dict, resume_from: str | None = None) -> None:
        """Builds the policy of `config.policy`; `resume_from` is a directory written by `save`."""
        config = RunConfig.model_validate(config)
        # Its own thread budget: the rollout workers and the gateway share the same cores.
        torch.set_num_threads(config.learner.torch_threads)
        self.learner = RLLearner.from_config(config)
        if resume_from is not None:
            self.learner.load(resume_from)

    def train_step(self, samples: list[Sample], current_version: int | None = None) -> dict:
        return self.learner.train_step(samples, current_version)

    def version(self) -> int:
        return self.learner.version

    def usage(self) -> dict:
        """This process's CPU time so far (`asyncrl run`'s summary reports each process's share)."""
        return {"process_cpu_s": time.process_time()}

    def state(self) -> dict[str, torch.Tensor]:
        return self.learner.state_dict_for_push()

    def save(self, directory: str) -> str:
        return str(self.learner.save(directory))

    def load(self, directory: str) -> int:
        self.learner.load(directory)
        return self.learner.version


LearnerActorClass: ActorClass[LearnerActor] = ray.remote(LearnerActor)
"""LearnerActor as a Ray actor class (made by a call rather than a decorator, so that type checkers
see the actor class and its `.options`, not the plain class)."""


def create_learner(config: RunConfig, resume_from: str | None = None):
    """Start the LearnerActor on `config.learner.num_cpus` CPUs (call after `ray.init()`)."""
    return LearnerActorClass.options(num_cpus=config.learner.num_cpus).remote(config.model_dump(), resume_from)
