"""A rollout's budget of turns and sampled tokens (`gateway.max_rollout_turns`, `gateway.max_rollout_tokens`).

The limits hold under concurrent calls on one key: a call reserves its turn and its `max_tokens` before
anything is rendered or sent to an engine, so N calls at once see each other's reservations and cannot
overshoot together. A call that ends recorded spends what it sampled; one that fails or is refused gives
its reservation back. Only recorded turns count, so after a restart the budget is rebuilt from the
store (`RolloutBudget.resume`).

Everything here runs on the event loop and never yields, so the checks need no lock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from asyncrl.records import Turn


class RolloutLimit(ValueError):
    """A call this rollout's budget has no room for; the gateway answers it with a 400 naming the limit."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(eq=False)
class Reservation:
    """One call's hold on the budget: a turn and up to `tokens` completion tokens."""

    tokens: int
    sampled: int | None = None
    """Completion tokens of the recorded turn (None: the call recorded nothing)."""
    open: bool = True

    def spend(self, sampled: int) -> None:
        """The call's turn is recorded with `sampled` completion tokens; `RolloutBudget.release` books them."""
        self.sampled = sampled


@dataclass
class RolloutBudget:
    max_turns: int | None
    max_tokens: int | None
    turns: int = 0
    """Turns recorded."""
    tokens: int = 0
    """Completion tokens of the recorded turns."""
    _held: list[Reservation] = field(default_factory=list, repr=False)

    def resume(self, turns: Sequence[Turn]) -> RolloutBudget:
        """This budget with a rollout's recorded turns already spent (a rollout a restarted gateway picks up)."""
        self.turns, self.tokens = len(turns), sum(len(t.completion_token_ids) for t in turns)
        return self

    def reserve(self, max_tokens: int) -> Reservation:
        """Hold a turn and `max_tokens` tokens for a call; `RolloutLimit` (and nothing held) when there is no room."""
        in_flight = len(self._held)
        if self.max_turns is not None and self.turns + in_flight >= self.max_turns:
            raise RolloutLimit(
                "too_many_turns",
                f"this rollout has {self.turns} turns and {in_flight} more in flight; gateway.max_rollout_turns is {self.max_turns}",
            )
        held = sum(r.tokens for r in self._held)
        if self.max_tokens is not None and self.tokens + held + max_tokens > self.max_tokens:
            room = max(self.max_tokens - self.tokens - held, 0)
            raise RolloutLimit(
                "too_many_tokens",
                f"this call may sample {max_tokens} tokens (max_tokens), this rollout has sampled {self.tokens} and calls in "
                f"flight hold {held} more; gateway.max_rollout_tokens is {self.max_tokens}"
                + (f" (send max_tokens of at most {room})" if room else ""),
            )
        reservation = Reservation(max_tokens)
        self._held.append(reservation)
        return reservation

    def release(self, reservation: Reservation) -> None:
        """End a call's hold: book what its recorded turn sampled, give the rest back (no-op the second time)."""
        if not reservation.open:
            return
        reservation.open = False
        self._held.remove(reservation)
        if reservation.sampled is not None:
            self.turns += 1
            self.tokens += reservation.sampled
