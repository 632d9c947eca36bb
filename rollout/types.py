"""The engine contract: the `Engine` protocol every rollout engine implements, and request intake.

Token IDs in, token IDs out: an engine never sees text. The request and result records
(`SamplingParams`, `GenerationResult`, `ScoreResult`) are floor 0 (`asyncrl/records.py`), shared
with the gateway and the learner; this module holds what only engines need.
"""

from __future__ import annotations

import operator
from collections.abc import AsyncGenerator
from typing import Protocol, runtime_checkable

from asyncrl.records import GenerationResult, RequestError, SamplingParams, TokenDelta


def resolve_sampling(sampling: SamplingParams | dict | None, defaults: dict) -> SamplingParams:
    """A request's sampling options: SamplingParams as given (validated), or a dict over `defaults`."""
    if isinstance(sampling, SamplingParams):
        sampling.validate()
        return sampling
    if sampling is None or isinstance(sampling, dict):
        return SamplingParams.from_dict({**defaults, **(sampling or {})})
    raise RequestError(f"sampling must be SamplingParams, a dict or None, got {type(sampling).__name__}")


def validate_prompt(prompt_token_ids, params: SamplingParams, *, vocab_size: int, max_model_len: int) -> list[int]:
    """The prompt as a list of token ids every engine can take, or a RequestError saying why not."""
    try:
        prompt = [operator.index(t) for t in prompt_token_ids]  # ints only: 3.7 is not a token
    except TypeError as error:
        raise RequestError(f"prompt_token_ids must be a list of integers: {error}") from None
    if not prompt:
        raise RequestError("prompt_token_ids is empty")
    if min(prompt) < 0 or max(prompt) >= vocab_size:
        bad = next(t for t in prompt if not 0 <= t < vocab_size)
        raise RequestError(f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    if len(prompt) + params.max_tokens > max_model_len:
        raise RequestError(f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds max_model_len {max_model_len}")
    return prompt


@runtime_checkable
class Engine(Protocol):
    """The verbs every rollout engine offers (embedded torch engine, vLLM)."""

    async def generate(self, prompt_token_ids: list[int], sampling: SamplingParams, *, session_id: str | None = None) -> GenerationResult:
        """Sample a completion. `session_id` groups the turns of one rollout for prefix reuse."""
        ...

    def stream(
        self, prompt_token_ids: list[int], sampling: SamplingParams, *, session_id: str | None = None
    ) -> AsyncGenerator[TokenDelta | GenerationResult, None]:
        """`generate`, as it comes: a TokenDelta per step (a speculative step may add several tokens), then
        the GenerationResult, which holds every token again. Closing the iterator early aborts the request."""
        ...

    def update_weights(self, state_dict: dict, version: int) -> None:
        """Swap in new weights between decode steps; tokens sampled afterwards carry `version`."""
        ...

    def health(self) -> dict:
        """Liveness and load: version, max_model_len, running and waiting requests, tokens generated."""
        ...
