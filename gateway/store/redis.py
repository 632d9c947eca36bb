"""The trajectory store on a Redis server, for runs that span machines.

Layout under one key prefix per run: a hash per rollout (header and status), a list per rollout (its
turns, so a turn's index is its position), a list of rollout ids in opening order (for `list`), a
hash of counters, and a stream of terminal rollout ids read through one consumer group. The consumer
group is what makes the hand-off exactly-once: an entry stays in the group's pending list, owned by
the consumer it was delivered to, until that consumer acks it; XAUTOCLAIM hands entries whose owner
stayed silent past the visibility timeout to the next claimer. Every check-then-write runs as a Lua
script, so two gateways can never both append to a rollout that one of them just finished.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterable

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
    turn_from_json,
    turn_json,
    unknown_error,
)

GROUP = "learner"
"""The one consumer group: every learner process is a consumer in it and shares its entries."""

# Scripts answer {0, value} on success, {1} for an unknown rollout, {2, status} for a closed one,
# {3, index} for a turn whose own index disagrees with the next one.
_OPEN = """
if redis.call('EXISTS', KEYS[1]) == 1 then return {2, redis.call('HGET', KEYS[1], 'status')} end
redis.call('HSET', KEYS[1], 'task', ARGV[2], 'group_id', ARGV[3], 'metadata', ARGV[4],
           'status', 'running', 'created_at', ARGV[5])
redis.call('RPUSH', KEYS[2], ARGV[1])
redis.call('HINCRBY', KEYS[3], 'running', 1)
return {0, 0}
"""
_APPEND = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return {1} end
if status ~= 'running' then return {2, status} end
local index = redis.call('LLEN', KEYS[2])
if tonumber(ARGV[2]) ~= -1 and tonumber(ARGV[2]) ~= index then return {3, index} end
redis.call('RPUSH', KEYS[2], ARGV[1])
return {0, index}
"""
_END = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return {1} end
if status ~= 'running' then return {2, status} end
redis.call('HSET', KEYS[1], 'status', ARGV[2], 'reward', ARGV[3], 'metrics', ARGV[4], 'reason', ARGV[5],
           'finished_at', ARGV[6])
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


