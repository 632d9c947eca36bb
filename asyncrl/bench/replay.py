"""Benchmark: `asyncrl replay score` on a run of 10,000 trajectories.

A synthetic run is built in a scratch directory: the config's tiny policy, saved as the run's one
kept checkpoint (`step-000001`, a real checkpoint `RunView` and the scorer load), and
`bench.trajectories` trajectories written through the SQLite store's own verbs (open, append, finish)
in GRPO groups of `learner.group_size`, in the shapes the built-in tasks record: three quarters
one-turn reasoning (a question, a short worked answer, EOS) and a quarter agentic (a tool call, the
tool's response in the next prompt, the answer), sampled under versions 0 and 1. Then, timed:

- `open_select_s`: `RunView.open` and `select(Selection())` of every trajectory (what any replay
  verb does first);
- re-scoring `bench.score_trajectories` of them the way `asyncrl replay score` does by default
  (series `nearest` and `final`: two checkpoints loaded, every report field computed), as sampled
  tokens re-scored per second per series, beside the scorer's forward alone on the same sequences.

    asyncrl bench replay --json runs/bench/replay.json
    asyncrl bench replay bench.trajectories=50 bench.score_trajectories=20
"""

from __future__ import annotations

import json
import platform
import random
import tempfile
import time
from pathlib import Path

import torch
from pydantic import Field

from asyncrl.configs.schema import RunConfig, Section

PRESET = "quickstart"
AGENTIC_SHARE = 0.25


class ReplayBenchOptions(Section):
    """Settings of `asyncrl bench replay` itself (`bench.KEY=VALUE` on the command line)."""

    trajectories: int = Field(10_000, ge=1, le=10_000_000)
    """Trajectories in the synthetic run."""
    score_trajectories: int = Field(2_000, ge=1, le=10_000_000)
    """How many of them (the first recorded) are re-scored for the throughput figure."""
    threads: int = Field(0, ge=0, le=256)
    """torch threads while scoring (0: torch's default)."""
    keep: str | None = None
    """Build the run in this directory and keep it (default: a scratch directory, deleted after)."""


def run(config: RunConfig, json_path: str | None, options: ReplayBenchOptions | None = None) -> dict:
    options = options or ReplayBenchOptions()
    if options.threads:
        torch.set_num_threads(options.threads)
    if options.keep:
        results = _measure(config, Path(options.keep), options)
    else:
        with tempfile.TemporaryDirectory(prefix="asyncrl-bench-replay-") as scratch:
            results = _measure(config, Path(scratch), options)
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(results, indent=2) + "\n")
    return results


def _measure(config: RunConfig, directory: Path, options: ReplayBenchOptions) -> dict:
    from asyncrl.replay.rescore import rescore
    from asyncrl.replay.run import RunView, Selection
    from asyncrl.replay.score import PolicyLoader, resolve_series
    from asyncrl.samples import trajectory_to_samples

    start = time.perf_counter()
    run_dir, written = build_run(config, directory, options.trajectories)
    build_s = time.perf_counter() - start

    start = time.perf_counter()
    view = RunView.open(run_dir)
    open_s = time.perf_counter() - start
    trajectories = view.select(Selection())
    open_select_s = time.perf_counter() - start
    assert len(trajectories) == written

    chosen = trajectories[: options.score_trajectories]
    series = resolve_series(view, None)
    loader = PolicyLoader(view)
    start = time.perf_counter()
    scores = rescore(view, chosen, series, loader.scorer, loader.tokenizer)
    rescore_s = time.perf_counter() - start
    sampled = sum(score.summary["sampled_tokens"] for score in scores)
    tokens = sum(len(score.tokens) for score in scores)

    sequences = [s.token_ids for t in chosen for s in trajectory_to_samples(t)]
    scorer = loader.scorer(view.final_checkpoint())
    start = time.perf_counter()
    scorer.score(sequences, 1.0)
    forward_s = time.perf_counter() - start
    view.close()
    return {
        "benchmark": "replay",
        "machine": {"platform": platform.platform(), "torch_threads": torch.get_num_threads()},
        "policy": {"arch": config.policy.tiny.arch, "hidden_size": config.policy.tiny.hidden_size, "layers": config.policy.tiny.num_layers},
        "trajectories": written,
        "build_s": round(build_s, 3),
        "open_s": round(open_s, 4),
        "open_select_s": round(open_select_s, 3),
        "select_per_trajectory_ms": round(1e3 * (open_select_s - open_s) / max(written, 1), 4),
        "rescore": {
            "trajectories": len(chosen),
            "samples": len(scores),
            "series": [s.label for s in series],
            "tokens": tokens,
            "sampled_tokens": sampled,
            "wall_s": round(rescore_s, 3),
            "sampled_tokens_per_s": round(sampled * len(series) / rescore_s, 1),
            "tokens_per_s": round(tokens * len(series) / rescore_s, 1),
        },
        "forward_only": {
            "sequences": len(sequences),
            "tokens": sum(map(len, sequences)),
            "wall_s": round(forward_s, 3),
            "tokens_per_s": round(sum(map(len, sequences)) / forward_s, 1),
        },
    }


