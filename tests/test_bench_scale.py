"""`asyncrl bench scale`: every session count runs with none lost, and the push timings cover every engine
count in every mode (the object store, and from a learner through it or by broadcast), from pushes that really reached the engines."""

from __future__ import annotations

import json

import pytest

from asyncrl.cli import main

pytestmark = pytest.mark.slow  # a Ray start and three rollout worker processes


def test_bench_scale_reports_sessions_and_pushes(tmp_path):
    path = tmp_path / "scale.json"
    overrides = ["bench.sessions=[20,40]", "bench.replicas=[1,2]", "bench.engine_latency_s=0.01", "bench.latency.median_s=0.01",
                 "bench.latency.tail_prob=0",
                 "bench.push_engines=[1,2]", "bench.push_repeats=1", "bench.push_hidden_size=64", "bench.push_layers=1"]  # fmt: skip
    assert main(["bench", "scale", *overrides, "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    assert set(result["sessions"]) == {"1", "2"} and all(set(by_count) == {"20", "40"} for by_count in result["sessions"].values())
    for replicas, by_count in result["sessions"].items():
        for count, side in by_count.items():
            assert side["lost"] == side["failed"] == 0 and sum(side["statuses"].values()) == int(count)
            assert side["in_flight_max"] <= int(count) and side["driver_cpu_ms_per_episode"] > 0
            opened = side["opened_per_replica"]  # each replica opened its turn of the rollouts
            assert len(opened) == int(replicas) and sum(opened.values()) == int(count) and max(opened.values()) - min(opened.values()) <= 1
            assert (side["other_replicas_cpu_ms_per_episode"] > 0) == (replicas == "2")
    push = result["push"]
    assert push["weights_mb"] > 0 and set(push["parallel_s"]) == set(push["serial_s"]) == {"1", "2"}
    assert all(seconds > 0 for seconds in [*push["parallel_s"].values(), *push["serial_s"].values()])
    assert push["parallel_over_one"]["2"] == pytest.approx(push["parallel_s"]["2"] / push["parallel_s"]["1"], abs=1e-3)
    assert set(push["learner_object_store_s"]) == set(push["learner_broadcast_s"]) == {"1", "2"}
    assert all(seconds > 0 for seconds in [*push["learner_object_store_s"].values(), *push["learner_broadcast_s"].values()])


def test_bad_settings_are_refused_naming_the_key(capsys):
    from asyncrl.cli import EXIT_CONFIG_ERROR

    assert main(["bench", "scale", "bench.push_engines=[]", "--json", "unused.json"]) == EXIT_CONFIG_ERROR
    assert "bench.push_engines" in capsys.readouterr().err
