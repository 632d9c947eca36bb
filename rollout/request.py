"""One request inside the embedded engine: what it asked for, where its KV lies, and what it sampled so far.

The engine core (`rollout/engine.py`) schedules requests and runs the forwards; a request keeps its own
books: the tokens the next forward must feed (`pending_tokens`), each step's tokens appended up to a
stop (`take`), its cache frontier moved past them (`advance`), and its result (`result`).

Its context is prompt + output. It is *prefilling* while more than the last sampled token lacks KV: a new
request's prompt, or, after a preemption or a weight push under `rollout.kv_on_push: recompute`, its whole
context again. The forward that completes the context samples the next token, the same draw the decode
step would have made (the request's random stream is untouched by recomputing).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import torch

from asyncrl.records import FinishReason, GenerationResult, SamplingParams


@dataclass(eq=False)
class Request:
    id: str
    prompt: list[int]
    params: SamplingParams
    session_id: str | None
    stop_ids: frozenset[int]
    rng: random.Random
    submitted: float = field(default_factory=time.perf_counter)
    scheduled: float = 0.0
    first_token: float = 0.0
    blocks: list[int] = field(default_factory=list)  # the block table: KV of positions [i*size, (i+1)*size) in blocks[i]
    computed: int = 0  # leading tokens of prompt + output whose KV is in the blocks
    keyed_blocks: int = 0  # leading blocks registered for prefix reuse (`BlockManager.register`)
    chain_key: int | None = None  # the last keyed block's chain key
    kv_oldest: int | None = None  # the oldest weight version among the KV in the blocks (None: none yet)
    cached_prompt_tokens: int = 0
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    kv_versions: list[int] = field(default_factory=list)  # per output token: the oldest KV version it attended to
    # Speculative decoding (see SpeculativeDecoder): the MTP layer's frontier and its pending inputs.
    mtp_computed: int = 0
    mtp_hidden: torch.Tensor | None = None
    verify_steps: int = 0  # decode steps that verified at least one draft
    verify_tokens: int = 0  # tokens those steps emitted
    routes: list[list[list[int]]] | None = None  # rollout.record_routes: per output token, per MoE layer, its experts

    @property
    def length(self) -> int:
        """Tokens in the context: prompt + output."""
        return len(self.prompt) + len(self.output)

    @property
    def prefilling(self) -> bool:
        return self.computed < self.length - (1 if self.output else 0)

    def context(self, lo: int, hi: int) -> list[int]:
        """Tokens lo..hi-1 of prompt + output, without concatenating the two lists."""
        split = len(self.prompt)
        if lo >= split:
            return self.output[lo - split : hi - split]
        return (self.prompt + self.output)[lo:hi]

    def pending_tokens(self, piece: int) -> list[int]:
        """Tokens the next forward must feed: the uncached part of the context (at most `piece` of it: a
        long prompt is prefilled over several steps), or, decoding, the last sampled token."""
        if self.prefilling:
            return self.context(self.computed, min(self.computed + piece, self.length))
        return self.output[-1:]

    def completes(self, fed: int) -> bool:
        """Whether feeding `fed` tokens now brings the KV to the end of the context (its logits sample)."""
        return self.computed + fed == self.length

    def forget_kv(self) -> None:
        """Its KV is gone (preempted, or recomputed after a push): the whole context is to be prefilled again."""
        self.blocks, self.computed, self.keyed_blocks, self.chain_key, self.kv_oldest = [], 0, 0, None, None
        self.mtp_computed, self.mtp_hidden = 0, None

    def take(self, tokens: list[int], logprobs: list[float], routes: list, version: int) -> tuple[int, FinishReason | None]:
        """Append a step's tokens (one, or a verified draft's several) sampled by weights `version` over KV
        no older than `kv_oldest`, up to the first stop token or max_tokens; how many it kept and why it
        finished, if it did."""
        reason: FinishReason | None = None
        kept = 0
        for j, (token, logprob) in enumerate(zip(tokens, logprobs, strict=True)):
            self.output.append(token)
            self.logprobs.append(logprob)
            self.versions.append(version)
            self.kv_versions.append(version if self.kv_oldest is None else self.kv_oldest)
            if self.routes is not None:
                self.routes.append(routes[j])
            kept += 1
            if token in self.stop_ids:
                reason = "stop"
            elif len(self.output) >= self.params.max_tokens:
                reason = "length"
            if reason:
                break  # drafts past a stop are discarded, as if never sampled
        return kept, reason

    def advance(self, fed: int, kept: int, prefill: bool, hidden: torch.Tensor | None) -> None:
        """Move the KV frontier past this step: the prompt piece it fed (prefill) or the tokens it kept
        (decode). `hidden`: with drafting, this row's target hidden states, queued for the MTP layer."""
        if prefill:
            if hidden is not None:  # every prompt position, piece after piece
                piece = hidden[:fed]
                if self.mtp_hidden is None:
                    self.mtp_computed, self.mtp_hidden = self.computed, piece
                else:
                    self.mtp_hidden = torch.cat([self.mtp_hidden, piece])
            self.computed += fed
        else:
            if hidden is not None:
                pending = hidden[:kept]
                # The drafter consumed its pending states this step (None) unless it had nothing to draft.
                self.mtp_hidden = pending if self.mtp_hidden is None else torch.cat([self.mtp_hidden, pending])
            self.computed += kept

    def result(self, reason: FinishReason, engine_id: str, error: str | None = None) -> GenerationResult:
        now = time.perf_counter()
        return GenerationResult(
            request_id=self.id,
            prompt_token_ids=self.prompt,
            token_ids=self.output,
            logprobs=self.logprobs,
            versions=self.versions,
            kv_versions=self.kv_versions,
            finish_reason=reason,
            engine_id=engine_id,
            cached_prompt_tokens=self.cached_prompt_tokens,
            mtp_verify_steps=self.verify_steps,
            mtp_accept_len=self.verify_tokens / self.verify_steps if self.verify_steps else None,
            timings={
                "queued": (self.scheduled or now) - self.submitted,
                "prefill": (self.first_token - self.scheduled) if self.first_token else 0.0,
                "total": now - self.submitted,
            },
            error=error,
            routes=self.routes,
        )
