"""The Anthropic Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) on the chat path.

A Messages request is translated into the chat completion it means (`to_chat`) and runs as one
(`service.begin_chat` / `stream` / `end_chat`), so its turn is recorded exactly as that chat completion's
would be; the reply is translated back into Anthropic's content blocks (`message`), or streamed as its
events (`anthropic_stream`). The translation:

- `system` (a string, or text blocks) -> a system message first; a `system` message inside `messages`
  (Claude Code's mid-conversation system messages) -> a system message in place; text blocks are
  concatenated as the chat route joins text parts, and `cache_control` (it moves between turns) is ignored;
- a user message's `tool_result` blocks -> tool messages (their content a string, or text blocks), then
  its text blocks -> a user message (`is_error` is checked, not rendered: the result's text says what failed);
- an assistant message's `thinking` -> `reasoning_content`, text -> content, `tool_use` -> tool calls
  (`input` as the arguments);
- `tools` (`input_schema`) -> function tools; `tool_choice` auto / none (any / tool force a tool: refused,
  as on the chat route); `stop_sequences` -> stop; `thinking: {type: enabled | disabled}` ->
  `chat_template_kwargs.enable_thinking` where the chat template reads that variable.

Tool ids go out as `toolu_<hex>`. Each `tool_result` must answer a `tool_use` of the assistant message
just before it and every such `tool_use` must be answered, as Anthropic requires; a request that breaks
this, or sends a block the policy cannot read (images, documents, server tools), is a 400 naming the field.
A last assistant message (a prefilled reply) is refused: the chat path always starts a new assistant turn.
Stop sequences are single tokens, and the one that stopped the reply stays in its text (as on the chat
route: the agent echoes what was sampled); `stop_reason` is then `stop_sequence`.
"""

from __future__ import annotations

import json
import secrets
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from . import api
from .errors import bad_request
from .toolcalls import ParsedCompletion

MAX_SEQUENCES = 64


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class Message(_Open):
    role: Literal["user", "assistant", "system"]
    """`system`: a system message in the middle of the conversation (Claude Code sends them), rendered in place."""
    content: str | list[dict[str, Any]]


class CountTokensRequest(_Open):
    """What a Messages call would render (its token count needs no sampling options)."""

    model: str | None = Field(None, max_length=256)
    messages: list[Message] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest):
    """An Anthropic Messages call; unknown fields (`metadata`, `service_tier`, betas' fields) change nothing sampled."""

    max_tokens: int = Field(ge=1, le=2**31)
    """Above gateway.max_tokens, or past what the context leaves, it is cut to fit (gateway.max_tokens_fit clamp) or refused."""
    stop_sequences: list[str] | None = Field(None, max_length=MAX_SEQUENCES)
    stream: bool | None = None
    temperature: float | None = Field(None, ge=0.0, le=100.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, le=2**31)
    metadata: dict[str, Any] | None = None
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    """Not Anthropic's: this gateway's extension, as on the chat route (send it with the SDK's `extra_body`)."""


class CountTokensResponse(BaseModel):
    input_tokens: int


def _text_of(blocks: Any, where: str) -> str:
    """A string, or text blocks, concatenated (as the chat route joins text parts); their cache_control is not rendered."""
    if isinstance(blocks, str):
        return blocks
    if blocks is None:
        return ""
    if not isinstance(blocks, list):
        raise bad_request(f"{where} must be a string or a list of text blocks")
    texts = []
    for j, block in enumerate(blocks):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise bad_request(f"{where}[{j}]: only text blocks are supported here (got {kind!r})")
        texts.append(block["text"])
    return "".join(texts)


def _blocks(message: Message, where: str) -> list[dict]:
    if isinstance(message.content, str):
        return [{"type": "text", "text": message.content}]
    for j, block in enumerate(message.content):
        if not isinstance(block.get("type"), str):
            raise bad_request(f"{where}.content[{j}].type is missing")
    return message.content


def _required(block: dict, name: str, kind: type, where: str) -> Any:
    value = block.get(name)
    if not isinstance(value, kind) or (kind is str and not value):
        raise bad_request(f"{where}.{name} must be a {'non-empty string' if kind is str else kind.__name__}")
    return value


