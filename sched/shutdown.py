"""How a run ends: with every rollout it started in exactly one account of the ledger.

The round of verbs (`sched/loop.py`) leaves work in flight by design: a learner step, episodes,
groups not yet complete. Ending a run is a different order of the same verbs, run once, and the
ledger balances only if every step of it happens: finish the learner's step, stop the episodes,
abort in the store what no episode drives any more, push and evaluate the final weights, count
what was never trained as aborted, checkpoint (the commit point acknowledges it all). A learner
that dies meanwhile is restarted (`sched/recovery.py`) and the run goes on to its end again.
A crash or Ctrl-C skips all this; `asyncrl run --resume` takes it from the last checkpoint.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from .parts import LearnerDied
from .resume import abort_running

if TYPE_CHECKING:
    from .loop import Loop


async def close(loop: Loop) -> float | None:
    """End `loop`'s run with balanced books; the final held-out accuracy."""
    while True:
        try:
            return await _close(loop)
        except LearnerDied as died:
            await loop.recovery.restart_learner(died)
            loop.closing = False  # rewound to its last checkpoint, the run trains again up to its end
            await loop.run()


async def _close(loop: Loop) -> float | None:
    loop.closing = True
    if loop.pending is not None:
        await loop.finish_step()
    await loop.episodes.stop()
    await asyncio.to_thread(abort_running, loop.p.store, "the run ended")
    if loop.state.version > loop.pushed:
        await loop.push()
    fresh = loop.evaluated == loop.pushed and loop.accuracy is not None
    accuracy = loop.accuracy if fresh else await loop.evaluate(force=True)
    await loop.collect()
    loop.books.book_untrained(loop.groups.drain())
    await loop.books.checkpoint()
    loop.recovery.note_replacements()
    return accuracy
