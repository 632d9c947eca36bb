"""The slot-based KV cache: fixed tensors, slots handed out to requests, finished turns kept for reuse.

A slot is one sequence's row in every cache tensor ([slots, heads, max_len, dim] per layer and per
name: "k", "v", and for DSA models "index_k"). Requests in flight hold one slot each; a finished
request of a session may leave its KV behind (a *retained prefix*) so the next turn of that
rollout, whose prompt starts with the same tokens, prefills only its new suffix. Retained
prefixes are evicted least-recently-used first.

`ForwardBatch` describes one model call over (slots, ragged token rows, start positions): the same
shape serves batched prefill (T = longest suffix), decode (T = 1) and, later, speculative
verification (T = draft length + 1).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass, replace

import torch

CacheLayout = list[dict[str, tuple[int, int]]]
"""Per layer: cache name -> (heads, dim) stored per position."""


@dataclass
class ForwardBatch:
    """One forward pass: row b feeds tokens[b, :lengths[b]] at positions starts[b] + 0, 1, ...

    Rows are padded to T tokens; padded positions are computed but never written to the cache and
    their outputs are never read.
    """

    slots: torch.Tensor  # [B]
    tokens: torch.Tensor  # [B, T]
    positions: torch.Tensor  # [B, T]
    last_index: torch.Tensor  # [B]: index in T of each row's last real token
    mask: torch.Tensor  # [B, T, L] bool: causal visibility of cached positions 0..L-1
    context_len: int  # L, the longest row's start + length
    write_rows: torch.Tensor | None  # indices into the flattened [B*T] of real tokens; None = all real
    write_slots: torch.Tensor  # [N] slot of each real token
    write_positions: torch.Tensor  # [N] position of each real token
    slot_range: tuple[int, int] | None  # (lo, hi) when slots are exactly lo..hi-1: reads become views

    @classmethod
    def build(cls, slots: list[int], rows: list[list[int]], starts: list[int], device: torch.device) -> ForwardBatch:
        lengths = [len(row) for row in rows]
        width = max(lengths)
        tokens = torch.tensor([row + [0] * (width - len(row)) for row in rows], dtype=torch.long, device=device)
        return cls.from_tokens(slots, tokens, starts, None if min(lengths) == width else lengths)

    @classmethod
    def from_tokens(cls, slots: list[int], tokens: torch.Tensor, starts: list[int], lengths: list[int] | None = None) -> ForwardBatch:
        """Rows already padded into tokens [B, T]; `lengths` None means every row is T long.

        Speculative decoding feeds its drafts this way, straight from the tensors it drew them into.
        """
        device = tokens.device
        width = tokens.shape[1]
        start_t = torch.tensor(starts, dtype=torch.long, device=device)
        slot_t = torch.tensor(slots, dtype=torch.long, device=device)
        positions = start_t[:, None] + torch.arange(width, device=device) if width > 1 else start_t[:, None]
        context_len = max(starts) + width if lengths is None else max(s + n for s, n in zip(starts, lengths, strict=True))
        mask = torch.arange(context_len, device=device)[None, None, :] <= positions[:, :, None]
        if lengths is None:
            write_rows = None
            write_slots = slot_t.repeat_interleave(width) if width > 1 else slot_t
            write_positions = positions.reshape(-1)
            last_index = torch.full((len(slots),), width - 1, dtype=torch.long, device=device)
        else:
            real = torch.arange(width, device=device)[None, :] < torch.tensor(lengths, device=device)[:, None]
            write_rows = real.reshape(-1).nonzero().squeeze(1)
            write_slots = slot_t[:, None].expand(-1, width).reshape(-1)[write_rows]
            write_positions = positions.reshape(-1)[write_rows]
            last_index = torch.tensor(lengths, dtype=torch.long, device=device) - 1
        lo = slots[0]
        contiguous = slots == list(range(lo, lo + len(slots)))
        return cls(
            slots=slot_t,
            tokens=tokens,
            positions=positions,
            last_index=last_index,
            mask=mask,
            context_len=context_len,
            write_rows=write_rows,
            write_slots=write_slots,
            write_positions=write_positions,
            slot_range=(lo, lo + len(slots)) if contiguous else None,
        )

    def next_position(self, tokens: torch.Tensor) -> ForwardBatch:
        """The same single-token rows one position further on, fed tokens [B, 1] (chained drafts)."""
        positions = self.positions + 1
        context_len = self.context_len + 1
        mask = torch.arange(context_len, device=tokens.device)[None, None, :] <= positions[:, :, None]
        return replace(self, tokens=tokens, positions=positions, mask=mask, context_len=context_len, write_positions=positions.reshape(-1))


class KVCache:
    """Cache tensors for every layer, indexed by slot and position."""

    def __init__(self, layout: CacheLayout, num_slots: int, max_len: int, *, dtype: torch.dtype, device: torch.device) -> None:
        self.num_slots = num_slots
        self.max_len = max_len
        # Zeros, not empty: masked-out positions still enter the attention matmul (weight 0), and
        # 0 * NaN from uninitialised memory would poison a whole row.
        self.layers = [
            {name: torch.zeros(num_slots, heads, max_len, dim, dtype=dtype, device=device) for name, (heads, dim) in spec.items()}
            for spec in layout
        ]  # fmt: skip

    def write(self, layer: int, name: str, batch: ForwardBatch, values: torch.Tensor) -> None:
        """Store values [B, T, heads, dim] of the batch's real tokens."""
        flat = values.reshape(-1, *values.shape[2:])
        if batch.write_rows is not None:
            flat = flat[batch.write_rows]
        self.layers[layer][name][batch.write_slots, :, batch.write_positions] = flat

    def copy(self, source: int, target: int, length: int) -> None:
        """Copy positions 0..length-1 of one slot into another, in every layer."""
        for buffers in self.layers:
            for buf in buffers.values():
                buf[target, :, :length] = buf[source, :, :length]

    def read(self, layer: int, name: str, batch: ForwardBatch) -> torch.Tensor:
        """Positions 0..L-1 of the batch's slots: [B, heads, L, dim] (a view when slots are contiguous)."""
        buf = self.layers[layer][name]
        if batch.slot_range is not None:
            lo, hi = batch.slot_range
            return buf[lo:hi, :, : batch.context_len]
        return buf[batch.slots, :, : batch.context_len]


