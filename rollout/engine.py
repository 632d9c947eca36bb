"""The embedded rollout engine: continuous batching over a native forward pass and a paged KV cache.

`advance()` is the whole engine core, synchronous and readable: schedule (admit waiting requests
while blocks last, reusing cached prefix blocks, or decode everything running; preempt the latest
admitted when blocks run out), execute (one forward, one sampling call), update (append tokens,
key full blocks for reuse, finish requests, release their blocks). The engine front (`rollout/front.py`) does the
rest: it takes requests from any thread, steps the core on a background thread while there is
work, and applies weight updates at the start of a step, so in-flight requests carry on and their
later tokens carry the new version. `step()` is one such step by hand (an engine not serving).

`score()` is prefill-only scoring (`rollout/scoring.py`) with the engine's own weights, run by the
stepping thread between two steps in a cache of its own.

With `rollout.mtp_drafting`, a decode step is speculative (`rollout/speculative.py`): the policy's
MTP layer drafts tokens, one target forward verifies them, and each request may gain several
tokens. With `rollout.fp8`, the linear weights are FP8 (`rollout/fp8.py`).
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from pathlib import Path

import torch

from asyncrl.configs.schema import EmbeddedRolloutConfig
from asyncrl.records import FinishReason, GenerationResult, ScoreResult

from .front import EngineFront
from .intake import resolve_sampling, validate_prompt
from .kv_budget import budget_bytes, plan_blocks
from .kv_cache import ForwardBatch, KVCache
from .models import build_model
from .models.mtp import NativeMTP
from .request import Request
from .sampler import sample
from .scheduler import Scheduler
from .scoring import NativeScorer
from .speculative import SpeculativeDecoder

log = logging.getLogger(__name__)


class EmbeddedEngine(EngineFront):
    """A rollout engine in this process, on CPU or one GPU: the core verbs over the native models of
    `rollout/models/` (or transformers' own forward for other causal LMs; docs/MODELS.md), served by
    `EngineFront`."""

    def __init__(
        self,
        model,
        config: EmbeddedRolloutConfig | None = None,
        *,
        engine_id: str = "embedded",
        version: int = 0,
        dtype: torch.dtype | None = None,
        mtp=None,
    ) -> None:
        """`model`: a transformers causal LM in memory (`from_pretrained` loads one from a directory),
        whose config and weights the native model is built from; `dtype` None: the model's own (so the
        engine computes in the dtype the learner trains in).

        `mtp`: the policy's MTP layer (`asyncrl.policy.mtp.MTPLayer`, or its state dict), needed by
        `config.mtp_drafting`.
        """
        self.config = config = config or EmbeddedRolloutConfig()
        torch.set_num_threads(config.torch_threads)
        _check_drafting(config, mtp)
        hf_config = model.config
        self.engine_id = engine_id
        self.dtype = dtype = dtype or next(model.parameters()).dtype
        self.device = torch.device("cuda" if config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available()) else "cpu")
        self.max_model_len: int = _max_model_len(hf_config, config)
        self.model = build_model(hf_config, model.state_dict(), max_len=self.max_model_len, dtype=dtype, device=self.device, fp8=config.fp8)
        # Only MoE families have routes; for the others record_routes records nothing (routes None).
        self.record_routes = config.record_routes and hasattr(self.model, "record_routes")
        if self.record_routes:
            self.model.record_routes = True
        if config.mtp_drafting and not hasattr(self.model, "layer_weights"):
            raise ValueError(
                f"rollout.mtp_drafting: {hf_config.model_type} runs on the generic transformers path, which has no MTP drafter"
            )
        self.drafter = NativeMTP(self.model, mtp if isinstance(mtp, dict) else mtp.state_dict()) if config.mtp_drafting else None
        self.vocab_size = hf_config.vocab_size
        eos = hf_config.eos_token_id
        self.eos_token_ids = frozenset([] if eos is None else [eos] if isinstance(eos, int) else eos)
        layout = self.model.cache_layout(extra_layers=1 if self.drafter else 0)  # the drafter's layer caches too
        self.cache = _budgeted_cache(layout, config, self.max_model_len, dtype, self.device)
        self.max_model_len = self.cache.max_len
        self.speculative = (
            SpeculativeDecoder(self.model, self.drafter, self.cache, config.mtp_draft_tokens, self.device) if self.drafter else None
        )
        # The core's state: only the stepping thread (or a caller holding the front's step lock) touches it.
        self.scheduler = Scheduler(self.cache, config, drafts=config.mtp_draft_tokens if self.drafter else 0)
        self.prefill_tokens = 0  # tokens fed by prefill forwards (what prefix reuse saves is not counted)
        self.verify_steps = 0
        self.verify_tokens = 0
        # What the rejection rule accepted (+1), before a stop token or max_tokens cut the step short.
        self.verify_tokens_before_stop = 0
        self.version = version
        self.generated_tokens = 0
        self.last_error: str | None = None
        self._ids = itertools.count()
        self._scorer: NativeScorer | None = None  # built by the first scoring call
        super().__init__(name=f"engine-{engine_id}")

    @classmethod
    def from_pretrained(cls, model, config: EmbeddedRolloutConfig | None = None, **kwargs) -> EmbeddedEngine:
        """An engine over a checkpoint directory (loaded here; with `config.mtp_drafting`, its MTP layer
        too, as `save_policy` writes it), or over a transformers model already in memory."""
        if isinstance(model, (str, Path)):
            if config is not None and config.mtp_drafting and kwargs.get("mtp") is None:
                from asyncrl.policy.checkpoint import load_policy

                model, _, kwargs["mtp"] = load_policy(model)
            else:
                from transformers import AutoModelForCausalLM

                model = AutoModelForCausalLM.from_pretrained(str(model), dtype=kwargs.get("dtype", torch.float32))
        return cls(model, config, **kwargs)

    # --- beside the front's verbs (generate, stream, update_weights, ...): scoring and health -------

    async def score(self, sequences: list[list[int]], temperature: float = 1.0) -> ScoreResult:
        """Prefill-only log-probs of every token given the ones before it, and the version of the weights
        that scored. The stepping thread runs it between two steps, so a weight swap never lands
        mid-forward. Bad input is a RequestError, raised here."""

        def job() -> ScoreResult:
            if self._scorer is None:
                self._scorer = NativeScorer.over(
                    self.model, vocab_size=self.vocab_size, max_len=self.max_model_len, dtype=self.dtype, device=self.device
                )
            return ScoreResult(self._scorer.score(sequences, temperature), self.version, self.engine_id)

        return await self.call(job)

    def health(self) -> dict:
        return {
            "engine_id": self.engine_id,
            # Shut down means not serving, even though a later `generate` would start it again.
            "alive": self.alive,
            "version": self.version,
            "max_model_len": self.max_model_len,
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting) + self.queued,
            "kv_blocks": self.cache.num_blocks - 1,
            "kv_blocks_free": self.scheduler.blocks.available - self.scheduler.blocks.cached,
            "kv_blocks_cached": self.scheduler.blocks.cached,
            "prefill_tokens": self.prefill_tokens,
            "preemptions": self.scheduler.preemptions,
            "generated_tokens": self.generated_tokens,
            "fp8": self.model.fp8,
            "mtp_accept_len": self.verify_tokens / self.verify_steps if self.verify_steps else None,
            "device": str(self.device),
            "last_error": self.last_error,
            "busy_s": self.busy_s,
            # The whole process's CPU (a rollout worker's actor is the engine; in-process, the driver too).
            "process_cpu_s": time.process_time(),
        }

    # --- the core (`EngineFront` calls these on its stepping thread, make_request on the caller's) ---

    def make_request(self, prompt_token_ids, sampling, session_id: str | None) -> Request:
        params = resolve_sampling(sampling, self.config.sampling.model_dump())
        prompt = validate_prompt(prompt_token_ids, params, vocab_size=self.vocab_size, max_model_len=self.max_model_len)
        return Request(
            id=f"{self.engine_id}-{next(self._ids)}",
            prompt=prompt,
            params=params,
            session_id=session_id,
            stop_ids=self.eos_token_ids | frozenset(params.stop_token_ids),
            rng=random.Random(params.seed),  # seed None draws from OS entropy
            routes=[] if self.record_routes else None,
        )

    def admit(self, requests: list[Request]) -> None:
        self.scheduler.waiting.extend(requests)

    def cancel(self, request_ids: set[str], error: str | None = None) -> list[GenerationResult]:
        held = (*self.scheduler.waiting, *self.scheduler.running)
        return [self._finish(r, "abort", error) for r in [r for r in held if r.id in request_ids]]

    def busy(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting)

    def sampled(self, request: Request) -> tuple[list[int], list[float], list[int], list[int]]:
        return request.output, request.logprobs, request.versions, request.kv_versions

    def load_weights(self, state_dict: dict, version: int) -> None:
        # Keys "mtp.*" (MTPLayer names) update the drafter; without them it keeps its weights,
        # which can only lower acceptance, never change what is sampled.
        mtp_state = {k.removeprefix("mtp."): v for k, v in state_dict.items() if k.startswith("mtp.")}
        if mtp_state and self.drafter is not None:
            self.drafter.load_state_dict(mtp_state)
        self.model.load_state_dict(state_dict)  # builds every tensor before swapping: all or nothing
        self.version = version
        if self.config.kv_on_push == "recompute":
            self.scheduler.recompute_all()

    def advance(self) -> list[GenerationResult]:
        """One engine iteration: schedule -> execute -> update. Returns the requests it finished."""
        batch = self.scheduler.schedule(self.version)
        return self._execute_and_update(batch) if batch else []

    def _execute_and_update(self, batch: list[Request]) -> list[GenerationResult]:
        prefill = batch[0].prefilling  # the scheduler never mixes prefill and decode
        rows = [r.pending_tokens(self.config.prefill_chunk_tokens) for r in batch]
        for request in batch:  # what this step computes, the current weights compute
            request.kv_oldest = self.version if request.kv_oldest is None else min(request.kv_oldest, self.version)
        hidden, drafted = None, [0] * len(batch)
        routes: list[list] = [[] for _ in batch]
        try:
            if self.speculative is not None and not prefill:
                tokens, logprobs, drafted, hidden = self.speculative.step(batch)
                if self.record_routes:  # the verify forward: position j of a row sampled its token j
                    recorded = self.model.recorded_routes(len(batch))
                    routes = [recorded[b, : len(tokens[b])].tolist() for b in range(len(batch))]
            else:
                forward = ForwardBatch.build(
                    [r.blocks for r in batch], rows, [r.computed for r in batch], self.cache.block_size, self.device
                )
                if self.speculative is not None:  # the MTP layer will need every prompt position's hidden state
                    hidden = self.model.hidden_states(forward, self.cache)
                    logits = self.model.logits(hidden[torch.arange(len(batch)), forward.last_index])
                else:
                    logits = self.model.forward(forward, self.cache)
                # Only rows whose context this step completes sample (a partly prefilled one must not draw
                # from its random stream: a seeded request samples the same tokens however it is prefilled).
                done = [b for b, r in enumerate(batch) if r.completes(len(rows[b]))]
                tokens, logprobs = [[] for _ in batch], [[] for _ in batch]
                if done:
                    picked = logits if len(done) == len(batch) else logits[done]
                    sampled, logps = sample(picked, [batch[b].params for b in done], [batch[b].rng for b in done])
                    for b, token, logprob in zip(done, sampled, logps, strict=True):
                        tokens[b], logprobs[b] = [token], [logprob]
                if self.record_routes:  # each row's last position sampled its token
                    recorded = self.model.recorded_routes(len(batch))
                    routes = [[recorded[b, int(forward.last_index[b])].tolist()] if tokens[b] else [] for b in range(len(batch))]
        except Exception as error:  # a bug or resource failure: fail this batch, keep the engine
            log.exception("engine step failed")
            self.last_error = f"{type(error).__name__}: {error}"
            return [self._finish(r, "error", error=self.last_error) for r in batch]
        now = time.perf_counter()
        if prefill:
            self.prefill_tokens += sum(map(len, rows))
        finished = []
        for b, request in enumerate(batch):
            kept, reason = request.take(tokens[b], logprobs[b], routes[b], self.version)
            if prefill and tokens[b] and not request.first_token:
                request.first_token = now
            request.advance(len(rows[b]), kept, prefill, None if hidden is None else hidden[b])
            self.scheduler.computed(request)
            if drafted[b]:
                request.verify_steps += 1
                request.verify_tokens += kept
                self.verify_steps += 1
                self.verify_tokens += kept
                self.verify_tokens_before_stop += len(tokens[b])
            self.generated_tokens += kept
            if reason:
                finished.append(self._finish(request, reason))
        return finished

    def _finish(self, request: Request, reason: FinishReason, error: str | None = None) -> GenerationResult:
        self.scheduler.remove(request)
        return request.result(reason, self.engine_id, error)


def _check_drafting(config: EmbeddedRolloutConfig, mtp) -> None:
    if config.mtp_drafting and not 1 <= config.mtp_draft_tokens <= config.mtp_max_draft_tokens:
        raise ValueError(
            f"rollout.mtp_draft_tokens must be in [1, mtp_max_draft_tokens={config.mtp_max_draft_tokens}], got {config.mtp_draft_tokens}"
        )
    if config.mtp_drafting and mtp is None:
        raise ValueError("rollout.mtp_drafting needs the policy's MTP layer: pass mtp=, or a checkpoint directory that has one")


def _budgeted_cache(layout, config: EmbeddedRolloutConfig, model_len: int, dtype: torch.dtype, device: torch.device) -> KVCache:
    """The paged KV cache, as many blocks as `rollout.kv_cache_memory` holds (kv_budget.py)."""
    blocks, max_len = plan_blocks(
        layout, block_size=config.kv_block_size, max_num_seqs=config.max_num_seqs, model_len=model_len, dtype=dtype,
        budget=budget_bytes(config.kv_cache_memory, device), explicit=config.max_model_len is not None,
    )  # fmt: skip
    return KVCache(layout, blocks, config.kv_block_size, max_len=max_len, dtype=dtype, device=device)


def _max_model_len(hf_config, config: EmbeddedRolloutConfig) -> int:
    """`rollout.max_model_len`, else the model's max_position_embeddings; refusing one longer than the model's."""
    positions = getattr(hf_config, "max_position_embeddings", None)
    max_model_len = config.max_model_len or positions
    if max_model_len is None:
        raise ValueError(f"{hf_config.model_type}: the config has no max_position_embeddings; set rollout.max_model_len")
    if positions is not None and max_model_len > positions:
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's max_position_embeddings {positions}")
    return max_model_len
