"""The gateway's rollouts: opening and ending them, their keys, and the in-memory state of each running one.

A rollout key is `rk-<rollout id>.<HMAC of the id>`, so any gateway that shares the secret can check
a key without a lookup, and after a restart a key still finds its rollout in the store (its next
turn then starts a fresh branch, which sample assembly handles as a fork).

An evaluation rollout (opened with `evaluation: true`, for held-out evaluation) takes the same path
but is sampled greedily whatever the request asks, and touches no store: it lives in `live` until
it is finished or aborted, then only its ended status is remembered. It never reaches the learner.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import secrets
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from asyncrl.configs.schema import GatewayConfig
from asyncrl.records import Turn

from . import api
from .budget import Reservation, RolloutBudget, RolloutLimit
from .conversation import Conversation
from .errors import GatewayError
from .replicas import ReplicaSet
from .store import TrajectoryRecorder, UnknownRollout
from .template import TokenizerTemplate


@dataclass(eq=False)
class Rollout:
    id: str
    conversation: Conversation
    budget: RolloutBudget
    """Its turns and sampled tokens against gateway.max_rollout_turns and max_rollout_tokens."""
    group_id: str = ""
    """Its GRPO group, as opened (evaluation rollouts: none, so held-out problems spread over the engines)."""
    texts: list[tuple[str, list[int]]] = field(default_factory=list)
    """(text, its exact tokens) of recent text-completion turns, prompt plus completion."""
    abandon: set[asyncio.Future] = field(default_factory=set)
    """Wake-ups of this rollout's requests in flight; resolved when the rollout ends."""
    broken: str | None = None
    evaluation: api.OpenRolloutRequest | None = None
    """An evaluation rollout's opening request (its task, group and metadata); None for a recorded rollout."""
    turns: int = 0
    """Turns an evaluation rollout has taken (the store counts a recorded rollout's)."""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)
    """Held while the conversation prepares or commits a turn (preparing may run on a worker thread)."""

    @property
    def route_key(self) -> str:
        """What places its calls on the engines' ring (gateway/routing.py): its group, so that every member
        reaches the engine that already holds the group's prompt; its own id when it has none."""
        return self.group_id or self.id

    def reserve(self, max_tokens: int) -> Reservation:
        """A call's hold on this rollout's turns and tokens, taken before any work; the service's `drop` gives it back."""
        try:
            return self.budget.reserve(max_tokens)
        except RolloutLimit as limit:
            raise GatewayError(400, limit.code, str(limit)) from None

    @contextlib.contextmanager
    def budgeted(self, max_tokens: int) -> Iterator[Reservation]:
        reservation = self.reserve(max_tokens)
        try:
            yield reservation
        finally:
            self.budget.release(reservation)


