"""How many KV blocks the embedded engine's paged cache holds within `rollout.kv_cache_memory`.

The cache is paged (`rollout/kv_cache.py`): memory goes to positions requests actually hold, in blocks of
`rollout.kv_block_size`, not to every slot's worst case. The budget decides how many blocks there are, up
to twice what `rollout.max_num_seqs` requests at the full model length could ever need; no request can be
longer than all the blocks, so the engine's max_model_len is at most that. With `rollout.max_model_len`
unset the engine takes the model's own context, cut to the cache; set, a length the cache cannot hold is
refused with the numbers and the settings that change them. A request that does not fit the engine's
length is refused when it arrives (`rollout/intake.py`), naming both settings.
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
CACHE_SHARE = 2
"""The cache never takes more than this times what every running request at full length needs: the rest
keeps finished requests' blocks for reuse (a rollout's next turn), as much again."""
"""A cache of fewer positions than this holds no useful request: refused instead."""


def bytes_per_position(layout: CacheLayout, dtype: torch.dtype) -> int:
    """Cache bytes one position of one sequence takes in every layer."""
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


def plan_blocks(
    layout: CacheLayout, *, block_size: int, max_num_seqs: int, model_len: int, dtype: torch.dtype, budget: int, explicit: bool
) -> tuple[int, int]:  # fmt: skip
    """(blocks, max_model_len): as many blocks as `budget` bytes hold (one of them the zero block), at most
    CACHE_SHARE x what `max_num_seqs` requests of `model_len` positions need; the length cut to what the blocks
    hold unless `explicit` (rollout.max_model_len was set), which is refused instead."""
    per_block = bytes_per_position(layout, dtype) * block_size
    wanted = CACHE_SHARE * max_num_seqs * -(-model_len // block_size) + 1
    blocks = min(wanted, budget // per_block)
    positions = (blocks - 1) * block_size
    over = f"rollout.kv_cache_memory's {budget / 1e9:.2f} GB holds {max(positions, 0)} positions"
    if positions < MIN_POSITIONS:
        raise ValueError(f"{over} ({per_block / block_size / 1e3:.1f} KB each), fewer than {MIN_POSITIONS}: raise rollout.kv_cache_memory")
    if explicit and positions < model_len:
        raise ValueError(
            f"rollout.max_model_len={model_len} does not fit: {over}; lower rollout.max_model_len or raise rollout.kv_cache_memory"
        )
    max_len = min(model_len, positions // ALIGN * ALIGN)
    if max_len < model_len:
        log.warning(
            "KV cache: %s, fewer than the model's %d: max_model_len is %d (set rollout.max_model_len or rollout.kv_cache_memory to choose)",
            over, model_len, max_len,
        )  # fmt: skip
    log.info(
        "KV cache: %d blocks of %d positions (%d tokens, %.2f GB of rollout.kv_cache_memory's %.2f GB), max_model_len %d",
        blocks, block_size, positions, blocks * per_block / 1e9, budget / 1e9, max_len,
    )  # fmt: skip
    return blocks, max_len
