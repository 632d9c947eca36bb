"""FP8 weights for the embedded engine: float8_e4m3fn matrices with one scale per output channel.

A quantized matrix keeps `w ≈ qweight * scale[:, None]`, the scale chosen so each row's largest
magnitude lands on e4m3's largest finite value (448). `linear` multiplies with `torch._scaled_mm`
(activations quantized per token on the fly, row-wise scales on both sides) where the device
supports it, and otherwise dequantizes the matrix for that one product: memory stays at one byte a
weight either way. Only the engine's copy is quantized; the learner trains in full precision, so
rollout and learner log-probs differ a little (measured by `asyncrl bench engine`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
ALIGN = 16
"""`_scaled_mm` on GPUs needs both matrix widths to be multiples of 16. Input widths must already be
(padding them would copy every activation); output rows are padded with zeros and sliced off."""


class Fp8Error(ValueError):
    """A model that cannot run with FP8 weights (raised when the engine starts or loads weights)."""


@dataclass(frozen=True)
class Fp8Weight:
    qweight: torch.Tensor  # [N_padded, K] float8_e4m3fn
    scale: torch.Tensor  # [1, N_padded] float32 (the shape `_scaled_mm` takes for row-wise scales)
    out_features: int

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        w = self.qweight.to(torch.float32) * self.scale.t()
        return w[: self.out_features].to(dtype)

    @property
    def nbytes(self) -> int:
        return self.qweight[: self.out_features].nbytes + self.scale[:, : self.out_features].nbytes


def quantize(name: str, weight: torch.Tensor) -> Fp8Weight:
    """Per-output-channel FP8 of a [N, K] matrix; `name` is for the error message."""
    if weight.dim() != 2:
        raise Fp8Error(f"rollout.fp8: {name} is not a matrix (shape {tuple(weight.shape)})")
    out_features, in_features = weight.shape
    if in_features % ALIGN:
        raise Fp8Error(
            f"rollout.fp8: {name} has input width {in_features}, not a multiple of {ALIGN}, "
            "so it cannot be quantized for torch._scaled_mm; run this model without rollout.fp8"
        )
    w = weight.detach().float()
    if not torch.isfinite(w).all():
        raise Fp8Error(f"rollout.fp8: {name} holds non-finite values and cannot be quantized")
    pad = -out_features % ALIGN
    if pad:
        w = torch.cat([w, w.new_zeros(pad, in_features)])
    # An all-zero row keeps scale 1 (any scale gives zeros; 0 would divide by zero).
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    qweight = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return Fp8Weight(qweight.contiguous(), scale[None, :].contiguous(), out_features)


def quantize_weights(weights: dict, keys: frozenset[str], prefix: str = "") -> None:
    """Replace, in place, every matrix under `keys` in a (nested) weight dict by its `Fp8Weight`.

    A 3D tensor under such a key is a stack of experts and becomes a list of quantized matrices.
    """
    for key, value in weights.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            quantize_weights(value, keys, name + ".")
        elif isinstance(value, list) and value and isinstance(value[0], dict):
            for i, item in enumerate(value):
                quantize_weights(item, keys, f"{name}.{i}.")
        elif key in keys and isinstance(value, torch.Tensor):
            if value.dim() == 3:
                weights[key] = [quantize(f"{name}.{e}", w) for e, w in enumerate(value)]
            else:
                weights[key] = quantize(name, value)


@cache
def scaled_mm_supported(device_type: str, dtype: torch.dtype) -> bool:
    """Whether `torch._scaled_mm` with row-wise scales runs here, producing `dtype` (probed once)."""
    device = torch.device(device_type)
    try:
        a = torch.ones(ALIGN, ALIGN, device=device).to(FP8)
        b = torch.ones(ALIGN, ALIGN, device=device).to(FP8)
        ones_a = torch.ones(ALIGN, 1, device=device)
        out = torch._scaled_mm(a, b.t(), scale_a=ones_a, scale_b=ones_a.t().contiguous(), out_dtype=dtype)
        return bool(torch.allclose(out.float(), torch.full_like(out.float(), ALIGN)))
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` for a plain tensor or an `Fp8Weight`."""
    if not isinstance(weight, Fp8Weight):
        return F.linear(x, weight, bias)
    shape = x.shape
    if not scaled_mm_supported(x.device.type, x.dtype):
        return F.linear(x, weight.dequantize(x.dtype), bias)
    flat = x.reshape(-1, shape[-1]).float()
    amax = flat.abs().amax(dim=1, keepdim=True)
    x_scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    xq = (flat / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    out = torch._scaled_mm(xq, weight.qweight.t(), scale_a=x_scale, scale_b=weight.scale, out_dtype=x.dtype)
    out = out[:, : weight.out_features]
    if bias is not None:
        out = out + bias
    return out.reshape(*shape[:-1], weight.out_features)


def weight_bytes(weights, *, float_bytes: int = 2, skip: frozenset[str] = frozenset()) -> int:
    """Bytes of a (nested) weight dict, counting full-precision tensors at `float_bytes` each (bf16: 2).

    Keys in `skip` (constants derived from the weights, not weights) are left out.
    """
    if isinstance(weights, Fp8Weight):
        return weights.nbytes
    if isinstance(weights, torch.Tensor):
        return weights.numel() * float_bytes
    if isinstance(weights, dict):
        return sum(weight_bytes(v, float_bytes=float_bytes, skip=skip) for k, v in weights.items() if k not in skip)
    if isinstance(weights, (list, tuple)):
        return sum(weight_bytes(v, float_bytes=float_bytes, skip=skip) for v in weights)
    return 0