class RedisStore:
    """`TrajectoryStore` on Redis streams and a consumer group; one key prefix per run."""

    def __init__(self, url: str, *, namespace: str = "default", visibility_timeout_s: float = DEFAULT_VISIBILITY_TIMEOUT_S) -> None:
        self.url = url
        self.prefix = f"asyncrl:{namespace}:"
        self.visibility_timeout_s = visibility_timeout_s
        self._r = redis.Redis.from_url(url, decode_responses=True)
        try:
            self._r.ping()
        except redis.RedisError as error:
            raise StoreError(f"cannot reach Redis at {url}: {error}") from error
        self._stream, self._order, self._counts = (self.prefix + k for k in ("done", "rollouts", "counts"))
        try:
            self._r.xgroup_create(self._stream, GROUP, id="0", mkstream=True)
        except redis.ResponseError as error:
            if "BUSYGROUP" not in str(error):
                raise
        self._open, self._append, self._end, self._ack = (self._r.register_script(s) for s in (_OPEN, _APPEND, _END, _ACK))

    def __repr__(self) -> str:
        return f"RedisStore({self.url!r}, prefix={self.prefix!r})"

    def _traj(self, rollout_id: str) -> str:
        return f"{self.prefix}traj:{rollout_id}"

    def _turns(self, rollout_id: str) -> str:
        return f"{self.prefix}turns:{rollout_id}"

    def close(self) -> None:
        self._r.close()

    # -- the rollout lifecycle --------------------------------------------------------------------

    def open(self, task: str = "", group_id: str = "", metadata: dict | None = None, *, rollout_id: str | None = None) -> str:
        rollout_id = rollout_id or uuid.uuid4().hex
        code, *_ = self._open(
            keys=[self._traj(rollout_id), self._order, self._counts],
            args=[rollout_id, task, group_id, json.dumps(metadata or {}), repr(time.time())],
        )
        if code:
            raise StoreError(f"rollout id {rollout_id!r} is already in use in {self!r}")
        return rollout_id

    def append(self, turn: Turn) -> int:
        reply = self._append(keys=[self._traj(turn.rollout_id), self._turns(turn.rollout_id)], args=[turn_json(turn), turn.index])
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
        reply = self._end(
            keys=[self._traj(rollout_id), self._stream, self._counts],
            args=[rollout_id, status, reward, json.dumps(metrics), reason, repr(time.time())],
        )
        self._raise_refusal(reply, rollout_id, verb)

    @staticmethod
    def _raise_refusal(reply: list, rollout_id: str, verb: str) -> None:
        if reply[0] == 1:
            raise unknown_error(rollout_id)
        if reply[0] == 2:
            raise closed_error(rollout_id, reply[1], verb)

    # -- the hand-off to the learner --------------------------------------------------------------

    def claim(self, consumer: str, max_n: int, block_s: float = 0.0) -> list[Trajectory]:
        check_claim(consumer, max_n, block_s)
        entries = self._reclaim_expired(consumer, max_n)
        if len(entries) < max_n:
            # Block only when nothing was reclaimed: a consumer with work in hand should not wait.
            block_ms = max(1, int(block_s * 1000)) if block_s > 0 and not entries else None
            reply = self._r.xreadgroup(GROUP, consumer, {self._stream: ">"}, count=max_n - len(entries), block=block_ms)
            if isinstance(reply, dict):  # RESP3's shape; redis-py types both, this client speaks RESP2: [[stream, entries]]
                raise StoreError(f"Redis at {self.url} replied to XREADGROUP in RESP3; the store speaks RESP2")
            for _stream, new in reply or []:
                entries += new
        return [self.get(fields["rid"]) for _entry, fields in entries]

    def _reclaim_expired(self, consumer: str, max_n: int) -> list[tuple[str, dict[str, str]]]:
        entries: list[tuple[str, dict[str, str]]] = []
        cursor = "0-0"
        idle_ms = int(self.visibility_timeout_s * 1000)
        while len(entries) < max_n:
            cursor, claimed, _deleted = self._r.xautoclaim(
                self._stream, GROUP, consumer, idle_ms, start_id=cursor, count=max_n - len(entries)
            )
            entries += claimed
            if cursor == "0-0":
                break
        return entries

    def ack(self, consumer: str, rollout_ids: Iterable[str]) -> int:
        ids = list(rollout_ids)
        if not ids:
            return 0
        pipe = self._r.pipeline(transaction=False)
        for rollout_id in ids:
            pipe.hget(self._traj(rollout_id), "entry")
        entries = [entry for entry in pipe.execute() if entry]
        if not entries:
            return 0
        return self._ack(keys=[self._stream, self._counts], args=[GROUP, consumer, *entries])

    # -- reading ----------------------------------------------------------------------------------

    def get(self, rollout_id: str) -> Trajectory:
        pipe = self._r.pipeline(transaction=True)
        pipe.hgetall(self._traj(rollout_id))
        pipe.lrange(self._turns(rollout_id), 0, -1)
        header, turns = pipe.execute()
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
            ids = _decoded(self._r.lrange(self._order, offset, stop)) if limit != 0 else []
        else:
            ids = _decoded(self._r.lrange(self._order, 0, -1))
            pipe = self._r.pipeline(transaction=False)
            for rollout_id in ids:
                pipe.hmget(self._traj(rollout_id), "status", "group_id")
            ids = [
                rollout_id for rollout_id, (s, g) in zip(ids, pipe.execute(), strict=True) if status in (None, s) and group_id in (None, g)
            ]
            ids = ids[offset:] if limit is None else ids[offset : offset + limit]
        return [self.get(rollout_id) for rollout_id in ids]

    def counts(self) -> dict[str, int]:
        pipe = self._r.pipeline(transaction=True)
        pipe.hgetall(self._counts)
        pipe.xpending(self._stream, GROUP)
        stored, pending_info = pipe.execute()
        counts = dict.fromkeys(COUNT_KEYS, 0)
        counts.update({key: int(value) for key, value in stored.items()})
        terminal = sum(counts[status] for status in TERMINAL_STATUSES)
        counts["claimed"] = int(pending_info["pending"])
        counts["pending"] = terminal - counts["acked"] - counts["claimed"]
        return counts


def _decoded(values: list[bytes | str]) -> list[str]:
    """Replies of this store's decode_responses=True client as the strings they are (redis-py types them bytes | str)."""
    return [value.decode() if isinstance(value, bytes) else value for value in values]
