"""The Messages calls themselves: a translated request through the chat path, answered whole or as
Anthropic's stream events (`message_start`, `ping`, per content block `content_block_start` /
`content_block_delta` (text_delta, thinking_delta, input_json_delta) / `content_block_stop`, then
`message_delta` with the stop reason and `message_stop`; a failure after the start is an `error` event).

Thinking and text stream as they are sampled (`replystream`); tool_use blocks are sent whole, each
input as one input_json_delta, once the reply is parsed and its turn recorded.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Callable
from typing import Any

from asyncrl.records import GenerationResult

from . import anthropic
from .replystream import ReplyStream
from .service import GatewayService
from .streaming import EventStream, encode, ended, record_of
from .turns import ChatTurn

_BLOCKS = {"reasoning": ("thinking", "thinking_delta", "thinking"), "content": ("text", "text_delta", "text")}


def event(kind: str, data: dict) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + encode({"type": kind, **data}) + b"\n\n"


def _reads_thinking(service: GatewayService) -> bool:
    """Whether the chat template reads `enable_thinking` (Qwen3's and GLM-4.5's do): the variables the
    template-kwargs check allows, so a mapped `thinking` is never refused by it."""
    return "enable_thinking" in service.template.variables


async def _begin(service: GatewayService, key: str | None, request: anthropic.MessagesRequest) -> tuple[ChatTurn, dict[int, str]]:
    chat = anthropic.to_chat(request, _reads_thinking(service))
    stops = {service.stop_token(text): text for text in request.stop_sequences or ()}
    return await service.begin_chat(key, chat), stops


async def create_message(service: GatewayService, key: str | None, request: anthropic.MessagesRequest, error_event) -> Any:
    """The reply as an Anthropic `message`, or (`stream`) an EventStream of its events."""
    turn, stops = await _begin(service, key, request)
    model = request.model or service.model_name
    if request.stream:
        return EventStream(_events(service, turn, model, stops), error_event, lambda: service.drop(turn))
    result, timings = await service.generate(turn)
    index, branch, parsed = await service.end_chat(turn, result, timings)
    reason = anthropic.stop_reason(parsed, result.finish_reason, result.token_ids, stops)
    usage = anthropic.usage(len(turn.prompt_token_ids), len(result.token_ids))
    return anthropic.message(model, parsed, reason, usage, record_of(turn, index, branch, result))


async def count_tokens(service: GatewayService, key: str | None, request: anthropic.CountTokensRequest) -> dict:
    chat = anthropic.to_chat(request, _reads_thinking(service))
    return {"input_tokens": await service.count_prompt_tokens(key, chat)}


class _Blocks:
    """Content blocks of a streamed message, opened and closed as the fields change."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None

    def switch(self, name: str) -> list[bytes]:
        if self.open == name:
            return []
        events = self.close()
        self.index += 1
        self.open = name
        kind = _BLOCKS[name][0]
        block = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else {"type": "text", "text": ""}
        return [*events, event("content_block_start", {"index": self.index, "content_block": block})]

    def delta(self, name: str, text: str) -> list[bytes]:
        _, delta_type, key = _BLOCKS[name]
        return [*self.switch(name), event("content_block_delta", {"index": self.index, "delta": {"type": delta_type, key: text}})]

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        events = []
        if self.open == "reasoning":  # clients keep a thinking block's signature; this gateway signs nothing
            events.append(event("content_block_delta", {"index": self.index, "delta": {"type": "signature_delta", "signature": ""}}))
        events.append(event("content_block_stop", {"index": self.index}))
        self.open = None
        return events

    def whole(self, block: dict, delta: dict) -> list[bytes]:
        events = self.close()
        self.index += 1
        events.append(event("content_block_start", {"index": self.index, "content_block": block}))
        events.append(event("content_block_delta", {"index": self.index, "delta": delta}))
        events.append(event("content_block_stop", {"index": self.index}))
        return events


async def _events(service: GatewayService, turn: ChatTurn, model: str, stops: dict[int, str]) -> AsyncGenerator[bytes, None]:
    reply = ReplyStream(service.tokenizer, service.tool_parser, service.reasoning_parser, turn.prompt_token_ids)
    blocks = _Blocks()
    message_id, first = anthropic.new_message_id(), True
    result: GenerationResult | None = None
    async with contextlib.aclosing(service.stream(turn)) as stream:
        async for item in stream:
            if first:  # after the engine's first answer: a call refused at the start is an HTTP error
                first = False
                start: dict[str, Any] = {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": [],
                         "stop_reason": None, "stop_sequence": None, "usage": anthropic.usage(len(turn.prompt_token_ids), 0)}  # fmt: skip
                yield event("message_start", {"message": start}) + event("ping", {})
            if isinstance(item, GenerationResult):
                result = item
                continue
            events = [e for name, text in reply.feed(item.token_ids) for e in blocks.delta(name, text)]
            if events:
                yield b"".join(events)
    assert result is not None
    index, branch, parsed = await ended(service, service.end_chat(turn, result, dict(result.timings)))
    events = [e for name, text in reply.finish(parsed) for e in blocks.delta(name, text)]
    if not parsed.tool_calls and blocks.index < 0:
        events += blocks.switch("content")  # an empty reply is one empty text block
    for call in parsed.tool_calls:
        use = anthropic.tool_use(call)
        events += blocks.whole({**use, "input": {}}, {"type": "input_json_delta", "partial_json": call["function"]["arguments"]})
    events += blocks.close()
    reason, sequence = anthropic.stop_reason(parsed, result.finish_reason, result.token_ids, stops)
    delta = {"delta": {"stop_reason": reason, "stop_sequence": sequence}, "usage": {"output_tokens": len(result.token_ids)}}
    events.append(event("message_delta", {**delta, "asyncrl": record_of(turn, index, branch, result)}))
    events.append(event("message_stop", {}))
    yield b"".join(events)


def error_event(classify: Callable[[BaseException], tuple[int, str, str]]) -> Callable[[BaseException], bytes]:
    """The `error` event of a Messages stream that failed after it started."""

    def make(error: BaseException) -> bytes:
        status, _, message = classify(error)
        body = anthropic.error_body(status, message)
        return event("error", {"error": body["error"]})

    return make
