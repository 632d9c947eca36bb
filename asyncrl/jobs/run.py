"""`asyncrl run`: start everything, run the loop, shut everything down, write the summary.

Start-up, in order:

1. SFT warm start when `loop.sft_first` asks for one (by default when `policy.path` is unset); RL starts from its
   checkpoint (a resumed run starts from its own last checkpoint instead).
2. Ray, local or the cluster of `cluster.address` (`asyncrl/jobs/cluster.py`, docs/CLUSTER.md):
   `rollout.num_workers` RolloutWorkers on `rollout.cpus_per_worker` CPUs each (one placement group)
   and the LearnerActor on `learner.num_cpus` CPUs, each with its own torch thread budget, so rollout and
   learner never share a core budget; the loop reaches them through `RayWorkers` (sched/workers.py),
   supervised by a `RaySupervisor` (sched/supervision.py), and `RayLearner` (sched/learners.py). The
   engines start from the learner's weights (one push).
3. The trajectory store in the run directory (or Redis), and the TITO gateway in this process, on
   127.0.0.1, over the Ray engine handles. Episodes run as asyncio tasks on the same event loop and
   call the gateway through the OpenAI client like any agent, handing each request to its app
   without a socket (`loop.episode_transport`, gateway/inprocess_transport.py).

A config with `distill.teachers` is a cross-stage distillation run (`asyncrl distill`, distill/):
the task mix is the teachers' stages at their ratios and a scoring actor per teacher scores every
batch before the learner sees it; everything else is the same run.

Then `Loop.run` until `loop.steps` optimizer steps (or `loop.wall_budget_s`), and `Loop.close`, which
leaves the ledger balanced. A crash or Ctrl-C skips `close`: `asyncrl run --resume` picks up.

Ray starts its actors at niceness 15 unless told otherwise (`rollout/worker.py` RAY_SYSTEM_CONFIG):
a run's actors run at the driver's niceness. A rollout worker or the learner that dies is replaced
while the run goes on (`sched/supervision.py`, `sched/recovery.py`); `summary.json` lists every such
recovery (`recoveries`), for a resumed run how long the resume took (`resumed`), and each process's
CPU and each engine's busy time over the RL phase (`usage`, asyncrl/jobs/usage.py).
"""

from __future__ import annotations

import time
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import ray

from asyncrl.configs.schema import RunConfig
from asyncrl.distill.teachers import Teachers, check_checkpoints
from asyncrl.envs.base import Environment
from asyncrl.gateway.app import run_loop, settle_heap
from asyncrl.gateway.replica_actors import start_gateways
from asyncrl.gateway.serving import episode_http_client
from asyncrl.policy.validate import resolve_policy
from asyncrl.records import TERMINAL_STATUSES
from asyncrl.sched.display import Display
from asyncrl.sched.evaluation import OwnEngineEvaluation
from asyncrl.sched.learners import RayLearner
from asyncrl.sched.loop import Loop
from asyncrl.sched.parts import Parts
from asyncrl.sched.ray_calls import remote
from asyncrl.sched.rundir import LoopState, RunDir
from asyncrl.sched.supervision import RaySupervisor
from asyncrl.sched.tasks import TaskMix, distill_task_mix
from asyncrl.sched.weight_push import direct_transport
from asyncrl.sched.workers import RayEvaluationEngine, RayWorkers

from . import usage
from .cluster import check_shared_run_dir, start_ray, write_shared_check

if TYPE_CHECKING:
    from collections.abc import Callable

    from transformers import PreTrainedTokenizerBase

    from asyncrl.gateway.replica_actors import Gateways
    from asyncrl.gateway.store import TrajectoryStore
    from asyncrl.runlog import MetricsLog


class RunExists(RuntimeError):
    """A fresh run would mix its trajectories or checkpoints with an earlier run's."""


def run(
    config: RunConfig | None,
    *,
    resume: str | Path | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    env: Environment | None = None,
) -> dict:
    """Run (or, with `resume`, continue) the RL job; returns the summary also written to summary.json.

    `env` replaces the configured task mix (`tasks.mix`) with that one environment (any `Environment`).
    """
    began = time.monotonic()
    sft = None
    if resume is not None:
        rundir = RunDir(resume)
        config = rundir.read_config(overrides)
    elif config is None:
        raise TypeError("run() needs a config, or resume= a run directory")
    else:
        mtp_used = config.learner.mtp_loss_weight > 0 or config.rollout.mtp_drafting
        config = config.model_copy(update={"policy": resolve_policy(config.policy, mtp_used=mtp_used)})
        rundir = RunDir.for_config(config)
        if rundir.has_run():
            raise RunExists(f"{rundir.path} already holds a run: continue it with `asyncrl run --resume {rundir.path}`, "
                            "or pick another name= (or delete the directory)")  # fmt: skip
        if config.sft_warm_start:
            from .sft import give_back_memory, run_sft

            result = run_sft(config)
            give_back_memory()
            sft = {"accuracy": result.accuracy, "steps": result.steps, "wall_s": result.wall_s, "checkpoint": str(result.checkpoint)}
            # The run starts from the warm start's checkpoint; its config says so and asks for no other.
            policy, loop = (
                config.policy.model_copy(update={"path": str(result.checkpoint)}),
                config.loop.model_copy(update={"sft_first": False}),
            )
            config = config.model_copy(update={"policy": policy, "loop": loop})
        rundir.write_config(config)
    summary = run_loop(_main(config, rundir, resume is not None, env))  # uvloop where installed
    summary.update(sft=sft, wall_s=time.monotonic() - began)
    rundir.write_summary(summary)
    return summary


