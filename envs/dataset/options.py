"""The options of `env: dataset` (`tasks.mix.<name>.options`), validated before any file is opened.

Errors name the option the way config errors name a key (`answer_column: ...`), and are
`ConfigError`s, so `asyncrl run` reports them as a bad config rather than a crash.
"""

from __future__ import annotations

import string
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from asyncrl.configs.loader import ConfigError, format_validation_error

Format = Literal["auto", "jsonl", "csv", "parquet", "hf_disk", "hf"]


class DatasetError(ConfigError):
    """The dataset cannot be used as configured: the message names the file, the column or the rule."""


class DatasetOptions(BaseModel):
    """Where the rows are, how their columns map onto a task, how the held-out split is drawn, how an answer is scored."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    path: str
    """The dataset: a .jsonl/.ndjson, .csv, .parquet file, a directory saved by `datasets`' `save_to_disk`, or
    anything `datasets.load_dataset` reads locally (a .json file, a directory of data files)."""
    format: Format = "auto"
    """How to read `path`; auto: by extension (a directory: `hf_disk` when it holds a saved dataset, else `hf`)."""
    hf_split: str = "train"
    """The split of a Hugging Face dataset (a saved DatasetDict, or `load_dataset`) that training rows come from."""
    hf_cache_dir: str | None = None
    """`load_dataset`'s cache directory (null: Hugging Face's default)."""

    prompt_column: str | None = None
    """A column whose text is the user message (the default, `prompt`, when no prompt option is given)."""
    messages_column: str | None = None
    """A column holding the whole prompt as chat messages (a list of {role, content}, or its JSON)."""
    prompt_template: str | None = None
    """The user message as a template over the row's columns, e.g. 'Solve: {question}' (literal braces: {{ }})."""
    system_prompt: str | None = None
    """A system message put first, unless the row's messages already start with one."""
    answer_column: str | None = "answer"
    """The reference answer the reward reads (null: none, e.g. for code tests)."""
    tests_column: str | None = None
    """Unit tests (python source: a list of strings, one string, or a JSON list) for the code_tests reward."""
    tools_column: str | None = None
    """OpenAI tool definitions offered in the episode (a list or its JSON); calls of `python_tool` run in the sandbox."""
    id_column: str | None = None
    """A stable id per row (default: file name and row number); the hash split uses it when given."""
    metadata_columns: list[str] = []
    """Other columns passed to the reward in `task.metadata`."""

    eval_path: str | None = None
    """The held-out split is this file (read like `path`; rows also in it are dropped from training)."""
    hf_eval_split: str | None = None
    """The held-out split is this split of the Hugging Face dataset at `path`."""
    split_column: str | None = None
    """The held-out split is given by this column's value (`train_values` / `eval_values`)."""
    train_values: list[str] = ["train"]
    """Values of `split_column` that mark training rows (compared as strings)."""
    eval_values: list[str] = ["eval", "test", "validation"]
    """Values of `split_column` that mark held-out rows; rows with other values are in neither split."""
    heldout_fraction: float = Field(0.05, gt=0.0, lt=1.0)
    """Without a column or a file: this share of rows is held out, by a stable hash of the id column, or
    of the prompt itself without one (so duplicates of a prompt never straddle the split)."""

    on_bad_row: Literal["skip", "error"] = "skip"
    """A malformed row (unparsable, a required column empty, messages or tests of the wrong shape): skip it and
    report the count at start-up, or refuse the dataset."""

    reward: str = "math"
    """The reward plug-in (a name such as math, exact, regex, code_tests, constraints, http, judge, or an import path)."""
    reward_options: dict[str, Any] = {}
    """Keyword options of the reward."""
    max_tokens: int | None = Field(None, ge=1)
    """Answer budget per model call (null: the run's loop.episode_max_tokens)."""
    max_turns: int = Field(4, ge=1)
    """Model calls per episode when the row offers tools (each answered tool call is a turn)."""
    python_tool: str = "python"
    """The tool name whose `code` argument runs in the sandbox; calls of other tools are answered with an error."""

    @model_validator(mode="after")
    def _one_source_of_each(self) -> DatasetOptions:
        if self.messages_column is not None and (self.prompt_column is not None or self.prompt_template is not None):
            raise ValueError("give messages_column, or prompt_column / prompt_template, not both")
        if self.prompt_column is not None and self.prompt_template is not None:
            raise ValueError("give prompt_column or prompt_template, not both (a template names its columns itself: {column})")
        held_out = [k for k in ("eval_path", "hf_eval_split", "split_column") if getattr(self, k) is not None]
        if len(held_out) > 1:
            raise ValueError(f"the held-out split is given twice ({' and '.join(held_out)}); give one")
        if held_out and "heldout_fraction" in self.model_fields_set:
            raise ValueError(f"heldout_fraction applies only without {held_out[0]}")
        if self.prompt_template is not None:
            template_columns(self.prompt_template)  # a broken template is refused here, not at the first row
        return self

    @property
    def prompt_source(self) -> str:
        """The column the user message is read from (when neither messages nor a template give it)."""
        return self.prompt_column or "prompt"

    def required_columns(self) -> dict[str, str]:
        """Column -> the option naming it, for the columns every row must have (non-null) to become a task."""
        if self.messages_column is not None:
            named = {self.messages_column: "messages_column"}
        elif self.prompt_template is not None:
            named = dict.fromkeys(template_columns(self.prompt_template), "prompt_template")
        else:
            named = {self.prompt_source: "prompt_column" if self.prompt_column else "prompt_column (default)"}
        for option in ("answer_column", "tests_column", "id_column"):
            column = getattr(self, option)
            if column is not None:
                named.setdefault(column, option + (" (default)" if option not in self.model_fields_set else ""))
        return named

    def named_columns(self) -> dict[str, str]:
        """Column -> option, for every column the options name (required ones, then tools, split and metadata columns)."""
        named = self.required_columns()
        for option in ("tools_column", "split_column"):
            if getattr(self, option) is not None:
                named.setdefault(getattr(self, option), option)
        for column in self.metadata_columns:
            named.setdefault(column, "metadata_columns")
        return named


def template_columns(template: str) -> list[str]:
    """The columns a prompt template names, in order; a template with positional or malformed fields is refused."""
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except ValueError as error:
        raise ValueError(f"prompt_template {template!r} is not a valid template: {error}") from None
    names = [f.split(".")[0].split("[")[0] for f in fields]
    if any(not n or n.isdigit() for n in names):
        raise ValueError(f"prompt_template {template!r} has a positional field: name a column, e.g. {{question}}")
    return list(dict.fromkeys(names))


def parse_options(options: dict[str, Any]) -> DatasetOptions:
    """The validated options, or a DatasetError with one line per problem, each naming its option."""
    try:
        return DatasetOptions(**options)
    except ValidationError as error:
        lines = format_validation_error(error, DatasetOptions).removeprefix("invalid config:\n")
        raise DatasetError(f"invalid options of env 'dataset':\n{lines}") from None
