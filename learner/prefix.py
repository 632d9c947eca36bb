"""Shared-prefix scoring: rows that begin with the same tokens run those tokens through the policy once.

The samples of a GRPO group answer one prompt, so their rows start with the same tokens; an agent's
rollouts of one task share its system prompt, tool list and first message. Scoring each row whole
computes that prefix once per row. Here a micro-batch runs in two passes instead:

    prefix pass  -> each distinct prefix once, [G, P], filling a KV cache
    suffix pass  -> every row's remaining tokens, [R, S], attending to its group's cached prefix

and `PrefixSplit.gather` puts the two passes' hidden states back in the rows' own layout, [R, T, H],
so that log-probs, the objective, the consistency figures and the MTP loss see exactly what
the one-pass forward gives them (to float rounding: the same products, summed in other orders).
Gradients flow through the cache into the prefix pass and add up over the rows that share it, as
they would over the rows' own copies of the prefix.

The learner shares prefixes where the policy's family gives the same logits both ways
(`sharing_refusal` checks this once, at start) and where a micro-batch saves enough tokens to pay
for its second pass (`MIN_SAVED_FRACTION`).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from asyncrl.policy.mtp import decoder_and_head

from .sft_data import Masked, padded

MIN_SAVED_FRACTION = 0.2
"""Share a micro-batch's prefixes only when that skips at least this fraction of its tokens: the second
pass costs a decoder call of its own, which a few skipped tokens do not pay for."""

MAX_LOGIT_GAP = {torch.float32: 1e-3, torch.float64: 1e-6}
"""The largest logit difference (relative to the largest logit) between the two ways of scoring that
`sharing_refusal` accepts as float rounding, by the policy's dtype; half-precision dtypes get
`MAX_LOGIT_GAP_HALF` (their rounding alone moves logits by about 1e-2). A family that mishandles the
cache is off by far more."""

MAX_LOGIT_GAP_HALF = 5e-2


@dataclass
class PrefixSplit:
    """A micro-batch's rows as shared prefixes and per-row suffixes (G prefixes, R rows, width T)."""

    prefix_ids: torch.Tensor
    """[G, P] each prefix's tokens, right-padded."""
    prefix_mask: torch.Tensor
    """[G, P] 1 on real prefix tokens."""
    suffix_ids: torch.Tensor
    """[R, S] each row's tokens after its prefix, right-padded."""
    suffix_mask: torch.Tensor
    """[R, S] 1 on real suffix tokens."""
    group_of: torch.Tensor
    """[R] the prefix of each row."""
    prefix_len: torch.Tensor
    """[R] the length of each row's prefix (its suffix's first position)."""
    gather: torch.Tensor
    """[R, T] where each row position's hidden state is in the two passes' outputs, flattened and
    concatenated (prefixes first); padding positions point at some real one."""

    def to(self, device: torch.device) -> PrefixSplit:
        return dataclasses.replace(self, **{f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)})


def prefix_groups(rows: Sequence[Masked]) -> list[tuple[int, list[int]]]:
    """(prefix length, indices of its rows) for every set of rows with the same prompt, in first-seen order.

    Rows with the same tokens before their first sampled token share a prompt; their prefix is the
    longest run of tokens all of them begin with, short of each row's last token (every row keeps
    at least one token for the suffix pass). A row alone keeps all but its last token as its prefix.
    """
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    for index, row in enumerate(rows):
        first_sampled = next((j for j, m in enumerate(row.loss_mask) if m), len(row.token_ids))
        by_prompt.setdefault(tuple(row.token_ids[:first_sampled]), []).append(index)
    groups = []
    for members in by_prompt.values():
        token_lists = [rows[i].token_ids for i in members]
        limit = min(len(t) for t in token_lists) - 1
        length = 0
        while length < limit and all(t[length] == token_lists[0][length] for t in token_lists):
            length += 1
        groups.append((length, members))
    return groups


def saved_fraction(groups: Sequence[tuple[int, list[int]]], rows: Sequence[Masked]) -> float:
    """The fraction of the rows' tokens that sharing `groups`' prefixes does not compute."""
    total = sum(len(row.token_ids) for row in rows)
    saved = sum(length * (len(members) - 1) for length, members in groups)
    return saved / total if total else 0.0


