"""From selected samples to the padded tensors of the RL learner's micro-batches.

Samples are bucketed by length the way SFT buckets demonstrations (`sft_data.length_buckets`) and
each bucket is cut so that no micro-batch holds more than `max_tokens` padded tokens (rows x
longest row), which bounds activation memory whatever the mix of short and long rollouts.

Every row carries the temperature at which each of its tokens is scored (`Sample.scoring_temperatures`:
the temperature its turn sampled at, 1 for greedy tokens, the run's where none is on record), so the
learner's log-probs compare with the engine's token by token. Rows also carry their sample's task
and the trajectory turn of each token (`Sample.token_turns`), for the consistency figures
(`learner/consistency.py`).

Rows that begin with the same tokens (the samples of one GRPO group) can share them
(`share_prefixes`): their micro-batches then hold whole sets of such rows and carry a `PrefixSplit`
(`learner/prefix.py`) that scores each shared prefix once.

A sample may carry `teacher_logprobs` (aligned with its tokens, as `distill.ScoredSample` does):
it is a distillation sample, whose advantage is per token and is computed in the learner's step
from those log-probs (`distill_advantages` in `learner/objectives/`) instead of from its reward.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from asyncrl.records import Sample, StalenessBy, oldest_version

from .prefix import MIN_SAVED_FRACTION, PrefixSplit, prefix_groups, saved_fraction, split_rows
from .routing_replay import routes_tensor
from .sft_data import collate, length_buckets, padded


@dataclass
class Row:
    """One sample to compute, with its advantage (padding repeats are rows of their own)."""

    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    advantage: float
    temperatures: list[float]
    """The temperature each token's log-prob is taken at (> 0; see `Sample.scoring_temperatures`)."""
    teacher_logprobs: list[float] | None = None
    """A distillation row: the teacher's log-prob of every token (its advantage is then per token)."""
    task: str = ""
    turns: list[int] | None = None
    """The trajectory turn of each token (`Sample.token_turns`); None when not on record."""
    routes: list | None = None
    """MoE routing replay: `Sample.routes` (per token, per MoE layer, expert ids; None where not sampled)."""
    top_k: list[int] | None = None
    """top-k each token was sampled under (0: none); None: no token of the row was truncated."""
    top_p: list[float] | None = None
    """top-p each token was sampled under (1.0: none); None as `top_k`."""
    index: int = -1
    """Where the row came from, for a caller that maps micro-batch results back to rows (-1: not set)."""


