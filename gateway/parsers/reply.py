"""One sampled reply -> the OpenAI assistant message: reasoning split off first, then tool calls parsed."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from asyncrl.gateway.toolcalls import ParsedCompletion

from .base import NewId, ReasoningParser, ToolCallParser


def parse_reply(
    token_ids: Sequence[int],
    tokenizer: Any,
    tools: Sequence[Mapping] | None,
    new_id: NewId,
    tool_parser: ToolCallParser,
    reasoning_parser: ReasoningParser | None = None,
) -> ParsedCompletion:
    """The reply as the agent sees it; the recorded turn keeps `token_ids` whatever this returns."""
    if reasoning_parser is None:
        return tool_parser.parse(token_ids, tokenizer, tools, new_id)
    reasoning, rest = reasoning_parser.split(token_ids, tokenizer)
    parsed = tool_parser.parse_text(rest, tools, new_id) if isinstance(rest, str) else tool_parser.parse(rest, tokenizer, tools, new_id)
    if reasoning is None:
        return parsed
    # Separators the template puts after the thinking section are not content.
    return dataclasses.replace(parsed, content=parsed.content.lstrip("\n"), reasoning_content=reasoning)
