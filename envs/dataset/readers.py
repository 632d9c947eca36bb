"""Rows of a dataset file, read lazily: a file larger than memory is scanned once, then read row by row.

A `Source` scans its rows in order, each with a *position* that reads it again later (`read`):
- JSONL: the byte offset of its line; CSV: the byte offset of its record (a quoted field may span lines);
- Parquet: the row's index in the file, read back from its row group (one decoded row group is kept);
- a Hugging Face dataset (`load_from_disk`, or `load_dataset` on local files): its index in the
  memory-mapped Arrow table.
Only positions are kept in memory, never rows. A scan yields a row as a dict of its columns, or the
reason it is malformed as a string (the caller counts or refuses it). A file that cannot be opened at
all is a `DatasetError` naming the file and the reader's own error.
"""

from __future__ import annotations

import bisect
import csv
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from asyncrl.configs.paths import data_path

from .options import DatasetError, Format

Scanned = tuple[int, dict[str, Any] | str]
"""(position, the row's columns or why it is malformed)."""

SCAN_BATCH = 256
"""Rows decoded at a time from a columnar file while scanning (long rows: a few MB at most)."""
CSV_FIELD_LIMIT = 2**31 - 1
"""Prompts and tests can be longer than the csv module's 128 KiB default field limit."""
SAVED_DATASET_FILES = ("dataset_info.json", "state.json", "dataset_dict.json")
LOAD_DATASET_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}


class Source(Protocol):
    path: str
    columns: list[str] | None
    """The file's columns: from its schema, or (JSONL) every key seen once a scan has ended."""

    def scan(self) -> Iterator[Scanned]: ...

    def read(self, position: int) -> dict[str, Any]: ...


def open_source(path: str, format: Format = "auto", *, hf_split: str = "train", cache_dir: str | None = None) -> Source:
    """The reader for `path` in `format` (auto: by extension, or what a directory holds)."""
    where = data_path(path)
    if not where.exists():
        raise DatasetError(f"dataset file {path} does not exist")
    path = str(where)
    kind = detect_format(where) if format == "auto" else format
    try:
        if kind == "jsonl":
            return JsonlSource(path)
        if kind == "csv":
            return CsvSource(path)
        if kind == "parquet":
            return ParquetSource(path)
        return HfSource.open(path, saved=kind == "hf_disk", split=hf_split, cache_dir=cache_dir)
    except DatasetError:
        raise
    except Exception as error:  # each library has its own errors; the user needs the file and the message
        raise DatasetError(f"cannot read {path} as {kind}: {type(error).__name__}: {error}") from error


def detect_format(path: Path) -> Format:
    if path.is_dir():
        return "hf_disk" if any((path / name).exists() for name in SAVED_DATASET_FILES) else "hf"
    suffix = path.suffix.lower()
    formats: dict[str, Format] = {
        ".jsonl": "jsonl",
        ".ndjson": "jsonl",
        ".csv": "csv",
        ".parquet": "parquet",
        ".pq": "parquet",
        ".json": "hf",
    }
    if suffix not in formats:
        raise DatasetError(f"cannot tell the format of {path} from its extension; set format: jsonl, csv, parquet, hf_disk or hf")
    return formats[suffix]


