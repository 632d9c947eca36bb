"""Parsers by name: the built-ins, entry points of installed packages, or an import path.

`gateway.tool_parser` and `gateway.reasoning_parser` name one each. A name is a built-in below, an
entry point of any installed package in the group `asyncrl.tool_parsers` / `asyncrl.reasoning_parsers`
(`[project.entry-points."asyncrl.tool_parsers"] mine = "pkg.module:MyParser"`), or an import path
`package.module:Class`; the class is built with no arguments. An unknown name lists the known ones.
"""

from __future__ import annotations

from typing import Any

from asyncrl.plugins import import_target, registered_names

from .base import ReasoningParser, ToolCallParser

TOOL_GROUP = "asyncrl.tool_parsers"
REASONING_GROUP = "asyncrl.reasoning_parsers"
TOOL_PARSERS: dict[str, str] = {
    "glm45": "asyncrl.gateway.parsers.glm:GlmParser",
    "hermes": "asyncrl.gateway.parsers.json_calls:HermesParser",
    "qwen": "asyncrl.gateway.parsers.json_calls:HermesParser",
    "llama3_json": "asyncrl.gateway.parsers.json_calls:Llama3JsonParser",
}
"""`glm45` is also the tiny policy's markup (its tags are single tokens of the built-in tokenizer);
`qwen` is Hermes' format under the name Qwen's model cards use."""
REASONING_PARSERS: dict[str, str] = {"think": "asyncrl.gateway.parsers.reasoning:ThinkParser"}


class ParserNotFound(LookupError):
    """The name is no known parser, or its import path does not resolve."""


def tool_call_parser(name: str) -> ToolCallParser:
    parser = _build(name, TOOL_PARSERS, TOOL_GROUP, "tool-call parser")
    if not isinstance(parser, ToolCallParser):
        raise ParserNotFound(f"tool-call parser {name!r} has no parse and parse_text methods (gateway/parsers/base.py)")
    return parser


def reasoning_parser(name: str) -> ReasoningParser:
    parser = _build(name, REASONING_PARSERS, REASONING_GROUP, "reasoning parser")
    if not isinstance(parser, ReasoningParser):
        raise ParserNotFound(f"reasoning parser {name!r} has no split method (gateway/parsers/base.py)")
    return parser


def _build(name: str, builtin: dict[str, str], group: str, kind: str) -> Any:
    names = registered_names(builtin, group, kind, ParserNotFound)
    path = name if ":" in name else names.get(name)
    if path is None:
        raise ParserNotFound(
            f"unknown {kind} {name!r}; known: {', '.join(sorted(names))}. Register one through an entry point "
            f"in the group {group!r}, or give an import path 'package.module:Class'"
        )
    return import_target(name, path, kind, ParserNotFound)()