async def _main(config: RunConfig, rundir: RunDir, resumed: bool, env: Environment | None) -> dict:
    began = time.monotonic()
    latest = rundir.latest_checkpoint() if resumed else None
    checkpoint, state = latest if latest else (None, LoopState())
    distilling = bool(config.distill.teachers)
    if distilling and env is not None:
        raise ValueError("a distillation run takes its tasks from distill.teachers; it cannot train on env=")
    # First: a bad environment reference fails before anything starts.
    tasks = distill_task_mix(config) if distilling else TaskMix.from_config(config, env)
    await tasks.check_sandboxes()
    ray_actors = _RayActors(start_ray(config))
    display = Display(config.logging.progress)
    resumption = None
    async with AsyncExitStack() as stack:
        stack.callback(ray_actors.stop)
        stack.callback(display.close)
        started = await _start_parts(stack, config, rundir, resumed, checkpoint, state, tasks, ray_actors, display)
        if resumed:
            resumption = await _resume(config, rundir, started, state, checkpoint, began, display)
        if state.eval_before is None:
            await started.loop.evaluate_first()
        rl = await _run_rl(started, rundir)
    return _summary(config, rundir, tasks, state, started, rl, resumption)


@dataclass
class _RayActors:
    """The run's Ray actors, killed last when the run ends. Each part's actors join as it starts; the workers'
    and the learner's are read only at the end, since supervision replaces one that dies."""

    started_ray: bool
    teachers: list = field(default_factory=list)
    evaluation: list = field(default_factory=list)
    workers: RayWorkers | None = None
    learner: RayLearner | None = None

    def stop(self) -> None:
        workers, learner = self.workers, self.learner
        actors = [*self.teachers, *self.evaluation, *(workers.actors if workers else []), *([learner.actor] if learner else [])]
        _stop_ray(actors, workers, self.started_ray)


@dataclass
class _Started:
    """The run's parts once started, each one's teardown already on the run's exit stack."""

    store: TrajectoryStore
    workers: RayWorkers
    learner: RayLearner
    gateways: Gateways
    metrics: MetricsLog
    loop: Loop
    weight_transport: str


@dataclass
class _RLPhase:
    """What the summary needs of the RL phase, read before the parts are torn down."""

    stop_reason: str | None
    usage: dict
    eval_after: float | None
    engine_versions: list[int]
    counts: dict[str, int]
    records: list[dict]


async def _start_parts(
    stack: AsyncExitStack, config: RunConfig, rundir: RunDir, resumed: bool, checkpoint: Path | None, state: LoopState,
    tasks: TaskMix, ray_actors: _RayActors, display: Display,
) -> _Started:  # fmt: skip
    """Start the run's parts in order, up to the engines serving the learner's weights, each one's teardown
    pushed onto `stack` as it starts (and each Ray actor into `ray_actors`)."""
    store = rundir.open_store(config)
    stack.callback(store.close)
    if not resumed and any(store.counts()[status] for status in ("running", *TERMINAL_STATUSES)):
        raise RunExists(f"the trajectory store {store!r} already holds rollouts; use another store.namespace")
    workers, tokenizer = _start_workers(config)
    ray_actors.workers = workers
    supervisor = RaySupervisor(workers)
    stack.push_async_callback(supervisor.close)  # before the actors are killed: those deaths are not replaced
    learner = _start_learner(config, checkpoint)
    ray_actors.learner = learner
    if not config.cluster.is_local:
        path, token = write_shared_check(rundir.path)
        check_shared_run_dir(rundir.path, await learner.reads(path, token))
    teachers = None
    if config.distill.teachers:
        handles = _start_teachers(config)
        ray_actors.teachers += [handle.actor for handle in handles.values()]
        teachers = Teachers.from_config(config, handles)
    await workers.ready()
    weight_transport = await _weight_transport(config, learner, workers, display)
    store_at = rundir.store_address(config), rundir.store_namespace(config)
    gateways = await start_gateways(stack, config, store, workers.engines, tokenizer, store_at=store_at)
    if gateways.replicas is not None:
        display.say(f"gateway replicas: {gateways.own.url} (this process), {', '.join(gateways.replicas.urls.values())}")
    metrics = rundir.metrics(config, resume=resumed)
    stack.callback(metrics.close)
    gateways.watch(_on_replica_lost(display, metrics, state))
    http = await stack.enter_async_context(episode_http_client(config, gateways.own))
    evaluation = await _start_evaluation(stack, config, tasks, workers, tokenizer, ray_actors, display)
    parts = Parts(
        store=store, gateway=gateways.episodes, http=http, tasks=tasks, learner=learner, workers=workers,
        supervision=supervisor, tokenizer=tokenizer, rundir=rundir, metrics=metrics, display=display, teachers=teachers,
        reclaim_store=lambda: rundir.open_store(config, visibility_timeout_s=1e-6), evaluation=evaluation,
    )  # fmt: skip
    loop = Loop(config, parts, state)
    stack.push_async_callback(loop.episodes.stop)  # on a crash, before the gateway goes
    await loop.push()  # the engines serve exactly the learner's weights, at its version
    supervisor.attach(gateways.routing)
    return _Started(store, workers, learner, gateways, metrics, loop, weight_transport)


