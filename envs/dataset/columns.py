"""The column mapping: a raw row of a dataset file -> the `DatasetRow` an episode plays.

The prompt comes from a messages column, a prompt column, or a template over the row's columns, with
the system prompt put first; the answer, tests, tools, id and metadata columns are copied across,
JSON columns of text files parsed. A row that cannot be mapped raises `BadRow` with the reason (the
scan counts or refuses it); a column no row has is a `DatasetError` listing the file's columns.
"""

from __future__ import annotations

import json
from typing import Any

from .options import DatasetError, DatasetOptions
from .row import DatasetRow

ROLES = ("system", "user", "assistant", "tool")


class BadRow(ValueError):
    """This row cannot become a task; the message says why."""


class ColumnMap:
    """Maps rows of one file under the dataset's options."""

    def __init__(self, options: DatasetOptions) -> None:
        self.options = options
        self.required = options.required_columns()
        self.named = options.named_columns()

    def check(self, path: str, columns: list[str]) -> None:
        """Refuse a file lacking a column the options name, listing the columns it has (a file without any
        is left to the scan, which refuses it as having no usable rows)."""
        if not columns:
            return
        for column, option in self.named.items():
            if column not in columns:
                have = ", ".join(repr(c) for c in columns)
                raise DatasetError(f"{path} has no column {column!r} (named by {option}); its columns: {have}")

    def row(self, raw: dict[str, Any], number: int, label: str) -> DatasetRow:
        """The task of row `number` (0-based, in file order) of the file shown as `label`."""
        o = self.options
        for column in self.required:
            if raw.get(column) is None:
                reason = "is empty" if column in raw else f"is missing (the row's columns: {', '.join(map(repr, raw))})"
                raise BadRow(f"column {column!r} {reason}")
        messages = self._prompt(raw)
        if o.system_prompt is not None and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": o.system_prompt}, *messages]
        return DatasetRow(
            row_id=str(raw[o.id_column]) if o.id_column else f"{label}:{number}",
            messages=messages,
            answer=raw[o.answer_column] if o.answer_column else None,
            tests=parse_tests(raw[o.tests_column]) if o.tests_column else None,
            tools=parse_tools(raw.get(o.tools_column)) if o.tools_column else None,
            metadata={column: raw.get(column) for column in o.metadata_columns},
        )

    def split_key(self, row: DatasetRow, raw: dict[str, Any]) -> str:
        """What the hash split and the train/eval overlap check compare: the id column, else the prompt."""
        if self.options.id_column:
            return str(raw[self.options.id_column])
        return json.dumps(row.messages, sort_keys=True, ensure_ascii=False)

    def _prompt(self, raw: dict[str, Any]) -> list[dict]:
        o = self.options
        if o.messages_column is not None:
            return parse_messages(raw[o.messages_column])
        if o.prompt_template is not None:
            try:
                text = o.prompt_template.format_map(raw)
            except (KeyError, AttributeError, IndexError, TypeError, ValueError) as error:
                raise BadRow(f"prompt_template cannot be filled from this row ({type(error).__name__}: {error})") from None
        else:
            value = raw[o.prompt_source]
            if not isinstance(value, (str, int, float)):
                raise BadRow(f"column {o.prompt_source!r} holds a {type(value).__name__}, not text")
            text = str(value)
        return [{"role": "user", "content": text}]


def _decoded(value: Any, what: str) -> Any:
    """A JSON column of a text file (CSV, or a JSONL row that stored it as a string) parsed."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError:
        raise BadRow(f"{what} is text that is not JSON") from None


def parse_messages(value: Any) -> list[dict]:
    """Chat messages: a non-empty list of {role, content}; keys with no value (Arrow fills a struct's
    missing fields with nulls) are dropped."""
    messages = _decoded(value, "the messages column")
    if not isinstance(messages, list) or not messages:
        raise BadRow("the messages column is not a non-empty list of messages")
    cleaned = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise BadRow(f"message {i} is not a {{role, content}} mapping with a role among {', '.join(ROLES)}")
        message = {k: v for k, v in message.items() if v is not None}
        content = message.get("content")
        if not isinstance(content, str) and not (message["role"] == "assistant" and message.get("tool_calls")):
            raise BadRow(f"message {i} ({message['role']}) has no text content")
        cleaned.append(message)
    return cleaned


def parse_tests(value: Any) -> list[str]:
    """Unit tests: a list of python sources, a JSON list of them, or one source."""
    tests = value
    if isinstance(value, str):
        try:
            tests = json.loads(value) if value.lstrip().startswith("[") else [value]
        except ValueError:
            tests = [value]  # python source that happens to start with a list
        if not isinstance(tests, list):
            tests = [value]
    if not isinstance(tests, list) or not tests or not all(isinstance(t, str) for t in tests):
        raise BadRow("the tests column is not a non-empty list of python sources")
    return tests


def parse_tools(value: Any) -> list[dict] | None:
    """OpenAI tool definitions ({type: function, function: {name, ...}}), or None when the row offers none."""
    if value is None or value == "":
        return None
    tools = _drop_nulls(_decoded(value, "the tools column"))
    if not isinstance(tools, list):
        raise BadRow("the tools column is not a list of tool definitions")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or tool.get("type", "function") != "function" or not function.get("name"):
            raise BadRow(f"tool {i} is not an OpenAI function definition ({{type: function, function: {{name, parameters}}}})")
    return tools or None


def _drop_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value
