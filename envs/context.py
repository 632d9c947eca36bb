"""Context management for agent loops: which part of an episode's history each model call sends.

Long-horizon agents outgrow their context. The GLM-5 report's long-horizon evaluations either keep
the most recent turns (keep-recent-k, k = 5) or, once the context passes a threshold, discard the
whole tool-call history and restart from the system prompt and the question (discard-all). An
environment keeps the full history itself and sends what a strategy keeps of it:

    context = context_strategy({"strategy": "keep_last", "turns": 5})
    reply = await client.chat.completions.create(model="policy", messages=context.apply(messages), ...)
    messages.append(...)  # the full history grows; only the request is trimmed

A message list is a head, everything before the first assistant message (the system prompt and the
task), then turns: an assistant message and every message after it up to the next assistant message
(its tool results, a user's follow-up). Strategies keep the head and drop whole turns, so a tool call
is never split from its results and the trimmed request is as valid as the full one.

Strategies are pure functions of the full history (discard-all replays its own resets from it), so one
object serves every episode of an environment, concurrent ones included. The gateway records each call
token-exactly; a trimmed request does not extend the branch it came from, so the trajectory forks
(reason "rewrite") and sample assembly trains each fork as its own sample (docs/ENVIRONMENTS.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, ValidationError

Message = Mapping[str, Any]
Turn = list[Message]


@runtime_checkable
class ContextStrategy(Protocol):
    """What of the full history (OpenAI chat messages, oldest first) the next model call sends."""

    def apply(self, messages: Sequence[Message]) -> list[Message]: ...


class ContextError(ValueError):
    """A context setting that names no strategy, or gives a strategy options it does not take."""


def split_turns(messages: Sequence[Message]) -> tuple[list[Message], list[Turn]]:
    """(head, turns): the messages before the first assistant message, then one list per assistant
    message holding it and the messages after it up to the next one."""
    head: list[Message] = []
    turns: list[Turn] = []
    for message in messages:
        if message.get("role") == "assistant":
            turns.append([message])
        elif turns:
            turns[-1].append(message)
        else:
            head.append(message)
    return head, turns


def message_chars(message: Message) -> int:
    """Characters of a message's text and tool calls: the size measure of `discard_all` (an environment
    sees no tokens; a BPE token is ~4 characters, the tiny char-level tokenizer's is one)."""
    content = message.get("content")
    if isinstance(content, str):
        size = len(content)
    elif isinstance(content, Sequence):  # content parts: count the text ones
        size = sum(len(part.get("text") or "") for part in content if isinstance(part, Mapping))
    else:
        size = 0
    for call in message.get("tool_calls") or ():
        function = call.get("function") or {}
        arguments = function.get("arguments") or ""
        size += len(function.get("name") or "") + len(arguments if isinstance(arguments, str) else str(arguments))
    return size


class _Strategy(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    def apply(self, messages: Sequence[Message]) -> list[Message]:
        raise NotImplementedError


class Full(_Strategy):
    """Send the whole history (the default): every call extends the last, one sample per episode."""

    strategy: Literal["full"] = "full"

    def apply(self, messages: Sequence[Message]) -> list[Message]:
        return list(messages)


class KeepLast(_Strategy):
    """Send the head and the last `turns` turns (the report's keep-recent-k)."""

    strategy: Literal["keep_last"] = "keep_last"
    turns: int = Field(5, ge=1)
    """Turns kept after the system prompt and the task; the report keeps 5."""

    def apply(self, messages: Sequence[Message]) -> list[Message]:
        head, turns = split_turns(messages)
        return [*head, *(m for turn in turns[-self.turns :] for m in turn)]


class DiscardAll(_Strategy):
    """Send the head and the turns since the last restart; a call whose context (those together) has
    grown past `max_chars` sends the head alone, and the agent starts afresh (the report's discard-all)."""

    strategy: Literal["discard_all"] = "discard_all"
    max_chars: int = Field(ge=1)
    """Size of the context (head and kept turns, `message_chars`) above which the next call starts afresh."""

    def apply(self, messages: Sequence[Message]) -> list[Message]:
        head, turns = split_turns(messages)
        base = sum(message_chars(m) for m in head)
        start, size = 0, base
        # Replays the restarts from the beginning (a call follows each turn), so the history alone
        # says where the last one was and the strategy needs no state per episode.
        for index, turn in enumerate(turns):
            size += sum(message_chars(m) for m in turn)
            if size > self.max_chars:
                start, size = index + 1, base
        return [*head, *(m for turn in turns[start:] for m in turn)]


STRATEGIES: dict[str, type[_Strategy]] = {"full": Full, "keep_last": KeepLast, "discard_all": DiscardAll}

ContextSpec = str | Mapping[str, Any] | ContextStrategy | None


def context_strategy(spec: ContextSpec = None) -> ContextStrategy:
    """The strategy a setting names: None or "full" (whole history), a name ("keep_last"), a mapping
    with `strategy` and its options ({"strategy": "keep_last", "turns": 5}), or a strategy object of
    your own (anything with `apply`), returned as it is. `ContextError` names what is wrong."""
    if spec is None:
        return Full()
    if isinstance(spec, ContextStrategy):
        return spec
    if isinstance(spec, str):
        spec = {"strategy": spec}
    if not isinstance(spec, Mapping):
        raise ContextError(f"context: expected a strategy name or a mapping with 'strategy', got {type(spec).__name__}")
    options = dict(spec)
    name = options.pop("strategy", None)
    if name is None:
        raise ContextError(f"context: say which strategy ('strategy': one of {', '.join(STRATEGIES)}); got options {sorted(options)}")
    model = STRATEGIES.get(name) if isinstance(name, str) else None
    if model is None:
        raise ContextError(f"context: unknown strategy {name!r}; known: {', '.join(STRATEGIES)}")
    try:
        return model.model_validate(options)
    except ValidationError as error:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'options'}: {e['msg']}" for e in error.errors())
        raise ContextError(f"context strategy {name!r}: {problems}") from None
