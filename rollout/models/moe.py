"""The sigmoid-routed MoE MLP that GLM-5 (`glm_moe_dsa`), GLM-4.5 (`glm4_moe`) and DeepSeek-V3 share:
scores by sigmoid, experts chosen by score plus a correction bias within the best groups, weights from
the scores (`asyncrl.policy.routing.route`, the learner's router too), one shared expert always on.

Up to DENSE_EXPERTS_MAX routed experts, every expert runs on every token as one wide MLP (two
matmuls, unchosen experts weighted by exactly 0); beyond it, experts run one by one on the tokens
routed to them. `RouteRecorder` keeps what each MoE layer chose in a forward, for routing replay.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from asyncrl.policy.routing import RouterSpec, route

from ..fp8 import linear
from .common import swiglu

DENSE_EXPERTS_MAX = 32
LINEAR_KEYS = frozenset({"gate_up", "down", "expert_gate_up", "expert_down"})
"""Weight-dict entries of an MLP or MoE layer that are matrices of a linear layer (what rollout.fp8
quantizes). The router stays in full precision: it chooses experts, and a flipped choice is a large
change, not a small one."""


def mlp_weights(get, p: str) -> dict:
    """A SwiGLU MLP's weights under prefix `p`, gate and up fused."""
    return dict(gate_up=torch.cat([get(p + "gate_proj.weight"), get(p + "up_proj.weight")]), down=get(p + "down_proj.weight"))


class SigmoidMoE:
    def __init__(self, config) -> None:
        self.experts, self.top_k = config.n_routed_experts, config.num_experts_per_tok
        self.spec = RouterSpec.of(config)

    def weights(self, get, p: str) -> dict:
        """The layer's weights under prefix `p` (`...mlp.`), laid out for the forward this many experts takes."""
        gate_up = get(p + "experts.gate_up_proj")  # [E, 2I, H]: gate rows then up rows per expert
        down = get(p + "experts.down_proj")  # [E, H, I]
        shared = mlp_weights(get, p + "shared_experts.")
        w = dict(router=get(p + "gate.weight"), router_bias=get(p + "gate.e_score_correction_bias"))
        if self.experts > DENSE_EXPERTS_MAX:
            return dict(w, expert_gate_up=gate_up, expert_down=down, shared=shared)
        experts, inner, hidden = down.shape[0], down.shape[2], down.shape[1]
        shared_gate, shared_up = shared["gate_up"].chunk(2)
        # All experts plus the shared one as a single MLP of width M = E*I + I_shared: gate rows of
        # every expert, then up rows of every expert, so one chunk(2) splits them.
        gates, ups = gate_up.view(experts, 2, inner, hidden).unbind(1)
        routed_down = down.permute(1, 0, 2).reshape(hidden, experts * inner)
        # expand[e, m] = 1 where column m belongs to expert e (row E is the shared expert): turns
        # per-token routing weights [N, E+1] into per-column scales [N, M] with one exact matmul.
        width = experts * inner + shared_gate.shape[0]
        expand = torch.zeros(experts + 1, width, dtype=down.dtype, device=down.device)
        for e in range(experts):
            expand[e, e * inner : (e + 1) * inner] = 1
        expand[experts, experts * inner :] = 1
        return dict(
            w,
            gate_up=torch.cat([gates.reshape(-1, hidden), shared_gate, ups.reshape(-1, hidden), shared_up]),
            down=torch.cat([routed_down, shared["down"]], dim=1),
            expand=expand,
        )

    def __call__(self, lw: dict, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(output like x, the chosen experts [tokens, top_k]) for x [..., H]."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        chosen, weights = route(F.linear(x.float(), lw["router"].float()), lw["router_bias"], self.spec)
        weights = weights.to(x.dtype)
        if "expand" not in lw:
            return self._one_by_one(lw, x, chosen, weights).view(shape), chosen
        per_expert = torch.zeros(x.shape[0], self.experts + 1, dtype=x.dtype, device=x.device)
        per_expert[:, self.experts] = 1  # the shared expert always runs with weight 1
        per_expert.scatter_(1, chosen, weights)
        gate, up = linear(x, lw["gate_up"]).chunk(2, dim=-1)
        return linear(F.silu(gate) * up * (per_expert @ lw["expand"]), lw["down"]).view(shape), chosen

    @staticmethod
    def _one_by_one(lw, x, chosen, weights) -> torch.Tensor:
        out = swiglu(x, lw["shared"]["gate_up"], lw["shared"]["down"])
        for e in chosen.unique().tolist():
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            y = swiglu(x[rows], lw["expert_gate_up"][e], lw["expert_down"][e])
            out.index_add_(0, rows, y * weights[rows, slot, None])
        return out


class RouteRecorder:
    """What a native MoE model keeps for routing replay: with `record_routes` set (the engine sets it), the
    experts every decoder MoE layer chose in the last forward."""

    top_k: int
    record_routes: bool

    def start_recording(self) -> None:
        """At the start of a forward: a fresh list when recording, else None."""
        self.routes: list[torch.Tensor] | None = [] if self.record_routes else None

    def keep(self, chosen: torch.Tensor) -> None:
        if self.routes is not None:
            self.routes.append(chosen)

    def recorded_routes(self, rows: int) -> torch.Tensor:
        """[B, T, MoE layers, top_k] expert ids (ascending) the last forward over B = `rows` rows chose."""
        if not self.routes:
            raise RuntimeError("no routes recorded: set record_routes before the forward (and the model needs MoE layers)")
        return torch.stack(self.routes, dim=1).sort(dim=-1).values.view(rows, -1, len(self.routes), self.top_k)
