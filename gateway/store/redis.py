"""The trajectory store on a Redis server, for runs that span machines.

Layout under one key prefix per run: a hash per rollout (header and status), a list per rollout (its
turns, so a turn's index is its position), a list of rollout ids in opening order (for `list`), a
hash of counters, and a stream of terminal rollout ids read through one consumer group. The consumer
group is what makes the hand-off exactly-once: an entry stays in the group's pending list, owned by
the consumer it was delivered to, until that consumer acks it; XAUTOCLAIM hands entries whose owner
stayed silent past the visibility timeout to the next claimer. Every check-then-write runs as a Lua
script, so two gateways can never both append to a rollout that one of them just finished.

A Redis restart (or a dropped connection) is survived: every call is retried with backoff for up to
`reconnect_s`, then fails as `RedisUnavailable`. A write whose reply was lost may already have been
applied, so each write carries an operation token and its script recognises its own earlier
application (an open, a finish or an abort already done by this very call, the turn it already
appended, the entries the claim already leased) instead of doing it twice or refusing it.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterable
from functools import partial
from typing import TypeVar

import redis

from asyncrl.records import TERMINAL_STATUSES, Trajectory, Turn

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

GROUP = "learner"
"""The one consumer group: every learner process is a consumer in it and shares its entries."""

DEFAULT_RECONNECT_S = 30.0
"""How long a call keeps retrying an unreachable Redis (a restart, loading its AOF) before it fails."""

_T = TypeVar("_T")


class RedisUnavailable(ConnectionError):
    """Redis did not answer within the store's reconnect budget; the store's side, not the caller's request."""


# Scripts answer {0, value} on success, {1} for an unknown rollout, {2, status} for a closed one,
# {3, index} for a turn whose own index disagrees with the next one. ARGV[#ARGV] of the writes is the
# call's operation token (open, finish, abort) or "1" on a retry (append): see the module docstring.
_OPEN = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  if redis.call('HGET', KEYS[1], 'op') == ARGV[6] then return {0, 0} end
  return {2, redis.call('HGET', KEYS[1], 'status')}
end
redis.call('HSET', KEYS[1], 'task', ARGV[2], 'group_id', ARGV[3], 'metadata', ARGV[4],
           'status', 'running', 'created_at', ARGV[5], 'op', ARGV[6])
redis.call('RPUSH', KEYS[2], ARGV[1])
redis.call('HINCRBY', KEYS[3], 'running', 1)
return {0, 0}
"""
_APPEND = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return {1} end
if status ~= 'running' then return {2, status} end
local index = redis.call('LLEN', KEYS[2])
-- A turn's text holds its creation time to the microsecond: equal to the last one only if it is that one.
if ARGV[3] == '1' and index > 0 and redis.call('LINDEX', KEYS[2], -1) == ARGV[1] then return {0, index - 1} end
if tonumber(ARGV[2]) ~= -1 and tonumber(ARGV[2]) ~= index then return {3, index} end
redis.call('RPUSH', KEYS[2], ARGV[1])
return {0, index}
"""
_END = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return {1} end
if status ~= 'running' then
  if redis.call('HGET', KEYS[1], 'end_op') == ARGV[7] then return {0, 0} end
  return {2, status}
end
redis.call('HSET', KEYS[1], 'status', ARGV[2], 'reward', ARGV[3], 'metrics', ARGV[4], 'reason', ARGV[5],
           'finished_at', ARGV[6], 'end_op', ARGV[7])
redis.call('HSET', KEYS[1], 'entry', redis.call('XADD', KEYS[2], '*', 'rid', ARGV[1]))
redis.call('HINCRBY', KEYS[3], 'running', -1)
redis.call('HINCRBY', KEYS[3], ARGV[2], 1)
return {0, 0}
"""
# XACK alone would let any consumer ack any entry; a consumer whose lease went to another must not.
_ACK = """
local acked = 0
for i = 3, #ARGV do
  local owned = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1, ARGV[2])
  if #owned == 1 then acked = acked + redis.call('XACK', KEYS[1], ARGV[1], ARGV[i]) end
