"""The gateway's wire format: the subset of the OpenAI API agents use, the rollout lifecycle, the
token-level endpoint and engine registration, as pydantic models (they are the OpenAPI schema too).

OpenAI request models allow unknown fields: clients send many optional ones (`user`, `metadata`,
`parallel_tool_calls`, ...) that change nothing about sampling. Options that would change the
sampled distribution without the gateway knowing are refused where they are checked (`service`).
Message and tool shapes are checked here only loosely; `toolcalls.to_template_messages` checks them
fully and says exactly what is wrong.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, Literal

import httpx
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from asyncrl.records import FINISH_STATUSES, MAX_SCORE_SEQUENCES

from .registry import MAX_CAPACITY

_INT64_MAX = 2**63 - 1


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class _Closed(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ToolCallFunction(_Open):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(_Open):
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class SamplingFields(_Open):
    """Sampling options shared by chat and text completions (OpenAI names, plus vLLM's top_k and
    stop_token_ids). Unset options take `rollout.sampling`'s defaults; with gateway.sampling_overrides
    refuse (the default), a temperature, top_p or top_k other than those is a 400. The turn records them."""

    model: str | None = None
    temperature: float | None = Field(None, ge=0.0, le=100.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, le=2**31)
    max_tokens: int | None = Field(None, ge=1, le=2**31)
    seed: int | None = Field(None, ge=0, le=_INT64_MAX)
    stop: str | list[str] | None = None
    """Stop strings; each must be a single token (use stop_token_ids otherwise)."""
    stop_token_ids: list[int] | None = None
    n: int | None = Field(None, ge=1, le=2**31)
    stream: bool | None = None
    """Server-sent events in OpenAI's chunk format (`streaming`); the turn is recorded as without it."""
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None


class StreamOptions(_Open):
    include_usage: bool | None = None
    """Send a last chunk with the usage (and no choices) before `data: [DONE]`."""


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    chat_template_kwargs: dict[str, Any] | None = None
    """Passed to the chat template as variables (vLLM's name): e.g. {"enable_thinking": false}."""
    reasoning_effort: str | None = Field(None, max_length=64)
    """Passed to the chat template as `reasoning_effort` (templates that read it switch thinking with it)."""
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_completion_tokens: int | None = Field(None, ge=1, le=2**31)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    """One prompt: text, or token ids (a list of several prompts is refused)."""
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool | None = None
    suffix: str | None = None


class TokenGenerateRequest(_Closed):
    """Token ids in, token ids out, for rollout code that keeps its own tokens."""

    prompt_token_ids: list[int] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=2**31)
    temperature: float | None = Field(None, ge=0.0, le=100.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, le=2**31)
    seed: int | None = Field(None, ge=0, le=_INT64_MAX)
    stop_token_ids: list[int] | None = None


class TokenGenerateResponse(_Closed):
    rollout_id: str
    turn_index: int
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    engine_id: str
    kv_versions: list[int] | None = None
    """Per token, the oldest policy version among the KV it attended to; None where the engine records none."""


class TokenScoreRequest(_Closed):
    """Token sequences in, the log-prob of every token given the ones before it out: prefill only,
    nothing sampled or recorded, so no rollout key. Empty sequences and ids outside the vocabulary
    are refused by the engine (a 400 with its message)."""

    sequences: list[list[int]] = Field(min_length=1, max_length=MAX_SCORE_SEQUENCES)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    """Log-probs under softmax(logits / temperature); 0 means 1, as for greedy sampled tokens."""


class TokenScoreResponse(_Closed):
    logprobs: list[list[float]]
    """Per sequence, aligned with its tokens; entry 0 is 0.0 (nothing predicts the first token)."""
    engine_id: str
    version: int
    """Policy version of the weights that scored."""


class OpenRolloutRequest(_Closed):
    task: str = Field("", max_length=4096)
    group_id: str = Field("", max_length=4096)
    """Rollouts of the same prompt that the learner compares (a GRPO group)."""
    metadata: dict[str, Any] = Field(default_factory=dict)
    evaluation: bool = False
    """An evaluation rollout (held-out evaluation): every call is sampled greedily (temperature 0,
    whatever the request asks) and nothing is recorded; its state lives in the gateway's memory
    until it is finished or aborted, and it never reaches the learner or the ledger."""
    sampled: bool = False
    """With `evaluation`: its calls are sampled as they ask instead of greedily (pass@k over n samples)."""

    @model_validator(mode="after")
    def _sampled_evaluation(self) -> OpenRolloutRequest:
        if self.sampled and not self.evaluation:
            raise ValueError(
                "sampled applies to evaluation rollouts only (set evaluation: true); a recorded rollout samples as its calls ask"
            )
        return self


class OpenRolloutResponse(_Closed):
    rollout_id: str
    api_key: str
    """Send as `Authorization: Bearer <api_key>` with OpenAI calls; it identifies the rollout."""
    base_url: str | None = None
    """The OpenAI base URL of the gateway replica that serves this rollout (`gateway.replica_id`); None: this gateway's."""


class FinishRolloutRequest(_Closed):
    reward: float = Field(allow_inf_nan=False)
    status: Literal[FINISH_STATUSES] = "ok"  # type: ignore[valid-type]
    metrics: dict[str, Any] = Field(default_factory=dict)
    reason: str = Field("", max_length=65536)


