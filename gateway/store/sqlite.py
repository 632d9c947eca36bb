"""The embedded trajectory store: one SQLite file per run, in WAL mode.

WAL lets readers (a debugging view, an export) run while the gateway writes. Every write is a short
`BEGIN IMMEDIATE` transaction (or a savepoint of one, inside `transaction()`: the gateway commits
the writes that queued up meanwhile together), which takes the write lock up front: two processes can then never
both read, decide, and deadlock upgrading to a write. Each thread (and each forked process) gets its
own connection, because a sqlite3 connection must not be shared across either.
"""

from __future__ import annotations

import functools
import json
import sqlite3
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Concatenate, ParamSpec, TypeVar

from asyncrl.records import Trajectory, Turn

from .base import (
    COUNT_KEYS,
    DEFAULT_VISIBILITY_TIMEOUT_S,
    StoreError,
    check_claim,
    check_finish,
    check_index,
    closed_error,
    delete_refused,
    turn_from_json,
    turn_json,
    unknown_error,
)
from .sqlite_connections import ThreadConnections

_SCHEMA = """
CREATE TABLE IF NOT EXISTS trajectories (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    rollout_id TEXT NOT NULL UNIQUE,
    task TEXT NOT NULL,
    group_id TEXT NOT NULL,
    metadata TEXT NOT NULL,
    status TEXT NOT NULL,
    reward REAL,
    metrics TEXT NOT NULL DEFAULT '{}',
    reason TEXT NOT NULL DEFAULT '',
    created_at REAL NOT NULL,
    finished_at REAL,
    done_seq INTEGER,      -- order of reaching a terminal status: the hand-off order
    claimed_by TEXT,
    claimed_at REAL,
    deliveries INTEGER NOT NULL DEFAULT 0,
    acked_at REAL
);
-- The hand-off reads two small partial indexes: finished and never claimed, in done order; claimed
-- and not acknowledged, by claim time (a claim expires after the visibility timeout). One index of
-- everything unacknowledged made each claim scan every claimed row since the last checkpoint's acks:
-- 10% of the driver's CPU in an RL run at ~10k rows.
DROP INDEX IF EXISTS handoff;
CREATE INDEX IF NOT EXISTS unclaimed ON trajectories(done_seq) WHERE done_seq IS NOT NULL AND acked_at IS NULL AND claimed_at IS NULL;
CREATE INDEX IF NOT EXISTS claimed ON trajectories(claimed_at) WHERE acked_at IS NULL AND claimed_at IS NOT NULL;
-- MAX(done_seq), taken on every finish, reads this index's last entry; the partial index above
-- cannot answer it, and a table scan made each finish O(rollouts so far): 0.4 -> 2.5 ms at 40k.
CREATE INDEX IF NOT EXISTS done_order ON trajectories(done_seq);
CREATE TABLE IF NOT EXISTS turns (
    rollout_id TEXT NOT NULL,
    idx INTEGER NOT NULL,
    data TEXT NOT NULL,
    PRIMARY KEY (rollout_id, idx)
) WITHOUT ROWID;
-- Gateway replicas sharing this file (replicas on one machine): who answers where, until when.
CREATE TABLE IF NOT EXISTS replicas (
    replica_id TEXT PRIMARY KEY,
    url TEXT NOT NULL,
    until REAL NOT NULL
) WITHOUT ROWID;
"""

_HEADER = "rollout_id, task, group_id, metadata, status, reward, metrics, reason, created_at, finished_at"
_CHUNK = 500
"""Ids per `IN (...)` query: well under SQLite's bound on host parameters."""
_POLL_S = 0.05
"""How often a blocking claim looks again: SQLite has no cross-process notification."""

P = ParamSpec("P")
R = TypeVar("R")


def _counted(method: Callable[Concatenate[SQLiteStore, P], R]) -> Callable[Concatenate[SQLiteStore, P], R]:
    """A store method as one counted call (`ThreadConnections.call`: `close` waits for it)."""

    @functools.wraps(method)
    def counted(self: SQLiteStore, *args: P.args, **kwargs: P.kwargs) -> R:
        with self._connections.call():
            return method(self, *args, **kwargs)

    return counted