def _string(block: dict, name: str, where: str) -> str:
    if not isinstance(block.get(name), str):
        raise bad_request(f"{where}.{name} must be a string")
    return block[name]


def _assistant(message: Message, where: str) -> tuple[dict, list[str]]:
    """(the chat message, its tool_use ids)."""
    text, thinking, calls, ids = [], [], [], []
    for j, block in enumerate(_blocks(message, where)):
        at, kind = f"{where}.content[{j}]", block["type"]
        if kind == "text":
            text.append(_string(block, "text", at))
        elif kind == "thinking":
            thinking.append(_string(block, "thinking", at))
        elif kind == "tool_use":
            call_id, name = _required(block, "id", str, at), _required(block, "name", str, at)
            arguments = _required(block, "input", dict, at)
            if call_id in ids:
                raise bad_request(f"{at}.id {call_id!r} is used twice in this message")
            ids.append(call_id)
            calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
        else:
            raise bad_request(f"{at}: {kind!r} blocks are not supported in assistant messages (text, thinking, tool_use)")
    chat: dict[str, Any] = {"role": "assistant", "content": "".join(text) or (None if calls else "")}
    if calls:
        chat["tool_calls"] = calls
    if thinking:
        chat["reasoning_content"] = "".join(thinking)
    return chat, ids


def _user(message: Message, where: str, expected: list[str], previous: str) -> list[dict]:
    """The tool messages and the user message of one user turn; `expected`: the tool_use ids it must answer."""
    results, texts, answered = [], [], set()
    for j, block in enumerate(_blocks(message, where)):
        at, kind = f"{where}.content[{j}]", block["type"]
        if kind == "text":
            texts.append(_string(block, "text", at))
        elif kind == "tool_result":
            call_id = _required(block, "tool_use_id", str, at)
            if call_id not in expected:
                raise bad_request(f"{at}.tool_use_id {call_id!r} matches no tool_use block of {previous}")
            if call_id in answered:
                raise bad_request(f"{at}.tool_use_id {call_id!r} is answered twice")
            answered.add(call_id)
            is_error = block.get("is_error")
            if is_error is not None and not isinstance(is_error, bool):
                raise bad_request(f"{at}.is_error must be a boolean")
            results.append({"role": "tool", "tool_call_id": call_id, "content": _text_of(block.get("content"), f"{at}.content")})
        else:
            raise bad_request(f"{at}: {kind!r} blocks are not supported (text and tool_result only; the policy reads text)")
    missing = [i for i in expected if i not in answered]
    if missing:
        raise bad_request(f"{where}: tool_use ids {missing} of {previous} have no tool_result block here; every tool_use needs its result")
    user = [{"role": "user", "content": "".join(texts)}] if texts else []
    return results + user


def _tools(tools: list[dict[str, Any]] | None) -> list[dict] | None:
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if tool.get("type") not in (None, "custom"):
            kind = tool.get("type")
            raise bad_request(f"{where}.type {kind!r}: server tools are not supported (define the tool with name and input_schema)")
        function: dict[str, Any] = {"name": _required(tool, "name", str, where), "parameters": _required(tool, "input_schema", dict, where)}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: dict[str, Any] | None) -> str | None:
    kind = (choice or {}).get("type", "auto")
    if kind in ("auto", "none"):
        return kind
    if kind in ("any", "tool"):
        raise bad_request(f"tool_choice.type {kind!r} forces a tool, which is not supported (the policy decides); use auto or none")
    raise bad_request(f"tool_choice.type must be auto, none, any or tool, got {kind!r}")


def _thinking(thinking: dict[str, Any] | None, template_reads_thinking: bool) -> dict[str, Any] | None:
    if thinking is None:
        return None
    kind = thinking.get("type")
    if kind not in ("enabled", "disabled", "adaptive"):
        raise bad_request(f"thinking.type must be enabled, disabled or adaptive, got {kind!r}")
    if kind == "adaptive" or not template_reads_thinking:
        return None  # the model decides, or the template has no switch to pass it to
    return {"enable_thinking": kind == "enabled"}


