"""The training and held-out splits of a dataset, built by one scan of its file(s) at start-up.

The held-out split is, in this order of precedence (only one may be configured):
- a file (`eval_path`) or a split of a Hugging Face dataset (`hf_eval_split`);
- a column (`split_column`): rows whose value is in `eval_values` are held out, those in
  `train_values` train, others are in neither;
- a stable hash (`heldout_fraction`): blake2b of the id column, or of the prompt without one, so
  the split survives re-ordering the file and duplicates of one prompt fall on the same side.
With a file or a column, training rows whose key (id, else prompt) is also held out are dropped, so
the two splits stay disjoint. Each split keeps only its rows' positions (envs/dataset/readers.py):
8 bytes a row for the position and 8 for the row number, whatever the size of the rows (with a file
or a column, 8 more a training row and a set of the held-out keys while the scan runs).

Malformed rows are counted and skipped (the first few reasons logged), or refused with
`on_bad_row: error`. A dataset without usable rows, or an empty split, is refused, naming the file
and the rule that emptied it.
"""

from __future__ import annotations

import hashlib
import logging
from array import array
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from asyncrl.envs.arithmetic import is_heldout

from .columns import BadRow, ColumnMap
from .options import DatasetError, DatasetOptions
from .readers import Source, open_source
from .row import DatasetRow

log = logging.getLogger(__name__)

Picker = Callable[[dict, str], "SplitRows | None"]
"""(raw row, its split key) -> the split it belongs to, or None for neither."""
EXAMPLES = 5
"""Malformed rows quoted in the start-up report."""


@dataclass
class SplitRows:
    """The rows of one split: positions in `source`, read and mapped on demand."""

    source: Source
    columns: ColumnMap
    label: str
    """How row ids name the file (its file name)."""
    positions: array = field(default_factory=lambda: array("q"))
    numbers: array = field(default_factory=lambda: array("q"))

    def __len__(self) -> int:
        return len(self.positions)

    def add(self, position: int, number: int) -> None:
        self.positions.append(position)
        self.numbers.append(number)

    def row(self, index: int) -> DatasetRow:
        """The `index`-th row of the split as a task."""
        raw = self.source.read(self.positions[index])
        return self.columns.row(raw, self.numbers[index], self.label)


@dataclass
class ScanReport:
    """What one file's scan found, logged at start-up and kept on the environment (`env.reports`)."""

    path: str
    rows: int = 0
    """Rows read (malformed ones included)."""
    malformed: int = 0
    examples: list[str] = field(default_factory=list)
    """The first malformed rows: 'row N: reason'."""
    outside: Counter = field(default_factory=Counter)
    """split_column values in neither train_values nor eval_values -> rows."""
    overlap: int = 0
    """Training rows dropped because the same id or prompt is held out."""


def build_splits(options: DatasetOptions) -> tuple[SplitRows, SplitRows, list[ScanReport]]:
    """(train, eval, reports): the scanned splits of the configured dataset; DatasetError when unusable."""
    columns = ColumnMap(options)
    source = _open(options, options.path, options.hf_split)
    train = SplitRows(source, columns, _label(options.path))
    if options.eval_path is not None or options.hf_eval_split is not None:
        eval_source = _open(options, options.eval_path or options.path, options.hf_eval_split or options.hf_split)
        heldout = SplitRows(eval_source, columns, _eval_label(options, train.label))
        eval_report, eval_keys = _scan(eval_source, columns, options, lambda raw, key: heldout, heldout=heldout, dedupe=True)
        report, _ = _scan(source, columns, options, lambda raw, key: train, heldout=heldout, dedupe=False, drop=eval_keys)
        reports = [report, eval_report]
        rule = f"eval_path {options.eval_path}" if options.eval_path else f"hf_eval_split {options.hf_eval_split!r}"
    else:
        heldout = SplitRows(source, columns, train.label)
        if options.split_column is not None:
            by_value = {**dict.fromkeys(map(str, options.train_values), train), **dict.fromkeys(map(str, options.eval_values), heldout)}
            column = options.split_column

            def pick(raw: dict, key: str) -> SplitRows | None:
                return by_value.get(str(raw.get(column)))

            rule = f"split_column {column!r} (train_values {options.train_values}, eval_values {options.eval_values})"
        else:
            fraction = options.heldout_fraction

            def pick(raw: dict, key: str) -> SplitRows | None:
                return heldout if is_heldout(key, fraction) else train

            rule = f"heldout_fraction {fraction} (a hash of {'the id column' if options.id_column else 'the prompt'})"
        report, _ = _scan(source, columns, options, pick, heldout=heldout, dedupe=options.split_column is not None)
        reports = [report]
    for report in reports:
        _log(report)
    _refuse_empty(train, heldout, reports, rule)
    return train, heldout, reports


