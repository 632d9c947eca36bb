"""The loop's evaluate verb: each task's held-out greedy accuracy with the weights the engines serve.

`heldout_scores` is the one way the loop evaluates: each evaluated task plays its own held-out
episodes (`envs/evaluation.py`: the environment's own prompts, rewards and sandboxes) through a
gateway, in rollouts opened for evaluation, which the gateway decodes greedily and records nowhere.
Where they play is `eval.engine`:

    shared   the run's own gateway and engines, between pushes: the loop neither trains nor pushes
             until the evaluation ends (the time is reported as "training waited")
    own      `OwnEngineEvaluation`: an engine of its own behind a gateway of its own, loaded with the
             weights of the push that made the evaluation due, plays them in the background while the
             loop trains on; its result is booked when it ends, at the version it evaluated. The
             first (the starting weights) plays there beside the first steps; the final one, when no
             evaluation of the last push is playing or done, on the shared engines (idle by then).

`record_evaluation` books a result in the metrics and on the display.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from asyncrl.configs.schema import RunConfig
from asyncrl.envs.evaluation import TaskEval, evaluate_env

from .parts import Parts, Weights

if TYPE_CHECKING:
    from asyncrl.gateway.engines import EngineHandle
    from asyncrl.lifecycle import RolloutLifecycle

    from .tasks import TaskMix


async def heldout_scores(config: RunConfig, tasks: TaskMix, gateway: RolloutLifecycle, http: Any) -> dict[str, TaskEval]:
    """Each evaluated task's held-out evaluation (task name -> its greedy episodes), at `eval.num_problems`
    problems, played through `gateway` (episodes' OpenAI clients sharing `http`)."""
    scores = {}
    for task, num_problems in tasks.evaluated(config.eval.num_problems):
        scores[task.name] = await evaluate_env(
            task.env, gateway, num_problems=num_problems, seed=config.eval.seed, sandboxes=task.sandboxes,
            timeout_s=config.loop.episode_timeout_s, http_client=http, task_name=task.name,
        )  # fmt: skip
    return scores


def record_evaluation(
    parts: Parts, evals: dict[str, TaskEval], version: int, elapsed_s: float, wall_s: float = 0.0, *, aside: bool = False,
    held_training: bool = True,
) -> float | None:  # fmt: skip
    """Metrics and display for one evaluation; returns its one number, the tasks weighed equally
    whatever their shares (None with no task evaluated). Each task's figure comes with its 95% interval
    (`eval_interval/<task>`) and its episodes that failed (`eval_failed/<task>`: not ok, scored 0).
    `elapsed_s`: the run's time when `version` was evaluated from; `wall_s`: what the evaluation took,
    during which the loop neither trained nor pushed (`held_training`; not so before and after the RL
    phase, when nothing trains) unless it played `aside`, on its own engine (`eval_engine` in the record:
    shared or own)."""
    scores = {name: evaluation.accuracy for name, evaluation in evals.items()}
    intervals = {name: evaluation.accuracy_interval() for name, evaluation in evals.items()}
    accuracy = sum(scores.values()) / len(scores) if scores else None
    per_task = {f"eval_accuracy/{name}": value for name, value in scores.items()} if len(scores) > 1 else {}
    bounds = {f"eval_interval/{name}": [round(low, 4), round(high, 4)] for name, (low, high) in intervals.items()}
    failures = {f"eval_failed/{name}": evaluation.failed for name, evaluation in evals.items()}
    parts.metrics.record({
        "step": version, "eval_accuracy": accuracy, **per_task, **bounds, **failures, "elapsed_s": elapsed_s, "eval_wall_s": wall_s,
        "eval_engine": "own" if aside else "shared",
    })  # fmt: skip
    shown = "  ".join(f"{name} {value:.1%} [{intervals[name][0]:.1%}, {intervals[name][1]:.1%}]" for name, value in scores.items())
    # Episodes that did not end ok count as failures (score 0): said, so a broken evaluation is not read as a bad policy.
    for name, evaluation in evals.items():
        if evaluation.failed:
            status, reason = next(iter(evaluation.reasons.items()), ("", ""))
            shown += f"  ({evaluation.failed} {name} episodes failed and scored 0; {status}: {reason[:160]})"
    if aside:
        how = f"  (on its own engine in {wall_s:.0f} s; training went on)"
    elif held_training:
        how = f"  (between pushes: training waited {wall_s:.0f} s)" if wall_s >= 1 else ""
    else:
        how = f"  (in {wall_s:.0f} s)" if wall_s >= 1 else ""
    parts.display.say(f"version {version}  {elapsed_s:6.0f}s  held-out accuracy {shown}{how}")
    return accuracy


class EvaluationEngine(Protocol):
    """An engine that serves evaluation only (`eval.engine: own`): in no push and no training routing."""

    handle: EngineHandle
    """For the evaluation gateway's pool (`gateway/engines.py`)."""

    async def load(self, weights: Weights, version: int) -> None:
        """Serve `weights` (as a push hands them to the worker group) as `version` once this returns."""
        ...


@dataclass
class Finished:
    """An evaluation played aside, ended: what it evaluated, when, and its result (or why it failed)."""

    version: int
    elapsed_s: float
    """The run's time when it began (when `version` was pushed)."""
    wall_s: float
    evals: dict[str, TaskEval] | None
    error: BaseException | None = None


class OwnEngineEvaluation:
    """`eval.engine: own`. `async with OwnEngineEvaluation(config, tasks, engine, tokenizer)`: a gateway of
    its own over `engine`; `begin` loads a push's weights into the engine and starts the held-out play in
    the background; `finished` hands over its result once it has ended. One evaluation at a time: a push
    that makes another due while one plays is not evaluated (the next due one is)."""

    def __init__(self, config: RunConfig, tasks: TaskMix, engine: EvaluationEngine, tokenizer: Any) -> None:
        self.config, self.tasks, self.engine, self.tokenizer = config, tasks, engine, tokenizer
        self._stack = contextlib.AsyncExitStack()
        self._playing: asyncio.Task | None = None

    async def __aenter__(self) -> OwnEngineEvaluation:
        from asyncrl.gateway.serving import episode_http_client, evaluation_gateway

        self.gateway = await self._stack.enter_async_context(evaluation_gateway(self.config, [self.engine.handle], self.tokenizer))
        self.http = await self._stack.enter_async_context(episode_http_client(self.config, self.gateway))
        return self

    async def __aexit__(self, *exc) -> None:
        if self._playing is not None:
            self._playing.cancel()
            await asyncio.gather(self._playing, return_exceptions=True)
        await self._stack.aclose()

    @property
    def playing(self) -> bool:
        return self._playing is not None and not self._playing.done()

    async def begin(self, weights: Weights, version: int, elapsed_s: float) -> None:
        """Load `weights` (those of the push just made; loaded before the caller's next step can change
        them) and start playing the held-out set with them. An engine that fails to load them fails this
        evaluation (booked as failed), not the push."""
        try:
            await self.engine.load(weights, version)
        except Exception as error:
            self._playing = asyncio.create_task(_failed(Finished(version, elapsed_s, 0.0, None, error)))
            return
        self._playing = asyncio.create_task(self._play(version, elapsed_s))

    async def _play(self, version: int, elapsed_s: float) -> Finished:
        began = time.monotonic()
        try:
            evals = await heldout_scores(self.config, self.tasks, self.gateway, self.http)
        except Exception as error:  # a crashed evaluation is reported, never the run's end
            return Finished(version, elapsed_s, time.monotonic() - began, None, error)
        return Finished(version, elapsed_s, time.monotonic() - began, evals)

    def finished(self) -> Finished | None:
        """The evaluation that ended since the last call, once (None while one plays or none did)."""
        if self._playing is None or not self._playing.done():
            return None
        task, self._playing = self._playing, None
        return task.result()

    async def wait(self) -> Finished | None:
        """The evaluation playing now, once it ends (None when none plays or none ended unbooked)."""
        if self._playing is not None:
            await asyncio.wait([self._playing])
        return self.finished()


async def _failed(finished: Finished) -> Finished:
    return finished
