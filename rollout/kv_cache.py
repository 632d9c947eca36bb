"""The paged KV cache: fixed-size blocks of positions, a block table per sequence, and one forward's view of them.

Every layer keeps, per cache name ("k", "v", and for DSA models "index_k"), one tensor of
[heads, blocks x block_size, dim]: a position of a sequence lives at row `table[p // block_size] *
block_size + p % block_size`. Which blocks a sequence owns, and which it shares with others (a GRPO
group's prompt, a session's earlier turns), is the block manager's business (`rollout/kv_blocks.py`);
this module only moves values in and out.

`ForwardBatch` describes one model call over (block tables, ragged token rows, start positions): the same
shape serves batched prefill (T = longest piece), decode (T = 1) and speculative verification
(T = draft length + 1). Reads gather each row's positions 0..L-1 into [heads, B, L, dim], head-major, so
attention (`rollout/models/common.py: attend`) batches over (head, row) without copying them again.
"""

from __future__ import annotations

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

    tables: torch.Tensor  # [B, blocks]: each row's block ids, covering at least its positions 0..start+length-1
    block_size: int
    tokens: torch.Tensor  # [B, T]
    positions: torch.Tensor  # [B, T]
    last_index: torch.Tensor  # [B]: index in T of each row's last real token
    mask: torch.Tensor  # [B, T, L] bool: causal visibility of cached positions 0..L-1
    context_len: int  # L, the longest row's start + length
    write_rows: torch.Tensor | None  # indices into the flattened [B*T] of real tokens; None = all real
    write_index: torch.Tensor  # [N] cache row of each real token
    read_index: torch.Tensor  # [B, L] cache row of each row's positions 0..L-1 (past a row's end: masked)

    @classmethod
    def build(
        cls, tables: list[list[int]], rows: list[list[int]], starts: list[int], block_size: int, device: torch.device
    ) -> ForwardBatch:
        lengths = [len(row) for row in rows]
        width = max(lengths)
        tokens = torch.tensor([row + [0] * (width - len(row)) for row in rows], dtype=torch.long, device=device)
        return cls.from_tokens(tables, tokens, starts, block_size, None if min(lengths) == width else lengths)

    @classmethod
    def from_tokens(
        cls, tables: list[list[int]], tokens: torch.Tensor, starts: list[int], block_size: int, lengths: list[int] | None = None
    ) -> ForwardBatch:
        """Rows already padded into tokens [B, T]; `lengths` None means every row is T long.

        Speculative decoding feeds its drafts this way, straight from the tensors it drew them into.
        """
        device = tokens.device
        width = tokens.shape[1]
        start_t = torch.tensor(starts, dtype=torch.long, device=device)
        positions = start_t[:, None] + torch.arange(width, device=device) if width > 1 else start_t[:, None]
        context_len = max(starts) + width if lengths is None else max(s + n for s, n in zip(starts, lengths, strict=True))
        # Whole tables, not just the blocks this forward reads: chained drafts (`next_position`) step into the next.
        table_t = _table_tensor(tables, max(-(-context_len // block_size), *map(len, tables)), device)
        write_index = _rows(table_t, positions, block_size).reshape(-1)
        if lengths is None:
            write_rows = None
            last_index = torch.full((len(starts),), width - 1, dtype=torch.long, device=device)
        else:
            real = torch.arange(width, device=device)[None, :] < torch.tensor(lengths, device=device)[:, None]
            write_rows = real.reshape(-1).nonzero().squeeze(1)
            write_index = write_index[write_rows]
            last_index = torch.tensor(lengths, dtype=torch.long, device=device) - 1
        return cls(
            tables=table_t,
            block_size=block_size,
            tokens=tokens,
            positions=positions,
            last_index=last_index,
            mask=_causal(context_len, positions),
            context_len=context_len,
            write_rows=write_rows,
            write_index=write_index,
            read_index=_rows(table_t, torch.arange(context_len, device=device).expand(len(starts), -1), block_size),
        )

    def next_position(self, tokens: torch.Tensor) -> ForwardBatch:
        """The same single-token rows one position further on, fed tokens [B, 1] (chained drafts); the
        tables must already cover the new position."""
        positions = self.positions + 1
        context_len = self.context_len + 1
        device = tokens.device
        return replace(
            self,
            tokens=tokens,
            positions=positions,
            mask=_causal(context_len, positions),
            context_len=context_len,
            write_index=_rows(self.tables, positions, self.block_size).reshape(-1),
            read_index=_rows(self.tables, torch.arange(context_len, device=device).expand(len(positions), -1), self.block_size),
        )


def _table_tensor(tables: list[list[int]], columns: int, device: torch.device) -> torch.Tensor:
    """Tables padded with block 0 to `columns` (the padding is only ever read at masked positions)."""
    return torch.tensor([table + [0] * (columns - len(table)) for table in tables], dtype=torch.long, device=device)


def _rows(tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache rows of `positions` [B, n] through `tables` [B, blocks]."""
    blocks = tables.gather(1, (positions // block_size).clamp_(max=tables.shape[1] - 1))
    return blocks * block_size + positions % block_size


def _causal(context_len: int, positions: torch.Tensor) -> torch.Tensor:
    return torch.arange(context_len, device=positions.device)[None, None, :] <= positions[:, :, None]


class KVCache:
    """Cache tensors for every layer: `num_blocks` blocks of `block_size` positions each.

    `max_len`: the longest sequence one request may hold (the engine's max_model_len); the layout probe of
    the transformers path reports it.
    """

    def __init__(
        self, layout: CacheLayout, num_blocks: int, block_size: int, *, max_len: int, dtype: torch.dtype, device: torch.device
    ) -> None:  # fmt: skip
        self.num_blocks, self.block_size, self.max_len = num_blocks, block_size, max_len
        # Zeros, not empty: masked-out positions still enter the attention matmul (weight 0), and
        # 0 * NaN from uninitialised memory would poison a whole row.
        self.layers = [
            {name: torch.zeros(heads, num_blocks * block_size, dim, dtype=dtype, device=device) for name, (heads, dim) in spec.items()}
            for spec in layout
        ]  # fmt: skip

    def write(self, layer: int, name: str, batch: ForwardBatch, values: torch.Tensor) -> None:
        """Store values [B, T, heads, dim] of the batch's real tokens."""
        flat = values.reshape(-1, *values.shape[2:])
        if batch.write_rows is not None:
            flat = flat[batch.write_rows]
        self.layers[layer][name].index_copy_(1, batch.write_index, flat.transpose(0, 1))

    def read(self, layer: int, name: str, batch: ForwardBatch) -> torch.Tensor:
        """Positions 0..L-1 of the batch's rows: [B, heads, L, dim], a view of a head-major [heads, B, L, dim] gather.

        `index_select` over the flattened index, not `buf[:, index]`: on CPU it gathers 4x faster."""
        buf = self.layers[layer][name]
        rows, length = batch.read_index.shape
        return torch.index_select(buf, 1, batch.read_index.view(-1)).view(buf.shape[0], rows, length, buf.shape[2]).transpose(0, 1)

    def copy_positions(self, source: int, target: int, count: int) -> None:
        """Copy the first `count` positions of block `source` into block `target`, in every layer."""
        size = self.block_size
        for buffers in self.layers:
            for buf in buffers.values():
                buf[:, target * size : target * size + count] = buf[:, source * size : source * size + count]

    def zero(self, blocks: list[int]) -> None:
        """Clear blocks about to be handed out: positions past a row's end are read under the mask, and stale
        values there (a NaN above all) would leak through the attention matmul (0 x NaN)."""
        for buffers in self.layers:
            for buf in buffers.values():
                rows = torch.tensor(blocks, device=buf.device)[:, None] * self.block_size + torch.arange(self.block_size, device=buf.device)
                buf[:, rows.reshape(-1)] = 0

    @property
    def bytes(self) -> int:
        return sum(buf.numel() * buf.element_size() for buffers in self.layers for buf in buffers.values())


def contiguous_tables(rows: int, length: int, block_size: int) -> list[list[int]]:
    """Block tables giving row r the blocks [r*n, (r+1)*n) of a cache of rows x n blocks (n = blocks per `length`):
    a cache used as fixed rows, as prefill-only scoring does."""
    per_row = -(-length // block_size)
    return [list(range(r * per_row, (r + 1) * per_row)) for r in range(rows)]