def split_rows(groups: Sequence[tuple[int, list[int]]], rows: Sequence[Masked], pad_token_id: int) -> PrefixSplit:
    """The `PrefixSplit` of `rows` (in their order) under `groups` (`prefix_groups` of the same rows)."""
    group_of = [0] * len(rows)
    prefix_len = [0] * len(rows)
    for group, (length, members) in enumerate(groups):
        for i in members:
            group_of[i], prefix_len[i] = group, length
    width = max(len(row.token_ids) for row in rows)
    longest_prefix = max(length for length, _ in groups)
    longest_suffix = max(len(row.token_ids) - prefix_len[i] for i, row in enumerate(rows))

    prefixes = [rows[members[0]].token_ids[:length] for length, members in groups]
    suffixes = [row.token_ids[prefix_len[i] :] for i, row in enumerate(rows)]
    prefix_ids = padded(prefixes, longest_prefix, pad_token_id, torch.long)
    prefix_mask = padded([[1] * len(p) for p in prefixes], longest_prefix, 0, torch.long)
    suffix_ids = padded(suffixes, longest_suffix, pad_token_id, torch.long)
    suffix_mask = padded([[1] * len(s) for s in suffixes], longest_suffix, 0, torch.long)

    groups_t, lengths = torch.tensor(group_of), torch.tensor(prefix_len)
    position = torch.arange(width)[None, :]
    in_prefix = groups_t[:, None] * longest_prefix + position.clamp(max=longest_prefix - 1)
    in_suffix = len(groups) * longest_prefix + torch.arange(len(rows))[:, None] * longest_suffix
    in_suffix = in_suffix + (position - lengths[:, None]).clamp(min=0, max=longest_suffix - 1)
    gather = torch.where(position < lengths[:, None], in_prefix, in_suffix)
    return PrefixSplit(prefix_ids, prefix_mask, suffix_ids, suffix_mask, groups_t, lengths, gather)


def shared_hidden(policy: nn.Module, split: PrefixSplit) -> torch.Tensor:
    """The policy's final hidden states of the split's rows, [R, T, H], from the two passes: what
    `policy_hidden` gives for the whole rows."""
    from transformers import DynamicCache

    decoder = decoder_and_head(policy)[0]
    config: Any = decoder.config
    cache = DynamicCache(config=config)
    name = _cache_argument(decoder)
    prefix = decoder(input_ids=split.prefix_ids, attention_mask=split.prefix_mask, use_cache=True, **{name: cache})
    cache.batch_select_indices(split.group_of)  # each row its own reference to its prefix's keys and values
    positions = split.prefix_len[:, None] + torch.arange(split.suffix_ids.shape[1], device=split.suffix_ids.device)
    mask = torch.cat([split.prefix_mask[split.group_of], split.suffix_mask], dim=1)
    suffix = decoder(input_ids=split.suffix_ids, attention_mask=mask, position_ids=positions, use_cache=True, **{name: cache})
    width = prefix.last_hidden_state.shape[-1]
    flat = torch.cat([prefix.last_hidden_state.reshape(-1, width), suffix.last_hidden_state.reshape(-1, width)])
    return flat[split.gather]


def sharing_refusal(policy: nn.Module) -> str | None:
    """Why this policy cannot score rows through shared prefixes (its family's cache or attention does
    not give the one-pass logits back), or None when it can. Runs two short forwards of three rows."""
    from asyncrl.policy.mtp import policy_hidden_and_logits

    device = next(policy.parameters()).device
    config: Any = policy.config
    vocab = int(config.vocab_size)
    tokens = [[(7 * j + 3) % vocab for j in range(5)] + tail for tail in ([1, 2, 3], [4, 5], [6])]
    rows = [_Tokens(t, [0] * 5 + [1] * (len(t) - 5)) for t in tokens]
    split = split_rows(prefix_groups(rows), rows, pad_token_id=0).to(device)
    ids = torch.zeros((len(rows), 8), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, : len(row.token_ids)] = torch.tensor(row.token_ids)
        mask[i, : len(row.token_ids)] = 1
    ids, mask = ids.to(device), mask.to(device)
    try:
        with torch.no_grad():
            whole = policy_hidden_and_logits(policy, ids, mask)[1].float()
            shared = decoder_and_head(policy)[1](shared_hidden(policy, split)).float()
    except Exception as error:  # a family whose forward takes no cache, or other arguments
        return f"{type(policy).__name__}: scoring through a shared prefix failed ({type(error).__name__}: {error})"
    real = mask.bool()
    gap = float((whole - shared).abs()[real].max())
    tolerance = MAX_LOGIT_GAP.get(next(policy.parameters()).dtype, MAX_LOGIT_GAP_HALF)
    if not gap <= tolerance * max(1.0, float(whole.abs()[real].max())):
        return f"{type(policy).__name__}: a shared prefix changes its logits by up to {gap:.2e}"
    return None


@dataclass
class _Tokens:
    token_ids: list[int]
    loss_mask: list[int]


def _cache_argument(decoder: nn.Module) -> str:
    """The name the decoder's forward takes its KV cache under (transformers renamed `past_key_values`)."""
    parameters: Any = inspect.signature(decoder.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"
