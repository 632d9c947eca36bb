"""What goes into and comes out of a rollout engine; shared by every engine implementation.

Token IDs in, token IDs out: an engine never sees text. Each sampled token carries the log-prob it
was sampled with and the policy version of the weights that produced it, because the learner's
importance ratios and staleness rules are computed from exactly these numbers.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

FinishReason = Literal["stop", "length", "abort", "error"]
MIN_TEMPERATURE = 1e-4
"""Smallest positive temperature; below it, ask for greedy (0) instead."""


class RequestError(ValueError):
    """A request the engine refuses (bad token ids, empty prompt, too long, bad sampling options).

    Raised for that request only; the engine and every other request carry on.
    """


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request.

    Log-prob semantics: the returned log-prob of a token is its log-probability under the
    distribution it was actually drawn from: logits / temperature, then top-k, then top-p, then
    renormalised. With temperature 0 (greedy) the token is the argmax and its log-prob is that of
    the raw model distribution (temperature 1, no truncation).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 32
    stop_token_ids: tuple[int, ...] = ()
    """Tokens that end the request (the EOS token always does); the stop token is returned."""
    seed: int | None = None
    """Seeds this request's own random stream: same seed, same prompt, same tokens, whatever else is batched."""

    def validate(self) -> None:
        if not (0.0 <= self.temperature <= 100.0):
            raise RequestError(f"temperature must be in [0, 100], got {self.temperature}")
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            # logits / 1e-300 overflow to inf and would turn the whole batch's logits into NaN.
            raise RequestError(f"temperature {self.temperature} is too small to sample with; use 0 for greedy")
        if not (0.0 < self.top_p <= 1.0):
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise RequestError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.max_tokens <= 0:
            raise RequestError(f"max_tokens must be > 0, got {self.max_tokens}")

    @classmethod
    def from_dict(cls, options: dict) -> "SamplingParams":
        """Build from a plain mapping (JSON, Ray); unknown options are a RequestError naming them."""
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(options) - known)
        if unknown:
            raise RequestError(f"unknown sampling option(s): {', '.join(unknown)} (known: {', '.join(sorted(known))})")
        values = dict(options)
        if "stop_token_ids" in values:
            values["stop_token_ids"] = tuple(values["stop_token_ids"] or ())
        params = cls(**values)
        params.validate()
        return params


@dataclass
class GenerationResult:
    """One finished request: the sampled tokens with their log-probs and policy versions."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: FinishReason
    engine_id: str = ""
    cached_prompt_tokens: int = 0
    """Prompt tokens whose KV cache was reused from an earlier request of the same session."""
    mtp_verify_steps: int = 0
    """Decode steps that verified MTP drafts for this request (0 without drafting)."""
    mtp_accept_len: float | None = None
    """Mean tokens emitted per such step (accepted drafts + 1); None when nothing was drafted."""
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds: queued (submit to first scheduling), prefill, total."""
    error: str | None = None


@dataclass
class ScoreResult:
    """One prefill-only scoring call (`rollout/scoring.py`): per sequence, the log-prob of each token
    given the ones before it (entry 0 is 0.0), and the policy version of the weights that scored."""

    logprobs: list[list[float]]
    version: int
    engine_id: str = ""


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
        raise RequestError(
            f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds max_model_len {max_model_len}"
        )
    return prompt


@runtime_checkable
class Engine(Protocol):
    """The verbs every rollout engine offers (embedded torch engine, vLLM)."""

    async def generate(
        self, prompt_token_ids: list[int], sampling: SamplingParams, *, session_id: str | None = None
    ) -> GenerationResult:
        """Sample a completion. `session_id` groups the turns of one rollout for prefix reuse."""
        ...

    def update_weights(self, state_dict: dict, version: int) -> None:
        """Swap in new weights between decode steps; tokens sampled afterwards carry `version`."""
        ...

    def health(self) -> dict:
        """Liveness and load: version, running and waiting requests, tokens generated."""
        ...
