"""A fixed held-out set of distinct tasks: the same seed gives the same set in every process.

Distinct, because drawing with replacement from a small held-out split repeats its few problems, and a
handful of them would weigh a large share of the score.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

MISSES_PER_PROBLEM = 100
"""Repeated draws allowed per problem wanted before the split counts as too small."""


def distinct_draws(
    draw: Callable[[random.Random], T], key: Callable[[T], str], num_problems: int, seed: int, *, too_few: Callable[[int], Exception]
) -> list[T]:
    """`num_problems` draws of `draw(rng)` with distinct `key`s, in draw order; raises `too_few(found)`
    when the split runs out of new ones."""
    rng, found, misses = random.Random(seed), dict[str, T](), 0
    while len(found) < num_problems:
        item = draw(rng)
        if key(item) in found:
            misses += 1
            if misses > MISSES_PER_PROBLEM * num_problems:
                raise too_few(len(found))
            continue
        found[key(item)] = item
    return list(found.values())