async def _start_evaluation(
    stack: AsyncExitStack, config: RunConfig, tasks: TaskMix, workers: RayWorkers, tokenizer, ray_actors: _RayActors, display: Display
) -> OwnEngineEvaluation | None:
    """`eval.engine: own`: the evaluation engine, built, behind its own gateway; says where evaluations play."""
    every = f"held-out evaluation every {config.loop.eval_every} versions"
    if config.loop.eval_every_s is not None:
        every += f" or {config.loop.eval_every_s:g} s"
    if config.eval.engine == "shared":
        display.say(f"{every}: between pushes on the serving engines, training waits meanwhile (eval.engine=shared)")
        return None
    engine = RayEvaluationEngine(workers.launcher, f"{config.name}-eval")
    ray_actors.evaluation.append(engine.actor)
    await remote(engine.actor.version)  # built (its first call waits for its constructor)
    display.say(f"{every}: on an engine of its own, beside training (eval.engine=own)")
    return await stack.enter_async_context(OwnEngineEvaluation(config, tasks, engine, tokenizer))


async def _weight_transport(config: RunConfig, learner: RayLearner, workers: RayWorkers, display: Display) -> str:
    """How the learner's pushes reach the engines, for the summary: a direct transport where one is set up, else the object store."""
    learner.direct = await direct_transport(config.rollout.weight_transport, learner.actor, workers.actors)
    if learner.direct is None:
        return "object_store"
    transport, backend = learner.direct
    display.say(f"weight pushes: {transport} from the learner to the engines" + (f" over {backend}" if backend else ""))
    return transport


def _on_replica_lost(display: Display, metrics: MetricsLog, state: LoopState) -> Callable[[str, str], None]:
    """What the run does when a gateway replica leaves the rotation: says so and records it at the current version."""

    def replica_lost(replica: str, why: str) -> None:
        display.say(f"gateway replica {replica} is gone ({why}); its rollouts end through this process's gateway")
        metrics.record({"event": "gateway_replica_lost", "step": state.version, "replica": replica, "reason": why})

    return replica_lost


async def _resume(
    config: RunConfig, rundir: RunDir, started: _Started, state: LoopState, checkpoint: Path | None, began: float, display: Display
) -> dict:
    """Claim again what the interrupted run left running; returns the summary's `resumed`, also recorded in the metrics."""
    reclaim = rundir.open_store(config, visibility_timeout_s=1e-6)
    recovered = await started.loop.recover(reclaim)
    reclaim.close()
    resumption = {"version": state.version, "checkpoint": str(checkpoint), "recovered": recovered,
                  "serving_at": time.time(), "restart_s": time.monotonic() - began}  # fmt: skip
    started.metrics.record({"event": "resumed", "step": state.version, **resumption})
    display.say(f"resumed at version {state.version} from {checkpoint}; {recovered} trajectories claimed again")
    return resumption


async def _run_rl(started: _Started, rundir: RunDir) -> _RLPhase:
    """`Loop.run` until it stops, then `Loop.close`, with each process's CPU over the phase."""
    settle_heap()  # the gateway's event loop stalls less on garbage collection (gateway/app.py)
    workers, learner, replicas, loop = started.workers, started.learner, started.gateways.replicas, started.loop
    began_rl = await usage.snapshot(workers, learner, replicas)
    await loop.run()
    stop_reason = loop.stop_reason()
    spent = usage.between(began_rl, await usage.snapshot(workers, learner, replicas))
    eval_after = await loop.close()
    engine_versions = await workers.versions()
    counts = started.store.counts()
    records = started.metrics.read()
    rundir.plot(records)
    return _RLPhase(stop_reason, spent, eval_after, engine_versions, counts, records)


