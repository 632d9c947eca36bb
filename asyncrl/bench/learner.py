"""Benchmark: the learner alone, with 1 and 2 data-parallel ranks (replicated and FSDP), and its weight push
against its limit.

Each side is the real `LearnerActor` (learner/actor.py) with `learner.num_ranks` set (and, above one rank,
`learner.sharding` replicate and fsdp: sides "2" and "2-fsdp"), on the run's
policy (`policy.path`, or the tiny policy), fed the same synthetic GRPO batches: `learner.batch_groups`
groups of `learner.group_size` rollouts of `bench.prompt_tokens` + `bench.reply_tokens` random tokens,
rewards spread within every group so every row is computed. After a warm-up step, `bench.steps`
steps are timed; the sides alternate `bench.repeats` times and the medians are reported.

- `samples_per_s` per rank count and `dp_speedup` (2 ranks over 1): on CPU each rank has
  `learner.torch_threads` threads, so 2 ranks use twice the cores of 1.
- `peak_rss_mb` per rank: what each learner process held at most (ru_maxrss); `held_mb` per rank: its
  weights and optimizer state (FSDP's shards: about half of them each with 2 ranks).
- the push: `LearnerActor.state` (the CPU copy of every weight, put in Ray's object store) timed until
  the driver holds it, against its limit, the state's bytes over this machine's measured memory copy
  bandwidth (a tensor of the same size cloned, best of five): `push_over_copy_limit` is how many
  copies' worth of time the push costs (a copy, a serialization, a fetch: about 3 is the floor). A small
  policy's push is bound by the actor call's latency (milliseconds), not by its bytes.

    asyncrl bench learner --json bench-learner.json
    asyncrl bench learner policy.path=runs/quickstart/sft/checkpoint bench.steps=10
"""

from __future__ import annotations

import json
import math
import random
import statistics
import time
from pathlib import Path
from typing import Literal

from pydantic import Field

from asyncrl.configs.schema import RunConfig, Section
from asyncrl.records import UNSAMPLED_VERSION, Batch, Sample

from .asyncloop import _with

PRESET = "quickstart"
OVERRIDES = ("name=bench-learner", "policy.mtp.enabled=false", "learner.num_cpus=1", "learner.torch_threads=1")


class LearnerBenchOptions(Section):
    """Settings of `asyncrl bench learner` itself (`bench.KEY=VALUE` on the command line)."""

    ranks: list[int] = Field([1, 2], min_length=1)
    """learner.num_ranks of each side, in this order."""
    sharding: list[Literal["replicate", "fsdp"]] = Field(["replicate", "fsdp"], min_length=1)
    """learner.sharding of each side with more than one rank (side "N" replicated, "N-fsdp" sharded)."""
    steps: int = Field(6, ge=1, le=10000)
    """Timed optimizer steps per side and repeat (after one warm-up step)."""
    repeats: int = Field(2, ge=1, le=100)
    """Times the sides alternate; medians are reported."""
    prompt_tokens: int = Field(32, ge=1)
    reply_tokens: int = Field(96, ge=1)


def synthetic_batch(config: RunConfig, options: LearnerBenchOptions, vocab: int, seed: int) -> Batch:
    """`batch_groups` GRPO groups with distinct rewards in each, of random tokens below `vocab`."""
    rng = random.Random(seed)
    prompt_n, reply_n, size = options.prompt_tokens, options.reply_tokens, config.learner.group_size
    groups: list[list[Sample]] = []
    for group in range(config.learner.batch_groups):
        prompt = [rng.randrange(vocab) for _ in range(prompt_n)]
        groups.append([])
        for member in range(size):
            reply = [rng.randrange(vocab) for _ in range(reply_n)]
            groups[-1].append(Sample(
                token_ids=prompt + reply, loss_mask=[0] * prompt_n + [1] * reply_n,
                logprobs=[0.0] * prompt_n + [-3.0] * reply_n, versions=[UNSAMPLED_VERSION] * prompt_n + [0] * reply_n,
                reward=float(member), group_id=f"g{seed}-{group}", rollout_id=f"r{seed}-{group}-{member}", status="ok", task="bench",
            ))  # fmt: skip
    return Batch(groups)


COPY_PROBE_BYTES = 256 << 20
"""The copy bandwidth is measured on at least this much, well past the CPU's caches: main memory's."""