def to_chat(request: CountTokensRequest, reads_thinking: bool) -> api.ChatCompletionRequest:
    """The chat completion a Messages request means."""
    messages: list[dict] = []
    answered_by = ""
    system = _text_of(request.system, "system")
    if system:
        messages.append({"role": "system", "content": system})
    expected: list[str] = []
    for i, message in enumerate(request.messages):
        where = f"messages[{i}]"
        if message.role == "system":  # in place, so that a later turn's prompt extends this one's
            messages.append({"role": "system", "content": _text_of(message.content, f"{where}.content")})
        elif message.role == "assistant":
            if expected:
                raise bad_request(f"{where}: the tool_use ids {expected} before it have no tool_result blocks in a user message")
            chat, expected = _assistant(message, where)
            answered_by = where
            messages.append(chat)
        else:
            messages += _user(message, where, expected, answered_by if expected else "the messages before it, which have none")
            expected = []
    if request.messages[-1].role == "assistant":
        last = len(request.messages) - 1
        raise bad_request(f"messages[{last}]: the last message is an assistant message (prefilling a reply is not supported)")
    fields: dict[str, Any] = {
        "model": request.model, "messages": messages, "tools": _tools(request.tools), "tool_choice": _tool_choice(request.tool_choice),
        "chat_template_kwargs": _thinking(request.thinking, reads_thinking),
    }  # fmt: skip
    if isinstance(request, MessagesRequest):
        fields.update(
            max_tokens=request.max_tokens, stop=request.stop_sequences, temperature=request.temperature, top_p=request.top_p,
            top_k=request.top_k, seed=request.seed,
        )  # fmt: skip
    try:
        return api.ChatCompletionRequest.model_validate(fields)
    except ValidationError as error:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in error.errors(include_url=False)[:5])
        raise bad_request(f"the request does not translate to a chat completion: {problems}") from None


def tool_id(call_id: str) -> str:
    """Anthropic's spelling of a tool-call id (`call_<hex>` -> `toolu_<hex>`)."""
    return "toolu_" + call_id.removeprefix("call_")


def stop_reason(parsed: ParsedCompletion, finish_reason: str, token_ids: list[int], stops: dict[int, str]) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence); `stops`: the request's stop sequences by token id."""
    if finish_reason == "length":
        return "max_tokens", None
    if parsed.tool_calls and finish_reason == "stop":
        return "tool_use", None
    if finish_reason == "stop" and token_ids and token_ids[-1] in stops:
        return "stop_sequence", stops[token_ids[-1]]
    return "end_turn", None


def tool_use(call: dict) -> dict:
    function = call["function"]
    return {"type": "tool_use", "id": tool_id(call["id"]), "name": function["name"], "input": json.loads(function["arguments"])}


def message(model: str, parsed: ParsedCompletion, reason: tuple[str, str | None], usage: dict, record: dict) -> dict:
    """An Anthropic `message`, with the `asyncrl` record of where the turn was recorded."""
    content: list[dict] = []
    if parsed.reasoning_content is not None:
        content.append({"type": "thinking", "thinking": parsed.reasoning_content, "signature": ""})
    if parsed.content or not parsed.tool_calls:
        content.append({"type": "text", "text": parsed.content or ""})
    content += [tool_use(call) for call in parsed.tool_calls]
    return {
        "id": new_message_id(), "type": "message", "role": "assistant", "model": model, "content": content,
        "stop_reason": reason[0], "stop_sequence": reason[1], "usage": usage, "asyncrl": record,
    }  # fmt: skip


def new_message_id() -> str:
    return f"msg_{secrets.token_hex(12)}"


def usage(input_tokens: int, output_tokens: int) -> dict:
    return {"input_tokens": input_tokens, "output_tokens": output_tokens, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}


ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
               409: "conflict_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
               504: "timeout_error"}  # fmt: skip


def error_body(status: int, message: str) -> dict:
    """Anthropic's error shape (the `anthropic` client reads `error.type` and `error.message`)."""
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}
