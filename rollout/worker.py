"""Rollout workers: one engine per Ray actor, on a fraction of a CPU or one GPU.

`rollout.type` picks the engine: the embedded torch engine, or vLLM (`rollout/vllm_engine.py`,
imported only when chosen, since vLLM lives in its own environment).

Methods are async so one actor serves many concurrent `generate` calls, which the engine batches;
`stream` is a Ray streaming generator (call it with `.options(num_returns="streaming")`): a TokenDelta
per engine step, then the result; cancelling the task (`ray.cancel` on its generator) aborts the request.
`score` is prefill-only scoring with the engine's current weights (the vLLM engine refuses it).
Weights arrive as a state dict (`load_weights`); pass an `ObjectRef` from `ray.put` so N workers
share one copy in the object store. A push the learner sends itself arrives through `receive_weights`
(a broadcast) or `copy_shared_bucket` and `swap_in_shared` (CUDA IPC). `WorkerLauncher` starts
workers of one configuration, again whenever one died (the scheduler's replacement,
`sched/supervision.py`), and `watch` lets the driver hear of a death at once.

Start Ray with `RAY_SYSTEM_CONFIG`: Ray's core worker calls `nice(worker_niceness)` in every process
it starts for tasks and actors (default 15: src/ray/common/ray_config_def.h, applied in
core_worker.cc), which on a busy machine starved the engines until the gateway dropped them for
missed heartbeats. 0 leaves actors at the driver's own niceness.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING

import ray
import torch
from pydantic import TypeAdapter
from ray.actor import ActorClass
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from asyncrl.configs import ConfigError
from asyncrl.configs.schema import ClusterConfig, RolloutConfig
from asyncrl.records import GenerationResult, RequestError, SamplingParams, ScoreResult, TokenDelta
from asyncrl.weight_transfer import Layout, WeightGroup, device_identity, open_shared, unpack

from .engine import EmbeddedEngine

if TYPE_CHECKING:
    from .vllm_engine import VLLMEngine

RAY_SYSTEM_CONFIG = {"worker_niceness": 0}
"""`ray.init(_system_config=...)` for any Ray that runs asyncrl's actors: actors at the driver's niceness."""


class RolloutWorker:
    def __init__(self, model, config: RolloutConfig | dict, engine_id: str, version: int = 0, mtp=None) -> None:
        """`model`: a transformers causal LM (or an ObjectRef to one) or a model directory; `mtp`: its
        MTP layer (or state dict), for `rollout.mtp_drafting` when `model` is not a checkpoint directory."""
        config = TypeAdapter(RolloutConfig).validate_python(config)
        self.engine: EmbeddedEngine | VLLMEngine
        if config.type == "vllm":
            from .vllm_engine import VLLMEngine

            self.engine = VLLMEngine.from_pretrained(model, config, engine_id=engine_id, version=version, mtp=mtp)
        else:
            self.engine = EmbeddedEngine.from_pretrained(model, config, engine_id=engine_id, version=version, mtp=mtp)
        self._outboxes: dict[str, _Outbox] = {}
        self._weight_group: WeightGroup | None = None
        self._incoming: dict[int, torch.Tensor] = {}  # a cuda_ipc push's buckets, until swapped in

    async def generate(
        self, prompt_token_ids: list[int], sampling: SamplingParams | dict | None = None, session_id: str | None = None
    ) -> GenerationResult:
        return await self.engine.generate(prompt_token_ids, sampling, session_id=session_id)

    async def submit(self, caller: str, requests: list[tuple[int, list[int], dict, str | None]]) -> None:
        """Start `(key, prompt_token_ids, sampling, session_id)` generate requests, many in one Ray call;
        each one's outcome waits in `caller`'s outbox for `collect`. A driver with hundreds of rollouts in
        flight spent a tenth of its CPU on one Ray call per request (`gateway.engines.RayEngine`)."""
        outbox = self._outboxes.setdefault(caller, _Outbox())
        for key, prompt_token_ids, sampling, session_id in requests:
            task = asyncio.ensure_future(self.generate(prompt_token_ids, sampling, session_id))
            task.add_done_callback(functools.partial(outbox.put, key))

    async def collect(self, caller: str) -> list[Outcome]:
        """The outcomes of `caller`'s submitted requests that finished since its last collect (`Outcome`),
        waiting for one when none has."""
        return await self._outboxes.setdefault(caller, _Outbox()).take()

    async def stream(
        self, prompt_token_ids: list[int], sampling: SamplingParams | dict | None = None, session_id: str | None = None
    ) -> AsyncGenerator[TokenDelta | GenerationResult, None]:
        # A cancelled task leaves this generator with CancelledError, and closing the engine's stream aborts the request.
        items = self.engine.stream(prompt_token_ids, sampling, session_id=session_id)
        try:
            async for item in items:
                yield item
        finally:
            await items.aclose()

    async def score(self, sequences: list[list[int]], temperature: float = 1.0) -> ScoreResult:
        return await self.engine.score(sequences, temperature)

    async def load_weights(self, state_dict: dict, version: int) -> int:
        """Serve `state_dict` (pass an ObjectRef from `ray.put`, so N workers share one copy in the object
        store) as `version` once this returns; the version the engine serves."""
        # Waiting for the swap blocks; a thread keeps this actor's event loop serving generate calls.
        await asyncio.to_thread(self.engine.update_weights, state_dict, version)
        return self.engine.version

    async def device_identity(self) -> dict:
        """The engine's device (`asyncrl/weight_transfer.py`): what decides how pushes reach it."""
        return device_identity(torch.device(self.engine.health()["device"]))

    async def receive_weights(
        self, address: tuple[str, int], generation: int, rank: int, world: int, backend: str, layout: Layout, version: int
    ) -> int:
        """Take part in the learner's broadcast of `version` (`sched/weight_push.py`), joining group
        `generation` first if this engine is not in it yet; the engine serves the weights once it returns."""

        def receive() -> dict:
            group = self._weight_group
            if group is None or group.generation != generation:
                self._weight_group = None  # the old group's resources go before the new one's
                group = self._weight_group = WeightGroup(tuple(address), rank, world, backend, generation)  # type: ignore[arg-type]
            try:
                return group.receive(layout)
            except BaseException:
                group.close()
                self._weight_group = None
                raise

        # Receiving and swapping block; threads keep this actor's event loop serving generate calls.
        weights = await asyncio.to_thread(receive)
        await asyncio.to_thread(self.engine.update_weights, weights, version)
        return self.engine.version

    async def copy_shared_bucket(self, layout: Layout, bucket: int, handle: tuple) -> None:
        """Copy bucket `bucket` of a push out of the learner's buffer on this GPU (`cuda_ipc`); the engine
        serves it with the others at `swap_in_shared`."""

        def copy() -> torch.Tensor:
            copied = open_shared(handle).clone()
            torch.cuda.current_stream(copied.device).synchronize()  # done before the learner frees its buffer
            return copied

        if bucket == 0:
            self._incoming = {}
        self._incoming[bucket] = await asyncio.to_thread(copy)

    async def swap_in_shared(self, layout: Layout, version: int) -> int:
        """Serve the buckets `copy_shared_bucket` took as `version` (all of them at once)."""
        incoming, self._incoming = self._incoming, {}
        if sorted(incoming) != list(range(len(layout.bucket_sizes))):
            raise RuntimeError(f"push of version {version}: buckets {sorted(incoming)} of {len(layout.bucket_sizes)} arrived")
        weights = {name: tensor for bucket, buffer in incoming.items() for name, tensor in unpack(layout, bucket, buffer).items()}
        await asyncio.to_thread(self.engine.update_weights, weights, version)
        return self.engine.version

    async def health(self) -> dict:
        """The engine's health, and the Ray node this worker runs on (`node_id`)."""
        return {**self.engine.health(), "node_id": ray.get_runtime_context().get_node_id()}

    async def version(self) -> int:
        return self.engine.version

    async def watch(self) -> None:
        """Never returns: a caller awaiting it hears that this actor died as soon as Ray knows
        (the call fails with ActorDiedError), with no polling."""
        await asyncio.Event().wait()