@dataclass
class _Retained:
    session_id: str
    tokens: list[int]


class SlotManager:
    """Hands out cache slots to requests and keeps finished sessions' KV for prefix reuse.

    Slots 0..max_running-1 serve requests in flight, lowest free first, so a decode batch is
    usually one contiguous block and reads its KV as a view instead of gathering it. Retained
    prefixes live in the slots above: a finished turn's KV is copied up there (evicting the least
    recently used) and copied back down when the session's next turn reuses it. A copy moves one
    sequence's KV once; gathering scattered slots would cost that every decode step.
    """

    def __init__(self, cache: KVCache, max_running: int, max_retained: int) -> None:
        if cache.num_slots != max_running + max_retained:
            raise ValueError("the cache needs max_running + max_retained slots")
        self.cache = cache
        self.max_retained = max_retained
        self._free = list(range(max_running))  # heaps: lowest slot first
        self._free_retained = list(range(max_running, max_running + max_retained))
        self._retained: OrderedDict[int, _Retained] = OrderedDict()  # least recently used first

    @property
    def num_retained(self) -> int:
        return len(self._retained)

    def acquire(self, session_id: str | None, prompt: list[int]) -> tuple[int, int]:
        """A slot for `prompt` and how many of its leading tokens already have KV there.

        The caller keeps fewer than max_running requests in flight, so a slot is always free.
        """
        slot = heapq.heappop(self._free)
        best, best_len = None, 0
        for kept_slot, kept in self._retained.items():
            if session_id is not None and kept.session_id == session_id:
                common = _common_prefix(kept.tokens, prompt)
                if common > best_len:
                    best, best_len = kept_slot, common
        # At least one prompt token is always fed: its logits give the first sampled token.
        reuse = min(best_len, len(prompt) - 1)
        if best is None or reuse == 0:
            return slot, 0
        self.cache.copy(best, slot, reuse)
        del self._retained[best]
        heapq.heappush(self._free_retained, best)
        return slot, reuse

    def release(self, slot: int, session_id: str | None, cached_tokens: list[int]) -> None:
        """Free a finished request's slot, first keeping its KV for the session if prefixes are retained."""
        heapq.heappush(self._free, slot)
        if session_id is None or self.max_retained == 0 or not cached_tokens:
            return
        if not self._free_retained:
            evicted, _ = self._retained.popitem(last=False)
            heapq.heappush(self._free_retained, evicted)
        kept = heapq.heappop(self._free_retained)
        self.cache.copy(slot, kept, len(cached_tokens))
        self._retained[kept] = _Retained(session_id, cached_tokens)

    def drop_retained(self) -> None:
        """Forget every retained prefix (their KV was computed with weights that are gone)."""
        for slot in self._retained:
            heapq.heappush(self._free_retained, slot)
        self._retained.clear()


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