def copy_bandwidth(nbytes: int) -> float:
    """Bytes per second of cloning one tensor of max(`nbytes`, COPY_PROBE_BYTES) here (best of five)."""
    import torch

    data = torch.ones(max(nbytes, COPY_PROBE_BYTES) // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        data.clone()
        best = min(best, time.perf_counter() - start)
    return data.numel() * 4 / best


def side_names(options: LearnerBenchOptions) -> dict[str, tuple[int, str]]:
    """Side name -> (learner.num_ranks, learner.sharding), in the order they run."""
    sides = {}
    for ranks in options.ranks:
        for sharding in options.sharding if ranks > 1 else ["replicate"]:
            sides[str(ranks) if sharding == "replicate" else f"{ranks}-{sharding}"] = (ranks, sharding)
    return sides


def _side(config: RunConfig, ranks: int, sharding: str, batches: list[Batch], options: LearnerBenchOptions) -> dict:
    import ray

    from asyncrl.learner.actor import create_learner

    learner = create_learner(_with(config, f"learner.num_ranks={ranks}", f"learner.sharding={sharding}"))
    try:
        ray.get(learner.train_step.remote(batches[0], 0))  # warm-up: process start, first allocations
        start = time.perf_counter()
        for step in range(options.steps):
            ray.get(learner.train_step.remote(batches[1 + step % (len(batches) - 1)], step + 1))
        wall = time.perf_counter() - start
        usage = ray.get(learner.usage.remote())
        start = time.perf_counter()
        state = ray.get(learner.state.remote())
        push_s = time.perf_counter() - start
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
    finally:
        ray.kill(learner)
    samples = options.steps * len(batches[0].samples)
    return {
        "samples_per_s": samples / wall,
        "peak_rss_mb": [b / 2**20 for b in usage["peak_rss_bytes"]],
        "held_mb": [b / 2**20 for b in usage["held_bytes"]],
        "push_s": push_s,
        "push_bytes": nbytes,
    }


def run(config: RunConfig, json_path: str | None = None, options: LearnerBenchOptions | None = None) -> dict:
    import ray

    from asyncrl.policy.checkpoint import build_policy
    from asyncrl.rollout.worker import RAY_SYSTEM_CONFIG

    options = options or LearnerBenchOptions()
    vocab = build_policy(config.policy.model_copy(update={"mtp": config.policy.mtp.model_copy(update={"enabled": False})}), 0)[0]
    vocab_size = min(vocab.config.vocab_size, 1 << 20)
    batches = [synthetic_batch(config, options, vocab_size, seed) for seed in range(4)]
    started = not ray.is_initialized()
    if started:
        cpus = math.ceil(max(options.ranks) * config.learner.num_cpus)
        ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=False, _system_config=RAY_SYSTEM_CONFIG)
    names = side_names(options)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    try:
        for _ in range(options.repeats):
            for name, (ranks, sharding) in names.items():
                runs[name].append(_side(config, ranks, sharding, batches, options))
                print(f"[bench learner] {name}: {runs[name][-1]['samples_per_s']:.1f} samples/s", flush=True)
    finally:
        if started:
            ray.shutdown()
    sides = {
        name: {
            "samples_per_s": statistics.median(r["samples_per_s"] for r in results),
            "peak_rss_mb": [max(r["peak_rss_mb"][i] for r in results) for i in range(names[name][0])],
            "held_mb": results[0]["held_mb"],
            "push_s": statistics.median(r["push_s"] for r in results),
            "repeats": [r["samples_per_s"] for r in results],
        }
        for name, results in runs.items()
    }
    nbytes = next(iter(runs.values()))[0]["push_bytes"]
    bandwidth = copy_bandwidth(nbytes)
    push_s = statistics.median(r["push_s"] for r in next(iter(runs.values())))  # the first side's: no gather
    results = {
        "benchmark": "learner",
        "samples_per_step": len(batches[0].samples),
        "tokens_per_sample": options.prompt_tokens + options.reply_tokens,
        "torch_threads_per_rank": config.learner.torch_threads,
        "sides": sides,
        "dp_speedup": sides["2"]["samples_per_s"] / sides["1"]["samples_per_s"] if {"1", "2"} <= sides.keys() else None,
        "fsdp_speedup": sides["2-fsdp"]["samples_per_s"] / sides["1"]["samples_per_s"] if {"1", "2-fsdp"} <= sides.keys() else None,
        "push": {
            "seconds": push_s,
            "bytes": nbytes,
            "copy_bandwidth_gb_s": bandwidth / 1e9,
            "push_over_copy_limit": push_s / (nbytes / bandwidth),
        },
    }
    if json_path:
        Path(json_path).write_text(json.dumps(results, indent=2) + "\n")
    return results
