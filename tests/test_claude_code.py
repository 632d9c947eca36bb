"""Claude Code itself (`claude -p`, the npm package @anthropic-ai/claude-code) against a real gateway in front of a
real engine: every call it makes reaches the gateway's Messages route and is recorded token-exactly.

The policy is tests/agent_policy.py (BPE tokenizer, ChatML template, 32k context). Its replies are nonsense
that ends in EOS; the point is the wire. The gateway app runs under a recording ASGI layer, so the test
sees exactly the requests Claude Code sent and can re-render each one with the tokenizer's own calls.

Marker `claude_code`; skipped when the package is not installed (scripts/claude_code.sh installs it, and
scripts/test.sh runs it there when npm is present). Set ASYNCRL_CLAUDE_CODE to use another `claude`.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from agent_policy import MAX_TOKENS, agent_policy, agent_service
from gateway_helpers import LiveGateway

from asyncrl.gateway import anthropic
from asyncrl.gateway.app import create_app, gateway_server
from asyncrl.gateway.service import GatewayService
from asyncrl.gateway.template import BREAK, TokenizerTemplate
from asyncrl.gateway.toolcalls import to_template_messages, to_template_tools

pytestmark = pytest.mark.claude_code

ROOT = Path(__file__).resolve().parents[1]
CLAUDE = Path(os.environ.get("ASYNCRL_CLAUDE_CODE") or ROOT / ".cache" / "claude-code" / "node_modules" / ".bin" / "claude")
QUIET = {
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    "DISABLE_TELEMETRY": "1",
    "DISABLE_AUTOUPDATER": "1",
    "DISABLE_ERROR_REPORTING": "1",
}
"""No update checks, telemetry or error reports: nothing but the model calls (which go to ANTHROPIC_BASE_URL)."""


@dataclass
class Call:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes = b""
    status: int | None = None

    def json(self) -> dict:
        return json.loads(self.body)


@dataclass
class Recorder:
    """ASGI layer under the gateway app: keeps every request as it arrived and the status it was answered with."""

    app: object
    calls: list[Call] = field(default_factory=list)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        call = Call(scope["method"], scope["path"], {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]})
        self.calls.append(call)

        async def receiving():
            message = await receive()
            call.body += message.get("body", b"")
            return message

        async def sending(message) -> None:
            if message["type"] == "http.response.start":
                call.status = message["status"]
            await send(message)

        await self.app(scope, receiving, sending)


class RecordedGateway(LiveGateway):
    def __init__(self, service: GatewayService) -> None:
        super().__init__(service)
        self.recorder = Recorder(create_app(service))
        self.server = gateway_server(self.recorder, service.config, host="127.0.0.1", port=0)
        self.thread = threading.Thread(target=self.server.run, daemon=True)


@pytest.fixture
def gateway(tmp_path):
    if not os.access(CLAUDE, os.X_OK):
        pytest.skip(f"Claude Code is not installed at {CLAUDE}: run scripts/claude_code.sh (needs npm)")
    service, engine = agent_service(tmp_path / "store", max_tokens_fit="clamp")
    with RecordedGateway(service) as live:
        yield live
    engine.shutdown()


def claude(url: str, key: str, home: Path, prompts: list[str], tools: str | None) -> list[dict]:
    """One Claude Code session of len(prompts) user turns (stream-json in and out); its output events."""
    home.mkdir(exist_ok=True)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": key, **QUIET}
    command = [str(CLAUDE), "-p", "--input-format", "stream-json", "--output-format", "stream-json", "--verbose"]
    command += ["--max-turns", str(len(prompts) + 1)] + (["--tools", tools] if tools else [])
    stdin = "".join(json.dumps({"type": "user", "message": {"role": "user", "content": p}}) + "\n" for p in prompts)
    done = subprocess.run(command, input=stdin, capture_output=True, text=True, cwd=home, env=env, timeout=600)
    assert done.returncode == 0, f"claude exited {done.returncode}: {done.stderr[-2000:]} {done.stdout[-2000:]}"
    return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]


@pytest.mark.parametrize("tools", ["Bash,Agent", pytest.param(None, marks=pytest.mark.slow, id="default-tools")])
def test_a_claude_code_session_is_recorded_token_exactly(gateway, tmp_path, tools) -> None:
    tokenizer, _ = agent_policy()
    rollout_id, key = gateway.open(task="claude code")
    gateway.recorder.calls.clear()  # from here on, only Claude Code calls
    prompts = ["Say hi.", "Now say it again, louder."]
    events = claude(gateway.url, key, tmp_path / "home", prompts, tools)

    results = [e for e in events if e.get("type") == "result"]
    assert [(r["subtype"], r["is_error"]) for r in results] == [("success", False)] * len(prompts), results

    # Every request Claude Code made reached the gateway: a reachability probe, then one Messages call per prompt.
    calls = gateway.recorder.calls
    assert all(c.status is not None and c.status < 500 for c in calls), [(c.method, c.path, c.status) for c in calls]
    messages = [c for c in calls if c.method == "POST"]
    assert {c.path for c in messages} == {"/v1/messages"} and all(c.status == 200 for c in messages)
    assert {(c.method, c.path) for c in calls if c.method != "POST"} <= {("HEAD", "/")}
    assert len(messages) == len(prompts)
    assert all(c.headers.get("x-api-key") == key for c in messages)
    bodies = [c.json() for c in messages]
    assert all(b["stream"] is True and b["max_tokens"] > MAX_TOKENS for b in bodies)  # clamped to gateway.max_tokens

    gateway.http.post(f"/rollouts/{rollout_id}/finish", json={"reward": 0.0}).raise_for_status()
    trajectory = gateway.service.store.get(rollout_id)
    assert trajectory.status == "ok" and len(trajectory.turns) == len(prompts)

    reference = TokenizerTemplate(tokenizer)  # the tokenizer's own apply_chat_template and encode
    reads_thinking = "enable_thinking" in reference.variables
    previous = None
    for body, turn in zip(bodies, trajectory.turns, strict=True):
        chat = anthropic.to_chat(anthropic.MessagesRequest.model_validate(body), reads_thinking)
        rendered = reference.render(
            to_template_messages([m.model_dump(exclude_none=True) for m in chat.messages]),
            to_template_tools(chat.tools),
            generation_prompt=True,
        )
        # Claude Code's own text spells none of the template's markers. A reply the policy sampled may
        # (its plain tokens happened to spell "</tool_response>"), and the template writes it escaped, as
        # the gateway's decode of the sampled tokens does: every BREAK is in an echoed reply.
        echoed = previous.prompt_token_ids + previous.completion_token_ids if previous is not None else []
        assert rendered.count(BREAK) == reference.decode(echoed).count(BREAK)
        # Text-exact: the recorded prompt says exactly what Claude Code sent, in the template's form.
        assert tokenizer.decode(turn.prompt_token_ids) == rendered.replace(BREAK, "")
        for block in body["system"]:
            assert block["text"] in rendered
        for tool in body["tools"]:
            assert json.dumps(tool["description"], ensure_ascii=False) in rendered
        if previous is None:  # token-exact: the first prompt is the template's encoding of the request
            assert turn.prompt_token_ids == reference.encode(rendered)
        else:  # the next turn extends the last one: its sampled tokens kept as sampled, the new text encoded
            made_from = reference.decode(echoed)  # the text the reused tokens stand for, as the template writes it
            assert turn.branch == previous.branch and turn.prompt_token_ids[: len(echoed)] == echoed
            assert rendered.startswith(made_from)
            assert turn.prompt_token_ids[len(echoed) :] == reference.encode(rendered[len(made_from) :])
        assert 0 < len(turn.completion_token_ids) <= MAX_TOKENS and turn.finish_reason == "stop"
        assert turn.completion_token_ids[-1] == tokenizer.eos_token_id
        assert set(turn.versions) == {0} and all(math.isfinite(lp) and lp <= 0 for lp in turn.logprobs)
        assert turn.temperature == 1.0  # Claude Code sends no temperature: the run's
        previous = turn

    # What Claude Code printed is what the policy sampled.
    replies = [e for e in events if e.get("type") == "assistant"]
    texts = ["".join(b.get("text", "") for b in r["message"]["content"]) for r in replies]
    sampled = [tokenizer.decode(t.completion_token_ids, skip_special_tokens=True) for t in trajectory.turns]
    assert [t.strip() for t in texts] == [s.strip() for s in sampled]
