"""Chat files for SFT (`sft.data`): rows read from JSONL, Parquet or a `datasets` directory, rendered
with the chat template into masked demonstrations (`sft_data.render_demos`), malformed rows counted by
reason or refused, and the held-out split."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.configs.paths import data_path
from asyncrl.configs.schema import SFTDataConfig

from .sft_data import ChatRenderer, Demo, render_demos


class ChatDataError(ValueError):
    """A chat file that cannot be trained on; the message names the file or the `sft.data` key."""


Prepare = Callable[[Any, Any], tuple[list[dict], list[dict] | None]]
"""A row's raw messages and tools -> the template's form, raising ValueError on malformed ones (in a run:
the gateway's `to_template_messages` / `to_template_tools`, the normalisation every RL prompt gets)."""


@dataclass
class ChatRows:
    """The rows of `sft.data`, rendered: training rows, held-out rows and the skipped rows by reason."""

    train: list[Demo]
    heldout: list[Demo]
    skipped: Counter[str]

    @classmethod
    def load(cls, data: SFTDataConfig, renderer: ChatRenderer, prepare: Prepare) -> ChatRows:
        """Read, check and render `data.path` (and `data.eval_path`); refuses an empty file or held-out split."""
        if data.path is None:
            raise ChatDataError("sft.data.path is not set")
        skipped: Counter[str] = Counter()
        rows = _rendered(data.path, data, renderer, prepare, skipped)
        if not rows:
            raise ChatDataError(f"sft.data.path: no usable rows in {data.path} ({_reasons(skipped)})")
        if data.eval_path is not None:
            train, heldout = [demo for _, demo in rows], [demo for _, demo in _rendered(data.eval_path, data, renderer, prepare, skipped)]
            if not heldout:
                raise ChatDataError(f"sft.data.eval_path: no usable rows in {data.eval_path} ({_reasons(skipped)})")
        else:
            train = [demo for key, demo in rows if key >= data.heldout_fraction]
            heldout = [demo for key, demo in rows if key < data.heldout_fraction]
            if data.heldout_fraction > 0 and (not heldout or not train):
                side = "no row" if not heldout else "every row"
                raise ChatDataError(f"sft.data.heldout_fraction={data.heldout_fraction} holds out {side} of {len(rows)}")
        return cls(train, heldout, skipped)


def _reasons(skipped: Counter[str]) -> str:
    return ", ".join(f"{count} {reason}" for reason, count in skipped.most_common()) or "the file has no rows"


class _Malformed(Exception):
    pass


def _rendered(path: str, data: SFTDataConfig, renderer: ChatRenderer, prepare: Prepare, skipped: Counter[str]) -> list[tuple[float, Demo]]:
    """(held-out key in [0, 1), demonstration) for each usable row (one per assistant turn where the template is not
    prefix-stable, `render_demos`); the key is a hash of the row's messages, so a row's turns stay on one side."""
    out = []
    for where, row in _read(path, data.messages_column, data.tools_column):
        try:
            if isinstance(row, Exception):
                raise _Malformed("not JSON")
            if not isinstance(row, Mapping):
                raise _Malformed("not an object")
            if row.get(data.messages_column) is None:
                raise _Malformed(f"no {data.messages_column!r}")
            try:
                messages, tools = prepare(row[data.messages_column], row.get(data.tools_column))
                demos = render_demos(renderer, messages, tools)
            except ValueError as err:
                raise _Malformed(f"invalid messages ({err})") from err
            if not any(message["role"] == "assistant" for message in messages):
                raise _Malformed("no assistant message")
            if max(len(demo.token_ids) for demo in demos) > data.max_length:
                raise _Malformed(f"longer than sft.data.max_length={data.max_length}")
        except _Malformed as bad:
            if data.on_malformed == "refuse":
                raise ChatDataError(f"{where}: {bad} (sft.data.on_malformed=refuse)") from None
            skipped[str(bad).split(" (")[0]] += 1
            continue
        canonical = json.dumps(row[data.messages_column], sort_keys=True, default=str).encode()
        out += [(int.from_bytes(hashlib.sha256(canonical).digest()[:8], "big") / 2**64, demo) for demo in demos]
    return out


def _read(path: str, messages_column: str, tools_column: str) -> Iterator[tuple[str, Any]]:
    """(where, row) of a JSONL file, a Parquet file or a `datasets` directory; a line that is not JSON
    comes as its error. A messages column that no row has is refused with the columns the file has."""
    file = data_path(path)
    if not file.exists():
        raise ChatDataError(f"{path}: no such file or directory")
    try:
        if file.is_dir():
            rows, columns = _dataset_rows(file, messages_column, tools_column)
        elif file.suffix == ".parquet":
            rows, columns = _parquet_rows(file, messages_column, tools_column)
        elif file.suffix in (".jsonl", ".json"):
            yield from _jsonl_rows(file, messages_column)
            return
        else:
            raise ChatDataError(f"{path}: expected a .jsonl or .parquet file or a datasets directory")
    except (OSError, ValueError) as err:  # pyarrow's and datasets' read errors are among these
        raise err if isinstance(err, ChatDataError) else ChatDataError(f"{path}: cannot read it: {err}") from err
    if messages_column not in columns:
        raise ChatDataError(f"sft.data.messages_column: {path} has no column {messages_column!r}; its columns: {', '.join(columns)}")
    for number, row in enumerate(rows, 1):
        yield f"{path} row {number}", row


def _jsonl_rows(file: Path, messages_column: str) -> Iterator[tuple[str, Any]]:
    seen: set[str] = set()
    found = False
    with file.open("rb") as lines:
        for number, raw in enumerate(lines, 1):
            if not raw.strip():
                continue
            try:
                row: Any = json.loads(raw)
            except ValueError as err:  # not JSON, or not UTF-8: this line only
                row = err
            if isinstance(row, dict):
                seen.update(row)
                found = found or messages_column in row
            yield f"{file}:{number}", row
    if seen and not found:
        raise ChatDataError(f"sft.data.messages_column: {file} has no column {messages_column!r}; its columns: {', '.join(sorted(seen))}")


def _parquet_rows(file: Path, messages_column: str, tools_column: str) -> tuple[Iterator[Any], list[str]]:
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(file)
    columns = list(parquet.schema_arrow.names)
    wanted = [name for name in (messages_column, tools_column) if name in columns]
    return (row for batch in parquet.iter_batches(batch_size=1024, columns=wanted) for row in batch.to_pylist()), columns


def _dataset_rows(directory: Path, messages_column: str, tools_column: str) -> tuple[Iterator[Any], list[str]]:
    import datasets

    loaded = datasets.load_from_disk(str(directory))
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise ChatDataError(f"{directory}: a DatasetDict without a 'train' split (splits: {', '.join(loaded)})")
        loaded = loaded["train"]
    columns = list(loaded.column_names)
    wanted = [name for name in (messages_column, tools_column) if name in columns]
    return (iter(loaded.select_columns(wanted)) if messages_column in columns else iter(())), columns
