"""`asyncrl bench gateway`'s streaming and Messages-route parts, shrunk: every call succeeds through a real
gateway child process, and the figures it reports are there (their size is the benchmark's business)."""

from __future__ import annotations

import pytest

from asyncrl.bench import gateway_routes


@pytest.mark.slow  # ~12 s: two server processes
def test_streaming_and_the_messages_route_are_measured_side_by_side(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(gateway_routes, "STREAM_SESSIONS", 2)
    monkeypatch.setattr(gateway_routes, "STREAM_CALLS", 2)
    monkeypatch.setattr(gateway_routes, "STREAM_REPEATS", 1)
    monkeypatch.setattr(gateway_routes, "ROUTE_SESSIONS", 2)
    monkeypatch.setattr(gateway_routes, "ROUTE_TURNS", 2)
    monkeypatch.setattr(gateway_routes, "ROUTE_REPEATS", 1)
    streamed = gateway_routes.streaming(str(tmp_path))
    # Both sides waited at least the stub's first-token delay, so the figures are real times.
    for mode in ("", "_burst"):  # paced arrivals, and every session at once
        assert streamed[f"stream_ttft_gateway{mode}_p50_ms"] >= 1000 * gateway_routes.FIRST_TOKEN_S
        assert streamed[f"stream_ttft_direct{mode}_p50_ms"] >= 1000 * gateway_routes.FIRST_TOKEN_S
        assert streamed[f"stream_per_token_gateway{mode}_ms"] > 0
    assert streamed["stream_setup"]["reply_tokens"] > 10
    routes = gateway_routes.anthropic_route(str(tmp_path))
    assert routes["chat_cpu_ms_per_call"] > 0 and routes["messages_cpu_ms_per_call"] > 0
    assert routes["messages_over_chat_cpu"] > 0
