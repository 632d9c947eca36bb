"""Tool calls between the OpenAI wire format and the model's GLM-style markup.

Two directions:
- model -> agent: `parse_completion` turns sampled tokens into an OpenAI assistant message
  (`content` plus `tool_calls` with JSON-string arguments). It never raises: markup the model got
  wrong comes back verbatim as content with `parse_error` set, so the agent sees what was sampled and
  the episode carries on.
- agent -> template: `to_template_messages` / `to_template_tools` / `to_template_kwargs` validate
  request messages, tools and template variables and turn them into the form the chat template renders
  (arguments as a mapping of JSON values, reasoning kept). Bad client input raises `MessageError`,
  which the HTTP layer answers with a 400.

Markup: `<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>`, one or more
calls after the content, then `<|endoftext|>`. The template also renders string arguments (OpenAI
wire form) as a single keyless `<arg_value>{json}</arg_value>`; that form is parsed too.
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
import weakref
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from asyncrl.policy.tokenizer import (
    ARG_KEY_CLOSE,
    ARG_KEY_OPEN,
    ARG_VALUE_CLOSE,
    ARG_VALUE_OPEN,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
)

MARKERS = (TOOL_CALL_OPEN, TOOL_CALL_CLOSE, ARG_KEY_OPEN, ARG_KEY_CLOSE, ARG_VALUE_OPEN, ARG_VALUE_CLOSE)
_MARKER_RE = re.compile("(" + "|".join(re.escape(m) for m in MARKERS) + ")")
ROLES = ("system", "user", "assistant", "tool")
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
"""Where an echoed assistant message may carry its reasoning (vLLM, DeepSeek; Anthropic-style; OpenRouter)."""


class MessageError(ValueError):
    """A request message or tool the gateway cannot render; the message says which and why."""


@dataclass(frozen=True)
class ParsedCompletion:
    """What the model wrote, in OpenAI terms."""

    content: str
    """Text before the first tool call (all of it, markup included, when parsing failed)."""
    tool_calls: list[dict] = field(default_factory=list)
    """OpenAI tool calls: {id, type: "function", function: {name, arguments: JSON string}}."""
    parse_error: str | None = None
    """Why the tool-call markup could not be parsed; None when it could (or there was none)."""
    reasoning_content: str | None = None
    """The reply's thinking section, when the run has a reasoning parser and the reply had one."""

    def message(self) -> dict:
        """The OpenAI assistant message the gateway returns (and later expects echoed back)."""
        message: dict = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            # OpenAI sends null, not "", for a tool-call-only reply; both normalise to "" in a conversation.
            message.update(content=self.content or None, tool_calls=self.tool_calls)
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        return message

    def finish_reason(self, engine_finish: str) -> str:
        """OpenAI finish reason: a clean stop that produced tool calls is `tool_calls`."""
        return "tool_calls" if engine_finish == "stop" and self.tool_calls else engine_finish


# ---------------------------------------------------------------- model -> agent


def parse_completion(
    token_ids: Sequence[int],
    tokenizer: Any,
    tools: Sequence[Mapping] | None = None,
    new_id: Callable[[], str] | None = None,
) -> ParsedCompletion:
    """Parse sampled tokens. Markup is recognised by token id, not by text, where the markup strings
    are single tokens: a model that spells `<tool_call>` out of characters has not made a tool call.

    `tools` (OpenAI format) types the arguments: a value is JSON-decoded only when its parameter's
    schema type is not "string" (as GLM's own parser does), so `"42"` stays a string for a string
    parameter. `new_id` makes tool-call ids (default: random `call_...`).
    """
    ids = strip_stop(token_ids, tokenizer, MARKERS)
    marker_ids = _specials(tokenizer).markers
    if len(marker_ids) < len(MARKERS):  # a tokenizer without markup tokens: fall back to the text
        return parse_completion_text(tokenizer.decode(ids, skip_special_tokens=False), tools, new_id)
    pieces: list[tuple[str | None, str]] = []
    run: list[int] = []
    for token_id in [*ids, None]:
        if token_id is not None and token_id not in marker_ids:
            run.append(token_id)
            continue
        if run:
            pieces.append((None, tokenizer.decode(run, skip_special_tokens=False)))
            run = []
        if token_id is not None:
            pieces.append((marker_ids[token_id], marker_ids[token_id]))
    return _parse(pieces, tools, new_id)