class SQLiteStore:
    """`TrajectoryStore` over one SQLite file, safe from several threads and processes."""

    def __init__(self, path: str | Path, *, visibility_timeout_s: float = DEFAULT_VISIBILITY_TIMEOUT_S, read_only: bool = False) -> None:
        """`read_only`: open an existing file for reading only (SQLite refuses every write), as replay
        and inspection do, so reading a run can never change it."""
        self.path = Path(path)
        self.visibility_timeout_s = visibility_timeout_s
        self.read_only = read_only
        self._connections = ThreadConnections(self._connect, repr(self))
        self._local = self._connections.local
        if read_only:
            if not self.path.is_file():
                raise FileNotFoundError(f"{self.path}: no such trajectory store")
            self._db()
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db().executescript(_SCHEMA)

    def __repr__(self) -> str:
        return f"SQLiteStore({str(self.path)!r})"

    # -- connections and transactions -------------------------------------------------------------

    def _connect(self) -> sqlite3.Connection:
        # isolation_level=None: we issue BEGIN ourselves, so no transaction opens behind our back.
        if self.read_only:
            uri = f"{self.path.resolve().as_uri()}?mode=ro"
            return sqlite3.connect(uri, uri=True, timeout=60.0, isolation_level=None, check_same_thread=False)
        db = sqlite3.connect(self.path, timeout=60.0, isolation_level=None, check_same_thread=False)
        db.execute("PRAGMA journal_mode=WAL")
        # NORMAL in WAL mode survives a process crash; only a power loss can drop the last commits.
        db.execute("PRAGMA synchronous=NORMAL")
        return db

    def _db(self) -> sqlite3.Connection:
        return self._connections.get()

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        db = self._db()
        if getattr(self._local, "batching", False):
            # Inside `transaction()`: a savepoint, so a refusal undoes this write alone.
            db.execute("SAVEPOINT write")
            try:
                yield db
            except BaseException:
                db.execute("ROLLBACK TO write")
                db.execute("RELEASE write")
                raise
            db.execute("RELEASE write")
            return
        db.execute("BEGIN IMMEDIATE")
        try:
            yield db
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """Run this thread's calls inside as one transaction (each write a savepoint of it), committed
        at the end: one commit for many writes (gateway/store_calls.py). Not reentrant."""
        with self._connections.call():
            db = self._db()
            db.execute("BEGIN IMMEDIATE")
            self._local.batching = True
            try:
                yield
            except BaseException:
                db.execute("ROLLBACK")
                raise
            finally:
                self._local.batching = False
            db.execute("COMMIT")

    def close(self) -> None:
        """Refuse new calls, wait for those in progress (`ThreadConnections.close`), close every connection."""
        self._connections.close()

    # -- the rollout lifecycle --------------------------------------------------------------------

    @_counted
    def open(self, task: str = "", group_id: str = "", metadata: dict | None = None, *, rollout_id: str | None = None) -> str:
        rollout_id = rollout_id or uuid.uuid4().hex
        try:
            with self._write() as db:
                db.execute(
                    "INSERT INTO trajectories (rollout_id, task, group_id, metadata, status, created_at) VALUES (?, ?, ?, ?, 'running', ?)",
                    (rollout_id, task, group_id, json.dumps(metadata or {}), time.time()),
                )
        except sqlite3.IntegrityError:
            raise StoreError(f"rollout id {rollout_id!r} is already in use in {self!r}") from None
        return rollout_id

    @_counted
    def append(self, turn: Turn) -> int:
        with self._write() as db:
            self._require_running(db, turn.rollout_id, "append a turn to")
            # Turns are numbered 0, 1, ... and never deleted while the rollout runs, so the count is the last
            # index + 1: one seek to the end of the rollout's key range, where COUNT(*) walked every turn's page.
            (index,) = db.execute("SELECT COALESCE(MAX(idx), -1) + 1 FROM turns WHERE rollout_id = ?", (turn.rollout_id,)).fetchone()
            check_index(turn, index)
            db.execute("INSERT INTO turns VALUES (?, ?, ?)", (turn.rollout_id, index, turn_json(turn)))
        return index

    @_counted
    def finish(self, rollout_id: str, reward: float, status: str = "ok", metrics: dict | None = None, reason: str = "") -> None:
        check_finish(rollout_id, reward, status)
        self._end(rollout_id, status, float(reward), metrics or {}, reason, "finish")

    @_counted
    def abort(self, rollout_id: str, reason: str = "") -> None:
        self._end(rollout_id, "aborted", None, {}, reason, "abort")

    def _end(self, rollout_id: str, status: str, reward: float | None, metrics: dict, reason: str, verb: str) -> None:
        with self._write() as db:
            self._require_running(db, rollout_id, verb)
            db.execute(
                "UPDATE trajectories SET status = ?, reward = ?, metrics = ?, reason = ?, finished_at = ?,"
                " done_seq = (SELECT COALESCE(MAX(done_seq), 0) + 1 FROM trajectories) WHERE rollout_id = ?",
                (status, reward, json.dumps(metrics), reason, time.time(), rollout_id),
            )

    def _require_running(self, db: sqlite3.Connection, rollout_id: str, verb: str) -> None:
        row = db.execute("SELECT status FROM trajectories WHERE rollout_id = ?", (rollout_id,)).fetchone()
        if row is None:
            raise unknown_error(rollout_id)
        if row[0] != "running":
            raise closed_error(rollout_id, row[0], verb)

    # -- the replicas' directory ------------------------------------------------------------------

    @_counted
    def announce_replica(self, replica_id: str, url: str, ttl_s: float) -> None:
        with self._write() as db:
            db.execute("INSERT OR REPLACE INTO replicas VALUES (?, ?, ?)", (replica_id, url, time.time() + ttl_s))

    @_counted
    def replicas(self) -> dict[str, str]:
        rows = self._db().execute("SELECT replica_id, url FROM replicas WHERE until > ?", (time.time(),))
        return dict(rows.fetchall())

    @_counted
    def withdraw_replica(self, replica_id: str) -> None:
        with self._write() as db:
            db.execute("DELETE FROM replicas WHERE replica_id = ?", (replica_id,))

    # -- the hand-off to the learner --------------------------------------------------------------

    @_counted
    def claim(self, consumer: str, max_n: int, block_s: float = 0.0) -> list[Trajectory]:
        check_claim(consumer, max_n, block_s)
        deadline = time.monotonic() + block_s
        while True:
            now = time.time()
            with self._write() as db:
                # The first max_n in done order of (never claimed) + (claim expired): each read by its own index.
                fresh = db.execute(
                    "SELECT done_seq, rollout_id FROM trajectories INDEXED BY unclaimed"
                    " WHERE done_seq IS NOT NULL AND acked_at IS NULL AND claimed_at IS NULL ORDER BY done_seq LIMIT ?",
                    (max_n,),
                ).fetchall()
                expired = db.execute(
                    "SELECT done_seq, rollout_id FROM trajectories INDEXED BY claimed"
                    " WHERE acked_at IS NULL AND claimed_at IS NOT NULL AND claimed_at <= ? ORDER BY done_seq LIMIT ?",
                    (now - self.visibility_timeout_s, max_n),
                ).fetchall()
                ids = [rollout_id for _, rollout_id in sorted(fresh + expired)[:max_n]]
                db.executemany(
                    "UPDATE trajectories SET claimed_by = ?, claimed_at = ?, deliveries = deliveries + 1 WHERE rollout_id = ?",
                    [(consumer, now, rollout_id) for rollout_id in ids],
                )
            # Terminal trajectories never change again, so reading them outside the claim is safe.
            if ids:
                return self._get_many(ids)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return []
            if self._connections.wait_closed(min(_POLL_S, remaining)):
                raise StoreError(f"{self!r} was closed while a claim waited")

    @_counted
    def ack(self, consumer: str, rollout_ids: Iterable[str]) -> int:
        now = time.time()
        with self._write() as db:
            before = db.total_changes
            db.executemany(
                "UPDATE trajectories SET acked_at = ? WHERE rollout_id = ? AND claimed_by = ? AND acked_at IS NULL",
                [(now, rollout_id, consumer) for rollout_id in rollout_ids],
            )
            return db.total_changes - before

    # -- retention (TrajectoryPruner) -------------------------------------------------------------

    @_counted
    def acknowledged(self) -> list[str]:
        return [row[0] for row in self._db().execute("SELECT rollout_id FROM trajectories WHERE acked_at IS NOT NULL ORDER BY seq")]

    @_counted
    def delete(self, rollout_ids: Iterable[str]) -> int:
        ids = list(dict.fromkeys(rollout_ids))
        with self._write() as db:
            found: list[tuple[str, str, float | None]] = []
            for start in range(0, len(ids), _CHUNK):
                chunk = ids[start : start + _CHUNK]
                marks = ", ".join("?" * len(chunk))
                found += db.execute(f"SELECT rollout_id, status, acked_at FROM trajectories WHERE rollout_id IN ({marks})", chunk)
            refused = [(rid, status) for rid, status, acked_at in found if acked_at is None]
            if refused:
                raise delete_refused(refused)
            doomed = [(rid,) for rid, _, _ in found]
            db.executemany("DELETE FROM turns WHERE rollout_id = ?", doomed)
            db.executemany("DELETE FROM trajectories WHERE rollout_id = ?", doomed)
        return len(doomed)

    # -- reading ----------------------------------------------------------------------------------

    @_counted
    def get(self, rollout_id: str) -> Trajectory:
        db = self._db()
        row = db.execute(f"SELECT {_HEADER} FROM trajectories WHERE rollout_id = ?", (rollout_id,)).fetchone()
        if row is None:
            raise unknown_error(rollout_id)
        turns = db.execute("SELECT idx, data FROM turns WHERE rollout_id = ? ORDER BY idx", (rollout_id,))
        return _trajectory(row, [turn_from_json(data, index) for index, data in turns])

    def _get_many(self, rollout_ids: list[str]) -> list[Trajectory]:
        """`get` of each id, in order, two queries a chunk instead of two an id (a claim reads hundreds)."""
        db, found = self._db(), {}
        for start in range(0, len(rollout_ids), _CHUNK):
            chunk = rollout_ids[start : start + _CHUNK]
            marks = ", ".join("?" * len(chunk))
            turns: dict[str, list[Turn]] = {rollout_id: [] for rollout_id in chunk}
            query = f"SELECT rollout_id, idx, data FROM turns WHERE rollout_id IN ({marks}) ORDER BY rollout_id, idx"
            for rollout_id, index, data in db.execute(query, chunk):
                turns[rollout_id].append(turn_from_json(data, index))
            for row in db.execute(f"SELECT {_HEADER} FROM trajectories WHERE rollout_id IN ({marks})", chunk):
                found[row[0]] = _trajectory(row, turns[row[0]])
        missing = [rollout_id for rollout_id in rollout_ids if rollout_id not in found]
        if missing:
            raise unknown_error(missing[0])
        return [found[rollout_id] for rollout_id in rollout_ids]

    @_counted
    def list(
        self, *, status: str | None = None, group_id: str | None = None, limit: int | None = None, offset: int = 0
    ) -> list[Trajectory]:
        where: list[str] = []
        params: list[str | int] = []
        for column, value in (("status", status), ("group_id", group_id)):
            if value is not None:
                where.append(f"{column} = ?")
                params.append(value)
        sql = "SELECT rollout_id FROM trajectories"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY seq LIMIT ? OFFSET ?"
        params += [-1 if limit is None else limit, offset]
        ids = [row[0] for row in self._db().execute(sql, params)]
        return [self.get(rollout_id) for rollout_id in ids]

    @_counted
    def counts(self) -> dict[str, int]:
        counts = dict.fromkeys(COUNT_KEYS, 0)
        db = self._db()
        # One read transaction, so the numbers are a consistent snapshot.
        db.execute("BEGIN")
        try:
            counts.update(db.execute("SELECT status, COUNT(*) FROM trajectories GROUP BY status").fetchall())
            pending, claimed, acked = db.execute(
                "SELECT COALESCE(SUM(done_seq IS NOT NULL AND claimed_at IS NULL AND acked_at IS NULL), 0),"
                " COALESCE(SUM(claimed_at IS NOT NULL AND acked_at IS NULL), 0),"
                " COALESCE(SUM(acked_at IS NOT NULL), 0) FROM trajectories"
            ).fetchone()
        finally:
            db.execute("COMMIT")
        counts.update(pending=pending, claimed=claimed, acked=acked)
        return counts


def _trajectory(row: tuple, turns: list[Turn]) -> Trajectory:
    rollout_id, task, group_id, metadata, status, reward, metrics, reason, created_at, finished_at = row
    return Trajectory(
        rollout_id=rollout_id,
        task=task,
        group_id=group_id,
        metadata=json.loads(metadata),
        turns=turns,
        status=status,
        reward=reward,
        metrics=json.loads(metrics),
        reason=reason,
        created_at=created_at,
        finished_at=finished_at,
    )
