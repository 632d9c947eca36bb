"""MoE routing for GLM-5's sigmoid router, shared by the embedded engine and the learner, and routing replay.

`route` is the router's choice (scores + correction bias, group-limited top-k) and weighting
(the chosen experts' own sigmoid scores, normalised and scaled), with the same explicit order on
ties as the DSA selection (`asyncrl.policy.dsa.topk_positions`: score descending, expert id
ascending). Given `replay` experts, a token takes those instead of choosing again but is still
weighted by its own router scores, so the router's gradient is the usual one.

Routing replay (`learner.routing_replay`): two experts whose scores differ by less than the
rounding noise between two code paths (the engine's native forward and transformers') can be
chosen differently by each, and one flipped expert moves a log-prob by far more than rounding
does. The engine records the experts behind every sampled token (`rollout.record_routes`); the
learner's forward takes them (`replaying_routes`).

Convention: a turn's `routes[i]` are the experts, per MoE layer, at the forward position whose
output sampled completion token i (the last prompt token for i = 0, completion token i - 1 after
it); `Sample.routes[j]` is aligned with `token_ids`, so position p of a learner forward replays
`Sample.routes[p + 1]`. Recorded ids are sorted ascending.
"""

from __future__ import annotations

import contextlib
import types
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .dsa import indexer_forward, topk_positions


@dataclass(frozen=True)
class RouterSpec:
    """What the choice and weighting read of a `glm_moe_dsa` config."""

    top_k: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    scaling: float

    @classmethod
    def of(cls, config) -> RouterSpec:
        return cls(config.num_experts_per_tok, config.n_group, config.topk_group, config.norm_topk_prob, config.routed_scaling_factor)

    @classmethod
    def of_gate(cls, gate) -> RouterSpec:
        """From a transformers `GlmMoeDsaTopkRouter`, which keeps its own copies of these fields."""
        return cls(gate.top_k, gate.num_group, gate.topk_group, gate.norm_topk_prob, gate.routed_scaling_factor)


def choose_experts(choice: torch.Tensor, spec: RouterSpec) -> torch.Tensor:
    """[N, top_k] expert ids from choice scores [N, E] (sigmoid scores + correction bias): the best
    `topk_group` groups (by the sum of each group's two best), then the best experts within them."""
    tokens, experts = choice.shape
    if spec.n_group > 1:
        grouped = choice.view(tokens, spec.n_group, experts // spec.n_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # values only: ties cannot reorder them
        best = topk_positions(group_scores, spec.topk_group)
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(tokens, experts)
    return topk_positions(choice, spec.top_k)


def route(
    logits: torch.Tensor, bias: torch.Tensor, spec: RouterSpec, replay: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen [N, top_k] ids, weights [N, top_k] float32) from router logits [N, E] (float32).

    `replay` [N, top_k]: experts to use instead of choosing; rows holding -1 choose as usual.
    """
    scores = logits.sigmoid()
    chosen = choose_experts(scores + bias, spec)
    if replay is not None:
        given = replay.to(chosen.device, torch.long)
        chosen = torch.where((given >= 0).all(dim=-1, keepdim=True), given, chosen)
    weights = scores.gather(1, chosen)
    if spec.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return chosen, weights * spec.scaling


# --- the learner's transformers modules ----------------------------------------------------------


_REPLAY: weakref.WeakKeyDictionary[nn.Module, torch.Tensor] = weakref.WeakKeyDictionary()
"""Router module -> the routes [N, top_k] its next forwards take (only inside `replaying_routes`)."""


def _gate_forward(gate, hidden_states: torch.Tensor):
    """A router's forward (`ROUTERS`) through `route`, replaying the routes `replaying_routes` set."""
    hidden_states = hidden_states.view(-1, gate.hidden_dim)
    logits = F.linear(hidden_states.float(), gate.weight.float())
    replay = _REPLAY.get(gate)
    if replay is not None and replay.shape[0] != logits.shape[0]:
        raise ValueError(f"routing replay: {replay.shape[0]} routed tokens given for a forward of {logits.shape[0]}")
    chosen, weights = route(logits, gate.e_score_correction_bias, RouterSpec.of_gate(gate), replay)
    return logits, weights, chosen


def _modules(model: nn.Module, class_name: str) -> list[nn.Module]:
    return [m for m in model.modules() if type(m).__name__ == class_name]


ROUTERS = ("GlmMoeDsaTopkRouter", "Glm4MoeTopkRouter", "DeepseekV3TopkRouter")
"""transformers' routers of the sigmoid-routed MoE families (GLM-5, GLM-4.5, DeepSeek-V3): the same fields and
forward, so `route` replaces each the same way."""


def moe_gates(model: nn.Module) -> list[nn.Module]:
    """The router of every MoE layer of a transformers model of those families, in layer order."""
    return [m for m in model.modules() if type(m).__name__ in ROUTERS]


def use_shared_selection(*models: nn.Module) -> None:
    """Make the routers (`ROUTERS`) and DSA indexers of these transformers modules (a policy, its MTP layer)
    choose through `route` and `asyncrl.policy.dsa`, the functions the engine uses.
    In place and idempotent; the weights and the state dict are untouched. Other families: no-op."""
    for model in models:
        for gate in moe_gates(model):
            gate.forward = types.MethodType(_gate_forward, gate)
        for indexer in _modules(model, "GlmMoeDsaIndexer"):
            indexer.forward = types.MethodType(indexer_forward, indexer)


@contextlib.contextmanager
def replaying_routes(model: nn.Module, routes: torch.Tensor | None) -> Iterator[None]:
    """Within the block, the model's MoE layers take `routes` [B, S, layers, top_k] (expert ids, -1
    where the token routes itself) for a forward over [B, S] tokens. None: no replay (shared
    selection only). Installs `use_shared_selection` on the model if not yet there."""
    use_shared_selection(model)
    gates = moe_gates(model)
    if routes is not None and routes.shape[2] != len(gates):
        raise ValueError(f"routing replay: routes for {routes.shape[2]} MoE layers, the model has {len(gates)}")
    try:
        for layer, gate in enumerate(gates):
            if routes is not None:
                _REPLAY[gate] = routes[:, :, layer].reshape(-1, routes.shape[-1])
        yield
    finally:
        for gate in gates:
            _REPLAY.pop(gate, None)
