"""The learner's side of MoE routing replay (`learner.routing_replay`): recorded experts as a tensor per micro-batch.

The engine records, for every sampled token, the experts its router chose at the position whose
output sampled that token (`asyncrl.policy.routing` states the convention); `Sample.routes` holds
them aligned with `token_ids`. A learner forward over a right-padded micro-batch routes position p
with the experts recorded for token p + 1, and every other position (prompt and tool tokens,
padding) routes itself. `replay` wraps the forward; it also makes the forward choose through the
selection functions the engine uses (DSA top-k and router top-k, ties included).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from asyncrl.policy.routing import replaying_routes

Routes = Sequence[Sequence[Sequence[int]] | None]
"""One sample's routes: per token, per MoE layer, expert ids (None where the token was not sampled)."""


def routes_tensor(rows: Sequence[Routes | None], length: int) -> torch.Tensor | None:
    """[B, length, MoE layers, top_k] long: row b, position p holds rows[b][p + 1], -1 where nothing
    was recorded. None when no row has any route."""
    shape = next((
        (len(token), len(token[0])) for routes in rows if routes is not None for token in routes if token is not None
    ), None)  # fmt: skip
    if shape is None:
        return None
    out = torch.full((len(rows), length, *shape), -1, dtype=torch.long)
    for b, routes in enumerate(rows):
        if routes is None:
            continue
        for p, token in enumerate(routes[1 : length + 1]):
            if token is not None:
                if (len(token), len(token[0])) != shape:
                    raise ValueError(f"routing replay: row {b} token {p + 1} has routes of shape {len(token)}x{len(token[0])}, not {shape}")
                out[b, p] = torch.tensor(token, dtype=torch.long)
    return out


@contextlib.contextmanager
def replay(model: nn.Module, routes: torch.Tensor | None) -> Iterator[None]:
    """Run the block's forward of `model` over the micro-batch that `routes` (from `routes_tensor`, or
    None: no replay) was built for, with the shared selection functions."""
    with replaying_routes(model, None if routes is None else routes.to(next(model.parameters()).device)):
        yield