def _open(options: DatasetOptions, path: str, hf_split: str) -> Source:
    source = open_source(path, options.format, hf_split=hf_split, cache_dir=options.hf_cache_dir)
    if source.columns is not None:
        ColumnMap(options).check(source.path, source.columns)  # a schema: refuse a missing column before the scan
    select = getattr(source, "select", None)
    if select is not None:
        select(list(options.named_columns()))
    return source


def _label(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]


def _eval_label(options: DatasetOptions, train_label: str) -> str:
    """How row ids name the held-out file: never as the training file is named, so ids stay unique."""
    if options.eval_path is None:
        return f"{train_label}[{options.hf_eval_split}]"
    label = _label(options.eval_path)
    return label if label != train_label else options.eval_path


def _key_hash(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big", signed=True)


def _scan(
    source: Source,
    columns: ColumnMap,
    options: DatasetOptions,
    pick: Picker,
    *,
    heldout: SplitRows,
    dedupe: bool,
    drop: set[int] | None = None,
) -> tuple[ScanReport, set[int]]:
    """Scan `source` into the split `pick(raw, key)` chooses for each row (None: neither); returns the
    report and, with `dedupe`, the key hashes of the rows held out (training rows sharing one are
    dropped at the end). `drop`: key hashes of rows held out elsewhere (another file), dropped as read."""
    report = ScanReport(source.path)
    heldout_keys: set[int] = set()
    trained: SplitRows | None = None
    hashes = array("q")  # key hashes of `trained`'s rows, with `dedupe`
    try:
        for number, (position, raw) in enumerate(source.scan()):
            report.rows += 1
            try:
                if isinstance(raw, str):
                    raise BadRow(raw)
                row = columns.row(raw, number, "")
            except BadRow as bad:
                _malformed(report, options, number, str(bad))
                continue
            key = columns.split_key(row, raw)
            split = pick(raw, key)
            if split is None:
                report.outside[str(raw.get(options.split_column or ""))] += 1
                continue
            hashed = _key_hash(key) if dedupe or drop else 0
            if drop and hashed in drop:
                report.overlap += 1
                continue
            if dedupe and split is heldout:
                heldout_keys.add(hashed)
            elif dedupe:
                trained = split
                hashes.append(hashed)
            split.add(position, number)
    except DatasetError:
        raise
    except Exception as error:  # a file damaged past its header: name it and the reader's error
        raise DatasetError(f"cannot read {source.path}: {type(error).__name__}: {error}") from error
    if source.columns is not None:
        columns.check(source.path, source.columns)  # JSONL: the columns are known now
    if trained is not None and heldout_keys:
        report.overlap += _drop_overlap(trained, hashes, heldout_keys)
    return report, heldout_keys


def _drop_overlap(split: SplitRows, hashes: array, heldout_keys: set[int]) -> int:
    """Remove `split`'s rows whose key hash is held out; how many were removed."""
    keep = [i for i, hashed in enumerate(hashes) if hashed not in heldout_keys]
    removed = len(split) - len(keep)
    if removed:
        split.positions = array("q", (split.positions[i] for i in keep))
        split.numbers = array("q", (split.numbers[i] for i in keep))
    return removed


def _malformed(report: ScanReport, options: DatasetOptions, number: int, reason: str) -> None:
    if options.on_bad_row == "error":
        raise DatasetError(f"{report.path}: row {number} is malformed: {reason} (on_bad_row: error; skip: on_bad_row: skip)")
    report.malformed += 1
    if len(report.examples) < EXAMPLES:
        report.examples.append(f"row {number}: {reason}")


def _log(report: ScanReport) -> None:
    if report.malformed:
        log.warning(
            "dataset %s: skipped %d malformed rows of %d; first: %s", report.path, report.malformed, report.rows, "; ".join(report.examples)
        )
    if report.overlap:
        log.warning("dataset %s: dropped %d training rows also in the held-out split", report.path, report.overlap)
    if report.outside:
        log.info("dataset %s: %d rows in neither split (split values %s)", report.path, sum(report.outside.values()), dict(report.outside))


def _refuse_empty(train: SplitRows, heldout: SplitRows, reports: list[ScanReport], rule: str) -> None:
    main = reports[0]
    if not len(train) and not len(heldout):
        detail = f"; {main.malformed} malformed, first: {main.examples[0]}" if main.examples else ""
        raise DatasetError(f"dataset {main.path} has no usable rows ({main.rows} read{detail})")
    for split, name in ((train, "training"), (heldout, "held-out")):
        if not len(split):
            seen = f"; split values seen: {dict(main.outside)}" if main.outside else ""
            raise DatasetError(f"the {name} split of dataset {main.path} is empty under {rule}{seen}")