class AbortRolloutRequest(_Closed):
    reason: str = Field("", max_length=65536)


class RolloutInfo(_Closed):
    rollout_id: str
    task: str
    group_id: str
    metadata: dict[str, Any]
    status: str
    reward: float | None
    metrics: dict[str, Any]
    reason: str
    turns: int
    in_flight: int
    """Generation requests of this rollout running now on this gateway."""


MAX_HEALTH_BYTES = 16384
"""Largest health report an engine may send (as JSON); /health shows them all."""
ENGINE_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"


def _bounded_health(health: dict[str, Any]) -> dict[str, Any]:
    size = len(json.dumps(health, default=str))
    if size > MAX_HEALTH_BYTES:
        raise ValueError(f"the health report is {size} bytes as JSON; at most {MAX_HEALTH_BYTES}")
    return health


def _engine_address(address: str) -> str:
    if address.startswith("ray:"):
        return address
    if not address.startswith(("http://", "https://")):
        raise ValueError(f"engine address must start with http://, https:// or ray:, got {address[:64]!r}")
    try:
        host = httpx.URL(address).host
    except httpx.InvalidURL as error:
        raise ValueError(f"engine address is not a URL: {error}") from None
    if not host:
        raise ValueError("engine address has no host")
    return address


Health = Annotated[dict[str, Any], Field(default_factory=dict, max_length=64), AfterValidator(_bounded_health)]
Lease = Annotated[str, Field(min_length=1, max_length=128)]


class RegisterEngineRequest(_Closed):
    """Needs the engine token. A new engine_id is registered to the caller, who gets its lease; a live id
    can be registered again (new address, capacity) only with that lease (409 otherwise)."""

    engine_id: str = Field(pattern=ENGINE_ID_PATTERN)
    """1-128 characters: letters, digits, `.`, `_`, `:`, `-`; starts with a letter or digit."""
    address: Annotated[str, Field(min_length=1, max_length=512), AfterValidator(_engine_address)]
    """`http(s)://host:port` of an `engine_app`, or `ray:[NAMESPACE/]ACTOR` for a named RolloutWorker."""
    capacity: float = Field(1.0, gt=0.0, le=MAX_CAPACITY)
    health: Health
    lease: Lease | None = None
    """The lease an earlier registration of this engine_id returned, to update it while it is alive."""


class RegisterEngineResponse(_Closed):
    registered: bool
    lease: str
    """The secret that proves this engine holds its id: send it with every heartbeat, re-registration and
    deregistration. Valid until the engine leaves or expires."""


class HeartbeatRequest(_Closed):
    lease: Lease
    """The lease POST /engines/register returned."""
    health: Health


class HeartbeatResponse(_Closed):
    registered: bool
    """False: the gateway dropped this engine (missed heartbeats); register again."""


class DeregisterEngineRequest(_Closed):
    lease: Lease


class DeregisterEngineResponse(_Closed):
    deregistered: bool
    """False: the engine was not registered (it had expired, or left already)."""


class ErrorBody(_Closed):
    message: str
    type: str
    code: str
    param: str | None = None


class ErrorResponse(_Closed):
    """Every refusal, in the OpenAI error shape the `openai` client reads."""

    error: ErrorBody


def _envelope(kind, model, choice, result, prompt_tokens, reused, rollout_id, index, branch, evaluation) -> dict:
    """The fields every completion shares, plus an `asyncrl` field saying where the turn was recorded
    (`evaluation: true`: an evaluation rollout's turn, sampled greedily and recorded nowhere)."""
    completion_tokens = len(result.token_ids)
    where = {"rollout_id": rollout_id, "turn_index": index, "branch": branch, "engine_id": result.engine_id}
    return {
        "id": f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{rollout_id}-{index}",
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": reused},
        },
        "asyncrl": {**where, "evaluation": True} if evaluation else where,
    }


def chat_response(
    model, rollout_id, index, branch, message, finish_reason, result, prompt_tokens, reused, logprobs, evaluation=False
) -> dict:
    """An OpenAI `chat.completion`."""
    choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": None}
    if logprobs is not None:
        choice["logprobs"] = {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []} for t, lp in logprobs]}
    return _envelope("chat.completion", model, choice, result, prompt_tokens, reused, rollout_id, index, branch, evaluation)


def completion_response(model, rollout_id, index, text, result, prompt_tokens, reused, logprobs, evaluation=False) -> dict:
    """An OpenAI `text_completion`; a stop token other than EOS stays in `text` (it was sampled)."""
    choice: dict[str, Any] = {"index": 0, "text": text, "finish_reason": result.finish_reason, "logprobs": None}
    if logprobs is not None:
        offsets, at = [], 0
        for token, _ in logprobs:
            offsets.append(at)
            at += len(token)
        choice["logprobs"] = {
            "tokens": [t for t, _ in logprobs],
            "token_logprobs": [lp for _, lp in logprobs],
            "top_logprobs": None,
            "text_offset": offsets,
        }
    return _envelope("text_completion", model, choice, result, prompt_tokens, reused, rollout_id, index, 0, evaluation)