def build_run(config: RunConfig, directory: Path, count: int) -> tuple[Path, int]:
    """A run directory with one real checkpoint and `count` trajectories written through SQLiteStore."""
    from asyncrl.gateway.store import SQLiteStore
    from asyncrl.learner.resume import STATE_FILE
    from asyncrl.policy.checkpoint import build_policy, save_policy
    from asyncrl.sched.rundir import LoopState, RunDir

    run = config.model_copy(update={"runs_dir": str(directory), "name": "replay-bench"})
    rundir = RunDir.for_config(run)
    rundir.write_config(run)
    model, tokenizer, mtp = build_policy(run.policy, run.seed)
    checkpoint = save_policy(rundir.checkpoint_dir(1), model, tokenizer, mtp, extra_config={"asyncrl": {"stage": "rl", "version": 1}})
    torch.save({"version": 1}, checkpoint / STATE_FILE)
    rundir.commit_checkpoint(checkpoint, LoopState(version=1))

    rng = random.Random(run.seed)
    encode = _Encoder(tokenizer)
    store = SQLiteStore(rundir.store_address(run))
    group_size = run.learner.group_size
    try:
        for index in range(count):
            if index % group_size == 0:
                # One prompt per group, as GRPO has it: same task kind, problem and sampling version.
                group, agentic, version = f"g{index // group_size:06d}", rng.random() < AGENTIC_SHARE, rng.randrange(2)
                problem = (rng.randrange(10**4), rng.randrange(10**4))
            rollout_id = store.open(task="agentic" if agentic else "reasoning", group_id=group)
            for turn in _turns(rng, encode, problem, agentic, rollout_id, version, run.rollout.sampling.temperature):
                store.append(turn)
            store.finish(rollout_id, reward=float(rng.random() < 0.5))
    finally:
        store.close()
    return rundir.path, count


class _Encoder:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)


def _turns(
    rng: random.Random, encode: _Encoder, problem: tuple[int, int], agentic: bool, rollout_id: str, version: int, temperature: float
):
    from asyncrl.records import Turn

    a, b = problem

    def turn(prompt: list[int], text: str) -> Turn:
        completion = encode(text)
        logprobs = [-rng.expovariate(2.0) for _ in completion]
        return Turn(rollout_id, prompt, completion, logprobs, [version] * len(completion), temperature=temperature)

    if not agentic:
        worked = " ".join(str(rng.randrange(10**4)) for _ in range(rng.randrange(1, 6)))
        return [turn(encode(f"<|user|>What is {a}+{b}?<|assistant|>"), f"{worked} so {a + b}<|endoftext|>")]
    call = f"<tool_call>python<arg_key>code</arg_key><arg_value>print({a}*{b})</arg_value></tool_call><|endoftext|>"
    first = turn(encode(f"<|system|>tools: python<|user|>What is {a}*{b}?<|assistant|>"), call)
    observation = encode(f"<|observation|><tool_response>{a * b}</tool_response><|assistant|>")
    second = turn(first.prompt_token_ids + first.completion_token_ids + observation, f"The product is {a * b}.<|endoftext|>")
    return [first, second]