def strip_stop(token_ids: Sequence[int], tokenizer: Any, keep: Collection[str] = ()) -> list[int]:
    """The reply without the token it stopped on: EOS, or another special token that is not markup in
    `keep` (GLM-4.5 stops on `<|observation|>` or `<|user|>`, Llama 3 on `<|eom_id|>`)."""
    ids = list(token_ids)
    if not ids:
        return ids
    specials = _specials(tokenizer)
    if ids[-1] == specials.eos:
        return ids[:-1]
    special = specials.special.get(ids[-1])
    if special is not None and special not in keep:
        return ids[:-1]
    return ids


@dataclass(frozen=True)
class _Specials:
    """What parsing reads of a tokenizer."""

    eos: int | None
    special: dict[int, str]
    """The special added tokens, id -> text."""
    markers: dict[int, str]
    """The tool-call markup tokens the vocabulary has, id -> text."""


_SPECIALS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _specials(tokenizer: Any) -> _Specials:
    """A tokenizer's special ids, read once: transformers works each out again on every access (an id is a
    vocabulary lookup, `added_tokens_decoder` a new dict), several per reply. A gateway's tokenizer does
    not change while it serves."""
    try:
        return _SPECIALS[tokenizer]
    except (KeyError, TypeError):
        pass
    unknown = getattr(tokenizer, "unk_token_id", None)
    markers = {}
    for marker in MARKERS:
        token_id = tokenizer.convert_tokens_to_ids(marker)
        if isinstance(token_id, int) and token_id != unknown:
            markers[token_id] = marker
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    special = {i: t.content for i, t in decoder.items() if getattr(t, "special", False) and getattr(t, "content", None) is not None}
    specials = _Specials(getattr(tokenizer, "eos_token_id", None), special, markers)
    with contextlib.suppress(TypeError):  # a tokenizer that cannot be weakly referenced is read again next time
        _SPECIALS[tokenizer] = specials
    return specials


def parse_completion_text(text: str, tools: Sequence[Mapping] | None = None, new_id: Callable[[], str] | None = None) -> ParsedCompletion:
    """Parse decoded text (markup recognised by string); for engines that return text only."""
    pieces = [(part if part in MARKERS else None, part) for part in _MARKER_RE.split(text) if part]
    return _parse(pieces, tools, new_id)


class _Malformed(Exception):
    pass


def _parse(pieces: list[tuple[str | None, str]], tools, new_id) -> ParsedCompletion:
    """pieces: (marker or None for text, text), in order."""
    text = "".join(t for _, t in pieces)
    first_call = next((i for i, (m, _) in enumerate(pieces) if m == TOOL_CALL_OPEN), len(pieces))
    stray = next((m for m, _ in pieces[:first_call] if m is not None), None)
    if stray is not None:
        return ParsedCompletion(text, [], f"{stray} outside a tool call")
    content = "".join(t for _, t in pieces[:first_call])
    types = _parameter_types(tools)
    new_id = new_id or (lambda: "call_" + uuid.uuid4().hex[:24])
    try:
        calls = []
        rest = _Cursor(pieces[first_call:])
        while rest.skip_space():
            name, arguments = _parse_call(rest, types)
            calls.append({"id": new_id(), "type": "function", "function": {"name": name, "arguments": arguments}})
    except _Malformed as error:
        return ParsedCompletion(text, [], str(error))
    return ParsedCompletion(content, calls)


class _Cursor:
    def __init__(self, pieces: list[tuple[str | None, str]]) -> None:
        self.pieces, self.i = pieces, 0

    def skip_space(self) -> bool:
        """Skip whitespace-only text (models put newlines between tags); True if anything is left."""
        while self.i < len(self.pieces) and self.pieces[self.i][0] is None and not self.pieces[self.i][1].strip():
            self.i += 1
        return self.i < len(self.pieces)

    def expect(self, marker: str, where: str) -> None:
        if not self.skip_space():
            raise _Malformed(f"unclosed {TOOL_CALL_OPEN}: expected {marker} {where}")
        got = self.pieces[self.i][0]
        if got != marker:
            raise _Malformed(f"expected {marker} {where}, got {got or 'text'}")
        self.i += 1

    def text(self) -> str:
        """The text at the cursor ("" when a marker follows directly)."""
        if self.i < len(self.pieces) and self.pieces[self.i][0] is None:
            self.i += 1
            return self.pieces[self.i - 1][1]
        return ""

    def peek(self) -> str | None:
        return self.pieces[self.i][0] if self.skip_space() else None


