"""DSA indexer warm-up (GLM-5 / DeepSeek-V3.2): teach each lightning indexer where its layer's attention looks.

transformers runs the indexer under no_grad (its top-k is discrete), so the language-model loss
never trains it. The warm-up gives it a loss of its own, in two stages, after SFT:

- dense: the policy frozen, full attention (every visible position selected), each indexer's
  score distribution softmax_l(I[t, l]) over the visible keys is fitted to its layer's attention
  probabilities summed over heads and L1-normalised, p[t, l], by KL(p || softmax(I)), per query,
  token-averaged. Only the indexers' parameters move.
- sparse: the indexers' top-k selection in effect (`sparse_index_topk`, else the policy's own).
  The rest of the policy (and the MTP layer) trains on the SFT loss with the SFT optimizer, the
  indexers on the KL restricted to the positions they selected, with their own optimizer; the
  indexers' inputs are detached, so neither loss reaches the other's parameters.

The targets come from hooks: each indexer's inputs (hidden states, q_resid, rotary embedding,
mask) and its selection, and its attention layer's probabilities (eager attention, which returns
them), all detached. The indexer's scores are then recomputed with gradients by
`asyncrl.policy.dsa.indexer_scores`, the formula the engine and the learner's selection use.
Each indexer learns from its own layer's attention; layers of `indexer_types` "shared" reuse an
earlier layer's selection and have no indexer to train. The MTP layer's indexer is not trained.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from asyncrl.configs.schema import IndexerWarmupConfig, RunConfig
from asyncrl.policy.dsa import indexer_scores, topk_positions, visible_positions
from asyncrl.policy.routing import use_shared_selection

from .sft import micro_batches, train_step
from .sft_data import Demo

NO_INDEXER = "sft.indexer_warmup: the policy has no DSA indexer (policy.tiny.arch glm_moe_dsa has one)"
DENSE = 1 << 30
"""An index_topk no context reaches: the selection keeps every visible position."""


def indexed_attentions(model: nn.Module) -> list[Any]:
    """The policy's attention layers that run their own DSA indexer, in layer order (none for other families)."""
    return [m for m in model.get_submodule("model").modules() if type(m).__name__ == "GlmMoeDsaAttention" and m.indexer is not None]


def indexer_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for attention in indexed_attentions(model) for p in attention.indexer.parameters()]


@dataclass
class Capture:
    """One layer's forward: the indexer's inputs, its selection [B, S, T] and the attention target [B, S, T]."""

    indexer: nn.Module
    hidden_states: torch.Tensor
    q_resid: torch.Tensor
    position_embeddings: tuple[torch.Tensor, torch.Tensor]
    attention_mask: torch.Tensor
    selected: torch.Tensor | None = None
    attention: torch.Tensor | None = None


@contextlib.contextmanager
def capturing(model: nn.Module) -> Iterator[list[Capture]]:
    """Within the block, every forward of the policy appends a `Capture` per indexed layer, under eager attention."""
    captures: list[Capture] = []
    hooks = []
    for attention in indexed_attentions(model):

        def before(indexer, args, kwargs):
            hidden, q_resid, (cos, sin), mask = args[:4]
            captures.append(Capture(indexer, hidden.detach(), q_resid.detach(), (cos.detach(), sin.detach()), mask.detach()))

        def after(_indexer, _args, chosen):
            last = captures[-1]
            visible = visible_positions(last.attention_mask).expand(*chosen.shape[:2], last.attention_mask.shape[-1])
            last.selected = torch.zeros_like(visible).scatter_(-1, chosen.long(), True) & visible

        def probabilities(_attention, _args, output):
            # [B, heads, S, T] -> summed over heads; normalised where the KL is taken.
            captures[-1].attention = output[1].detach().float().sum(dim=1)

        hooks += [
            attention.indexer.register_forward_pre_hook(before, with_kwargs=True),
            attention.indexer.register_forward_hook(after),
            attention.register_forward_hook(probabilities),
        ]
    config: Any = model.config
    previous = config._attn_implementation
    config._attn_implementation = "eager"  # sdpa does not return the probabilities
    try:
        yield captures
    finally:
        config._attn_implementation = previous
        for hook in hooks:
            hook.remove()


