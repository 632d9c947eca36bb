"""`asyncrl bench agentic` with few episodes: every episode reaches the store, the numbers agree with
each other, and a sandbox backend that cannot run reports null with its reason."""

from __future__ import annotations

import json

import pytest

from asyncrl.bench import BENCHMARKS
from asyncrl.bench.agentic import AgenticBenchOptions, run
from asyncrl.configs import load_config
from asyncrl.envs.latency import LatencyConfig

pytestmark = pytest.mark.timeout(180)


def test_small_bench_loses_no_episode(tmp_path):
    config = load_config("agentic", ["sandbox.backend=docker", "sandbox.docker_host=unix:///nonexistent/docker.sock"])
    options = AgenticBenchOptions(
        episodes=40, engine_latency_s=0.02, sandbox_runs=1,
        latency=LatencyConfig(median_s=0.3, sigma=0.0, tail_prob=0.0),
    )  # fmt: skip
    path = tmp_path / "bench.json"
    results = run(config, str(path), options)
    assert json.loads(path.read_text()) == results

    assert results["lost_episodes"] == 0 and results["episodes_recorded"] == results["episodes_started"] == 40
    # Every episode called its tool once and answered: the stub engine's script ran through the gateway.
    assert results["store_statuses"] == results["episode_statuses"] == {"ok": 40} and results["runner_failures"] == 0
    assert results["tool_calls"] == results["tool_calls_recorded"] == 40
    # Episodes overlap at the gateway and in their tools (how many at once depends on how fast the
    # machine starts them within one 0.3 s tool wait, so only overlap itself is asserted).
    assert 1 < results["tools_in_flight_max"] <= results["episodes_in_flight_max"] <= 40
    assert 0.3 <= results["episode_p50_s"] <= results["episode_p99_s"] <= results["wall_s"]
    assert results["episodes_per_s"] == pytest.approx(40 / results["wall_s"], rel=0.01)

    assert results["sandbox_start_ms_process"] > 0
    assert results["sandbox_start_ms_docker"] is None
    assert "no Docker engine answers at unix:///nonexistent/docker.sock" in results["sandbox_start_errors"]["docker"]


def test_registered_with_its_settings():
    bench = BENCHMARKS["agentic"]
    config, options = bench.resolve(None, ["bench.episodes=7", "bench.latency.median_s=2"])
    assert config.name == "agentic" and (options.episodes, options.latency.median_s) == (7, 2.0)
