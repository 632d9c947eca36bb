"""The slot-based KV cache: fixed tensors, slots handed out to requests, finished turns kept for reuse.

A slot is one sequence's row in every cache tensor ([slots, heads, max_len, dim] per layer and per
name: "k", "v", and for DSA models "index_k"). Requests in flight hold one slot each; a finished
request of a session may keep its slot (a *retained prefix*) so the next turn of that rollout,
whose prompt starts with the same tokens, prefills only its new suffix. Retained slots are evicted
least-recently-used first.

`ForwardBatch` describes one model call over (slots, ragged token rows, start positions): the same
shape serves batched prefill (T = longest suffix), decode (T = 1) and, later, speculative
verification (T = draft length + 1).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass

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
    def build(cls, slots: list[int], rows: list[list[int]], starts: list[int], device: torch.device) -> "ForwardBatch":
        lengths = [len(row) for row in rows]
        width = max(lengths)
        tokens = torch.tensor([row + [0] * (width - len(row)) for row in rows], dtype=torch.long, device=device)
        start_t = torch.tensor(starts, dtype=torch.long, device=device)
        slot_t = torch.tensor(slots, dtype=torch.long, device=device)
        positions = start_t[:, None] + torch.arange(width, device=device)
        context_len = max(s + n for s, n in zip(starts, lengths))
        mask = torch.arange(context_len, device=device)[None, None, :] <= positions[:, :, None]
        if all(n == width for n in lengths):
            write_rows = None
            write_slots = slot_t.repeat_interleave(width) if width > 1 else slot_t
            write_positions = positions.reshape(-1)
        else:
            real = torch.arange(width, device=device)[None, :] < torch.tensor(lengths, device=device)[:, None]
            write_rows = real.reshape(-1).nonzero().squeeze(1)
            write_slots = slot_t[:, None].expand(-1, width).reshape(-1)[write_rows]
            write_positions = positions.reshape(-1)[write_rows]
        lo = slots[0]
        contiguous = slots == list(range(lo, lo + len(slots)))
        return cls(
            slots=slot_t,
            tokens=tokens,
            positions=positions,
            last_index=torch.tensor(lengths, dtype=torch.long, device=device) - 1,
            mask=mask,
            context_len=context_len,
            write_rows=write_rows,
            write_slots=write_slots,
            write_positions=write_positions,
            slot_range=(lo, lo + len(slots)) if contiguous else None,
        )


class KVCache:
    """Cache tensors for every layer, indexed by slot and position."""

    def __init__(
        self, layout: CacheLayout, num_slots: int, max_len: int, *, dtype: torch.dtype, device: torch.device
    ) -> None:
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
    """Hands out cache slots; keeps finished sessions' slots for prefix reuse, evicting LRU.

    Capacity is max_running + max_retained slots, so a request admitted while fewer than
    max_running are in flight always finds a slot (a free one, or the oldest retained one).
    """

    def __init__(self, max_running: int, max_retained: int) -> None:
        self.num_slots = max_running + max_retained
        self.max_retained = max_retained
        self._free = list(range(self.num_slots))  # a heap: lowest slot first keeps batches contiguous
        self._retained: OrderedDict[int, _Retained] = OrderedDict()

    @property
    def num_retained(self) -> int:
        return len(self._retained)

    def acquire(self, session_id: str | None, prompt: list[int]) -> tuple[int, int]:
        """A slot for `prompt` and how many of its leading tokens already have KV in that slot."""
        if session_id is not None:
            best, best_len = None, 0
            for slot, kept in self._retained.items():
                if kept.session_id == session_id:
                    common = _common_prefix(kept.tokens, prompt)
                    if common > best_len:
                        best, best_len = slot, common
            # At least one prompt token is always fed: its logits give the first sampled token.
            reuse = min(best_len, len(prompt) - 1)
            if best is not None and reuse > 0:
                del self._retained[best]
                return best, reuse
        if self._free:
            return heapq.heappop(self._free), 0
        slot, _ = self._retained.popitem(last=False)
        return slot, 0

    def release(self, slot: int, session_id: str | None, cached_tokens: list[int]) -> None:
        """Return a finished request's slot; keep it for its session if prefixes are retained."""
        if session_id is None or self.max_retained == 0:
            heapq.heappush(self._free, slot)
            return
        if len(self._retained) >= self.max_retained:
            evicted, _ = self._retained.popitem(last=False)
            heapq.heappush(self._free, evicted)
        self._retained[slot] = _Retained(session_id, cached_tokens)

    def drop_retained(self) -> None:
        """Forget every retained prefix (their KV was computed with weights that are gone)."""
        for slot in self._retained:
            heapq.heappush(self._free, slot)
        self._retained.clear()


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
