"""`asyncrl bench async` end to end on a tiny policy: both modes run with real Ray actors, the JSON
holds the promised keys, and its numbers agree with each other (same sample budget in both modes,
idle fractions that are fractions, rates that are counts over walls)."""

from __future__ import annotations

import json

import pytest
from loop_helpers import TINY, CoinEnv

from asyncrl.bench.asyncloop import OVERRIDES, PRESET, AsyncBenchOptions
from asyncrl.configs.loader import load_config
from asyncrl.envs.latency import LatencyConfig

pytestmark = pytest.mark.slow  # two runs, each with a rollout worker and a learner process

# Groups of 8 so that a batch without reward signal (every group all-equal: no optimizer step, one
# more batch) is too rare to make the two modes' budgets differ; no evaluation or checkpoint mid-run.
SIZE = ["learner.group_size=8", "loop.steps=2", "loop.max_inflight=32", "loop.eval_every=1000", "learner.checkpoint_every=1000"]


def test_bench_async_runs_both_modes_on_the_same_budget(ray_session, tmp_path):
    from asyncrl.bench.asyncloop import run

    config = load_config(PRESET, [*OVERRIDES, *TINY, *SIZE])
    options = AsyncBenchOptions(latency=LatencyConfig(median_s=0.05, tail_min_s=0.3, max_s=1.0))
    path = tmp_path / "bench.json"
    results = run(config, str(path), options, env_factory=lambda config: CoinEnv())  # parity reward: signal without SFT

    assert json.loads(path.read_text()) == results
    sync, async_ = results["sync"], results["async"]
    assert results["async_over_sync_samples_per_s"] == pytest.approx(async_["samples_per_s"] / sync["samples_per_s"], rel=1e-2)
    budget = config.loop.steps * config.learner.batch_groups * config.learner.group_size
    for mode, side in (("sync", sync), ("async", async_)):
        assert results[f"learner_idle_frac_{mode}"] == side["learner_idle_frac"]
        assert 0.0 <= side["learner_idle_frac"] <= 1.0
        assert 0.0 < side["learner_busy_s"] < side["rl_wall_s"] < side["run_wall_s"]
        assert side["optimizer_steps"] == config.loop.steps and side["balanced"]
        # Each learner call takes one whole batch; a batch without signal would take no step.
        assert side["rollouts_to_learner"] == side["learner_calls"] * budget // config.loop.steps >= budget
        assert 0 < side["trained"] <= side["rollouts_to_learner"]
        assert side["samples_per_s"] == pytest.approx(side["trained"] / side["rl_wall_s"], rel=1e-2)
        assert side["tool_latency_s"]["max"] <= 1.0  # the episodes waited the configured latencies
    assert sync["staleness_max"] == 0  # sync trains only on the weights that sampled
    assert results["setup"]["latency"]["median_s"] == 0.05
