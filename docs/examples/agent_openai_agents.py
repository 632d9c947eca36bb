"""An agent on the OpenAI Agents SDK, trained through asyncrl: one episode against `asyncrl serve` (docs/AGENTS.md).

    python docs/examples/agent_openai_agents.py URL RUN_TOKEN

The agent is the SDK's own: an `Agent` with a function tool, run by `Runner` on the chat-completions model
class (`OpenAIChatCompletionsModel`) over an `AsyncOpenAI` client whose base URL is the gateway and whose
key is the rollout's. Nothing in the agent knows about asyncrl; the episode around it opens the rollout,
runs the agent and finishes the rollout with a reward. Tracing is off: it would upload to OpenAI.
"""

from __future__ import annotations

import asyncio
import json
import sys

import httpx
from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, RunConfig, Runner, function_tool
from openai import AsyncOpenAI


@function_tool
def lookup_capital(country: str) -> str:
    """The capital city of a country."""
    return {"france": "Paris", "japan": "Tokyo"}.get(country.lower(), "unknown")


def build_agent(base_url: str, api_key: str) -> Agent:
    client = AsyncOpenAI(base_url=base_url + "/v1", api_key=api_key, max_retries=0)
    model = OpenAIChatCompletionsModel(model="policy", openai_client=client)
    return Agent(
        name="geographer",
        instructions="Answer with the capital of the country asked about. Use lookup_capital.",
        tools=[lookup_capital],
        model=model,
        model_settings=ModelSettings(max_tokens=64),
    )


async def episode(base_url: str, run_token: str, question: str = "What is the capital of France?") -> dict:
    """One rollout: open it, run the agent, finish it with reward 1 if the answer says Paris. Returns the
    rollout as the finish call reports it (status, reward, turns recorded) and the agent's final answer."""
    headers = {"authorization": f"Bearer {run_token}"}
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=120) as lifecycle:
        opened = await lifecycle.post("/rollouts", json={"task": question, "metadata": {"agent": "openai-agents"}})
        rollout_id, api_key = opened.raise_for_status().json()["rollout_id"], opened.json()["api_key"]
        try:
            result = await Runner.run(build_agent(base_url, api_key), question, max_turns=4, run_config=RunConfig(tracing_disabled=True))
        except Exception:
            await lifecycle.post(f"/rollouts/{rollout_id}/abort", json={"reason": "agent failed"})
            raise
        answer = str(result.final_output)
        finished = await lifecycle.post(f"/rollouts/{rollout_id}/finish", json={"reward": float("paris" in answer.lower())})
        info = finished.raise_for_status().json()
    return {"rollout": info, "answer": answer}


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python docs/examples/agent_openai_agents.py URL RUN_TOKEN")
    print(json.dumps(asyncio.run(episode(sys.argv[1], sys.argv[2])), indent=2))
