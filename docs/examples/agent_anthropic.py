"""An agent on the Anthropic SDK, trained through asyncrl: one episode against `asyncrl serve` (docs/AGENTS.md).

    python docs/examples/agent_anthropic.py URL RUN_TOKEN

A two-turn tool-using loop written the way the Anthropic SDK's docs write one: `messages.stream` with a
system prompt and a tool, the reply's content blocks appended to the history as they came, a `tool_result`
for each `tool_use` (or a follow-up question when the model called none), and a second call. The client's
base URL is the gateway and its API key the rollout's (sent as `x-api-key`, as the SDK always does).
"""

from __future__ import annotations

import json
import sys

import anthropic
import httpx

SYSTEM = "You are a careful assistant. Look up capitals with the tool before answering."
TOOLS = [
    {
        "name": "lookup_capital",
        "description": "The capital city of a country.",
        "input_schema": {"type": "object", "properties": {"country": {"type": "string"}}, "required": ["country"]},
    }
]
CAPITALS = {"france": "Paris", "japan": "Tokyo"}


def agent(client: anthropic.Anthropic, question: str) -> str:
    """The agent: ask, run the tools the model called, ask again; returns the last reply's text."""
    messages: list[dict] = [{"role": "user", "content": question}]
    for _ in range(2):
        with client.messages.stream(model="policy", max_tokens=64, system=SYSTEM, tools=TOOLS, messages=messages) as stream:
            reply = stream.get_final_message()
        messages.append({"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in reply.content]})
        calls = [block for block in reply.content if block.type == "tool_use"]
        if calls:
            results = [CAPITALS.get(str(call.input.get("country", "")).lower(), "unknown") for call in calls]
            messages.append({
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": c.id, "content": r} for c, r in zip(calls, results, strict=True)],
            })  # fmt: skip
        else:
            messages.append({"role": "user", "content": "Please use the lookup_capital tool."})
    return "".join(block.text for block in reply.content if block.type == "text")


def episode(base_url: str, run_token: str, question: str = "What is the capital of Japan?") -> dict:
    """One rollout: open it, run the agent, finish it with reward 1 if the answer says Tokyo. Returns the
    rollout as the finish call reports it (status, reward, turns recorded) and the agent's final answer."""
    with httpx.Client(base_url=base_url, headers={"authorization": f"Bearer {run_token}"}, timeout=120) as lifecycle:
        opened = lifecycle.post("/rollouts", json={"task": question, "metadata": {"agent": "anthropic"}}).raise_for_status().json()
        client = anthropic.Anthropic(base_url=base_url, api_key=opened["api_key"], max_retries=0)
        try:
            answer = agent(client, question)
        except Exception:
            lifecycle.post(f"/rollouts/{opened['rollout_id']}/abort", json={"reason": "agent failed"})
            raise
        reward = float("tokyo" in answer.lower())
        info = lifecycle.post(f"/rollouts/{opened['rollout_id']}/finish", json={"reward": reward}).raise_for_status().json()
    return {"rollout": info, "answer": answer}


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python docs/examples/agent_anthropic.py URL RUN_TOKEN")
    print(json.dumps(episode(sys.argv[1], sys.argv[2]), indent=2))
