"""Contract tests for an environment, without Ray or a trainer: `check_environment(env)`.

The environment plays a few training episodes against a real TITO gateway (FastAPI over loopback)
in front of a real embedded engine, exactly as in `asyncrl run`, and a few held-out episodes
through the same gateway in evaluation rollouts (greedy, recorded nowhere), as an RL run evaluates.
The policy is a tiny random model unless you pass one (a checkpoint directory, or a model object
such as a scripted policy). What is checked:

- `name` is a usable task name and `sample_task` gives both splits, the same task for the same seed;
- every episode ends with an allowed status (default: ok, whatever the reward), a finite reward
  and metrics the store can keep, after at least one call to the policy through the client;
- each recorded trajectory becomes at least one learner sample with sampled tokens to train on;
- every recorded turn carries the sampling options it was drawn with, and they are the run's
  (`rollout.sampling`: an RL run answers other options 400, `gateway.sampling_overrides`), and the
  learner's log-prob of every sampled token, recomputed at its turn's temperature, is the engine's;
- held-out evaluation runs without crashing episodes.

All problems are collected and raised together as one `ContractError`; on success a
`ContractReport` comes back for further assertions of your own.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import tempfile
from dataclasses import dataclass, field
from typing import Any

from asyncrl.envs.base import Environment, EpisodeResult, needs_sandbox
from asyncrl.envs.evaluation import TaskEval, evaluate_env
from asyncrl.envs.runner import run_recorded_episode

TINY_POLICY = dict(arch="qwen3", hidden_size=32, num_layers=1, num_heads=2, intermediate_size=32, max_position_embeddings=1024)
"""The default policy: random and small enough to start in a second on a laptop."""


class ContractError(AssertionError):
    """The environment breaks the contract; the message lists every problem found."""


@dataclass
class ContractReport:
    results: list[EpisodeResult]
    trajectories: list[Any]
    """The recorded `Trajectory` of each training episode (turns with token IDs, reward, status)."""
    eval: TaskEval | None
    problems: list[str] = field(default_factory=list)


def check_environment(env: Environment, **options: Any) -> ContractReport:
    """Synchronous `acheck_environment` (for tests and scripts without an event loop)."""
    return asyncio.run(acheck_environment(env, **options))


async def acheck_environment(
    env: Environment, *, policy: Any = None, tokenizer: Any = None, sandboxes: Any = None,
    episodes: int = 4, eval_episodes: int = 4, seed: int = 0, timeout_s: float = 60.0,
    allowed_statuses: tuple[str, ...] = ("ok",), max_tokens: int = 32,
) -> ContractReport:  # fmt: skip
    """`policy`: None (tiny random model), a checkpoint directory, or a model the embedded engine runs
    (then `tokenizer` defaults to the embedded one). `sandboxes`: a SandboxBackend; by default the one
    `ProcessSandboxConfig()` opens, for environments that need one."""
    problems = _check_tasks(env, seed)
    if needs_sandbox(env) and sandboxes is None:
        from asyncrl.configs.schema import ProcessSandboxConfig
        from asyncrl.envs.sandbox import open_backend

        sandboxes = open_backend(ProcessSandboxConfig())
    model, tokenizer = _policy(policy, tokenizer)
    rng = random.Random(seed)
    tasks = [env.sample_task(rng, "train") for _ in range(episodes)]
    with tempfile.TemporaryDirectory(prefix="asyncrl-contract-") as directory:
        async with _Gateway(model, tokenizer, directory, max_tokens) as gateway:
            results, trajectories = [], []
            for index, task in enumerate(tasks):
                try:
                    rollout_id, result = await run_recorded_episode(
                        env, task, gateway.client, group_id="contract", timeout_s=timeout_s, sandboxes=sandboxes
                    )
                except Exception as error:  # the runner raises only when recording failed
                    problems.append(f"episode {index}: could not be recorded: {type(error).__name__}: {error}")
                    continue
                results.append(result)
                trajectories.append(gateway.store.get(rollout_id))
                problems += _check_episode(env, index, result, trajectories[-1], allowed_statuses)
                problems += _check_sampling(index, trajectories[-1], gateway.service.sampling, model)
            evaluation = None
            if eval_episodes:
                evaluation = await evaluate_env(
                    env, gateway.client, num_problems=eval_episodes, seed=seed, sandboxes=sandboxes, timeout_s=timeout_s
                )
                crashed = {s: n for s, n in evaluation.statuses.items() if s not in allowed_statuses}
                if crashed:
                    problems.append(f"held-out evaluation: episodes ended {crashed}")
    if problems:
        raise ContractError(f"environment {getattr(env, 'name', env)!r} breaks the contract:\n- " + "\n- ".join(problems))
    return ContractReport(results, trajectories, evaluation)


def _check_tasks(env: Environment, seed: int) -> list[str]:
    problems = []
    name = getattr(env, "name", None)
    if not isinstance(name, str) or not name or not all(c.isalnum() or c in "_.-" for c in name):
        problems.append(f"name must be a non-empty string of letters, digits, '_', '.' or '-', got {name!r}")
    for split in ("train", "eval"):
        try:
            first, again = (env.sample_task(random.Random(seed), split) for _ in range(2))
        except Exception as error:
            problems.append(f"sample_task(rng, {split!r}) raised {type(error).__name__}: {error}")
            continue
        if repr(first) != repr(again):  # a fixed seed must fix the held-out set, or evaluations drift
            problems.append(f"sample_task(rng, {split!r}) differs for the same seed: {first!r} vs {again!r}")
    return problems


def _check_episode(env: Environment, index: int, result: EpisodeResult, trajectory: Any, allowed: tuple[str, ...]) -> list[str]:
    from asyncrl.samples import trajectory_to_samples

    where = f"episode {index}"
    problems = []
    if result.status not in allowed:
        problems.append(f"{where} ended {result.status}: {result.reason}")
        return problems
    if not isinstance(result.reward, (int, float)) or not math.isfinite(result.reward):
        problems.append(f"{where}: reward {result.reward!r} is not a finite number")
    try:
        json.dumps(result.metrics)
    except (TypeError, ValueError) as error:
        problems.append(f"{where}: metrics are not JSON ({error})")
    if trajectory.task != env.name:
        problems.append(f"{where}: recorded under task {trajectory.task!r}, not {env.name!r}")
    if not trajectory.turns:
        problems.append(f"{where}: the policy was never called through the client (nothing to learn from)")
    elif not any(sum(s.loss_mask) for s in trajectory_to_samples(trajectory)):
        problems.append(f"{where}: its trajectory gives no sampled tokens to train on")
    return problems


def _check_sampling(index: int, trajectory: Any, run: Any, model: Any) -> list[str]:
    """The turns' recorded sampling options are the run's, and the learner's recomputed log-probs
    (`learner.rl.sampled_logprobs` at each token's temperature) are the engine's."""
    import torch

    from asyncrl.learner.rl import sampled_logprobs
    from asyncrl.samples import trajectory_to_samples

    expected = (run.temperature, run.top_p, run.top_k)
    problems = []
    for turn in trajectory.turns:
        options = (turn.temperature, turn.top_p, turn.top_k)
        if None in options:
            problems.append(f"episode {index} turn {turn.index}: no sampling options on record (temperature, top_p, top_k)")
        elif options != expected:
            problems.append(
                f"episode {index} turn {turn.index}: sampled with temperature, top_p, top_k = {options}, not the run's "
                f"{expected} (rollout.sampling); an RL run answers such calls 400 (gateway.sampling_overrides=refuse)"
            )
    if problems or trajectory.status in ("running", "aborted"):
        return problems
    # fp32 engines agree with a full forward to ~1e-5; lower precision rounds differently in each.
    tolerance = 1e-3 if next(model.parameters()).dtype == torch.float32 else 5e-2
    for sample in trajectory_to_samples(trajectory):
        ids = torch.tensor([sample.token_ids], device=next(model.parameters()).device)
        temperatures = torch.tensor([sample.scoring_temperatures(run.temperature)[1:]], device=ids.device)
        with torch.no_grad():
            logp = sampled_logprobs(model(input_ids=ids).logits, ids, temperatures)[0].cpu()
        sampled = torch.tensor(sample.loss_mask[1:], dtype=torch.bool)
        gap = float((logp - torch.tensor(sample.logprobs[1:]))[sampled].abs().max()) if sampled.any() else 0.0
        if gap > tolerance:
            problems.append(f"episode {index}: the learner's log-probs differ from the engine's by up to {gap:.2e} (> {tolerance:g})")
    return problems


def _policy(policy: Any, tokenizer: Any) -> tuple[Any, Any]:
    from asyncrl.policy.tokenizer import build_tokenizer

    if policy is None:
        from asyncrl.configs.schema import TinyModelConfig
        from asyncrl.policy.tiny import build_tiny_model

        return build_tiny_model(TinyModelConfig(**TINY_POLICY), seed=0).eval(), tokenizer or build_tokenizer()
    if isinstance(policy, str):
        from asyncrl.policy.checkpoint import load_policy

        model, loaded, _ = load_policy(policy)
        return model, tokenizer or loaded
    return policy, tokenizer or build_tokenizer()


class _Gateway:
    """A real gateway on this event loop (uvicorn over loopback), its store, one embedded engine."""

    def __init__(self, model: Any, tokenizer: Any, directory: str, max_tokens: int) -> None:
        from asyncrl.configs.schema import EmbeddedRolloutConfig, GatewayConfig, SamplingConfig
        from asyncrl.gateway.engines import LocalEngine
        from asyncrl.gateway.pool import EnginePool
        from asyncrl.gateway.service import GatewayService
        from asyncrl.gateway.store import open_store
        from asyncrl.rollout import EmbeddedEngine

        self.engine = EmbeddedEngine(model, EmbeddedRolloutConfig(device="cpu", torch_threads=1, max_num_seqs=16), engine_id="contract")
        config = GatewayConfig(sampling_overrides="allow")  # an override is reported per turn, not refused
        pool = EnginePool(config)
        pool.add_local(LocalEngine(self.engine))
        self.store = open_store(directory)
        self.service = GatewayService(self.store, tokenizer, pool, config, SamplingConfig(max_tokens=max_tokens))

    async def __aenter__(self) -> _Gateway:
        from asyncrl.gateway.app import create_app, gateway_server
        from asyncrl.gateway.client import AsyncGatewayClient

        self.server = gateway_server(create_app(self.service), self.service.config, host="127.0.0.1", port=0)
        self.task = asyncio.create_task(self.server.serve())
        while not self.server.started:
            if self.task.done():
                self.task.result()
                raise RuntimeError("the gateway stopped during start-up")
            await asyncio.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.client = AsyncGatewayClient(f"http://127.0.0.1:{port}", token=self.service.credentials.run_token)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.client.aclose()
        self.server.should_exit = True
        await asyncio.gather(self.task, return_exceptions=True)
        self.service.close()
        self.engine.shutdown()
        self.store.close()
