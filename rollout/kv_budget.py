"""How long a sequence the embedded engine's KV cache can hold within `rollout.kv_cache_memory`.

The cache is dense (`rollout/kv_cache.py`): every slot holds `max_len` positions of every layer, so its
size is slots x max_len x (bytes per position). A real model's own context (SmolLM2: 8,192 positions,
46 KB a position in fp32) times 128 slots is 48 GB, which the kernel's OOM killer answered with no
message. So the budget decides: with `rollout.max_model_len` unset, the cache holds as many positions as
fit (at most the model's); set, a cache that does not fit is refused with the numbers and the settings
that change them. A request that does not fit the engine's length is refused when it arrives
(`rollout/intake.py`), naming `rollout.max_model_len`.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from .kv_cache import CacheLayout

log = logging.getLogger(__name__)

ALIGN = 16
"""Positions are granted in multiples of this (attention kernels like aligned lengths)."""
MIN_POSITIONS = 64
"""Fewer positions per slot than this hold no useful request: refused instead."""


def bytes_per_position(layout: CacheLayout, dtype: torch.dtype) -> int:
    """Cache bytes one position of one slot takes in every layer."""
    return sum(heads * dim for spec in layout for heads, dim in spec.values()) * torch.empty((), dtype=dtype).element_size()


def available_memory(device: torch.device) -> int:
    """Bytes free now: the GPU's free memory, or on CPU the kernel's MemAvailable, bounded by this
    process's cgroup limit (a container sees the host's memory in /proc/meminfo)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        limit, used = (Path("/sys/fs/cgroup") / "memory.max").read_text().strip(), (Path("/sys/fs/cgroup") / "memory.current").read_text()
        if limit != "max":
            available = min(available, int(limit) - int(used))
    except (OSError, ValueError):
        pass
    return available


def budget_bytes(setting: float, device: torch.device) -> int:
    """`rollout.kv_cache_memory`: at most 1 is a fraction of the memory available now, above 1 bytes."""
    return int(setting * available_memory(device)) if setting <= 1 else int(setting)


def fit_max_len(
    layout: CacheLayout, num_slots: int, model_len: int, *, dtype: torch.dtype, budget: int, explicit: bool
) -> int:  # fmt: skip
    """Positions per slot: `model_len` when the cache fits `budget` bytes; else, unless `explicit`
    (rollout.max_model_len was set, and is refused), the most that fit."""
    per_position = bytes_per_position(layout, dtype) * num_slots
    fits = budget // per_position
    if fits >= model_len:
        return model_len
    need = f"{num_slots} slots (rollout.max_num_seqs + rollout.retained_prefixes) x {{}} positions need {{:.2f}} GB of KV cache"
    over = f"above rollout.kv_cache_memory's {budget / 1e9:.2f} GB"
    if explicit:
        raise ValueError(
            f"{need.format(model_len, per_position * model_len / 1e9)} (rollout.max_model_len={model_len}), {over}: "
            "lower rollout.max_model_len or the slots, or raise rollout.kv_cache_memory"
        )
    granted = fits // ALIGN * ALIGN
    if granted < MIN_POSITIONS:
        raise ValueError(
            f"{need.format(MIN_POSITIONS, per_position * MIN_POSITIONS / 1e9)} at least, {over}: "
            "lower rollout.max_num_seqs or rollout.retained_prefixes, or raise rollout.kv_cache_memory"
        )
    log.warning(
        "KV cache: %d slots x %d positions (%.2f GB of rollout.kv_cache_memory's %.2f GB); the model supports %d: "
        "set rollout.max_model_len or rollout.kv_cache_memory to choose",
        num_slots, granted, per_position * granted / 1e9, budget / 1e9, model_len,
    )  # fmt: skip
    return granted
