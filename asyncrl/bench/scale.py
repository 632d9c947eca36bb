"""Benchmark: how the driver carries many rollouts at once, and how a weight push grows with the engines.

Two parts, each side by side in one run:

- sessions: `asyncrl bench agentic`'s episodes (the built-in agentic environment through the in-process
  TITO gateway over StubEngines, a SQLite store; its module docstring says what is stubbed and why) at
  each count of `bench.sessions`, all started at once, through each count of `bench.replicas` gateway
  replicas (the driver's own, and the others in processes of their own, each over stub engines of its
  own; the rollouts opened on each in turn, as `asyncrl run` spreads them). Per count: the most rollouts
  open at once, the episodes that failed or were lost (0 is the target), episodes per second, the
  driver's CPU per episode (`time.process_time` over the episodes / episodes: the gateway, store and
  episode runner's cost per rollout, which should stay flat as the count grows) and the other replicas'.
- push: real RolloutWorker Ray actors (the embedded engine on a tiny qwen3 policy whose size
  `bench.push_hidden_size` and `bench.push_layers` set) take one pushed state dict, put in the object
  store first. `parallel_s[n]`: `RayWorkers.push`, the push `asyncrl run` makes, to n engines
  at once; `serial_s[n]`: the same pushes one engine after another. Then from a LearnerActor holding a
  policy of the same shape, each timed from the learner's weights to every engine serving them:
  `learner_object_store_s[n]` (`LearnerActor.state`'s host copy into the object store, then loaded) and
  `learner_broadcast_s[n]` (`rollout.weight_transport=broadcast`: a gloo group, `sched/weight_push.py`).
  Median of `bench.push_repeats`.
  `parallel_over_serial` at the most engines is the saving; `parallel_over_one` what n engines cost
  against one (1.0 would be free; n would be no better than serial).

    asyncrl bench scale --json bench-scale.json
    asyncrl bench scale bench.sessions=[1000] bench.push_engines=[1,2] --json out.json
"""

from __future__ import annotations

import asyncio
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

from pydantic import Field

from asyncrl.configs.schema import RunConfig, Section
from asyncrl.envs.latency import LatencyConfig

PRESET = "agentic"


class ScaleBenchOptions(Section):
    """Settings of `asyncrl bench scale` itself (`bench.KEY=VALUE` on the command line)."""

    sessions: list[int] = Field([1000, 2000, 5000], min_length=1)
    """Episode counts, each started at once (a rollout open at the gateway per episode)."""
    replicas: list[int] = Field([1, 2], min_length=1)
    """Gateway replica counts each session count runs through (the driver's gateway, and the others in
    processes of their own: asyncrl/bench/stub_replica.py)."""
    engine_latency_s: float = Field(0.1, ge=0.0, le=60.0)
    """Time each model call takes at the stub engines."""
    latency: LatencyConfig = LatencyConfig()
    """The simulated latency of each tool call (envs/latency.py)."""
    push_engines: list[int] = Field([1, 2, 4], min_length=1)
    """Engine counts a push goes to."""
    push_repeats: int = Field(3, ge=1, le=100)
    """Timed pushes per count and mode (after one untimed)."""
    push_hidden_size: int = Field(512, ge=16, le=8192)
    """Hidden size of the pushed policy (with push_layers, its size)."""
    push_layers: int = Field(8, ge=1, le=64)
    """Layers of the pushed policy."""


def run(config: RunConfig, json_path: str | None = None, options: ScaleBenchOptions | None = None) -> dict:
    options = options or ScaleBenchOptions()
    sessions = {str(r): {str(n): _sessions(config, options, n, r) for n in options.sessions} for r in options.replicas}
    results = {"sessions": sessions, "push": _pushes(options)}
    results["setup"] = {
        "sessions": "bench agentic's episodes (StubEngines, SQLite store, in-process gateway and replica processes), all started "
        "at once; keyed by gateway replicas, then sessions",
        "engine_latency_s": options.engine_latency_s, "tool_latency": options.latency.model_dump(),
        "push": "RolloutWorker Ray actors (embedded engine, 0.5 CPU each, 1 torch thread) loading one ObjectRef; or from a LearnerActor",
        "machine": platform.machine(), "python": platform.python_version(),
    }  # fmt: skip
    if json_path:
        Path(json_path).write_text(json.dumps(results, indent=2) + "\n")
    return results


