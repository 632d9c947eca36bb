"""Rollout engines: token IDs in, sampled token IDs with log-probs and policy versions out.

`EmbeddedEngine` is the in-process torch engine, `rollout.vllm_engine.VLLMEngine` the vLLM one
(imported only where vLLM is installed); both are engine cores behind one `EngineFront`
(`rollout/front.py`: request intake, aborts, weight swaps, the stepping thread). `asyncrl.rollout.worker`
wraps engines in Ray actors.
"""

from asyncrl.records import GenerationResult, RequestError, SamplingParams

from .engine import EmbeddedEngine
from .front import EngineFront
from .types import Engine

__all__ = ["EmbeddedEngine", "Engine", "EngineFront", "GenerationResult", "RequestError", "SamplingParams"]