def _parse_call(cur: _Cursor, types: dict[str, dict[str, Any]]) -> tuple[str, str]:
    cur.expect(TOOL_CALL_OPEN, "(only whitespace may follow a tool call)")
    name = cur.text().strip()
    if not name or any(c.isspace() for c in name):
        raise _Malformed(f"tool call without a valid name: {name!r}")
    where = f"in tool call {name!r}"
    arguments: dict[str, Any] = {}
    while (marker := cur.peek()) != TOOL_CALL_CLOSE:
        if marker == ARG_KEY_OPEN:
            cur.expect(ARG_KEY_OPEN, where)
            key = cur.text().strip()
            cur.expect(ARG_KEY_CLOSE, where)
            cur.expect(ARG_VALUE_OPEN, f"after argument {key!r} {where}")
            value = cur.text()
            cur.expect(ARG_VALUE_CLOSE, f"after the value of {key!r} {where}")
            if not key or key in arguments:
                raise _Malformed(f"empty or repeated argument name {key!r} {where}")
            arguments[key] = _typed(value, types.get(name, {}).get(key))
        elif marker == ARG_VALUE_OPEN and not arguments:  # the keyless JSON form
            cur.expect(ARG_VALUE_OPEN, where)
            raw = cur.text()
            cur.expect(ARG_VALUE_CLOSE, where)
            if not isinstance(_loads(raw), dict):
                raise _Malformed(f"keyless arguments {where} are not a JSON object")
            cur.expect(TOOL_CALL_CLOSE, where)
            return name, raw
        else:
            raise _Malformed(f"unclosed {TOOL_CALL_OPEN} or unexpected {marker or 'text'} {where}")
    cur.expect(TOOL_CALL_CLOSE, where)
    return name, json.dumps(arguments, ensure_ascii=False)


def _parameter_types(tools: Sequence[Mapping] | None) -> dict[str, dict[str, Any]]:
    """{tool name: {parameter: JSON-schema type}} from OpenAI tool definitions; lenient on shape."""
    types: dict[str, dict[str, Any]] = {}
    for tool in tools or ():
        function = tool.get("function", tool) if isinstance(tool, Mapping) else {}
        properties = (function.get("parameters") or {}).get("properties") or {}
        if isinstance(properties, Mapping):
            types[str(function.get("name"))] = {k: v.get("type") for k, v in properties.items() if isinstance(v, Mapping)}
    return types


def _typed(value: str, schema_type: Any) -> Any:
    # Unknown parameters stay strings: guessing "42" -> 42 would change what a string tool receives.
    if schema_type is None or schema_type == "string" or (isinstance(schema_type, list) and "string" in schema_type):
        return value
    decoded = _loads(value)
    return value if decoded is _INVALID else decoded


_INVALID = object()


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return _INVALID


# ---------------------------------------------------------------- agent -> template


def to_template_messages(messages: Any) -> list[dict]:
    """OpenAI request messages -> the mapping form the chat template renders.

    Keeps only what the template renders: role, content (text) and, for assistant messages, tool
    calls with arguments as a mapping of JSON values (chat templates serialise them: `tojson`, or GLM's
    `v if v is string else v | tojson`) and the reply's reasoning. Reasoning sent as `reasoning_content`,
    `thinking` or `reasoning` is passed under the first two names, as transformers' own call does, so
    templates that read either see it.
    """
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)) or not messages:
        raise MessageError("messages must be a non-empty list")
    return [_template_message(m, f"messages[{i}]") for i, m in enumerate(messages)]


def _template_message(message: Any, where: str) -> dict:
    if not isinstance(message, Mapping):
        raise MessageError(f"{where} must be an object")
    role = message.get("role")
    role = "system" if role == "developer" else role
    if role not in ROLES:
        raise MessageError(f"{where}.role must be one of {', '.join(ROLES)} (or developer), got {role!r}")
    out: dict[str, Any] = {"role": role, "content": _text(message.get("content"), f"{where}.content")}
    calls = message.get("tool_calls")
    if calls:
        if role != "assistant":
            raise MessageError(f"{where}: only assistant messages carry tool_calls")
        if not isinstance(calls, Sequence) or isinstance(calls, (str, bytes)):
            raise MessageError(f"{where}.tool_calls must be a list")
        out["tool_calls"] = [_template_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
    if role == "assistant":
        reasoning = next((message[name] for name in REASONING_FIELDS if message.get(name) is not None), None)
        if reasoning is not None:
            if not isinstance(reasoning, str):
                raise MessageError(f"{where}.reasoning_content must be a string or null")
            # transformers' order exactly: `thinking` first, `reasoning_content` last.
            return {"thinking": reasoning, **out, "reasoning_content": reasoning}
    return out


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence) and not isinstance(content, (bytes, bytearray)):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise MessageError(f"{where}[{j}]: only text parts are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise MessageError(f"{where} must be a string, null or a list of text parts")


def _template_call(call: Any, where: str) -> dict:
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping):
        raise MessageError(f"{where}.function must be an object")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise MessageError(f"{where}.function.name must be a non-empty string")
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        arguments = _loads(arguments or "{}")
    if not isinstance(arguments, Mapping):
        raise MessageError(f"{where}.function.arguments must be a JSON object (or a string holding one)")
    return {"type": "function", "function": {"name": name, "arguments": {str(k): v for k, v in arguments.items()}}}