def _sessions(config: RunConfig, options: ScaleBenchOptions, count: int, replicas: int) -> dict:
    from asyncrl.gateway.app import run_loop

    from .agentic import AgenticBenchOptions, episodes_at_once

    agentic = AgenticBenchOptions(episodes=count, engine_latency_s=options.engine_latency_s, latency=options.latency)
    print(f"[bench scale] {count} sessions at once through {replicas} gateway replica(s)", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
        cpu = time.process_time()
        measured = run_loop(episodes_at_once(config, agentic, str(Path(tmp) / "trajectories.db"), replicas=replicas))
        cpu = time.process_time() - cpu
    return {
        "in_flight_max": measured["episodes_in_flight_max"], "failed": measured["runner_failures"],
        "lost": measured["lost_episodes"], "statuses": measured["episode_statuses"],
        "episodes_per_s": measured["episodes_per_s"], "driver_cpu_ms_per_episode": round(1000 * cpu / count, 3),
        "other_replicas_cpu_ms_per_episode": round(1000 * measured["other_replicas_cpu_s"] / count, 3),
        "opened_per_replica": measured["opened_per_replica"],
        "episode_p50_s": measured["episode_p50_s"], "episode_p99_s": measured["episode_p99_s"], "wall_s": measured["wall_s"],
    }  # fmt: skip


def _pushes(options: ScaleBenchOptions) -> dict:
    import ray

    from asyncrl.configs.schema import EmbeddedRolloutConfig, LearnerConfig, MTPConfig, PolicyConfig, TinyModelConfig
    from asyncrl.gateway.app import run_loop
    from asyncrl.learner.actor import create_learner
    from asyncrl.policy.tiny import build_tiny_model
    from asyncrl.rollout.worker import RAY_SYSTEM_CONFIG, WorkerLauncher

    most = max(options.push_engines)
    shape = TinyModelConfig(
        arch="qwen3", hidden_size=options.push_hidden_size, num_layers=options.push_layers, num_heads=4,
        intermediate_size=3 * options.push_hidden_size,
    )  # fmt: skip
    model = build_tiny_model(shape, seed=0)
    weights = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    megabytes = sum(t.numel() * t.element_size() for t in weights.values()) / 2**20
    rollout = EmbeddedRolloutConfig(num_workers=most, cpus_per_worker=0.5, torch_threads=1, max_num_seqs=4)
    print(f"[bench scale] pushes of {megabytes:.0f} MB to {options.push_engines} engines", flush=True)
    started = not ray.is_initialized()
    if started:  # a CPU for the learner beside the engines
        ray.init(address="local", num_cpus=max(2, most) + 1, include_dashboard=False, log_to_driver=False, _system_config=RAY_SYSTEM_CONFIG)
    try:
        launcher = WorkerLauncher(model, rollout)
        policy = PolicyConfig(tiny=shape, mtp=MTPConfig(enabled=False))
        learner = create_learner(RunConfig(policy=policy, learner=LearnerConfig(num_cpus=0.5)))
        timings = run_loop(_timed_pushes(launcher, learner, weights, options))
    finally:
        if started:
            ray.shutdown()
    counts = options.push_engines
    parallel, serial, store, broadcast = (timings[mode] for mode in ("parallel", "serial", "learner_object_store", "learner_broadcast"))
    one = parallel.get(1)
    return {
        "weights_mb": round(megabytes, 1), "parallel_s": parallel, "serial_s": serial,
        "parallel_over_serial": {n: round(parallel[n] / serial[n], 3) for n in counts if serial[n]},
        "parallel_over_one": {n: round(parallel[n] / one, 3) for n in counts} if one else None,
        "learner_object_store_s": store, "learner_broadcast_s": broadcast,
        "broadcast_over_object_store": {n: round(broadcast[n] / store[n], 3) for n in counts if store[n]},
    }  # fmt: skip


async def _timed_pushes(launcher, learner, weights: dict, options: ScaleBenchOptions) -> dict[str, dict[int, float]]:
    """Median seconds of a push to n engines, by mode and n (every mode pushes to the same engines in turn)."""
    import ray

    from asyncrl.sched.weight_push import DirectPush
    from asyncrl.sched.workers import RayWorkers

    version = 0
    modes = ("parallel", "serial", "learner_object_store", "learner_broadcast")
    medians: dict[str, dict[int, float]] = {mode: {} for mode in modes}
    for count in options.push_engines:
        workers = RayWorkers(launcher, f"bench-scale-{count}", count)
        try:
            await workers.ready()
            timings: dict[str, list[float]] = {mode: [] for mode in modes}
            for repeat in range(options.push_repeats + 1):
                for mode in modes:
                    version += 1
                    ref = ray.put(weights)  # the learner's ObjectRef in a run: in the store before the push starts
                    began = time.perf_counter()
                    if mode == "parallel":
                        await workers.push(ref, version)
                    elif mode == "serial":
                        for actor in workers.actors:
                            loaded = await asyncio.wrap_future(actor.load_weights.remote(ref, version).future())
                            if loaded != version:
                                raise RuntimeError(f"pushed version {version}, an engine serves {loaded}")
                    elif mode == "learner_object_store":
                        await workers.push(learner.state.remote(), version)
                    else:
                        await workers.push(DirectPush(learner, "broadcast", "gloo"), version)
                    if repeat:  # the first of each is untimed: the actors' first load allocates, the group forms
                        timings[mode].append(time.perf_counter() - began)
            for mode in modes:
                medians[mode][count] = round(statistics.median(timings[mode]), 4)
        finally:
            for actor in workers.actors:
                ray.kill(actor)
    return medians