end
if acked > 0 then redis.call('HINCRBY', KEYS[2], 'acked', acked) end
return acked
"""
# Leases expired entries (XAUTOCLAIM) and then new ones (XREADGROUP) in one step, and remembers the
# rollout ids it leased under the call's token in the consumer's claim record: a retry of the same
# call gets them back instead of leaving them leased to no one who knows. Answers {last stream id
# (when nothing was leased, for a blocking wait), rollout ids...}.
_CLAIM = """
local record = redis.call('HMGET', KEYS[2], 'op', 'rids')
if record[1] == ARGV[5] then
  local rids = cjson.decode(record[2])
  table.insert(rids, 1, '')
  return rids
end
local n, rids, cursor = tonumber(ARGV[3]), {}, '0-0'
repeat
  local reply = redis.call('XAUTOCLAIM', KEYS[1], ARGV[1], ARGV[2], ARGV[4], cursor, 'COUNT', n - #rids)
  cursor = reply[1]
  for _, entry in ipairs(reply[2]) do table.insert(rids, entry[2][2]) end
until cursor == '0-0' or #rids >= n
if #rids < n then
  local reply = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', n - #rids, 'STREAMS', KEYS[1], '>')
  if reply then
    for _, entry in ipairs(reply[1][2]) do table.insert(rids, entry[2][2]) end
  end
end
redis.call('HSET', KEYS[2], 'op', ARGV[5], 'rids', #rids > 0 and cjson.encode(rids) or '[]')
local last = ''
if #rids == 0 then
  local newest = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
  last = #newest > 0 and newest[1][1] or '0-0'
end
table.insert(rids, 1, last)
return rids
"""

# Deletes acknowledged rollouts (the caller checked: acknowledgement is final, so the check cannot go
# stale) with their stream entry and their place in the opening order; one already gone is skipped, so
# a retry deletes nothing twice and the counters stay right. ARGV[1] is the key prefix.
_DELETE = """
local deleted = 0
for i = 2, #ARGV do
  local traj, turns = ARGV[1] .. 'traj:' .. ARGV[i], ARGV[1] .. 'turns:' .. ARGV[i]
  local header = redis.call('HMGET', traj, 'status', 'entry')
  if header[1] then
    if header[2] then redis.call('XDEL', KEYS[1], header[2]) end
    redis.call('LREM', KEYS[2], 1, ARGV[i])
    redis.call('DEL', traj, turns)
    redis.call('HINCRBY', KEYS[3], header[1], -1)
    redis.call('HINCRBY', KEYS[3], 'acked', -1)
    deleted = deleted + 1
  end
end
return deleted
"""
_DELETE_CHUNK = 200
"""Rollouts per delete script: each LREM walks the opening-order list, so a script stays short."""


class RedisStore:
    """`TrajectoryStore` on Redis streams and a consumer group; one key prefix per run."""

    def __init__(
        self,
        url: str,
        *,
        namespace: str = "default",
        visibility_timeout_s: float = DEFAULT_VISIBILITY_TIMEOUT_S,
        reconnect_s: float = DEFAULT_RECONNECT_S,
        read_only: bool = False,
    ) -> None:
        """`read_only`: the reader of an existing run (`open_reader`) creates nothing, not even the
        consumer group; a namespace with nothing recorded is FileNotFoundError."""
        self.url = url
        self.prefix = f"asyncrl:{namespace}:"
        self.visibility_timeout_s = visibility_timeout_s
        self.reconnect_s = reconnect_s
        self._r = redis.Redis.from_url(url, decode_responses=True)
        try:
            self._r.ping()
        except redis.RedisError as error:
            raise StoreError(f"cannot reach Redis at {url}: {error}") from error
        self._stream, self._order, self._counts, self._replicas = (self.prefix + k for k in ("done", "rollouts", "counts", "replicas"))
        if read_only:
            if not self._r.exists(self._order, self._stream):
                raise FileNotFoundError(f"nothing recorded under {self.prefix}* at {url} (is the namespace the run's name?)")
        else:
            try:
                self._r.xgroup_create(self._stream, GROUP, id="0", mkstream=True)
            except redis.ResponseError as error:
                if "BUSYGROUP" not in str(error):
                    raise
        scripts = (_OPEN, _APPEND, _END, _ACK, _CLAIM, _DELETE)
        self._open, self._append, self._end, self._ack, self._claim, self._delete = (self._r.register_script(s) for s in scripts)

    def __repr__(self) -> str:
        return f"RedisStore({self.url!r}, prefix={self.prefix!r})"

    def _traj(self, rollout_id: str) -> str:
        return f"{self.prefix}traj:{rollout_id}"

    def _turns(self, rollout_id: str) -> str:
        return f"{self.prefix}turns:{rollout_id}"

    def close(self) -> None:
        self._r.close()

    def _call(self, attempt: Callable[[bool], _T]) -> _T:
        """`attempt(retry)` until Redis answers, for up to `reconnect_s`; `retry` is True once an earlier
        attempt may have been applied (its reply lost with the connection)."""
        deadline, delay, retry = time.monotonic() + self.reconnect_s, 0.05, False
        while True:
            try:
                return attempt(retry)
            except (redis.ConnectionError, redis.TimeoutError) as error:  # BusyLoadingError (AOF loading) is one
                if time.monotonic() + delay > deadline:
                    raise RedisUnavailable(
                        f"Redis at {self.url} did not answer for {self.reconnect_s:g} s ({type(error).__name__}: {error})"
                    ) from error
            except redis.ResponseError as error:
                if "NOGROUP" in str(error):
                    raise StoreError(
                        f"Redis at {self.url} no longer holds this run's data ({self.prefix}*): it restarted without "
                        "persistence (run Redis with --appendonly yes)"
                    ) from error
                raise
            time.sleep(delay)
            delay, retry = min(delay * 2, 1.0), True

    # -- the rollout lifecycle --------------------------------------------------------------------

    def open(self, task: str = "", group_id: str = "", metadata: dict | None = None, *, rollout_id: str | None = None) -> str:
        rollout_id = rollout_id or uuid.uuid4().hex
        args = [rollout_id, task, group_id, json.dumps(metadata or {}), repr(time.time()), uuid.uuid4().hex]
        code, *_ = self._call(lambda retry: self._open(keys=[self._traj(rollout_id), self._order, self._counts], args=args))
        if code:
            raise StoreError(f"rollout id {rollout_id!r} is already in use in {self!r}")
        return rollout_id

    def append(self, turn: Turn) -> int:
        keys, text = [self._traj(turn.rollout_id), self._turns(turn.rollout_id)], turn_json(turn)
        reply = self._call(lambda retry: self._append(keys=keys, args=[text, turn.index, "1" if retry else "0"]))
        if reply[0] == 3:
            check_index(turn, reply[1])
        self._raise_refusal(reply, turn.rollout_id, "append a turn to")
        return reply[1]

    def finish(self, rollout_id: str, reward: float, status: str = "ok", metrics: dict | None = None, reason: str = "") -> None:
        check_finish(rollout_id, reward, status)
        self._finish(rollout_id, status, repr(float(reward)), metrics or {}, reason, "finish")

    def abort(self, rollout_id: str, reason: str = "") -> None:
        self._finish(rollout_id, "aborted", "", {}, reason, "abort")

    def _finish(self, rollout_id: str, status: str, reward: str, metrics: dict, reason: str, verb: str) -> None:
        keys = [self._traj(rollout_id), self._stream, self._counts]
        args = [rollout_id, status, reward, json.dumps(metrics), reason, repr(time.time()), uuid.uuid4().hex]
        reply = self._call(lambda retry: self._end(keys=keys, args=args))
        self._raise_refusal(reply, rollout_id, verb)

    @staticmethod
    def _raise_refusal(reply: list, rollout_id: str, verb: str) -> None:
        if reply[0] == 1:
            raise unknown_error(rollout_id)
        if reply[0] == 2:
            raise closed_error(rollout_id, reply[1], verb)

    # -- the replicas' directory ------------------------------------------------------------------
    # One hash, replica id -> {url, until}, against Redis's own clock, so nodes' clocks need not agree.

    def announce_replica(self, replica_id: str, url: str, ttl_s: float) -> None:
        def write(retry: bool) -> None:
            seconds, micros = self._r.time()
            self._r.hset(self._replicas, replica_id, json.dumps({"url": url, "until": seconds + micros / 1e6 + ttl_s}))

        self._call(write)

    def replicas(self) -> dict[str, str]:
        def read(retry: bool) -> list:
            pipe = self._r.pipeline(transaction=True)
            pipe.time()
            pipe.hgetall(self._replicas)
            return pipe.execute()

        (seconds, micros), announced = self._call(read)
        now = seconds + micros / 1e6
        entries = {replica_id: json.loads(text) for replica_id, text in announced.items()}
        return {replica_id: entry["url"] for replica_id, entry in entries.items() if entry["until"] > now}

    def withdraw_replica(self, replica_id: str) -> None:
        self._call(lambda retry: self._r.hdel(self._replicas, replica_id))

    # -- the hand-off to the learner --------------------------------------------------------------

    def claim(self, consumer: str, max_n: int, block_s: float = 0.0) -> list[Trajectory]:
        check_claim(consumer, max_n, block_s)
        last, *rollout_ids = self._lease(consumer, max_n)
        if not rollout_ids and block_s > 0:
            # Wait for an entry past the newest one the lease saw (a read: nothing to lose if its reply is),
            # then lease once more.
            block_ms = max(1, int(block_s * 1000))
            if self._call(lambda retry: self._r.xread({self._stream: last or "$"}, count=1, block=block_ms)):
                _last, *rollout_ids = self._lease(consumer, max_n)
        return [self.get(rollout_id) for rollout_id in rollout_ids]

    def _lease(self, consumer: str, max_n: int) -> list[str]:
        """[newest stream id when nothing was leased, else "", leased rollout ids...] (the `_CLAIM` script)."""
        keys = [self._stream, f"{self.prefix}claim:{consumer}"]
        args: list[str | int] = [GROUP, consumer, max_n, int(self.visibility_timeout_s * 1000), uuid.uuid4().hex]
        return self._call(lambda retry: self._claim(keys=keys, args=args))

    def ack(self, consumer: str, rollout_ids: Iterable[str]) -> int:
        ids = list(rollout_ids)
        if not ids:
            return 0

        def entries(retry: bool) -> list[str]:
            pipe = self._r.pipeline(transaction=False)
            for rollout_id in ids:
                pipe.hget(self._traj(rollout_id), "entry")
            return [entry for entry in pipe.execute() if entry]

        found = self._call(entries)
        if not found:
            return 0
        # Acking twice acks nothing the second time: a retry is safe (it may under-report the count).
        return self._call(lambda retry: self._ack(keys=[self._stream, self._counts], args=[GROUP, consumer, *found]))

    # -- retention (TrajectoryPruner) -------------------------------------------------------------

    def acknowledged(self) -> list[str]:
        ids = _decoded(self._call(lambda retry: self._r.lrange(self._order, 0, -1)))
        return [rollout_id for rollout_id, (status, acked) in zip(ids, self._hand_off(ids), strict=True) if acked]

    def delete(self, rollout_ids: Iterable[str]) -> int:
        ids = list(dict.fromkeys(rollout_ids))
        states = self._hand_off(ids)
        refused = [(rid, status) for rid, (status, acked) in zip(ids, states, strict=True) if status is not None and not acked]
        if refused:
            raise delete_refused(refused)
        doomed = [rid for rid, (status, _) in zip(ids, states, strict=True) if status is not None]
        chunks = [[self.prefix, *doomed[start : start + _DELETE_CHUNK]] for start in range(0, len(doomed), _DELETE_CHUNK)]
        return sum(self._call(partial(self._delete_chunk, chunk)) for chunk in chunks)

    def _delete_chunk(self, args: list[str], retry: bool) -> int:
        return self._delete(keys=[self._stream, self._order, self._counts], args=args)

    def _hand_off(self, rollout_ids: list[str]) -> list[tuple[str | None, bool]]:
        """(status, or None when there is no such rollout; acknowledged) of each rollout. An entry is
        acknowledged when the group had delivered it (it is at or before the last-delivered id) and it
        is no longer pending. Read in this order, the answer cannot be wrong: an entry delivered after
        the last-delivered id was read counts as unacknowledged, and acknowledgement is final."""

        def headers(retry: bool) -> list:
            pipe = self._r.pipeline(transaction=False)
            for rollout_id in rollout_ids:
                pipe.hmget(self._traj(rollout_id), "status", "entry")
            return pipe.execute()

        found = self._call(headers)
        groups = self._call(lambda retry: self._r.xinfo_groups(self._stream))
        delivered = next((_stream_id(g["last-delivered-id"]) for g in groups if g["name"] == GROUP), (0, 0))
        entries = [entry for _, entry in found if entry is not None and _stream_id(entry) <= delivered]

        def pending(retry: bool) -> list:
            pipe = self._r.pipeline(transaction=False)
            for entry in entries:
                pipe.xpending_range(self._stream, GROUP, min=entry, max=entry, count=1)
            return pipe.execute()

        acked = {entry for entry, leased in zip(entries, self._call(pending), strict=True) if not leased}
        return [(status, entry in acked) for status, entry in found]

    # -- reading ----------------------------------------------------------------------------------

    def get(self, rollout_id: str) -> Trajectory:
        def read(retry: bool) -> list:
            pipe = self._r.pipeline(transaction=True)
            pipe.hgetall(self._traj(rollout_id))
            pipe.lrange(self._turns(rollout_id), 0, -1)
            return pipe.execute()

        header, turns = self._call(read)
        if not header:
            raise unknown_error(rollout_id)
        return Trajectory(
            rollout_id=rollout_id,
            task=header["task"],
            group_id=header["group_id"],
            metadata=json.loads(header["metadata"]),
            turns=[turn_from_json(text, index) for index, text in enumerate(turns)],
            status=header["status"],
            reward=float(header["reward"]) if header.get("reward") else None,
            metrics=json.loads(header.get("metrics", "{}")),
            reason=header.get("reason", ""),
            created_at=float(header["created_at"]),
            finished_at=float(header["finished_at"]) if header.get("finished_at") else None,
        )

    def list(
        self, *, status: str | None = None, group_id: str | None = None, limit: int | None = None, offset: int = 0
    ) -> list[Trajectory]:
        if status is None and group_id is None:
            stop = -1 if limit is None else offset + limit - 1
            ids = _decoded(self._call(lambda retry: self._r.lrange(self._order, offset, stop))) if limit != 0 else []
        else:
            ids = _decoded(self._call(lambda retry: self._r.lrange(self._order, 0, -1)))

            def headers(retry: bool) -> list:
                pipe = self._r.pipeline(transaction=False)
                for rollout_id in ids:
                    pipe.hmget(self._traj(rollout_id), "status", "group_id")
                return pipe.execute()

            found = zip(ids, self._call(headers), strict=True)
            ids = [rollout_id for rollout_id, (s, g) in found if status in (None, s) and group_id in (None, g)]
            ids = ids[offset:] if limit is None else ids[offset : offset + limit]
        return [self.get(rollout_id) for rollout_id in ids]

    def counts(self) -> dict[str, int]:
        def read(retry: bool) -> list:
            pipe = self._r.pipeline(transaction=True)
            pipe.hgetall(self._counts)
            pipe.xpending(self._stream, GROUP)
            return pipe.execute()

        stored, pending_info = self._call(read)
        counts = dict.fromkeys(COUNT_KEYS, 0)
        counts.update({key: int(value) for key, value in stored.items()})
        terminal = sum(counts[status] for status in TERMINAL_STATUSES)
        counts["claimed"] = int(pending_info["pending"])
        counts["pending"] = terminal - counts["acked"] - counts["claimed"]
        return counts


def _stream_id(entry: str) -> tuple[int, int]:
    """A stream entry id ("ms-seq") as a pair that orders like the stream."""
    ms, _, seq = entry.partition("-")
    return int(ms), int(seq or 0)


def _decoded(values: list[bytes | str]) -> list[str]:
    """Replies of this store's decode_responses=True client as the strings they are (redis-py types them bytes | str)."""
    return [value.decode() if isinstance(value, bytes) else value for value in values]