def _summary(
    config: RunConfig, rundir: RunDir, tasks: TaskMix, state: LoopState, started: _Started, rl: _RLPhase, resumption: dict | None
) -> dict:
    """summary.json's run part (`run` adds the SFT warm start and the wall time)."""
    rollouts_started = sum(rl.counts[status] for status in ("running", *TERMINAL_STATUSES))
    ledger = {**state.ledger, "started": rollouts_started}
    return {
        "mode": config.loop.mode, "version": state.version, "stop_reason": rl.stop_reason,
        "eval_before": state.eval_before, "eval_after": rl.eval_after,
        **eval_by_task(rl.records, [task.name for task, _ in tasks.evaluated(config.eval.num_problems)]),
        "rl_wall_s": state.rl_wall_s, "engine_versions": rl.engine_versions, "weight_transport": started.weight_transport,
        "gateway_replicas": started.gateways.summary(),
        "ledger": ledger, "balanced": sum(state.ledger.values()) == rollouts_started,
        "recoveries": started.loop.recoveries, "resumed": resumption, "usage": rl.usage, "run_dir": str(rundir.path),
    }  # fmt: skip


def eval_by_task(records: list[dict], names: list[str]) -> dict:
    """`eval_before_by_task` / `eval_after_by_task`: each evaluated task's held-out accuracy at the
    first and the last evaluation in the metrics (`eval_before` / `eval_after` are their mean). The
    loop records `eval_accuracy/<task>` only beside other tasks; a lone task's is `eval_accuracy`."""
    evals = [r for r in records if r.get("eval_accuracy") is not None]
    if not evals:
        return {"eval_before_by_task": None, "eval_after_by_task": None}

    def by_task(record: dict) -> dict:
        if len(names) == 1:
            return {names[0]: record["eval_accuracy"]}
        return {name: record.get(f"eval_accuracy/{name}") for name in names}

    return {"eval_before_by_task": by_task(evals[0]), "eval_after_by_task": by_task(evals[-1])}


def _stop_ray(actors: list, workers: RayWorkers | None, started_ray: bool) -> None:
    for actor in actors:
        ray.kill(actor)
    if workers is not None:
        workers.launcher.close()  # the engines' placement group, which would hold its resources in a caller's Ray
    if started_ray:
        ray.shutdown()


def _start_workers(config: RunConfig) -> tuple[RayWorkers, PreTrainedTokenizerBase]:
    from asyncrl.policy.checkpoint import build_policy
    from asyncrl.rollout.worker import WorkerLauncher

    # The engines need the policy's MTP layer only to draft with it; the policy's weights are
    # replaced by the first push (and the MTP layer's by every push while RL trains it).
    drafting = config.rollout.mtp_drafting
    policy = config.policy.model_copy(update={"mtp": config.policy.mtp.model_copy(update={"enabled": drafting})})
    model, tokenizer, mtp = build_policy(policy, config.seed)
    launcher = WorkerLauncher(model, config.rollout, mtp if drafting else None, placement=config.cluster)
    return RayWorkers(launcher, f"{config.name}-rollout", config.rollout.num_workers), tokenizer


def _start_learner(config: RunConfig, checkpoint: Path | None) -> RayLearner:
    """The LearnerActor from `checkpoint` (None: the run's starting policy); a restart starts it the same way."""
    from asyncrl.learner.actor import create_learner

    return RayLearner(lambda directory: create_learner(config, resume_from=directory), str(checkpoint) if checkpoint else None)


def _start_teachers(config: RunConfig) -> dict:
    """A ScoringWorker actor per teacher given as a checkpoint (refusing a missing one), behind its
    RayScorer. Teachers given as a url need no actor: `Teachers.from_config` reaches them."""
    from asyncrl.rollout.worker import RayScorer, ScoringWorkerActor

    check_checkpoints(config)
    distill = config.distill
    options = dict(num_cpus=distill.cpus_per_teacher, num_gpus=distill.gpus_per_teacher, resources=config.cluster.teacher_resources)
    if config.cluster.teacher_labels:
        options["label_selector"] = dict(config.cluster.teacher_labels)
    # The student's rollouts are what a teacher scores: no longer than the engines' context.
    scoring = (distill.torch_threads, distill.max_batch_tokens, config.rollout.max_model_len)
    return {
        name: RayScorer(ScoringWorkerActor.options(**options).remote(spec.checkpoint, *scoring))
        for name, spec in distill.teachers.items()
        if spec.checkpoint
    }