@dataclass
class MicroBatch:
    input_ids: torch.Tensor
    """[B, T] token ids, right-padded."""
    attention_mask: torch.Tensor
    """[B, T] 1 on real tokens."""
    loss_mask: torch.Tensor
    """[B, T] float, 1 exactly on sampled tokens."""
    rollout_logprobs: torch.Tensor
    """[B, T] log-prob of each sampled token under the distribution it was sampled from; 0 elsewhere."""
    advantages: torch.Tensor
    """[B] one advantage per row (0 for distillation rows)."""
    teacher_logprobs: torch.Tensor
    """[B, T] teacher log-prob of each token of a distillation row; 0 elsewhere."""
    distill: torch.Tensor
    """[B] bool: the row is a distillation row (per-token advantages from `teacher_logprobs`)."""
    temperatures: torch.Tensor
    """[B, T] temperature the log-prob of each token is taken at; 1 on padding."""
    turns: torch.Tensor
    """[B, T] long: trajectory turn index of each token; -1 on padding and where none is on record."""
    tasks: list[str]
    """The task of each row."""
    indices: list[int] = dataclasses.field(default_factory=list)
    """Each row's `Row.index` (micro-batches lay rows out by length, not in the order given)."""
    routes: torch.Tensor | None = None
    """[B, T, MoE layers, top_k] the experts position p replays (`learner/routing_replay.py`; -1: routes
    itself); None when no row has routes."""
    prefix: PrefixSplit | None = None
    """The rows as shared prefixes and suffixes, to score in two passes; None: one pass over whole rows."""
    top_k: torch.Tensor | None = None
    """[B, T] long top-k each token was sampled under (0: none); None when no row was truncated."""
    top_p: torch.Tensor | None = None
    """[B, T] top-p each token was sampled under (1.0: none); None as `top_k`."""
    old_logprobs: torch.Tensor | None = None
    """[B, T-1] pi_old's log-prob of token j+1 at trained positions (`learner/updates.py`); None: not scored."""

    @property
    def truncation(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """([B, T] top-k, [B, T] top-p) the tokens were sampled under, or None when none was truncated."""
        return None if self.top_k is None or self.top_p is None else (self.top_k, self.top_p)

    def to(self, device: torch.device) -> MicroBatch:
        moved: dict[str, Any] = {
            name: value.to(device) for name, value in vars(self).items() if isinstance(value, torch.Tensor | PrefixSplit)
        }
        return dataclasses.replace(self, **moved)


def to_rows(samples: Sequence[Sample], advantages: Sequence[float], temperature: float = 1.0) -> list[Row]:
    """Pair samples with advantages, refusing samples the learner cannot score. `temperature`: the run's
    sampling temperature, for tokens with none on record."""
    rows = []
    for sample, advantage in zip(samples, advantages, strict=True):
        n = len(sample.token_ids)
        if not (len(sample.loss_mask) == len(sample.logprobs) == len(sample.versions) == n):
            raise ValueError(f"rollout {sample.rollout_id!r}: token_ids, loss_mask, logprobs, versions lengths differ")
        if sample.temperatures is not None and len(sample.temperatures) != n:
            raise ValueError(f"rollout {sample.rollout_id!r}: temperatures and token_ids lengths differ")
        if n and sample.loss_mask[0]:
            # Position 0 has no context to predict it from; it can only be a prompt token.
            raise ValueError(f"rollout {sample.rollout_id!r}: its first token is marked as sampled")
        teacher = getattr(sample, "teacher_logprobs", None)
        if teacher is not None and len(teacher) != n:
            raise ValueError(f"rollout {sample.rollout_id!r}: teacher_logprobs and token_ids lengths differ")
        if any(values is not None and len(values) != n for values in (sample.top_ks, sample.top_ps)):
            raise ValueError(f"rollout {sample.rollout_id!r}: top_ks / top_ps and token_ids lengths differ")
        if sample.token_turns is not None and len(sample.token_turns) != n:
            raise ValueError(f"rollout {sample.rollout_id!r}: token_turns and token_ids lengths differ")
        temperatures = sample.scoring_temperatures(temperature)
        rows.append(Row(
            sample.token_ids, sample.loss_mask, sample.logprobs, float(advantage), temperatures, teacher,
            task=sample.task, turns=sample.token_turns, routes=sample.routes, top_k=sample.top_ks, top_p=sample.top_ps,
        ))  # fmt: skip
    return rows


def micro_batches(rows: list[Row], pad_token_id: int, max_tokens: int, share_prefixes: bool = False) -> list[MicroBatch]:
    """Length-bucketed micro-batches of at most `max_tokens` padded tokens (at least one row each).

    `share_prefixes`: rows with the same prompt stay together (in pieces of at most `max_tokens`
    padded tokens), and a micro-batch whose shared prefixes skip enough of its tokens
    (`prefix.MIN_SAVED_FRACTION`) carries their `PrefixSplit`.
    """
    if not share_prefixes:
        batches = []
        for bucket in length_buckets(rows):  # sorted by length, so a chunk's longest row is its last
            chunk: list[Row] = []
            for row in bucket:
                if chunk and (len(chunk) + 1) * len(row.token_ids) > max_tokens:
                    batches.append(_collate(chunk, pad_token_id))
                    chunk = []
                chunk.append(row)
            batches.append(_collate(chunk, pad_token_id))
        return batches
    sets = [piece for _, members in prefix_groups(rows) for piece in _pieces([rows[i] for i in members], max_tokens)]
    shared = []
    for similar in length_buckets(sets, length=_longest):
        held: list[list[Row]] = []
        for rows_of_prompt in similar:  # sorted by their longest row
            if held and (sum(map(len, held)) + len(rows_of_prompt)) * _longest(rows_of_prompt) > max_tokens:
                shared.append(_collate_shared([row for piece in held for row in piece], pad_token_id))
                held = []
            held.append(rows_of_prompt)
        shared.append(_collate_shared([row for piece in held for row in piece], pad_token_id))
    return shared


def _longest(rows: list[Row]) -> int:
    return max(len(row.token_ids) for row in rows)


def _pieces(rows: list[Row], max_tokens: int) -> list[list[Row]]:
    """`rows` (of one prompt) cut into pieces of at most `max_tokens` padded tokens (at least one row each)."""
    per_piece = max(1, max_tokens // _longest(rows))
    return [rows[i : i + per_piece] for i in range(0, len(rows), per_piece)]


def _collate_shared(rows: list[Row], pad_token_id: int) -> MicroBatch:
    groups = prefix_groups(rows)
    # A one-token row has an empty prefix: its row of the prefix pass would attend to nothing (NaN,
    # which the backward pass would carry into the weights' gradients even where it is never read).
    if saved_fraction(groups, rows) < MIN_SAVED_FRACTION or min(length for length, _ in groups) == 0:
        return _collate(rows, pad_token_id)
    return dataclasses.replace(_collate(rows, pad_token_id), prefix=split_rows(groups, rows, pad_token_id))


def _collate(rows: list[Row], pad_token_id: int) -> MicroBatch:
    tensors = collate(rows, pad_token_id)
    width = tensors["input_ids"].shape[1]
    logprobs = padded([row.logprobs for row in rows], width, 0.0, torch.float32)
    teacher = padded([row.teacher_logprobs or () for row in rows], width, 0.0, torch.float32)
    temperatures = padded([row.temperatures for row in rows], width, 1.0, torch.float32)  # not 0: logits / 0 is NaN
    turns = padded([row.turns or () for row in rows], width, -1, torch.long)
    truncating = any(row.top_k is not None for row in rows)
    top_k = padded([row.top_k or () for row in rows], width, 0, torch.long) if truncating else None
    top_p = padded([row.top_p or () for row in rows], width, 1.0, torch.float32) if truncating else None
    return MicroBatch(
        input_ids=tensors["input_ids"], attention_mask=tensors["attention_mask"], loss_mask=tensors["loss_mask"],
        rollout_logprobs=logprobs, advantages=torch.tensor([r.advantage for r in rows], dtype=torch.float32),
        teacher_logprobs=teacher, distill=torch.tensor([r.teacher_logprobs is not None for r in rows]),
        temperatures=temperatures, turns=turns, tasks=[r.task for r in rows], indices=[r.index for r in rows],
        routes=routes_tensor([r.routes for r in rows], tensors["input_ids"].shape[1]), top_k=top_k, top_p=top_p,
    )  # fmt: skip


def staleness_histogram(samples: Sequence[Sample], current_version: int, by: StalenessBy = "sampled") -> dict[int, int]:
    """Rollouts per version lag (current version - oldest sampled-token version, or with `by="kv"` oldest
    KV version: what the staleness rule reads, `learner.staleness_by`), before any drop."""
    lags: dict[str, int] = {}
    for sample in samples:
        oldest = oldest_version(sample.staleness_versions(by), sample.loss_mask)
        if oldest is not None:
            lag = current_version - oldest
            lags[sample.rollout_id] = max(lag, lags.get(sample.rollout_id, lag))
    return dict(sorted(Counter(lags.values()).items()))