@contextlib.contextmanager
def selecting(model: nn.Module, topk: int) -> Iterator[None]:
    """Within the block, each policy indexer keeps `topk` positions per query (DENSE: all of them)."""
    indexers: list[Any] = [a.indexer for a in indexed_attentions(model)]
    saved = [indexer.index_topk for indexer in indexers]
    for indexer in indexers:
        indexer.index_topk = topk
    try:
        yield
    finally:
        for indexer, topk_before in zip(indexers, saved, strict=True):
            indexer.index_topk = topk_before


def _scores(capture: Capture) -> torch.Tensor:
    return indexer_scores(capture.indexer, capture.hidden_states, capture.q_resid, capture.position_embeddings, capture.attention_mask)


def indexer_kl(capture: Capture, query_mask: torch.Tensor) -> tuple[torch.Tensor, float]:
    """(summed KL over the real queries, their count): KL(p || softmax(I)) on the selected positions,
    p the attention summed over heads and renormalised there."""
    assert capture.selected is not None and capture.attention is not None
    support = capture.selected
    target = capture.attention.masked_fill(~support, 0.0)
    target = target / target.sum(dim=-1, keepdim=True).clamp_min(1e-30)
    log_q = torch.log_softmax(_scores(capture).masked_fill(~support, float("-inf")), dim=-1)
    per_query = (torch.xlogy(target, target) - target * log_q.masked_fill(~support, 0.0)).sum(dim=-1)
    real = query_mask.bool() & support.any(dim=-1)
    return per_query[real].sum(), float(real.sum())


