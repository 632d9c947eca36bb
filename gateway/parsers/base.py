"""The two parser Protocols: a tool-call parser reads calls out of a reply, a reasoning parser its thinking."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from asyncrl.gateway.toolcalls import ParsedCompletion

NewId = Callable[[], str]
"""Makes a tool-call id (`call_...`)."""


@runtime_checkable
class ToolCallParser(Protocol):
    """Reads the tool calls a model wrote in its own markup; never raises on what the model wrote."""

    def parse(self, token_ids: Sequence[int], tokenizer: Any, tools: Sequence[Mapping] | None, new_id: NewId) -> ParsedCompletion:
        """Parse sampled tokens (a parser may recognise markup by token id, so that markup spelled
        out of ordinary characters is not a call)."""
        ...

    def parse_text(self, text: str, tools: Sequence[Mapping] | None, new_id: NewId) -> ParsedCompletion:
        """Parse decoded text, for replies whose tokens were already split (after a reasoning section)."""
        ...


@runtime_checkable
class ReasoningParser(Protocol):
    """Splits a reply into its reasoning and the rest."""

    def split(self, token_ids: Sequence[int], tokenizer: Any) -> tuple[str | None, list[int] | str]:
        """(the reasoning, or None when the reply has none; the rest of the reply, as token IDs where
        the split fell on a token boundary, else as text)."""
        ...
