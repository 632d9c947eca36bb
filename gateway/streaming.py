"""`stream: true`: server-sent events in the OpenAI wire format, and the ASGI response that sends them.

A chat stream is `chat.completion.chunk`s: the assistant role first, then content (and, with
gateway.reasoning_parser, `reasoning_content`) as it is sampled (`replystream`), then the tool calls
whole once the reply is parsed, a chunk with the finish reason and the `asyncrl` record (rollout, turn
index, branch, engine), with `stream_options.include_usage` a usage chunk, and `data: [DONE]`. A text
completion stream is `text_completion` chunks the same way. The turn is recorded as the same call
without `stream` would record it (`service.end_chat` / `end_text`), before the finish chunk is sent.

`EventStream` sends its first event's headers only when that event is ready: a call refused before
anything was sampled (no engine, prompt too long) is answered with its HTTP status and error body, as
without `stream`. Later failures become an error event. A client that disconnects is noticed at once,
even while the engine has nothing new: the stream's task is cancelled, which aborts the engine request
and records the turn truncated (`service.stream`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any

from asyncrl.records import GenerationResult, TokenDelta

from . import api
from .errors import GatewayError
from .replystream import IncrementalDecoder, ReplyStream
from .service import GatewayService
from .turns import ChatTurn, TextTurn

log = logging.getLogger(__name__)

SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
DONE = b"data: [DONE]\n\n"
_FIELDS = {"reasoning": "reasoning_content", "content": "content"}
_SLOT = "\x00slot\x00"
"""A stand-in text whose encoding occurs once in a chunk: where a text delta's text goes."""


def encode(data: Any) -> bytes:
    return json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode()


def data_event(data: Any) -> bytes:
    return b"data: " + encode(data) + b"\n\n"


class EventStream:
    """An ASGI response of server-sent events from `events` (bytes, each one or more whole events).

    An exception before the first event propagates (the app's handlers answer it, nothing was sent);
    after it, `error_event(exception)` is sent and the stream ends. `on_unstarted` runs when the stream
    ends before `events` was ever pulled (the client left at once), for what `events` would have released."""

    def __init__(
        self, events: AsyncGenerator[bytes, None], error_event: Callable[[BaseException], bytes], on_unstarted: Callable[[], None]
    ) -> None:
        self.events, self.error_event, self.on_unstarted = events, error_event, on_unstarted
        self._pulled = False

    async def __call__(self, scope, receive, send) -> None:
        pump = asyncio.ensure_future(self._pump(send))
        listener = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait((pump, listener), return_when=asyncio.FIRST_COMPLETED)
        finally:
            listener.cancel()
            if not pump.done():
                pump.cancel()  # the client left: cancelling the stream aborts the engine request
            await asyncio.gather(pump, listener, return_exceptions=True)
            if not self._pulled:
                self.on_unstarted()
        if not pump.cancelled() and pump.exception() is not None:
            raise pump.exception()  # type: ignore[misc]  # before the first event: answered as an HTTP error

    async def _pump(self, send) -> None:
        started = False
        try:
            async with contextlib.aclosing(self.events) as events:
                self._pulled = True
                async for chunk in events:
                    if not started:
                        started = True
                        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except Exception as error:
            if not started:
                raise
            if isinstance(error, OSError):
                return  # the client is gone (a send failed): nobody to tell; the stream was closed, its turn kept
            if not _is_refusal(error):
                log.exception("a stream failed after it started")
            with contextlib.suppress(OSError):
                await send({"type": "http.response.body", "body": self.error_event(error), "more_body": True})
        if started:
            with contextlib.suppress(OSError):
                await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _is_refusal(error: BaseException) -> bool:
    return isinstance(error, GatewayError) and error.status < 500


