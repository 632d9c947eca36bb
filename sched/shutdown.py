"""How a run ends: with every rollout it started in exactly one account of the ledger.

The round of verbs (`sched/loop.py`) leaves work in flight by design: a learner step, episodes,
groups not yet complete. Ending a run is a different order of the same verbs, run once, and the
ledger balances only if every step of it happens: finish the learner's step, stop the episodes,
abort in the store what no episode drives any more, push and evaluate the final weights, count
what was never trained as aborted, checkpoint (the commit point acknowledges it all). A learner
that dies meanwhile raises LearnerDied out of `close`; the loop restarts it (`sched/recovery.py`),
runs on to its end and closes again (`Loop.close`).
A crash or Ctrl-C skips all this; `asyncrl run --resume` takes it from the last checkpoint.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from .resume import abort_running

if TYPE_CHECKING:
    from .loop import Loop


async def close(loop: Loop) -> float | None:
    """End `loop`'s run with balanced books, through its verbs and its `InFlight`; the final held-out accuracy."""
    flight = loop.flight
    flight.closing = True
    if flight.step is not None:
        await loop.finish_step()
    await loop.episodes.stop()
    await asyncio.to_thread(abort_running, loop.p.store, "the run ended")
    if loop.state.version > flight.pushed:
        await loop.push()
    fresh = flight.evaluated == flight.pushed and flight.accuracy is not None and loop.p.evaluation is None
    accuracy = flight.accuracy if fresh else await loop.evaluate(force=True)  # waits for one playing aside first
    await loop.collect()
    loop.books.book_untrained(flight.groups.drain())
    await loop.books.checkpoint()
    loop.recovery.note_replacements()
    return accuracy
