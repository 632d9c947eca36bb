"""A turn between its prompt and its record (`ChatTurn`, `TextTurn`), and how its exact prompt is made.

Text is text (`template`): message content, tool results, tool-call arguments and text prompts are
encoded as plain tokens, markers come only from the chat template; a `/v1/completions` text prompt is
raw text too (send token ids for a prompt with special tokens).

Bounded work before validation: every message's characters (and a text prompt's) are checked against
`gateway.max_message_chars` before anything is rendered or tokenized, and a prompt with more than
OFFLOAD_CHARS characters of new text is rendered and tokenized on a worker thread (`offload`), so one big request
does not hold up the others' event loop. A rollout's conversation is prepared and committed under
its own lock (uncontended, it does not yield), so the thread never races a commit.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from asyncrl.records import SamplingParams

from . import api
from .budget import Reservation
from .conversation import Conversation, ConversationError, Draft, Prepared
from .errors import bad_request
from .offload import CpuWorkers
from .rollouts import Rollout
from .template import TokenizerTemplate
from .toolcalls import REASONING_FIELDS, MessageError

TEXT_HISTORY = 8
"""Text-completion turns per rollout whose exact tokens a later prompt may reuse."""
OFFLOAD_CHARS = 8192
"""New prompt text (characters) above which rendering and tokenizing run on a worker thread: encoding
takes ~0.4 µs a character on a busy core, so this keeps the event loop's stalls to a few ms."""
OFFLOAD_RENDER_CHARS = 32 * OFFLOAD_CHARS
"""Conversation size (characters) above which even the render alone (every turn renders it all) goes to the thread."""


@dataclass(eq=False)
class _Turn:
    rollout: Rollout
    sampling: SamplingParams
    """What it samples with: the request's options, max_tokens fitted to the context (`SamplingPolicy.fit`)."""
    reservation: Reservation
    started: float
    """perf_counter() when the call arrived (the record's gateway_s counts from here)."""


@dataclass(eq=False)
class ChatTurn(_Turn):
    """A chat call between its prompt and its record: what the plain, streamed and Anthropic routes share."""

    prepared: Prepared | None = None
    tools: list | None = None

    @property
    def prompt_token_ids(self) -> list[int]:
        assert self.prepared is not None
        return self.prepared.prompt_token_ids

    @property
    def reused_tokens(self) -> int:
        assert self.prepared is not None
        return self.prepared.reused_tokens


@dataclass(eq=False)
class TextTurn(_Turn):
    """A text completion between its prompt and its record."""

    text: str | None = None
    """The prompt text (None: the prompt was token ids)."""
    prompt_token_ids: list[int] = field(default_factory=list)
    reused_tokens: int = 0


def check_chars(what: str, chars: int, max_chars: int) -> None:
    if chars > max_chars:
        raise bad_request(f"{what} has {chars} characters; gateway.max_message_chars is {max_chars}")


def request_messages(request: api.ChatCompletionRequest, max_chars: int) -> list[dict]:
    """A chat request's messages as the conversation takes them, each checked against gateway.max_message_chars."""
    messages = [m.model_dump(exclude_none=True) for m in request.messages]
    for i, message in enumerate(messages):
        check_chars(f"messages[{i}]", _message_chars(message), max_chars)
    return messages


async def draft(cpu: CpuWorkers, conversation: Conversation, messages: list[dict], tools: list | None, template_kwargs: dict) -> Draft:
    """The turn's prompt, rendered and tokenized on a worker thread when it is big (the caller holds the rollout's lock)."""
    plan = _refusing(conversation.plan, messages, tools, template_kwargs)
    if plan.new_chars > OFFLOAD_CHARS or plan.chars > OFFLOAD_RENDER_CHARS:
        return await cpu.run(_refusing, conversation.render, plan)
    return _refusing(conversation.render, plan)


async def text_prompt(
    cpu: CpuWorkers, template: TokenizerTemplate, rollout: Rollout, prompt: Any, max_chars: int
) -> tuple[str | None, list[int], int]:
    """(text or None, exact prompt tokens, tokens reused): a text prompt that extends an earlier
    turn's text reuses that turn's exact tokens and encodes only the rest, as plain text."""
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return None, list(prompt), 0
    if not isinstance(prompt, str):
        raise bad_request("prompt must be one string or one list of token ids (one prompt per request)")
    if not prompt:
        raise bad_request("prompt is empty")
    check_chars("prompt", len(prompt), max_chars)
    base_text, base = max(((t, ids) for t, ids in rollout.texts if prompt.startswith(t)), key=lambda e: len(e[0]), default=("", []))
    rest = prompt[len(base_text) :]
    if len(rest) > OFFLOAD_CHARS:
        return prompt, base + await cpu.run(template.encode_text, rest), len(base)
    return prompt, base + template.encode_text(rest), len(base)


def remember_text(rollout: Rollout, turn: TextTurn, completion_text: str, completion: list[int]) -> None:
    """Keep a text turn's text and exact tokens (prompt plus completion) for a later prompt that extends it."""
    if turn.text is not None:
        rollout.texts = ([*rollout.texts, (turn.text + completion_text, turn.prompt_token_ids + completion)])[-TEXT_HISTORY:]


def _refusing(step, *args):
    """A step of preparing the prompt; rendering problems are the request's fault, never a 500."""
    try:
        return step(*args)
    except (MessageError, ConversationError):
        raise
    except Exception as error:  # e.g. a template error on content the template cannot render
        raise bad_request(f"the messages cannot be rendered with the chat template: {type(error).__name__}: {error}") from None


def template_kwargs(request: api.ChatCompletionRequest) -> dict:
    """What the request asks of the chat template beyond the messages (thinking switches)."""
    kwargs = dict(request.chat_template_kwargs or {})
    if request.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", request.reasoning_effort)
    return kwargs


def _message_chars(message: dict) -> int:
    """Characters a request message (as dumped from the request) would have rendered: its text and tool calls."""
    content = message.get("content")
    if isinstance(content, str):
        size = len(content)
    else:
        size = sum(len(p["text"]) for p in content or () if isinstance(p, dict) and isinstance(p.get("text"), str))
    size += sum(len(message[name]) for name in REASONING_FIELDS if isinstance(message.get(name), str))
    for call in message.get("tool_calls") or ():
        function = call.get("function") or {}
        arguments = function.get("arguments")
        size += len(function.get("name") or "")
        if isinstance(arguments, str):
            size += len(arguments)
        elif isinstance(arguments, dict):
            size += sum(len(str(k)) + (len(v) if isinstance(v, str) else len(json.dumps(v))) for k, v in arguments.items())
    return size


def strip_eos(token_ids: list[int], tokenizer: Any) -> list[int]:
    eos = getattr(tokenizer, "eos_token_id", None)
    return token_ids[:-1] if token_ids and token_ids[-1] == eos else list(token_ids)
