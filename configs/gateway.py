"""The gateway section: where the TITO gateway listens, who may call it, and its limits."""

from __future__ import annotations

import ipaddress
from typing import Literal

from pydantic import Field, model_validator

from .section import Section


class GatewayConfig(Section):
    """The TITO gateway: where it listens, how it routes and watches engines, and what it refuses."""

    host: str = "127.0.0.1"
    """Address to bind; the default is reachable from this machine only."""
    auth: bool = True
    """Require the run token on lifecycle and scoring calls and the engine token on engine registration
    (rollout keys are per rollout either way); false is refused on a non-loopback host."""
    port: int = Field(0, ge=0, le=65535)
    """TCP port; 0 picks a free one (printed at start)."""
    engines: Literal["in_process", "ray"] = "in_process"
    """Where `asyncrl serve` runs its engines: in the gateway's process, or as Ray RolloutWorker actors."""
    heartbeat_interval_s: float = Field(1.0, gt=0, le=60)
    """How often in-process engines are asked for their health (remote engines send heartbeats themselves)."""
    heartbeat_timeout_s: float = Field(10.0, gt=0, le=3600)
    """An engine silent for this long is taken out of routing; its in-flight requests are retried or failed."""
    route_vnodes: int = Field(128, ge=1, le=4096)
    """Points per engine on the consistent-hash ring (more: smoother shares, slower rebuilds)."""
    route_load_factor: float = Field(0.25, ge=0.0, le=10.0)
    """Bounded loads: an engine takes no new rollouts above (1 + this) x the average in-flight load."""
    request_timeout_s: float = Field(300.0, gt=0, le=86400)
    """Longest a generation request may take, retries included; then it fails with 504."""
    engine_retries: int = Field(1, ge=0, le=16)
    """Times a request is re-sent to another engine after its engine failed; 0 fails fast with 503."""
    max_prompt_tokens: int = Field(32768, ge=1)
    """Longest prompt, in tokens, the gateway forwards."""
    max_tokens: int = Field(4096, ge=1)
    """Largest max_tokens a request may ask for (requests without one get rollout.sampling.max_tokens)."""
    max_tokens_fit: Literal["clamp", "refuse"] = "clamp"
    """A request whose max_tokens is above gateway.max_tokens, or more than the engines' context leaves after
    its prompt: "clamp" samples at most what fits (agent harnesses ask for tens of thousands of tokens whatever
    the model), "refuse" answers 400."""
    max_messages: int = Field(1024, ge=1)
    """Most messages in one chat request."""
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024)
    """Largest request body; bigger ones are refused with 413 before they are parsed."""
    max_message_chars: int = Field(1_000_000, ge=1)
    """Most characters in one message's content (and in one text prompt), checked before anything is tokenized."""
    keep_alive_s: int = Field(75, ge=1, le=3600)
    """How long an idle client connection stays open. Longer than clients' own keep-alive (httpx and the
    openai SDK: 5 s), so a client never reuses a connection the gateway is closing at that moment."""
    max_branches: int = Field(64, ge=1, le=100000)
    """Most forks one rollout may have (each rewrite of earlier context starts one)."""
    max_rollout_turns: int | None = Field(4096, ge=1)
    """Most turns (recorded generation calls) one rollout may take; calls in flight count, so concurrent
    calls on one key cannot pass it together. None: no limit."""
    max_rollout_tokens: int | None = Field(16_777_216, ge=1)
    """Most completion tokens one rollout may sample over all its turns; each call in flight holds its
    max_tokens until it is recorded, so concurrent calls cannot pass it together. None: no limit."""
    max_ended_rollouts: int = Field(100_000, ge=1, le=10_000_000)
    """Ended rollouts whose status the gateway keeps in memory (~200 B each), so that a late call on one
    is refused without a store lookup; older ones are looked up in the store."""
    tool_parser: str = Field("auto", min_length=1)
    """How replies' tool calls are read (gateway/parsers/): glm45 (GLM-4.5's XML-style arguments, the
    tiny policy's markup), hermes or qwen (JSON in <tool_call> tags), llama3_json, an entry point of the
    group asyncrl.tool_parsers, or an import path 'package.module:Class'; auto: the one the checkpoint's
    tokenizer config declares (tool_parser), else the one its chat template's markup implies (logged)."""
    reasoning_parser: str | None = "auto"
    """How replies' thinking is split off into reasoning_content: think (<think>...</think>), an entry
    point of the group asyncrl.reasoning_parsers, or an import path; auto: the checkpoint's declared one,
    else think where its chat template writes <think>, else none; None: replies are all content."""
    sampling_overrides: Literal["allow", "refuse"] = "refuse"
    """Requests whose temperature, top_p or top_k differ from rollout.sampling: "refuse" answers them 400, so
    every token of an RL run comes from the distribution it trains (the learner reproduces no top-k/top-p
    truncation); "allow" samples as asked (`asyncrl serve` allows unless this is set: agents and judges under
    development). Either way each turn records its options and the learner scores each token at its turn's temperature."""

    replicas: int = Field(1, ge=1, le=64)
    """How many gateways `asyncrl run` serves over its store and engines: its own and replicas - 1 more, each a
    Ray actor; each rollout is served by the replica that opened it (gateway/replicas.py, docs/CLUSTER.md)."""
    replica_id: str | None = Field(None, pattern=r"^[A-Za-z0-9_-]{1,32}$")
    """This gateway's name among replicas sharing one store (`asyncrl serve`: give each process its own); None:
    a lone gateway. Rollouts it opens name it as their home, and calls on them reaching another replica are forwarded here."""
    advertise_url: str | None = None
    """The URL other replicas and agents reach this gateway at (e.g. http://10.0.0.5:8000); None:
    http://HOST:PORT, with this machine's address where host is 0.0.0.0."""
    replica_ttl_s: float = Field(10.0, gt=0, le=3600)
    """A replica that has not announced itself for this long is taken as dead; calls on its rollouts are then
    served by whichever replica they reach (their next turn starts a fresh branch)."""

    @model_validator(mode="after")
    def _check_heartbeats(self) -> GatewayConfig:
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ValueError("heartbeat_timeout_s must exceed heartbeat_interval_s (else live engines expire)")
        if not self.auth and not is_loopback(self.host):
            raise ValueError(
                f"auth: false on host {self.host!r} would let anyone who reaches it register engines and finish rollouts; "
                "bind 127.0.0.1 or keep auth"
            )
        return self


def is_loopback(host: str) -> bool:
    """Whether `host` is this machine only (localhost, 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