class ChatChunks:
    """The `chat.completion.chunk`s of one streamed chat call."""

    def __init__(self, model: str, rollout_id: str) -> None:
        self.id, self.model, self.created = f"chatcmpl-{rollout_id}-{secrets.token_hex(6)}", model, int(time.time())
        # A text delta is most of a stream's chunks: its bytes around the text are the same every time, so they
        # are encoded once (`text`), byte for byte what `chunk` writes.
        self._text_frames: dict[str, tuple[bytes, bytes]] = {}
        for name in _FIELDS.values():
            head, _, tail = self.chunk({name: _SLOT}).partition(encode(_SLOT))
            self._text_frames[name] = (head, tail)

    def chunk(self, delta: dict, finish_reason: str | None = None, logprobs: dict | None = None, **extra: Any) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return data_event({"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                           "choices": [choice], **extra})  # fmt: skip

    def text(self, field: str, text: str) -> bytes:
        """`chunk({field: text})`: a content or reasoning_content delta."""
        head, tail = self._text_frames[field]
        return head + encode(text) + tail

    def usage(self, usage: dict) -> bytes:
        return data_event({"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                           "choices": [], "usage": usage})  # fmt: skip


def usage(prompt_tokens: int, completion_tokens: int, reused: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": reused},
    }  # fmt: skip


def record_of(turn: ChatTurn | TextTurn, index: int, branch: int, result: GenerationResult) -> dict:
    """The `asyncrl` field of a finish chunk: where the turn was recorded."""
    where = {"rollout_id": turn.rollout.id, "turn_index": index, "branch": branch, "engine_id": result.engine_id}
    return {**where, "evaluation": True} if turn.rollout.evaluation is not None else where


async def ended(service: GatewayService, coroutine) -> Any:
    """Finish recording a turn even if the client leaves meanwhile (the stream's task is then cancelled)."""
    return await asyncio.shield(service.background.start(coroutine))


def token_logprobs(service: GatewayService, delta: TokenDelta) -> dict:
    content = []
    for token, logprob in zip(delta.token_ids, delta.logprobs, strict=True):
        text = service.tokenizer.decode([token], skip_special_tokens=False)
        content.append({"token": text, "logprob": logprob, "bytes": list(text.encode()), "top_logprobs": []})
    return {"content": content}


async def chat_events(service: GatewayService, turn: ChatTurn, request: api.ChatCompletionRequest) -> AsyncGenerator[bytes, None]:
    chunks = ChatChunks(service.model_name, turn.rollout.id)
    reply = ReplyStream(service.tokenizer, service.tool_parser, service.reasoning_parser, turn.prompt_token_ids)
    result: GenerationResult | None = None
    # Nothing is yielded before the engine's first answer: a call refused at the start is an HTTP error.
    # What one engine item produces goes out as one write (the role chunk with the first one's text).
    pending = [chunks.chunk({"role": "assistant", "content": ""})]
    async with contextlib.aclosing(service.stream(turn)) as stream:
        async for item in stream:
            if isinstance(item, GenerationResult):
                result = item
                continue
            deltas = reply.feed(item.token_ids)
            if request.logprobs:
                logprobs = token_logprobs(service, item)
                if not deltas:
                    pending.append(chunks.chunk({"content": ""}, logprobs=logprobs))
                for i, (name, text) in enumerate(deltas):
                    pending.append(chunks.chunk({_FIELDS[name]: text}, logprobs=logprobs if i == 0 else None))
            else:
                pending += [chunks.text(_FIELDS[name], text) for name, text in deltas]
            if pending:
                yield b"".join(pending)
                pending = []
    assert result is not None
    index, branch, parsed = await ended(service, service.end_chat(turn, result, dict(result.timings)))
    pending += [chunks.text(_FIELDS[name], text) for name, text in reply.finish(parsed)]
    pending += [chunks.chunk({"tool_calls": [{"index": i, **call}]}) for i, call in enumerate(parsed.tool_calls)]
    finish = parsed.finish_reason(result.finish_reason)
    pending.append(chunks.chunk({}, finish, asyncrl=record_of(turn, index, branch, result)))
    if request.stream_options is not None and request.stream_options.include_usage:
        pending.append(chunks.usage(usage(len(turn.prompt_token_ids), len(result.token_ids), turn.reused_tokens)))
    yield b"".join([*pending, DONE])


async def completion_events(service: GatewayService, turn: TextTurn, request: api.CompletionRequest) -> AsyncGenerator[bytes, None]:
    completion_id, created = f"cmpl-{turn.rollout.id}-{secrets.token_hex(6)}", int(time.time())
    eos = getattr(service.tokenizer, "eos_token_id", None)
    decoder = IncrementalDecoder(service.tokenizer, [eos] if isinstance(eos, int) else [])
    sent = ""

    def chunk(text: str, finish_reason: str | None = None, **extra: Any) -> bytes:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return data_event({"id": completion_id, "object": "text_completion", "created": created, "model": service.model_name,
                           "choices": [choice], **extra})  # fmt: skip

    result: GenerationResult | None = None
    async with contextlib.aclosing(service.stream(turn)) as stream:
        async for item in stream:
            if isinstance(item, GenerationResult):
                result = item
                continue
            text = decoder.feed(item.token_ids)
            if text:
                sent += text
                yield chunk(text)
    assert result is not None
    index, completion = await ended(service, service.end_text(turn, result, dict(result.timings)))
    rest = completion[len(sent) :] if completion.startswith(sent) else ""
    if rest:
        yield chunk(rest)
    yield chunk("", result.finish_reason, asyncrl=record_of(turn, index, 0, result))
    if request.stream_options is not None and request.stream_options.include_usage:
        counts = usage(len(turn.prompt_token_ids), len(result.token_ids), turn.reused_tokens)
        yield data_event({"id": completion_id, "object": "text_completion", "created": created, "model": service.model_name,
                          "choices": [], "usage": counts})  # fmt: skip
    yield DONE


def openai_error_event(classify: Callable[[BaseException], tuple[int, str, str]]) -> Callable[[BaseException], bytes]:
    """The error event of an OpenAI stream (the `openai` client raises it as an APIError)."""

    def event(error: BaseException) -> bytes:
        status, code, message = classify(error)
        kind = "invalid_request_error" if status < 500 else "server_error"
        return data_event({"error": {"message": message, "type": kind, "code": code, "param": None}}) + DONE

    return event
