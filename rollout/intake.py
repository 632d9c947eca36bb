"""Request intake, the same for every engine: a request's sampling options and prompt, checked.

Token IDs in, token IDs out: an engine never sees text. The request and result records
(`SamplingParams`, `GenerationResult`, `ScoreResult`) are floor 0 (`asyncrl/records.py`), shared
with the gateway and the learner; the engine interface is `EngineFront` (`rollout/front.py`).
"""

from __future__ import annotations

import operator

from asyncrl.records import RequestError, SamplingParams


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
            f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds the engine's max_model_len {max_model_len} "
            "(rollout.max_model_len, or as many positions as rollout.kv_cache_memory holds)"
        )
    return prompt
