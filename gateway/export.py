"""Export a run's trajectories to a file, and read them back, for replay and offline analysis.

JSONL (one trajectory a line, always available) or Parquet (one row a trajectory, turns as a nested
list; needs pyarrow). The file is written beside its final name and renamed at the end, so an
interrupted export never leaves a file that looks complete. Files written before turns carried their
sampling options, MoE routes or KV versions read back with those unset (None: the learner assumes the
run's sampling options, and takes each token's KV as new as its sampling version).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from asyncrl.records import Trajectory

from .store.base import TrajectoryReader

Format = Literal["jsonl", "parquet"]
_PAGE = 256
# Free-form mappings become JSON text in Parquet: their keys differ from row to row.
_JSON_FIELDS = ("metadata", "metrics")


def export_trajectories(store: TrajectoryReader, path: str | Path, *, format: Format | None = None, status: str | None = None) -> int:
    """Write every trajectory in `store` (or those with `status`) to `path`; returns how many.

    The format follows the suffix (.jsonl, .parquet) unless given.
    """
    path = Path(path)
    format = format or _format_of(path)
    pages = _pages(store, status)
    tmp = path.with_name(path.name + ".partial")
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        written = _write_parquet(pages, tmp) if format == "parquet" else _write_jsonl(pages, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return written


def read_trajectories(path: str | Path, *, format: Format | None = None) -> list[Trajectory]:
    """The trajectories of an exported file, exactly as they were stored."""
    path = Path(path)
    if (format or _format_of(path)) == "parquet":
        rows = _pyarrow()[1].read_table(path).to_pylist()
        return [Trajectory.from_dict(_from_parquet_row(row)) for row in rows]
    with path.open() as lines:
        return [Trajectory.from_dict(json.loads(line)) for line in lines if line.strip()]


def _format_of(path: Path) -> Format:
    if path.suffix in (".jsonl", ".parquet"):
        return path.suffix[1:]  # type: ignore[return-value]
    raise ValueError(f"cannot tell the export format of {str(path)!r}: name it .jsonl or .parquet, or pass format=")


def _pages(store: TrajectoryReader, status: str | None) -> Iterator[list[Trajectory]]:
    offset = 0
    while page := store.list(status=status, limit=_PAGE, offset=offset):
        yield page
        offset += len(page)


def _write_jsonl(pages: Iterator[list[Trajectory]], path: Path) -> int:
    written = 0
    with path.open("w") as out:
        for page in pages:
            for trajectory in page:
                out.write(json.dumps(trajectory.to_dict(), separators=(",", ":")) + "\n")
            written += len(page)
    return written


def _write_parquet(pages: Iterator[list[Trajectory]], path: Path) -> int:
    pa, pq = _pyarrow()
    schema = _parquet_schema(pa)
    written = 0
    with pq.ParquetWriter(path, schema) as writer:
        for page in pages:
            rows = [_to_parquet_row(trajectory.to_dict()) for trajectory in page]
            writer.write_table(pa.Table.from_pylist(rows, schema=schema))
            written += len(page)
    return written


def _pyarrow() -> tuple[Any, Any]:
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError as error:
        raise ImportError(
            "Parquet export needs pyarrow, which is not installed: `pip install pyarrow`, or export to a .jsonl file instead"
        ) from error
    return pyarrow, pyarrow.parquet


def _parquet_schema(pa: Any) -> Any:
    turn = pa.struct([
        ("rollout_id", pa.string()),
        ("prompt_token_ids", pa.list_(pa.int64())),
        ("completion_token_ids", pa.list_(pa.int64())),
        ("logprobs", pa.list_(pa.float64())),
        ("versions", pa.list_(pa.int64())),
        ("finish_reason", pa.string()),
        ("index", pa.int64()),
        ("branch", pa.int64()),
        ("engine_id", pa.string()),
        ("timings", pa.map_(pa.string(), pa.float64())),
        ("created_at", pa.float64()),
        ("temperature", pa.float64()),
        ("top_p", pa.float64()),
        ("top_k", pa.int64()),
        ("routes", pa.list_(pa.list_(pa.list_(pa.int64())))),
        ("kv_versions", pa.list_(pa.int64())),
    ])  # fmt: skip
    return pa.schema([
        ("rollout_id", pa.string()),
        ("task", pa.string()),
        ("group_id", pa.string()),
        ("metadata", pa.string()),
        ("turns", pa.list_(turn)),
        ("status", pa.string()),
        ("reward", pa.float64()),
        ("metrics", pa.string()),
        ("reason", pa.string()),
        ("created_at", pa.float64()),
        ("finished_at", pa.float64()),
    ])  # fmt: skip


def _to_parquet_row(data: dict[str, Any]) -> dict[str, Any]:
    return {**data, **{key: json.dumps(data[key]) for key in _JSON_FIELDS}}


def _from_parquet_row(row: dict[str, Any]) -> dict[str, Any]:
    row = {**row, **{key: json.loads(row[key]) for key in _JSON_FIELDS}}
    # pyarrow reads a map column back as a list of (key, value) pairs.
    row["turns"] = [{**turn, "timings": dict(turn["timings"] or [])} for turn in row["turns"]]
    return row
