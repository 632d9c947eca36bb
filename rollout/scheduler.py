"""The embedded engine's scheduler: which requests the next step runs, and the KV blocks they hold.

Each step is either prefill (requests whose context is partly computed, else newly admitted ones) or
decode (every running request). Admission takes waiting requests in order while a step's prefill budget
and the free blocks allow, each reusing the cached blocks that already hold the start of its context
(`rollout/kv_blocks.py`); a request whose first block another request is computing right now waits a
step to reuse it, and copies the partial last block of an identical prompt another request holds, so a
GRPO group's prompt is prefilled once and each other member feeds only its last prompt token. Before a step runs, every request in it gets
blocks for the positions it writes; when none are left the latest admitted running request is preempted:
its blocks go back (its keyed ones stay cached) and it waits first in line to prefill its whole context
again. After the step, newly completed blocks are keyed for reuse.
"""

from __future__ import annotations

import time
from collections import deque

from asyncrl.configs.schema import EmbeddedRolloutConfig

from .kv_blocks import BlockManager
from .kv_cache import KVCache
from .request import Request

MAX_PREFILL_TOKENS = 8192
"""Padded prompt tokens (rows x longest piece) admitted into one prefill step; bounds its memory."""


class Scheduler:
    """The waiting queue, the running requests in admission order, and the block manager over `cache`."""

    def __init__(self, cache: KVCache, config: EmbeddedRolloutConfig, *, drafts: int) -> None:
        """`drafts`: the positions past the next token a decode step writes (MTP drafts; 0 without drafting)."""
        self.cache, self.config, self.drafts = cache, config, drafts
        self.blocks = BlockManager(cache.num_blocks, cache.block_size)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.preemptions = 0

    def schedule(self, version: int) -> list[Request]:
        """The next step's requests (never prefill and decode mixed), each holding the blocks it writes;
        `version`: the weights that will compute it."""
        batch = [r for r in self.running if r.prefilling] or self._admit(version) or list(self.running)
        return self._grow(batch)

    def computed(self, request: Request) -> None:
        """After a step: key the request's newly completed blocks, so later requests with the same context reuse them."""
        size = self.cache.block_size
        assert request.kv_oldest is not None  # it has just computed
        while (request.keyed_blocks + 1) * size <= request.computed:
            i = request.keyed_blocks
            tokens = request.context(i * size, (i + 1) * size)
            request.chain_key = self.blocks.register(request.blocks[i], request.chain_key, tokens, request.kv_oldest)
            request.keyed_blocks += 1
        start = request.keyed_blocks * size
        if request.computed == len(request.prompt) > start and len(request.output) <= 1:  # its prompt, just computed
            self.blocks.offer_tail(request.blocks[request.keyed_blocks], request.chain_key, request.prompt[start:], request.kv_oldest)

    def remove(self, request: Request) -> None:
        """A finished or aborted request leaves; its keyed blocks stay cached (a rollout's next turn starts with its context)."""
        if request in self.running:
            self.running.remove(request)
            self.blocks.release(request.blocks)
            request.blocks = []
        elif request in self.waiting:
            self.waiting.remove(request)

    def recompute_all(self) -> None:
        """After a push under `kv_on_push: recompute`: nothing the old weights computed is attended to again.
        Cached blocks are unkeyed, and running requests give their blocks back to prefill again, in order."""
        self.blocks.forget()
        for request in reversed(list(self.running)):
            self._preempt(request)

    def _admit(self, version: int) -> list[Request]:
        size = self.cache.block_size
        admitted: list[Request] = []
        longest, reserved = 0, 0
        match_version = version if self.config.kv_on_push == "recompute" else None
        computing = {self._first_key(r) for r in self.running if r.prefilling}
        for request in list(self.waiting):
            if len(self.running) + len(admitted) >= self.config.max_num_seqs:
                break
            hits, chain_key, oldest = self.blocks.match(request.context(0, request.length), request.length - 1, match_version)
            first = self._first_key(request)
            if not hits and first is not None and first in computing:
                continue
            reused = len(hits) * size
            tail = self.blocks.tail(chain_key, request.context(reused, request.length), match_version)
            piece = 1 if tail else min(request.length - reused, self.config.prefill_chunk_tokens)
            longest = max(longest, piece)
            need = -(-(request.length if tail else reused + piece) // size) - len(hits)
            over_budget = bool(admitted) and (len(admitted) + 1) * longest > MAX_PREFILL_TOKENS
            if over_budget or reserved + need > self.blocks.available - len(hits):
                break
            self.waiting.remove(request)
            self.blocks.take(hits)
            request.blocks, request.keyed_blocks, request.chain_key, request.kv_oldest = hits, len(hits), chain_key, oldest
            if tail:  # another request holds this prompt's partial last block: copy all of it but the last token
                fresh = self.blocks.allocate(1)
                assert fresh is not None  # counted among the available ones above
                self.cache.zero(fresh)
                self.cache.copy_positions(tail[0], fresh[0], request.length - 1 - reused)
                request.blocks = [*hits, *fresh]
                request.kv_oldest = tail[1] if oldest is None else min(oldest, tail[1])
                need -= 1
            reserved += need
            request.computed = request.length - 1 if tail else reused
            if not request.scheduled:  # its first admission (a preempted request comes back to recompute)
                request.cached_prompt_tokens = request.computed
                request.scheduled = time.perf_counter()
            computing.add(first)
            admitted.append(request)
        self.running += admitted
        return admitted

    def _first_key(self, request: Request) -> int | None:
        """The chain key its context's first full block would have (None: shorter than a block)."""
        size = self.cache.block_size
        return hash((None, tuple(request.prompt[:size]))) if len(request.prompt) > size else None

    def _grow(self, batch: list[Request]) -> list[Request]:
        """Give each request of `batch` blocks for every position this step writes, preempting the latest
        admitted running requests (out of the batch too) while blocks are short."""
        size = self.cache.block_size
        for request in list(batch):
            if request not in batch:  # preempted for an earlier one
                continue
            if request.prefilling:
                end = request.computed + len(request.pending_tokens(self.config.prefill_chunk_tokens))
            else:
                end = min(request.computed + 1 + self.drafts, len(request.prompt) + request.params.max_tokens)
            need = -(-end // size) - len(request.blocks)
            if need <= 0:
                continue
            fresh = self.blocks.allocate(need)
            while fresh is None and request in self.running:
                victim = self.running[-1]
                self._preempt(victim)
                if victim in batch:
                    batch.remove(victim)
                if victim is not request:
                    fresh = self.blocks.allocate(need)
            if fresh is not None:
                self.cache.zero(fresh)
                request.blocks += fresh
        return batch

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.blocks.release(request.blocks)
        request.forget_kv()
        self.waiting.appendleft(request)
        self.preemptions += 1
