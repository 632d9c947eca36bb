"""Rollout engines: token IDs in, sampled token IDs with log-probs and policy versions out.

`EmbeddedEngine` is the in-process torch engine, `rollout.vllm_engine.VLLMEngine` the vLLM one
(imported only where vLLM is installed); both are `EngineFront`s (`rollout/front.py`: the engine
interface, with request intake, aborts, weight swaps and the stepping thread around each one's core). `asyncrl.rollout.worker`
wraps engines in Ray actors.
"""

from asyncrl.records import GenerationResult, RequestError, SamplingParams

from .engine import EmbeddedEngine
from .front import EngineFront

__all__ = ["EmbeddedEngine", "EngineFront", "GenerationResult", "RequestError", "SamplingParams"]
