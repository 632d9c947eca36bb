"""What a request samples with: its options checked against the run's and turned into SamplingParams.

Every turn records the sampling options it was drawn with (temperature, top-p, top-k), and the
learner scores its tokens at them. With `gateway.sampling_overrides: refuse` (the default) a request
may not ask for other options than the run's `rollout.sampling`: it gets a 400 naming the option.

A stop string is matched against what the model writes: a marker token writes exactly its text, so
`stop="<|user|>"` stops at that token. Only single-token stops are supported.

max_tokens is fitted twice: to `gateway.max_tokens` when the request is read (`params`), and to the
engines' context once the prompt's length is known (`fit`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from asyncrl.configs.schema import GatewayConfig, SamplingConfig
from asyncrl.records import SamplingParams

from .errors import GatewayError, bad_request
from .template import TokenizerTemplate

MAX_STOPS = 64
"""Stop strings in one request (each is tokenized on the event loop)."""
MAX_STOP_CHARS = 1024
"""Longest stop string considered (longer ones cannot be one token)."""


class SamplingPolicy:
    """The gateway's rules for sampling options; `context` is the engines' context length (None: unknown)."""

    def __init__(self, config: GatewayConfig, run: SamplingConfig, template: TokenizerTemplate, context: Callable[[], int | None]) -> None:
        self.config, self.run, self.template, self._context = config, run, template, context

    def params(self, request: Any, max_tokens: int | None) -> SamplingParams:
        if (getattr(request, "n", None) or 1) != 1:
            raise bad_request("n must be 1; send n requests (each is recorded as its own turn)")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(request, name, None):
                raise bad_request(f"{name} is not supported: recorded log-probs must come from the policy's own distribution")
        defaults, cap = self.run, self.config.max_tokens
        max_tokens = max_tokens or min(defaults.max_tokens, cap)
        if max_tokens > cap:
            if self.config.max_tokens_fit != "clamp":
                raise bad_request(f"max_tokens {max_tokens} exceeds gateway.max_tokens {cap} (gateway.max_tokens_fit is refuse)")
            max_tokens = cap
        stop = getattr(request, "stop", None)
        stops = [stop] if isinstance(stop, str) else list(stop or ())
        if len(stops) > MAX_STOPS:
            raise bad_request(f"{len(stops)} stop strings; at most {MAX_STOPS} (or send stop_token_ids)")
        pick = lambda value, default: default if value is None else value  # noqa: E731
        params = SamplingParams(
            temperature=pick(request.temperature, defaults.temperature), top_p=pick(request.top_p, defaults.top_p),
            top_k=pick(request.top_k, defaults.top_k), max_tokens=max_tokens, seed=request.seed,
            stop_token_ids=tuple(request.stop_token_ids or ()) + tuple(self.stop_token(s) for s in stops),
        )  # fmt: skip
        params.validate()  # a RequestError, answered as a 400
        refuse = self.config.sampling_overrides == "refuse"
        if refuse and (params.temperature, params.top_p, params.top_k) != (defaults.temperature, defaults.top_p, defaults.top_k):
            raise _override_refused(params, defaults)
        return params

    def stop_token(self, text: str) -> int:
        """The token a stop string stands for; a 400 unless it is exactly one token."""
        if len(text) > MAX_STOP_CHARS:
            raise bad_request(f"stop string of {len(text)} characters; only single-token stops are supported (or send stop_token_ids)")
        marker = self.template.marker_id(text)
        ids = [marker] if marker is not None else self.template.encode_text(text)
        if len(ids) != 1:
            raise bad_request(f"stop string {text!r} is {len(ids)} tokens; only single-token stops are supported (or send stop_token_ids)")
        return ids[0]

    def fit(self, sampling: SamplingParams, prompt_tokens: int) -> SamplingParams:
        """gateway.max_tokens_fit=clamp: a max_tokens past what the engines' context leaves after the prompt is
        cut to fit (agent harnesses ask for far more than a small policy's context); refuse: the engine says no.
        A prompt past gateway.max_prompt_tokens is refused here first, naming that limit."""
        if prompt_tokens > self.config.max_prompt_tokens:
            raise bad_request(f"prompt is {prompt_tokens} tokens; gateway.max_prompt_tokens is {self.config.max_prompt_tokens}")
        context = self._context()
        if self.config.max_tokens_fit != "clamp" or context is None or prompt_tokens + sampling.max_tokens <= context:
            return sampling
        room = context - prompt_tokens
        if room < 1:
            raise bad_request(f"prompt is {prompt_tokens} tokens; the engines' context is {context} tokens, which leaves no room to sample")
        return dataclasses.replace(sampling, max_tokens=room)


def _override_refused(params: SamplingParams, run: SamplingConfig) -> GatewayError:
    """gateway.sampling_overrides=refuse: every call samples at the run's options, so every token is drawn
    from the distribution the run trains (the learner reproduces no top-k/top-p truncation)."""
    name = next(n for n in ("temperature", "top_p", "top_k") if getattr(params, n) != getattr(run, n))
    asked, value = getattr(params, name), getattr(run, name)
    return GatewayError(
        400, "sampling_override_refused",
        f"{name}={asked} differs from this run's rollout.sampling.{name}={value}, and gateway.sampling_overrides is "
        f"'refuse'; leave {name} out (or send {value}), or set gateway.sampling_overrides=allow to sample as each "
        "request asks (every turn records the options it was sampled with, and the learner scores it at them)",
    )  # fmt: skip
