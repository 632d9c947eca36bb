"""Which KV blocks each request holds, which are shared, and which are kept for later reuse.

A block of the paged cache (`rollout/kv_cache.py`) is free, held by one or more requests (a reference
count), or cached: held by none, but still keyed by the tokens it holds so that a later request whose
context starts with the same tokens reuses it instead of computing it again. That is how a GRPO group's
prompt is prefilled once for all its members, and how a session's next turn skips its earlier turns.

A full block's key is a hash chained through every block before it: block i matches only when all of
blocks 0..i hold the same tokens (the KV at a position depends on every token before it). A hit is
checked against the stored tokens and parent key, so a hash collision can never serve wrong KV.

Each keyed block records the oldest weight version among the KV it depends on. After a weight push the
engine (`rollout.kv_on_push`) either forgets every key (recompute: nothing computed by older weights is
served to new requests) or matches regardless of version and reports the version it served (keep).
Cached blocks are evicted least recently used first when fresh blocks run out. Block 0 is never handed
out: it stays zero, and block tables are padded with it (padding is only read at masked positions).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

NULL_BLOCK = 0


@dataclass
class _Key:
    parent: int | None
    tokens: tuple[int, ...]
    version: int

    @property
    def value(self) -> int:
        return hash((self.parent, self.tokens))


class BlockManager:
    """Reference-counted blocks 1..num_blocks-1, with a prefix index over full blocks."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks (one is the zero block), got {num_blocks}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._refs = [0] * num_blocks
        self._free = list(range(num_blocks - 1, NULL_BLOCK, -1))  # popped from the end: lowest id first
        self._cached: OrderedDict[int, None] = OrderedDict()  # unreferenced keyed blocks, least recently used first
        self._keys: dict[int, _Key] = {}  # block -> its key
        self._index: dict[int, int] = {}  # key value -> block
        # A prompt's partial last block, while its request holds it: (parent chain key, its tokens) -> (block, version).
        self._tails: dict[tuple[int | None, tuple[int, ...]], tuple[int, int]] = {}
        self._tail_of: dict[int, tuple[int | None, tuple[int, ...]]] = {}

    @property
    def available(self) -> int:
        """Blocks a request could get now: free ones and cached ones (evicted on demand)."""
        return len(self._free) + len(self._cached)

    @property
    def cached(self) -> int:
        return len(self._cached)

    def match(self, tokens: Sequence[int], limit: int, version: int | None) -> tuple[list[int], int | None, int | None]:
        """The longest run of keyed blocks holding `tokens` from position 0, at most `limit` positions of them:
        (blocks, chain key of the last, oldest version among them). `version` None matches any version;
        otherwise only blocks computed by exactly that version."""
        size, blocks, parent, oldest = self.block_size, [], None, None
        for start in range(0, limit - limit % size, size):
            piece = tuple(tokens[start : start + size])
            block = self._index.get(hash((parent, piece)))
            if block is None:
                break
            key = self._keys[block]
            if key.parent != parent or key.tokens != piece or (version is not None and key.version != version):
                break
            blocks.append(block)
            parent = key.value
            oldest = key.version if oldest is None else min(oldest, key.version)
        return blocks, parent, oldest

    def take(self, blocks: Sequence[int]) -> None:
        """Hold blocks `match` returned (one more reference each)."""
        for block in blocks:
            if self._refs[block] == 0:
                self._cached.pop(block, None)
            self._refs[block] += 1

    def allocate(self, count: int) -> list[int] | None:
        """`count` fresh blocks (evicting cached ones, least recently used first), or None if there are not
        that many; the caller zeroes them."""
        if count > self.available:
            return None
        fresh = []
        for _ in range(count):
            if self._free:
                block = self._free.pop()
            else:
                block, _ = self._cached.popitem(last=False)
                self._unkey(block)
            self._refs[block] = 1
            fresh.append(block)
        return fresh

    def offer_tail(self, block: int, parent: int | None, tokens: Sequence[int], version: int) -> None:
        """A prompt's partial last block, computed: a request with the same prompt may copy it (`tail`) while
        its holder keeps it (its later positions are the holder's own; these ones stay as they are)."""
        key = (parent, tuple(tokens))
        if key not in self._tails and block not in self._tail_of:
            self._tails[key], self._tail_of[block] = (block, version), key

    def tail(self, parent: int | None, tokens: Sequence[int], version: int | None) -> tuple[int, int] | None:
        """(block, version) of an offered partial block holding exactly `tokens` after the chain `parent`."""
        found = self._tails.get((parent, tuple(tokens)))
        return found if found is not None and (version is None or found[1] == version) else None

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block; a block no one holds is cached if keyed, else free."""
        for block in blocks:
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._tail_of:
                    del self._tails[self._tail_of.pop(block)]
                if block in self._keys:
                    self._cached[block] = None
                else:
                    self._free.append(block)

    def register(self, block: int, parent: int | None, tokens: Sequence[int], version: int) -> int:
        """Key a full, computed block by its tokens and everything before them (`parent`: the previous
        block's chain key); its chain key. A key already held by another block keeps that block."""
        key = _Key(parent, tuple(tokens), version)
        value = key.value
        if value not in self._index and block not in self._keys:
            self._index[value] = block
            self._keys[block] = key
        return value

    def forget(self) -> None:
        """Unkey every block (a weight push under `kv_on_push: recompute`): cached blocks become free, held
        ones are freed when released."""
        for block in list(self._keys):
            self._unkey(block)
        self._tails.clear()
        self._tail_of.clear()
        self._free.extend(reversed(self._cached))
        self._cached.clear()

    def _unkey(self, block: int) -> None:
        key = self._keys.pop(block)
        if self._index.get(key.value) == block:
            del self._index[key.value]
