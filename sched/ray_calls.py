"""Ray actor calls as the loop's clients make them: awaitable on the loop's event loop, and telling an
actor's own death from the other failures a call can carry back."""

from __future__ import annotations

import asyncio
from typing import Any


def remote(method: Any, *args: Any) -> asyncio.Future:
    """A Ray actor call (`actor.verb`, not yet `.remote`d) as an asyncio future."""
    return asyncio.wrap_future(method.remote(*args).future())


def died(error: BaseException, actor: Any) -> bool:
    """Whether `error` says that `actor` itself is gone (not, say, the learner whose weights it was handed)."""
    import ray

    return isinstance(error, ray.exceptions.RayActorError) and getattr(error, "actor_id", None) in (None, actor._actor_id.hex())


def creation_failure(error: BaseException) -> str:
    """`: <the exception>` when the actor died of an error in its constructor (say a checkpoint that is not on
    its node's disk), else nothing: Ray's message puts the exception on its last line."""
    text = str(error)
    return f": {text.strip().splitlines()[-1]}" if "error raised in its creation task" in text else ""
