"""Export of a run's trajectories to JSONL and Parquet, and reading them back unchanged."""

from __future__ import annotations

import json
import math
import sys

import pytest

from asyncrl.gateway.export import _parquet_schema, _to_parquet_row, export_trajectories, read_trajectories
from asyncrl.gateway.store import open_store
from asyncrl.records import Turn


@pytest.fixture
def store(tmp_path):
    store = open_store(tmp_path / "run.db")
    done = store.open("arithmetic", "g0", {"problem": "2+2", "nested": {"k": [1, None]}})
    logprobs = [-math.pi, math.nextafter(0.0, -1.0)]
    store.append(
        Turn(
            done, [1, 2], [3, 4], logprobs, [0, 1], timings={"total": 0.25}, temperature=0.7, top_p=0.9, top_k=40,
            routes=[[[0, 3]], [[1, 2]]], kv_versions=[0, 0],
        )
    )  # fmt: skip
    store.append(Turn(done, [1, 2, 3, 4, 9], [5], [-1e-300], [2], finish_reason="length", engine_id="e1"))
    store.finish(done, 1.0, metrics={"tool_calls": 1})
    store.abort(store.open("arithmetic", "g0"), reason="timeout in client")
    store.open("other", "g1")  # still running: exported as it stands
    yield store
    store.close()


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_export_round_trips_exactly(store, tmp_path, suffix) -> None:
    if suffix == ".parquet":
        pytest.importorskip("pyarrow", reason="Parquet export needs pyarrow")
    path = tmp_path / "out" / f"trajectories{suffix}"
    assert export_trajectories(store, path) == 3
    assert read_trajectories(path) == store.list()
    assert not list(path.parent.glob("*.partial"))


def test_export_filters_by_status(store, tmp_path) -> None:
    path = tmp_path / "ok.jsonl"
    assert export_trajectories(store, path, status="ok") == 1
    (only,) = read_trajectories(path)
    assert (only.status, len(only.turns), only.turns[1].logprobs) == ("ok", 2, [-1e-300])


def test_parquet_without_pyarrow_is_a_clear_error(store, tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # makes `import pyarrow` fail like a missing package
    path = tmp_path / "t.parquet"
    with pytest.raises(ImportError, match=r"pip install pyarrow.*jsonl"):
        export_trajectories(store, path)
    assert not path.exists() and not list(tmp_path.glob("*.partial"))


def test_an_unknown_format_is_refused(store, tmp_path) -> None:
    with pytest.raises(ValueError, match=r"\.jsonl or \.parquet"):
        export_trajectories(store, tmp_path / "t.csv")
    assert export_trajectories(store, tmp_path / "t.data", format="jsonl") == 3


SAMPLING = ("temperature", "top_p", "top_k")
LATER_FIELDS = (*SAMPLING, "routes", "kv_versions")


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_files_written_before_turns_carried_sampling_options_routes_or_kv_versions_read_back_without_them(store, tmp_path, suffix) -> None:
    stored = store.list()
    assert (stored[0].turns[0].temperature, stored[0].turns[0].top_p, stored[0].turns[0].top_k) == (0.7, 0.9, 40)
    assert stored[0].turns[0].kv_versions == [0, 0]
    old = [trajectory.to_dict() for trajectory in stored]
    for data in old:
        for turn in data["turns"]:
            for key in LATER_FIELDS:
                del turn[key]
    path = tmp_path / f"old{suffix}"
    if suffix == ".jsonl":
        path.write_text("".join(json.dumps(data) + "\n" for data in old))
    else:
        pa = pytest.importorskip("pyarrow", reason="Parquet export needs pyarrow")
        import pyarrow.parquet as pq

        schema = _parquet_schema(pa)
        turn = schema.field("turns").type.value_type
        old_turn = pa.struct([turn.field(i) for i in range(turn.num_fields) if turn.field(i).name not in LATER_FIELDS])
        old_schema = schema.set(schema.get_field_index("turns"), pa.field("turns", pa.list_(old_turn)))
        pq.write_table(pa.Table.from_pylist([_to_parquet_row(data) for data in old], schema=old_schema), path)
    got = read_trajectories(path)
    unset = [[(None,) * len(LATER_FIELDS)] * len(s.turns) for s in stored]
    assert [[tuple(getattr(t, key) for key in LATER_FIELDS) for t in g.turns] for g in got] == unset
    assert [[t.logprobs for t in g.turns] for g in got] == [[t.logprobs for t in s.turns] for s in stored]