class JsonlSource:
    """One JSON object per line; blank lines are skipped."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.columns: list[str] | None = None
        with open(path, "rb"):  # unreadable (a directory, no permission) fails here, at start-up
            pass

    def scan(self) -> Iterator[Scanned]:
        seen: dict[str, None] = {}
        offset = 0
        with open(self.path, "rb") as lines:
            for line in lines:
                start, offset = offset, offset + len(line)
                if not line.strip():
                    continue
                row = _json_object(line)
                if isinstance(row, dict):
                    seen.update(dict.fromkeys(row))
                yield start, row
        self.columns = list(seen)

    def read(self, position: int) -> dict[str, Any]:
        with open(self.path, "rb") as lines:
            lines.seek(position)
            row = _json_object(lines.readline())
        if isinstance(row, str):
            raise DatasetError(f"{self.path} changed since it was scanned: the row at byte {position} is now malformed ({row})")
        return row


def _json_object(line: bytes) -> dict[str, Any] | str:
    try:
        row = json.loads(line)
    except ValueError as error:  # UnicodeDecodeError is a ValueError too
        return f"not JSON ({error})"
    return row if isinstance(row, dict) else f"a JSON {type(row).__name__}, not an object"


class _Lines:
    """Lines of a binary file as text, with the offset just past the last one handed out: csv.reader
    pulls exactly the lines of one record, so between records `end` is where the next one starts."""

    def __init__(self, file: Any) -> None:
        self.file, self.end = file, file.tell()

    def __iter__(self) -> _Lines:
        return self

    def __next__(self) -> str:
        line = self.file.readline()
        if not line:
            raise StopIteration
        self.end += len(line)
        return line.decode("utf-8")


class CsvSource:
    """A CSV file with a header row; every value is a string (JSON columns are parsed by the column mapping)."""

    def __init__(self, path: str) -> None:
        csv.field_size_limit(CSV_FIELD_LIMIT)
        self.path = path
        with open(path, "rb") as file:
            header = next(csv.reader(_Lines(file)), None)
        self.columns: list[str] | None = header or []

    def scan(self) -> Iterator[Scanned]:
        columns = self.columns or []
        with open(self.path, "rb") as file:
            lines = _Lines(file)
            reader = csv.reader(lines)
            next(reader, None)
            while True:
                start = lines.end
                try:
                    record = next(reader)
                except StopIteration:
                    return
                except (csv.Error, UnicodeDecodeError) as error:
                    yield start, f"not CSV ({error})"
                    reader = csv.reader(lines)  # carry on with the next line
                    continue
                if not record:
                    continue
                if len(record) != len(columns):
                    yield start, f"{len(record)} fields where the header has {len(columns)}"
                    continue
                yield start, dict(zip(columns, record, strict=True))

    def read(self, position: int) -> dict[str, Any]:
        with open(self.path, "rb") as file:
            file.seek(position)
            record = next(csv.reader(_Lines(file)))
        return dict(zip(self.columns or [], record, strict=True))


class ParquetSource:
    """A Parquet file, decoded one row group at a time (only the columns the task reads, once `select`ed)."""

    def __init__(self, path: str) -> None:
        import pyarrow.parquet as pq

        self.path = path
        self.file = pq.ParquetFile(path)
        self.columns: list[str] | None = list(self.file.schema_arrow.names)
        metadata = self.file.metadata
        self._starts = [0]
        for group in range(metadata.num_row_groups):
            self._starts.append(self._starts[-1] + metadata.row_group(group).num_rows)
        self._wanted: list[str] | None = None
        self._group: tuple[int, Any] | None = None
        """The row group read last, kept decoded: samples drawn close together in a sorted file often share it."""

    def select(self, columns: list[str]) -> None:
        """Read only these columns (those the task maps) from now on."""
        self._wanted = [c for c in columns if c in (self.columns or [])]

    def scan(self) -> Iterator[Scanned]:
        position = 0
        # Group by group: over the whole file at once, Arrow buffers far ahead of the batch it hands out.
        for group in range(self.file.metadata.num_row_groups):
            for batch in self.file.iter_batches(batch_size=SCAN_BATCH, row_groups=[group], columns=self._wanted):
                for row in batch.to_pylist():
                    yield position, row
                    position += 1

    def read(self, position: int) -> dict[str, Any]:
        group = bisect.bisect_right(self._starts, position) - 1
        if self._group is None or self._group[0] != group:
            self._group = None  # freed before the next one is decoded: one row group in memory, not two
            self._group = (group, self.file.read_row_group(group, columns=self._wanted))
        return self._group[1].slice(position - self._starts[group], 1).to_pylist()[0]


class HfSource:
    """A Hugging Face `datasets.Dataset`: memory-mapped Arrow on disk, read by index."""

    def __init__(self, path: str, dataset: Any) -> None:
        self.path, self.dataset = path, dataset
        self.columns: list[str] | None = list(dataset.column_names)

    @classmethod
    def open(cls, path: str, *, saved: bool, split: str, cache_dir: str | None) -> HfSource:
        import datasets

        if saved:
            loaded = datasets.load_from_disk(path)
        else:
            where = Path(path)
            if where.is_file():
                builder = LOAD_DATASET_BUILDERS.get(where.suffix.lower())
                if builder is None:
                    raise DatasetError(f"load_dataset cannot read {path}: no builder for {where.suffix!r} files")
                loaded = datasets.load_dataset(builder, data_files=path, cache_dir=cache_dir)
            else:
                loaded = datasets.load_dataset(path, cache_dir=cache_dir)
        if isinstance(loaded, (datasets.DatasetDict, dict)):
            if split not in loaded:
                raise DatasetError(f"{path} has no split {split!r}; its splits: {', '.join(loaded)} (set hf_split / hf_eval_split)")
            loaded = loaded[split]
        return cls(path if split == "train" else f"{path} [{split}]", loaded)

    def select(self, columns: list[str]) -> None:
        wanted = [c for c in columns if c in (self.columns or [])]
        self.dataset = self.dataset.select_columns(wanted)

    def scan(self) -> Iterator[Scanned]:
        position = 0
        for batch in self.dataset.iter(batch_size=SCAN_BATCH):
            names = list(batch)
            for values in zip(*(batch[n] for n in names), strict=True):
                yield position, dict(zip(names, values, strict=True))
                position += 1

    def read(self, position: int) -> dict[str, Any]:
        return self.dataset[position]
