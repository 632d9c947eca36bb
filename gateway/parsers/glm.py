"""GLM-4.5's XML-style tool calls, the project's own markup (gateway/toolcalls.py holds the parser).

`<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>`, with or without GLM-4.5's
newlines between the tags; argument values are JSON-decoded only where the tool's schema says they are
not strings. Markup is recognised by token id where the tags are single tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from asyncrl.gateway.toolcalls import ParsedCompletion, parse_completion, parse_completion_text

from .base import NewId


class GlmParser:
    def parse(self, token_ids: Sequence[int], tokenizer: Any, tools: Sequence[Mapping] | None, new_id: NewId) -> ParsedCompletion:
        return parse_completion(token_ids, tokenizer, tools, new_id)

    def parse_text(self, text: str, tools: Sequence[Mapping] | None, new_id: NewId) -> ParsedCompletion:
        return parse_completion_text(text, tools, new_id)
