"""A rollout's calls to the engine pool, whole or streamed, and scoring calls: the prompt cap, greedy
decoding for evaluation rollouts, the request deadline, the engine call's time in the turn's timings,
and the count of calls in flight (the health endpoint's `requests_in_flight`)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncGenerator

from asyncrl.configs.schema import GatewayConfig
from asyncrl.records import GenerationResult, SamplingParams, TokenDelta

from .errors import bad_request
from .pool import EnginePool, ScoreResult
from .rollouts import Rollout


class EngineCalls:
    def __init__(self, pool: EnginePool, config: GatewayConfig) -> None:
        self.pool, self.config = pool, config
        self.in_flight = 0

    async def generate(self, rollout: Rollout, prompt: list[int], sampling: SamplingParams) -> tuple[GenerationResult, dict]:
        """The whole completion and the turn's timings (the engine's, its call's, the retries it took)."""
        sampling = self._checked(rollout, prompt, sampling)
        began = time.perf_counter()
        self.in_flight += 1
        try:
            result, retries = await self.pool.generate(
                rollout.id, prompt, sampling, route_key=rollout.route_key, deadline=self._deadline(), abandon=rollout.abandon
            )
        finally:
            self.in_flight -= 1
        return result, {**result.timings, "engine_call_s": time.perf_counter() - began, "retries": float(retries)}

    async def stream(
        self, rollout: Rollout, prompt: list[int], sampling: SamplingParams
    ) -> AsyncGenerator[TokenDelta | GenerationResult, None]:
        """TokenDeltas as they come, then the whole GenerationResult (its timings with the call's); a
        caller that leaves first aborts the engine request."""
        sampling = self._checked(rollout, prompt, sampling)
        began = time.perf_counter()
        self.in_flight += 1
        try:
            engine = self.pool.stream(
                rollout.id, prompt, sampling, route_key=rollout.route_key, deadline=self._deadline(), abandon=rollout.abandon
            )
            async with contextlib.aclosing(engine):
                async for item in engine:
                    if isinstance(item, GenerationResult):
                        item.timings = {**item.timings, "engine_call_s": time.perf_counter() - began}
                    yield item
        finally:
            self.in_flight -= 1

    async def score(self, sequences: list[list[int]], temperature: float) -> ScoreResult:
        """Prefill-only log-probs from the least loaded engine (the pool's `score` result)."""
        self.in_flight += 1
        try:
            result, _ = await self.pool.score(sequences, temperature, deadline=self._deadline())
        finally:
            self.in_flight -= 1
        return result

    def _checked(self, rollout: Rollout, prompt: list[int], sampling: SamplingParams) -> SamplingParams:
        if len(prompt) > self.config.max_prompt_tokens:
            raise bad_request(f"prompt is {len(prompt)} tokens; gateway.max_prompt_tokens is {self.config.max_prompt_tokens}")
        if rollout.evaluation is not None and not rollout.evaluation.sampled:
            sampling = dataclasses.replace(sampling, temperature=0.0)  # held-out evaluation decodes greedily
        return sampling

    def _deadline(self) -> float:
        return asyncio.get_running_loop().time() + self.config.request_timeout_s