Outcome = tuple[int, GenerationResult | None, str | None, str | None]
"""What `collect` hands back for one request: `(key, result, refusal, failure)`, exactly one of the last
three set: the result; the engine's refusal (a RequestError: the client's 400); or its failure of this
request (the gateway may retry the prompt elsewhere)."""


class _Outbox:
    """Finished requests of one caller, until it collects them."""

    def __init__(self) -> None:
        self.outcomes: list[Outcome] = []
        self.ready = asyncio.Event()

    def put(self, key: int, task: asyncio.Future) -> None:
        error = None if task.cancelled() else task.exception()
        if task.cancelled():
            self.outcomes.append((key, None, None, "the request was cancelled on the engine"))
        elif isinstance(error, RequestError):
            self.outcomes.append((key, None, str(error), None))
        elif error is not None:
            self.outcomes.append((key, None, None, f"{type(error).__name__}: {error}"))
        else:
            self.outcomes.append((key, task.result(), None, None))
        self.ready.set()

    async def take(self) -> list[Outcome]:
        await self.ready.wait()
        self.ready.clear()
        outcomes, self.outcomes = self.outcomes, []
        return outcomes


class WorkerLauncher:
    """Starts RolloutWorker actors of one configuration (call after `ray.init()`), as many times as
    asked: a replacement for a worker that died is started the same way as the first ones.

    CPU engines ask for `cpus_per_worker` (fractions allowed); GPU engines for `gpus_per_worker`,
    or one whole GPU each when it is 0 and the engine will run on CUDA. With `placement` (the cluster
    section) the engines are one placement group, a bundle each with the section's custom resources,
    spread over nodes or packed; engine slot i lives in bundle i, and so does its replacement, which Ray
    places on another node with room when bundle i's node is gone.
    """

    def __init__(self, model, config: RolloutConfig, mtp=None, placement: ClusterConfig | None = None) -> None:
        gpus = config.gpus_per_worker
        if gpus == 0 and (config.device == "cuda" or (config.device == "auto" and ray.cluster_resources().get("GPU", 0) > 0)):
            gpus = 1
        # Kept in the object store for the whole run: a replacement builds its engine from it (and
        # then loads the current weights), so it never needs the driver's copy.
        self.model = model if isinstance(model, (str, ray.ObjectRef)) else ray.put(model)
        custom = placement.engine_resources if placement else {}
        self.options = dict(num_cpus=config.cpus_per_worker, num_gpus=gpus, resources=custom)
        self.config = config.model_dump()
        self.mtp = None if mtp is None else mtp if isinstance(mtp, dict) else mtp.state_dict()
        self.group = None
        if placement is not None:
            bundle = {"CPU": config.cpus_per_worker, **({"GPU": gpus} if gpus else {}), **custom}
            self.group = _placed([bundle] * config.num_workers, placement)

    def start(self, engine_id: str, slot: int = 0):
        """One RolloutWorker actor whose engine is `engine_id`, in engine slot `slot` (its bundle when the
        engines have a placement group); its handle, returned before it is up."""
        options = dict(self.options)
        if self.group is not None:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=slot)
        return RolloutWorkerActor.options(**options).remote(self.model, self.config, engine_id, mtp=self.mtp)

    def start_aside(self, engine_id: str):
        """One RolloutWorker of this configuration outside the engines' placement group, reserving no CPU
        (an evaluation engine works now and then, beside parts that hold every core), with no MTP drafting;
        its handle, returned before it is up."""
        options = {**self.options, "num_cpus": 0}
        config = {**self.config, "mtp_drafting": False} if "mtp_drafting" in self.config else self.config
        return RolloutWorkerActor.options(**options).remote(self.model, config, engine_id)

    def close(self) -> None:
        """Give the placement group's resources back (the workers must be gone, or going)."""
        if self.group is not None:
            ray.util.remove_placement_group(self.group)
            self.group = None