def _kl_backward(captures: Sequence[Capture], query_masks: Sequence[torch.Tensor], layers: int) -> float:
    """Backpropagate the KL of `captures` (`layers` per forward, one forward per query mask [B, S]):
    each layer's token mean, summed over layers, so each indexer gets its own mean's gradient.
    Returns the mean KL per query and layer."""
    if len(captures) != layers * len(query_masks):
        raise RuntimeError(f"indexer warm-up: {len(captures)} indexer forwards captured, expected {layers} x {len(query_masks)}")
    terms = [indexer_kl(capture, query_masks[i // layers]) for i, capture in enumerate(captures)]
    queries = max(1.0, sum(n for _, n in terms) / layers)
    total = torch.stack([kl for kl, _ in terms]).sum() / queries
    total.backward()
    return total.item() / layers


class IndexerWarmup:
    """The two stages over one policy; the indexers have their own AdamW (no weight decay)."""

    def __init__(self, model: nn.Module, config: IndexerWarmupConfig, grad_clip: float) -> None:
        self.model, self.config, self.grad_clip = model, config, grad_clip
        self.params = indexer_parameters(model)
        self.layers = len(indexed_attentions(model))
        if not self.params:
            raise ValueError(NO_INDEXER)
        use_shared_selection(model)  # the engine's top-k, ties included
        self.optimizer = torch.optim.AdamW(self.params, lr=config.lr, weight_decay=0.0)
        policy_config: Any = model.config
        self.sparse_topk: int = config.sparse_index_topk or policy_config.index_topk

    def _indexer_step(self, captures: Sequence[Capture], masks: Sequence[torch.Tensor]) -> float:
        kl = _kl_backward(captures, masks, self.layers)
        torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return kl

    def dense_step(self, demos: Sequence[Demo], pad_token_id: int, pack_length: int | None) -> float:
        """One dense step: the policy's forwards without gradients, the indexers fitted to full attention."""
        masks = []
        with capturing(self.model) as captures, selecting(self.model, DENSE), torch.no_grad():
            for batch in micro_batches(demos, pad_token_id, pack_length):
                self.model.get_submodule("model")(**_inputs(batch), use_cache=False)
                masks.append(batch["attention_mask"])
        return self._indexer_step(captures, masks)

    def sparse_step(
        self, run: RunConfig, mtp: nn.Module | None, demos: list[Demo], pad_token_id: int, pack_length: int | None,
        main_params: Sequence[nn.Parameter], main_optimizer: torch.optim.Optimizer,
    ) -> tuple[float, float]:  # fmt: skip
        """One sparse step: the SFT step under the selection (the SFT optimizer; the indexers get no
        gradient from it), then the indexers on the KL over their selections. Returns (SFT loss, KL)."""
        with capturing(self.model) as captures, selecting(self.model, self.sparse_topk):
            loss, _, _ = train_step(run, self.model, mtp, demos, pad_token_id, pack_length)
        # train_step's forwards are the micro-batches', in order; the MTP layer's indexer is not hooked.
        masks = [b["attention_mask"] for b in micro_batches(demos, pad_token_id, pack_length)]
        torch.nn.utils.clip_grad_norm_(main_params, run.sft.grad_clip)
        main_optimizer.step()
        main_optimizer.zero_grad(set_to_none=True)
        return loss, self._indexer_step(captures, masks)


def _inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The decoder's inputs: packed rows carry position ids and no mask (see learner/sft.py)."""
    if "position_ids" in batch:
        return {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}


@torch.no_grad()
def topk_agreement(model: nn.Module, demos: Sequence[Demo], pad_token_id: int, k: int) -> tuple[float, float] | None:
    """(overlap@k, chance): the mean share of each indexer's k best positions that are among its layer's
    k most attended ones under full attention, over the real queries that see more than 2k positions;
    chance is the mean of k / visible, what a random choice of k positions scores. None: no such query."""
    overlaps, chances = [], []
    with capturing(model) as captures, selecting(model, DENSE):
        for batch in micro_batches(demos, pad_token_id, None):
            start = len(captures)
            model.get_submodule("model")(**_inputs(batch), use_cache=False)
            for capture in captures[start:]:
                assert capture.attention is not None  # the layer's hook ran
                visible = visible_positions(capture.attention_mask).expand_as(capture.attention)
                counts = visible.sum(dim=-1)
                rows = batch["attention_mask"].bool() & (counts > 2 * k)
                attention = capture.attention.masked_fill(~visible, float("-inf"))
                mine = torch.zeros_like(visible).scatter_(-1, topk_positions(_scores(capture), k), True)
                best = torch.zeros_like(visible).scatter_(-1, topk_positions(attention, k), True)
                overlaps.append(((mine & best).sum(dim=-1).float() / k)[rows])
                chances.append((k / counts.float())[rows])
    if not sum(len(o) for o in overlaps):
        return None
    return torch.cat(overlaps).mean().item(), torch.cat(chances).mean().item()


def check_warmup(config: IndexerWarmupConfig, model: nn.Module) -> None:
    """Refuse, before any training, a warm-up asked of a policy with no DSA indexer."""
    if (config.steps or config.sparse_steps) and not indexer_parameters(model):
        raise ValueError(NO_INDEXER)


def run_indexer_warmup(
    run: RunConfig, model: nn.Module, mtp: nn.Module | None, next_demos: Callable[[int], list[Demo]], pad_token_id: int,
    pack_length: int | None, main_params: Sequence[nn.Parameter], main_optimizer: torch.optim.Optimizer,
    record: Callable[[dict], None],
) -> bool:  # fmt: skip
    """Both stages as `run.sft.indexer_warmup` sets them, each step recorded, then the top-k agreement on an
    unseen batch (`indexer_overlap`, `indexer_overlap_chance`, at the sparse stage's k); False when it sets none."""
    config = run.sft.indexer_warmup
    if config.steps == 0 and config.sparse_steps == 0:
        return False
    warmup = IndexerWarmup(model, config, run.sft.grad_clip)
    for step in range(1, config.steps + 1):
        kl = warmup.dense_step(next_demos(config.batch_size), pad_token_id, pack_length)
        record({"indexer_step": step, "indexer_stage": "dense", "indexer_kl": kl})
    for step in range(1, config.sparse_steps + 1):
        demos = next_demos(config.batch_size)
        loss, kl = warmup.sparse_step(run, mtp, demos, pad_token_id, pack_length, main_params, main_optimizer)
        record({"indexer_step": config.steps + step, "indexer_stage": "sparse", "indexer_kl": kl, "sparse_loss": loss})
    agreement = topk_agreement(model, next_demos(config.batch_size), pad_token_id, warmup.sparse_topk)
    if agreement is not None:
        record({"indexer_overlap": agreement[0], "indexer_overlap_chance": agreement[1], "indexer_overlap_k": warmup.sparse_topk})
    return True
