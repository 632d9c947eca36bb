"""Tool calls written as JSON: Hermes/Qwen (`<tool_call>{...}</tool_call>` blocks) and Llama 3 (bare JSON).

Hermes and Qwen 2.5/3 write each call as a JSON object `{"name": ..., "arguments": {...}}` between
`<tool_call>` and `</tool_call>` lines, after any content. Llama 3.1/3.2 write a reply that *is* the
call: one JSON object `{"name": ..., "parameters": {...}}` (several separated by `;`), optionally
after `<|python_tag|>`; a reply that does not start with `{` is plain content. In both, a call that is
not valid JSON, has no string name, or has non-object arguments leaves the whole reply as content with
`parse_error` set.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from asyncrl.gateway.toolcalls import ParsedCompletion, strip_stop

from .base import NewId

_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


class _Malformed(ValueError):
    pass


def _call(obj: Any, arguments_key: str, new_id: NewId, where: str) -> dict:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"].strip():
        raise _Malformed(f"{where}: not an object with a string 'name'")
    arguments = obj.get(arguments_key, {})
    if isinstance(arguments, str):  # some models write the OpenAI wire form, a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            raise _Malformed(f"{where}: {arguments_key!r} is a string that is not JSON") from None
    if not isinstance(arguments, dict):
        raise _Malformed(f"{where}: {arguments_key!r} is not an object")
    function = {"name": obj["name"].strip(), "arguments": json.dumps(arguments, ensure_ascii=False)}
    return {"id": new_id(), "type": "function", "function": function}


def _decode(tokenizer: Any, token_ids: Sequence[int]) -> str:
    return tokenizer.decode(strip_stop(token_ids, tokenizer), skip_special_tokens=False)


class HermesParser:
    """`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks after the content."""

    def parse(self, token_ids: Sequence[int], tokenizer: Any, tools: Sequence[Mapping] | None, new_id: NewId) -> ParsedCompletion:
        return self.parse_text(_decode(tokenizer, token_ids), tools, new_id)

    def parse_text(self, text: str, tools: Sequence[Mapping] | None, new_id: NewId) -> ParsedCompletion:
        first = text.find("<tool_call>")
        if first < 0:
            stray = "</tool_call>" in text
            return ParsedCompletion(text, [], "</tool_call> outside a tool call" if stray else None)
        blocks = list(_HERMES_BLOCK.finditer(text, first))
        try:
            end = first
            calls = []
            for number, block in enumerate(blocks, 1):
                if text[end : block.start()].strip():
                    raise _Malformed(f"text between tool calls before call {number}")
                try:
                    obj = json.loads(block.group(1))
                except ValueError as error:
                    raise _Malformed(f"tool call {number} is not JSON ({error})") from None
                calls.append(_call(obj, "arguments", new_id, f"tool call {number}"))
                end = block.end()
            if not blocks or text[end:].strip():
                raise _Malformed("unclosed <tool_call> or text after the tool calls")
        except _Malformed as error:
            return ParsedCompletion(text, [], str(error))
        return ParsedCompletion(text[:first].rstrip("\n"), calls)


class Llama3JsonParser:
    """A reply that is one or more `{"name": ..., "parameters": {...}}` objects (`;`-separated)."""

    PYTHON_TAG = "<|python_tag|>"

    def parse(self, token_ids: Sequence[int], tokenizer: Any, tools: Sequence[Mapping] | None, new_id: NewId) -> ParsedCompletion:
        return self.parse_text(_decode(tokenizer, token_ids), tools, new_id)

    def parse_text(self, text: str, tools: Sequence[Mapping] | None, new_id: NewId) -> ParsedCompletion:
        body = text.strip()
        body = body.removeprefix(self.PYTHON_TAG).strip()
        if not body.startswith("{"):
            return ParsedCompletion(text, [])
        decoder, calls, position, number = json.JSONDecoder(), [], 0, 0
        try:
            while position < len(body):
                number += 1
                try:
                    obj, position = decoder.raw_decode(body, position)
                except ValueError as error:
                    raise _Malformed(f"tool call {number} is not JSON ({error})") from None
                key = "parameters" if isinstance(obj, dict) and "parameters" in obj else "arguments"
                calls.append(_call(obj, key, new_id, f"tool call {number}"))
                rest = body[position:].lstrip()
                if rest and not rest.startswith(";"):
                    raise _Malformed(f"text after tool call {number}")
                position = len(body) - len(rest.removeprefix(";").lstrip())
        except _Malformed as error:
            return ParsedCompletion(text, [], str(error))
        return ParsedCompletion("", calls)
