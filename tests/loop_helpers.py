"""What the loop's tests share: a tiny run config, an environment whose random policy has signal, and
the real loop run over in-process parts (no Ray)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from asyncrl.configs.loader import load_config
from asyncrl.envs.base import EpisodeResult
from asyncrl.gateway.serving import InProcessGateway, episode_http_client
from asyncrl.gateway.store import open_store
from asyncrl.learner.rl import RLLearner
from asyncrl.policy.checkpoint import build_policy
from asyncrl.records import TERMINAL_STATUSES
from asyncrl.rollout.engine import EmbeddedEngine
from asyncrl.sched.display import Display
from asyncrl.sched.evaluation import OwnEngineEvaluation
from asyncrl.sched.learners import LocalLearner
from asyncrl.sched.loop import Loop
from asyncrl.sched.parts import Parts
from asyncrl.sched.rundir import LoopState, RunDir
from asyncrl.sched.supervision import Unsupervised
from asyncrl.sched.tasks import TaskMix
from asyncrl.sched.workers import LocalEvaluationEngine, LocalWorkers

TINY = [
    "policy.tiny.arch=qwen3", "policy.tiny.hidden_size=32", "policy.tiny.num_layers=2", "policy.tiny.num_heads=2",
    "policy.tiny.intermediate_size=64", "policy.mtp.enabled=false", "loop.sft_first=false",
    "rollout.cpus_per_worker=0.5", "rollout.max_num_seqs=16", "learner.num_cpus=0.5", "learner.group_size=4",
    "learner.batch_groups=2", "learner.lr=1e-2", "learner.checkpoint_every=2", "loop.max_inflight=16",
    "loop.eval_every=2", "eval.num_problems=16", "eval.max_tokens=4", "logging.wandb=disabled", "logging.progress=false",
]  # fmt: skip


class CoinEnv:
    """Rewards the parity of what the policy wrote, so a random policy's groups have signal;
    crashes on every `crash_every`-th task, and raises KeyboardInterrupt (a Ctrl-C) in the first episode
    that starts once `stop_when()` holds."""

    name = "coin"

    def __init__(self, crash_every: int = 0, stop_when: Callable[[], bool] | None = None) -> None:
        self.crash_every, self.stop_when, self.episodes = crash_every, stop_when, 0

    def sample_task(self, rng, split="train") -> int:
        return rng.randrange(1_000_000)

    async def run_episode(self, task: int, client) -> EpisodeResult:
        self.episodes += 1
        if self.stop_when is not None and self.stop_when():
            self.stop_when = None
            raise KeyboardInterrupt
        reply = await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": str(task)}], max_tokens=4, temperature=1.0
        )
        if self.crash_every and task % self.crash_every == 0:
            raise RuntimeError("the sandbox died")
        return EpisodeResult(reward=float(sum(map(ord, reply.choices[0].message.content or "")) % 2))


def run_config(tmp_path, *overrides: str):
    """The quickstart preset made tiny (TINY), its run directory under `tmp_path`."""
    return load_config("quickstart", [*TINY, f"runs_dir={tmp_path}", *overrides])


async def run_in_process(config, env, *, resume: bool = False, on_loop: Callable[[Loop], None] | None = None) -> dict:
    """What `asyncrl run` does after start-up (asyncrl/jobs/run.py), over in-process parts; with `resume`, it
    continues the run in `config`'s run directory from its last checkpoint. `on_loop`: called with the loop
    once it is built (a test's environment watching it); `eval.engine: own` gets an engine of its own."""
    rundir = RunDir.for_config(config)
    checkpoint, state = rundir.latest_checkpoint() if resume else (None, LoopState())
    if not resume:
        rundir.write_config(config)
    store = open_store(rundir.store_address(config), namespace=config.name)
    model, tokenizer, _ = build_policy(config.policy, config.seed)
    workers = LocalWorkers([EmbeddedEngine(model, config.rollout, engine_id="local-0")])
    policy = RLLearner.from_config(config)
    if checkpoint is not None:
        policy.load(checkpoint)
    metrics, result = rundir.metrics(config, resume=resume), {"state": state, "rundir": rundir}
    try:
        async with (
            InProcessGateway(config, store, workers.engines, tokenizer) as gateway,
            episode_http_client(config, gateway) as http,
            _evaluation(config, env, tokenizer) as evaluation,
        ):
            parts = Parts(
                store=store, gateway=gateway, http=http, tasks=TaskMix.from_config(config, env), learner=LocalLearner(policy),
                workers=workers, supervision=Unsupervised(len(workers.engines)), tokenizer=tokenizer, rundir=rundir,
                metrics=metrics, display=Display(progress=False), evaluation=evaluation,
            )  # fmt: skip
            loop = Loop(config, parts, state)
            if on_loop is not None:
                on_loop(loop)
            try:
                await loop.push()
                if resume:
                    reclaim = open_store(rundir.store_address(config), namespace=config.name, visibility_timeout_s=1e-6)
                    result["recovered"] = await loop.recover(reclaim)
                    reclaim.close()
                if state.eval_before is None:
                    await loop.evaluate_first()
                await loop.run()
                result["stop_reason"] = loop.stop_reason()
                result["eval_after"] = await loop.close()
            finally:
                await loop.episodes.stop()
        result.update(counts=store.counts(), versions=await workers.versions(), health=await workers.health(), records=metrics.read())
    finally:
        metrics.close()
        store.close()
    return result


@contextlib.asynccontextmanager
async def _evaluation(config, env, tokenizer):
    """`eval.engine: own`: an `OwnEngineEvaluation` over an engine of its own (None with `shared`)."""
    if config.eval.engine == "shared":
        yield None
        return
    model, _, _ = build_policy(config.policy, config.seed)
    engine = EmbeddedEngine(model, config.rollout, engine_id="local-eval")
    try:
        async with OwnEngineEvaluation(config, TaskMix.from_config(config, env), LocalEvaluationEngine(engine), tokenizer) as evaluation:
            yield evaluation
    finally:
        engine.shutdown()


def started(counts: dict) -> int:
    return sum(counts[status] for status in ("running", *TERMINAL_STATUSES))