def to_template_tools(tools: Any) -> list[dict] | None:
    """Validate OpenAI tool definitions for the template; None or [] means no tools."""
    if not tools:
        return None
    if not isinstance(tools, Sequence) or isinstance(tools, (str, bytes)):
        raise MessageError("tools must be a list")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str) or not function["name"]:
            raise MessageError(f"tools[{i}] must be {{type: function, function: {{name: ...}}}}")
        if tool.get("type", "function") != "function":
            raise MessageError(f"tools[{i}].type must be 'function'")
    return [dict(t) for t in tools]


MAX_TEMPLATE_KWARGS = 16
MAX_TEMPLATE_KWARGS_CHARS = 4096
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
RENDER_NAMES = frozenset({"messages", "tools", "documents", "add_generation_prompt", "continue_final_message", "chat_template", "tokenize"})
"""Template variables the gateway sets itself; a request may not."""


def to_template_kwargs(kwargs: Any, reads: frozenset[str], reserved: frozenset[str]) -> tuple[dict | None, str]:
    """A request's template variables (`chat_template_kwargs`, plus `reasoning_effort`) checked against
    the template: (the variables, or None for none; their canonical JSON, "" for none).

    Each must be a name the template reads (`reads`): a thinking switch the template ignores would
    otherwise be silently dropped, and the agent would believe thinking was off. `reserved`: names the
    render sets (messages, special tokens), which would let a request write a marker's text as a marker.
    Values are plain JSON, and small. Anything else is a `MessageError` naming the field.
    """
    if not kwargs:
        return None, ""
    if not isinstance(kwargs, Mapping):
        raise MessageError("chat_template_kwargs must be an object")
    if len(kwargs) > MAX_TEMPLATE_KWARGS:
        raise MessageError(f"chat_template_kwargs has {len(kwargs)} keys; at most {MAX_TEMPLATE_KWARGS}")
    for name, value in kwargs.items():
        where = _kwarg_field(name)
        if not isinstance(name, str) or not _IDENTIFIER.fullmatch(name):
            raise MessageError(f"{where}: keys must be identifiers of at most 64 characters")
        if name in RENDER_NAMES or name in reserved:
            raise MessageError(f"{where}: {name} is set by the gateway, not by a request")
        if name not in reads:
            known = sorted(reads - RENDER_NAMES - reserved)
            raise MessageError(
                f"{where}: this model's chat template does not read {name}"
                + (f" (it reads: {', '.join(known)})" if known else " (it reads no variables)")
            )
        _check_plain(value, where, depth=0)
    try:
        key = json.dumps(kwargs, sort_keys=True, ensure_ascii=False, allow_nan=False)
    except ValueError:
        raise MessageError("chat_template_kwargs: values must be finite numbers, strings, booleans, null, lists or objects") from None
    if len(key) > MAX_TEMPLATE_KWARGS_CHARS:
        raise MessageError(f"chat_template_kwargs is {len(key)} characters as JSON; at most {MAX_TEMPLATE_KWARGS_CHARS}")
    return dict(kwargs), key


def _kwarg_field(name: Any) -> str:
    if name == "reasoning_effort":
        return "reasoning_effort (or chat_template_kwargs.reasoning_effort)"
    return f"chat_template_kwargs.{name}"


def _check_plain(value: Any, where: str, depth: int) -> None:
    if depth > 4:
        raise MessageError(f"{where}: nested more than 4 levels")
    if value is None or isinstance(value, (bool, int, float, str)):
        return
    if isinstance(value, list):
        for item in value:
            _check_plain(item, where, depth + 1)
        return
    if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
        for item in value.values():
            _check_plain(item, where, depth + 1)
        return
    raise MessageError(f"{where} must be a JSON value (got {type(value).__name__})")
