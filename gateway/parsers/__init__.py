"""What the model wrote, in the agent's terms: tool-call parsers and reasoning parsers as named plug-ins.

A checkpoint brings its own tool-call markup (GLM-4.5's XML-style arguments, Hermes/Qwen JSON in
`<tool_call>` tags, Llama 3's bare JSON) and often a thinking section (`<think>...</think>`). The
gateway turns a sampled reply into an OpenAI assistant message with the run's parsers
(`gateway.tool_parser`, `gateway.reasoning_parser`): `parse_reply` splits off the reasoning first,
then parses tool calls from the rest. Parsing never changes what is recorded (the sampled token IDs
are the record); it only shapes the message the agent sees. A reply a parser cannot read comes back
verbatim as content with `parse_error` set, so the agent sees what was sampled and the episode goes on.
"""

from .base import ReasoningParser, ToolCallParser
from .registry import ParserNotFound, reasoning_parser, tool_call_parser
from .reply import parse_reply

__all__ = ["ParserNotFound", "ReasoningParser", "ToolCallParser", "parse_reply", "reasoning_parser", "tool_call_parser"]
