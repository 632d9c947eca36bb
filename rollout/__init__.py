"""Rollout engines: token IDs in, sampled token IDs with log-probs and policy versions out.

`EmbeddedEngine` is the in-process torch engine; `asyncrl.rollout.worker` wraps engines in Ray actors.
"""

from asyncrl.records import GenerationResult, RequestError, SamplingParams

from .engine import EmbeddedEngine
from .types import Engine

__all__ = ["EmbeddedEngine", "Engine", "GenerationResult", "RequestError", "SamplingParams"]
