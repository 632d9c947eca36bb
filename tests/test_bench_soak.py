"""`asyncrl bench soak` for a few seconds: the gateway serves episodes without an error, every sample has
every quantity, the result says bounded, names what grows or says the run was too short to tell, and
the plot lands next to the JSON. The verdict itself on made-up series: growth in the second half, a
warm-up, and a capped memory still filling when the second half began."""

from __future__ import annotations

import json
import os

import pytest

from asyncrl.bench.soak import GROWTH_TOLERANCE, verdict
from asyncrl.cli import main

SAMPLE_KEYS = {
    "t_min", "rss_mib", "open_fds", "store_rollouts", "store_turns", "store_bytes", "store_bytes_per_episode",
    "latency_p50_ms", "latency_p99_ms", "chat_requests", "episodes_done", "errors",
}  # fmt: skip


REDIS_URL = os.environ.get("ASYNCRL_REDIS_URL", "redis://127.0.0.1:6379/0")


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("store", ["sqlite", "redis"])
def test_a_short_soak_samples_the_gateway_and_gives_a_verdict(tmp_path, store) -> None:
    path = tmp_path / "soak" / "soak.json"
    words = ["bench.minutes=0.05", "bench.sample_s=1", "bench.sessions=4", f"bench.store={store}"]
    if store == "redis":
        words += ["store.type=redis", f"store.url={REDIS_URL}"]
    assert main(["bench", "soak", *words, "--json", str(path)]) == 0
    results = json.loads(path.read_text())

    assert results["errors"] == 0, results["first_errors"]
    assert results["episodes"] > 0 and results["chat_requests"] >= results["episodes"]
    samples = results["samples"]
    assert len(samples) >= 2  # one when the episodes start and one when they end, whatever the machine's speed
    assert all(set(sample) == SAMPLE_KEYS for sample in samples)
    assert [s["t_min"] for s in samples] == sorted(s["t_min"] for s in samples)
    last = samples[-1]
    assert last["rss_mib"] > 0 and last["open_fds"] > 0 and last["store_bytes"] > 0
    # Every finished episode is in the store, and the consumer took each one once.
    assert last["store_rollouts"] >= last["episodes_done"] > 0
    assert results["acked"] <= results["episodes"]
    assert set(results["fits"]) == set(GROWTH_TOLERANCE)
    assert results["result"] == "bounded" or "grows" in results["result"] or results["result"].startswith("inconclusive")
    assert results["setup"]["ended_cap"] == 2_000 and isinstance(results["rss_mib_per_min"], float)
    assert (path.parent / "soak.png").stat().st_size > 0


def _samples(rss: list[float], episodes_per_min: int = 1000) -> list[dict]:
    return [
        {"t_min": float(i), "rss_mib": value, "open_fds": 40, "store_bytes_per_episode": 3000.0, "latency_p50_ms": 50.0,
         "latency_p99_ms": 60.0, "episodes_done": i * episodes_per_min}
        for i, value in enumerate(rss)
    ]  # fmt: skip


def test_the_verdict_names_a_quantity_that_grows_in_the_second_half() -> None:
    leaking = verdict(_samples([100.0 + 10 * i for i in range(20)]))
    assert leaking["fits"]["rss_mib"]["verdict"] == "grows"
    assert leaking["result"].startswith("rss_mib grows +10/min")
    assert all(fit["verdict"] == "bounded" for name, fit in leaking["fits"].items() if name != "rss_mib")


def test_warm_up_growth_in_the_first_half_is_not_a_leak() -> None:
    warming = verdict(_samples([100.0 + 10 * min(i, 5) for i in range(20)]))
    assert warming["result"] == "bounded"


def test_a_creep_the_old_16_mib_tolerance_let_through_is_growth() -> None:
    creeping = verdict(_samples([100.0 + 0.27 * i for i in range(30)]), ended_cap=2_000)  # the first 30-minute soak's RSS
    assert creeping["result"].startswith("rss_mib grows +0.27/min")
    assert creeping["rss_mib_per_min"] == 0.27 and creeping["ended_cap_filled_at_min"] == 2.0


def test_memory_flat_once_the_cap_of_ended_rollouts_is_full_is_bounded() -> None:
    flat = verdict(_samples([100.0 + 4 * min(i, 2) for i in range(30)]), ended_cap=2_000)
    assert flat["result"] == "bounded" and flat["rss_mib_per_min"] == 0.0


def test_a_cap_still_filling_in_the_second_half_makes_the_soak_inconclusive() -> None:
    slow = verdict(_samples([100.0] * 30, episodes_per_min=100), ended_cap=2_000)  # full at minute 20 of 29
    assert slow["result"].startswith("inconclusive: the 2000 ended rollouts") and "only at minute 20.0" in slow["result"]
    assert verdict(_samples([100.0] * 30, episodes_per_min=0), ended_cap=2_000)["result"].startswith("inconclusive")


def test_a_soak_too_short_to_fit_says_so() -> None:
    assert verdict(_samples([100.0]))["result"] == "too few samples"