class RolloutTable:
    """The running rollouts by id (`live`), the recent ended ones' statuses, and the lifecycle calls.

    `io` runs a blocking store call on the gateway's store threads (a store outage is a 503)."""

    def __init__(
        self,
        store: TrajectoryRecorder,
        io: Callable[..., Awaitable[Any]],
        tokenizer: Any,
        template: TokenizerTemplate,
        config: GatewayConfig,
        secret: bytes,
        replicas: ReplicaSet | None = None,
    ) -> None:
        self.store, self._io, self.tokenizer, self.template, self.config = store, io, tokenizer, template, config
        self._secret = secret
        self.replicas = replicas
        """Where this gateway has replicas: its rollouts' ids name it as their home."""
        self.live: dict[str, Rollout] = {}
        self.ended: OrderedDict[str, str] = OrderedDict()

    async def open(self, request: api.OpenRolloutRequest) -> api.OpenRolloutResponse:
        replicas = self.replicas
        if request.evaluation:
            rollout_id = f"eval-{secrets.token_hex(12)}"
            rollout_id = replicas.rollout_id(rollout_id) if replicas else rollout_id
            self.live[rollout_id] = self._new(rollout_id)
            self.live[rollout_id].evaluation = request
        else:
            chosen = replicas.rollout_id(uuid.uuid4().hex) if replicas else None
            rollout_id = await self._io(self.store.open, request.task, request.group_id, request.metadata, rollout_id=chosen)
            self.live[rollout_id] = self._new(rollout_id, request.group_id)
        base_url = replicas.base_url if replicas else None
        return api.OpenRolloutResponse(rollout_id=rollout_id, api_key=self.key(rollout_id), base_url=base_url)

    async def finish(self, rollout_id: str, request: api.FinishRolloutRequest) -> api.RolloutInfo:
        """`settle`, and the rollout's info after (read back from the store)."""
        evaluation = self._evaluation(rollout_id)
        await self.settle(rollout_id, request)
        if evaluation is not None:
            return _evaluation_info(evaluation, request.status, request.reward, request.metrics, request.reason)
        return await self.info(rollout_id)

    async def settle(self, rollout_id: str, request: api.FinishRolloutRequest) -> None:
        """End a rollout with its reward and status: recorded (an evaluation rollout nowhere), then forgotten."""
        if self._evaluation(rollout_id) is None:
            await self._io(self.store.finish, rollout_id, request.reward, request.status, request.metrics, request.reason)
        self.end(rollout_id, request.status)

    async def abort(self, rollout_id: str, request: api.AbortRolloutRequest) -> api.RolloutInfo:
        evaluation = self._evaluation(rollout_id)
        if evaluation is not None:
            info = _evaluation_info(evaluation, "aborted", None, {}, request.reason)
            self.end(rollout_id, "aborted")
            return info
        await self._io(self.store.abort, rollout_id, request.reason)
        self.end(rollout_id, "aborted")
        return await self.info(rollout_id)

    def _evaluation(self, rollout_id: str) -> Rollout | None:
        """The running evaluation rollout of this id (None: a recorded rollout, or one that ended)."""
        rollout = self.live.get(rollout_id)
        return rollout if rollout is not None and rollout.evaluation is not None else None

    async def info(self, rollout_id: str) -> api.RolloutInfo:
        evaluation = self._evaluation(rollout_id)
        if evaluation is not None:
            return _evaluation_info(evaluation, "running", None, {}, "")
        t = await self._io(self.store.get, rollout_id)
        live = self.live.get(rollout_id)
        return api.RolloutInfo(
            rollout_id=t.rollout_id, task=t.task, group_id=t.group_id, metadata=t.metadata, status=t.status,
            reward=t.reward, metrics=t.metrics, reason=t.reason, turns=len(t.turns),
            in_flight=len(live.abandon) if live else 0,
        )  # fmt: skip

    def end(self, rollout_id: str, status: str | None) -> None:
        """Forget a rollout that ended (status None: ended elsewhere, ask the store next time)."""
        rollout = self.live.pop(rollout_id, None)
        if status is not None:
            self.ended[rollout_id] = status
            while len(self.ended) > self.config.max_ended_rollouts:
                self.ended.popitem(last=False)
        for wake in list(rollout.abandon if rollout else ()):
            if not wake.done():
                wake.set_result(f"rollout {rollout_id} was {status or 'ended'} while this request was running; nothing was recorded")

    def _new(self, rollout_id: str, group_id: str = "", recorded: Sequence[Turn] = ()) -> Rollout:
        """A rollout's in-memory state; `recorded`: its turns in the store (one a restarted gateway picks up)."""
        conversation = Conversation(self.tokenizer, max_branches=self.config.max_branches, template=self.template)
        budget = RolloutBudget(self.config.max_rollout_turns, self.config.max_rollout_tokens).resume(recorded)
        return Rollout(rollout_id, conversation, budget, group_id=group_id)

    def key(self, rollout_id: str) -> str:
        return f"rk-{rollout_id}.{self._mac(rollout_id)}"

    def _mac(self, rollout_id: str) -> str:
        return hmac.new(self._secret, rollout_id.encode(), hashlib.sha256).hexdigest()[:32]

    async def for_key(self, key: str | None) -> Rollout:
        """The running rollout a key stands for; 401 for a key this gateway never issued, 409 for an ended rollout."""
        if not key:
            raise GatewayError(
                401, "missing_api_key", "send the rollout key as `Authorization: Bearer <api_key>` (open a rollout with POST /rollouts)"
            )
        rollout_id, _, mac = key.removeprefix("rk-").rpartition(".")
        # Bytes: compare_digest refuses a str that is not ASCII, and a header may carry anything.
        forged = not hmac.compare_digest(mac.encode("utf-8", "surrogateescape"), self._mac(rollout_id).encode())
        if not key.startswith("rk-") or not rollout_id or forged:
            raise GatewayError(401, "invalid_api_key", "unknown rollout key (open a rollout with POST /rollouts and use its api_key)")
        rollout = self.live.get(rollout_id)
        if rollout is not None:
            if rollout.broken:
                raise GatewayError(409, "rollout_broken", f"rollout {rollout_id} cannot continue: {rollout.broken}; abort it")
            return rollout
        status = self.ended.get(rollout_id)
        if status is None:  # issued before a restart, or ended long ago: the store knows
            try:
                stored = await self._io(self.store.get, rollout_id)
            except UnknownRollout:
                raise GatewayError(401, "invalid_api_key", f"rollout {rollout_id} is not in this gateway's store") from None
            status = stored.status
            if status == "running":
                return self.live.setdefault(rollout_id, self._new(rollout_id, stored.group_id, stored.turns))
        raise GatewayError(409, "rollout_closed", f"rollout {rollout_id} is {status}; it takes no more calls")


def _evaluation_info(rollout: Rollout, status: str, reward: float | None, metrics: dict, reason: str) -> api.RolloutInfo:
    opened = rollout.evaluation
    assert opened is not None
    return api.RolloutInfo(
        rollout_id=rollout.id, task=opened.task, group_id=opened.group_id, metadata=opened.metadata, status=status,
        reward=reward, metrics=metrics, reason=reason, turns=rollout.turns, in_flight=len(rollout.abandon),
    )  # fmt: skip
