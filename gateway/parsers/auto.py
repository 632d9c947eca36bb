"""`auto`: the parsers a checkpoint needs, read from its tokenizer.

A checkpoint may declare its parsers (`tool_parser` / `tool_call_parser` and `reasoning_parser` in its
tokenizer_config.json, which the tokenizer keeps in `init_kwargs`); otherwise its chat template says
which markup it renders: GLM's `<arg_key>` tags, Llama 3's `<|python_tag|>` / header tokens, or
Hermes/Qwen JSON in `<tool_call>` tags; a template that writes `<think>` gets the `think` reasoning
parser. What was chosen, and why, is logged.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Literal

from .base import ReasoningParser, ToolCallParser
from .registry import reasoning_parser, tool_call_parser

log = logging.getLogger(__name__)

AUTO = "auto"
DEFAULT_TOOL_PARSER = "glm45"
"""A template that shows no known markup: the project's own (the tiny policy's) markup."""
_DECLARED = {"tool": ("tool_parser", "tool_call_parser"), "reasoning": ("reasoning_parser",)}
_TOOL_MARKUP = (
    ("<arg_key>", "glm45"),
    ("<|python_tag|>", "llama3_json"),
    ("<|start_header_id|>", "llama3_json"),
    ("<tool_call>", "hermes"),
)
"""Template text -> parser, most specific first (GLM-4.5's template also writes `<tool_call>`)."""


def resolve(name: str | None, tokenizer: Any, kind: Literal["tool", "reasoning"] = "tool") -> str | None:
    """`name`, or for "auto" the parser `tokenizer`'s checkpoint declares or its chat template implies
    (a tool-call parser always; a reasoning parser, or None when the template writes no `<think>`)."""
    if name != AUTO:
        return name
    declared = _declared(tokenizer, kind)
    if declared is not None:
        log.info("gateway: %s parser %r (declared by the checkpoint's tokenizer config)", kind, declared)
        return declared
    source = _template_source(tokenizer)
    chosen: str | None
    if kind == "tool":
        chosen, why = next(((parser, f"its chat template writes {tag}") for tag, parser in _TOOL_MARKUP if tag in source), (None, ""))
        if chosen is None:
            chosen, why = DEFAULT_TOOL_PARSER, "its chat template shows no known tool-call markup; the default"
    else:
        thinks = "<think>" in source or "</think>" in source
        chosen, why = ("think", "its chat template writes <think>") if thinks else (None, "its chat template writes no <think>: none")
    log.info("gateway: %s parser %r (%s)", kind, chosen, why)
    return chosen


def _declared(tokenizer: Any, kind: str) -> str | None:
    config = getattr(tokenizer, "init_kwargs", None)
    if not isinstance(config, Mapping):
        return None
    return next((config[key] for key in _DECLARED[kind] if isinstance(config.get(key), str) and config[key] not in ("", AUTO)), None)


def _template_source(tokenizer: Any) -> str:
    template = getattr(tokenizer, "chat_template", None)
    sources = template.values() if isinstance(template, Mapping) else [template]
    return "".join(s for s in sources if isinstance(s, str))


def parsers_for(tool: str, reasoning: str | None, tokenizer: Any) -> tuple[ToolCallParser, ReasoningParser | None]:
    """The run's tool-call and reasoning parsers (`gateway.tool_parser`, `gateway.reasoning_parser`) resolved
    against the checkpoint; ParserNotFound names one that does not exist."""
    tool_name = resolve(tool, tokenizer, "tool") or tool
    reasoning_name = resolve(reasoning, tokenizer, "reasoning")
    return tool_call_parser(tool_name), reasoning_parser(reasoning_name) if reasoning_name else None