def _placed(bundles: list[dict[str, float]], placement: ClusterConfig):
    """The engines' placement group, once Ray has placed every bundle; refused (ConfigError) when it could not
    within `placement.placement_timeout_s`, naming what it asked for and what the cluster has free."""
    labels = [dict(placement.engine_labels) for _ in bundles] if placement.engine_labels else None
    group = ray.util.placement_group(bundles, strategy=placement.engine_placement.upper(), bundle_label_selector=labels)
    try:
        ray.get(group.ready(), timeout=placement.placement_timeout_s)
    except ray.exceptions.GetTimeoutError:
        ray.util.remove_placement_group(group)
        free = {name: round(amount, 3) for name, amount in sorted(ray.available_resources().items()) if not name.startswith("node:")}
        raise ConfigError(
            f"cluster: Ray could not place {len(bundles)} engine(s) of {bundles[0]} each ({placement.engine_placement}"
            f"{f', on nodes labelled {placement.engine_labels}' if placement.engine_labels else ''}) within "
            f"cluster.placement_timeout_s={placement.placement_timeout_s:g}; the cluster has free: {free}"
        ) from None
    return group


def create_workers(model, config: RolloutConfig, *, name_prefix: str = "rollout", mtp=None) -> list:
    """Start `config.num_workers` RolloutWorker actors named `<name_prefix>-<i>` (see `WorkerLauncher`)."""
    launcher = WorkerLauncher(model, config, mtp)
    return [launcher.start(f"{name_prefix}-{i}", i) for i in range(config.num_workers)]


RolloutWorkerActor: ActorClass[RolloutWorker] = ray.remote(RolloutWorker)
"""RolloutWorker as a Ray actor class (made by a call rather than a decorator, so that type
checkers see the actor class and its `.options`, not the plain class)."""


class ScoringWorker:
    """A checkpoint that only scores: prefill-only log-probs (`rollout/scoring.py`) in its own actor,
    with no generation cache (a distillation teacher). Calls run one at a time: each is one batched
    forward already."""

    def __init__(self, checkpoint: str, torch_threads: int, max_batch_tokens: int, max_len: int | None = None) -> None:
        import torch

        from .scoring import NativeScorer

        torch.set_num_threads(torch_threads)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        self.scorer = NativeScorer(checkpoint, max_batch_tokens=max_batch_tokens, max_len=max_len, device=device)

    def score(self, sequences: list[list[int]], temperature: float) -> list[list[float]]:
        return self.scorer.score(sequences, temperature)


ScoringWorkerActor: ActorClass[ScoringWorker] = ray.remote(ScoringWorker)
"""ScoringWorker as a Ray actor class (as `RolloutWorkerActor`)."""


class RayScorer:
    """A `ScoringWorker` actor as an awaitable scorer (`distill.teachers.TeacherScorer`)."""

    def __init__(self, actor) -> None:
        self.actor = actor

    async def score(self, sequences: list[list[int]], temperature: float) -> list[list[float]]:
        return await asyncio.wrap_future(self.actor.score.remote(sequences, temperature).future())
